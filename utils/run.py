"""The bookkeeping of a training run, the same in every script: epochs and steps, resume, checkpoints,
stop signals, --max-steps, progress bar, per-epoch summary and metrics. The scripts keep the lesson (how
the model is wrapped, how a step is taken) and hand this object the rest (distributed.py's loop shows how).

Where the ranks meet: every rank must make each of these calls, at the same points and in the same
order, or the others wait in it until --dist-timeout and fail with an error that names the call
(`meeting(...)`, utils/distributed.py): no rank may skip a `step_done()` or leave the loop on its own.

- `TrainingRun(...)`: agreements (`all_ranks_ok`, through the job's store) on the output files, on whether every rank
  sees --checkpoint-dir as rank 0 does (after an all-gather of rank 0's lock line, whether it sees a checkpoint there,
  and each node's torchrun), and whether every rank loaded the checkpoint (a sharded model loads in a collective).
- `step_done()`: every `check_every` steps (10 under a launcher, 1 alone) a stop-signal agreement; when a
  checkpoint is due, an all-reduce of the epoch's training sums (`save`) and a sharded model's save.
- `end_epoch()`: an all-reduce of the training sums (for the summary and the checkpoint), then a stop
  agreement (for a signal that came during evaluation). The script's `metrics.evaluate` before it
  makes its own (the broadcasts of batch-norm buffers, one all-reduce).
- `finish()` and `epochs()` communicate nothing."""
import json
import math
import os
import signal
import sys
import time

import torch

from . import checkpoint, observe
from .cli import Plan, UsageError, first_line, given, plain_config
from .data import steps_per_epoch
from .distributed import DistEnv, all_ranks_ok, any_rank, device_name, meeting, print0
from .lifecycle import stop_signals, stop_under_way
from .metrics import EpochTimer, TrainMeter, peak_memory_mb, reset_peak_memory


def _launch():
    """This node's torchrun, the same through all its restarts and no other's: the log folder it made for them
    (mkdtemp; TORCHELASTIC_ERROR_FILE is FOLDER/attempt_N/RANK/error.json), or with --log-dir /dev/null, its
    process. A run id would not do: the same --rdzv-id serves every launch of one command. None outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    folder = os.path.dirname(os.path.dirname(os.path.dirname(error_file))) if error_file else os.getppid()
    return f"{os.uname().nodename}:{folder}"


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (through symbolic links, relative paths)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def validated(args, check, state=checkpoint.WholeState) -> Plan:
    """check(args) -> Plan, or a UsageError: the run's every refusal that needs no process group, data or model
    (a batch that does not split, a device this machine lacks, a network on which the groups cannot form,
    contradicting flags). --check-args (what scripts/slurm.sbatch runs before srun) adds, as a new launch's, the
    refusals of the outputs, --checkpoint-dir and --resume (a path it cannot write, a folder another run holds, a
    checkpoint it would overwrite, of another kind (`state`) or incomplete, a changed recipe), then stops. Not
    checked: what needs the data or the optimizer (the data's size, a flag that the script's optimizer lacks)."""
    plan = check(args)
    if args.check_args:
        for flag, path, file in _outputs(args):
            checkpoint.writable(flag, path, make=False, file=file)
        saved = os.path.join(args.checkpoint_dir, checkpoint.FILENAME) if args.checkpoint_dir else None
        # A folder that its own job holds (a node that joins it, or comes back): the run checks the job's checkpoint.
        if not (args.checkpoint_dir and checkpoint.lock_directory(args.checkpoint_dir, take=False)) and \
                (path := _resume_choice(args, bool(saved) and os.path.isfile(saved), restarts=False)[0]):
            state.check(loaded := checkpoint.load(path), path)
            _check_recipe(args, loaded, path)
        n, read = plan.world_size, f" ({plan.read})" if plan.read else ""
        print(f"arguments OK for {n} process{'es' if n != 1 else ''}{read}", flush=True)
        sys.exit(0)
    return plan


def _outputs(args, main: bool = True) -> list:
    """(flag, path, whether a file) of the outputs given but --checkpoint-dir: --profile's, which every rank
    writes (nodes may not share it), and rank 0's (`main`)."""
    given = [("--profile", getattr(args, "profile", None)), ("--metrics", main and args.metrics),
             ("--tensorboard", main and getattr(args, "tensorboard", None))]
    return [(flag, path, flag == "--metrics") for flag, path in given if path]


