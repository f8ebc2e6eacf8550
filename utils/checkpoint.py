"""Full-state checkpoints: written atomically, read with weights_only=True.

A checkpoint holds everything needed to continue with the exact next batch:
model, optimizer, scheduler, GradScaler (mixed precision), the epoch and the
number of optimizer steps already taken in it, the partial training sums of that
epoch, and the RNG states. Only tensors and plain Python values go in, so
`torch.load(path, weights_only=True)` can read it without running pickled code.
"""
import os
import random
import tempfile

import numpy as np
import torch

from .cli import UsageError

FORMAT = "multi-gpu-training-checkpoint/1"
FILENAME = "checkpoint.pt"


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


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_file(path: str, what: str = "checkpoint"):
    """torch.load with weights_only=True onto the CPU, or UsageError with one readable line."""
    if not os.path.isfile(path):
        raise UsageError(f"no {what} at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
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
