"""The shared command line: defaults, the seed repositories' aliases, batch
splitting and the one-line error contract."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, subprocess_env
from models import MODEL_NAMES
from utils import cli, lifecycle


def parse(argv):
    return cli.parse_args(cli.build_parser(__doc__, MODEL_NAMES), argv)


@pytest.fixture
def no_local_rank(monkeypatch):
    """LOCAL_RANK absent for the test and restored afterwards (parse_args may set it)."""
    monkeypatch.setenv("LOCAL_RANK", "unset")  # records the original value for the undo
    monkeypatch.delenv("LOCAL_RANK")


def assert_one_line_usage_error(excinfo, capsys, *fragments):
    assert excinfo.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    assert "usage:" not in captured.err  # argparse's usage block is replaced by one line
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert captured.out == ""
    return lines[0]


# --- defaults and aliases ---------------------------------------------------------------

def test_defaults_reproduce_the_published_recipe(no_local_rank):
    args = parse([])
    assert args.dataset == "cifar100" and args.data_dir == "./data"
    assert args.train_samples is None and args.test_samples is None
    assert args.model == "resnet18"
    assert args.epochs == 200 and args.batch_size == 128
    assert args.lr == 0.1 and args.momentum == 0.9 and args.weight_decay == 5e-4
    assert args.warmup_epochs == 1.0 and args.nesterov is True
    assert args.seed == 0 and args.workers is None  # None: what the machine can feed, see below
    assert args.max_steps is None and args.checkpoint_dir is None and args.checkpoint_every is None
    assert args.resume is None and args.metrics is None and args.local_rank is None
    assert "LOCAL_RANK" not in os.environ


def test_kebab_case_flags(no_local_rank):
    args = parse(["--dataset", "synthetic", "--data-dir", "/d", "--train-samples", "7", "--test-samples", "5",
                  "--model", "resnet_tiny", "--epochs", "3", "--batch-size", "64", "--lr", "0.05",
                  "--weight-decay", "0", "--max-steps", "9", "--checkpoint-dir", "ck", "--checkpoint-every", "2",
                  "--resume", "--metrics", "m.jsonl", "--workers", "0"])
    assert (args.dataset, args.data_dir, args.train_samples, args.test_samples) == ("synthetic", "/d", 7, 5)
    assert (args.model, args.epochs, args.batch_size, args.lr) == ("resnet_tiny", 3, 64, 0.05)
    assert (args.weight_decay, args.max_steps, args.workers) == (0.0, 9, 0)
    assert (args.checkpoint_dir, args.checkpoint_every, args.resume, args.metrics) == ("ck", 2, "auto", "m.jsonl")


def test_nesterov_can_be_switched_off(no_local_rank):
    assert parse(["--no-nesterov"]).nesterov is False


def test_resume_takes_an_optional_path(no_local_rank):
    assert parse(["--resume", "run/checkpoint.pt"]).resume == "run/checkpoint.pt"


@pytest.mark.parametrize("argv, dest, value", [
    (["--batch_size", "256"], "batch_size", 256),
    (["--data_dir", "/x"], "data_dir", "/x"),
    (["--weight_decay", "0.001"], "weight_decay", 0.001),
])
def test_seed_repository_aliases(no_local_rank, argv, dest, value):
    assert getattr(parse(argv), dest) == value


@pytest.mark.parametrize("argv", [["--local_rank", "3"], ["--local-rank", "3"], ["--local-rank=3"]])
def test_local_rank_from_the_old_launcher_sets_the_environment(no_local_rank, argv):
    args = parse(argv)
    assert args.local_rank == 3
    assert os.environ["LOCAL_RANK"] == "3"


def test_local_rank_flag_does_not_override_the_launchers_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    args = parse(["--local_rank", "3"])
    assert args.local_rank == 3
    assert os.environ["LOCAL_RANK"] == "1"


def test_local_rank_is_not_advertised_in_help(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser(__doc__, MODEL_NAMES).parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--local-rank" not in out and "--batch-size" in out


def test_help_shows_every_default(capsys):
    """argparse shows a default only beside a help text: a flag without one hid its default (--epochs 200)."""
    parser = cli.build_parser(__doc__, MODEL_NAMES)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # the help's line breaks fall anywhere
    shown = [a for a in parser._actions if a.default not in (None, argparse.SUPPRESS) and a.help != argparse.SUPPRESS]
    assert {"--epochs", "--model", "--seed", "--weight-decay"} <= {a.option_strings[0] for a in shown}
    for action in shown:
        assert f"(default: {action.default})" in out, f"{action.option_strings[0]}: no default in --help"


# --- batch splitting --------------------------------------------------------------------

@pytest.mark.parametrize("global_batch, world_size, accum_steps, per_device", [
    (128, 1, 1, 128), (128, 4, 1, 32), (128, 2, 4, 16), (96, 3, 1, 32), (8, 8, 1, 1),
])
def test_split_batch_divides_the_global_batch(global_batch, world_size, accum_steps, per_device):
    assert cli.split_batch(global_batch, world_size, accum_steps) == per_device
    assert per_device * world_size * accum_steps == global_batch


def test_split_batch_shows_the_arithmetic():
    with pytest.raises(cli.UsageError) as excinfo:
        cli.split_batch(100, 3)
    message = str(excinfo.value)
    assert "\n" not in message
    assert "batch size 100" in message and "3 processes" in message
    assert "100 / 3 = 33.3333" in message
    assert "e.g. 99" in message  # the nearest multiple below


def test_split_batch_with_accumulation_names_both_factors():
    with pytest.raises(cli.UsageError) as excinfo:
        cli.split_batch(100, 3, accum_steps=2)
    message = str(excinfo.value)
    assert "3 processes x 2 accumulation steps" in message
    assert "100 / 6 = 16.6667" in message and "e.g. 96" in message


def test_split_batch_smaller_than_the_world():
    with pytest.raises(cli.UsageError) as excinfo:
        cli.split_batch(2, 4)
    assert "2 / 4 = 0.5" in str(excinfo.value) and "e.g. 4" in str(excinfo.value)


def test_split_batch_one_process_is_singular():
    assert "by 1 process " in _message(lambda: cli.split_batch(5, 1, accum_steps=2))


def _message(call):
    with pytest.raises(cli.UsageError) as excinfo:
        call()
    return str(excinfo.value)


# --- bad input: one line, exit status 2 -----------------------------------------------

@pytest.mark.parametrize("flag", ["--epochs", "--max-steps", "--batch-size", "--batch_size",
                                  "--train-samples", "--checkpoint-every"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_non_positive_counts_are_refused_in_one_line(capsys, no_local_rank, flag, value):
    with pytest.raises(SystemExit) as excinfo:
        lifecycle.run_main(parse, [flag, value, "--checkpoint-dir", "ck"])
    line = assert_one_line_usage_error(excinfo, capsys, flag.split("_")[0], value, "at least 1")
    assert line.endswith("(see --help)")


@pytest.mark.parametrize("argv, fragment", [
    (["--epochs", "two"], "'two'"),
    (["--lr", "0"], "--lr"),
    (["--momentum", "-0.1"], "--momentum"),
    (["--workers", "-1"], "--workers"),
    (["--model", "resnet19"], "resnet19"),
    (["--dataset", "imagenet"], "imagenet"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--resume"], "--checkpoint-dir"),
    (["--checkpoint-every", "5"], "--checkpoint-dir"),
])
def test_other_bad_flags_are_one_line(capsys, no_local_rank, argv, fragment):
    with pytest.raises(SystemExit) as excinfo:
        lifecycle.run_main(parse, argv)
    assert_one_line_usage_error(excinfo, capsys, fragment)


def test_run_main_turns_usage_error_into_one_line_and_status_2(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)

    def main(argv):
        cli.split_batch(100, 3)

    with pytest.raises(SystemExit) as excinfo:
        lifecycle.run_main(main, [])
    line = assert_one_line_usage_error(excinfo, capsys, "error:", "batch size 100", "3 processes")
    assert line.split(": error: ")[1].startswith("batch size 100")


def test_run_main_prints_only_on_global_rank_0(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")

    def main(argv):
        raise cli.UsageError("the same bad input on every rank")

    with pytest.raises(SystemExit) as excinfo:
        lifecycle.run_main(main, [])
    assert excinfo.value.code == 2
    assert capsys.readouterr().err == ""


def test_run_main_returns_normally_on_success():
    import gc
    frozen = gc.get_freeze_count()
    seen = []
    lifecycle.run_main(seen.append, ["--x"])
    assert seen == [["--x"]]
    assert gc.get_freeze_count() == frozen  # a caller's process: its collector sees what it saw


# A program that calls run_main as the scripts do. The witness's __del__ runs only in
# the interpreter's teardown, so its line shows whether the process left through
# lifecycle.leave (os._exit, no teardown) or exited normally.
RUN_MAIN_PROGRAM = """
import sys
sys.path.insert(0, {root!r})
from utils import cli, lifecycle

