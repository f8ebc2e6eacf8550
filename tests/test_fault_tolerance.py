"""Failures on purpose, through the real launchers: workers killed, SIGTERM, a rank that
raises, a crash in the middle of a checkpoint write, two nodes on one machine.

Every fault comes from tests/fault_injection.py, which runs the unchanged script with
one hook patched. Runs are tiny (resnet_tiny, 512 synthetic images, 16 steps of 32) on
CPU/gloo and 127.0.0.1; each is bounded by a timeout, and everything a test started is
SIGKILLed afterwards, including workers that torchrun put in sessions of their own.

"The same weights" means bitwise: torch.equal on every tensor of the model and of the
optimizer state, against an uninterrupted run with the same flags.
"""
import contextlib
import faulthandler
import hashlib
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch

from conftest import (FAULTS, FRESH_STORE, ROOT, SMALL, TAG, Proc, assert_one_line_error, assert_refused,
                      assert_same_state, assert_same_training_state, expect, expect_ok, free_port, kill_tagged, left_in,
                      observing_entry, patched_on_import, private_tmpdir, read_metrics, run_script, subprocess_env,
                      tagged_pids, two_nodes_here)
from utils import checkpoint, lifecycle
from utils.run import StopSignal

STEPS = 16  # 512 images / 32 per step
TINY = ["--dataset", "synthetic", "--model", "resnet_tiny", "--train-samples", "512",
        "--test-samples", "64", "--batch-size", "32", "--workers", "0", "--epochs", "1",
        "--checkpoint-every", "2", "--dist-timeout", "120"]


# --- processes ---------------------------------------------------------------------------

def run(args, timeout=240, **env) -> Proc:
    proc = Proc(args, **env)
    try:
        return proc.wait(timeout)
    finally:
        proc.kill()


def torchrun(args, nproc=2, extra=(), timeout=300, **env) -> Proc:
    return run(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                *extra, *args], timeout=timeout, **FRESH_STORE, **env)


# --- checkpoints ---------------------------------------------------------------------------

def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# --- the uninterrupted runs to compare with --------------------------------------------------

@pytest.fixture(scope="module")
def python_reference(tmp_path_factory, run_in_process_once):
    """One process, start to end (main() in this process, as plain python runs it). --resume
    on an empty --checkpoint-dir: a fresh start."""
    ckpt_dir = tmp_path_factory.mktemp("python_reference")
    return ckpt_dir, expect_ok(run_in_process_once("distributed.py", [*TINY, "--checkpoint-dir", ckpt_dir,
                                                                      "--resume"]))


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    """torchrun, 2 processes, start to end."""
    ckpt_dir = tmp_path_factory.mktemp("ddp_reference")
    expect(torchrun(["distributed.py", *TINY, "--checkpoint-dir", ckpt_dir]))
    return ckpt_dir / "checkpoint.pt"


# --- resume and its guard ------------------------------------------------------------------

def test_resume_with_an_empty_checkpoint_dir_starts_fresh(python_reference):
    ckpt_dir, output = python_reference
    assert f"--resume: no checkpoint in {ckpt_dir} yet, starting from scratch" in output
    assert checkpoint.load(ckpt_dir / "checkpoint.pt")["global_step"] == STEPS


@pytest.mark.not_on_floor("one process, torch.save and torch.load: test_ctrl_c_to_one_process_with_loader_workers")
def test_fresh_run_refuses_to_overwrite_a_checkpoint(python_reference, run_in_process):
    ckpt_dir, _ = python_reference
    before = sha256(ckpt_dir / "checkpoint.pt")
    assert_refused(run_in_process("distributed.py", [*TINY, "--checkpoint-dir", ckpt_dir]),
                   "already holds a checkpoint", "--resume")
    assert sha256(ckpt_dir / "checkpoint.pt") == before


# --- SIGTERM: checkpoint, exit 0, resume -----------------------------------------------------

@pytest.mark.not_on_floor("one process, torch.save and torch.load: test_ctrl_c_to_one_process_with_loader_workers")
def test_sigterm_checkpoints_and_resume_ends_with_the_same_weights(python_reference, tmp_path, run_in_process):
    reference_dir, _ = python_reference
    ckpt = tmp_path / "checkpoint.pt"
    stopped = run([FAULTS, "--fault", "sigterm-self", "--step", "3", "--",
                   "distributed.py", *TINY, "--checkpoint-dir", tmp_path])
    output = expect(stopped, rc=0)
    # One process checks for a signal after every step: it stops at the step it came in.
    assert (f"stopping at step 3 on SIGTERM: checkpoint saved to {ckpt}; continue with --resume"
            in output), output
    assert checkpoint.load(ckpt)["global_step"] == 3

    resumed = expect_ok(run_in_process("distributed.py", [*TINY, "--checkpoint-dir", tmp_path, "--resume"]))
    assert "3 steps in all" in resumed
    assert_same_training_state(ckpt, reference_dir / "checkpoint.pt", STEPS)


def test_sigterm_at_the_last_step_of_max_steps_ends_the_run_with_its_records(tmp_path):
    """The signal comes as --max-steps ends the run mid-epoch: the run evaluates, checkpoints and
    writes its records as it would have (a resume finds nothing to train, so nothing left to record)."""
    metrics = tmp_path / "metrics.jsonl"
    output = expect(run([FAULTS, "--fault", "sigterm-self", "--step", "6", "--", "distributed.py", *TINY,
                         "--max-steps", "6", "--checkpoint-dir", tmp_path, "--metrics", metrics]), rc=0)
    records = read_metrics(metrics)
    assert [(r["event"], r["step"]) for r in records] == [("epoch", 6), ("end", 6)], output
    assert "continue with --resume" not in output and "done: 6 steps" in output, output
    assert checkpoint.load(tmp_path / "checkpoint.pt")["global_step"] == 6


# --- crashes ------------------------------------------------------------------------------

