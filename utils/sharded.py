"""Sharded checkpoints, for distributed_fsdp.py: the model and the optimizer split across ranks.

Every rank writes its own shards of the model and optimizer with torch.distributed.checkpoint
(DCP) into a new folder beside checkpoint.pt, SHARDED_PREFIX + step + this run's token (never
into a folder that a copy kept from another run names); rank 0 then writes
checkpoint.pt as always (scheduler, RNG, epoch, step, ...), naming that folder. The atomic
os.replace of checkpoint.pt is the commit: a crash in the middle of the shards leaves
checkpoint.pt naming the previous, complete folder. Only tensors go through DCP, so that
DCP never unpickles a value (it would, with torch.load(weights_only=False)); the
optimizer's param_groups (plain values) go into checkpoint.pt.
"""
import contextlib
import enum
import os
import pickle
import shutil

import torch

from .checkpoint import LOCKNAME, check_kind, look_again
from .cli import UsageError, first_line

SHARDED_PREFIX = "sharded-step"
_DCP_METADATA = ".metadata"


class ShardedState:
    """checkpoint.WholeState's kind for a model and optimizer sharded across ranks (FSDP): the
    shards in a folder of their own beside checkpoint.pt, which names it."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.folder = self.param_groups = self.token = None  # the folder this run's checkpoint.pt names
        self.previous = None  # the folder it named before the last save

    @staticmethod
    def check(state: dict, path: str, patience: float = 0.0):
        """Before the collective load, and by --check-args. `patience`: how long to look again for the folder's
        .metadata, which rank 0 wrote before checkpoint.pt named the folder (every rank looked that name up,
        missing, as DCP's save began: a node on NFS may answer from that view)."""
        check_kind(state, path, sharded=True)
        folder = sharded_folder(path, state["sharded"]["folder"])
        look_again(lambda: os.path.isfile(os.path.join(folder, _DCP_METADATA)), True, patience)
        check_sharded_folder(folder)

    def load(self, state: dict, path: str, own: bool = False):
        """A collective: the whole run fails alike if the shards do not fit. own: `path` is this
        run's own checkpoint.pt, whose folder a later save replaces."""
        shards = state["sharded"]
        folder = sharded_folder(path, shards["folder"])
        load_sharded(self.model, self.optimizer, folder, shards["param_groups"], check_sharded_folder(folder))
        if own:
            self.folder, self.param_groups = shards["folder"], shards["param_groups"]

    def save(self, step: int, path: str) -> dict:
        """A collective: every rank writes its shards; DCP returns once all have."""
        if self.token is None:  # rank 0's, once a run: every rank writes into the same folder
            token = [os.urandom(4).hex()]
            torch.distributed.broadcast_object_list(token, src=0)
            self.token = token[0]
        name = f"{SHARDED_PREFIX}{step}-{self.token}"
        if name != self.folder:  # not saved at this step yet (a folder left by a crash is gone: tidy)
            self.previous, self.folder = self.folder, name
            # Beside the checkpoint.pt to come: atomic_save replaces a symbolic link there by the file.
            folder = os.path.join(_directory(path), name)
            self.param_groups = save_sharded(self.model, self.optimizer, folder)
        return {"sharded": {"folder": self.folder, "param_groups": self.param_groups}}

    def saved(self, path: str):
        """Once checkpoint.pt names the new folder (the commit), the one it named before goes,
        unless another checkpoint names it too (a copy kept: cp checkpoint.pt best.pt)."""
        if self.previous is not None and self.previous not in self.kept(path):
            shutil.rmtree(os.path.join(_directory(path), self.previous), ignore_errors=True)
        self.previous = None

    def tidy(self, path: str):
        """At the start (rank 0, in the folder it has locked): the folders of saves that never became a
        checkpoint (a crash during a save, finished or not)."""
        keep, directory = self.kept(path), _directory(path)
        for entry in os.listdir(directory):
            if entry.startswith(SHARDED_PREFIX) and entry not in keep:
                shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)

    def kept(self, path: str) -> set:
        """The folders beside checkpoint.pt (`path`) that stay: the one it names, and those that another
        checkpoint there names (a copy, or one renamed: best.pt, checkpoint.pt.bak; the one resumed from)."""
        names = {self.folder}
        for entry in os.scandir(_directory(path)):
            # Not .lock: closing a file that this process holds a lock on would release the lock.
            if entry.name != LOCKNAME and entry.is_file():
                with contextlib.suppress(Exception):  # not a checkpoint of ours
                    # mmap: what a large file holds is not read (this runs at every save).
                    state = torch.load(entry.path, map_location="cpu", weights_only=True, mmap=True)
                    names.add(state["sharded"]["folder"])
        return names


