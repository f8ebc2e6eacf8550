"""The bookkeeping of a training run, the same in every script: epochs and steps,
resume, checkpoints, --max-steps, progress bar, per-epoch summary and metrics.

The scripts keep the lesson (how the model is wrapped, how a step is taken) and
hand this object the rest:

    run = TrainingRun(args, env, model, optimizer, scheduler, ...)   # resumes if asked
    for epoch in run.epochs():
        train_loader.sampler.set_epoch(epoch, run.step_in_epoch)
        for images, targets in run.progress(train_loader):
            ...forward, backward, optimizer.step()...
            run.meter.update(loss, logits, targets)
            if run.step_done():      # True at --max-steps
                break
        run.end_epoch(evaluate(model, test_loader, env.device))
    run.finish()

Collectives: every rank must make each of these calls, at the same points and in the
same order, or the others wait in it until --dist-timeout. So no rank may skip a
`step_done()` or leave the loop on its own (a rank-dependent `continue` or `break`).

- `TrainingRun(...)`: small all-reduces (`all_ranks_ok`) that agree on the output
  files, on whether a checkpoint exists and on whether this is a launcher's restart,
  and, with --resume, on whether every rank loaded it.
- `step_done()`, every step: every `check_every` steps (10 with several processes)
  one all-reduce that agrees on a stop signal; when a checkpoint is due, one
  all-reduce of the epoch's training sums (`save`).
- `end_epoch()`: an all-reduce of the training sums for the summary, another in
  `save`, then one more stop agreement (a signal that came during evaluation).
  The script's `metrics.evaluate` before it makes its own (one all-reduce, and the
  broadcasts of batch-norm buffers).
- `finish()` and `epochs()` communicate nothing.

Each of these collectives runs inside `meeting(...)` (utils/distributed.py): if a rank
never comes, the rank left waiting fails after --dist-timeout with a MissedCollective
error that names the call it was waiting in.
"""
import json
import math
import os
import shutil
import sys
import time

import torch

from . import checkpoint, observe
from .cli import UsageError, plain_config, print_line
from .distributed import DistEnv, all_ranks_ok, device_name, meeting, print0
from .metrics import EpochTimer, MetricsLog, TrainMeter, peak_memory_mb, reset_peak_memory
from .preemption import Preempted, StopSignal


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (through symbolic links, relative paths)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _check_writable(path: str):
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write --metrics {path}: {exc.strerror or exc}") from None