@pytest.mark.parametrize("rendezvous", ["--standalone", "--rdzv-backend=c10d", "static", "--standalone, shared store"])
def test_killed_worker_is_restarted_and_ends_with_the_same_weights(ddp_reference, tmp_path, rendezvous):
    # --standalone draws a run id; c10d without --rdzv-id has torchrun's default, "none". The launchers' fresh store
    # per attempt; without TORCH_DISABLE_SHARE_RDZV_TCP_STORE, and in torchrun's default, the static rendezvous,
    # one store for every attempt, which still holds the first attempt's keys.
    ckpt = tmp_path / "checkpoint.pt"
    launch = {"--standalone": ["--standalone"], "static": [f"--master-port={free_port()}"],
              "--standalone, shared store": ["--standalone"],
              "--rdzv-backend=c10d": ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]}[rendezvous]
    proc = run(["-m", "torch.distributed.run", *launch, "--nproc_per_node=2", "--max-restarts=1",
                FAULTS, "--fault", "kill", "--rank", "1", "--step", "5", "--",
                "distributed.py", *TINY, "--checkpoint-dir", tmp_path], timeout=300,
               **({} if rendezvous in ("static", "--standalone, shared store") else FRESH_STORE))
    output = expect(proc)
    assert "fault_injection: kill on rank 1 at step 5" in output
    # Both workers start again (restart 1) and continue from the checkpoint of step 4.
    assert "torchrun restart" in output and f"resuming from {ckpt}" in output, output
    assert f"resumed from {ckpt}: epoch 1, step 4 of {STEPS} in it, 4 steps in all" in output, output
    assert_same_training_state(ckpt, ddp_reference, STEPS)


def test_a_restarted_launch_refuses_a_checkpoint_it_did_not_write(tmp_path):
    # The command run again on a folder that holds its last run's checkpoint, with the same --rdzv-id (a job's
    # name): the first attempt refuses with exit status 2, which torchrun restarts as any failure; the restart
    # must not take that checkpoint for its own.
    def launch(*args):
        return run(["-m", "torch.distributed.run", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                    "--rdzv-id=my-job", "--nproc_per_node=2", "--max-restarts=1", "distributed.py", *TINY,
                    "--checkpoint-dir", tmp_path, *args], timeout=300, **FRESH_STORE)
    expect(launch("--max-steps", "2"))
    before = (tmp_path / "checkpoint.pt").read_bytes()
    output = launch().output()
    assert "torchrun restart" not in output and "resumed from" not in output, output
    refusals = [line for line in output.splitlines() if line.startswith("distributed.py: error: --checkpoint-dir")]
    assert len(refusals) == 2 and "add --resume" in refusals[1], output  # the first attempt's, then its restart's
    assert "done:" not in output and (tmp_path / "checkpoint.pt").read_bytes() == before


@pytest.mark.not_on_floor("one process, torch.save and torch.load: test_ctrl_c_to_one_process_with_loader_workers")
def test_crash_during_a_checkpoint_write_keeps_the_previous_checkpoint(python_reference, tmp_path, run_in_process):
    reference_dir, _ = python_reference
    ckpt = tmp_path / "checkpoint.pt"
    crashed = run([FAULTS, "--fault", "kill-during-save", "--save", "2", "--",
                   "distributed.py", *TINY, "--checkpoint-dir", tmp_path])
    expect(crashed, rc=-signal.SIGKILL)
    # Save 1 (step 2) is intact; save 2 (step 4) died half-written in its temporary file.
    assert checkpoint.load(ckpt)["global_step"] == 2
    leftovers = list(tmp_path.glob(".checkpoint.pt.*.tmp"))
    assert len(leftovers) == 1, sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(Exception):
        torch.load(leftovers[0], weights_only=True)

    resumed = expect_ok(run_in_process("distributed.py", [*TINY, "--checkpoint-dir", tmp_path, "--resume"]))
    assert f"resumed from {ckpt}: epoch 1, step 2 of {STEPS} in it, 2 steps in all" in resumed, resumed
    assert_same_training_state(ckpt, reference_dir / "checkpoint.pt", STEPS)
    assert not list(tmp_path.glob(".checkpoint.pt.*.tmp"))  # the crashed write's leftover is removed


def test_a_rank_that_raises_fails_the_job_quickly_and_is_reported_first(tmp_path):
    proc = torchrun([FAULTS, "--fault", "raise", "--rank", "1", "--step", "2", "--",
                     "distributed.py", *TINY, "--checkpoint-dir", tmp_path], timeout=240)
    output = proc.output()
    assert proc.rc != 0, output
    fired = re.search(r"fault_injection: raise on rank 1 at step 2 \(pid \d+, time ([\d.]+)\)", output)
    assert fired, output
    # Rank 0 learns at once (its peer's socket closes), not after --dist-timeout (TINY's 120 s).
    seconds = proc.ended - float(fired.group(1))
    assert seconds < 45, f"{seconds:.0f} s from the failure to the end of the job"
    # The root cause torchrun reports (read from the @record error file) is rank 1's error...
    root_cause = output.split("Root Cause (first observed failure):", 1)[1]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause), output
    assert "RuntimeError: injected failure on rank 1" in root_cause, output
    # ... and it comes before whatever rank 0 then says about the lost peer.
    first_error = output.index("RuntimeError: injected failure on rank 1")
    for symptom in ("Connection closed by peer", "Connection reset by peer", "timed out", "Timeout"):
        if symptom in output:
            assert first_error < output.index(symptom), output


# --- stop signals as clusters and terminals deliver them: loader workers on ---------------

# After TINY: what users run, loader workers included. One per process, the default on a
# 2-core machine with 2 processes (--workers: the cores per process, at most 4).
WORKERS = ["--workers", "1"]


def no_loader_failure(output):
    assert "DataLoader worker" not in output and "Traceback" not in output.replace(
        "torch.distributed.elastic.multiprocessing.api.SignalException", ""), output


def assert_same_checkpoint(path, other):
    """Every entry of two checkpoints bitwise equal (the folder each names for itself, and the launch, apart)."""
    got, want = checkpoint.load(path), checkpoint.load(other)
    for state in (got, want):
        state["config"].pop("checkpoint_dir"), state.pop("launches")
    assert_same_state(got, want, "checkpoint")