def _directory(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def sharded_folder(checkpoint_path: str, name) -> str:
    """The shards' folder that a checkpoint.pt names: beside that file, wherever it is (beside
    its target, for a symbolic link: latest.pt -> run1/checkpoint.pt names run1's folder)."""
    if not (isinstance(name, str) and name.startswith(SHARDED_PREFIX) and os.path.basename(name) == name):
        # A folder elsewhere would be read, and deleted once replaced: a checkpoint is data, never a path to follow.
        raise UsageError(f"checkpoint {checkpoint_path} names {name!r} as its shards, not a folder beside it")
    return os.path.join(os.path.dirname(os.path.realpath(checkpoint_path)), name)


def save_sharded(model, optimizer, folder: str) -> list:
    """Write this rank's shards into `folder` (a collective: every rank calls it). Returns the
    optimizer's param_groups, for checkpoint.pt. When it returns on any rank, every rank has
    written (and fsynced) its files and rank 0 the folder's metadata: DCP gathers every
    rank's result before it writes the metadata, and only then returns."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict

    class Writer(dcp.FileSystemWriter):
        def write_data(self, *args, **kwargs):
            try:
                return super().write_data(*args, **kwargs)
            except Exception as exc:
                raise storage_error(exc) from exc

        def finish(self, *args, **kwargs):
            super().finish(*args, **kwargs)
            # 2.11's finish fsyncs .metadata before it flushes Python's buffer (2.14's flushes first): an
            # empty file's. Its bytes must be on disk before checkpoint.pt names the folder and the old one goes.
            fd = os.open(os.path.join(self.path, ".metadata"), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    model_state, optim_state = get_state_dict(model, optimizer)
    # Buffers (batch-norm statistics) are whole on every rank but differ between ranks; DCP
    # writes one copy of such a tensor, by default from whichever rank has the least to write.
    # dedup_save_to_lowest_rank: rank 0's, the buffers a DDP checkpoint holds.
    try:
        # overwrite=False: DCP refuses a folder that holds a checkpoint (its .metadata) rather than mix two.
        dcp.save({"model": model_state, "optimizer": optim_state["state"]},
                 storage_writer=Writer(folder, overwrite=False),
                 planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    except dcp.CheckpointException as exc:  # a BaseException, which no handler of failures would see
        interrupted(exc)
        raise SaveFailed(f"the sharded checkpoint could not be written to {folder}: {causes(exc)}") from None
    return optim_state["param_groups"]


class SaveFailed(Exception):
    """A sharded save failed on some rank (a disk full, a quota, an I/O error): every rank raises it."""


class StorageError(Exception):
    """A shard file that DCP could not write or read (unlike a checkpoint that does not fit the model),
    with the first line of the error that started it: DCP hands it to rank 0 pickled, without its chain."""


def storage_error(exc: Exception) -> StorageError:
    # An OSError in the chain is the cause (a disk full, a quota, an I/O error): torch.save's writer
    # reports one as a RuntimeError of its own ("unexpected pos 704 vs 598"), the OSError its context.
    cause = exc
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    return StorageError(first_line(cause or exc, typed=True))


def interrupted(exc):
    """DCP catches any BaseException of a rank's save or load and raises a CheckpointException on every
    rank (checkpoint/utils.py, _DistWrapper): a Ctrl-C (KeyboardInterrupt) in it is a Ctrl-C again, not a
    checkpoint that failed or does not fit."""
    if any(isinstance(err, KeyboardInterrupt) for err, _ in exc.failures.values()):
        raise KeyboardInterrupt from None


def causes(exc) -> str:
    """The first line of each rank's error in a CheckpointException (DCP's failure, raised on every
    rank): "rank 1: OSError: [Errno 28] No space left on device"; ranks that failed alike share one."""
    ranks = {}
    for rank, (err, _) in sorted(exc.failures.items()):
        line = str(err) if isinstance(err, StorageError) else first_line(err, typed=True)
        ranks.setdefault(line, []).append(str(rank))
    said = [f"rank{'s' * (len(r) > 1)} {', '.join(r)}: {line}" for line, r in ranks.items()]
    return "; ".join(said[:3]) + (f"; and {len(said) - 3} more" if len(said) > 3 else "")  # one line, at any size


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


def checked_reader(folder: str, metadata):
    """DCP's FileSystemReader for `folder`, handed the metadata that check_sharded_folder read.
    Its own read_metadata would unpickle the file again with pickle.load: a second read (of a
    file that may have changed) by an unpickler that resolves names its own way (the real
    getattr, where ours gives enum members only). What is checked must be what is used."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            # What FileSystemReader.read_metadata does after its pickle.load (PyTorch 2.11 to 2.14).
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, *args, **kwargs):
            # A file cut short or missing fails as EOFError, OSError, RuntimeError...: told apart from a
            # model that does not fit, which fails before, in the plan.
            try:
                return super().read_data(*args, **kwargs)
            except Exception as exc:
                raise storage_error(exc) from exc

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
        raise UsageError(f"cannot read sharded checkpoint {folder}: {first_line(exc, typed=True)}") from None
    items = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(items, dict) or not all(isinstance(v, TensorStorageMetadata) for v in items.values()):
        raise UsageError(f"sharded checkpoint {folder} holds items other than tensors: "
                         "it was not written by these scripts")
    return metadata


def load_sharded(model, optimizer, folder: str, param_groups: list, metadata):
    """Load `folder` into the (sharded) model and optimizer, whatever the number of ranks that
    wrote it: DCP reads the pieces of the saved shards that this rank's shards cover. A
    collective. metadata: the folder's, as check_sharded_folder read it. UsageError if the folder does not
    fit the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    # The current state is the template: DCP loads into its tensors (this rank's shards).
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state["state"]}
    try:
        dcp.load(state, storage_reader=checked_reader(folder, metadata))
    except dcp.CheckpointException as exc:  # on every rank: a shard unreadable, a missing key, another shape
        interrupted(exc)
        what = (f"cannot read sharded checkpoint {folder}" if any(isinstance(err, StorageError) for err, _ in
                exc.failures.values()) else f"sharded checkpoint {folder} does not fit this model/optimizer")
        raise UsageError(f"{what}: {causes(exc)}") from None
    try:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optimizer"], "param_groups": param_groups})
    except Exception as exc:
        raise UsageError(f"sharded checkpoint {folder} does not fit this model/optimizer: "
                         f"{first_line(exc, typed=True)}") from None
