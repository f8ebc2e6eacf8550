"""--profile and --tensorboard: looking inside a run beyond its metrics file.

--profile DIR: a torch.profiler trace of a few optimizer steps once the run is warm,
one file per rank, DIR/trace-rank{rank}.json. Open one in https://ui.perfetto.dev
(or chrome://tracing): each ProfilerStep#N is one optimizer step. DDP's gradient
hooks launch the all-reduces during the backward pass, and they run beside it (on a
CUDA stream of their own on GPUs, on gloo's threads on the CPU): that overlap is what
makes DDP fast. A run that ends inside the window still writes what it recorded; one
that ends before it says how many steps it needs.

--tensorboard DIR: the scalars of every epoch record (losses, accuracies, speed,
learning rate, peak memory, gradient norm) written by rank 0 for
`tensorboard --logdir DIR`, at the record's global step, flushed after each epoch so
that a live TensorBoard shows it. tensorboard stays an optional package: it is
imported only when the flag is given.

TrainingRun (utils/run.py) calls, on every rank:
    observers = Observers(args, env, start_step)   # start_step > 0 after a resume
    observers.step(global_step)                    # after every optimizer step
    observers.epoch(record)                        # after every epoch record
    observers.close()                              # at the end of the run or at a stop
None of these communicates with other ranks.
"""
import math
import os

import torch
from torch.profiler import ProfilerActivity

from .cli import UsageError

# The profiled window, in optimizer steps counted from the run's start (or resume).
# WAIT keeps the start-up out of the trace: loader workers starting, cudnn timing its
# algorithms, torch.compile, DDP rebuilding its buckets after the first step.
# WARMUP steps run the profiler but drop what it records (its own start-up cost).
# ACTIVE steps are recorded: enough to see the pattern repeat, few enough that the
# file stays small and opens quickly in the browser.
WAIT_STEPS, WARMUP_STEPS, ACTIVE_STEPS = 5, 2, 5
STEPS_TO_PROFILE = WAIT_STEPS + WARMUP_STEPS + ACTIVE_STEPS

# Record key -> TensorBoard tag; grouped by the part before "/" in TensorBoard's UI.
SCALAR_TAGS = {
    "train_loss": "train/loss",
    "train_acc1": "train/acc1",
    "grad_norm": "train/grad_norm",
    "test_loss": "test/loss",
    "test_acc1": "test/acc1",
    "test_acc5": "test/acc5",
    "images_per_second": "speed/images_per_second",
    "epoch_seconds": "speed/epoch_seconds",
    "lr": "lr",
    "peak_memory_mb": "memory/peak_mb",
    "peak_reserved_mb": "memory/peak_reserved_mb",
}


def profiled_steps(start_step: int) -> range:
    """The global steps that the trace records, for a run that starts at start_step."""
    first = start_step + WAIT_STEPS + WARMUP_STEPS + 1
    return range(first, first + ACTIVE_STEPS)


def profiler_activities(device: torch.device) -> list:
    """The CPU, plus the device's own activity where this PyTorch can record it
    (CUDA, which ROCm builds also call cuda, XPU, HPU, MTIA)."""
    activities = [ProfilerActivity.CPU]
    own = getattr(ProfilerActivity, device.type.upper(), None)
    if own not in (None, ProfilerActivity.CPU) and own in torch.profiler.supported_activities():
        activities.append(own)
    return activities


def _make_dir(flag: str, path: str):
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot write {flag} {path}: {exc.strerror or exc}") from None


class Observers:
    def __init__(self, args, env, start_step: int = 0):
        self.env = env
        self.profile_dir = getattr(args, "profile", None)
        self._profiler = self._writer = None
        self._step = start_step
        self._window = profiled_steps(start_step)
        self._traced_up_to = None  # the last global step in the written trace
        if self.profile_dir:
            _make_dir("--profile", self.profile_dir)  # every rank: nodes may not share it
            # The profiler counts its own steps from here (each step() ends one), so the
            # window falls after this run's warm-up, also when it resumes at a later step.
            self._profiler = torch.profiler.profile(
                activities=profiler_activities(env.device),
                schedule=torch.profiler.schedule(wait=WAIT_STEPS, warmup=WARMUP_STEPS,
                                                 active=ACTIVE_STEPS, repeat=1),  # one window only
                on_trace_ready=self._write_trace,
                # With one window there is nothing to accumulate across windows: True only
                # spares PyTorch 2.11's warning that events are not kept between them.
                acc_events=True)
            self._profiler.start()
        if getattr(args, "tensorboard", None) and env.is_main:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            _make_dir("--tensorboard", args.tensorboard)
            # A resumed run may repeat steps that an earlier attempt had logged after the
            # checkpoint: purge_step hides those, so each step shows one value.
            self._writer = SummaryWriter(args.tensorboard, purge_step=start_step + 1 if start_step else None)

    def trace_path(self, rank: int) -> str:
        return os.path.join(self.profile_dir, f"trace-rank{rank}.json")

    def _say(self, message: str):
        if self.env.is_main:
            print(f"--profile: {message}", flush=True)

    def _write_trace(self, profiler):
        profiler.export_chrome_trace(self.trace_path(self.env.rank))
        self._traced_up_to = self._step
        partial = "" if self._step == self._window[-1] else " (the run ended inside the window)"
        self._say(f"traced steps {self._window[0]} to {self._step}{partial} in "
                  f"{os.path.join(self.profile_dir, 'trace-rank*.json')}: open one in "
                  "https://ui.perfetto.dev or chrome://tracing")

    def step(self, global_step: int):
        if self._profiler is None:
            return
        self._step = global_step
        self._profiler.step()
        if self._traced_up_to is not None:  # the window is written: stop profiling for good
            self._profiler.stop()
            self._profiler = None

    def epoch(self, record: dict):
        if self._writer is None:
            return
        for key, tag in SCALAR_TAGS.items():
            value = record.get(key)
            if value is None or math.isnan(value):  # not measured (CPU memory, a skipped evaluation)
                continue
            self._writer.add_scalar(tag, value, global_step=record["step"])
        self._writer.flush()

    def close(self):
        if self._profiler is not None:
            self._profiler.stop()  # inside the window this writes the steps recorded so far
            self._profiler = None
            if self._traced_up_to is None:
                self._say(f"the run was too short to profile, no trace written: it ended at step "
                          f"{self._step}, the trace records steps {self._window[0]} to {self._window[-1]} "
                          f"(it needs {STEPS_TO_PROFILE} steps after the run's start)")
        if self._writer is not None:
            self._writer.close()
            self._writer = None