def test_a_stop_signal_to_torchrun_or_to_every_process_checkpoints_and_resumes_exactly(ddp_reference, tmp_path):
    # Four ways a torchrun job is told to stop, loader workers on, one job each:
    # - SIGTERM to torchrun's agent alone (a scheduler that signals the launcher): the agent
    #   forwards it to both workers;
    # - scancel --signal or a preemption (SIGTERM), Ctrl-C to an interactive job (SIGINT), its
    #   terminal or ssh session closed (SIGHUP): the agent, both workers and their loader workers
    #   all get it, and the loader workers leave it to their rank.
    # (Loader workers on in all four, as users run it; torchrun signals each worker's process
    # group, loader workers included. A stop without loader workers: the one-process
    # SIGTERM test above.)
    # Each time the ranks agree on step 10 (they compare every 10 steps) and checkpoint. The
    # four checkpoints are the same, bitwise, and one of them, resumed, ends with the weights
    # of the uninterrupted run: so would the others. (One resume for the four: each resume
    # is a torchrun of 3 Pythons.)
    stops = {"agent": ["--fault", "sigterm-parent"], "TERM": ["--fault", "signal-job", "--send", "TERM"],
             "INT": ["--fault", "signal-job", "--send", "INT"], "HUP": ["--fault", "signal-job", "--send", "HUP"]}
    for way, fault in stops.items():
        folder, statuses = tmp_path / way, tmp_path / f"{way}-exit"
        statuses.mkdir()
        stopped = torchrun([FAULTS, *fault, "--rank", "0", "--step", "3", "--",
                            "distributed.py", *TINY, *WORKERS, "--checkpoint-dir", folder],
                           EXIT_STATUS_DIR=str(statuses))
        output = stopped.output()
        assert f"stopping at step 10 on SIG{'TERM' if way == 'agent' else way}" in output, output
        assert checkpoint.load(folder / "checkpoint.pt")["global_step"] == 10
        # Both workers exit 0 (torchrun, signalled itself, reports no worker's status: each writes its
        # own), with no traceback of the script's, and no loader worker complains.
        assert {p.name: p.read_text() for p in statuses.iterdir()} == {"0": "0", "1": "0"}, output
        assert 'distributed.py", line' not in output and "DataLoader worker" not in output, output
        if way == "agent":
            # torchrun itself re-raises the signal as a SignalException once its workers are
            # gone: its own traceback, and exit status 1; no worker failed.
            assert stopped.rc == 1, output
            assert output.count("Traceback") == 1 and "SignalException" in output, output
            assert "Root Cause" not in output, output
    for way in ("agent", "TERM", "HUP"):
        assert_same_checkpoint(tmp_path / way / "checkpoint.pt", tmp_path / "INT" / "checkpoint.pt")
    resumed = expect(torchrun(["distributed.py", *TINY, *WORKERS, "--checkpoint-dir", tmp_path / "INT", "--resume"]))
    assert "10 steps in all" in resumed
    assert_same_training_state(tmp_path / "INT" / "checkpoint.pt", ddp_reference, STEPS)


def test_ctrl_c_to_one_process_with_loader_workers(python_reference, tmp_path):
    # Ctrl-C in a terminal: SIGINT to the foreground process group, loader workers included.
    ckpt = tmp_path / "checkpoint.pt"
    output = expect(run([FAULTS, "--fault", "signal-group", "--send", "INT", "--step", "3", "--",
                         "distributed.py", *TINY, *WORKERS, "--checkpoint-dir", tmp_path]))
    assert f"stopping at step 3 on SIGINT: checkpoint saved to {ckpt}" in output, output
    no_loader_failure(output)
    assert "done:" not in output  # stopped, not finished
    expect(run(["distributed.py", *TINY, *WORKERS, "--checkpoint-dir", tmp_path, "--resume"]))
    assert_same_training_state(ckpt, python_reference[0] / "checkpoint.pt", STEPS)


def slow_evaluation(evaluate, module):
    """utils.metrics.evaluate after a 60 s pause (a long evaluation), which each process marks a file at;
    a file "handled.PID" marks when the run's own handler has taken its first SIGINT or SIGTERM."""
    import os, signal, time

    def slowly(*args, **kwargs):
        marks = os.environ["IN_EVALUATION"]
        for sig in (signal.SIGINT, signal.SIGTERM):
            def marked(signum, frame, handler=signal.getsignal(sig)):
                open(os.path.join(marks, f"handled.{os.getpid()}"), "a").close()
                handler(signum, frame)
            signal.signal(sig, marked)
        open(os.path.join(marks, str(os.getpid())), "w").close()
        time.sleep(60)
        return evaluate(*args, **kwargs)
    return slowly


def wait_for_marks(proc, marks, count, prefix=""):
    deadline = time.time() + 120
    while len([name for name in os.listdir(marks) if name.startswith(prefix)]) < count:
        assert proc.popen.poll() is None and time.time() < deadline, proc.output()
        time.sleep(0.2)


@pytest.mark.parametrize("launch", ["python", "mp.spawn", "torchrun"])
def test_a_second_ctrl_c_stops_at_once_without_the_checkpoint(tmp_path, launch):
    # One Ctrl-C waits for the next agreed step, here after a 60 s evaluation; a person who presses it again
    # (2 s or more later) wants the run to end now: exit status 130. Each press reaches the whole process
    # group, and under mp.spawn every rank a second time, passed on by the parent; torchrun's workers have
    # sessions of their own, and get the presses from torchrun, the second as SIGTERM.
    hook = patched_on_import(tmp_path, "utils.metrics", "evaluate", slow_evaluation)
    marks = tmp_path / "in_evaluation"
    marks.mkdir()
    ranks, script = {"python": (1, ["distributed.py"]),
                     "mp.spawn": (2, ["distributed_mp.py", "--nproc-per-node", "2"]),
                     "torchrun": (2, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                      "distributed.py"])}[launch]
    proc = Proc([*script, *TINY, *WORKERS, "--checkpoint-dir", tmp_path / "ckpt"],
                PYTHONPATH=os.pathsep.join([hook, str(ROOT)]), IN_EVALUATION=str(marks))
    try:
        wait_for_marks(proc, marks, ranks)
        os.killpg(proc.popen.pid, signal.SIGINT)
        wait_for_marks(proc, marks, ranks, prefix="handled.")  # every rank has it: the 2 s count from here
        time.sleep(StopSignal.FORCE_AFTER_S + 0.5)
        os.killpg(proc.popen.pid, signal.SIGINT)
        pressed = time.time()
        proc.wait(40)
    finally:
        proc.kill()
    output = proc.output()
    assert "checkpoint saved" not in output and "KeyboardInterrupt" not in output, output
    if launch == "torchrun":
        # torchrun passed the second press on as SIGTERM, and ends with its own SignalException tracebacks (no
        # worker's: none names distributed.py); its workers ended at once, before torchrun's SIGKILL 30 s later
        # ("Unable to shutdown process ...").
        assert proc.ended - pressed < 20 and "Unable to shutdown" not in output, output
        assert 'distributed.py", line' not in output and "DataLoader worker" not in output, output
        return
    assert proc.rc == 130 and proc.ended - pressed < 20, output
    no_loader_failure(output)


