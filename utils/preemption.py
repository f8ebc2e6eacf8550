"""Stop cleanly on SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (which SLURM can send before a
time limit or preemption): checkpoint at the next step boundary that every rank agrees
on, then exit with status 0, so that a later run with --resume continues with the exact
next batch.

torchrun forwards SIGTERM to every worker and kills them 30 s later; SLURM's
`--signal=USR1@120` gives two minutes. The signal handler only sets a flag: the
ranks then agree, in one small collective, on the step at which all of them
stop. A rank that stopped alone would leave the others waiting in the next
gradient all-reduce.

Clusters and terminals signal a whole process group or job step, so the data-loading
workers of each rank receive the signal too. They ignore it (`ignore_stop_signals`,
run first in every worker) and leave the decision to their rank; the loader creates its
workers with the signals blocked (`stop_signals_blocked`), so that none can arrive
between a worker's start and that call.
"""
import atexit
import contextlib
import os
import signal
import threading

import torch
import torch.distributed as dist

from .cli import loader_sigchld_off
from .distributed import cpu_group, print0, stop_under_way

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised after the checkpoint is saved; exits the process with status 0."""

    def __init__(self):
        super().__init__(0)


class StopSignal:
    """A collective: should_stop() must be called by every rank at the same steps."""

    def __init__(self, distributed: bool, check_every: int = 10):
        self.received = None
        self.distributed = distributed
        self.check_every = check_every if distributed else 1
        # The agreement runs on a CPU (gloo) group: reading the result never waits for the
        # GPU, so it does not stall the queue of kernels; a peer that never comes fails it
        # after --dist-timeout (utils/distributed.py, cpu_group). None: the default group.
        self.group = cpu_group() if distributed else None
        self._previous = {sig: signal.signal(sig, self._handler) for sig in SIGNALS}

    def close(self):
        """Give the signals back to whoever handled them before (the default: exit)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handler(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum).name
            stop_under_way()

    def should_stop(self, global_step: int, now: bool = False) -> bool:
        """True on every rank at the same step once any rank has received a signal.
        Checked every `check_every` steps (one tiny CPU all-reduce each time), or at once
        with now=True (at a point every rank reaches together, such as after evaluation)."""
        if global_step % self.check_every and not now:
            return False
        # One process: nobody to agree with (and the group of one that distributed_fsdp.py
        # makes under plain python may be NCCL's, which reduces no CPU tensor).
        if not self.distributed or not (dist.is_available() and dist.is_initialized()):
            return self.received is not None
        flag = torch.tensor([0 if self.received is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)  # all ranks meet here
        if flag.item() and self.received is None:
            self.received = "a signal to another rank"
            stop_under_way()
        return bool(flag.item())

    def announce(self, global_step: int, path):
        where = f"checkpoint saved to {path}" if path else "no --checkpoint-dir, nothing saved"
        print0(f"stopping at step {global_step} on {self.received}: {where}; continue with --resume")


# --- data-loading workers --------------------------------------------------------------

def ignore_stop_signals():
    """In a DataLoader worker: the stop signals are its rank's to handle, not its own.
    (A forked worker would otherwise run its copy of the rank's handler, or die of the
    default action, and the rank would fail at its next batch before it could checkpoint.)"""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


_workers_ended_at_exit = False


def end_loader_workers_at_exit():
    """Once per process, before its first loader workers start: at exit, SIGKILL the
    daemonic children (the loader workers) still alive. multiprocessing's own exit handler
    ends them with SIGTERM and then waits for them, and ours ignore SIGTERM: a process
    that ends while a loader still holds workers (persistent ones, kept by an exception's
    traceback or a caller) would wait forever. Registered after multiprocessing's handler,
    so it runs before it (atexit runs handlers last in, first out). PyTorch 2.13 and 2.14
    register their own handler when a loader starts persistent workers that pin memory,
    after this one: it runs first and stops those iterators properly (its pin-memory
    thread, then its workers), as it should."""
    global _workers_ended_at_exit
    if not _workers_ended_at_exit:
        atexit.register(_end_loader_workers)
        _workers_ended_at_exit = True


def end_loader_workers_before_pytorch_at_exit():
    """Once a loader's workers have started: with PyTorch 2.11, make the handler above run
    before the ones that iterator registered. 2.11 registers one per worker of a loader
    with persistent workers that pins memory (`_clean_up_worker`, in
    torch/utils/data/dataloader.py): at exit it joins a worker that was never told to stop,
    for 5 s (MP_STATUS_CHECK_INTERVAL), then sends SIGTERM, which ours ignore. That is 5 s
    for every worker still alive (on an H200, a run's 15 evaluation workers kept it from
    ending for more than the benchmark's 30 s). Registered again, ours runs first and
    those find the workers gone. PyTorch 2.13.0 and 2.14.1 (read in their sources) have
    the single handler of the docstring above instead, which is left to run first."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    if hasattr(_MultiProcessingDataLoaderIter, "_clean_up_persistent_workers_atexit"):
        return
    atexit.unregister(_end_loader_workers)
    atexit.register(_end_loader_workers)


def _end_loader_workers():
    import multiprocessing
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if not children:
        return
    loader_sigchld_off()  # torch's loader would report each kill as a failed worker
    for child in children:
        child.kill()


@contextlib.contextmanager
def stop_signals_blocked():
    """Block the stop signals in this thread while loader workers are started: a child
    inherits the mask, so a signal sent to the whole group stays pending in the worker
    until `ignore_stop_signals` has run there, and is delivered here when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