class Witness:
    import time
    slow = "slow-teardown" in sys.argv and time.sleep  # (module globals may be gone by then)

    def __del__(self):
        print("teardown ran", flush=True)
        self.slow and self.slow(2)

witness = Witness()

def main(argv):
    if "join" in sys.argv:
        lifecycle.joined_a_group()  # what utils.distributed.setup calls after init_process_group
    if "slow-teardown" in sys.argv:  # a handler of its own, as mp.spawn's parent forwards the stop signals
        import signal
        signal.signal(signal.SIGTERM, lambda *_: print("forwarded", flush=True))
    print("main ran", flush=True)
    if "slow-exit" in sys.argv:  # a rank still on its way out, as under load
        import atexit, time
        atexit.register(time.sleep, 3)
    if "usage-error" in sys.argv:
        raise cli.UsageError("bad input")

lifecycle.run_main(main)
"""


@pytest.mark.parametrize("args, code, teardown", [
    (["join"], 0, False),                 # a rank that finished: leave, exit 0
    (["join", "usage-error"], 2, False),  # refused after joining: leave, exit 2
    ([], 0, True),                        # never joined a group (one process): exit as usual
    (["usage-error"], 2, True),           # refused at argument parsing: exit as usual
])
def test_run_main_as_the_program_leaves_without_teardown_once_a_group_was_joined(
        tmp_path, args, code, teardown):
    # Whether a group was joined is only known after main has run: a check made before
    # it once sent every finished torchrun rank through the interpreter's teardown,
    # where gloo's threads abort it now and then.
    program = tmp_path / "program.py"
    program.write_text(RUN_MAIN_PROGRAM.format(root=os.path.dirname(os.path.dirname(__file__))))
    env = dict(os.environ)
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(program), *args], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "main ran" in proc.stdout, proc.stdout + proc.stderr
    assert ("teardown ran" in proc.stdout) == teardown, proc.stdout + proc.stderr
    if code == 2:
        assert "error: bad input" in proc.stderr, proc.stderr


def test_a_program_that_finished_is_not_killed_by_a_stop_signal_in_its_teardown(tmp_path):
    # The interpreter's teardown puts back the default of a signal that Python handled: a second Ctrl-C, or a
    # repeated kill, there would kill a finished mp.spawn parent (exit -15 for a run that ended well).
    program = tmp_path / "program.py"
    program.write_text(RUN_MAIN_PROGRAM.format(root=os.path.dirname(os.path.dirname(__file__))))
    env = dict(os.environ)
    env.pop("RANK", None)
    proc = subprocess.Popen([sys.executable, str(program), "slow-teardown"], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "main ran\n" and proc.stdout.readline() == "teardown ran\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()


@pytest.mark.parametrize("joined", [False, True])
def test_a_refusing_rank_keeps_exit_status_2_when_sigterm_comes_on_its_way_out(tmp_path, joined):
    # Under torchrun the first rank to refuse makes the agent send SIGTERM to the others;
    # one still exiting must not be reported as killed by it (exitcode -15) in the summary.
    import signal
    import time
    program = tmp_path / "program.py"
    program.write_text(RUN_MAIN_PROGRAM.format(root=os.path.dirname(os.path.dirname(__file__))))
    env = dict(os.environ)
    env.pop("RANK", None)
    args = [*(["join"] if joined else []), "slow-exit", "usage-error"]
    proc = subprocess.Popen([sys.executable, str(program), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert "error: bad input" in proc.stderr.readline()  # printed: now on its way out (3 s)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 2, proc.stdout.read() + proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()


LEAVE_WITH_LOADER_WORKERS = """
import sys
sys.path.insert(0, {root!r})
import torch
from torch.utils.data import TensorDataset
from utils import cli, data, lifecycle