def test_a_terminal_that_hangs_up_stops_the_run_with_its_checkpoint(python_reference, tmp_path):
    # A closed terminal or a dropped ssh session: SIGHUP to the process group, loader workers included, and from
    # then on every write to the terminal fails (EIO). Here the terminal is gone from the start and the signal
    # comes at step 3: the run stops as on SIGTERM, unheard, with its checkpoint and exit status 0.
    import pty
    master, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, FAULTS, "--fault", "signal-group", "--send", "HUP", "--step", "3", "--",
                             "distributed.py", *TINY, *WORKERS, "--checkpoint-dir", tmp_path],
                            cwd=ROOT, env=subprocess_env(), stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
                            start_new_session=True)
    os.close(terminal)
    os.close(master)  # hung up
    try:
        assert proc.wait(180) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert checkpoint.load(tmp_path / "checkpoint.pt")["global_step"] == 3
    expect(run(["distributed.py", *TINY, *WORKERS, "--checkpoint-dir", tmp_path, "--resume"]))
    assert_same_training_state(tmp_path / "checkpoint.pt", python_reference[0] / "checkpoint.pt", STEPS)


def test_a_run_started_with_nohup_trains_on_when_its_terminal_hangs_up(tmp_path):
    # nohup: SIGHUP is ignored, by the mp.spawn parent and the workers it starts alike; the run trains to its end.
    proc = Proc(["distributed_mp.py", *LONG_RUN, "--nproc-per-node", "2", "--checkpoint-dir", tmp_path],
                program=("nohup", sys.executable))
    wait_for_file(tmp_path / "checkpoint.pt", proc)
    os.killpg(proc.popen.pid, signal.SIGHUP)
    output = expect(proc.wait(240))
    assert f"done: {LONG_STEPS} steps" in output and "stopping" not in output, output


def wait_for_file(path, proc, timeout=120):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if proc.popen.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"{path} never appeared\n{proc.output()}")
        time.sleep(0.2)


# 256 steps in all, 60 of them trained: the signal, sent from outside as a user would,
# lands long before the end whatever the machine's speed.
LONG_RUN, LONG_STEPS = [*TINY, "--train-samples", "8192", *WORKERS, "--max-steps", "60"], 60


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("long_reference")
    expect(torchrun(["distributed.py", *LONG_RUN, "--checkpoint-dir", ckpt_dir]))
    return ckpt_dir / "checkpoint.pt"


def test_a_single_process_that_fails_with_loader_workers_exits_at_once(tmp_path):
    # `python distributed.py` with loader workers and a bug at step 2: its traceback and
    # exit status 1. The workers ignore SIGTERM, which is how Python's exit ends them:
    # without more, the process printed its traceback and then waited for them forever.
    proc = run([FAULTS, "--fault", "raise", "--step", "2", "--", "distributed.py", *TINY, *WORKERS,
                "--checkpoint-dir", tmp_path], timeout=60)
    assert proc.rc == 1 and "RuntimeError: injected failure on rank 0" in proc.output(), proc.output()


@pytest.mark.parametrize("launch", ["python", "torchrun"])
def test_a_loader_worker_killed_by_a_bus_error_ends_the_run_with_one_line(tmp_path, launch):
    # What a DataLoader worker gets when the shared-memory folder is full (Docker gives a
    # container 64 MB): the run ends at once with the line that says what to do.
    rank = "0" if launch == "python" else "1"
    args = [FAULTS, "--fault", "sigbus-loader", "--rank", rank, "--step", "2", "--",
            "distributed.py", *TINY, *WORKERS, "--checkpoint-dir", tmp_path]
    proc = run(args, timeout=180) if launch == "python" else torchrun(args, timeout=180)
    output = proc.output()
    assert proc.rc != 0, output
    line = "distributed.py: error: a DataLoader worker died of a bus error"
    assert line in output and "--shm-size" in output.split(line, 1)[1].splitlines()[0], output
    fired = re.search(r"fault_injection: sigbus-loader on rank \d at step 2 \(pid \d+, time ([\d.]+)\)", output)
    assert fired and proc.ended - float(fired.group(1)) < 45, output  # every rank gone, not at TINY's 120 s timeout
    if launch == "python":
        # No traceback from our code. A worker that dies while handing a batch over can make
        # multiprocessing's resource-sharer thread print its own ConnectionResetError first.
        ours = [line for line in output.splitlines() if line.strip().startswith('File "')
                and ("utils/" in line or "distributed.py" in line or "fault_injection.py" in line)]
        assert proc.rc == 1 and not ours and output.count(line) == 1, output
        assert "distributed.py: error: a DataLoader worker" in output.rstrip().splitlines()[-1], output
    else:  # torchrun's summary names the rank whose loader failed, not its peer's lost connection,
        # and shows the line as its error: printed by the rank, then once more at the end
        assert "Root Cause (first observed failure):" in output and output.count(line) == 2, output
        root_cause = output.split("Root Cause (first observed failure):", 1)[1]
        assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause), output
        assert re.search(rf"traceback\s*:\s*{re.escape(line)}", root_cause), output


# A rank's error, as @record writes it, cut short by the loader's SIGCHLD handler raising in
# the middle of the write (it raises wherever the main thread is): the file is left empty.
CUT_SHORT = """
import sys
from torch.distributed.elastic.multiprocessing.errors import error_handler
from utils import lifecycle

def cut_short(self, e):
    open(self._get_error_file_path(), "w").close()

def main(argv):
    lifecycle.joined_a_group()
    raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Bus error. ")

error_handler.ErrorHandler.record_exception = cut_short
sys.argv = ["distributed.py"]
lifecycle.run_main(main)
"""


def test_a_bus_error_leaves_torchrun_an_error_file_it_can_read(tmp_path):
    # torchrun's agent reads a failed rank's error file with ProcessFailure; an empty one
    # made it fail with a JSONDecodeError and end the job without its summary.
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    error_file = tmp_path / "error.json"
    proc = run_script(["-c", CUT_SHORT], check=False, timeout=120,
                      env=subprocess_env(TORCHELASTIC_ERROR_FILE=error_file))
    line = "distributed.py: error: a DataLoader worker died of a bus error"
    assert proc.returncode == 1 and line in proc.stderr, proc.stdout + proc.stderr
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(error_file))
    assert failure.message["message"].startswith(line), failure.message  # the summary's root cause
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # the file written beside it was renamed


