"""Shared test helpers: run the real scripts as subprocesses, bounded in time."""
import atexit
import contextlib
import gc
import inspect
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The temporary files of every process a test starts go here, not straight into /tmp:
# torchrun makes a log folder (torchelastic_*) for each run and never removes it, and a
# process the test kills on purpose removes nothing. One folder for each pytest process
# (each xdist worker), inside $TMPDIR when one is set, removed when that process ends, and
# passed on in the environment. This process keeps the folder it had (pytest's tmp_path
# lives there, kept for a look after a failure): tempfile reads TMPDIR once, here.
tempfile.gettempdir()
CHILD_TMPDIR = tempfile.mkdtemp(prefix="tests-")
atexit.register(shutil.rmtree, CHILD_TMPDIR, ignore_errors=True)
os.environ["TMPDIR"] = CHILD_TMPDIR


def private_tmpdir() -> Path:
    """A TMPDIR for one run of its own, to see what the run leaves there. Short, and inside
    CHILD_TMPDIR: a loader worker binds a socket in it (pymp-*/listener-*), and a socket's
    path may not exceed 107 bytes, which tmp_path (/tmp/pytest-of-USER/pytest-N/popen-gwN/
    TEST_NAME/) nearly takes up alone."""
    return Path(tempfile.mkdtemp(prefix="t-", dir=CHILD_TMPDIR))


def left_in(tmp: Path) -> list:
    """What a run left in its TMPDIR, apart from PyTorch's compile cache (torchinductor_USER,
    kept between runs on purpose)."""
    return sorted(entry.name for entry in tmp.iterdir() if not entry.name.startswith("torchinductor_"))


# Small, fast settings every script accepts: the tiny ResNet on a slice of synthetic data.
SMALL = ["--dataset", "synthetic", "--model", "resnet_tiny", "--train-samples", "256",
         "--test-samples", "100", "--batch-size", "32", "--workers", "0", "--epochs", "1"]


def with_flag(argv, flag, value):
    """SMALL with one flag's value replaced."""
    argv = list(argv)
    argv[argv.index(flag) + 1] = str(value)
    return argv


def cli_args(*argv):
    """The scripts' command line parsed from argv alone, with no loader workers."""
    from models import MODEL_NAMES
    from utils import cli
    return cli.parse_args(cli.build_parser("", MODEL_NAMES), ["--workers", "0", *map(str, argv)])


def small_args(*argv):
    """SMALL's settings, then argv, parsed as the scripts parse their command line."""
    from models import MODEL_NAMES
    from utils import cli
    return cli.parse_args(cli.build_parser("", MODEL_NAMES), [*SMALL, *map(str, argv)])


def one_cpu_process():
    """Who a plain `python` run on the CPU is: rank 0 of 1, no process group. A function, not
    a constant: conftest imports torch only where it is used (the reaper's tests start
    processes that import conftest and nothing of PyTorch)."""
    import torch
    from utils.distributed import DistEnv
    return DistEnv(0, 0, 1, 1, torch.device("cpu"), False)


# The test files, longest first: `make test` hands them to its workers in this order
# (--no-loadscope-reorder), so that no long file is left to run alone at the end while the other
# workers idle. A file not named here takes a few seconds; one that grows long belongs in the list.
LONGEST_FIRST = ["test_fault_tolerance.py", "test_docs.py", "test_hosts.py", "test_slurm_cluster.py",
                 "test_benchmark.py", "test_fsdp.py", "test_flags.py", "test_distributed_script.py",
                 "test_clip_grad.py", "test_distributed_mp.py", "test_cli.py", "test_plot_metrics.py",
                 "test_own_data.py", "test_observe.py", "test_gpu_check.py", "test_preflight.py",
                 "test_data.py", "test_device_data.py", "test_collectives.py", "test_ddp.py",
                 "test_missed_collective.py", "test_gradient_accumulation.py", "test_apex.py", "test_bad_input.py",
                 "test_launchers.py", "test_checkpoint.py", "test_strategies_equivalence.py", "test_figures.py",
                 "test_fork_safety.py", "test_dataparallel.py"]

