"""Full-state checkpoints: written atomically, read with weights_only=True.

A checkpoint holds everything needed to continue with the exact next batch:
model, optimizer, scheduler, GradScaler (mixed precision), the epoch and the
number of optimizer steps already taken in it, the partial training sums of that
epoch, and the RNG states. Only tensors and plain Python values go in, so
`torch.load(path, weights_only=True)` can read it without running pickled code.
"""
import enum
import errno
import fcntl
import os
import pickle
import random
import shutil
import socket
import tempfile
import warnings

import numpy as np
import torch

from .cli import UsageError

FORMAT = "multi-gpu-training-checkpoint/1"
FILENAME = "checkpoint.pt"
LOCKNAME = ".lock"
_held_locks = []  # open descriptors of the locks this process holds, until it exits


def atomic_save(obj, path: str):
    """Write to a temporary file in the same directory, then os.replace it into place.

    os.replace is atomic on POSIX within one file system, so a crash (or a kill)
    mid-save leaves the previous checkpoint intact, never half a file.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    umask = os.umask(0)
    os.umask(umask)
    try:
        # mkstemp makes the file private (0600); give it the mode any new file gets, so
        # that colleagues sharing the directory can read and resume it.
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it visible
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def remove_stale_temporaries(path: str):
    """Delete the half-written temporaries that a crash during atomic_save left beside path."""
    directory, name = os.path.split(os.path.abspath(path))
    if os.path.isdir(directory):
        for entry in os.listdir(directory):
            if entry.startswith("." + name + ".") and entry.endswith(".tmp"):
                try:
                    os.unlink(os.path.join(directory, entry))
                except FileNotFoundError:
                    pass


def rng_state(device: torch.device = None) -> dict:
    """The random generators' states: the CPU's, numpy's, Python's, and those of the
    accelerator when `device` (the rank's training device) is one: a run on the CPU
    beside a GPU never touches the GPU (reading its generators would start CUDA there)."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": random.getstate(),
    }
    accelerator = _accelerator_module(device)
    if accelerator is not None:
        # Saved under the device type's name ("cuda", "xpu"): a resume on another kind of
        # machine leaves that generator alone.
        state[torch.accelerator.current_accelerator().type] = accelerator.get_rng_state_all()
    return state


def _accelerator_module(device):
    """torch.cuda, torch.xpu...: the module that holds the accelerator's random generators,
    if `device` is on the accelerator and it keeps one per device (get_rng_state_all)."""
    if device is None or device.type == "cpu" or not torch.accelerator.is_available():
        return None
    module = torch.get_device_module(torch.accelerator.current_accelerator())
    return module if hasattr(module, "get_rng_state_all") else None


def set_rng_state(state: dict, device: torch.device = None):
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    accelerator = _accelerator_module(device)
    if accelerator is not None:
        saved = state.get(torch.accelerator.current_accelerator().type)
        if saved is not None and len(saved) == torch.accelerator.device_count():
            accelerator.set_rng_state_all(saved)


