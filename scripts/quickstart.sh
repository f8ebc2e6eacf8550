#!/usr/bin/env bash
# The main job, bounded: ResNet-18 with DDP (torchrun) on every local GPU, or on
# 2 CPU processes when there is none. CIFAR-100 when it can be downloaded to
# ./data, otherwise the synthetic stand-in. Run it through `make train`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

# is_available, not device_count alone: device_count counts through NVML, so it sees GPUs that a driver
# too old for this CUDA build cannot run, and the scripts would then train on the CPU with the GPU plan.
gpus=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -gt 0 ]; then
  nproc=$gpus
  # About a minute per epoch-set on one modern GPU; real CIFAR-100 learns visibly in 10 epochs.
  budget=(--epochs 10 --batch-size $((128 * gpus)))
else
  nproc=2
  export OMP_NUM_THREADS=1
  # 2 CPU cores: 60 steps of 64 images and 1,000 test images end in a few minutes. --device cpu: on a
  # Mac, the default would pick Apple's MPS device, which DDP cannot use.
  budget=(--device cpu --epochs 1 --train-samples 3840 --test-samples 1000 --batch-size 64 --warmup-epochs 0.1
          --workers 1)
fi

# Bounded: torchvision's download has no timeout of its own (urlopen), and a stalled one would wait forever.
# --foreground: in this process group, where a Ctrl-C reaches it (timeout otherwise makes its own).
echo "CIFAR-100 in ./data: downloaded once (about 170 MB), 10 minutes at most; else synthetic data"
status=0
timeout --foreground 600 $PY -c "import torchvision; torchvision.datasets.CIFAR100('./data', train=True, download=True); torchvision.datasets.CIFAR100('./data', train=False, download=True)" >/dev/null 2>&1 || status=$?
if [ "$status" -gt 128 ]; then exit "$status"; fi  # stopped (Ctrl-C: 130), not failed; 124: timed out
if [ "$status" = 0 ]; then
  dataset=(--dataset cifar100 --data-dir ./data)
else
  echo "CIFAR-100 could not be downloaded to ./data (no network, or too slow): training on --dataset synthetic instead."
  dataset=(--dataset synthetic)
fi

# A demo: each `make train` starts afresh (the scripts refuse to overwrite a checkpoint
# they were not told to --resume).
rm -rf runs/quickstart runs/quickstart.jsonl
mkdir -p runs
set -x
# exec: a stop signal to this script (make passes SIGTERM to it) reaches torchrun, which stops its workers.
exec $PY -m torch.distributed.run --standalone --nproc_per_node="$nproc" distributed.py \
  "${dataset[@]}" "${budget[@]}" --metrics runs/quickstart.jsonl --checkpoint-dir runs/quickstart
