"""DESIGN: "Timing excludes warm-up and never adds barriers or .item() calls to the hot loop." The training
steps of a real run, after the first, make no device sync and no collective of their own (the points where the
design lets the ranks meet and the host read the device are the epoch's end, checkpoints and evaluation, all
outside the steps watched here; the stop-signal agreement every 10 steps is a store call on the host, also left
out of the window), with clipping and autocast too, and EpochTimer leaves the warm-up steps out of images/s."""
import collections
import os
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import SMALL, expect_ok, free_port
from utils import lifecycle, metrics
from utils.run import TrainingRun


# What makes the host wait for the device (a value read back, a sync), and the collectives a script could call
# from Python (torch.distributed's and distributed_c10d's names, the same functions).
SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu", "nonzero")
DEVICE_SYNCS = ((torch, "equal"), (torch.cuda, "synchronize"), (torch.accelerator, "synchronize"))
COLLECTIVES = ("barrier", "monitored_barrier", "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor", "broadcast_object_list", "all_gather_object", "reduce", "gather", "scatter",
               "reduce_scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
               "batch_isend_irecv", "gather_object", "scatter_object_list")
# A process group of one, as torchrun starts it (MASTER_PORT added): DDP and the group's collectives are real.
TORCHRUN_OF_ONE = {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1"}
# The loader's own work (sampling, a sample's augmentation): in its worker processes as users run it (--workers),
# here in this process (--workers 0) and not the training step's.
LOADER = os.path.join("torch", "utils", "data", "")


@pytest.mark.parametrize("script, launch, extra", [
    ("distributed.py", "torchrun", []),
    ("distributed.py", "torchrun", ["--workers", "2"]),  # loader workers on, as by default
    ("distributed.py", "python", []),
    ("distributed_gradient_accumulation.py", "torchrun", ["--accum-steps", "2"]),
    ("dataparallel.py", "python", []),
    ("distributed.py", "torchrun", ["--clip-grad-norm", "0.5"]),  # the global norm stays on the device
    ("distributed_apex.py", "torchrun", ["--amp", "bf16"]),
])
def test_the_training_steps_make_no_sync_and_no_collective(run_in_process, monkeypatch, script, launch, extra):
    watching = [False]
    inside, outside = [], collections.Counter()

    def spy(owner, name):
        original = getattr(owner, name)

        def spied(*args, **kwargs):
            if not watching[0]:
                outside[name] += 1
            else:
                stack = traceback.extract_stack()[:-1]
                if not any(LOADER in frame.filename for frame in stack):
                    inside.append(f"{name} from " + " < ".join(f"{os.path.relpath(f.filename)}:{f.lineno}"
                                                              for f in reversed(stack[-4:])))
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, spied)

    for name in SYNCS:
        spy(torch.Tensor, name)
    for owner, name in DEVICE_SYNCS:
        spy(owner, name)
    for name in COLLECTIVES:
        spy(dist, name)
        spy(dist.distributed_c10d, name)

    # The window: from the end of the first step to the end of the last (step_done returning True), before the
    # script's evaluation and end_epoch. No checkpoint is due in it (no --checkpoint-dir), no epoch ends (16 steps
    # an epoch, 8 taken), and under torchrun the stop-signal agreement (every 10 steps) is not reached.
    steps_watched = []
    step_done = TrainingRun.step_done

    def watched_step_done(self):
        if watching[0]:
            steps_watched.append(self.global_step + 1)
        ends = step_done(self)
        watching[0] = not ends
        return ends
    monkeypatch.setattr(TrainingRun, "step_done", watched_step_done)
    monkeypatch.setattr(lifecycle, "watch_launcher", lambda *a, **k: None)  # no launcher to watch in here
    env = dict(TORCHRUN_OF_ONE, MASTER_PORT=free_port()) if launch == "torchrun" else {}
    max_steps = 8
    expect_ok(run_in_process(script, [*SMALL, "--train-samples", "512", "--max-steps", max_steps, *extra], **env))

    assert steps_watched == list(range(2, max_steps + 1))  # the window held the training steps after the first
    assert inside == [], "\n".join(inside)
    # The spies were live: outside the window, the evaluation's exact sums are read back (and all-reduced, with its
    # buffers broadcast, in a process group).
    assert outside["tolist"] > 0, outside
    if launch == "torchrun":
        assert outside["all_reduce"] > 0 and outside["broadcast"] > 0, outside


# --- EpochTimer ----------------------------------------------------------------------------------

class Clock:
    """time.perf_counter as EpochTimer reads it, moved on by the test; counts its reads."""

    def __init__(self):
        self.now, self.reads = 1000.0, 0

    def perf_counter(self):
        self.reads += 1
        return self.now


@pytest.mark.parametrize("steps", [8, 40, 60])
def test_images_per_second_leaves_out_the_warm_up_steps(monkeypatch, steps):
    clock = Clock()
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    images_per_step = 96
    timer = metrics.EpochTimer(torch.device("cpu"), images_per_step, steps)
    warmup = timer.warmup_steps
    assert 0 < warmup < steps
    # Slow warm-up steps (loader start, autotuning, compilation), then steps of varying length.
    durations = [30.0 + i for i in range(warmup)] + [0.5 + 0.01 * (i % 7) for i in range(steps - warmup)]
    for seconds in durations:
        clock.now += seconds
        timer.step()
    timing = timer.stop()

    after_warmup = sum(durations[warmup:])
    assert timing["epoch_seconds"] == pytest.approx(sum(durations))
    assert timing["images_per_second"] == pytest.approx((steps - warmup) * images_per_step / after_warmup)
    # The clock is read at the start, at the warm-up boundary and at the end: never in the other steps.
    assert clock.reads == 3


def test_an_epoch_no_longer_than_its_warm_up_is_timed_whole(monkeypatch):
    # A resumed epoch with few steps left: EpochTimer(steps=...) is the steps still to run.
    clock = Clock()
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    timer = metrics.EpochTimer(torch.device("cpu"), 32, 40)  # 10 warm-up steps; the run stops after 6
    durations = [2.0, 1.0, 1.5, 0.5, 0.25, 0.75]
    for seconds in durations:
        clock.now += seconds
        timer.step()
    timing = timer.stop()
    assert timing["images_per_second"] == pytest.approx(len(durations) * 32 / sum(durations))
    assert timing["epoch_seconds"] == pytest.approx(sum(durations))