class _SlowSamples(torch.utils.data.Dataset):
    """Samples that take a minute: the worker is killed while it makes the first, once it
    has left the file `started`."""
    def __init__(self, started):
        self.started = started

    def __len__(self):
        return 4

    def __getitem__(self, index):
        # The worker inherited pytest's fault handler, which would print a "Fatal Python
        # error" and a stack for the bus error this test sends on purpose.
        faulthandler.disable()
        self.started.touch()
        time.sleep(60)
        return torch.zeros(1)


def test_a_bus_error_is_told_after_the_loader_reaped_its_worker(tmp_path):
    # Seen once (PyTorch 2.11, the test above with plain python, a loaded machine): the worker
    # died of SIGBUS while the training process read a batch it had handed over; the read
    # failed (the worker's socket closed), the loader checked its workers (is_alive(), which
    # takes a dead child out of multiprocessing's set of children) and raised "exited
    # unexpectedly" before its SIGCHLD handler could report the bus error; the run ended with
    # that traceback instead of the line. The same path here, every time: the SIGCHLD handler
    # off, the loader's read timing out instead of losing a socket (the same check follows).
    import multiprocessing.process
    from utils import cli
    from utils.data import Loader
    started = tmp_path / "started"
    iterator = iter(Loader(_SlowSamples(started), num_workers=1, timeout=1))
    sigchld = signal.getsignal(signal.SIGCHLD)  # after iter(): the loader's handler, set once per process
    try:
        lifecycle.loader_sigchld_off()
        [worker] = iterator._workers
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline and worker.is_alive(), "the worker never began its first sample"
            time.sleep(0.05)
        os.kill(worker.pid, signal.SIGBUS)
        deadline = time.monotonic() + 30
        while open(f"/proc/{worker.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":  # dead, not reaped
            assert time.monotonic() < deadline, "the worker did not die of SIGBUS"
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="exited unexpectedly") as failed:
            next(iterator)
        assert worker not in multiprocessing.process._children and worker.exitcode == -signal.SIGBUS
        message = lifecycle.bus_error_message(failed.value)
        assert message is not None and message.startswith("a DataLoader worker died of a bus error"), failed.value
    finally:
        del iterator
        signal.signal(signal.SIGCHLD, sigchld)


@pytest.mark.parametrize("sig", [
    pytest.param(signal.SIGINT, marks=pytest.mark.not_on_floor(
        "Ctrl-C to a process group with loader workers: test_ctrl_c_to_one_process_with_loader_workers; "
        "mp.spawn stopped by a signal to its group: the SIGTERM case here; a stopped run resumed bitwise: "
        "test_killed_worker_is_restarted_and_ends_with_the_same_weights")),
    signal.SIGTERM])
def test_mp_spawn_stops_on_a_signal_to_its_process_group(request, tmp_path, sig):
    # distributed_mp.py in a terminal (Ctrl-C) or killed with `kill -- -PGID`: the parent,
    # the spawned workers and their loader workers share one process group.
    tmp = private_tmpdir()
    proc = Proc(["distributed_mp.py", *LONG_RUN, "--nproc-per-node", "2", "--checkpoint-dir", tmp_path],
                TMPDIR=tmp)
    wait_for_file(tmp_path / "checkpoint.pt", proc)  # --checkpoint-every 2: training is under way
    os.killpg(proc.popen.pid, sig)
    output = expect(proc.wait(180))
    assert f"on {sig.name}: checkpoint saved" in output, output
    no_loader_failure(output)
    # The loader workers, killed at exit, had their sockets in their rank's folder, which
    # the rank's exit removed (lifecycle.start_loader_workers): one stop used to leave a
    # folder per loader worker.
    assert left_in(tmp) == [], output
    step = checkpoint.load(tmp_path / "checkpoint.pt")["global_step"]
    assert 0 < step < LONG_STEPS and step % 10 == 0, output
    if sig != signal.SIGINT:
        return  # the resume reads only the checkpoint, which the signal does not enter: resumed once, below
    expect(run(["distributed_mp.py", *LONG_RUN, "--nproc-per-node", "2", "--checkpoint-dir", tmp_path,
                "--resume"]))
    # Asked for here, not as an argument: the SIGTERM case alone (on the floor) needs no reference run.
    assert_same_training_state(tmp_path / "checkpoint.pt", request.getfixturevalue("long_reference"), LONG_STEPS)


def ctrl_c_before_the_run(init, run):
    """utils.run.TrainingRun.__init__, after rank 0 sends SIGINT to its whole process group, as Ctrl-C
    in a terminal does, just before the run installs its own handler: during the set-up (data, model,
    process group), where Python's KeyboardInterrupt still ends the process."""
    import os, signal, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background shell ignores it)

    def before(self, args, env, *rest, **kwargs):
        if env.rank == 0:
            os.killpg(os.getpgrp(), signal.SIGINT)
            time.sleep(10)  # interrupted
        return init(self, args, env, *rest, **kwargs)
    return before


def test_ctrl_c_during_the_set_up_of_mp_spawn_ends_it_with_130(tmp_path):
    # torch.multiprocessing.spawn's workers end with status 0 on a KeyboardInterrupt (its _wrap passes it by),
    # so the run reported success though it never trained, after tens of seconds of C++ stack dumps.
    hook = patched_on_import(tmp_path, "utils.run", "TrainingRun.__init__", ctrl_c_before_the_run)
    started = time.monotonic()
    proc = run(["distributed_mp.py", *TINY, *WORKERS, "--nproc-per-node", "2", "--checkpoint-dir", tmp_path / "ckpt"],
               timeout=120, PYTHONPATH=os.pathsep.join([hook, str(ROOT)]))
    output = expect(proc, rc=130)
    assert "Traceback" not in output and "done:" not in output and "error" not in output, output
    assert not (tmp_path / "ckpt" / "checkpoint.pt").exists()
    print(f"ended {time.monotonic() - started:.1f} s after the start")
    # The folder is free for the next run: the same command trains.
    expect(run(["distributed_mp.py", *TINY, "--max-steps", "2", "--nproc-per-node", "2",
                "--checkpoint-dir", tmp_path / "ckpt"]))


