"""--profile and --tensorboard (utils/observe.py): what the files hold, through the real
scripts and launchers, and the step arithmetic of a resumed run."""
import importlib.util
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import SMALL, assert_one_line_error, expect_ok, read_metrics, run_script, subprocess_env, torchrun

from utils import observe
from utils.distributed import DistEnv

# The ProfilerStep#N spans a complete window holds: the profiler numbers the steps from 0.
WINDOW_NUMBERS = range(observe.WAIT_STEPS + observe.WARMUP_STEPS, observe.STEPS_TO_PROFILE)
WINDOW_NAMES = {f"ProfilerStep#{n}" for n in WINDOW_NUMBERS}


def profiled_steps(start_step: int) -> range:
    """The global steps (from 1) that the trace should record, for a run that starts after start_step."""
    return range(start_step + 1 + WINDOW_NUMBERS[0], start_step + 1 + WINDOW_NUMBERS[-1] + 1)


def small(**changes):
    """SMALL with some flags' values changed (flag_name=value), or removed (value None)."""
    argv = list(SMALL)
    for name, value in changes.items():
        flag = "--" + name.replace("_", "-")
        i = argv.index(flag)
        argv[i:i + 2] = [] if value is None else [flag, str(value)]
    return argv


def load_trace(path):
    with open(path) as f:
        trace = json.load(f)
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    return trace


def spans(trace):
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def within(event, start, end):
    return start <= event["ts"] <= end


def steps_of(trace):
    """{ProfilerStep name: the complete events that start inside it}."""
    events = spans(trace)
    return {step["name"]: [e for e in events if within(e, step["ts"], step["ts"] + step["dur"])]
            for step in events if step["name"].startswith("ProfilerStep#")}


def cpu_env(rank=0):
    return DistEnv(rank, rank, 1, 1, torch.device("cpu"), False)


def some_work():
    """A forward and backward for the in-process profiler to record."""
    x = torch.randn(64, 64, requires_grad=True)
    (x @ x).relu().sum().backward()


def test_profile_two_ranks_shows_the_all_reduces_inside_backward(tmp_path):
    profile_dir = tmp_path / "profile"
    # The default --workers (loader worker processes): what users run. 512 samples are 16
    # steps of 32, so the window lies inside the first epoch; it ends at the last step.
    proc = torchrun(2, "distributed.py", [*small(workers=None, train_samples=512),
                                          "--max-steps", observe.STEPS_TO_PROFILE, "--profile", profile_dir])
    announced = [line for line in proc.stdout.splitlines() if line.startswith("--profile:")]
    assert len(announced) == 1, proc.stdout  # rank 0 alone says it
    assert "trace-rank*.json" in announced[0] and "ui.perfetto.dev" in announced[0]
    assert "inside the window" not in announced[0]  # the whole window was recorded
    assert sorted(os.listdir(profile_dir)) == ["trace-rank0.json", "trace-rank1.json"]

    for rank in (0, 1):
        trace = load_trace(profile_dir / f"trace-rank{rank}.json")
        assert trace["distributedInfo"]["rank"] == rank  # each rank wrote its own
        steps = steps_of(trace)
        assert set(steps) == WINDOW_NAMES  # one window, after the warm-up steps
        for name, events in steps.items():
            backward = [e for e in events if e["name"].startswith("autograd::engine::evaluate_function")]
            assert backward, f"rank {rank} {name}: no backward pass in the step"
            start = min(e["ts"] for e in backward)
            end = max(e["ts"] + e["dur"] for e in backward)
            comm = [e for e in events if "all_reduce" in e["name"].lower() or "allreduce" in e["name"].lower()]
            # DDP's gradient hooks launch the all-reduce from inside the backward pass...
            launched = [e for e in comm if e["tid"] == backward[0]["tid"] and within(e, start, end)]
            assert launched, f"rank {rank} {name}: no all-reduce launched during backward {start}..{end}: {comm}"
            # ...and gloo runs it on its own thread, beside the training thread. This tiny model's
            # gradients fit in DDP's first bucket, so here it starts as backward ends; a real
            # model's earlier buckets run while backward computes the later ones.
            assert any(e["tid"] != launched[0]["tid"] and e["ts"] >= launched[0]["ts"] for e in comm), comm