loader = data.Loader(TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=2,
                     persistent_workers=True, worker_init_fn=lifecycle.ignore_stop_signals)
next(iter(loader))  # the workers run, and ignore SIGTERM like every loader worker of ours
print("workers:", len(loader._iterator._workers), flush=True)
lifecycle.leave(0)  # with the loader (and so its workers) still alive
"""


def test_leave_ends_loader_workers_that_are_still_alive(tmp_path):
    # An exception's traceback (a stop on a signal raised through a worker's `with`) or a
    # caller's reference can keep a loader with persistent workers alive at leave().
    # multiprocessing's exit handler ends such children with SIGTERM and joins them; ours
    # ignore SIGTERM, so they must be ended otherwise (lifecycle.start_loader_workers),
    # or the process waits forever.
    program = tmp_path / "program.py"
    program.write_text(LEAVE_WITH_LOADER_WORKERS.format(root=os.path.dirname(os.path.dirname(__file__))))
    proc = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "workers: 2" in proc.stdout, proc.stdout + proc.stderr
    assert "DataLoader worker" not in proc.stderr, proc.stderr  # not reported as a failure


LEAVE_WITH_AN_EXIT_HANDLER_THAT_HANGS = """
import atexit, sys, time
sys.path.insert(0, {root!r})
from utils import lifecycle
atexit.register(time.sleep, 600)  # an exit handler that never returns (a pool that waits for its children)
print("leaving", flush=True)
lifecycle.leave(3)
"""


def test_leave_ends_within_its_bound_though_it_ignores_stop_signals(tmp_path):
    # leave() ignores the stop signals while the exit handlers run (a late one, such as the copy that
    # mp.spawn's parent forwards, would interrupt them with a traceback): a Ctrl-C cannot end a handler
    # that hangs there, so the process ends by itself, with its own status, 30 s after leave() began.
    program = tmp_path / "program.py"
    program.write_text(LEAVE_WITH_AN_EXIT_HANDLER_THAT_HANGS.format(root=os.path.dirname(os.path.dirname(__file__))))
    proc = subprocess.Popen([sys.executable, str(program)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "leaving"
        started = time.monotonic()
        time.sleep(1)
        proc.send_signal(signal.SIGINT)  # ignored: the handler goes on hanging
        assert proc.wait(timeout=60) == 3, proc.stderr.read()
        assert 25 < time.monotonic() - started < 40
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.communicate()


BUS_ERROR = ("DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that "
             "dataloader's workers are out of shared memory. Please try to raise your shared memory limit.")


def test_a_bus_error_in_a_loader_worker_is_explained_in_one_line():
    message = lifecycle.bus_error_message(RuntimeError(BUS_ERROR))
    assert "\n" not in message and "bus error" in message and "--shm-size" in message and "/dev/shm" in message
    assert lifecycle.bus_error_message(RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")) is None
    assert lifecycle.bus_error_message(RuntimeError("CUDA out of memory")) is None


SPAWNED_WORKER_WITH_A_BUS_ERROR = """
import sys
sys.path.insert(0, {root!r})
from utils import spawn
with spawn.worker_exit({error_dir!r}, 0):
    raise RuntimeError({error!r})
