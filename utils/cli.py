"""The command line shared by the six scripts, its validation, and the error exit.

Every script builds its parser with `build_parser`, adds its own flags in a group
of its own, calls `parse_args`, then `validated(args, check)`: its own `check`
makes every refusal that needs no process group (a batch that does not split over
the processes, a device this machine lacks, flags that contradict each other), and
--check-args stops right after it, so that a batch script's check and the run
refuse the same things with the same words. Bad input that can only be seen later (a
missing data set, a corrupt checkpoint) raises `UsageError` there; `run_main` turns
either into one line on stderr and exit status 2.
"""
import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import signal
import sys
import time
import traceback
import types
import weakref


class UsageError(Exception):
    """Bad input from the user: reported as one line and exit status 2, no traceback.

    met_by: who meets it, and so who prints the line: "job" (every rank, the default:
    global rank 0 prints), "node" (every rank of one node: its local rank 0 prints, which
    need not be on rank 0's node), or "rank" (this rank alone: it prints)."""

    def __init__(self, message, met_by: str = "job"):
        super().__init__(message)
        self.met_by = met_by


def _prints_errors(met_by: str = "job") -> bool:
    """Only global rank 0 prints a bad-input line (every rank meets the same one); a
    RANK or WORLD_SIZE that cannot be right is itself the error, and is printed. An error
    of one node is printed by its local rank 0, an error of one rank by that rank."""
    if met_by == "rank":
        return True
    if met_by == "node":
        local_rank = os.environ.get("LOCAL_RANK", "").strip()
        return not local_rank.isdigit() or int(local_rank) == 0
    rank, size = os.environ.get("RANK", "").strip(), os.environ.get("WORLD_SIZE", "").strip()
    if not rank.isdigit() or int(rank) == 0:
        return True
    if not size:
        return False
    return not size.isdigit() or int(rank) >= int(size)  # a RANK that cannot be right: say so


class Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block before the error; a wrong flag deserves
    # one line that names it, and --help for the rest.
    def error(self, message):
        # Every rank of a job parses the same arguments: one copy of the line is enough.
        line = f"{self.prog}: error: {message} (see --help)"
        refuse(line, _prints_errors())
        self.exit(2)


_NOT_GIVEN = object()


def given(args, name: str) -> bool:
    """Whether the flag whose destination is `name` was on the command line (and not left
    at its default): a flag that a run would not use is refused only when it was asked for."""
    return name in getattr(args, "_given", ())


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _finite_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):  # inf and nan would train on garbage or overflow later
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _positive_float(text):
    value = _finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {value}")
    return value