@pytest.mark.parametrize("max_steps", [3, profiled_steps(0)[0] - 1])  # far from the window, and its step before
def test_run_too_short_to_profile_says_so(tmp_path, run_in_process, max_steps):
    profile_dir = tmp_path / "profile"
    code, out, err = run_in_process("distributed.py", [*SMALL, "--max-steps", max_steps, "--profile", profile_dir])
    assert code == 0, out + err
    line, = [line for line in out.splitlines() if line.startswith("--profile:")]
    assert "too short to profile" in line and f"ended at step {max_steps}" in line
    assert f"needs {observe.STEPS_TO_PROFILE} steps" in line
    assert os.listdir(profile_dir) == []
    assert "Traceback" not in err


def test_a_run_ending_inside_the_window_traces_its_steps_and_not_what_follows(tmp_path, run_in_process):
    """The run's last step ends the trace: the evaluation and checkpoint after it are not one more ProfilerStep."""
    last = profiled_steps(0)[1]
    code, out, err = run_in_process("distributed.py", [*SMALL, "--train-samples", "512", "--max-steps", last,
                                                       "--profile", tmp_path / "profile", "--checkpoint-dir",
                                                       tmp_path / "ck"])
    assert code == 0, out + err
    assert set(steps_of(load_trace(tmp_path / "profile" / "trace-rank0.json"))) == {
        f"ProfilerStep#{n}" for n in range(min(WINDOW_NUMBERS), last)}
    assert f"(ProfilerStep#{min(WINDOW_NUMBERS)} to #{last - 1}) (the run ended inside the window)" in out


def test_resumed_run_profiles_after_its_own_warmup(tmp_path, capsys):
    start = 100  # the run resumed at global step 100: its warm-up is steps 101 to 107
    window = profiled_steps(start)
    observers = observe.Observers(SimpleNamespace(profile=str(tmp_path), tensorboard=None), cpu_env(),
                                  start_step=start)
    trace = tmp_path / "trace-rank0.json"
    for step in range(start + 1, start + observe.STEPS_TO_PROFILE):
        some_work()
        observers.step(step)
        assert not trace.exists(), f"written after step {step}, before the window's end"
    some_work()
    observers.step(start + observe.STEPS_TO_PROFILE)
    assert set(steps_of(load_trace(trace))) == WINDOW_NAMES
    # The steps as the run counts them, and as the trace names them (from 0 at the resume).
    assert f"traced steps {window[0]} to {window[-1]} (ProfilerStep#{min(WINDOW_NUMBERS)} to " \
           f"#{max(WINDOW_NUMBERS)}) in" in capsys.readouterr().out
    trace.unlink()
    for step in range(start + observe.STEPS_TO_PROFILE + 1, start + 3 * observe.STEPS_TO_PROFILE):
        some_work()
        observers.step(step)
    observers.close()
    observers.close()  # idempotent
    assert not trace.exists()  # one window only
    assert capsys.readouterr().out == ""


def test_run_ending_inside_the_window_writes_what_it_recorded(tmp_path, capsys):
    observers = observe.Observers(SimpleNamespace(profile=str(tmp_path), tensorboard=None), cpu_env())
    last = profiled_steps(0)[1]  # two steps into the window
    for step in range(1, last + 1):
        some_work()
        observers.step(step, last=step == last)
    some_work()  # after the last step (the evaluation, the checkpoint): in no ProfilerStep
    observers.close()
    recorded = steps_of(load_trace(tmp_path / "trace-rank0.json"))
    assert set(recorded) == {f"ProfilerStep#{n}" for n in range(min(WINDOW_NUMBERS), last)}  # the two steps only
    out = capsys.readouterr().out
    assert f"traced steps {profiled_steps(0)[0]} to {last} (ProfilerStep#{min(WINDOW_NUMBERS)} to #{last - 1}) " \
           "(the run ended inside the window)" in out


