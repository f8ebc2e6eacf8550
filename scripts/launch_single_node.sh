#!/usr/bin/env bash
# One machine, all its GPUs: torchrun starts one DDP process per GPU. Without a GPU it
# starts 2 processes on the CPU (gloo), enough to see the whole thing work on a laptop
# (a Mac's GPU too: no backend moves MPS tensors between processes).
#
#   bash scripts/launch_single_node.sh                        # the settings below
#   bash scripts/launch_single_node.sh --epochs 1 --lr 0.2    # extra flags go to the script
#   SCRIPT=distributed_gradient_accumulation.py bash scripts/launch_single_node.sh --accum-steps 4
#
# Flags given on the command line come after SCRIPT_ARGS, so they win (argparse keeps
# the last value). Run it again after an interruption and it continues the run: --resume
# picks up --checkpoint-dir/checkpoint.pt, or starts fresh when there is none yet.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository: relative paths, in flags too, are read from here

# --- edit here -------------------------------------------------------------------------
SCRIPT=${SCRIPT:-distributed.py}   # a script that torchrun launches (not distributed_mp.py)
NPROC=${NPROC:-auto}               # processes; auto = one per visible GPU, or 2 on the CPU
MAX_RESTARTS=${MAX_RESTARTS:-0}    # restart every worker up to N times after a crash
SCRIPT_ARGS=(--batch-size 128 --epochs 200 --checkpoint-dir checkpoints/single_node
             --checkpoint-every 1000 --resume)   # --batch-size is the GLOBAL batch
# ---------------------------------------------------------------------------------------

# The repository's virtual environment (make venv) when there is one.
PYTHON=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}

# The one training flag this script reads itself: --device cpu (in SCRIPT_ARGS or the extra flags)
# trains on the CPU even where there are GPUs, so auto counts CPU processes then, not GPUs.
device=auto
args=("${SCRIPT_ARGS[@]}" "$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --device=*) device=${args[i]#--device=} ;;
    --device) device=${args[i + 1]-} ;;
  esac
done

if [ "$NPROC" = auto ]; then
  if [ "$device" = cpu ]; then
    NPROC=0
  else
    # The GPUs that --device auto trains on (torch.accelerator: NVIDIA, AMD, Intel).
    NPROC=$("$PYTHON" -c "import torch; a = torch.accelerator.current_accelerator(check_available=True)
print(torch.accelerator.device_count() if a is not None and a.type != 'mps' else 0)")
  fi
  if [ "$NPROC" -eq 0 ]; then
    NPROC=2
    echo "$([ "$device" = cpu ] && echo "--device cpu" || echo "no GPU found"): $NPROC processes on the CPU (gloo)"
    SCRIPT_ARGS+=(--device cpu)  # not auto, which would take a Mac's GPU
  fi
fi

# torchrun (torch 2.5 and later) lends its own rendezvous store to the workers and keeps
# it across restarts: a restarted rank can then read a peer's address from the attempt
# before and fail to connect (pytorch/pytorch#135712). This gives each attempt a new store.
# The price: its port (MASTER_PORT) is one the agent found free and let go (torch's
# get_free_port, from the ephemeral range), which rank 0 binds seconds later; an outgoing
# connection may take it in between (rarely: the attempt then fails, address in use).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# --standalone: a private rendezvous on a free local port, so two jobs on one machine
# never collide. `python -m torch.distributed.run` is `torchrun`, run by this Python.
set -x
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
  --max-restarts="$MAX_RESTARTS" "$SCRIPT" "${SCRIPT_ARGS[@]}" "$@"
