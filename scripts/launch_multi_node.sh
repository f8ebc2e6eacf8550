#!/usr/bin/env bash
# Several machines: run this SAME command on every node (by hand, pdsh, or your scheduler).
# Each node's torchrun starts one DDP process per GPU, then all of them meet at a c10d
# rendezvous hosted by the torchrun on the node named in RDZV_HOST ("node 0").
#
#   node0$ bash scripts/launch_multi_node.sh
#   node1$ bash scripts/launch_multi_node.sh            # same command, same settings
#   node1$ RDZV_HOST=10.0.0.1 bash scripts/launch_multi_node.sh --epochs 10   # overrides
#
# No --node_rank: the c10d rendezvous numbers the nodes itself, sorting them by address
# (torchrun ignores --node_rank with it). Global rank 0, the process that prints and writes
# the checkpoint, can therefore land on any node, and after a restart on another one:
# --checkpoint-dir must be on a file system that every node sees.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository: relative paths, in flags too, are read from here

# --- edit here -------------------------------------------------------------------------
NNODES=${NNODES:-2}                 # nodes; MIN:MAX (e.g. 2:4) makes the job elastic
NPROC_PER_NODE=${NPROC_PER_NODE:-8} # GPUs per node
RDZV_HOST=${RDZV_HOST:-node0.example.com}  # node 0's address (the "master"), reachable from all
RDZV_PORT=${RDZV_PORT:-29500}       # a free TCP port on node 0
JOB_ID=${JOB_ID:-cifar100-ddp}      # the same on every node; a new one for a new job
MAX_RESTARTS=${MAX_RESTARTS:-3}     # after a crash, every node restarts its workers, up to N times
SCRIPT=${SCRIPT:-distributed.py}    # a script of yours must take --check-args too (below)
SCRIPT_ARGS=(--batch-size 1024 --epochs 200 --checkpoint-dir checkpoints/multi_node
             --checkpoint-every 500 --resume)   # --batch-size is the GLOBAL batch
# ---------------------------------------------------------------------------------------

PYTHON=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}

# --rdzv-backend=c10d: the torchrun on RDZV_HOST serves the rendezvous; the others connect
# to it, agree on ranks, then the workers find each other through it.
# --rdzv-id names the job, so two jobs using one host and port do not mix.
# --max-restarts: when a worker dies, every torchrun stops its workers and starts them
# again; the new workers resume from --checkpoint-dir by themselves.
# scripts/torchrun_bounded.py is torchrun, plus what this node decides for itself: whether it
# hosts the rendezvous (RDZV_HOST's name may resolve to 127.0.1.1 here, and torchrun would
# not know itself), its --local_addr (RDZV_HOST itself on the node it names, as every node
# reaches it; elsewhere its address toward RDZV_HOST; node rank 0's becomes every rank's
# MASTER_ADDR), gloo's interface toward RDZV_HOST, and an end to the wait for a store it cannot
# reach once its workers are gone (a partition). NCCL chooses its own interfaces.
job=(scripts/torchrun_bounded.py --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE"
     --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv-id="$JOB_ID"
     --max-restarts="$MAX_RESTARTS" "$SCRIPT" "${SCRIPT_ARGS[@]}" "$@")
# Bad arguments end here in one line: torchrun would restart the workers that refuse them
# MAX_RESTARTS times. The check runs as the first process of this node would, in its settings.
"$PYTHON" "${job[@]}" --check-args >/dev/null || exit  # its status: 2 refused, 130 Ctrl-C
set -x
exec "$PYTHON" "${job[@]}"