def _resume_choice(args, exists: bool, restarts: bool):
    """(checkpoint to continue from or None, whether a restart of this launch may have written it). --resume PATH:
    that file; --resume: --checkpoint-dir's if it holds one (`exists`; a requeued SLURM job passes it every time).
    torchrun's restarts (`restarts`) resume --checkpoint-dir's if this launch wrote it, even after --resume PATH."""
    saved = os.path.join(args.checkpoint_dir, checkpoint.FILENAME) if args.checkpoint_dir else None
    if args.resume == "auto":
        return (saved if exists else None), False
    if exists and not (args.resume and _same_file(args.resume, saved)):
        if not restarts:  # not under torchrun: no restart of this run can have written it
            raise UsageError(_holds_one(args))
        return saved, True
    return args.resume, False


def _holds_one(args) -> str:
    return f"--checkpoint-dir {args.checkpoint_dir} already holds a checkpoint: " + (
        f"--resume {args.resume} would overwrite it: give --resume alone to continue it, or choose another directory"
        if args.resume else "add --resume to continue it, or choose another directory (it would be overwritten)")


# Flags that decide which sample comes at which step and the learning rate there, and the optimizer's settings (its
# saved state carries them, a new value would be ignored): other values are a new run. (The data's size: _resume.)
_MUST_MATCH = ("model", "batch_size", "dataset", "seed", "epochs", "warmup_epochs",
               "lr", "momentum", "nesterov", "weight_decay")


def _check_recipe(args, state: dict, path: str):
    saved = state.get("config", {})
    for key in _MUST_MATCH:  # (None: filled in later, your own data's dataset by data.own_datasets)
        if key in saved and saved[key] != getattr(args, key, saved[key]) and getattr(args, key) is not None:
            flag = "--" + key.replace("_", "-")
            spelled = [f"--no-{flag[2:]}" if value is False else flag if value is True else f"{flag} {value}"
                       for value in (saved[key], getattr(args, key))]
            raise UsageError(f"checkpoint {path} was written with {spelled[0]}, this run has {spelled[1]}: "
                             "resume with the same value")