class TrainingRun:
    def __init__(self, args, env: DistEnv, model, optimizer, scheduler, *, steps_per_epoch: int,
                 strategy: str, scaler=None, extra_record=None, sharded=False):
        self.args, self.env = args, env
        # sharded: the model's parameters and the optimizer's state are split across ranks
        # (FSDP); every rank writes its part with torch.distributed.checkpoint (see save).
        self.sharded = sharded
        self._shards = None  # the shard folder that this directory's checkpoint.pt names
        self._param_groups = None  # the optimizer's param_groups of those shards
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.steps_per_epoch = steps_per_epoch
        self.strategy = strategy
        self.extra_record = dict(extra_record or {})
        self.epoch = 0           # the epoch in progress (0-based)
        self.step_in_epoch = 0   # optimizer steps already taken in it
        self.global_step = 0     # optimizer steps taken in the whole run
        self.meter = None
        self.last_eval = {}
        self.last_record = None
        self._partial_sums = None
        self._stop = False
        self._bar = None
        self._timing = None
        self._claim_outputs()
        self.log = MetricsLog(args.metrics)
        self.started = time.perf_counter()

        self.checkpoint_path = None
        if args.checkpoint_dir:
            self.checkpoint_path = os.path.join(args.checkpoint_dir, checkpoint.FILENAME)
        resume_from = self._resume_path()
        if resume_from:
            self._resume(resume_from)
        self.stop_signal = StopSignal(env.distributed)
        # --profile and --tensorboard (utils/observe.py); nothing when neither is given.
        self.observers = observe.Observers(args, env, start_step=self.global_step)
        if args.checkpoint_dir and env.is_main:
            checkpoint.remove_stale_temporaries(self.checkpoint_path)
            if sharded:  # shards of saves that never became the checkpoint (a crash)
                checkpoint.remove_unreferenced_shards(args.checkpoint_dir, keep=self._shards)
            # The resolved configuration beside the checkpoint, for whoever finds it later.
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            with open(os.path.join(args.checkpoint_dir, "config.json"), "w") as f:
                json.dump(dict(plain_config(args), world_size=env.world_size, strategy=strategy), f, indent=2)

    def _claim_outputs(self):
        """Before anything trains: the checkpoint directory is this run's alone (a lock
        that dies with the process) and writable, and the metrics file can be written.
        Rank 0 checks; every rank learns the outcome, so all of them stop together."""
        error = None
        if self.env.is_main:
            try:
                if self.args.checkpoint_dir:
                    checkpoint.lock_directory(self.args.checkpoint_dir)
                if self.args.metrics:
                    _check_writable(self.args.metrics)
            except UsageError as exc:
                error = exc
        if not all_ranks_ok(error is None, self.env.device, "TrainingRun(...), agreeing on the output paths"):
            raise error or UsageError("rank 0 refused the output paths")

    # --- resume -------------------------------------------------------------------

    def _resume_path(self):
        """Which checkpoint to continue from, if any.

        A worker restarted by torchrun --max-restarts resumes from --checkpoint-dir's
        checkpoint by itself (also when the first attempt had --resume PATH: the
        newer checkpoint wins). --resume PATH: that file. --resume: --checkpoint-dir's
        checkpoint if there is one (a requeued SLURM job passes it every time), else a
        fresh start. A run never overwrites a checkpoint it was not told to continue.
        """
        args = self.args
        here = bool(self.checkpoint_path) and os.path.isfile(self.checkpoint_path)
        agreeing = "TrainingRun(...), agreeing on the checkpoint to resume from"
        exists = all_ranks_ok(here, self.env.device, agreeing)
        if not exists and not all_ranks_ok(not here, self.env.device, agreeing):
            raise UsageError(f"{self.checkpoint_path} exists for some ranks but not others: "
                             "--checkpoint-dir must be on a file system that every node sees")
        # Each torchrun agent counts only its own restarts: when a worker dies on one node,
        # the healthy nodes' workers may restart with a count of 0. Any rank restarted
        # means the whole group was.
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        restarted = not all_ranks_ok(restarts == 0, self.env.device, agreeing)
        if exists and restarted:
            print0(f"torchrun restart: resuming from {self.checkpoint_path}")
            return self.checkpoint_path
        if args.resume == "auto":
            if not exists:
                print0(f"--resume: no checkpoint in {args.checkpoint_dir} yet, starting from scratch")
            return self.checkpoint_path if exists else None
        if exists and not (args.resume and _same_file(args.resume, self.checkpoint_path)):
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir} already holds a checkpoint: add --resume "
                             "to continue it, or choose another directory (it would be overwritten)")
        return args.resume

    # Flags that decide which sample comes at which step and the learning rate there:
    # a resume with other values would not continue the same run.
    # The optimizer's settings too: its saved state carries them, so a new value would be
    # silently ignored; changing them is a new run.
    _MUST_MATCH = ("model", "batch_size", "dataset", "train_samples", "seed", "epochs", "warmup_epochs",
                   "lr", "momentum", "nesterov", "weight_decay")
    _NEEDED = ("model", "optimizer", "scheduler", "epoch", "step_in_epoch", "global_step", "train_sums", "rng")
    _NEEDED_SHARDED = ("sharded", *_NEEDED[2:])  # model and optimizer: in the shard folder

    def _resume(self, path):
        error = state = None
        try:
            state = checkpoint.load(path)  # every rank reads the file: no broadcast needed
            if self.sharded != ("sharded" in state):
                raise UsageError(f"checkpoint {path} is {'' if 'sharded' in state else 'not '}sharded: "
                                 f"resume it with the script that wrote it ({state.get('strategy', 'unknown')})")
            if self.sharded:  # every rank must see the shards before DCP's collective load
                checkpoint.check_sharded_folder(checkpoint.sharded_folder(path, state["sharded"]["folder"]))
        except UsageError as exc:
            error = exc
        # A file that only some ranks can read must stop all of them, not leave the
        # others waiting in the next collective.
        if not all_ranks_ok(error is None, self.env.device, "TrainingRun(...), agreeing that every rank resumed"):
            raise error or UsageError(f"checkpoint {path} could not be read on another rank")
        missing = [key for key in (self._NEEDED_SHARDED if self.sharded else self._NEEDED) if key not in state]
        if missing:
            raise UsageError(f"checkpoint {path} lacks {', '.join(missing)}: it is not a complete "
                             "checkpoint of these scripts")
        saved = state.get("config", {})
        for key in self._MUST_MATCH:
            if key in saved and saved[key] != getattr(self.args, key, saved[key]):
                flag = "--" + key.replace("_", "-")
                raise UsageError(f"checkpoint {path} was written with {flag} {saved[key]}, this run has "
                                 f"{flag} {getattr(self.args, key)}: resume with the same value")
        if self.sharded:  # all ranks: a collective; the whole run fails alike if the shards do not fit
            shards = state["sharded"]
            checkpoint.load_sharded(self.model, self.optimizer, checkpoint.sharded_folder(path, shards["folder"]),
                                    shards["param_groups"])
            if _same_file(path, self.checkpoint_path or ""):
                self._shards, self._param_groups = shards["folder"], shards["param_groups"]
        try:
            if not self.sharded:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
        except (KeyError, RuntimeError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise UsageError(f"checkpoint {path} does not fit this model/optimizer: {first}") from None
        checkpoint.set_rng_state(state["rng"], self.env.device)
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        self.global_step = state["global_step"]
        # The interrupted epoch's training sums are already global: only rank 0 carries
        # them, so that the end-of-epoch all-reduce counts them once.
        self._partial_sums = state["train_sums"] if self.env.is_main and self.step_in_epoch else None
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch, self._partial_sums = self.epoch + 1, 0, None
        print0(f"resumed from {path}: epoch {self.epoch + 1}, step {self.step_in_epoch} of "
               f"{self.steps_per_epoch} in it, {self.global_step} steps in all")

    def save(self):
        """Checkpoint now (a collective: every rank must call it at the same step)."""
        if not self.checkpoint_path:
            return
        previous = self._shards
        if self.sharded and previous != f"{checkpoint.SHARDED_PREFIX}{self.global_step}":  # not saved at this step yet
            # Every rank writes its shards; DCP returns once all have. The folder is new: rank 0
            # removed any leftover of a crashed attempt when the run started.
            self._shards = f"{checkpoint.SHARDED_PREFIX}{self.global_step}"
            with meeting(f"the sharded checkpoint of step {self.global_step} (in run.step_done() or run.end_epoch())"):
                self._param_groups = checkpoint.save_sharded(
                    self.model, self.optimizer, checkpoint.sharded_folder(self.checkpoint_path, self._shards))
        with meeting(f"the checkpoint of step {self.global_step} (in run.step_done() or run.end_epoch())"):
            sums = self.meter.global_sums() if self.meter is not None else [0.0, 0.0, 0.0]
        if not self.env.is_main:
            return
        state = {
            "format": checkpoint.FORMAT,
            **({"sharded": {"folder": self._shards, "param_groups": self._param_groups}} if self.sharded else
               {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "train_sums": sums,
            "rng": checkpoint.rng_state(self.env.device),
            "config": plain_config(self.args),
            "world_size": self.env.world_size,
            "strategy": self.strategy,
        }
        checkpoint.atomic_save(state, self.checkpoint_path)  # the commit: checkpoint.pt names the new shards
        if previous is not None and previous != self._shards:
            shutil.rmtree(checkpoint.sharded_folder(self.checkpoint_path, previous), ignore_errors=True)

    # --- the loop -----------------------------------------------------------------

    def complete(self) -> bool:
        """The whole run is trained: every epoch, or --max-steps."""
        return ((self.epoch >= self.args.epochs) or
                (self.args.max_steps is not None and self.global_step >= self.args.max_steps))

    def done(self) -> bool:
        return self._stop or (self.args.max_steps is not None and self.global_step >= self.args.max_steps)

    def epochs(self):
        """The epochs still to run, from the resumed position on."""
        if self.epoch >= self.args.epochs or self.done():
            print0(f"nothing to train: the run already stands at epoch {self.epoch} "
                   f"of {self.args.epochs}, step {self.global_step}")
        while self.epoch < self.args.epochs and not self.done():
            self.meter = TrainMeter(self.env.device, self._partial_sums)
            self._partial_sums = None
            remaining = self.steps_per_epoch - self.step_in_epoch
            self.timer = EpochTimer(self.env.device, self.args.batch_size, remaining)
            reset_peak_memory(self.env.device)  # each epoch's record has its own peaks
            yield self.epoch
            if self.step_in_epoch >= self.steps_per_epoch:
                self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def progress(self, loader):
        """Iterate the loader; a progress bar on rank 0 when stderr is a terminal."""
        batches = self._batches(loader)
        if not (self.env.is_main and sys.stderr.isatty()):
            yield from batches
            return
        from tqdm import tqdm
        with tqdm(batches, total=len(loader), desc=f"epoch {self.epoch + 1}/{self.args.epochs}",
                  leave=False, dynamic_ncols=True) as self._bar:
            yield from self._bar
        self._bar = None

    def _batches(self, loader):
        """The loader's batches. If a loader worker dies while a stop signal is pending
        (one that a signal reached before it could ignore it), the stop must still get to
        its checkpoint: the rest of the epoch is loaded again by new workers, from the
        first batch not yet delivered, so training sees the same batches either way."""
        iterator, delivered = iter(loader), 0
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except RuntimeError as exc:
                if self.stop_signal.received is None or "DataLoader worker" not in str(exc):
                    raise
                print_line(f"rank {self.env.rank}: {exc.args[0].splitlines()[0]} during a stop: "
                           "loading the rest of the epoch with new workers")
                loader.sampler.skip += delivered * loader.batch_size
                loader._iterator = None  # persistent workers: forget the broken set
                iterator, delivered = iter(loader), 0
                continue
            delivered += 1
            yield batch

    def clip_grad_norm(self, parameters):
        """--clip-grad-norm: scale the gradients down to that global L2 norm if theirs is
        larger; the norm before clipping goes into the epoch's record (its mean over the
        epoch's steps). Nothing without the flag.

        Call it once per optimizer step, where the gradients are final: after backward
        (under DDP they are averaged by then, so every rank computes the same norm and
        clips the same way), after the last micro-batch with accumulation, and after
        GradScaler.unscale_ under float16, or the norm would be that of the scaled loss."""
        if self.args.clip_grad_norm is None:
            return None
        norm = torch.nn.utils.clip_grad_norm_(parameters, self.args.clip_grad_norm)
        if hasattr(norm, "full_tensor"):
            # Sharded parameters (FSDP): clip_grad_norm_ all-reduced the shards' norms once and
            # returns a replicated DTensor, so full_tensor() is local (CommDebugMode counted one
            # all-reduce for both calls, on 2 gloo processes with PyTorch 2.11 and 2.15).
            norm = norm.full_tensor()
        self.meter.add_grad_norm(norm)
        return norm

    def step_done(self) -> bool:
        """Count one optimizer step; checkpoint when due. True when the run must stop."""
        self.step_in_epoch += 1
        self.global_step += 1
        self.timer.step()
        self.observers.step(self.global_step)
        if self.step_in_epoch >= self.steps_per_epoch or self.done():
            # The epoch's training ends here: stop the clock before the evaluation that
            # the script runs next, so that images/s measures training alone.
            self._timing = self.timer.stop()
        if self._bar is not None and self.global_step % self.args.log_every == 0:
            self._bar.set_postfix(loss=f"{self.meter.local_loss():.3f}")  # one device sync
        every = self.args.checkpoint_every
        if every and self.global_step % every == 0 and self.step_in_epoch < self.steps_per_epoch:
            self.save()
        with meeting(f"run.step_done() at step {self.global_step} (the stop-signal agreement)"):
            stop = self.stop_signal.should_stop(self.global_step)
        if stop:
            if self.step_in_epoch >= self.steps_per_epoch:
                # The epoch is complete: let end_epoch evaluate, checkpoint and record it,
                # then stop there (done() is now True), rather than lose its record.
                self._stop = True
                return True
            self.save()
            self.stop_signal.announce(self.global_step, self.checkpoint_path)
            self.stop_signal.close()
            self.observers.close()
            raise Preempted()  # exit status 0; the script's `finally` still tears down
        return self.done()

    def end_epoch(self, eval_metrics: dict):
        """After the epoch (or at --max-steps): summary, metrics record, checkpoint."""
        timing = self._timing or self.timer.stop()
        self._timing = None
        with meeting(f"run.end_epoch() after step {self.global_step} (the epoch's training sums)"):
            train = self.meter.summary()
        self.last_eval = eval_metrics
        memory = peak_memory_mb(self.env.device)
        record = {
            "event": "epoch", "epoch": self.epoch + 1, "step": self.global_step,
            "epoch_complete": self.step_in_epoch >= self.steps_per_epoch,
            **train, **eval_metrics, **timing,
            "lr": self.optimizer.param_groups[0]["lr"],
            **memory,  # this epoch's peaks, on GPUs
            "world_size": self.env.world_size, "global_batch": self.args.batch_size,
            "strategy": self.strategy, "device": device_name(self.env.device), **self.extra_record,
        }
        self.last_record = record
        # Checkpoint first, then record: a record that fails to write loses no training.
        self.save()
        self.log.write(record)
        self.observers.epoch(record)
        acc5 = eval_metrics["test_acc5"]
        acc5 = "" if math.isnan(acc5) and eval_metrics["test_samples"] else f"acc5 {acc5:.2f}% "
        print0(f"epoch {self.epoch + 1}/{self.args.epochs} step {self.global_step} | "
               f"train loss {train['train_loss']:.4f} acc1 {train['train_acc1']:.2f}% "
               + (f"grad norm {train['grad_norm']:.3g} " if train["grad_norm"] is not None else "") + "| "
               f"test loss {eval_metrics['test_loss']:.4f} acc1 {eval_metrics['test_acc1']:.2f}% "
               f"{acc5}({eval_metrics['test_samples']} images) | "
               f"{timing['epoch_seconds']:.1f} s, {timing['images_per_second']:.0f} img/s"
               + (f" | peak memory {memory['peak_memory_mb']:,.0f} MB allocated, "
                  f"{memory['peak_reserved_mb']:,.0f} MB reserved" if memory["peak_memory_mb"] is not None else ""))
        # A signal that came during the evaluation is honoured now, with the epoch just
        # checkpointed, not ten steps into the next one (an evaluation longer than the
        # launcher's grace period would otherwise end in SIGKILL). All ranks meet here.
        with meeting(f"run.end_epoch() after step {self.global_step} (the stop-signal agreement)"):
            if not self._stop and self.stop_signal.should_stop(self.global_step, now=True):
                self._stop = True
        if self._stop:
            self.stop_signal.announce(self.global_step, self.checkpoint_path)

    def finish(self):
        """The end-of-run record (rank 0), with the last evaluation."""
        self.stop_signal.close()
        self.observers.close()
        if self.last_record is None or not self.complete():
            return  # stopped by a signal: the run goes on with --resume, it has not ended
        record = dict(self.last_record, event="end", step=self.global_step,
                      total_seconds=time.perf_counter() - self.started)
        self.log.write(record)
        print0(f"done: {self.global_step} steps, test acc1 {record['test_acc1']:.2f}%, "
               f"{record['total_seconds']:.1f} s in all")
