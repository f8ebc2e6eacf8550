"""--profile DIR: a torch.profiler trace of a few optimizer steps once the run is warm, in DIR/trace-rank{rank}.json
(each ProfilerStep#N is one optimizer step, numbered from 0 at the run's start or resume; an epoch's first also holds
the evaluation before it); a run ending inside the window writes what it recorded, up to its last step.
--tensorboard DIR: rank 0 writes each epoch record's scalars at its global step, flushed for a live `tensorboard
--logdir DIR`. TrainingRun (utils/run.py) makes every call on every rank; none communicates."""
import math
import os

import torch
from torch.profiler import ProfilerActivity

from . import compat
from .distributed import print0


# The profiled window, in optimizer steps from the run's start (or resume). WAIT keeps the start-up
# out (loader workers, cudnn autotuning, torch.compile, DDP rebuilding its buckets after step 1);
# WARMUP steps drop the profiler's own start-up; ACTIVE steps: the pattern repeats, the file stays small.
WAIT_STEPS, WARMUP_STEPS, ACTIVE_STEPS = 5, 2, 5
STEPS_TO_PROFILE = WAIT_STEPS + WARMUP_STEPS + ACTIVE_STEPS

# Record key -> TensorBoard tag; grouped by the part before "/" in TensorBoard's UI.
SCALAR_TAGS = {"train_loss": "train/loss", "train_acc1": "train/acc1", "grad_norm": "train/grad_norm",
               "test_loss": "test/loss", "test_acc1": "test/acc1", "test_acc5": "test/acc5",
               "images_per_second": "speed/images_per_second", "epoch_seconds": "speed/epoch_seconds",
               "lr": "lr", "peak_memory_mb": "memory/peak_mb", "peak_reserved_mb": "memory/peak_reserved_mb"}


class Observers:
    def __init__(self, args, env, start_step: int = 0):
        self.env, self.profile_dir = env, getattr(args, "profile", None)
        self._profiler = self._writer = self._traced_up_to = None  # _traced_up_to: the last step in the trace
        self._step, self._window = start_step, range(start_step + WAIT_STEPS + WARMUP_STEPS + 1,
                                                     start_step + STEPS_TO_PROFILE + 1)  # the traced global steps
        if self.profile_dir:
            own = getattr(ProfilerActivity, env.device.type.upper(), None)  # CUDA (ROCm's too), XPU, HPU, MTIA
            recordable = own not in (None, ProfilerActivity.CPU) and own in torch.profiler.supported_activities()
            # It counts steps from here (each step() ends one): the window follows this run's warm-up, resumed or not.
            self._profiler = torch.profiler.profile(
                activities=[ProfilerActivity.CPU, own] if recordable else [ProfilerActivity.CPU],
                on_trace_ready=self._write_trace, **compat.ONE_WINDOW,
                schedule=torch.profiler.schedule(wait=WAIT_STEPS, warmup=WARMUP_STEPS, active=ACTIVE_STEPS, repeat=1))
            self._profiler.start()
        if getattr(args, "tensorboard", None) and env.is_main:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            # A resume repeats the steps that an earlier attempt logged after the checkpoint: purge_step hides those.
            self._writer = SummaryWriter(args.tensorboard, purge_step=start_step + 1 if start_step else None)

    def _write_trace(self, profiler):
        profiler.export_chrome_trace(os.path.join(self.profile_dir, f"trace-rank{self.env.rank}.json"))
        self._traced_up_to = self._step
        partial = "" if self._step == self._window[-1] else " (the run ended inside the window)"
        first = self._window[0] - WAIT_STEPS - WARMUP_STEPS  # the step the profiler calls ProfilerStep#0
        print0(f"--profile: traced steps {self._window[0]} to {self._step} (ProfilerStep#{self._window[0] - first} to "
               f"#{self._step - first}){partial} in {os.path.join(self.profile_dir, 'trace-rank*.json')}: open one "
               "in https://ui.perfetto.dev or chrome://tracing")

    def step(self, global_step: int, last: bool = False):  # last: the run's last step, or a stop's
        if self._profiler is not None:
            self._step = global_step
            if not last:  # else no ProfilerStep more: it would hold the evaluation and checkpoint that follow
                self._profiler.step()
            if last or self._traced_up_to is not None:  # the window is written: stop profiling for good
                self.close(profiler_only=True)

    def epoch(self, record: dict):
        if self._writer is not None:
            for key, tag in SCALAR_TAGS.items():
                value = record.get(key)
                if value is not None and not math.isnan(value):  # else not measured (CPU memory, no evaluation)
                    self._writer.add_scalar(tag, value, global_step=record["step"])
            self._writer.flush()

    def close(self, profiler_only: bool = False):
        if self._profiler is not None:
            self._profiler.stop()  # inside the window this writes the steps recorded so far
            self._profiler = None
            if self._traced_up_to is None:  # written neither now nor before
                print0(f"--profile: the run was too short to profile, no trace written: it ended at step "
                       f"{self._step}, the trace records steps {self._window[0]} to {self._window[-1]} "
                       f"(it needs {STEPS_TO_PROFILE} steps after the run's start)")
        if self._writer is not None and not profiler_only:
            self._writer.close()
            self._writer = None