class TrainingRun:
    def __init__(self, args, env: DistEnv, model, optimizer, scheduler, *, train_size: int,
                 strategy: str, scaler=None, extra_record=None, state=None):
        # A flag of the recipe's SGD that the script's optimizer lacks (AdamW has no momentum) would be
        # accepted and ignored: refused, on every rank alike, before anything is written.
        for name in ("momentum", "nesterov", "weight_decay"):
            if given(args, name) and name not in optimizer.defaults:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag}: this script's optimizer, {type(optimizer).__name__}, has no {name}; "
                                 f"leave {flag} out, or give the optimizer {name}")
        self.args, self.env, self.train_size, self.strategy = args, env, train_size, strategy
        self.steps_per_epoch = steps_per_epoch(train_size, args.batch_size)  # as the script's sampler and schedule
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.state = state or checkpoint.WholeState(model, optimizer)  # or sharded across ranks (utils/sharded.py)
        self.extra_record = dict(extra_record or {})
        self.epoch = self.step_in_epoch = self.global_step = 0  # epoch (0-based); optimizer steps in it, in the run
        self.meter = self.last_record = self._partial_sums = self._bar = self._timing = self.lr = None
        self._stop = self._restarted_into = False
        self._saved = None  # whether rank 0 sees a checkpoint in --checkpoint-dir (_check_shared), when distributed
        self._launches = set()  # every node's torchrun: _check_shared gathers them (under torchrun: distributed)
        # How long a rank looks again for what another node wrote (checkpoint.look_again): within --dist-timeout.
        self._patience = min(60.0, args.dist_timeout / 2) if env.distributed else 0.0
        self._claim_outputs()
        self.started = time.perf_counter()
        self.checkpoint_path = os.path.join(args.checkpoint_dir, checkpoint.FILENAME) if args.checkpoint_dir else None
        exists = self._saved if self._saved is not None else os.path.isfile(self.checkpoint_path or "")
        if args.resume == "auto" and not exists:
            print0(f"--resume: no checkpoint in {args.checkpoint_dir} yet, starting from scratch")
        resume_from, self._restarted_into = _resume_choice(args, exists, restarts=bool(self._launches))
        if resume_from:
            self._resume(resume_from)
            if not args.checkpoint_dir:
                print0(f"--resume {args.resume} without --checkpoint-dir: this run saves no checkpoint")
        self.stop_signal = StopSignal(env.distributed)
        self.observers = observe.Observers(args, env, start_step=self.global_step)  # --profile, --tensorboard
        if args.checkpoint_dir and env.is_main:  # (the directory exists: _claim_outputs locked it)
            checkpoint.remove_stale_temporaries(self.checkpoint_path)
            self.state.tidy(self.checkpoint_path)
            # The resolved configuration beside the checkpoint, for whoever finds it later.
            with open(os.path.join(args.checkpoint_dir, "config.json"), "w") as f:
                json.dump(dict(plain_config(args), world_size=env.world_size, strategy=strategy), f, indent=2)

    def _claim_outputs(self):
        """Before anything trains, rank 0 locks the checkpoint directory (a lock that dies with the process) and
        makes sure that it, --metrics and --tensorboard can be written, every rank its --profile folder (nodes
        may not share it); every rank learns the outcome: all stop together, the failing node saying why."""
        args, error, line = self.args, None, None
        try:
            if self.env.is_main and args.checkpoint_dir:
                line = checkpoint.lock_directory(args.checkpoint_dir)
            for flag, path, file in _outputs(args, self.env.is_main):
                checkpoint.writable(flag, path, file=file)
        except UsageError as exc:
            error = exc
            error.met_by = "node"
        if not all_ranks_ok(error is None, "TrainingRun(...), agreeing on the output paths"):
            raise error or UsageError("an output path could not be written on another rank (its node says why)")
        if args.checkpoint_dir and self.env.distributed:
            self._check_shared(args.checkpoint_dir, line)

    def _check_shared(self, directory: str, line):
        """Every rank reads in --checkpoint-dir's .lock the `line` that rank 0 wrote (rank 0 must not: that drops its
        lock), and sees a checkpoint there if rank 0 does, whose view decides the resume. A resume reads the
        checkpoint on every rank: a folder on each node's own disk would fail only then."""
        saved = os.path.join(directory, checkpoint.FILENAME)
        held = [None] * self.env.world_size
        with meeting("TrainingRun(...), rank 0's .lock line and checkpoint in --checkpoint-dir, each node's torchrun"):
            torch.distributed.all_gather_object(held, (line, os.path.isfile(saved), _launch()))
        line, self._saved = held[0][:2]
        self._launches = {launch for *_, launch in held if launch}
        rank_0s = seen = (line, self._saved)
        if not self.env.is_main:  # seen late on NFS: looked at again before refusing
            seen = checkpoint.look_again(lambda: (checkpoint.holder(directory), os.path.isfile(saved)), rank_0s,
                                         self._patience)
        if not all_ranks_ok(seen == rank_0s, "TrainingRun(...), agreeing that every rank sees --checkpoint-dir"):
            found = seen[0]
            what = ("another rank does not see" if seen == rank_0s else "this node finds no .lock with" if not found
                    else f"this node reads {found!r} in .lock, not" if found != line
                    else f"this node {'does not see' if self._saved else 'sees'} a {checkpoint.FILENAME} (rank 0 "
                         f"{'does' if self._saved else 'does not'}) beside")
            raise UsageError(f"--checkpoint-dir {os.path.abspath(directory)}: {what} the line of rank 0 ({line}): "
                             "every node must see the same folder (a shared file system), and one run use it at a "
                             "time", met_by="job" if seen == rank_0s else "node")

    # --- resume -------------------------------------------------------------------

    def _resume(self, path):
        error = state = None
        try:
            state = checkpoint.load(path)  # every rank reads the file: no broadcast needed
            if self._restarted_into:  # every node's torchrun is a new process in another launch
                if not self._launches & set(state.get("launches", ())):
                    raise UsageError(_holds_one(self.args))
                print0(f"torchrun restart: resuming from {path}")
            self.state.check(state, path, self._patience)
            _check_recipe(self.args, state, path)
            # Your own data that gained or lost samples: each epoch's order is a permutation of the set's size, so
            # the resumed position would name other samples, and the schedule other steps.
            if state.get("train_size", self.train_size) != self.train_size:
                raise UsageError(f"checkpoint {path} was trained on {state['train_size']:,} training samples, this "
                                 f"run has {self.train_size:,}: resume with the same data, or start a new run in "
                                 "another --checkpoint-dir")
        except UsageError as exc:
            error = exc
        # A file that some ranks cannot read, or data of another size on one node, stops every rank, not only those.
        if not all_ranks_ok(error is None, "TrainingRun(...), agreeing that every rank resumed"):
            raise error or UsageError(f"checkpoint {path} could not be read, or does not fit, on another rank")
        try:
            self.state.load(state, path, own=_same_file(path, self.checkpoint_path or ""))
            self.scheduler.load_state_dict(state["scheduler"])
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise UsageError(f"checkpoint {path} does not fit this model/optimizer: {first_line(exc)}") from None
        checkpoint.set_rng_state(state["rng"], self.env.device)
        self.epoch, self.step_in_epoch, self.global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        # The interrupted epoch's sums are global already: rank 0 alone carries them, so the all-reduce counts once.
        self._partial_sums = state["train_sums"] if self.env.is_main and self.step_in_epoch else None
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch, self._partial_sums = self.epoch + 1, 0, None
        print0(f"resumed from {path}: epoch {self.epoch + 1}, step {self.step_in_epoch} of "
               f"{self.steps_per_epoch} in it, {self.global_step} steps in all")

    def save(self, sums=None):
        """Checkpoint now (every rank must call it at the same step); sums: the meter's global_sums, if made."""
        if not self.checkpoint_path:
            return
        with meeting(f"the checkpoint of step {self.global_step} (in run.step_done() or run.end_epoch())"):
            model_and_optimizer = self.state.save(self.global_step, self.checkpoint_path)
            sums = self.meter.global_sums() if sums is None else sums
        if not self.env.is_main:
            return
        state = {"format": checkpoint.FORMAT, **model_and_optimizer, "scheduler": self.scheduler.state_dict(),
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                 "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
                 "train_sums": sums, "train_size": self.train_size, "rng": checkpoint.rng_state(self.env.device),
                 "config": plain_config(self.args), "world_size": self.env.world_size, "strategy": self.strategy,
                 "launches": sorted(self._launches)}
        checkpoint.atomic_save(state, self.checkpoint_path)  # the commit
        self.state.saved(self.checkpoint_path)

    # --- the loop -----------------------------------------------------------------

    def trained(self) -> bool:
        """Whether the run has trained all it was asked to (--epochs, or --max-steps)."""
        epochs, max_steps = self.epoch + (self.step_in_epoch >= self.steps_per_epoch), self.args.max_steps
        return epochs >= self.args.epochs or (max_steps is not None and self.global_step >= max_steps)

    def done(self) -> bool:
        return self._stop or self.trained()

    def epochs(self):
        """The epochs still to run, from the resumed position on."""
        if self.done():
            print0(f"nothing to train: the run already stands at epoch {self.epoch + (self.step_in_epoch > 0)} "
                   f"of {self.args.epochs}, step {self.global_step}")
        while not self.done():
            self.meter, self._partial_sums = TrainMeter(self.env.device, self._partial_sums), None
            self.timer = EpochTimer(self.env.device, self.args.batch_size, self.steps_per_epoch - self.step_in_epoch)
            reset_peak_memory(self.env.device)  # each epoch's record has its own peaks
            yield self.epoch
            if self.step_in_epoch >= self.steps_per_epoch:
                self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def progress(self, loader):
        if self.env.is_main and sys.stderr.isatty():
            from tqdm import tqdm
            loader = self._bar = tqdm(loader, desc=f"epoch {self.epoch + 1}/{self.args.epochs}", leave=False,
                                      dynamic_ncols=True)  # its total: len(loader)
        for batch in loader:  # tqdm's iterator closes its bar when it ends, or is let go (the next epoch's replaces it)
            self.lr = self.optimizer.param_groups[0]["lr"]  # this step's rate, the record's (the scheduler moves on)
            yield batch

    def clip_grad_norm(self, parameters):
        """--clip-grad-norm (nothing without it): scale the gradients down to that global L2 norm if theirs is
        larger; the epoch's record gets the mean norm before clipping. Once per optimizer step, on final gradients
        (DDP's averaged ones: every rank clips alike): after the last micro-batch, after GradScaler.unscale_."""
        if self.args.clip_grad_norm is None:
            return
        norm = torch.nn.utils.clip_grad_norm_(parameters, self.args.clip_grad_norm)
        # Sharded (FSDP): a replicated DTensor, its shards' norms all-reduced already; full_tensor() is local.
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.meter.add_grad_norm(norm)

    def step_done(self) -> bool:
        """Count one optimizer step; checkpoint when due. True when the run must stop."""
        self.step_in_epoch += 1
        self.global_step += 1
        self.timer.step()
        ends = self.step_in_epoch >= self.steps_per_epoch or self.done()  # the epoch, or the run (--max-steps)
        if ends:  # stop the clock before the script's evaluation, so images/s measures training
            self._timing = self.timer.stop()
        if self._bar is not None and self.global_step % self.args.log_every == 0:
            loss_sum, _, n = self.meter.sums.tolist()  # this rank's: one device sync
            self._bar.set_postfix(loss=f"{loss_sum / max(n, 1):.3f}")
        # Where the epoch ends, end_epoch checkpoints: once a step, the step's file is written.
        saved = bool(self.args.checkpoint_every) and self.global_step % self.args.checkpoint_every == 0 and not ends
        if saved:
            self.save()
        if self.stop_signal.should_stop(self.global_step,
                                        f"run.step_done() at step {self.global_step} (the stop-signal agreement)"):
            self.observers.step(self.global_step, last=True)
            if ends:
                # A complete epoch, or the run's last step (--max-steps): end_epoch evaluates, checkpoints and
                # records it, then stops (done() is True); a resume would find nothing left to train, or record.
                self._stop = True
                return True
            if not saved:
                self.save()
            self.stop_signal.announce(self.global_step, self.checkpoint_path)
            self.finish()  # not trained(): it only closes the stop signal's handlers and the observers
            raise SystemExit(0)  # checkpointed: exit status 0; the script's `finally` still tears down
        self.observers.step(self.global_step, last=self.done())
        return self.done()

    def end_epoch(self, eval_metrics: dict):
        """After the epoch (or at --max-steps): summary, metrics record, checkpoint."""
        timing = self._timing or self.timer.stop()
        self._timing = None
        with meeting(f"run.end_epoch() after step {self.global_step} (the epoch's training sums)"):
            sums = self.meter.global_sums()
        loss_sum, correct, n, norm_sum, norms = sums
        train = {"train_loss": loss_sum / max(n, 1), "train_acc1": 100.0 * correct / max(n, 1),
                 "grad_norm": norm_sum / norms if norms else None}
        memory = peak_memory_mb(self.env.device)
        self.last_record = record = {
            "event": "epoch", "epoch": self.epoch + 1, "step": self.global_step,
            "epoch_complete": self.step_in_epoch >= self.steps_per_epoch, **train, **eval_metrics, **timing,
            "lr": self.lr, **memory,  # the rate of the epoch's last step; this epoch's peaks, on GPUs
            "world_size": self.env.world_size, "global_batch": self.args.batch_size,
            "strategy": self.strategy, "device": device_name(self.env.device), **self.extra_record}
        # Checkpoint first, then record: a record that fails to write loses no training.
        self.save(sums)
        self.record(record)
        self.observers.epoch(record)
        acc5 = "" if math.isnan(eval_metrics["test_acc5"]) else f"acc5 {eval_metrics['test_acc5']:.2f}% "
        print0(f"epoch {self.epoch + 1}/{self.args.epochs} step {self.global_step} | "
               f"train loss {train['train_loss']:.4f} acc1 {train['train_acc1']:.2f}% "
               + (f"grad norm {train['grad_norm']:.3g} " if train["grad_norm"] is not None else "") + "| "
               f"test loss {eval_metrics['test_loss']:.4f} acc1 {eval_metrics['test_acc1']:.2f}% "
               f"{acc5}({eval_metrics['test_samples']} samples) | "
               f"{timing['epoch_seconds']:.1f} s, {timing['images_per_second']:.0f} samples/s"
               + (f" | peak memory {memory['peak_memory_mb']:,.0f} MB allocated, "
                  f"{memory['peak_reserved_mb']:,.0f} MB reserved" if memory["peak_memory_mb"] is not None else ""))
        # A signal that came during the evaluation is honoured now, with the epoch just checkpointed, not ten
        # steps into the next one (an evaluation longer than the launcher's grace period would end in SIGKILL).
        call = f"run.end_epoch() after step {self.global_step} (the stop-signal agreement)"
        self._stop = self._stop or self.stop_signal.should_stop(self.global_step, call, now=True)
        if self._stop and not self.trained():  # the run's last epoch: it has ended, nothing to continue
            self.stop_signal.announce(self.global_step, self.checkpoint_path)

    def record(self, record: dict):
        if self.args.metrics and self.env.is_main:
            with open(self.args.metrics, "a") as f:  # NaN (no evaluation, no top-5), inf (overflow): null in JSON
                f.write(json.dumps({key: None if isinstance(value, float) and not math.isfinite(value) else value
                                    for key, value in record.items()}) + "\n")

    def finish(self):
        """The end-of-run record (rank 0), with the last evaluation."""
        self.stop_signal.close()
        self.observers.close()
        if self.last_record is None or not self.trained():
            return  # stopped by a signal: the run goes on with --resume, it has not ended
        record = dict(self.last_record, event="end", step=self.global_step,
                      total_seconds=time.perf_counter() - self.started)
        self.record(record)
        print0(f"done: {self.global_step} steps, test acc1 {record['test_acc1']:.2f}%, "
               f"{record['total_seconds']:.1f} s in all")


