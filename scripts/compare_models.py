"""Compare the weights of two checkpoints tensor by tensor.

    python scripts/compare_models.py runs/a/checkpoint.pt runs/b/checkpoint.pt
    python scripts/compare_models.py A.pt B.pt --atol 1e-6 --what all

Reads checkpoints written by these scripts (the "model" entry; with --what also the
optimizer state) or a plain state_dict saved with torch.save. A sharded checkpoint of
distributed_fsdp.py (its checkpoint.pt, or the sharded-step* folder beside it) is read
whole, in this one process, with the optimizer state numbered as torch.optim numbers it,
so that it compares with a DDP checkpoint entry by entry. A leading "module."
(left by saving a DDP or DataParallel wrapper's state_dict) is ignored, so a
wrapped and an unwrapped model compare by their real names.

Lists the tensors whose largest absolute difference exceeds --atol, the tensors
present in only one file and those whose shapes differ, or says that they match.
An optimizer's choice of kernel (fused, foreach, capturable, differentiable) is not
compared: it does not change the state, and on a GPU the DDP scripts use fused=True
where distributed_fsdp.py cannot.
Exit status: 0 they match, 1 they differ, 2 a file cannot be read.
"""
import os
import sys
import warnings

# `python scripts/compare_models.py` puts scripts/ on sys.path, not the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from utils import checkpoint, sharded  # noqa: E402
from utils.cli import Parser, UsageError, non_negative_float  # noqa: E402


def read_sharded(folder: str) -> dict:
    """Every tensor of a sharded checkpoint, whole, on the CPU, in one process (no process
    group): {"model.conv1.weight": tensor, "optimizer.<name>.momentum_buffer": tensor, ...}."""
    import torch.distributed.checkpoint as dcp
    metadata = sharded.check_sharded_folder(folder)
    state = {name: torch.empty(item.size, dtype=item.properties.dtype)
             for name, item in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, storage_reader=sharded.checked_reader(folder, metadata), no_dist=True)
        except dcp.CheckpointException as exc:  # a BaseException: `except Exception` would miss it
            sharded.interrupted(exc)
            # The template is the metadata's own: it fits. This one process is DCP's "rank 0".
            cause = sharded.causes(exc).removeprefix("rank 0: ")
            raise UsageError(f"cannot read sharded checkpoint {folder}: {cause}") from None
    return state


def load_full(path: str) -> dict:
    """A checkpoint of ours as a plain one, whatever wrote it: a sharded checkpoint's model
    and optimizer are read whole from its folder, the optimizer in torch's own layout
    (parameters numbered in param_groups order), as a DDP checkpoint holds them."""
    state = checkpoint.load(path)
    if "sharded" not in state:
        return state
    tensors = read_sharded(sharded.sharded_folder(path, state["sharded"]["folder"]))
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


def read_state(path: str) -> dict:
    """The whole checkpoint, or {"model": state_dict} for a plain state_dict file."""
    # A shard folder alone: its model (the checkpoint.pt beside it numbers the optimizer state). A folder
    # holding a checkpoint.pt is a --checkpoint-dir: read_file's refusal names the file to give.
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, checkpoint.FILENAME)):
        tensors = read_sharded(path)
        return {"model": {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}}
    state = checkpoint.read_file(path, what="file")
    if not isinstance(state, dict):
        raise UsageError(f"{path} holds a {type(state).__name__}, not a checkpoint or a state_dict")
    if state.get("format") == checkpoint.FORMAT:
        # load_full reads checkpoint.pt again: a sharded one is small (its tensors are in the shard folder).
        return load_full(path) if "sharded" in state else state
    if state and all(isinstance(v, torch.Tensor) for v in state.values()):
        return {"model": state}
    raise UsageError(f"{path} is neither a checkpoint of these scripts (format {checkpoint.FORMAT!r}) "
                     "nor a state_dict of tensors")