"""


def test_a_spawned_worker_reports_a_bus_error_in_one_line_and_exits_1(tmp_path):
    program = tmp_path / "worker.py"
    program.write_text(SPAWNED_WORKER_WITH_A_BUS_ERROR.format(
        root=os.path.dirname(os.path.dirname(__file__)), error_dir=str(tmp_path), error=BUS_ERROR))
    proc = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error: a DataLoader worker died of a bus error" in lines[0], proc.stderr


@pytest.mark.parametrize("body, status, stderr", [("sys.exit()", 0, ""), ("sys.exit(3)", 3, ""),
                                                  ("sys.exit('stopped here')", 1, "stopped here")])
def test_a_spawned_worker_ends_a_sys_exit_as_python_would(tmp_path, body, status, stderr):
    # A copied script's own sys.exit(): the status and the message that plain python would give it.
    program = tmp_path / "worker.py"
    program.write_text(SPAWNED_WORKER_WITH_A_BUS_ERROR.replace("raise RuntimeError({error!r})", body).format(
        root=os.path.dirname(os.path.dirname(__file__)), error_dir=str(tmp_path)))
    proc = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr.strip()) == (status, stderr)


def test_resolved_config_is_plain_json(no_local_rank):
    config = cli.plain_config(parse(["--dataset", "synthetic"]))
    assert json.loads(json.dumps(config)) == config
    assert config["batch_size"] == 128 and config["dataset"] == "synthetic"


@pytest.mark.parametrize("cores, local_world_size, expected", [(2, 1, 2), (2, 2, 1), (2, 4, 1), (64, 8, 4), (16, 1, 4)])
def test_default_workers_fit_the_cores_per_process(monkeypatch, cores, local_world_size, expected):
    from utils import data
    from utils.distributed import DistEnv
    import torch
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(data, "CGROUP", "/no/cgroup/here")  # no container limit, whatever this machine has
    env = DistEnv(0, 0, local_world_size, local_world_size, torch.device("cpu"), local_world_size > 1)
    args = parse([])
    assert data.loader_workers(args, env) == expected == args.workers  # kept, as config.json records it
    assert data.loader_workers(parse(["--workers", "0"]), env) == 0  # an explicit value wins


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "200000 100000\n"}, 2),                      # cgroup v2, docker --cpus 2
    ({"cpu.max": "max 100000\n"}, 4),                         # v2, no limit
    ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # v1, 1.5 CPUs
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),      # v1, no limit
])
def test_default_workers_fit_a_containers_cpu_limit(monkeypatch, tmp_path, files, expected):
    # 64 cores in the mask, but the container may use only its quota: more workers would wait for a core.
    from utils import data
    from utils.distributed import DistEnv
    import torch
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(data, "CGROUP", str(tmp_path))
    assert data.loader_workers(parse([]), DistEnv(0, 0, 1, 1, torch.device("cpu"), False)) == expected


# --- which flags were given; full names only; torchrun's error file -------------------------

def test_given_tells_a_flag_on_the_command_line_from_its_default(no_local_rank):
    args = parse(["--data-dir", "./data", "--no-nesterov"])
    assert cli.given(args, "data_dir") and cli.given(args, "nesterov")  # given, even at the default value
    assert not cli.given(args, "dist_timeout") and not cli.given(args, "batch_size")
    assert args.data_dir == "./data" and args.dist_timeout == 1800.0  # the values are argparse's
    assert "_given" not in cli.plain_config(args)  # not saved as a setting


def test_given_counts_no_destination_that_only_set_defaults_fills(no_local_rank):
    # A destination with no flag of its own (--data-on-gpu's where the script lacks it, own data's dataset)
    # was never typed.
    parser = cli.build_parser(__doc__, MODEL_NAMES, own_data=True)
    cli.add_fast_path_flags(parser)
    args = cli.parse_args(parser, ["--workers", "0"])
    assert args._given == {"workers"} and args.data_on_gpu is False and args.dataset is None


def test_an_abbreviated_flag_is_refused(capsys, no_local_rank):
    # A launcher that reads --checkpoint-dir from the extra flags could not see --checkpoint-d.
    with pytest.raises(SystemExit) as excinfo:
        lifecycle.run_main(parse, ["--checkpoint-d", "ck"])
    assert_one_line_usage_error(excinfo, capsys, "unrecognized arguments: --checkpoint-d")


def test_a_bad_flag_under_torchrun_is_in_its_error_file_on_every_rank(tmp_path, monkeypatch, capsys):
    # argparse's own exit printed the line and left torchrun's summary with "error_file: <N/A>".
    monkeypatch.setattr(lifecycle.time, "sleep", lambda seconds: None)  # a silent rank's wait for rank 0's line
    for rank in ("1", "0"):
        error_file = tmp_path / f"error-{rank}.json"
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        with pytest.raises(SystemExit) as excinfo:
            lifecycle.run_main(parse, ["--checkpoint-d", "ck"])
        assert excinfo.value.code == 2
        line = json.loads(error_file.read_text())["message"]["message"]
        assert line.endswith(": error: unrecognized arguments: --checkpoint-d ck (see --help)"), line
        assert (line in capsys.readouterr().err) == (rank == "0")


def test_the_error_line_is_what_torchrun_reads_as_the_root_cause(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    lifecycle.record_for_torchrun("distributed.py: error: batch size 33 is not divisible by 2 processes")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message["extraInfo"]["py_callstack"] == \
        "distributed.py: error: batch size 33 is not divisible by 2 processes"
    assert failure.timestamp > 0  # torchrun names the failure with the smallest as the root cause


def test_every_rank_that_refuses_leaves_the_line_for_torchrun_and_only_rank_0_prints(tmp_path, monkeypatch,
                                                                                     capsys):
    # torchrun stops the others once one rank has left: if rank 0 was still starting then,
    # the summary's root cause is rank 1's, and it must hold the line too.
    slept = []  # what the refusal waits, recorded rather than timed: a loaded machine stalls anyone
    monkeypatch.setattr(lifecycle.time, "sleep", slept.append)
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    for rank, prints in (("1", False), ("0", True)):
        error_file = tmp_path / f"error-{rank}.json"
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        slept.clear()
        with pytest.raises(SystemExit) as stop:
            lifecycle.run_main(lambda argv: (_ for _ in ()).throw(cli.UsageError("bad input")), [])
        assert stop.value.code == 2
        assert json.loads(error_file.read_text())["message"]["message"].endswith("error: bad input")
        assert ("error: bad input" in capsys.readouterr().err) == prints
        assert slept == ([] if prints else [2.0]), slept  # rank 1 lets rank 0's line come first
    # Given argv (in a caller's process, as here) run_main leaves the signal handlers alone.
    assert {number: signal.getsignal(number) for number in handlers} == handlers


INTERLOPER = """
import os, sys, threading
from utils.cli import print_line
line = "distributed.py: error: " + "x" * 400
stop = threading.Event()

