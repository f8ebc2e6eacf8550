"""scripts/gpu_check.sh (make gpu-check) on the CPU: its refusal without CUDA, and its
stages' own time limits, with the stage commands swapped for small ones through the
script's environment knobs. What it runs on a GPU is tested by the gpu-marked tests."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from conftest import ROOT, subprocess_env

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run_check(out, timeout, **env):
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(PYTHON=sys.executable, OUT=out, **env))


def test_without_cuda_one_line_and_exit_2(tmp_path):
    out = tmp_path / "out"
    proc = run_check(out, 180)  # subprocess_env hides every GPU
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "sees no CUDA GPU" in lines[0] and sys.executable in lines[0], proc.stderr
    assert proc.stdout == "" and not out.exists()  # nothing written


def test_stages_keep_to_their_time_and_out_holds_at_most_8_files(tmp_path):
    out = tmp_path / "out"
    hang = tmp_path / "test_hang.py"
    hang.write_text("import time\n\ndef test_hangs():\n    time.sleep(600)\n")
    began = time.monotonic()
    # Two pytest-xdist workers, not the default 4: the stop still reaches every worker (the
    # stage's timeout signals its whole process group), at half the imports on this small CPU.
    # 360 s in all: the benchmark stage is started only with 60 s left of it, after 45 s kept
    # for the end, and the stages before it took 49 s under a loaded CPU (150 s was too few); in
    # the full suite on a slower 2-core machine, 240 s left the benchmark's row too little and
    # it was cut short. The stages end early when their work is done, so the larger budget
    # costs no time here.
    proc = run_check(out, 450, GPU_CHECK_REQUIRE_CUDA="0", GPU_CHECK_SECONDS="360", GPU_CHECK_PYTEST_SECONDS="8",
                     GPU_CHECK_PYTEST_WORKERS="2", GPU_CHECK_PYTEST_ARGS=str(hang),
                     GPU_CHECK_MEMORY_ARGS="--device cpu --model resnet_tiny --world-sizes 1 --memory-batch 2",
                     GPU_CHECK_BENCH_ARGS="--quick --device cpu --rows ceiling-fp32")
    took = time.monotonic() - began
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the test stage ran out of time
    assert took < 360, took
    log = (out / "gpu_check.log").read_text()
    assert "== pytest: timed out after 8 s" in log, log
    assert "== benchmark: ok" in log and "== memory: ok" in log, log
    assert "1 stage(s) failed" in log and "pytest (timed out)" in log

    # The hung test was stopped like Ctrl-C, so pytest still wrote its report.
    junit = (out / "pytest.xml").read_text()
    assert "<testsuite" in junit
    report = json.loads((out / "benchmark.json").read_text())
    assert report["state"] == "complete" and report["settings"]["time_budget_s"] > 0
    assert [(r["name"], r["status"]) for r in report["rows"]] == [("ceiling-fp32", "ok")]
    with tarfile.open(out / "benchmark-logs.tar.gz") as tar:
        assert {"benchmark-logs/ceiling-fp32.log", "benchmark-logs/memory.json"} <= set(tar.getnames())
    assert "| fsdp2 | 1 |" in (out / "memory.md").read_text()
    assert "torch" in (out / "environment.txt").read_text()

    # Everything can be brought back: few plain files, plain names, no folders.
    entries = list(out.iterdir())
    assert len(entries) <= 8 and all(e.is_file() for e in entries), entries
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", e.name) for e in entries)
    assert {e.name for e in entries} == {"environment.txt", "gpu_check.log", "pytest.xml", "memory.md", "benchmark.md",
                                         "benchmark.json", "benchmark.png", "benchmark-logs.tar.gz"}


def test_with_too_little_time_no_stage_runs_unbounded_and_others_files_stay(tmp_path):
    """GPU_CHECK_SECONDS too short for any stage: each is said not run (pytest ran under `timeout 0`, no bound at
    all, or a negative one, status 125); the clean-up removes the benchmark's temporaries only, in an OUT that
    may be a shared folder."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.tmp").write_text("a user's")
    proc = run_check(out, 120, GPU_CHECK_REQUIRE_CUDA="0", GPU_CHECK_SECONDS="40")
    log = (out / "gpu_check.log").read_text()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert all(f"== {stage}: not run" in log for stage in ("pytest", "memory", "benchmark")), log
    assert "pytest (no time left)" in log and (out / "mine.tmp").read_text() == "a user's"


def processes_in_session(sid):
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.getsid(int(entry)) == sid:
                found.append(int(entry))
        except ProcessLookupError:
            pass
    return found


