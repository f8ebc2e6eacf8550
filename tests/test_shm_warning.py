"""The warning before training when the shared-memory folder is smaller than what the
loader workers may hold there: the estimate (utils/data.py shm_estimate), one warning
per node before the first step, and a run that trains on. The small folder is a real
1 MiB tmpfs, mounted by the test (root only); the scripts run through SHM_RUNNER, which points
the check at it (the workers themselves use /dev/shm)."""
import argparse
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, SMALL, subprocess_env, torchrun
from utils import data
from utils.distributed import DistEnv

SAMPLE_BYTES = 3 * 32 * 32 + 8  # a uint8 CIFAR image (normalised later, on the device) and its int64 label
# Per-process batch 128, evaluation 256: their uint8 samples need more than the 1 MiB folder holds.
RUN = ["distributed.py", *SMALL, "--batch-size", "128", "--workers", "1", "--max-steps", "2"]


def cpu_env(rank=0, world_size=1):
    return DistEnv(rank, rank, world_size, world_size, torch.device("cpu"), world_size > 1)


def data_args(workers):
    return argparse.Namespace(dataset="synthetic", train_samples=64, test_samples=40, seed=0, workers=workers)


def loaders(workers, env, per_device_batch=8):
    """The loaders of a script, built as the scripts build them (evaluation with twice the batch)."""
    args = data_args(workers)
    train_set, test_set = data.build_datasets(args, env)
    return (data.train_loader(train_set, per_device_batch, per_device_batch * env.world_size, env, args),
            data.eval_loader(test_set, 2 * per_device_batch, env, args))


