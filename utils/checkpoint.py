"""Full-state checkpoints (TrainingRun.save, utils/run.py: all that continuing with the exact next batch needs),
written atomically. Only tensors and plain values go in: `torch.load(path, weights_only=True)` runs no pickled code."""
import contextlib
import errno
import fcntl
import os
import random
import socket
import time

import numpy as np
import torch

from .cli import UsageError, error_line, first_line, print_line

FORMAT = "multi-gpu-training-checkpoint/1"
FILENAME = "checkpoint.pt"
LOCKNAME = ".lock"
RUN_TAG = ", torchrun run {}"  # how a lock line ends under torchrun: --check-args tells this job from another by it


def atomic_save(obj, path: str):
    """A temporary file in the same directory, then os.replace (atomic within a file system):
    a crash or a kill mid-save leaves the previous checkpoint intact, never half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:  # "x": a new file, never another writer's (two runs where no lock works may have rank 0s of one pid)
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it visible
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def remove_stale_temporaries(path: str):
    """Delete the half-written temporaries that a crash during atomic_save left beside path."""
    directory, name = os.path.split(os.path.abspath(path))
    for entry in os.listdir(directory) if os.path.isdir(directory) else ():
        if entry.startswith(f".{name}.") and entry.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, entry))


def rng_state(device: torch.device = None) -> dict:
    """The CPU's, numpy's and Python's generators, and the accelerator's where `device` (the rank's)
    is on it: a CPU run beside a GPU never starts CUDA by reading its generators."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
             "python": random.getstate()}
    accelerator, kind = _accelerator_module(device)
    if accelerator is not None:  # under the device type's name: a resume on another kind leaves it alone
        # Its own device, and every device this process sees (DataParallel draws on all of them): only rank 0
        # saves, and its copy of device r was never drawn from, while its own device drew as every rank's did.
        state[f"{kind}_own"] = accelerator.get_rng_state(device)
        if hasattr(accelerator, "get_rng_state_all"):  # torch.mps has one device, and no _all
            state[kind] = accelerator.get_rng_state_all()
    return state


def _accelerator_module(device):
    """(torch.cuda, torch.xpu...: the module of the accelerator's generators, its type) if `device` is on it."""
    if device is None or device.type == "cpu" or not torch.accelerator.is_available():
        return None, None
    kind = torch.accelerator.current_accelerator().type
    module = torch.get_device_module(kind)
    return (module, kind) if hasattr(module, "get_rng_state") else (None, None)


def set_rng_state(state: dict, device: torch.device = None):
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(state["python"])
    accelerator, kind = _accelerator_module(device)
    if accelerator is None:
        return
    if len(state.get(kind) or ()) == torch.accelerator.device_count():
        accelerator.set_rng_state_all(state[kind])
    if state.get(f"{kind}_own") is not None:  # then this rank's device: the state every rank's own had
        accelerator.set_rng_state(state[f"{kind}_own"], device)


def read_file(path: str, what: str = "checkpoint"):
    """torch.load with weights_only=True onto the CPU, or UsageError with one readable line."""
    if not os.path.isfile(path):
        raise UsageError(f"no {what} at {path}" + (f": a folder; name its file, {os.path.join(path, FILENAME)}"
                                                    if os.path.isdir(path) else ""))
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        if "Unsupported global" in str(exc):  # a class weights_only will not import; none in our files
            # Not torch's hint, weights_only=False: for a file from elsewhere it runs whatever code it holds.
            raise UsageError(f"cannot read {what} {path}: it holds Python objects other than tensors and plain values, "
                             "left unloaded as loading them could run code; these scripts did not write it") from None
        raise UsageError(f"cannot read {what} {path}: it is corrupt or not a PyTorch file "
                         f"({first_line(exc, typed=True)})") from None


def load(path: str) -> dict:
    """Read a checkpoint of ours, or raise UsageError with one readable line."""
    state = read_file(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"{path} is not a checkpoint written by these scripts (expected format {FORMAT!r})")
    return state


def writable(flag: str, path: str, make: bool = True, file: bool = False):
    """`path` (a folder, or with `file` a file in one) made where this process can write, or a UsageError naming
    why (the first of its parents that is a file, one it cannot write). make=False (--check-args): nothing made."""
    existing = folder = os.path.dirname(os.path.abspath(path)) if file else os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    where = "it" if existing == os.path.abspath(path) else existing  # the path itself, or a folder above it
    why = (f"{where} is a file, not a directory" if not os.path.isdir(existing) else
           f"{where} is not writable" if not os.access(existing, os.W_OK | os.X_OK) else None)
    try:
        if make and not why:
            os.makedirs(folder, exist_ok=True)
        if file and not why and (make or os.path.exists(path)):
            open(path, "a").close()  # nothing written: an empty file made, or one there opened
    except OSError as exc:
        why = exc.strerror
    if why:
        raise UsageError(f"cannot write {flag} {path}: {why}")