def test_signal_during_evaluation_stops_right_after_it(tmp_path):
    # The signal comes in the middle of epoch 1's evaluation, on rank 1 only: both ranks
    # stop after it with epoch 1 checkpointed, instead of ten steps into epoch 2.
    two_epochs = [*TINY, *WORKERS, "--epochs", "2", "--checkpoint-dir", tmp_path, "--metrics", tmp_path / "m.jsonl"]
    output = expect(torchrun([FAULTS, "--fault", "signal-during-eval", "--rank", "1", "--eval-seconds", "4", "--",
                              "distributed.py", *two_epochs]))  # a stop, not a failure: exit status 0
    assert f"stopping at step {STEPS} on a signal to another rank: checkpoint saved" in output, output
    assert "done:" not in output, output
    saved = checkpoint.load(tmp_path / "checkpoint.pt")
    assert (saved["global_step"], saved["epoch"], saved["step_in_epoch"]) == (STEPS, 0, STEPS)
    assert [r["event"] for r in read_metrics(tmp_path / "m.jsonl")] == ["epoch"]  # no "end": not finished
    resumed = expect(torchrun(["distributed.py", *two_epochs, "--resume"]))
    assert f"done: {2 * STEPS} steps" in resumed, resumed
    assert [r["event"] for r in read_metrics(tmp_path / "m.jsonl")] == ["epoch", "epoch", "end"]


def test_a_stop_at_an_epoch_s_end_evaluates_only_what_eval_every_asks(tmp_path):
    # 10 steps an epoch: a SIGTERM at step 5 is agreed at step 10, the last of epoch 1, which --eval-every 2
    # does not evaluate. The stop must not add an evaluation there: its checkpoint would wait for it (within
    # the launcher's grace period), and the record would differ from an uninterrupted run's.
    two_epochs = [*TINY, *WORKERS, "--train-samples", "320", "--epochs", "2", "--eval-every", "2",
                  "--checkpoint-dir", tmp_path, "--metrics", tmp_path / "m.jsonl"]
    output = expect(torchrun([FAULTS, "--fault", "sigterm-self", "--rank", "0", "--step", "5", "--",
                              "distributed.py", *two_epochs]))
    assert "stopping at step 10 on SIGTERM: checkpoint saved" in output, output
    [stopped] = read_metrics(tmp_path / "m.jsonl")
    assert stopped["epoch_complete"] and stopped["test_samples"] == 0, stopped  # not evaluated, as uninterrupted
    resumed = expect(torchrun(["distributed.py", *two_epochs, "--resume"]))
    assert "done: 20 steps" in resumed, resumed
    records = read_metrics(tmp_path / "m.jsonl")
    assert [(r["event"], r["test_samples"]) for r in records] == [("epoch", 0), ("epoch", 64), ("end", 64)]


# --- no orphans ------------------------------------------------------------------------

def wait_until_gone(proc, timeout=40):
    deadline = time.time() + timeout
    while tagged_pids(proc.tag):
        if time.time() > deadline:
            left = tagged_pids(proc.tag)
            proc.kill()
            raise AssertionError(f"processes {left} still running {timeout} s after their launcher died\n"
                                 f"{proc.output()}")
        time.sleep(0.5)


# Runs long enough (256 steps) that the launcher's death is noticed in the middle of them.
LONG = [*TINY, "--train-samples", "8192", *WORKERS]


# torchrun's default: its agent serves the workers' store, which then dies with it (rank 0 serves the agreements').
@pytest.mark.parametrize("store", [{}, FRESH_STORE], ids=["torchrun's store", "the workers' own store"])
def test_workers_stop_when_torchrun_is_killed(tmp_path, store):
    proc = Proc(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 FAULTS, "--fault", "kill-launcher", "--rank", "0", "--step", "3", "--",
                 "distributed.py", *LONG, "--checkpoint-dir", tmp_path], **store)
    try:
        proc.popen.wait(120)  # the agent dies of SIGKILL at step 3
        wait_until_gone(proc)
    finally:
        proc.kill()  # whatever is left, if the test failed before its workers were gone
    output = proc.output()
    # Orphaned, the workers stopped as on SIGTERM (each sends it to itself; whichever rank
    # noticed first is "another rank" to the other): at an agreed step, with a checkpoint.
    stop = re.search(r"stopping at step (\d+) on (SIGTERM|a signal to another rank)", output)
    assert stop and int(stop.group(1)) % 10 == 0 and "done:" not in output, output
    assert checkpoint.load(tmp_path / "checkpoint.pt")["global_step"] == int(stop.group(1))