FAULTS = "tests/fault_injection.py"  # run from the repository root, as the scripts are
# Every launcher in scripts/ sets this: torchrun's shared rendezvous store otherwise hands
# restarted workers their peers' addresses from the attempt before (pytorch/pytorch#135712).
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def pytest_configure(config):
    start_reaper()


def start_reaper():
    """Mark everything this test process starts from now on with its pid (reaper.OWNERS_VAR,
    inherited by every descendant), and start tests/reaper.py, which ends those processes and
    frees this process's test hosts once it is gone: after a Ctrl-C that cut a fixture's
    teardown short, or a SIGKILL. Once per process (the controller and each xdist worker)."""
    import reaper
    if os.environ.get(reaper.OWNERS_VAR, "").endswith(f":{os.getpid()}:") or not os.path.isdir("/proc"):
        return
    env = {k: v for k, v in os.environ.items() if k != reaper.OWNERS_VAR}  # the reaper owns nothing
    subprocess.run([sys.executable, reaper.__file__, str(os.getpid())], env=env, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=60,
                   start_new_session=True)  # out of the terminal's reach (Ctrl-C) from its first instant
    os.environ[reaper.OWNERS_VAR] = f"{os.environ.get(reaper.OWNERS_VAR, ':')}{os.getpid()}:"


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
    for item in items:
        marker = item.get_closest_marker("not_on_floor")
        if marker is not None and not (marker.args and isinstance(marker.args[0], str) and marker.args[0]):
            raise pytest.UsageError(f"{item.nodeid}: not_on_floor needs its reason (which tests run the same "
                                    f"PyTorch calls on the floor)")
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def assert_same_state(a, b, what="state"):
    """Two state dicts (or checkpoints) alike entry by entry: tensors bitwise, the rest ==."""
    import torch
    assert a.keys() == b.keys(), what
    for key in a:
        if isinstance(a[key], dict):
            assert_same_state(a[key], b[key], f"{what}.{key}")
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), f"{what}.{key} differs"
        else:
            assert a[key] == b[key], f"{what}.{key}: {a[key]!r} != {b[key]!r}"


def assert_same_training_state(path, reference, global_step):
    """Two checkpoints of one training, at `global_step`: model, optimizer and scheduler bitwise;
    the epoch's training sums to rounding (a resumed run adds the same numbers in another order)."""
    import torch
    got, want = (torch.load(p, weights_only=True) for p in (path, reference))
    assert got["global_step"] == want["global_step"] == global_step
    assert (got["epoch"], got["step_in_epoch"]) == (want["epoch"], want["step_in_epoch"])
    assert want["optimizer"]["state"], "no optimizer state to compare"
    for key in ("model", "optimizer", "scheduler"):
        assert_same_state(got[key], want[key], key)
    assert got["train_sums"] == pytest.approx(want["train_sums"], rel=1e-12)


def max_difference(a: dict, b: dict) -> float:
    """The largest absolute difference over every tensor of two nested dicts of equal keys (the
    other values equal)."""
    import torch
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        if isinstance(a[key], dict):
            worst = max(worst, max_difference(a[key], b[key]))
        elif isinstance(a[key], torch.Tensor):
            assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
            worst = max(worst, (a[key].double() - b[key].double()).abs().max().item())
        else:
            assert a[key] == b[key], f"{key}: {a[key]!r} != {b[key]!r}"
    return worst


def make_run(args, model_name="resnet_tiny"):
    """A TrainingRun of one CPU process, 8 steps an epoch, on a model seeded with 0 and its SGD."""
    import torch
    from models import build_model
    from utils import schedule
    from utils.run import TrainingRun
    torch.manual_seed(0)
    model = build_model(model_name, 100)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * args.batch_size / 128, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = schedule.warmup_multistep(optimizer, args, 8)
    run = TrainingRun(args, one_cpu_process(), model, optimizer, scheduler, train_size=8 * args.batch_size,
                      strategy="test")
    return run, model, optimizer