def lock_directory(directory: str, take: bool = True):
    """`directory` this run's alone while this process lives (UsageError for a second run, or a folder that cannot
    be made or written; a warning where its file system has no locks): a POSIX record lock (fcntl.lockf) on
    DIRECTORY/.lock, which the kernel releases however the process ends (no stale lock after a crash or a kill).
    Unlike flock(), forked loader workers do not inherit it, and NFS honours it. Returns the line it writes there:
    the holder, named in a refusal and compared by the other nodes. take=False, a check before the run: nothing
    made or written, a .lock tested with a shared lock (checks on several nodes pass each other): None, or the
    line of this torchrun job (its run id ends it: a node that joins the job, or comes back), which passes."""
    writable("--checkpoint-dir", directory, make=take)
    if not take and not os.path.isfile(os.path.join(directory, LOCKNAME)):
        return None  # no run has held it
    try:
        fd = os.open(os.path.join(directory, LOCKNAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise UsageError(f"--checkpoint-dir {directory} is not writable: {exc.strerror}") from None
    try:
        fcntl.lockf(fd, (fcntl.LOCK_EX if take else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            held_by = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown holder"
            os.close(fd)
            if not take and held_by.endswith(RUN_TAG.format(os.environ.get("TORCHELASTIC_RUN_ID", "\0"))):
                return held_by
            raise UsageError(f"--checkpoint-dir {directory} is in use by another run ({held_by}): wait until it ends, "
                             "or choose another directory" if exc.errno in (errno.EACCES, errno.EAGAIN) else
                             f"cannot lock --checkpoint-dir {directory}: {exc.strerror}") from None
        # NFS without its lock daemon (ENOLCK), Lustre mounted noflock (ENOSYS): train all the same (a folder every
        # node sees may be only there); a fresh run still refuses a checkpoint it finds.
        print_line(error_line(f"cannot lock --checkpoint-dir {directory} ({exc.strerror}): its file system offers "
                              "no locks, so a second run started on it at the same time would not be refused; start "
                              "one run per folder", kind="warning"))
    if not take:
        return os.close(fd)
    # Written through: this process keeps the file open, and NFS would write it to the server only on close.
    line = f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}" + (
        RUN_TAG.format(os.environ["TORCHELASTIC_RUN_ID"]) if "TORCHELASTIC_RUN_ID" in os.environ else "")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{line}\n".encode(), 0)
    with contextlib.suppress(OSError):  # a file system without fsync (some FUSE mounts)
        os.fsync(fd)
    return line


def holder(directory: str):
    """The line of the run holding `directory` (lock_directory), or None; not in the holder (a close drops its lock)."""
    with contextlib.suppress(OSError), open(os.path.join(directory, LOCKNAME), errors="replace") as f:
        return f.read().strip()


def look_again(look, want, patience: float):
    """look() every second until it answers `want`, for `patience` s at most; its last answer. What another node
    wrote may appear here late: NFS answers from its cached view of a folder for up to acdirmax (60 s by default)."""
    until = time.monotonic() + patience
    while (seen := look()) != want and time.monotonic() < until:
        time.sleep(1)
    return seen


def check_kind(state: dict, path: str, sharded: bool):
    """A complete checkpoint of ours, resumed by the kind of script that wrote it: sharded (FSDP) or whole."""
    if ("sharded" in state) != sharded:
        raise UsageError(f"checkpoint {path} is {'not ' * sharded}sharded: resume it with the script that wrote it "
                         f"({state.get('strategy', 'unknown')})")
    needed = ("sharded",) if sharded else ("model", "optimizer")
    if missing := [key for key in (*needed, "scheduler", "epoch", "step_in_epoch", "global_step", "train_sums",
                                   "rng") if key not in state]:
        raise UsageError(f"checkpoint {path} lacks {', '.join(missing)}: it is not a complete checkpoint of these "
                         "scripts")


class WholeState:
    """The model and optimizer of a checkpoint where every rank has all of them (DDP, one process): their
    state_dicts in checkpoint.pt (utils/sharded.py: sharded across ranks). TrainingRun calls check(state,
    path) before the ranks agree to resume, load() after, save(step, path) on every rank (rank 0's result
    is written), saved(path) once checkpoint.pt names it, and tidy(path) when the run starts (rank 0)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    @staticmethod
    def check(state: dict, path: str, patience: float = 0.0):
        check_kind(state, path, sharded=False)

    def load(self, state: dict, path: str, own: bool = False):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        # A buffer keeps its saved layout (channels_last or not); CUDA's fused SGD needs its parameter's strides.
        for param, slots in self.optimizer.state.items():
            slots.update({k: torch.empty_like(param, dtype=v.dtype).copy_(v) for k, v in slots.items()
                          if torch.is_tensor(v) and v.shape == param.shape and v.stride() != param.stride()})

    def save(self, step: int, path: str) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    saved = tidy = lambda self, path: None  # nothing beside checkpoint.pt to keep or remove
