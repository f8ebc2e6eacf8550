"""The command line the scripts share: the parser, its checks, and the one-line error.

A script builds its parser with `build_parser`, adds a group of its own, calls `parse_args`, then
utils/run.py's `validated(args, check)`, after which --check-args stops: a batch script's check and the run
refuse the same things in the same words. Bad input raises `UsageError` (one line, exit status 2: utils/lifecycle.py's
`run_main`). The ground floor: it imports nothing of the package."""
import argparse
import contextlib
import importlib.util
import os
import re
import sys
import types


class UsageError(Exception):
    """Bad input from the user: reported as one line and exit status 2, no traceback. met_by: who meets
    it, and so who prints the line: "job" (every rank, the default: global rank 0 prints), "node" (every
    rank of one node: its local rank 0 prints), or "rank" (this rank alone: it prints)."""

    def __init__(self, message, met_by: str = "job"):
        super().__init__(message)
        self.met_by = met_by


def first_line(err: BaseException, limit: int = 200, typed: bool = False) -> str:
    """An error's first line, without the C++ source location gloo puts in front ("[/__w/.../pair.cc:152] ",
    "[enforce fail at .../tcp.cc:80] "), after its type's name when `typed`; the name alone if it has no message."""
    line = (str(err).strip().splitlines() or [""])[0]
    line, name = re.sub(r"\[(?:enforce fail at )?[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\] ?", "", line), type(err).__name__
    return (f"{name}: {line}" if typed and line else line or name)[:limit]


def print_line(line: str):
    """`line` and its newline on stderr in one write: unbuffered (torchrun's `python -u`), print() writes
    them apart and another thread's output can land between; a pipe takes up to 4096 bytes whole."""
    with contextlib.suppress(OSError):  # a terminal that hung up (EIO): the line is lost, not the run
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()


def error_line(message, kind: str = "error") -> str:
    """`PROGRAM: error: MESSAGE`, the form of argparse's own errors ("warning" for a warning)."""
    return f"{os.path.basename(sys.argv[0]) or 'train'}: {kind}: {message}"


def prints_errors(met_by: str = "job") -> bool:
    """Whether this process prints a bad-input line that `met_by` meet (UsageError); a RANK or
    WORLD_SIZE that cannot be right is the error itself, and printed."""
    if met_by == "rank":
        return True
    if met_by == "node":
        local_rank = os.environ.get("LOCAL_RANK", "").strip()
        return not local_rank.isdigit() or int(local_rank) == 0
    rank, size = os.environ.get("RANK", "").strip(), os.environ.get("WORLD_SIZE", "").strip()
    return not rank.isdigit() or int(rank) == 0 or bool(size) and (not size.isdigit() or int(rank) >= int(size))


class Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # a default of None is "not given": the help says what happens then
        return action.help if action.default is None else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block before the error; a wrong flag deserves one line that names
    # it, and --help for the rest. Every rank parses the same arguments: a UsageError of the job, which
    # run_main prints on rank 0 and leaves in torchrun's error file, for its summary, on every rank.
    def error(self, message):
        raise UsageError(f"{message} (see --help)")


# --- value types: argparse calls them, a bad value becomes "argument --flag: ..." ------------