def _non_negative_float(text):
    value = _finite_float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _seed(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value < 2**64:  # what torch.manual_seed accepts
        raise argparse.ArgumentTypeError(f"must be in 0 .. 2**64-1, got {value}")
    return value


def _port(text):
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1 .. 65535, got {value}")
    return value


positive_int = _positive_int  # for the scripts' own flags (--accum-steps, --nproc-per-node, ...)
non_negative_int = _non_negative_int
positive_float = _positive_float
non_negative_float = _non_negative_float
port = _port


def build_parser(doc: str, model_names, own_data: bool = False) -> argparse.ArgumentParser:
    """The command line every script shares, grouped; each script adds its own group.
    model_names: the choices of --model (the script knows its models; this module does not).
    own_data: the script trains on a data set of its own (data.own_datasets), not on our
    CIFAR data: no --dataset, and the data flags say nothing of CIFAR."""
    first_line = (doc or "").strip().splitlines()[0] if doc else None
    # allow_abbrev=False: a flag is its full name only. The launchers read some flags from the
    # extra arguments themselves (scripts/slurm.sbatch: --checkpoint-dir), which an
    # abbreviation (--checkpoint-d) would pass unseen.
    parser = Parser(description=first_line, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                    allow_abbrev=False)

    g = parser.add_argument_group("data")
    if own_data:
        # args.dataset: what own_datasets records of the data (config.json, checkpoints).
        parser.set_defaults(dataset=None)
        g.add_argument("--data-dir", "--data_dir", default="./data",
                       help="where the data set's files are (the script builds its data sets from it)")
    else:
        g.add_argument("--dataset", choices=["cifar100", "synthetic"], default="cifar100",
                       help="cifar100 is downloaded once to --data-dir; synthetic is an offline "
                            "stand-in of the same shape (100 classes, 50,000/10,000 images) that a model can learn")
        g.add_argument("--data-dir", "--data_dir", default="./data",
                       help="where CIFAR-100 is stored (--dataset cifar100)")
    g.add_argument("--train-samples", type=_positive_int, default=None,
                   help="use only the first N training samples (quick runs, tests)")
    g.add_argument("--test-samples", type=_positive_int, default=None,
                   help="use only the first N test samples")
    g.add_argument("--workers", type=_non_negative_int, default=None,
                   help="data-loading worker processes per training process (default: the smaller of 4 "
                        "and the CPU cores per process on this node, at least 1)")

    g = parser.add_argument_group("model")
    g.add_argument("--model", choices=model_names, default=model_names[0])

    # Defaults follow weiaicunzai/pytorch-cifar100, itself after the Cutout paper (DeVries &
    # Taylor, 2017): 200 epochs, batch 128, SGD lr 0.1 with Nesterov momentum 0.9, weight decay
    # 5e-4, 1 warm-up epoch, lr x0.2 at epochs 60/120/160; ResNet-18 top-1 error 24.39% there.
    g = parser.add_argument_group("recipe")
    g.add_argument("--epochs", type=_positive_int, default=200)
    g.add_argument("--batch-size", "--batch_size", type=_positive_int, default=128,
                   help="GLOBAL batch per optimizer step, over all processes and accumulation steps")
    g.add_argument("--lr", type=_positive_float, default=0.1,
                   help="learning rate per 128 images; scaled linearly with --batch-size")
    g.add_argument("--momentum", type=_non_negative_float, default=0.9)
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True, help="Nesterov momentum")
    g.add_argument("--weight-decay", "--weight_decay", type=_non_negative_float, default=5e-4)
    g.add_argument("--warmup-epochs", type=_non_negative_float, default=1.0,
                   help="linear learning-rate warm-up from 0, in epochs")
    g.add_argument("--seed", type=_seed, default=0)
    g.add_argument("--clip-grad-norm", "--clip-grad", type=_positive_float, default=None, metavar="MAX_NORM",
                   help="clip the global L2 norm of the gradients to MAX_NORM, once per optimizer step "
                        "(after unscaling under mixed precision, after the last micro-batch with accumulation)")

    g = parser.add_argument_group("run")
    g.add_argument("--max-steps", type=_positive_int, default=None,
                   help="stop after N optimizer steps in all (benchmarks, smoke runs)")
    g.add_argument("--checkpoint-dir", default=None,
                   help="write full-state checkpoints here (checkpoint.pt, config.json)")
    g.add_argument("--checkpoint-every", type=_positive_int, default=None,
                   help="also checkpoint every N optimizer steps, not only at the end of each epoch")
    g.add_argument("--resume", nargs="?", const="auto", default=None, metavar="PATH",
                   help="continue from PATH, or from --checkpoint-dir/checkpoint.pt without PATH")
    g.add_argument("--metrics", default=None, metavar="FILE",
                   help="append JSON lines: one record per epoch and one at the end of the run")
    g.add_argument("--log-every", type=_positive_int, default=50,
                   help="refresh the progress bar's loss every N steps (each refresh waits for the device; "
                        "the bar is drawn when stderr is a terminal)")
    g.add_argument("--check-args", action="store_true",
                   help="make every check the run makes before it starts (with WORLD_SIZE, LOCAL_WORLD_SIZE "
                        "from the environment) and exit: 0 if the run would start, else its one line and 2 "
                        "(batch scripts run this before srun)")
    g.add_argument("--dist-timeout", type=_positive_float, default=1800.0, metavar="SECONDS",
                   help="how long a rank waits in a collective for a peer before the job fails "
                        "(bounds the hang when a peer dies); also how long the ranks wait for each other "
                        "to join the process group at the start")
    g.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,xpu,mps,...}",
                   help="auto: this machine's accelerator (torch.accelerator) if it has one, else the CPU; "
                        "cpu: the CPU even where there is a GPU; or name the accelerator's type")
    g.add_argument("--profile", default=None, metavar="DIR",
                   help="write a torch.profiler trace of a few steps after warm-up, one file per rank "
                        "(open it in https://ui.perfetto.dev or chrome://tracing)")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write the per-epoch scalars for TensorBoard (needs: pip install tensorboard)")
    # torch.distributed.launch (deprecated) passes --local-rank=N (--local_rank before 2.0).
    g.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def add_fast_path_flags(parser):
    """Opt-in speed (the DDP scripts but accumulation); the default path stays plain."""
    g = parser.add_argument_group("fast path")
    g.add_argument("--data-on-gpu", action="store_true",
                   help="keep the uint8 training set in device memory and augment it there (no loader workers)")
    g.add_argument("--channels-last", action="store_true",
                   help="NHWC memory format for the model and inputs (tensor-core convolutions on GPUs)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model (compilation happens in the first steps, outside the timing)")
    g.add_argument("--compile-mode", default="default",
                   choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                   help="torch.compile's mode (needs --compile). reduce-overhead and max-autotune replay CUDA "
                        "graphs (fewer kernel launches from the CPU): for one process, where no DDP wrapper "
                        "runs hooks between the graphs; max-autotune* tune kernels for minutes first")
    g.add_argument("--eval-every", type=_positive_int, default=1, metavar="N",
                   help="evaluate after every N-th epoch and after the last one (the others record NaN)")


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """The parsed arguments, checked for what the command line alone can tell; `given`
    then answers which flags were on it."""
    args = parser.parse_args(argv)
    # Which flags were given: parsed again into a namespace that already holds a marker for
    # every destination (argparse fills in a default only where the namespace has none).
    marked = parser.parse_args(argv, argparse.Namespace(**{
        action.dest: _NOT_GIVEN for action in parser._actions if action.dest != argparse.SUPPRESS}))
    args._given = frozenset(name for name, value in vars(marked).items() if value is not _NOT_GIVEN)
    if args.local_rank is not None and "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    if args.checkpoint_dir is not None and not args.checkpoint_dir.strip():
        parser.error("--checkpoint-dir is empty: name a directory")
    if args.resume is not None and not args.resume.strip():
        parser.error("--resume is empty: name a checkpoint file, or give --resume alone to continue "
                     "--checkpoint-dir's checkpoint")
    if args.resume is not None and args.resume == "auto" and not args.checkpoint_dir:
        parser.error("--resume without a PATH needs --checkpoint-dir")
    if args.checkpoint_every is not None and not args.checkpoint_dir:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    if getattr(args, "tensorboard", None) and importlib.util.find_spec("tensorboard") is None:
        parser.error("--tensorboard needs the tensorboard package, which is not installed: "
                     "pip install tensorboard")
    return args