# --- stop signals --------------------------------------------------------------------------------

class StopSignal:
    """On SIGTERM, SIGINT, SIGUSR1 (SLURM's warning before a time limit or preemption) or SIGHUP, checkpoint at the
    next step that every rank agrees on and exit 0. The handler only sets a flag: a rank that stopped alone would
    strand the others. A second Ctrl-C, FORCE_AFTER_S or more after the first signal, stops this process at once,
    unsaved (exit status 130): one Ctrl-C can come twice (from the terminal, and passed on by mp.spawn's parent).
    torchrun's workers have sessions of their own: torchrun passes the first Ctrl-C on as SIGINT and the second as
    SIGTERM, which forces too after a SIGINT (never after a SIGTERM: Slurm's comes twice, and must checkpoint)."""

    FORCE_AFTER_S = 2.0

    def __init__(self, distributed: bool, check_every: int = 10):
        self.received, self._first, self._received_at = None, None, None  # this process's own first: which, when
        self.check_every = check_every if distributed else 1  # one agreement per check_every steps: each waits for all
        self._previous = {sig: signal.signal(sig, self._handler) for sig in stop_signals()}

    def close(self):
        """Give the signals back to whoever handled them before (the default: exit)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handler(self, signum, frame):
        if self._first is None:  # this process's first (a rank may know of another's already)
            self._first, self._received_at = signum, time.monotonic()
            if self.received is None:
                self.received = signal.Signals(signum).name
                stop_under_way()
        elif signal.SIGINT in (signum, self._first) and signum in (signal.SIGINT, signal.SIGTERM) \
                and time.monotonic() - self._received_at >= self.FORCE_AFTER_S:
            for again in (signal.SIGINT, signal.SIGTERM):  # a copy (mp.spawn's parent passes it on) is not a third
                signal.signal(again, signal.SIG_IGN)
            raise KeyboardInterrupt

    def should_stop(self, global_step: int, call: str = "the stop-signal agreement", now: bool = False) -> bool:
        """True on every rank at the same step once any rank has received a signal. Checked every `check_every`
        steps, or at once with now=True; every rank must call it at the same points (`call` names where)."""
        if global_step % self.check_every and not now:
            return False
        stop = any_rank(self.received is not None, call)
        if stop and self.received is None:
            self.received = "a signal to another rank"
            stop_under_way()
        return stop

    def announce(self, global_step: int, path):
        print0(f"stopping at step {global_step} on {self.received}: " + (
            f"checkpoint saved to {path}; continue with --resume" if path
            else "no --checkpoint-dir, nothing saved; this run cannot be continued"))

