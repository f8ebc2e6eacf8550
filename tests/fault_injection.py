"""Test-only: run a training script with one fault injected at a chosen step.

    python tests/fault_injection.py --fault KIND [--rank R] [--step S] [--save N]
                                    [--once | --once-file PATH] -- SCRIPT [ARGS...]

It patches the shared bookkeeping (utils.run.TrainingRun.step_done, or the
torch.save that utils.checkpoint calls), then runs SCRIPT as `__main__` with
sys.argv = [SCRIPT, *ARGS], so the script cannot tell it is being tested. It
works as torchrun's entry point too: every worker runs the wrapper, and only
global rank R acts. This is a test fixture, not something a training job uses.

Faults, when global step S completes on global rank R:

    kill            SIGKILL this process (a crashed GPU, an OOM kill). Only on the
                    first attempt (as with --once): a restarted worker must survive.
    raise           raise RuntimeError("injected failure on rank R") (a bug).
    sigterm-self    SIGTERM to this process (a preemption notice).
    sigterm-parent  SIGTERM to the parent, i.e. torchrun's agent, which forwards
                    it to every worker (what SLURM or Kubernetes does to the job).
    kill-during-save
                    the N-th checkpoint write (--save N) writes half of the file,
                    then SIGKILLs the process: a crash in the middle of a save.
    signal-group    --send SIG to this process's whole process group, as Ctrl-C in
                    a terminal or `kill -- -PGID` deliver it (loader workers included).
    signal-job      --send SIG to the launcher and every process under it, as
                    SLURM's `scancel --signal` or a preemption deliver it to a job step.
    kill-launcher   SIGKILL torchrun's agent: its training processes must not train
                    on as orphans.
    signal-during-eval
                    the first evaluation takes --eval-seconds longer, and --send SIG
                    reaches this process in the middle of it.
    sigbus-loader   SIGBUS to one of this process's DataLoader workers: what a worker
                    gets when the shared-memory folder (/dev/shm) is full.
    pause           every rank (--rank -1) or rank R: create --marker PATH.RANK, then
                    wait before going on until PATH.go exists (a test acts on the network
                    meanwhile, at a known step, then creates it), for --pause-seconds at
                    most, or until the process receives a stop signal (then the run goes
                    on to its next stop check and stops there).
    hang-at-exit    rank R (every rank with --rank -1) never returns from the script's
                    last call, dist_utils.cleanup() (destroy_process_group): a job whose
                    work is done but whose processes do not end. --step is not used.

kill and raise act after the step's bookkeeping (a checkpoint due at step S is
written first). The signals are sent just before it, so that the run's own stop
check at that same step boundary can already see them.

--once: act only on the first attempt (TORCHELASTIC_RESTART_COUNT unset or 0).
--once-file PATH: act at most once among all the processes given the same PATH, whatever
their restart count (on several nodes each torchrun counts only its own restarts).

EXIT_STATUS_DIR=FOLDER in the environment: each rank writes its exit status to FOLDER/RANK
(record_exit_status).

FAULT_INJECTION="OPTIONS -- SCRIPT" in the environment gives the options and the script,
and the command line then only the script's arguments (for launchers that append their own).
"""
import argparse
import io
import os
import runpy
import shlex
import signal
import sys
import time

FAULTS = ("kill", "raise", "sigterm-self", "sigterm-parent", "kill-during-save", "signal-group",
          "signal-job", "kill-launcher", "signal-during-eval", "sigbus-loader", "pause", "hang-at-exit")
SIGNAL = signal.SIGTERM  # set from --send
PAUSE = {"marker": None, "seconds": 0.0}  # set from --marker, --pause-seconds


def _first_attempt() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0