class Plan(types.SimpleNamespace):
    """What a script's check settled before anything started: `world_size` (the processes
    of the whole job) and whatever else the run takes from it (the per-device batch, ...)."""

    def __init__(self, world_size: int, **settled):
        super().__init__(world_size=world_size, **settled)


def validated(args, check) -> Plan:
    """check(args): the script's every refusal that needs no process group, a UsageError
    (one line, exit status 2 through run_main) for bad input; it returns a Plan. The run
    calls this before it starts anything, and --check-args (what scripts/slurm.sbatch runs
    before srun) stops right after it: both refuse the same input with the same line,
    through the same code."""
    plan = check(args)
    if args.check_args:
        n = plan.world_size
        print(f"arguments OK for {n} process{'es' if n != 1 else ''}", flush=True)
        sys.exit(0)
    return plan


def check_flags(args, device_type: str, launcher: str = "torchrun"):
    """The refusals every script shares that need no process group: flags the run would
    accept and then not use, and flags that contradict each other. device_type: the device
    the run will train on; launcher: what starts its processes, "torchrun" (and plain
    python), "itself" (mp.spawn), or None (one process that joins no group)."""
    from . import data  # here, not at the top: utils.data imports this module
    data.check_flags(args)
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
    if args.local_rank is not None:
        if launcher is None:
            raise UsageError(f"--local-rank {args.local_rank}: this script is one process that no launcher "
                             "starts; run it with plain python")
        if launcher == "itself":
            raise UsageError(f"--local-rank {args.local_rank}: this script starts and numbers its own "
                             "processes (--nproc-per-node); run it with plain python, not a launcher")
        if not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
            raise UsageError(f"--local-rank {args.local_rank} without RANK and WORLD_SIZE: it comes from "
                             "torch.distributed.launch, which sets those too; under plain python "
                             "(one process) leave it out")
    if launcher is None and given(args, "dist_timeout"):
        raise UsageError("--dist-timeout bounds a wait for another process; this script is one process "
                         "and joins no process group: leave it out")


