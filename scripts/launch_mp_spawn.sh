#!/usr/bin/env bash
# distributed_mp.py starts its own processes (torch.multiprocessing.spawn), one per GPU:
# no torchrun. Pick how they meet with MODE:
#
#   bash scripts/launch_mp_spawn.sh                         # MODE=single: this machine only
#   MODE=multi NODE_RANK=0 bash scripts/launch_mp_spawn.sh  # on node 0, then on node 1 with
#   MODE=multi NODE_RANK=1 bash scripts/launch_mp_spawn.sh  #   NODE_RANK=1 (TCP at HEAD:PORT)
#   MODE=file  NODE_RANK=0 JOB_ID=run7 bash scripts/launch_mp_spawn.sh  # the same, through
#                                   #   a file named for the job (a new JOB_ID for every job)
#
# Extra flags go to the script and win over SCRIPT_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository: relative paths, in flags too, are read from here

# --- edit here -------------------------------------------------------------------------
MODE=${MODE:-single}                # single | multi | file
NPROC_PER_NODE=${NPROC_PER_NODE:-}  # empty: one per visible GPU, or 2 on the CPU
NODES=${NODES:-2}                   # multi, file: nodes in the job
NODE_RANK=${NODE_RANK:-0}           # multi, file: 0 on the first node, 1 on the next, ...
HEAD=${HEAD:-node0.example.com}     # multi: node 0's address, reachable from every node
PORT=${PORT:-29500}                 # multi: a free TCP port on node 0
# file: a new id for every job, the same on every node. A requeued Slurm job keeps its id, so its
# restart count goes with it: the start before may have been killed, and left its file.
JOB_ID=${JOB_ID:-${SLURM_JOB_ID:+$SLURM_JOB_ID${SLURM_RESTART_COUNT:+.$SLURM_RESTART_COUNT}}}
RDZV_FILE=${RDZV_FILE:-${JOB_ID:+/shared/path/rdzv.$JOB_ID}}  # file: on a file system all nodes see
SCRIPT_ARGS=(--batch-size 128 --epochs 200 --checkpoint-dir checkpoints/mp_spawn
             --checkpoint-every 1000 --resume)   # --batch-size is the GLOBAL batch
# ---------------------------------------------------------------------------------------

PYTHON=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}

# One list that is never empty: bash before 4.4 (RHEL/CentOS 7) calls an empty array
# unbound under `set -u`, so "${empty[@]}" would end the launcher there.
args=(distributed_mp.py)
if [ -n "$NPROC_PER_NODE" ]; then args+=(--nproc-per-node "$NPROC_PER_NODE"); fi

case "$MODE" in
  single)
    # One node: the processes meet at a free port on 127.0.0.1.
    ;;
  multi)
    # Node 0's first process hosts the rendezvous (a TCP store) at HEAD:PORT; every
    # process of every node connects to it. Ranks: node_rank * nproc_per_node + local rank.
    args+=(--nodes "$NODES" --node-rank "$NODE_RANK" --ip "$HEAD" --port "$PORT") ;;
  file)
    # No open port needed: the processes meet in a file on a shared file system (NFS,
    # Lustre). Node 0 removes it and its .refused (a node's refusal) once its processes ran; a
    # run killed outright leaves them, to mix two runs or end the next: hence a name per job.
    if [ -z "$RDZV_FILE" ]; then
      echo "MODE=file needs JOB_ID (or RDZV_FILE): a new name for every job, the same on every node" >&2
      exit 2
    fi
    args+=(--nodes "$NODES" --node-rank "$NODE_RANK" --init-method "file://$RDZV_FILE") ;;
  *)
    echo "MODE must be single, multi or file, not '$MODE'" >&2
    exit 2 ;;
esac

set -x
exec "$PYTHON" "${args[@]}" "${SCRIPT_ARGS[@]}" "$@"