def _claim(once_file) -> bool:
    """True for the first process to create once_file (O_EXCL: atomic), or without one."""
    if once_file is None:
        return True
    try:
        os.close(os.open(once_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _announce(message: str):
    from utils.cli import print_line  # one write: the job's other lines may come at once
    print_line(f"fault_injection: {message}")


def _fire(kind: str, rank: int, step: int, run=None):
    _announce(f"{kind} on rank {rank} at step {step} (pid {os.getpid()}, time {time.time():.3f})")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "raise":
        raise RuntimeError(f"injected failure on rank {rank}")
    elif kind == "sigterm-self":
        os.kill(os.getpid(), signal.SIGTERM)  # os.kill runs the Python handler before returning
    elif kind == "sigterm-parent":
        os.kill(os.getppid(), signal.SIGTERM)
    elif kind == "signal-group":
        os.killpg(os.getpgrp(), SIGNAL)
    elif kind == "signal-job":
        for pid in _tree(_launcher()):
            try:
                os.kill(pid, SIGNAL)
            except ProcessLookupError:
                pass
    elif kind == "kill-launcher":
        os.kill(_launcher(), signal.SIGKILL)
    elif kind == "pause":
        with open(f"{PAUSE['marker']}.{rank}", "w") as f:
            f.write(str(step))
        # The run's signal handler only records a signal (utils/run.py, StopSignal): look for it
        # between short sleeps, so that the pause ends soon after one; the run then stops at
        # its next stop check, as after any step.
        end = time.monotonic() + PAUSE["seconds"]
        while (time.monotonic() < end and not os.path.exists(f"{PAUSE['marker']}.go")
               and getattr(getattr(run, "stop_signal", None), "received", None) is None):
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))
    elif kind == "sigbus-loader":
        import multiprocessing
        workers = [child for child in multiprocessing.active_children() if child.daemon]
        assert workers, "sigbus-loader needs loader workers (--workers 1 or more)"
        os.kill(workers[0].pid, signal.SIGBUS)


def _launcher() -> int:
    """torchrun's agent; this process under plain python."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()


def _tree(root: int) -> list:
    """root and all its descendants, from /proc (Linux)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def patch_evaluate(rank: int, seconds: float):
    """The first evaluation on global rank `rank` gets the stop signal halfway through a
    pause of `seconds` (a long evaluation, longer than a launcher's grace period)."""
    import utils.metrics as metrics

    original, fired = metrics.evaluate, []

    def evaluate(model, loader, device, *args, **kwargs):
        result = original(model, loader, device, *args, **kwargs)
        if not fired:
            fired.append(True)
            import torch.distributed as dist
            me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            time.sleep(seconds / 2)
            if me == rank:
                _announce(f"{SIGNAL.name} during evaluation on rank {rank} (pid {os.getpid()})")
                os.kill(os.getpid(), SIGNAL)
            time.sleep(seconds / 2)
        return result

    metrics.evaluate = evaluate


def patch_cleanup(rank: int):
    """dist_utils.cleanup(), the scripts' last call, never returns on global rank `rank`."""
    import utils.distributed as dist_utils

    original = dist_utils.cleanup

    def cleanup():
        import torch.distributed as dist
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank in (me, -1):
            _announce(f"hang-at-exit on rank {me} (pid {os.getpid()})")
            while True:
                time.sleep(60)
        original()

    dist_utils.cleanup = cleanup


def patch_step_done(kind: str, rank: int, step: int, once: bool, once_file=None):
    from utils.run import TrainingRun

    original = TrainingRun.step_done
    before = kind.startswith("sigterm") or kind.startswith("signal") or kind == "kill-launcher"

    def step_done(self):
        due = (rank in (self.env.rank, -1) and self.global_step + 1 == step
               and (_first_attempt() or not once) and _claim(once_file))
        if due and before:
            _fire(kind, rank, step)
        stop = original(self)
        if due and not before:
            _fire(kind, self.env.rank, step, self)
        return stop

    TrainingRun.step_done = step_done