def take_one_step(run, model, optimizer):
    """make_run's first optimizer step, on 4 random images, and its checkpoint."""
    import torch
    import torch.nn.functional as F
    epochs = run.epochs()
    next(epochs)
    images, targets = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    logits = model(images)
    loss = F.cross_entropy(logits, targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    run.scheduler.step()
    run.meter.update(loss.detach(), logits.detach(), targets)
    run.step_done()
    run.save()


def load_script(name):
    """A training script as a module, its model built without batch norm."""
    import importlib.util

    import torch
    from models import build_model
    spec = importlib.util.spec_from_file_location(name[:-len(".py")], ROOT / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build_model = lambda model_name, num_classes: build_model(model_name, num_classes,
                                                                    norm_layer=torch.nn.Identity)
    return module


def free_port() -> int:
    """A free port on 127.0.0.1 outside the kernel's ephemeral range, as distributed_mp.py
    picks its own (utils.spawn.free_port): a process started later listens on it, and an
    ephemeral one may meanwhile go to any outgoing connection of the tests beside."""
    from utils import spawn
    return spawn.free_port("127.0.0.1")


def two_nodes_here():
    """(interface, address) for two nodes on this host: not loopback, where gloo listens for a job of
    several nodes (utils/network.py refuses 127.x there); skipped without one."""
    from utils import network
    outside = [(name, address) for name, address in network.interfaces().items() if not network.is_loopback(address)]
    if not outside:
        pytest.skip("two nodes on one host need an interface whose address is not loopback")
    return outside[0]


def normalized(pixels):
    """What the scripts' normalised values must be: uint8 images (..., 3, H, W) by the formula, on the CPU
    (utils/data.py's Normalize looks them up in a table, bitwise these on any device)."""
    import torch
    from utils import data
    mean, std = (torch.tensor(stats).view(3, 1, 1) for stats in (data.CIFAR100_MEAN, data.CIFAR100_STD))
    return (pixels.float() / 255 - mean) / std


def subprocess_env(**extra) -> dict:
    env = dict(os.environ)
    # Never inherit a launcher's identity from the test runner's environment.
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT", "GROUP_RANK"):
        env.pop(key, None)
    # CPU tests stay on the CPU on a GPU machine too; GPU tests pass CUDA_VISIBLE_DEVICES back.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_script(args, timeout=180, check=True, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Run `python <args>` (or any argv starting with a module flag) from the repo root."""
    cmd = [sys.executable, *map(str, args)]
    proc = subprocess.run(cmd, cwd=cwd or ROOT, env=env or subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n"
                             f"--- stderr\n{proc.stderr}")
    return proc


def observing_entry(tmp_path, patch: str):
    """A file to give torchrun as its entry point: it runs `patch` (Python that wraps some of
    PyTorch to report what the script does with it), then the script named first among its
    arguments, as __main__ and with that script's argv, so the script cannot tell."""
    entry = tmp_path / "observing_entry.py"
    entry.write_text(textwrap.dedent(patch) + textwrap.dedent("""
        import runpy, sys
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
        """))
    return entry


def patched_on_import(tmp_path, module: str, attribute: str, wrap) -> str:
    """A folder to put first on PYTHONPATH: every Python process started with it (mp.spawn's
    workers too) replaces module.attribute ("name" or "Class.name"), once the module is imported,
    with wrap(original, module). Only wrap's source is copied: it imports what it needs itself."""
    folder = tmp_path / "patched_on_import"
    folder.mkdir(exist_ok=True)
    *owner_path, name = attribute.split(".")
    folder.joinpath("sitecustomize.py").write_text(textwrap.dedent(inspect.getsource(wrap)) + textwrap.dedent(f"""
        import importlib.abc, importlib.machinery, sys

        class Patch(importlib.abc.MetaPathFinder):  # Python imports sitecustomize at start-up
            def find_spec(self, name, path, target=None):
                if name != {module!r}:
                    return None
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                load = spec.loader.exec_module

                def exec_module(mod):
                    load(mod)
                    owner = mod
                    for part in {owner_path!r}:
                        owner = getattr(owner, part)
                    setattr(owner, {name!r}, {wrap.__name__}(getattr(owner, {name!r}), mod))
                spec.loader.exec_module = exec_module
                return spec

        sys.meta_path.insert(0, Patch())
        """))
    return str(folder)


def group_norm(channels: int):
    """build_model(..., norm_layer=group_norm): no batch statistics, which depend on how the batch is split."""
    import torch.nn as nn
    return nn.GroupNorm(min(32, channels), channels)


# --- processes in sessions of their own ---------------------------------------------------

TAG = "FAULT_TOLERANCE_TEST_TAG"


def tagged_pids(tag):
    """Every process started with TAG=tag in its environment. torchrun starts its workers in new
    sessions: the launcher's process group would miss them."""
    needle, found = f"{TAG}={tag}".encode(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def kill_tagged(tag):
    for pid in tagged_pids(tag):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class Proc:
    """A command (a list, `python` by default) started in the repo root; stdout and stderr
    together in one file (a pipe would keep the reader waiting on any orphaned worker that
    still holds it)."""

    def __init__(self, args, program=(sys.executable,), **env):
        self.args = [*program, *map(str, args)]
        self.tag = uuid.uuid4().hex
        self.log = tempfile.TemporaryFile("w+")
        self.started = time.time()
        self.popen = subprocess.Popen(self.args, cwd=ROOT,
                                      env=subprocess_env(**{TAG: self.tag}, **env),
                                      stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)

    def wait(self, timeout):
        try:
            self.rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{' '.join(self.args)} still running after {timeout} s\n"
                                 f"{self.output()}") from None
        except BaseException:
            # pytest-timeout's failure or Ctrl-C, raised in here: the command's session would
            # outlive the test (on a GPU machine holding the GPU for the checks after it).
            self.kill()
            raise
        self.ended = time.time()
        self.kill()  # whatever it left behind
        return self

    def output(self):
        self.log.seek(0)
        return self.log.read()

    def kill(self):
        kill_tagged(self.tag)
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def expect(proc, rc=0):
    """A waited Proc's exit status must be rc; its output."""
    assert proc.rc == rc, (f"{' '.join(proc.args)} exited {proc.rc}, expected {rc}\n"
                           f"{proc.output()}")
    return proc.output()


def torchrun(nproc, script, args, timeout=240, check=True, extra_torchrun=(), env=None):
    return run_script(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                       *extra_torchrun, script, *args], timeout=timeout, check=check, env=env)


ON_RANK_1 = """
import os, runpy, sys
sys.path.insert(0, {root!r})
if os.environ["RANK"] == "1":
    {patch}
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def on_rank_1(tmp_path, script: str, patch: str):
    """An entry point for torchrun: `script`, after `patch` (one line of Python) on rank 1."""
    runner = tmp_path / "on_rank_1.py"
    runner.write_text(ON_RANK_1.format(root=str(ROOT), script=str(ROOT / script), patch=patch))
    return runner


def samples_by_index(train_set, args, world_size, global_batch, epoch=1) -> dict:
    """{index: (input, label)} of one epoch as data.train_loader delivers it to `world_size`
    ranks together (each rank's loader built in turn, here in one process)."""
    import torch
    from utils import data
    from utils.distributed import DistEnv
    found = {}
    for rank in range(world_size):
        env = DistEnv(rank, rank, world_size, world_size, torch.device("cpu"), False)
        loader = data.train_loader(train_set, global_batch // world_size, global_batch, env, args)
        loader.sampler.set_epoch(epoch)
        keys = list(loader.sampler)
        batches = list(loader)
        inputs = torch.cat([inputs for inputs, _ in batches])
        labels = torch.cat([labels for _, labels in batches])
        assert len(inputs) == len(keys) == len(loader.sampler)
        found.update({index: (x, y) for (index, _), x, y in zip(keys, inputs, labels)})
    return found


def read_metrics(path) -> list:
    """The --metrics file's records, read as strict JSON: NaN or Infinity, which Python's json writes
    by default and other readers refuse, fail the test."""
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")
    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f if line.strip()]


def assert_one_line_error(proc, *fragments):
    """Bad input: exit status 2, one line on stderr holding each fragment, no traceback."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def gpu_subprocess_env(**extra) -> dict:
    """subprocess_env for a GPU test: the GPUs this test process sees stay visible."""
    env = subprocess_env(**extra)
    if "CUDA_VISIBLE_DEVICES" not in extra:
        if "CUDA_VISIBLE_DEVICES" in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            del env["CUDA_VISIBLE_DEVICES"]
    return env


def keep_on_cpu(monkeypatch):
    """A script's main() run in the test process trains on the CPU on a GPU machine too:
    CPU tests compare to 1e-6 or bitwise, which TF32 and cuDNN's nondeterministic kernels
    would not meet. (CUDA_VISIBLE_DEVICES cannot do it here: CUDA may be initialised already.)"""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)


def fake_accelerator(monkeypatch, kind, count=1):
    """Stand in for a machine whose accelerator is `kind` ('cuda', 'xpu', 'mps') with
    `count` devices, or for one without (kind None), as torch.accelerator reports it.
    Selecting a device index is a no-op here: nothing may run on the stand-in."""
    import torch
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: kind is not None and count > 0)
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: torch.device(kind) if kind else None)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count if kind else 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    # dataparallel.py asks torch.cuda: it runs on CUDA GPUs only.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: kind == "cuda" and count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count if kind == "cuda" else 0)


# Python's own warning filters (the warnings module's documentation, "Default Warning Filter"),
# first match first: what a script run as `python SCRIPT` shows.
PYTHON_DEFAULT_WARNINGS = [("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
                           ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""),
                           ("ignore", ResourceWarning, "")]


def lock_descriptors() -> set:
    """This process's open descriptors of a checkpoint folder's .lock (utils/checkpoint.py's lock_directory keeps
    its own open, with its lock, until the process ends)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").endswith("/.lock"):
                found.add(int(fd))
    return found


@contextlib.contextmanager
def process_state_kept():
    """What a training run made in this process keeps until the process ends, given back on leaving:
    its stop-signal handlers (utils.run.StopSignal; only finish() restores them) and its checkpoint
    folder's locked .lock descriptor (closed, as the process's exit closes it)."""
    from utils import lifecycle
    handlers, locks = {sig: signal.getsignal(sig) for sig in lifecycle.SIGNALS}, lock_descriptors()
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for fd in lock_descriptors() - locks:
            os.close(fd)


@pytest.fixture(autouse=True)
def _process_state_kept():
    """Every test: a run it made (a script's main, a TrainingRun) leaves nothing to the next tests."""
    with process_state_kept():
        yield


def script_runner(monkeypatch, capture):
    """run(script, argv, **env) -> (exit status, stdout, stderr): the script's main behind
    lifecycle.run_main, in this process, as `python SCRIPT ARGV` runs it with the launcher's
    variables of `env` only (none: plain python), on the CPU. A tenth of a second where a
    subprocess takes two (it imports torch again). `capture()`: a context manager that
    collects what the run prints and returns a function giving (stdout, stderr)."""
    import importlib

    import torch
    from utils import lifecycle
    freeze_the_imports()
    keep_on_cpu(monkeypatch)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(lifecycle, "_joined_a_group", False)
    monkeypatch.setattr(lifecycle, "_job", None)
    monkeypatch.setattr(lifecycle, "_group_store", None)

    def run(script, argv, **env):
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
        monkeypatch.setattr(sys, "argv", [script])
        module = importlib.import_module(script[:-3])
        code, threads = 0, torch.get_num_threads()
        torch.set_num_threads(1)  # as in the scripts' subprocesses (OMP_NUM_THREADS=1): the same sums
        with capture() as printed, warnings.catch_warnings(), process_state_kept():
            # Warnings printed on stderr, as `python SCRIPT` shows them (Python's default
            # filters), not collected by pytest: a refusal must still be one line.
            warnings.resetwarnings()
            for action, category, module_name in reversed(PYTHON_DEFAULT_WARNINGS):
                warnings.filterwarnings(action, category=category, module=module_name)
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: \
                sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
            # torchelastic's @record (lifecycle.run_main) enables faulthandler on sys.stderr, which has
            # no file descriptor while the output is captured: it warns and goes on without.
            warnings.filterwarnings("ignore", message="Unable to enable fault handler")
            try:
                lifecycle.run_main(module.main, [str(a) for a in argv])
            except SystemExit as stop:
                code = stop.code
            finally:
                torch.set_num_threads(threads)
        return (code, *printed())
    return run


_imports_frozen = False


def freeze_the_imports():
    """Before the first run in this process: PyTorch's modules out of the garbage collector's
    sight (gc.freeze), once. Importing torch and torch._dynamo (which the first optimizer
    imports: Optimizer.add_param_group is wrapped by torch._disable_dynamo) leaves over 300,000
    objects that live as long as the process, and every full collection walks them all: 0.1 to
    0.2 s each on the 2-core build machine, dozens of times over a file of runs in one process
    (test_flags.py alone: 35.8 CPU-s with them walked, 28.4 without). Only what is alive now is
    frozen, after a collection: the garbage the runs leave behind is collected as before."""
    global _imports_frozen
    if not _imports_frozen:
        import torch._dynamo  # noqa: F401
        gc.collect()
        gc.freeze()
        _imports_frozen = True


@pytest.fixture
def run_in_process(monkeypatch, capsys):
    """script_runner for one test, its output read through capsys."""
    @contextlib.contextmanager
    def capture():
        capsys.readouterr()
        result = []
        yield lambda: result[0]
        captured = capsys.readouterr()
        result.append((captured.out, captured.err))

    return script_runner(monkeypatch, capture)


@pytest.fixture(scope="module")
def run_in_process_once():
    """script_runner for a module's fixtures: runs shared by several tests, made once. What
    a run patches (the CPU only, the environment) is undone when it returns, not when the
    module ends: the module's other tests (a GPU test among them) see this process as it was."""
    @contextlib.contextmanager
    def capture():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield lambda: (out.getvalue(), err.getvalue())

    def run(script, argv, **env):
        with pytest.MonkeyPatch.context() as monkeypatch:
            return script_runner(monkeypatch, capture)(script, argv, **env)

    return run


def expect_ok(outcome) -> str:
    """run_in_process's outcome of a run that must succeed: exit status 0; its stdout."""
    code, out, err = outcome
    assert code in (0, None), f"exit {code}\n{out}\n{err}"
    return out


def assert_refused(outcome, *fragments):
    """run_in_process's outcome for bad input: exit status 2, one line on stderr holding each
    fragment, no traceback, nothing on stdout."""
    code, out, err = outcome
    assert code == 2, f"exit {code}\n{out}\n{err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err + out, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# --- the lessons' markdown ------------------------------------------------------------------

TUTORIALS = ROOT / "tutorials"
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def lesson_files():
    return [p for p in sorted(TUTORIALS.glob("*.md")) if p.name != "README.md"]


def prose_of(path: Path) -> str:
    """The text outside code blocks (links in code are not links)."""
    out, inside, fence = [], False, ""
    for line in path.read_text().splitlines():
        m = FENCE.match(line)
        if m and (not inside or line.strip().startswith(fence)):
            inside, fence = (not inside), m.group(2)[0] * 3
            continue
        if not inside:
            out.append(line)
    return "\n".join(out)


def links_of(path: Path):
    """Relative link targets (no URLs, no pure #anchors), anchors stripped."""
    targets = []
    for m in LINK.finditer(prose_of(path)):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#")[0])
    return targets
