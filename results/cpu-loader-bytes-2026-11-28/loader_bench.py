"""The training loader's throughput as the scripts build it (data.train_loader), data only, no model;
the batch is made the model's input on the CPU as the loop does (data.model_inputs, where it exists).

usage: python loader_bench.py REPO WORKERS DATASET  (DATASET: synthetic, or cifar100 from /tmp/cifarbench)
prints the images/s of the third of three epochs over 8,192 samples in batches of 512."""
import argparse
import sys
import time

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402

from utils import data  # noqa: E402
from utils.distributed import DistEnv  # noqa: E402

torch.set_num_threads(1)
args = argparse.Namespace(dataset=sys.argv[3], data_dir="/tmp/cifarbench", train_samples=8192, test_samples=16,
                          seed=0, workers=int(sys.argv[2]), data_on_gpu=False)
env = DistEnv(0, 0, 1, 1, torch.device("cpu"), distributed=False)
train_set, _ = data.build_datasets(args, env)
loader = data.train_loader(train_set, 512, 512, env, args)
to_model = data.model_inputs(train_set, env.device) if hasattr(data, "model_inputs") else (lambda x: x)
for epoch in range(3):
    loader.sampler.set_epoch(epoch)
    start, count = time.perf_counter(), 0
    for images, targets in loader:
        count += len(to_model(images))
    rate = count / (time.perf_counter() - start)
print(f"{rate:.0f}")