def patch_checkpoint_save(nth_save: int):
    """utils.checkpoint sees a torch whose save() crashes halfway through the N-th file."""
    import utils.checkpoint as checkpoint

    real_torch = checkpoint.torch
    saves = 0

    class TorchWithCrashingSave:
        def __getattr__(self, name):
            return getattr(real_torch, name)

        @staticmethod
        def save(obj, f, *args, **kwargs):
            nonlocal saves
            saves += 1
            if saves != nth_save:
                return real_torch.save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            real_torch.save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            _announce(f"kill-during-save: wrote {len(data) // 2} of {len(data)} bytes of save {saves}, "
                      f"killing pid {os.getpid()}")
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.torch = TorchWithCrashingSave()


def record_exit_status(folder):
    """FOLDER/RANK holds this process's exit status once it ends through os._exit, as a rank that joined a group
    does (utils.lifecycle.leave): torchrun, itself stopped by a signal, reports none. Not written by the loader
    workers, forked with the patch, nor by a process that a signal killed."""
    own, real_exit = os.getpid(), os._exit

    def recorded(code):
        if os.getpid() == own:
            with open(os.path.join(folder, os.environ.get("RANK", "0")), "w") as f:
                f.write(str(code))
        real_exit(code)
    os._exit = recorded


def main():
    argv = sys.argv[1:]
    if os.environ.get("FAULT_INJECTION"):
        # Options and script from the environment, every argument for the script: a launcher
        # that appends its own arguments (scripts/launch_multi_node.sh with SCRIPT=this file)
        # runs the fault unchanged.
        argv = [*shlex.split(os.environ["FAULT_INJECTION"]), *argv]
    if "--" not in argv:
        sys.exit("usage: fault_injection.py --fault KIND [--rank R] [--step S] [--save N] "
                 "[--once | --once-file PATH] -- SCRIPT [ARGS...]")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="fault_injection.py")
    parser.add_argument("--fault", choices=FAULTS, required=True)
    parser.add_argument("--rank", type=int, default=0, help="global rank that fails")
    parser.add_argument("--step", type=int, default=1, help="global step after which it fails")
    parser.add_argument("--save", type=int, default=2, help="kill-during-save: which save crashes")
    parser.add_argument("--once", action="store_true", help="only on the first attempt")
    parser.add_argument("--once-file", default=None, help="at most once among processes sharing this file")
    parser.add_argument("--send", default="TERM", choices=["TERM", "INT", "USR1", "HUP"],
                        help="signal-group, signal-job, signal-during-eval: which signal")
    parser.add_argument("--eval-seconds", type=float, default=4.0, help="signal-during-eval: the pause")
    parser.add_argument("--marker", default=None, help="pause: the file to create (.RANK is appended)")
    parser.add_argument("--pause-seconds", type=float, default=1.0, help="pause: how long at most")
    opts = parser.parse_args(argv[:split])
    global SIGNAL
    SIGNAL = getattr(signal, "SIG" + opts.send)
    PAUSE.update(marker=opts.marker, seconds=opts.pause_seconds)
    if opts.fault == "pause" and not opts.marker:
        sys.exit("fault_injection.py: pause needs --marker PATH")
    script, script_args = argv[split + 1], argv[split + 2:]
    if opts.fault == "sigterm-parent" and "TORCHELASTIC_RUN_ID" not in os.environ:
        sys.exit("fault_injection.py: sigterm-parent needs torchrun as the parent (it would signal "
                 "whatever started this process)")

    # The script's own directory first, as `python SCRIPT` would have it (models/, utils/).
    script_dir = os.path.dirname(os.path.abspath(script))
    sys.path.insert(0, script_dir)

    if opts.fault == "kill-during-save":
        if _first_attempt():
            patch_checkpoint_save(opts.save)
    elif opts.fault == "signal-during-eval":
        patch_evaluate(opts.rank, opts.eval_seconds)
    elif opts.fault == "hang-at-exit":
        patch_cleanup(opts.rank)
    else:
        patch_step_done(opts.fault, opts.rank, opts.step, once=opts.once or opts.fault == "kill",
                        once_file=opts.once_file)

    if os.environ.get("EXIT_STATUS_DIR"):
        record_exit_status(os.environ["EXIT_STATUS_DIR"])
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