def _number(kind, test, wanted):
    """A value type: text to a finite `kind` for which test(value) holds, else "WANTED, got VALUE"."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {'whole ' if kind is int else ''}number, "
                                             f"got {text!r}") from None
        if kind is float and not abs(value) <= 3.4028234663852886e38:  # float32's largest; inf, nan: garbage
            raise argparse.ArgumentTypeError(f"expected a finite number of float32's range, got {text!r}")
        if not test(value):
            raise argparse.ArgumentTypeError(f"{wanted}, got {value}")
        return value
    return parse


positive_int = _number(int, lambda v: v > 0, "must be at least 1")
non_negative_int = _number(int, lambda v: v >= 0, "must be 0 or more")
positive_float = _number(float, lambda v: v > 0, "must be greater than 0")
non_negative_float = _number(float, lambda v: v >= 0, "must be 0 or more")
# A timeout: under 1 ms c10d's waits end at once ("after 0ms"); at 1e10 s its nanoseconds overflow (the same).
seconds = _number(float, lambda v: 1 <= v <= 365 * 86400, "must be 1 .. 31536000 (a year)")
seed = _number(int, lambda v: 0 <= v < 2**64, "must be in 0 .. 2**64-1")  # torch.manual_seed's range
port = _number(int, lambda v: 0 < v <= 65535, "a TCP port is 1 .. 65535")


def build_parser(doc: str, model_names, own_data: bool = False, images: bool = True) -> argparse.ArgumentParser:
    """The command line every script shares, grouped; each script adds its own group. model_names: the choices
    of --model. own_data: the script trains on a data set of its own (data.own_datasets): no --dataset nor
    --data-on-gpu, nor CIFAR in the data flags' help. images: its inputs are N x C x H x W (--channels-last)."""
    # allow_abbrev=False: the launchers read some flags from the extra arguments themselves
    # (scripts/slurm.sbatch: --checkpoint-dir), which an abbreviation (--checkpoint-d) would pass unseen.
    parser = Parser(description=doc.strip().splitlines()[0] if doc else None, formatter_class=Help, allow_abbrev=False)
    parser.own_data, parser.images = own_data, images

    g = parser.add_argument_group("data")
    if own_data:
        parser.set_defaults(dataset=None)  # own_datasets records what the data is here
    else:
        g.add_argument("--dataset", choices=["cifar100", "synthetic"], default="cifar100",
                       help="cifar100: downloaded once to --data-dir; synthetic: an offline stand-in a model can learn")
    g.add_argument("--data-dir", "--data_dir", default="./data",
                   help="where the data set's files are (the script builds its data sets from it)" if own_data
                   else "where CIFAR-100 is stored (--dataset cifar100)")
    g.add_argument("--train-samples", type=positive_int, default=None,
                   help="use only the first N training samples (quick runs, tests)")
    g.add_argument("--test-samples", type=positive_int, default=None, help="use only the first N test samples")
    g.add_argument("--workers", type=non_negative_int, default=None,
                   help="loader workers per training process (default: min(4, CPU cores per process), at least 1)")

    g = parser.add_argument_group("model")
    g.add_argument("--model", choices=model_names, default=model_names[0], help="the network to train")

    # Defaults follow weiaicunzai/pytorch-cifar100, itself after the Cutout paper (DeVries & Taylor, 2017),
    # with the schedule of utils/schedule.py: ResNet-18 top-1 error 24.39% there.
    g = parser.add_argument_group("recipe")
    g.add_argument("--epochs", type=positive_int, default=200, help="passes over the training set")
    g.add_argument("--batch-size", "--batch_size", type=positive_int, default=128,
                   help="GLOBAL batch per optimizer step, over all processes and accumulation steps")
    g.add_argument("--lr", type=positive_float, default=0.1, help="learning rate for 128 samples a step; the scripts "
                   "scale it linearly with --batch-size where they build the optimizer")
    g.add_argument("--momentum", type=non_negative_float, default=0.9, help="SGD's momentum")
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True, help="SGD's Nesterov momentum")
    g.add_argument("--weight-decay", "--weight_decay", type=non_negative_float, default=5e-4, help="SGD's weight decay")
    g.add_argument("--warmup-epochs", type=non_negative_float, default=1.0,
                   help="linear learning-rate warm-up from 0, in epochs")
    g.add_argument("--seed", type=seed, default=0,
                   help="the initial weights, the order of the data and its augmentation")
    g.add_argument("--clip-grad-norm", "--clip-grad", type=positive_float, default=None, metavar="MAX_NORM",
                   help="clip the global L2 norm of the gradients to MAX_NORM, once per optimizer step "
                        "(after unscaling under mixed precision, after the last micro-batch with accumulation)")

    g = parser.add_argument_group("run")
    g.add_argument("--max-steps", type=positive_int, default=None,
                   help="stop after N optimizer steps in all (benchmarks, smoke runs)")
    g.add_argument("--checkpoint-dir", default=None,
                   help="write full-state checkpoints here (checkpoint.pt, config.json)")
    g.add_argument("--checkpoint-every", type=positive_int, default=None,
                   help="also checkpoint every N optimizer steps, not only at the end of each epoch")
    g.add_argument("--resume", nargs="?", const="auto", default=None, metavar="PATH",
                   help="continue from PATH, or from --checkpoint-dir/checkpoint.pt without PATH")
    g.add_argument("--metrics", default=None, metavar="FILE",
                   help="append JSON lines: one record per epoch and one at the end of the run")
    g.add_argument("--log-every", type=positive_int, default=50, help="refresh the progress bar's loss every N steps "
                   "(each refresh waits for the device; the bar is drawn when stderr is a terminal)")
    g.add_argument("--check-args", action="store_true",
                   help="make the run's every check before it starts, with the launcher's variables (WORLD_SIZE, "
                        "LOCAL_WORLD_SIZE, RANK, MASTER_ADDR), and exit: 0 if it would start, else its line and 2")
    g.add_argument("--dist-timeout", type=seconds, default=1800.0, metavar="SECONDS",
                   help="how long a rank waits for a peer, to form the group or in a collective, before the job fails")
    g.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,xpu,mps,...}",
                   help="auto: this machine's accelerator (torch.accelerator), else the CPU; or name a device type")
    g.add_argument("--profile", default=None, metavar="DIR",
                   help="a torch.profiler trace of a few steps after warm-up, per rank, for https://ui.perfetto.dev")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write the per-epoch scalars for TensorBoard (needs: pip install tensorboard)")
    # torch.distributed.launch (deprecated) passes --local-rank=N (--local_rank before 2.0).
    g.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def add_fast_path_flags(parser, data_on_gpu: bool = False, torch_compile: bool = True):
    """Speed for the DDP scripts; --channels-last where the data is images, --data-on-gpu (our CIFAR images held
    in device memory) if asked, and --compile, --compile-mode unless the script cannot compile (torch_compile=False)."""
    g = parser.add_argument_group("fast path")
    parser.set_defaults(data_on_gpu=False, channels_last=False, compile=False)  # what a script without them reads
    if data_on_gpu and not getattr(parser, "own_data", False):
        g.add_argument("--data-on-gpu", action="store_true", help="images: keep the uint8 CIFAR training set in device "
                       "memory and augment it there (no loader workers)")
    if getattr(parser, "images", True):
        g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                       help="images: NHWC model and inputs (default: on for NVIDIA GPUs of compute capability 8.0+)")
    if torch_compile:
        g.add_argument("--compile", action="store_true",
                       help="torch.compile the model (compilation happens in the first steps, outside the timing)")
        g.add_argument("--compile-mode", default="default",
                       choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                       help="torch.compile's mode (needs --compile). reduce-overhead and max-autotune replay CUDA "
                            "graphs (under DDP, one per bucket's part of the model); max-autotune* tune for minutes")
    g.add_argument("--eval-every", type=positive_int, default=1, metavar="N",
                   help="evaluate after every N-th epoch and after the last one (the others record null test figures)")