@pytest.fixture
def small_shm(tmp_path):
    folder = tmp_path / "shm"
    folder.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (root only): {mount.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


# `python SHM_RUNNER FOLDER SCRIPT ARGS...`: SCRIPT as the program, its shared-memory check on FOLDER.
SHM_RUNNER = """
import runpy, sys
sys.path.insert(0, {root!r})
from utils import lifecycle
lifecycle.SHM_DIR = sys.argv[1]
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def shm_runner(tmp_path_factory):
    runner = tmp_path_factory.mktemp("runner") / "shm_runner.py"
    runner.write_text(SHM_RUNNER.format(root=str(ROOT)))
    return runner


def run_in_order(argv, shm_dir, runner):
    """`python argv`, checking shm_dir: exit status 0, stdout and stderr in the order written."""
    proc = subprocess.run([sys.executable, runner, shm_dir, *map(str, argv)], cwd=ROOT, env=subprocess_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


# --- the estimate ----------------------------------------------------------------------

def test_estimate_is_workers_x_prefetch_x_batch_bytes_x_processes_of_both_loaders():
    env = cpu_env(world_size=3)
    # What the loader really yields, measured from a batch: float32 images, int64 labels.
    batch = next(iter(loaders(0, env)[0]))
    images, labels = batch
    assert images.nbytes + labels.nbytes == 8 * SAMPLE_BYTES, (images.dtype, labels.dtype)
    assert data.batch_sample_bytes(batch) == SAMPLE_BYTES

    need, formula = data.shm_estimate(loaders(2, env), env.local_world_size, SAMPLE_BYTES)
    assert need == (2 * 2 * 8 * SAMPLE_BYTES + 2 * 2 * 16 * SAMPLE_BYTES) * 3
    assert formula == (f"(training 2 workers x 2 prefetched batches x 8 samples x {SAMPLE_BYTES:,} B + "
                       f"evaluation 2 workers x 2 prefetched batches x 16 samples x {SAMPLE_BYTES:,} B) "
                       "x 3 processes on this node")
    assert data.shm_estimate(loaders(0, env), 3, SAMPLE_BYTES)[0] == 0  # nothing goes through shared memory


class OwnData(torch.utils.data.Dataset):
    """A user's data set of other shapes and types, that must be read in the loader
    workers only (as an HDF5 file opened on first access must)."""

    def __init__(self, training_process):
        self.training_process = training_process

    def __len__(self):
        return 20

    def __getitem__(self, index):
        assert os.getpid() != self.training_process, "a sample was loaded in the training process"
        return torch.rand(5, 7, dtype=torch.float64), {"label": index, "weight": torch.ones(2)}


def test_estimate_measures_a_batch_of_any_data_set_loaded_by_a_worker(monkeypatch, capsys):
    monkeypatch.setattr(data, "shm_free_bytes", lambda path: 2**10)
    env, args = cpu_env(), data_args(1)
    loader = data.train_loader(OwnData(os.getpid()), 4, 4, env, args)
    loader.sampler.set_epoch(0)
    batch = next(iter(loader))  # the check ran on it, without loading a sample here
    per_sample = 5 * 7 * 8 + 8 + 2 * 4  # float64 input, int64 label, two float32 weights
    assert data.batch_sample_bytes(batch) == per_sample
    assert f"4 samples x {per_sample:,} B" in capsys.readouterr().err


# --- when the warning is given -----------------------------------------------------------

def test_one_warning_for_all_the_loaders_of_a_run_on_local_rank_0_only(monkeypatch, capsys):
    monkeypatch.setattr(data, "shm_free_bytes", lambda path: 2**10)
    for rank in (1, 0):  # two processes of one node, each with its own loaders
        train, test = loaders(1, cpu_env(rank, world_size=2))
        for epoch in range(2):
            train.sampler.set_epoch(epoch)
            next(iter(train))  # an epoch cut short: its prefetched batches stay
            list(test)
    err = capsys.readouterr().err
    need = (1 * 2 * 8 + 1 * 2 * 16) * SAMPLE_BYTES * 2
    assert err.count("warning:") == 1, err
    assert f"less than the {need / 2**20:,.1f} MiB" in err and "x 2 processes on this node" in err, err


def test_a_run_with_too_little_shared_memory_warns_once_before_training_and_trains_on(small_shm, shm_runner):
    out = run_in_order(RUN, small_shm, shm_runner)
    warnings = [line for line in out.splitlines() if "warning:" in line]
    assert len(warnings) == 1, out
    need = (1 * 2 * 128 + 1 * 2 * 256) * SAMPLE_BYTES
    assert warnings[0] == (
        f"distributed.py: warning: {small_shm} has 1.0 MiB free, less than the {need / 2**20:,.1f} MiB that "
        "the DataLoader workers of this node may hold there at once: (training 1 worker x 2 prefetched batches "
        f"x 128 samples x {SAMPLE_BYTES:,} B + evaluation 1 worker x 2 prefetched batches x 256 samples x "
        f"{SAMPLE_BYTES:,} B) x 1 process on this node. A worker that finds it full dies of a bus error. "
        "In Docker: docker run --ipc=host (or --shm-size=1g); otherwise lower --workers or --batch-size. "
        "Training goes on: the estimate is an upper bound, the run may still fit.")
    assert out.index("warning:") < out.index("epoch 1/1 step 2")
    assert "done: 2 steps" in out


@pytest.mark.parametrize("room, workers", [("enough", "1"), ("1 MiB", "0")])
def test_no_warning_with_room_enough_or_without_workers(room, workers, small_shm, tmp_path, shm_runner):
    out = run_in_order([*RUN, "--workers", workers], tmp_path if room == "enough" else small_shm, shm_runner)
    assert "warning:" not in out and "done: 2 steps" in out, out


def test_under_torchrun_one_warning_per_node_counting_both_processes(small_shm, shm_runner):
    proc = torchrun(2, shm_runner, [small_shm, *RUN])
    assert proc.stdout.count("warning:") + proc.stderr.count("warning:") == 1, proc.stderr
    need = (1 * 2 * 64 + 1 * 2 * 128) * SAMPLE_BYTES * 2  # per-process batch 64, evaluation 128
    assert f"less than the {need / 2**20:,.1f} MiB" in proc.stderr, proc.stderr
    assert "64 samples" in proc.stderr and "x 2 processes on this node" in proc.stderr, proc.stderr
    assert "done: 2 steps" in proc.stdout