def device_of_this_rank(args):
    """The device this process of a torchrun job (or a plain python run) will train on,
    as utils.distributed.setup_from_env will pick it, or the UsageError it would raise:
    an accelerator that --device names and this machine lacks, more processes on this
    node (LOCAL_WORLD_SIZE) than devices."""
    from . import distributed as dist_utils  # here: utils.distributed imports this module
    if not dist_utils.launched_by_torchrun():
        return dist_utils.pick_device(0, 1, args.device)
    world_size = dist_utils.world_size_from_env()
    return dist_utils.pick_device(dist_utils._env_int("LOCAL_RANK", 0),
                                  dist_utils._env_int("LOCAL_WORLD_SIZE", world_size), args.device,
                                  distributed=True)


def split_batch(global_batch: int, world_size: int, accum_steps: int = 1) -> int:
    """Per-device batch for one forward pass; refuses to truncate silently."""
    parts = world_size * accum_steps
    if global_batch % parts:
        how = f"{world_size} process{'es' if world_size != 1 else ''}"
        if accum_steps != 1:
            how += f" x {accum_steps} accumulation steps"
        raise UsageError(
            f"batch size {global_batch} is not divisible by {how}"
            f" ({global_batch} / {parts} = {global_batch / parts:g}); "
            f"choose a multiple of {parts}, e.g. {max(parts, global_batch // parts * parts)}"
        )
    return global_batch // parts


def plain_config(args: argparse.Namespace) -> dict:
    """The resolved arguments as plain JSON-able values (saved beside checkpoints)."""
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
            for k, v in sorted(vars(args).items()) if not k.startswith("_")}


# What a rank's error says when a peer died or left (gloo's sockets; utils.distributed.meeting).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Another rank never came")