def test_workers_stop_when_the_mp_spawn_parent_is_killed(tmp_path):
    tmp = private_tmpdir()
    proc = Proc(["distributed_mp.py", *LONG, "--nproc-per-node", "2", "--checkpoint-dir", tmp_path], TMPDIR=tmp)
    wait_for_file(tmp_path / "checkpoint.pt", proc)
    os.kill(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(10)
    wait_until_gone(proc)
    assert "stopping at step" in proc.output() and "done:" not in proc.output(), proc.output()
    # The parent, killed, cleaned nothing up: it had nothing on disk to clean (utils/spawn.py),
    # nor semaphores, which multiprocessing's resource tracker would report as leaked.
    assert left_in(tmp) == [] and "resource_tracker" not in proc.output(), proc.output()


def spawned_workers(tag) -> int:
    """How many of the processes tagged `tag` are multiprocessing's spawned workers (mp.spawn's)."""
    count = 0
    for pid in tagged_pids(tag):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            count += b"--multiprocessing-fork" in f.read().split(b"\0")
    return count


def test_workers_stop_when_the_mp_spawn_parent_is_killed_while_they_start(tmp_path):
    # Killed before its workers have imported what they run (slowed down here by 5 s): mp.spawn sets their
    # parent-death signal only after that, so their watch of the launcher must watch the parent that
    # started them, not whichever process adopted them.
    slow = tmp_path / "slow_start"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text("import sys, time\nif '--multiprocessing-fork' in sys.argv:\n"
                                           "    time.sleep(5)\n")
    proc = Proc(["distributed_mp.py", *LONG, "--nproc-per-node", "2", "--checkpoint-dir", tmp_path / "ck"],
                PYTHONPATH=str(slow))
    deadline = time.time() + 60
    while spawned_workers(proc.tag) < 2:  # both started (multiprocessing's resource tracker has the tag too)
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"the workers did not start\n{proc.output()}")
        time.sleep(0.1)
    os.kill(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(10)
    wait_until_gone(proc)
    assert "starting 2 processes" in proc.output() and "done:" not in proc.output(), proc.output()
    assert not (tmp_path / "ck" / "checkpoint.pt").exists()


def test_a_rank_started_by_hand_outlives_its_shell(tmp_path):
    """A rank started by hand with the launcher's variables, `nohup python distributed.py ... &`, in a shell that
    then exits: its parent was never a launcher, whose death would stop it (torchrun's agent, the mp.spawn
    parent). It trains to its end."""
    log, marker, tag = tmp_path / "log", tmp_path / "paused", uuid.uuid4().hex
    by_hand = dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=free_port(), **{TAG: tag})
    # The shell exits once the rank pauses at step 2, past its setup (where a launcher is watched). A watch of the
    # shell (polled every second) would stop the run within the pause, at step 10.
    shell = subprocess.run(["bash", "-c", f"nohup {sys.executable} {FAULTS} --fault pause --rank 0 --step 2 "
                            f"--pause-seconds 3 --marker {marker} -- distributed.py {' '.join(TINY)} "
                            f"--checkpoint-dir {tmp_path / 'ck'} > {log} 2>&1 & "
                            f"until [ -e {marker}.0 ] || ! kill -0 $!; do sleep 0.1; done"],
                           cwd=ROOT, env=subprocess_env(**by_hand), capture_output=True, text=True, timeout=120)
    assert shell.returncode == 0 and os.path.exists(f"{marker}.0"), (shell, log.read_text())
    try:
        deadline = time.monotonic() + 120
        while tagged_pids(tag) and time.monotonic() < deadline:
            time.sleep(0.5)
        output = log.read_text()
        assert f"done: {STEPS} steps" in output and "stopping" not in output, output
    finally:
        kill_tagged(tag)


def _watch_then_exit():
    from utils import lifecycle
    lifecycle.watch_launcher(poll_s=0.05)
    time.sleep(1.5)


def test_a_worker_of_a_fork_server_whose_creator_lives_is_not_stopped():
    # Started through multiprocessing's fork server, a worker's OS parent is the server, not the process that
    # asked for it (multiprocessing.parent_process()): watching the one while polling the other stopped it.
    worker = multiprocessing.get_context("forkserver").Process(target=_watch_then_exit)
    worker.start()
    worker.join(60)
    assert worker.exitcode == 0


# --- one run per checkpoint directory ------------------------------------------------------

@pytest.mark.parametrize("launcher", [[], ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]],
                         ids=["python", "torchrun"])
def test_second_run_on_the_same_directory_is_refused_and_no_lock_outlives_a_run(tmp_path, launcher):
    # The first run checkpoints step 2 and then sleeps in it (as a long step would, without
    # using the CPU the second run needs to start): still running whatever the machine's speed.
    # Under torchrun its ranks have read the folder's .lock too (every rank checks it sees it):
    # rank 0 must still hold the lock.
    longer = [*TINY, "--train-samples", "8192", "--epochs", "50", *WORKERS, "--checkpoint-dir", tmp_path]
    first = Proc([*launcher, FAULTS, "--fault", "pause", "--rank", "-1", "--step", "2", "--pause-seconds", "600",
                  "--marker", tmp_path / "paused", "--", "distributed.py", *longer], **FRESH_STORE)
    try:
        wait_for_file(tmp_path / "paused.0", first)
        second = run_script(["distributed.py", *longer, "--resume"], check=False, timeout=120)
        line = assert_one_line_error(second, f"--checkpoint-dir {tmp_path} is in use by another run",
                                     "pid " if launcher else f"pid {first.popen.pid}")
        assert "host " in line and ", since 20" in line
    finally:
        first.kill()  # SIGKILL: no chance to clean up, and still no stale lock
    resumed = run_script(["distributed.py", *longer, "--resume", "--max-steps", "4"], timeout=180)
    assert "resumed from" in resumed.stdout + resumed.stderr


def test_a_group_of_one_agrees_on_a_stop_without_a_collective(monkeypatch):
    """distributed_fsdp.py under plain python trains in a process group of one, whose
    backend is NCCL on a GPU: NCCL cannot reduce the CPU flag of the stop agreement. With
    one process there is nobody to agree with, so should_stop() makes no collective and
    still sees the signal (here a gloo group, with every collective made to fail)."""
    import torch.distributed as dist
    from utils.run import StopSignal

    def collective(*args, **kwargs):
        raise AssertionError("a collective in a group of one")

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for module in (dist, dist.distributed_c10d):  # the functions and their calls of one another
            for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object", "barrier", "reduce",
                         "broadcast_object_list", "all_gather_into_tensor", "reduce_scatter_tensor", "gather",
                         "scatter", "all_to_all", "monitored_barrier"):
                monkeypatch.setattr(module, name, collective)
        stop = StopSignal(distributed=False)
        try:
            assert not stop.should_stop(1)
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.should_stop(2) and stop.received == "SIGUSR1"
        finally:
            stop.close()
    finally:
        dist.destroy_process_group()