def flatten(obj, prefix: str = "") -> dict:
    """Nested dicts and lists (an optimizer state_dict) as {"a.b.0": tensor or value}."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {prefix: obj}
    flat = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def model_tensors(state: dict, path: str) -> dict:
    if "model" not in state:
        raise UsageError(f"{path} has no model weights")
    # DDP and DataParallel prefix every name with "module."; the weights are the same.
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state["model"].items()}


# How torch.optim runs the update, not what it computes (param_groups' flags).
KERNEL_CHOICES = ("fused", "foreach", "capturable", "differentiable")


def entries(state: dict, path: str, what: str) -> dict:
    found = {}
    if what in ("model", "all"):
        found.update({f"model.{k}": v for k, v in model_tensors(state, path).items()})
    if what in ("optimizer", "all"):
        if not state.get("optimizer"):
            raise UsageError(f"{path}: a shard folder alone is compared by its model; for the optimizer, name the "
                             "checkpoint.pt beside it" if os.path.isdir(path) else
                             f"{path} has no optimizer state (a plain state_dict holds only weights)")
        found.update({k: v for k, v in flatten(state["optimizer"], "optimizer").items()
                      if not (k.startswith("optimizer.param_groups.") and k.rsplit(".", 1)[1] in KERNEL_CHOICES)})
    return found


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    # float64 so that integer counters and low-precision floats subtract exactly (bool: 0 and 1).
    a, b = a.double(), b.double()
    diff = (a - b).abs()
    # Equal values (the same infinity too: inf - inf is NaN) and NaN in the same place on both sides
    # are the same value; NaN on one side only stays NaN.
    diff = torch.where((a == b) | a.isnan() & b.isnan(), torch.zeros_like(diff), diff)
    return diff.max().item()


def compare(a: dict, b: dict, atol: float) -> list:
    """Lines describing every difference between the flat dicts a and b."""
    lines = []
    for name in sorted(a.keys() | b.keys()):
        if name not in b:
            lines.append(f"only in A: {name}")
        elif name not in a:
            lines.append(f"only in B: {name}")
        else:
            x, y = a[name], b[name]
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                if x.shape != y.shape:
                    lines.append(f"shape differs: {name} {tuple(x.shape)} vs {tuple(y.shape)}")
                elif x.dtype != y.dtype:  # float32 and float64 of the same values are not the same state
                    lines.append(f"dtype differs: {name} {x.dtype} vs {y.dtype}")
                else:
                    diff = max_abs_diff(x, y)
                    if diff > atol or diff != diff:  # diff != diff: a NaN on one side
                        lines.append(f"differs: {name} max |A-B| = {diff:.6g}")
            elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                lines.append(f"type differs: {name} {type(x).__name__} vs {type(y).__name__}")
            elif x != y:  # plain values: lr, momentum, step counters
                lines.append(f"differs: {name} {x!r} vs {y!r}")
    return lines


def main(argv=None):
    parser = Parser(description=__doc__.strip().splitlines()[0])  # a bad flag: a UsageError
    parser.add_argument("a", metavar="A.pt", help="a checkpoint, a state_dict file, or a shard folder")
    parser.add_argument("b", metavar="B.pt")
    parser.add_argument("--atol", type=non_negative_float, default=0.0,
                        help="largest absolute difference still counted as equal (default 0: bitwise)")
    parser.add_argument("--what", choices=["model", "optimizer", "all"], default="model",
                        help="compare the model weights, the optimizer state, or both (default: model)")
    try:
        args = parser.parse_args(argv)
        a = entries(read_state(args.a), args.a, args.what)
        b = entries(read_state(args.b), args.b, args.what)
    except UsageError as err:
        print(f"compare_models.py: error: {err}", file=sys.stderr)
        return 2
    lines = compare(a, b, args.atol)
    print(f"A = {args.a}\nB = {args.b}")
    if not lines:
        print(f"match: {len(a)} entries ({args.what}), max |A-B| <= {args.atol:g}")
        return 0
    print("\n".join(lines))
    print(f"{len(lines)} of {len(a.keys() | b.keys())} entries differ ({args.what}, atol {args.atol:g})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