def run_main(main, argv=None):
    """Call main(argv); a UsageError becomes one line on stderr and exit status 2.

    In a multi-process job every rank meets the same bad input at the same point,
    so only global rank 0 prints the line; all ranks exit with 2. Any other
    exception is a bug: torchelastic's @record writes its traceback to the error
    file torchrun reads, so the failing rank's error is the one torchrun reports
    first, not the timeouts of the ranks that were waiting for it.

    Called as the program (argv None, the scripts' `cli.run_main(main)`) in a process
    that joined a process group, a run that ended (finished, stopped by a signal,
    refused bad input, or failed, after its traceback) leaves through `leave`;
    otherwise SystemExit as usual. A DataLoader worker killed by a bus error (shared
    memory full) ends the run with one line that says so (bus_error_message).
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    failed_at = []  # when main raised: the time torchrun orders the ranks' failures by

    def guarded():
        try:
            main(argv)
        except UsageError as err:
            refuse(error_line(err), _prints_errors(getattr(err, "met_by", "job")))
            sys.exit(2)
        except KeyboardInterrupt:
            sys.exit(130)
        except Exception as err:
            failed_at.append(time.time())
            loader_sigchld_off()  # before @record writes the error file
            if _joined_a_group and isinstance(err, RuntimeError) and any(words in str(err) for words in _PEER_LOST):
                # Only a consequence of a peer's failure: report it a second later. torchrun
                # names as the root cause the failure whose error file (written by @record)
                # has the earliest time, in whole seconds, and this rank now fails as fast
                # as the peer that caused it.
                time.sleep(1.0)
            raise

    if argv is not None:
        record(guarded)()
        return
    global _as_program
    _as_program = True
    # Whether the process joined a group is known only once main has run: ask afterwards.
    try:
        with imports_frozen():
            record(guarded)()
    except SystemExit as stop:
        if not _joined_a_group:
            raise
        code = stop.code
        leave(code if isinstance(code, int) else (0 if code is None else 1), message=
              None if code is None or isinstance(code, int) else str(code))
    except Exception as err:
        # A loader worker killed by a bus error: this rank's own line, exit status 1 (under
        # torchrun, @record has written the loader's error to the error file already).
        message = bus_error_message(err)
        if message is not None:
            if not _joined_a_group:
                print_line(error_line(message))  # what sys.exit(line) prints, in one write
                sys.exit(1)
            # The rank's error file then holds this line (written whole), for torchrun's summary.
            record_for_torchrun(error_line(message), failed_at[0] if failed_at else None)
            leave(1, message=error_line(message))
        if not _joined_a_group:
            raise
        # A failure after joining (a bug, a peer that died): the traceback, as Python would
        # print it, then out through leave. Through the interpreter's teardown, a rank whose
        # peer had died stayed until torchrun killed it 30 s later (measured).
        traceback.print_exc()
        leave(1)
    if _joined_a_group:
        leave(0)


@contextlib.contextmanager
def imports_frozen():
    """Around a program's work (run_main, an mp.spawn worker): gc.freeze every object alive
    when the work starts, the imported modules above all, so that the garbage collector's
    full collections skip them; gc.unfreeze when the work ends.

    Those objects (about 180,000 after torch's imports) live as long as the process. The
    first optimizer, or DDP's constructor if it comes first, then imports torch._dynamo
    (torch.optim's add_param_group is wrapped by torch._disable_dynamo, torch/_compile.py),
    another second of Python, during which full collections walk all of torch's objects
    again and again. Frozen, they are not walked: import torch then torch._dynamo took
    2.00 s of CPU, and 1.80 s with the freeze between them (medians of 7, each process
    ending at once with os._exit; PyTorch 2.14.1; 1.69 and 1.53 s on 2.11; the 2-core
    build machine), in every process a job starts. A collection just before the freeze
    would find about 40 unreachable objects, for 0.08 s, so none is made. Objects made
    later are collected as before.

    The unfreeze comes before the interpreter's teardown: a module the collector cannot
    see is never freed there (its functions and its namespace form a cycle), and nothing
    it holds is finalized; a file that a module opened and wrote to stayed empty at exit
    (Python 3.11). Where something froze first (a caller's own process), it is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def loader_sigchld_off():
    """Put SIGCHLD back to its default in a rank that is failing. A DataLoader's SIGCHLD
    handler raises its error wherever the main thread is, each time a child ends, once a
    worker has died: in the middle of @record's write of the error file too, which it then
    leaves empty or cut (`open(file, "w")`, then `json.dump`). torchrun's agent fails to
    parse such a file and ends the job without its summary (seen once, in a full run of
    the tests, after a loader worker's bus error). signal.signal first runs the handlers
    of signals already pending, so the loader's may raise once more here: try again."""
    for _ in range(5):
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            return
        except RuntimeError:  # the loader's error, raised again: it is being handled already
            continue
        except (AttributeError, ValueError):  # no SIGCHLD here; not the main thread
            return


def refuse(line: str, prints: bool):
    """What a rank does with a bad-input line before it exits with status 2.

    The printing rank (global rank 0, for input every rank meets) puts it on stderr.
    Every rank leaves it in torchrun's error file: torchrun stops the other ranks with
    SIGTERM as soon as one has exited, and under load rank 0 could still be starting
    when rank 1 had refused and left, and died of it without a word (seen with the
    CPU busy); the summary's root cause is then rank 1's, and it holds the line. A rank
    that does not print waits 2 s before leaving under torchrun, so that rank 0's line
    normally comes first, as the one line to read."""
    if _as_program:  # a caller's own process (run_main given argv) keeps its handlers
        _keep_this_exit_status()
    if prints:
        print_line(line)
    record_for_torchrun(line)
    if not prints and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        time.sleep(2.0)


def _keep_this_exit_status():
    """Ignore SIGTERM from here on: this rank has refused bad input and exits with 2.

    Every rank refuses the same input at once. Under torchrun the first rank out makes
    the agent stop the others with SIGTERM (SIGKILL 30 s later), and a rank still on its
    way out, its line printed and its error file written, died of it: torchrun's summary
    then showed the root cause with `exitcode: -15 (SIGTERM)` instead of 2 (seen under
    load). Ignoring the signal lets the rank end with its own status a moment later."""
    import threading
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def record_for_torchrun(line: str, when: float = None):
    """Under torchrun, also leave `line` where torchrun reads a failed rank's error (the file
    TORCHELASTIC_ERROR_FILE names, in the JSON form that torch.distributed.elastic's
    ErrorHandler.record_exception writes). torchrun's closing "FAILED" summary then shows
    this line as the root cause's traceback, instead of a pointer to its documentation, so
    the one line that says what to fix is also the last thing on the screen. `when` (now by
    default): the time of the failure; torchrun names as the root cause the failure with the
    earliest time, in whole seconds."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = json.dumps({"message": {"message": line, "extraInfo": {
        "py_callstack": line, "timestamp": str(int(time.time() if when is None else when))}}})
    # Whole or not at all: written beside it, then renamed over it. A file cut short (this
    # process killed while writing it) makes torchrun's agent fail to parse it.
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w") as f:
            f.write(data)
        os.replace(temporary, path)
    except OSError:  # the launcher's folder gone: the line on stderr is still there
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def print_line(line: str):
    """`line` and its newline on stderr in one write. Where stderr is
    unbuffered, as in every worker torchrun starts (it runs them with `python -u`) and
    under PYTHONUNBUFFERED=1, print() and sys.exit(text) write the text and then the
    newline, two writes, and another thread's or process's output that comes in between is
    glued to the end of the line (seen: a c10d warning from the store watcher's thread,
    `[W... TCPStore.cpp] recvValue failed`, appended to a rank's one-line join failure).
    One write of the whole line reaches the file descriptor as it is, and a pipe takes a
    write of up to 4096 bytes (PIPE_BUF) whole."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def error_line(message, kind: str = "error") -> str:
    """`PROGRAM: error: MESSAGE`, the form of argparse's own errors (kind "warning" for
    a warning)."""
    return f"{os.path.basename(sys.argv[0]) or 'train'}: {kind}: {message}"


_as_program = False  # set by run_main called as the program (argv None): the process ends with it
_joined_a_group = False  # set by utils.distributed.setup: only such a process needs `leave`


def joined_a_group():
    """Called when this process joins a process group: from then on, run_main ends it
    through `leave` (a process that never did, e.g. one refused at argument parsing,
    exits normally)."""
    global _joined_a_group
    _joined_a_group = True


SHM_DIR = "/dev/shm"  # where DataLoader workers put the batches they hand over (Linux)


def shm_free_bytes(path: str = None):
    """Free bytes in the shared-memory folder (free, not its size: other jobs may be
    using it), or None where there is none."""
    try:
        st = os.statvfs(path or SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def bus_error_message(err: BaseException):
    """One line for a DataLoader worker killed by SIGBUS, or None for any other error.

    A worker hands each batch over in shared memory (/dev/shm); when that folder is
    full, writing to it kills the worker with a bus error. Docker gives a container
    64 MB of it unless told otherwise."""
    # The loader's SIGCHLD handler raises it wherever the main thread is, possibly while
    # another error (the dead worker's socket) is being handled: look down the chain too.
    chain = []
    while err is not None and not ("DataLoader worker" in str(err) and "Bus error" in str(err)):
        chain.append(err)
        err = err.__cause__ or err.__context__
    if err is None:
        # A worker that dies while handing a batch over closes its socket a moment before
        # it can be seen as dead: give it a second when that is what failed here.
        lost_a_socket = any(isinstance(e, (ConnectionError, EOFError)) for e in chain)
        if not _a_loader_worker_died_of_sigbus(wait_s=1.0 if lost_a_socket else 0.0):
            return None
    free = shm_free_bytes()
    where = f"{SHM_DIR}: {free / 2**20:.0f} MB free now" if free is not None else f"no {SHM_DIR} here"
    return (f"a DataLoader worker died of a bus error, which in a loader worker almost always means "
            f"that the shared-memory folder ran out ({where}). "
            "In Docker run with --ipc=host or --shm-size=2g; elsewhere make the folder larger "
            "(mount -o remount,size=2G /dev/shm) or lower --workers or --batch-size; "
            "scripts/preflight.py shows what the workers need")


# The worker processes of the DataLoader iterators that utils.data.Loader made (weakly held).
_loader_workers = weakref.WeakSet()


def note_loader_workers(iterator):
    """Remember the worker processes of a DataLoader iterator (none for --workers 0), so that
    a worker's death by SIGBUS can still be told after the loader has reaped it."""
    for worker in getattr(iterator, "_workers", ()):  # _MultiProcessingDataLoaderIter's list
        _loader_workers.add(worker)


def _a_loader_worker_died_of_sigbus(wait_s: float = 0.0) -> bool:
    """Whether a daemonic child (a DataLoader worker) of this process ended by SIGBUS. When
    the worker dies while handing a batch over, the error seen first is its closed socket
    (ConnectionResetError), not the loader's. multiprocessing keeps its started children
    in process._children (not public, hence the care) until they are joined or seen dead:
    the loader's own check of its workers after a failed read (worker.is_alive(), in
    _try_get_data, in 2.11 and 2.14) takes the dead worker out of that set before its
    "exited unexpectedly" error reaches us, so the workers of our loaders are looked at too,
    where the loader keeps them (their exit status stays readable)."""
    import multiprocessing.process
    bus = getattr(signal, "SIGBUS", None)
    deadline = time.monotonic() + wait_s
    try:
        while bus is not None:
            for child in {*getattr(multiprocessing.process, "_children", ()), *_loader_workers}:
                try:
                    if child.daemon and child.exitcode == -bus:
                        return True
                except (AssertionError, OSError, ValueError):  # not ours to poll, or closed
                    continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
    except RuntimeError as err:  # the loader's SIGCHLD handler, raising while we wait
        if "DataLoader worker" in str(err) and "Bus error" in str(err):
            return True
        raise
    return False


def leave(code: int = 0, message: str = None):
    """End this process now, once its work is done and its process group destroyed.

    The interpreter's own teardown is skipped on purpose. destroy_process_group() does
    not stop gloo's worker threads (gloo has no shutdown); they end when the last
    reference to the group goes, and once a DDP model has used the group something in
    PyTorch still holds it (measured: the threads still ran after `del model`,
    gc.collect() and destroy_process_group(); pytorch/pytorch issues 72366, 107298). A
    worker thread (ProcessGroupGloo::runLoop) can then free a finished work item whose
    tensors were made in Python while the main thread finalizes the interpreter; freeing
    them needs the GIL, Python (up to 3.13) ends that thread with pthread_exit inside a
    noexcept destructor: `terminate called without an active exception`, SIGABRT, and
    the launcher reports a failure for a job that completed (pytorch/pytorch issue
    190489). It strikes most often when a collective is the last thing a rank does
    before exiting; tutorials/09-debugging.md has the measurements.

    Before exiting this runs the atexit handlers (which also end the DataLoader workers
    still alive, see preemption.end_loader_workers_at_exit, and flush logging) and
    flushes stdout and stderr; nothing else (__del__ methods, other open files) runs."""
    if message:
        print_line(message)
    try:
        import atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed, or a broken pipe: nothing left to save
                pass
        os._exit(code)