def given(args, name: str) -> bool:
    """Whether the flag of destination `name` was on the command line (refused only if asked for)."""
    return name in getattr(args, "_given", ())


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    # Which flags were given: parsed again into a namespace that already holds a marker for every
    # destination, set_defaults' too (argparse fills in a default only where the namespace has none).
    marker = object()
    marked = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(
        [*parser._defaults, *(action.dest for action in parser._actions if action.dest != argparse.SUPPRESS)], marker)))
    args._given = frozenset(name for name, value in vars(marked).items() if value is not marker)
    if args.local_rank is not None and "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    for name, what in (("checkpoint_dir", "a directory"), ("metrics", "a file"), ("profile", "a directory"),
                       ("tensorboard", "a directory"), ("resume", "a checkpoint file, or give --resume alone to "
                                                        "continue --checkpoint-dir's checkpoint")):
        if str(getattr(args, name, None)).strip() == "":  # "$UNSET" (None: not given): nothing would be written
            parser.error(f"--{name.replace('_', '-')} is empty: name {what}")
    if args.resume == "auto" and not args.checkpoint_dir:
        parser.error("--resume without a PATH needs --checkpoint-dir")
    if args.checkpoint_every is not None and not args.checkpoint_dir:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    if getattr(args, "tensorboard", None) and importlib.util.find_spec("tensorboard") is None:
        parser.error("--tensorboard needs the tensorboard package, which is not installed: pip install tensorboard")
    return args


class Plan(types.SimpleNamespace):
    """What a script's check settled before anything started: `world_size` (the whole job's processes),
    `read` (the launcher's variables it read, for --check-args) and whatever else the run takes from it."""

    def __init__(self, world_size: int, read: str = "", **settled):
        super().__init__(world_size=world_size, read=read, **settled)


def check_flags(args):
    """The shared refusals that need no group: flags the run would not use, flags that contradict."""
    if getattr(args, "dataset", None) == "synthetic" and given(args, "data_dir"):
        raise UsageError(f"--data-dir {args.data_dir} with --dataset synthetic, which is made in memory and "
                         "reads nothing: leave --data-dir out, or use --dataset cifar100")
    if given(args, "compile_mode") and not args.compile:
        raise UsageError(f"--compile-mode {args.compile_mode} chooses how --compile compiles: add --compile, "
                         "or leave --compile-mode out")
    if getattr(args, "data_on_gpu", False) and args.workers:
        raise UsageError(f"--workers {args.workers} with --data-on-gpu: the data is already in device memory "
                         "and no loader worker runs; leave --workers out")
    if args.nesterov and args.momentum == 0:
        # torch.optim.SGD refuses it too, with a traceback: Nesterov's look-ahead is a momentum term.
        raise UsageError("--momentum 0 with Nesterov momentum (on by default): add --no-nesterov, "
                         "or give a momentum above 0")
    if args.local_rank is not None and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        raise UsageError(f"--local-rank {args.local_rank} without RANK and WORLD_SIZE: torch.distributed.launch sets "
                         "it with them; under plain python (one process) leave it out")


def split_batch(global_batch: int, world_size: int, accum_steps: int = 1, unit: str = "process") -> int:
    """Per-device batch for one forward pass; refuses to truncate silently."""
    parts = world_size * accum_steps
    if global_batch % parts:
        how = f"{world_size} {unit}{('es' if unit.endswith('s') else 's') if world_size != 1 else ''}" + (
            f" x {accum_steps} accumulation steps" if accum_steps != 1 else "")
        raise UsageError(f"batch size {global_batch} is not divisible by {how} "
                         f"({global_batch} / {parts} = {global_batch / parts:g}); "
                         f"choose a multiple of {parts}, e.g. {max(parts, global_batch // parts * parts)}")
    return global_batch // parts


def plain_config(args: argparse.Namespace) -> dict:
    """The resolved arguments as plain JSON-able values (saved beside checkpoints)."""
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
            for k, v in sorted(vars(args).items()) if not k.startswith("_")}