def test_without_the_flags_nothing_runs(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("a profiler was made without --profile")
    monkeypatch.setattr(torch.profiler, "profile", refuse)
    observers = observe.Observers(SimpleNamespace(profile=None, tensorboard=None), cpu_env())
    for step in range(1, 20):
        observers.step(step)
    observers.epoch({"step": 19, "train_loss": 1.0})
    observers.close()
    # --tensorboard on a rank other than 0: no writer, no files
    observers = observe.Observers(SimpleNamespace(profile=None, tensorboard=str(tmp_path / "tb")), cpu_env(rank=1))
    observers.epoch({"step": 19, "train_loss": 1.0})
    observers.close()
    assert not (tmp_path / "tb").exists()


def read_scalars(log_dir) -> dict:
    """{tag: [(step, value), ...]} as TensorBoard reads the directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: [(s.step, s.value) for s in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_scalars_are_the_metrics_records(tmp_path, run_in_process):
    pytest.importorskip("tensorboard")
    log_dir, metrics_file = tmp_path / "tb", tmp_path / "metrics.jsonl"
    # Two epochs of 8 steps, evaluated after the second only: the first has NaN test values.
    expect_ok(run_in_process("distributed.py", [*small(epochs=2), "--eval-every", 2,
                                                "--tensorboard", log_dir, "--metrics", metrics_file]))
    records = [r for r in read_metrics(metrics_file) if r["event"] == "epoch"]
    assert [r["step"] for r in records] == [8, 16]
    scalars = {tag: dict(points) for tag, points in read_scalars(log_dir).items()}
    assert scalars["train/loss"].keys() == {8, 16}
    assert scalars["test/loss"].keys() == {16}  # the skipped evaluation is left out, not plotted as NaN
    assert "memory/peak_mb" not in scalars      # None on the CPU
    for record in records:
        for key, tag in observe.SCALAR_TAGS.items():
            value = record.get(key)
            if value is None or math.isnan(value):
                assert record["step"] not in scalars.get(tag, {}), (tag, record["step"])
            else:  # TensorBoard keeps float32
                assert scalars[tag][record["step"]] == pytest.approx(value, rel=1e-6), tag


def test_tensorboard_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    args = SimpleNamespace(profile=None, tensorboard=str(tmp_path))
    first = observe.Observers(args, cpu_env())
    first.epoch({"step": 8, "train_loss": 2.0, "grad_norm": 3.0})
    first.epoch({"step": 16, "train_loss": 1.5, "grad_norm": None})
    first.close()  # a crash after step 16; the checkpoint was at step 8
    resumed = observe.Observers(args, cpu_env(), start_step=8)
    resumed.epoch({"step": 16, "train_loss": 1.25})
    resumed.close()
    scalars = read_scalars(tmp_path)
    assert scalars["train/loss"] == [(8, 2.0), (16, 1.25)]  # step 16 once, from the resumed run
    assert scalars["train/grad_norm"] == [(8, 3.0)]


def test_tensorboard_flag_without_the_package_is_refused(tmp_path):
    hider = tmp_path / "hide_tensorboard"
    hider.mkdir()
    # Python imports sitecustomize at start-up; None in sys.modules is how the import system
    # marks a module as absent: find_spec returns None and import raises ModuleNotFoundError.
    (hider / "sitecustomize.py").write_text('import sys\nsys.modules["tensorboard"] = None\n')
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(hider), env["PYTHONPATH"]])
    probe = "import importlib.util; print(importlib.util.find_spec('tensorboard'))"
    assert run_script(["-c", probe], env=env).stdout.strip() == "None"
    if importlib.util.find_spec("tensorboard") is not None:
        assert run_script(["-c", probe]).stdout.strip() != "None"  # hidden by the file, not absent
    proc = run_script(["distributed.py", *SMALL, "--tensorboard", tmp_path / "tb"], env=env, check=False)
    assert_one_line_error(proc, "--tensorboard", "pip install tensorboard")
    assert not (tmp_path / "tb").exists()


def test_the_metrics_file_writes_values_json_lacks_as_null(tmp_path):
    """A skipped evaluation (NaN) and an overflowed loss (inf) are null in the --metrics file, which
    any JSON reader parses; Python's json would write them as the non-standard NaN and Infinity."""
    from utils.run import TrainingRun
    path = tmp_path / "metrics.jsonl"
    run = SimpleNamespace(args=SimpleNamespace(metrics=str(path)), env=SimpleNamespace(is_main=True))
    TrainingRun.record(run, {"epoch": 1, "train_loss": math.inf, "grad_norm": -math.inf,
                             "test_loss": math.nan, "train_acc1": 12.5, "world_size": 2})
    assert read_metrics(path) == [{"epoch": 1, "train_loss": None, "grad_norm": None, "test_loss": None,
                                   "train_acc1": 12.5, "world_size": 2}]