# A terminal's shell starts a job with SIGINT at its default and unblocked. The suite itself may not have that: a
# non-interactive shell starts `make test &` with SIGINT ignored, every process of the run inherits it, and the
# script, started so, could not trap Ctrl-C (twice in full runs started in the background). Set back here, as exec
# keeps both.
AS_A_TERMINAL_STARTS_IT = [sys.executable, "-c", "import os, signal, sys; signal.pthread_sigmask(signal.SIG_SETMASK, "
                           "[]); signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"]


@pytest.mark.parametrize("slow_start", [False, True], ids=["running", "starting"])
def test_ctrl_c_stops_the_running_stage_and_skips_the_rest(tmp_path, slow_start):
    """Ctrl-C reaches the script's process group, which `timeout` has taken each stage out of:
    the script must hand it on, skip the stages left and end with 130, leaving no process behind.
    An earlier run's reports in the folder are gone, not passed off as this run's.
    starting: the stage's `timeout` starts 6 s late (as an exec stalled on a loaded machine once
    seemed to: the stage then ran on to its own timeout), so that Ctrl-C comes before it has set
    its handlers, while it still ignores SIGINT."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "benchmark.md").write_text("an earlier run's figures\n")
    hang = tmp_path / "test_hang.py"
    hang.write_text("import time\n\ndef test_hangs():\n    time.sleep(600)\n")
    env = subprocess_env(PYTHON=sys.executable, OUT=str(out), GPU_CHECK_REQUIRE_CUDA="0", GPU_CHECK_SECONDS="400",
                         GPU_CHECK_PYTEST_SECONDS="200", GPU_CHECK_PYTEST_WORKERS="0", GPU_CHECK_PYTEST_ARGS=str(hang))
    if slow_start:
        late = tmp_path / "bin"
        late.mkdir()
        (late / "timeout").write_text(f'#!/bin/bash\nsleep 6\nexec {shutil.which("timeout")} "$@"\n')
        (late / "timeout").chmod(0o755)
        env["PATH"] = f"{late}{os.pathsep}{env['PATH']}"
    proc = subprocess.Popen([*AS_A_TERMINAL_STARTS_IT, "bash", str(SCRIPT)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
    try:
        log = out / "gpu_check.log"
        deadline = time.monotonic() + 120
        while not (log.exists() and "== pytest: at most" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "== pytest: at most" in log.read_text()
        assert not (out / "benchmark.md").exists()
        time.sleep(3)  # into the hanging test (starting: into the late start of its `timeout`)
        began = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C sends it: to the foreground process group
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, output
    assert time.monotonic() - began < 30
    text = log.read_text()
    assert "== pytest: stopped by a signal" in text, text
    assert "== memory: not run, stopped by a signal" in text and "== benchmark: not run, stopped" in text, text
    assert "gpu_check: stopped by a signal" in text
    assert not (out / "benchmark.md").exists()
    # The script has exited; what it stopped may take a moment to end on a loaded machine: polled for up
    # to 10 s, not a fixed pause. A process still there then has outlived the script.
    deadline = time.monotonic() + 10
    while (left := processes_in_session(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [], f"a stage outlived the script: {left}"


FAKE_PYTHON = """#!/usr/bin/env bash
# Answers the GPU probe with FAKE_GPUS GPUs; every other command is only recorded.
echo "$*" >>"$FAKE_CALLS"
case "$*" in *"print(torch.__version__"*) echo "2.14.1 True $FAKE_GPUS" ;; esac
exit 0
"""


@pytest.mark.parametrize("gpus, memory_args, seconds", [(8, "--world-sizes 1,8 ", 155), (1, "", 90)])
def test_the_memory_stage_measures_1_and_every_gpu_within_its_time(tmp_path, gpus, memory_args, seconds):
    """On N GPUs memory_table.py alone would launch 1, 2, 4, ..., N processes (4 launches on
    8 GPUs, 20 s each for one process on an H200): the stage measures 1 and N, two launches of at
    most 65 s each, and the whole check still leaves the benchmark a minute when the tests take
    all of theirs. Every command is a recording stand-in for python here."""
    fake, calls = tmp_path / "python", tmp_path / "calls"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=subprocess_env(PYTHON=str(fake), OUT=str(out), FAKE_GPUS=str(gpus),
                                             FAKE_CALLS=str(calls)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (out / "gpu_check.log").read_text()
    assert (f"== memory: at most {seconds} s: {fake} scripts/memory_table.py {memory_args}--row-timeout 65 "
            in log), log
    assert f"scripts/memory_table.py {memory_args}--row-timeout 65 " in calls.read_text()
    stages = dict(re.findall(r"== (\w+): at most (\d+) s", log))
    total, kept = 510, 25 + 20  # GPU_CHECK_SECONDS, and the end's and the last kill grace's
    assert total - kept - int(stages["pytest"]) - int(stages["memory"]) >= 60  # the benchmark's least
