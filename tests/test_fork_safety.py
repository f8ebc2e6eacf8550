"""Loader workers are forked before the run's first collective, with our CIFAR reader too (its
agreements on the data go through the job's store, not the process group).

After a collective returns, a thread of the process group may still hold the tensor it
carried; when it lets go, PyTorch takes the GIL from that thread (c10/util/intrusive_ptr.h:
the last C++ reference but Python's drops the Python object, TensorImpl::decref_pyobject),
and the thread gets a Python thread state for it. A fork at that instant, on Python before
3.11.10 (CPython gh-112275), gives a child that waits forever on the interpreter's
thread-state lock in PyOS_AfterFork_Child: seen here as a loader worker that never started
and a rank waiting for its batch while its peers timed out in the next collective."""
import argparse
import multiprocessing
import time

import numpy as np
import pytest
import torch

from cifar_files import write_cifar100
from conftest import ROOT, run_script
from utils import data
from utils.distributed import DistEnv

# Counts every collective of this process and, before each fork, how many had run; prints
# both at exit. A module, so that a rank that mp.spawn starts (a new interpreter) can import it.
COUNTING = """
import atexit, os
import torch.distributed as dist
def count(rank):
    collectives, forks = [0], []
    def counted(call):
        def counting(*args, **kwargs):
            collectives[0] += 1
            return call(*args, **kwargs)
        return counting
    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list",
                 "reduce_scatter_tensor", "all_gather_into_tensor", "barrier", "_broadcast_coalesced"):
        if hasattr(dist, name):
            setattr(dist, name, counted(getattr(dist, name)))
    os.register_at_fork(before=lambda: forks.append(collectives[0]))
    # One write of the whole line: the two ranks share the pipe, and print() under
    # PYTHONUNBUFFERED writes the text and its newline apart, so that the other rank's line
    # could land in between.
    atexit.register(lambda: os.write(1, f"rank {rank}: {collectives[0]} collectives; "
                                        f"collectives before each fork: {forks}\\n".encode()))
def counted_worker(index, fn, *args):  # mp.spawn's worker, counted in its own process
    count(index)
    return fn(index, *args)
"""

# Runs a script with the collectives of each training process counted: under torchrun in
# this process; under mp.spawn in each process it starts.
COUNTING_RUNNER = """
import os, runpy, sys
import torch.multiprocessing as mp
import counting
if "RANK" in os.environ:
    counting.count(os.environ["RANK"])
spawn = mp.spawn
mp.spawn = lambda fn, args=(), **kwargs: spawn(counting.counted_worker, args=(fn, *args), **kwargs)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
"""

RUN = ["--dataset", "synthetic", "--model", "resnet_tiny", "--train-samples", "256", "--test-samples", "64",
       "--batch-size", "32", "--epochs", "1", "--workers", "2"]


@pytest.mark.parametrize("launch, dataset", [("torchrun", "synthetic"), ("mp.spawn", "synthetic"),
                                             ("torchrun", "cifar100")])
def test_every_loader_worker_is_forked_before_the_first_collective(tmp_path, launch, dataset):
    runner = tmp_path / "counting_runner.py"
    runner.write_text(COUNTING_RUNNER)
    (tmp_path / "counting.py").write_text(COUNTING)
    if launch == "torchrun":
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", runner, ROOT / "distributed.py"]
    else:  # the ranks' own start method is "spawn"; their loaders fork all the same (utils/data.py)
        args = [runner, ROOT / "distributed_mp.py", "--nproc-per-node", "2"]
    run = list(RUN)
    if dataset == "cifar100":  # the real reader, on files in the real format, written here
        rng = np.random.default_rng(0)
        write_cifar100(tmp_path / "data", rng.integers(0, 256, (256, 3, 32, 32)), rng.integers(0, 100, 256),
                       rng.integers(0, 256, (64, 3, 32, 32)), rng.integers(0, 100, 64))
        run[run.index("synthetic")] = "cifar100"
        run += ["--data-dir", tmp_path / "data"]
    proc = run_script([*args, *run, "--checkpoint-dir", tmp_path / "ckpt"], timeout=240)
    lines = [line for line in proc.stdout.splitlines() if "collectives before each fork" in line]
    assert len(lines) == 2, proc.stdout + proc.stderr
    for line in lines:
        # Two loaders (training, evaluation), two workers each; the run made collectives
        # (DDP's broadcast, the evaluation), none before a fork.
        assert "collectives before each fork: [0, 0, 0, 0]" in line, line
        assert int(line.split(": ")[1].split()[0]) > 0, line


class CountedSamples(torch.utils.data.Dataset):
    """64 samples that count every load, in whichever worker process loads them."""

    def __init__(self):
        self.loads = multiprocessing.get_context("fork").Value("i", 0)

    def __len__(self):
        return 64

    def __getitem__(self, index):
        with self.loads.get_lock():
            self.loads.value += 1
        return torch.zeros(3), 0


def test_forking_the_workers_early_loads_nothing_until_the_first_epoch():
    """The loaders fork their workers when built (above), through an iterator that DataLoader keeps for the
    first iter(), which discards whatever that iterator had prefetched: it must have prefetched nothing. Else
    each loader loads workers x prefetch_factor batches for nothing, and the evaluation loader's stay in
    shared and pinned memory until the first evaluation."""
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), False)
    args = argparse.Namespace(workers=2, seed=0)
    train, test = CountedSamples(), CountedSamples()
    loaders = [data.train_loader(train, 8, 8, env, args), data.eval_loader(test, 8, env, args)]
    assert all(loader._iterator is not None for loader in loaders)  # the workers are there
    # No batch was asked of them (DataLoader's count of requests sent), whenever they start; nor loaded since.
    assert [loader._iterator._send_idx for loader in loaders] == [0, 0]
    time.sleep(1.0)
    assert (train.loads.value, test.loads.value) == (0, 0)
    for epoch in range(2):
        loaders[0].sampler.set_epoch(epoch)
        assert sum(len(targets) for _, targets in loaders[0]) == 64 and train.loads.value == 64 * (epoch + 1)
    assert sum(len(targets) for _, targets in loaders[1]) == 64 and test.loads.value == 64