def interloper():  # a thread writing to the same file descriptor, as PyTorch's C++ warnings do
    while not stop.is_set():
        os.write(2, b"[W interloper]\\n")

thread = threading.Thread(target=interloper)
thread.start()
for _ in range(3000):
    print_line(line)
stop.set()
thread.join()
"""


def test_a_line_is_never_cut_by_another_writer_on_the_same_stderr():
    # print(line, file=sys.stderr) writes the text and its newline separately: another
    # thread's write in between glued it to the end of the line (about 100 lines in 3000
    # here when measured with print(); a c10d warning after a rank's join failure, in a run).
    proc = subprocess.run([sys.executable, "-c", INTERLOPER], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    ours = [line for line in lines if line != "[W interloper]"]
    assert len(ours) == 3000 and set(ours) == {"distributed.py: error: " + "x" * 400}, \
        [line for line in ours if line != "distributed.py: error: " + "x" * 400][:3]


def test_an_error_s_first_line_leaves_out_gloo_s_source_location():
    assert cli.first_line(RuntimeError("[enforce fail at ../gloo/transport/tcp/pair.cc:446] op.preamble.length "
                                       "<= op.nbytes. 8 vs 4\nmore")) == "op.preamble.length <= op.nbytes. 8 vs 4"
    assert cli.first_line(RuntimeError("[/__w/1/s/third_party/gloo/gloo/transport/tcp/pair.cc:152] Connection "
                                       "closed by peer [10.0.0.1]:1234")) == "Connection closed by peer [10.0.0.1]:1234"
    assert cli.first_line(ValueError()) == "ValueError" and len(cli.first_line(OSError("x" * 999))) == 200


def test_an_error_s_typed_first_line_names_its_type_once():
    # An error raised with no message reads "EOFError" in a refusal, not "EOFError: EOFError".
    assert cli.first_line(EOFError(), typed=True) == "EOFError"
    assert cli.first_line(EOFError("Ran out of input"), typed=True) == "EOFError: Ran out of input"