def read_file(path: str, what: str = "checkpoint"):
    """torch.load with weights_only=True onto the CPU, or UsageError with one readable line."""
    if not os.path.isfile(path):
        raise UsageError(f"no {what} at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        if "Unsupported global" in str(exc):  # weights_only met a class it will not import
            # torch's own hint suggests weights_only=False; for a file from elsewhere that
            # would run whatever code it holds. These scripts never write such objects.
            raise UsageError(f"cannot read {what} {path}: it holds Python objects other than tensors "
                             "and plain values, which are not loaded because loading them could run "
                             "code; it was not written by these scripts") from None
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise UsageError(f"cannot read {what} {path}: it is corrupt or not a PyTorch file "
                         f"({type(exc).__name__}: {first})") from None


def load(path: str) -> dict:
    """Read a checkpoint of ours, or raise UsageError with one readable line."""
    state = read_file(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"{path} is not a checkpoint written by these scripts "
                         f"(expected format {FORMAT!r})")
    return state


def lock_directory(directory: str):
    """Make `directory` this run's alone, for as long as this process lives.

    The lock is a POSIX record lock (fcntl.lockf) on DIRECTORY/.lock, which the kernel
    releases when the process ends, however it ends: a run that crashed or was killed
    leaves no stale lock, and a worker restarted by torchrun takes it back. Unlike
    flock(), it is not inherited by forked DataLoader workers (they would keep it after
    the rank died) and it works on NFS through the lock manager. The file names the
    holder, so the run that is refused can say which one it met. A second run is
    refused with UsageError, and so is a directory that cannot be created or written.
    """
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UsageError(f"--checkpoint-dir {directory} is a file, not a directory") from None
    except OSError as exc:
        raise UsageError(f"cannot create --checkpoint-dir {directory}: {exc.strerror}") from None
    path = os.path.join(directory, LOCKNAME)
    try:
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "Permission denied")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise UsageError(f"--checkpoint-dir {directory} is not writable: {exc.strerror}") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() if exc.errno in (
            errno.EACCES, errno.EAGAIN) else None
        os.close(fd)
        if holder is None:  # ENOLCK and the like: a file system without locks
            raise UsageError(f"cannot lock --checkpoint-dir {directory} ({exc.strerror}): its file system "
                             "offers no locks; use a local or lock-capable shared directory") from None
        raise UsageError(f"--checkpoint-dir {directory} is in use by another run "
                         f"({holder or 'unknown holder'}): wait until it ends, or choose another "
                         "directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode(), 0)
    _held_locks.append(fd)


# --- sharded checkpoints (distributed_fsdp.py) ------------------------------------------------
#
# Every rank writes its own shards of the model and optimizer with torch.distributed.checkpoint
# (DCP) into SHARDED_PREFIX + step, a folder beside checkpoint.pt; rank 0 then writes
# checkpoint.pt as always (scheduler, RNG, epoch, step, ...), naming that folder. The atomic
# os.replace of checkpoint.pt is the commit: a crash in the middle of the shards leaves
# checkpoint.pt naming the previous, complete folder. Only tensors go through DCP, so that
# DCP never unpickles a value (it would, with torch.load(weights_only=False)); the
# optimizer's param_groups (plain values) go into checkpoint.pt.

SHARDED_PREFIX = "sharded-step"
_DCP_METADATA = ".metadata"


def sharded_folder(checkpoint_path: str, name: str) -> str:
    """The shards' folder that a checkpoint.pt names: beside that file, wherever it is."""
    return os.path.join(os.path.dirname(os.path.abspath(checkpoint_path)), name)


def save_sharded(model, optimizer, folder: str) -> list:
    """Write this rank's shards into `folder` (a collective: every rank calls it). Returns the
    optimizer's param_groups, for checkpoint.pt. When it returns on any rank, every rank has
    written (and fsynced) its files and rank 0 the folder's metadata: DCP gathers every
    rank's result before it writes the metadata, and only then returns."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(model, optimizer)
    # Buffers (batch-norm statistics) are whole on every rank but differ between ranks; DCP
    # writes one copy of such a tensor, by default from whichever rank has the least to write.
    # dedup_save_to_lowest_rank: rank 0's, the buffers a DDP checkpoint holds.
    dcp.save({"model": model_state, "optimizer": optim_state["state"]}, checkpoint_id=folder,
             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    return optim_state["param_groups"]


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata file is a pickle: read it allowing only DCP's own metadata classes and
    the torch types they hold, so that a crafted folder cannot run code."""

    ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
        ("torch", "Size"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
        # Python 3.13 pickles the two as pathlib._local's (seen with 3.13.0)
        ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            # Early Python 3.11 releases (Debian 12's 3.11.2 among them) pickle an Enum member,
            # here DCP's _MEM_FORMAT_ENCODING, as getattr(its class, its name); 3.11.7 pickles
            # it by value again. The real getattr would hand out any attribute of an allowed
            # class (a method of PosixPath that writes files): this stand-in gives enum members.
            return _enum_member
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata never holds")


def _enum_member(cls, name):
    # isinstance: what an enum's member table holds is checked too (a pickle can rewrite it).
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str):
        member = cls.__members__.get(name)
        if isinstance(member, cls):
            return member
    raise pickle.UnpicklingError(f"it asks getattr for {name!r}, which is not a member of an enum")


def _checked_reader(folder: str, metadata):
    """DCP's FileSystemReader for `folder`, handed the metadata that check_sharded_folder read.
    Its own read_metadata would unpickle the file again with pickle.load: a second read (of a
    file that may have changed) by an unpickler that resolves names its own way (the real
    getattr, where ours gives enum members only). What is checked must be what is used."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # a rank's own metadata file: these scripts write none
                raise FileNotFoundError(f"no metadata of rank {kwargs['rank']} in {folder}")
            # What FileSystemReader.read_metadata does after its pickle.load (PyTorch 2.11 to 2.14).
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return CheckedReader(folder)


def check_sharded_folder(folder: str):
    """DCP's metadata of `folder`, read safely; UsageError in one line if the folder is
    missing, incomplete (a save that died before its end) or not ours (non-tensor items)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    path = os.path.join(folder, _DCP_METADATA)
    if not os.path.isfile(path):
        raise UsageError(f"no sharded checkpoint at {folder} (its {_DCP_METADATA} is missing: never written, "
                         "or the save did not finish)")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise UsageError(f"cannot read sharded checkpoint {folder}: {type(exc).__name__}: {first}") from None
    items = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(items, dict) or not all(isinstance(v, TensorStorageMetadata) for v in items.values()):
        raise UsageError(f"sharded checkpoint {folder} holds items other than tensors: "
                         "it was not written by these scripts")
    return metadata


def load_sharded(model, optimizer, folder: str, param_groups: list):
    """Load `folder` into the (sharded) model and optimizer, whatever the number of ranks that
    wrote it: DCP reads the pieces of the saved shards that this rank's shards cover. A
    collective. UsageError if the folder does not fit the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    metadata = check_sharded_folder(folder)
    # The current state is the template: DCP loads into its tensors (this rank's shards).
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state["state"]}
    try:
        dcp.load(state, storage_reader=_checked_reader(folder, metadata))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optimizer"], "param_groups": param_groups})
    except (Exception, dcp.CheckpointException) as exc:  # a missing key or another shape: on every rank
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise UsageError(f"sharded checkpoint {folder} does not fit this model/optimizer: {first}") from None


def read_sharded(folder: str) -> dict:
    """Every tensor of a sharded checkpoint, whole, on the CPU, in one process (no process
    group): {"model.conv1.weight": tensor, "optimizer.<name>.momentum_buffer": tensor, ...}."""
    import torch.distributed.checkpoint as dcp
    metadata = check_sharded_folder(folder)
    state = {name: torch.empty(item.size, dtype=item.properties.dtype)
             for name, item in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, storage_reader=_checked_reader(folder, metadata), no_dist=True)
        except (Exception, dcp.CheckpointException) as exc:  # a shard file cut short or missing (the
            # latter a BaseException: DCP's own failures would otherwise pass `except Exception`)
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise UsageError(f"cannot read sharded checkpoint {folder}: {type(exc).__name__}: {first}") from None
    return state


def load_full(path: str) -> dict:
    """A checkpoint of ours as a plain one, whatever wrote it: a sharded checkpoint's model
    and optimizer are read whole from its folder, the optimizer in torch's own layout
    (parameters numbered in param_groups order), as a DDP checkpoint holds them."""
    state = load(path)
    if "sharded" not in state:
        return state
    tensors = read_sharded(sharded_folder(path, state["sharded"]["folder"]))
    groups = state["sharded"]["param_groups"]
    names = [name for group in groups for name in group["params"]]
    optim_state = {}
    for index, name in enumerate(names):
        prefix = f"optimizer.{name}."
        entries = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}
        if entries:
            optim_state[index] = entries
    numbered, start = [], 0
    for group in groups:
        numbered.append(dict(group, params=list(range(start, start + len(group["params"])))))
        start += len(group["params"])
    model = {key[len("model."):]: value for key, value in tensors.items() if key.startswith("model.")}
    return dict(state, model=model, optimizer={"state": optim_state, "param_groups": numbered})


def remove_unreferenced_shards(directory: str, keep: str = None):
    """Delete the shard folders in `directory` but `keep` (the one checkpoint.pt names): what a
    crash during a sharded save left behind, finished or not."""
    if os.path.isdir(directory):
        for entry in os.listdir(directory):
            if entry.startswith(SHARDED_PREFIX) and entry != keep:
                shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