def test_a_gloo_that_cannot_start_is_not_blamed_on_a_rank_that_did_not_come():
    """GLOO_SOCKET_IFNAME naming no interface of this host: both ranks fail as they form the group, at once, and
    each says gloo's own error. Only a wait that ran out is put down to a rank that did not come."""
    env = dict(WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(),
               GLOO_SOCKET_IFNAME="nosuchif0")
    ranks = [subprocess.Popen([sys.executable, "distributed.py", *SMALL, "--device", "cpu", "--dist-timeout", "300"],
                              cwd=ROOT, env=subprocess_env(RANK=rank, LOCAL_RANK=rank, **env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        errors = [rank.communicate(timeout=120)[1] for rank in ranks]  # not --dist-timeout later
    finally:
        for rank in ranks:
            rank.kill()
            rank.communicate()
    for rank, err in enumerate(errors):
        lines = [line for line in err.splitlines() if line.strip()]
        assert ranks[rank].returncode == 1 and len(lines) == 1, err
        assert lines[0].startswith(f"distributed.py: error: rank {rank} could not join the gloo process group ("), err
        assert "nosuchif0" in lines[0] and "did not come" not in lines[0], err


@pytest.mark.parametrize("slow", [False, True])
def test_a_rank_whose_peer_never_comes_on_one_node_says_so_in_one_line(tmp_path, slow):
    """Rank 0 of two on one node, the other never started: the store's own wait ends at --dist-timeout with a
    DistStoreError, said in one line with the cause, status 1, not a traceback through init_process_group.
    The store, rank 0's, ends with that wait; the thread that looks for a peer's refusal in it meanwhile (every
    second) has stopped, and prints no C++ trace of a call to a store gone ("recvValue failed", seen once under
    load). slow: 1.5 s between the store's end and the line, as a loaded machine may take."""
    env = subprocess_env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=free_port())
    entry = observing_entry(tmp_path, """
        import time
        from utils import distributed
        said = distributed.print_line
        distributed.print_line = lambda line: (time.sleep(1.5), said(line))
        """) if slow else None
    proc = run_script([*([entry] if slow else []), "distributed.py", *SMALL, "--dist-timeout", "3"], check=False,
                      timeout=120, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("distributed.py: error: rank 0 could not join the gloo process group (DistStoreError: ")
    assert lines[0].endswith("another rank did not come in time (it failed or was slow to start): "
                             "scripts/preflight.py checks each node's network"), lines[0]


@pytest.mark.parametrize("launch", ["torchrun", "mp.spawn"])
@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm", "launcher-killed"])
def test_a_stop_signal_to_a_rank_waiting_for_its_peer_ends_it_at_once_saying_what_it_waited_for(tmp_path, stop,
                                                                                                  launch):
    """Ctrl-C, or a launcher's SIGTERM (torchrun's agent stops its ranks so when another node's agent ends), to
    the process group of a rank that waits for a peer that never comes: started with torchrun's variables, or
    node 0 of two under mp.spawn. Its main thread waits in the store's C++ call, where a Python handler does
    not run: Ctrl-C did nothing until --dist-timeout (here 120 s; 30 min by default), and SIGTERM killed it
    without a word. It ends at once, with one line (also in torchrun's error file; under mp.spawn, the
    parent's "process 0 terminated with exit code 143" no more) and the status of that signal.

    Or its launcher is killed (SIGKILL, to it alone): mp.spawn's parent, or a parent that starts the rank as
    torchrun's agent does (a child process with TORCHELASTIC_RUN_ID). The rank's line then names the launcher
    that died (mp.spawn's SIGINT to its workers, lifecycle.watch_launcher's SIGTERM), not a peer."""
    port, error_file = free_port(), tmp_path / "error.json"
    if launch == "torchrun":
        address, script, flags = "127.0.0.1", "distributed.py", []
        env = subprocess_env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, MASTER_ADDR=address,
                             MASTER_PORT=port, TORCHELASTIC_ERROR_FILE=str(error_file),
                             **({"TORCHELASTIC_RUN_ID": "by-hand"} if stop == "launcher-killed" else {}))
    else:
        iface, address = two_nodes_here()
        script, env = "distributed_mp.py", subprocess_env(GLOO_SOCKET_IFNAME=iface)
        flags = ["--nodes", "2", "--node-rank", "0", "--nproc-per-node", "1", "--ip", address, "--port", str(port)]
    argv = [sys.executable, script, *SMALL, *flags, "--dist-timeout", "120"]
    if stop == "launcher-killed" and launch == "torchrun":  # the agent: a parent that waits for its child
        argv = ["bash", "-c", '"$@" & wait', "launcher", *argv]
    with subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            deadline = time.monotonic() + 90  # the imports, on a busy machine
            while True:  # waiting to join: its store takes connections
                with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=1):
                    break
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.2)
            if stop == "launcher-killed":
                os.kill(proc.pid, signal.SIGKILL)
            else:
                os.killpg(proc.pid, signal.SIGINT if stop == "ctrl-c" else signal.SIGTERM)
            sent = time.monotonic()
            stderr = proc.communicate(timeout=60)[1]  # until the rank, which holds the pipe too, has ended
            took = time.monotonic() - sent
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the rank too, if the test failed
    sig = {"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM}.get(
        stop, signal.SIGINT if launch == "mp.spawn" else signal.SIGTERM)
    why = (re.escape(f"its launcher (pid {proc.pid}) died") if stop == "launcher-killed" else
           rf"a rank did not come \(it failed before joining, or cannot reach {re.escape(address)}\), or cannot be "
           r"reached by the others; scripts/preflight\.py checks each node's network")
    lines = [line for line in stderr.splitlines() if line.strip()]
    status = -signal.SIGKILL if stop == "launcher-killed" else 128 + sig  # the launcher's, killed: not the rank's
    assert proc.returncode == status and took < 15 and len(lines) == 1, (proc.returncode, took, stderr)
    assert re.fullmatch(rf"{re.escape(script)}: error: rank 0 was stopped by {sig.name} after waiting \d+ s to join "
                        rf"the gloo process group: {why}", lines[0]), lines[0]
    if launch == "torchrun":
        assert json.loads(error_file.read_text())["message"]["message"] == lines[0]


def test_a_rank_that_could_not_join_exits_once_its_store_watcher_is_back(monkeypatch, capsys):
    """A rank of a multi-node job whose joining fails exits (one line, status 1) only once
    the thread that watches the store for a peer's refusal has come back from the store: a
    thread still in a store call while the interpreter finalizes ended a rank with SIGABRT
    (seen once, tutorials/09-debugging.md's rank alone on its rendezvous). Here the
    watcher's store call takes a second, and the join fails while it is under way."""
    import threading
    from utils import distributed, lifecycle
    in_call = threading.Event()

    class SlowStore:
        def check(self, keys):
            in_call.set()
            time.sleep(1.0)
            return False

    monkeypatch.setattr(lifecycle, "store_client", lambda *args, **kwargs: SlowStore())
    job = distributed.DistEnv(0, 0, 2, 1, distributed=True, init_method="tcp://127.0.0.1:1")
    before = set(threading.enumerate())
    with pytest.raises(SystemExit) as exited:
        with distributed.joining(job, 60.0, "gloo"):
            assert in_call.wait(30), "the watcher never asked the store"
            raise RuntimeError("Timed out after 6 seconds waiting for clients. 1/2 clients joined.")
    assert exited.value.code == 1
    assert not [t for t in set(threading.enumerate()) - before if t.name == "joining"]
    assert "rank 0 could not join the gloo process group" in capsys.readouterr().err