"""distributed.py end to end through its real launchers: torchrun with two CPU
processes, plain `python`, exact resume, and the one-line errors for bad input."""
import math
import os
import re
import sys

import pytest
import torch

from conftest import SMALL, assert_same_training_state, expect_ok, on_rank_1, read_metrics, torchrun, with_flag
from utils import checkpoint, lifecycle

# Every field README promises in each --metrics epoch record.
RECORD_FIELDS = ("epoch", "step", "train_loss", "train_acc1", "test_loss", "test_acc1", "test_acc5",
                 "test_samples", "epoch_seconds", "images_per_second", "world_size", "global_batch",
                 "strategy", "device")


# --- torchrun, two processes ------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """One epoch of SMALL over 2 processes."""
    out = tmp_path_factory.mktemp("torchrun")
    proc = torchrun(2, "distributed.py", [*SMALL, "--metrics", out / "metrics.jsonl"])
    return proc, out


def test_torchrun_two_processes_writes_complete_metrics(two_process_run):
    proc, out = two_process_run
    records = read_metrics(out / "metrics.jsonl")
    assert [r["event"] for r in records] == ["epoch", "end"]
    for record in records:
        missing = [f for f in RECORD_FIELDS if f not in record]
        assert not missing, f"{record['event']} record lacks {missing}"
        assert record["epoch"] == 1 and record["step"] == 8  # 256 images / 32 per step
        assert record["world_size"] == 2 and record["global_batch"] == 32
        assert record["test_samples"] == 100
        assert record["device"] == "cpu" and record["strategy"].startswith("ddp")
        assert 0 <= record["train_acc1"] <= 100 and 0 <= record["test_acc1"] <= record["test_acc5"] <= 100
        # Untrained on 100 classes the loss starts near ln(100) = 4.6: finite and in that region.
        assert 3.0 < record["train_loss"] < 7.0 and math.isfinite(record["test_loss"])
        assert record["epoch_seconds"] > 0 and record["images_per_second"] > 0
    assert records[1]["total_seconds"] >= records[0]["epoch_seconds"]


def test_only_rank_0_prints(two_process_run):
    proc, _ = two_process_run
    epoch_lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch 1/1")]
    assert len(epoch_lines) == 1, proc.stdout
    assert "(100 samples)" in epoch_lines[0]
    assert sum(line.startswith("done:") for line in proc.stdout.splitlines()) == 1
    assert "Traceback" not in proc.stderr


# --- exact resume, one process ----------------------------------------------------------------

# The runs of this section are main() in the test process (conftest.script_runner), as plain
# python runs it: what they check is the checkpoint's arithmetic, which does not depend on the
# process, and each saves starting Python and importing torch (4 CPU-s on a slow 2-core
# machine). The same resume through real processes, torchrun's among them: the resumes after a
# signal or a crash in test_fault_tolerance.py.

@pytest.fixture(scope="module")
def straight_four_steps(tmp_path_factory, run_in_process_once):
    """4 steps in one go: 96 images, batch 32, so 3 steps per epoch; --epochs 2."""
    out = tmp_path_factory.mktemp("straight")
    expect_ok(run_in_process_once("distributed.py", [*RESUME_ARGS, "--max-steps", "4", "--checkpoint-dir", out / "ck",
                                                     "--metrics", out / "m.jsonl"]))
    return out


RESUME_ARGS = [*with_flag(with_flag(SMALL, "--train-samples", 96), "--epochs", 2), "--test-samples", "20"]


@pytest.mark.parametrize("first_leg", [2, 3], ids=["mid-epoch", "epoch-boundary"])
def test_resume_continues_exactly(straight_four_steps, tmp_path, first_leg, run_in_process):
    ck = tmp_path / "ck"
    expect_ok(run_in_process("distributed.py", [*RESUME_ARGS, "--max-steps", first_leg, "--checkpoint-dir", ck]))
    saved = torch.load(ck / "checkpoint.pt", weights_only=True)
    assert (saved["epoch"], saved["step_in_epoch"]) == (0, first_leg)  # stopped where intended
    resumed = expect_ok(run_in_process("distributed.py", [*RESUME_ARGS, "--max-steps", "4", "--checkpoint-dir", ck,
                                                          "--resume", "--metrics", tmp_path / "m.jsonl"]))
    expected_epoch, expected_step = (1, 2) if first_leg == 2 else (2, 0)
    assert f"resumed from {ck / 'checkpoint.pt'}: epoch {expected_epoch}, step {expected_step} of 3" in resumed

    assert_same_training_state(straight_four_steps / "ck" / "checkpoint.pt", ck / "checkpoint.pt", global_step=4)
    # What the resumed run reports (the rest of the interrupted epoch included) is what
    # the uninterrupted run reported for the same steps.
    straight = [r for r in read_metrics(straight_four_steps / "m.jsonl") if r["step"] > first_leg]
    resumed = read_metrics(tmp_path / "m.jsonl")
    keys = ("event", "epoch", "step", "epoch_complete", "train_loss", "train_acc1", "test_loss", "test_acc1",
            "test_acc5", "test_samples")
    assert [r["event"] for r in resumed] == [r["event"] for r in straight]
    for a, b in zip(straight, resumed):
        for key in keys:
            expected = pytest.approx(a[key], rel=1e-9, abs=1e-9) if isinstance(a[key], float) else a[key]
            assert b[key] == expected, (key, a["event"], a["epoch"])


def test_resume_continues_the_random_numbers_a_model_draws(tmp_path, run_in_process, monkeypatch):
    """The scripts' own steps draw nothing from the global generators (each sample's augmentation has its own
    seed), but a model with dropout, or a loss with noise, does: a resumed run continues torch's, NumPy's and
    Python's sequences from the checkpoint (a lost restore, or a re-seed after it, would replay the first steps'
    draws, and train on otherwise). In training only: the first leg's --max-steps ends with an evaluation that the
    straight run does not make there, and the checkpoint keeps the generators as they are after it."""
    import random

    import numpy as np
    from models.resnet import ResNet
    forward = ResNet.forward

    def drawing(self, x):  # in training: dropout (torch's generator), a logit scale drawn from NumPy's and Python's
        if not self.training:
            return forward(self, x)
        return torch.nn.functional.dropout(forward(self, x), 0.3) * (1 + 0.1 * (np.random.rand() + random.random()))
    monkeypatch.setattr(ResNet, "forward", drawing)
    expect_ok(run_in_process("distributed.py", [*RESUME_ARGS, "--max-steps", "4", "--checkpoint-dir", tmp_path / "a"]))
    expect_ok(run_in_process("distributed.py", [*RESUME_ARGS, "--max-steps", "2", "--checkpoint-dir", tmp_path / "b"]))
    expect_ok(run_in_process("distributed.py", [*RESUME_ARGS, "--max-steps", "4", "--checkpoint-dir", tmp_path / "b",
                                                "--resume"]))
    assert_same_training_state(tmp_path / "b" / "checkpoint.pt", tmp_path / "a" / "checkpoint.pt", global_step=4)


@pytest.mark.parametrize("flag, value, said", [
    ("--seed", "1", "this run has --seed 1: resume with the same value"),
    ("--train-samples", "64", "was trained on 96 training samples, this run has 64: resume with the same data"),
    ("--epochs", "3", "this run has --epochs 3: resume with the same value")])
def test_resume_refuses_flags_that_would_change_the_run(straight_four_steps, in_process, flag, value, said):
    # Another seed, data set size or length would give other batches or another schedule
    # after the resume point: not a continuation of the saved run.
    line = in_process([*RESUME_ARGS, flag, value, "--resume", straight_four_steps / "ck" / "checkpoint.pt",
                       "--checkpoint-dir", straight_four_steps / "other"])
    assert said in line, line


def test_resume_takes_the_whole_training_set_named_or_not(tmp_path, run_in_process):
    # The same 50,000 samples, once by default and once as --train-samples 50000: the same run.
    at = SMALL.index("--train-samples")
    flags = [*SMALL[:at], *SMALL[at + 2:], "--test-samples", "20", "--checkpoint-dir", tmp_path]
    expect_ok(run_in_process("distributed.py", [*flags, "--max-steps", "1"]))
    out = expect_ok(run_in_process("distributed.py", [*flags, "--train-samples", "50000", "--max-steps", "2",
                                                      "--resume"]))
    assert "resumed from" in out and checkpoint.load(str(tmp_path / "checkpoint.pt"))["global_step"] == 2, out


def test_resume_from_a_path_does_not_overwrite_another_checkpoint(straight_four_steps, in_process, tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "checkpoint.pt").write_bytes(b"someone else's run")
    line = in_process([*RESUME_ARGS, "--resume", straight_four_steps / "ck" / "checkpoint.pt",
                       "--checkpoint-dir", tmp_path / "ck"])
    assert "already holds a checkpoint: --resume" in line and "would overwrite it: give --resume alone" in line
    assert (tmp_path / "ck" / "checkpoint.pt").read_bytes() == b"someone else's run"


# --- bad input: one line on stderr, exit status 2 -----------------------------------------------

def test_bad_input_under_torchrun_is_the_first_line_and_the_root_cause():
    # Both ranks refuse; rank 0 prints the line, first on stderr, and every rank leaves it in
    # torchrun's error file, so that torchrun's closing summary names it as the root cause
    # whichever rank torchrun saw leave first.
    proc = torchrun(2, "distributed.py", with_flag(SMALL, "--batch-size", 33), check=False, timeout=120)
    line = "distributed.py: error: batch size 33 is not divisible by 2 processes (33 / 2 = 16.5)"
    lines = [text for text in proc.stderr.splitlines() if text.strip()]
    summary = proc.stderr[proc.stderr.index("Root Cause"):]
    assert proc.returncode != 0
    assert "exitcode  : 2" in summary and f"traceback : {line}" in summary, summary
    assert sum(text.startswith(line) for text in lines) <= 1, proc.stderr  # rank 1 says nothing
    # Rank 0 printed it first, unless it was still starting 2 s after rank 1 had refused (a
    # loaded machine) and torchrun stopped it then: SIGTERM, before it could say anything.
    stopped_first = re.search(r"rank\s*: 0 \(local_rank: 0\)\n\s*exitcode\s*: -15", proc.stderr)
    assert stopped_first or lines[0].startswith(line), proc.stderr
    assert proc.stdout == ""


ELSEWHERE = """
import time
from utils import distributed, run
sys.argv[sys.argv.index("--checkpoint-dir") + 1] += "-elsewhere"
agreed = run.all_ranks_ok

def slow(ok, call):  # a loaded node: its next call to the agreements' store comes 3 s after an agreement
    answer = agreed(ok, call)
    time.sleep(3)
    distributed._store.add("late", 1)
    return answer
if {slow}:
    run.all_ranks_ok = slow
"""


# Slow: rank 0 has its answer, and refuses, while rank 1 still uses the store that rank 0 serves under torchrun's
# own (which would die with torchrun): it must answer until rank 0's process ends, not stop at its cleanup.
@pytest.mark.parametrize("slow", [False, True], ids=["", "rank 1 slow after each agreement"])
def test_a_checkpoint_dir_that_not_every_node_sees_is_refused_at_the_start(tmp_path, slow):
    # As on two nodes that each have a folder of that name on their own disk: the saves would succeed,
    # and the resume fail (rank 1 would not find the checkpoint). Rank 1 looks for half of --dist-timeout
    # (60 s at most), then refuses.
    ck = tmp_path / "ck"
    (tmp_path / "elsewhere.py").write_text(ELSEWHERE.format(slow=slow))
    runner = on_rank_1(tmp_path, "distributed.py", f"exec(open({str(tmp_path / 'elsewhere.py')!r}).read())")
    workers_on = with_flag(SMALL, "--workers", 1)  # as users run it: loader workers forked before the check
    proc = torchrun(2, runner, [*workers_on, "--checkpoint-dir", ck, "--dist-timeout", "40"], check=False, timeout=180)
    lines = [text for text in proc.stderr.splitlines() if text.strip()]
    assert proc.returncode != 0 and lines[0].startswith(
        f"distributed.py: error: --checkpoint-dir {ck}: another rank does not see the line of rank 0 (host ") and \
        lines[0].endswith("): every node must see the same folder (a shared file system), and one run use it at a "
                          "time"), proc.stderr
    assert "exitcode  : 2" in proc.stderr and "exitcode  : 1" not in proc.stderr, proc.stderr
    # Rank 1's own line, in its error file:
    assert f"--checkpoint-dir {ck}-elsewhere: this node finds no .lock with the line of rank 0 (host " in proc.stderr

    assert os.listdir(ck) == [".lock"] and "epoch 1/1" not in proc.stdout


LATE = """
import threading
from utils import checkpoint
i = sys.argv.index("--checkpoint-dir") + 1
shared, sys.argv[i] = sys.argv[i], sys.argv[i] + "-late"
appears = threading.Timer(2.0, os.symlink, (shared, sys.argv[i]))
looked_up = checkpoint.holder

def holder(directory):  # the folder's entry appears 2 s after this rank first looks for it
    if appears.ident is None:
        appears.start()
    return looked_up(directory)
checkpoint.holder = holder
"""


def test_a_checkpoint_dir_that_a_node_sees_late_is_looked_at_again(tmp_path):
    # NFS may answer from its cached view of a folder for up to 60 s (acdirmax): seen late, not refused.
    (tmp_path / "late.py").write_text(LATE)
    runner = on_rank_1(tmp_path, "distributed.py", f"exec(open({str(tmp_path / 'late.py')!r}).read())")
    torchrun(2, runner, [*with_flag(SMALL, "--workers", 1), "--max-steps", "2", "--checkpoint-dir", tmp_path / "ck"])
    assert (tmp_path / "ck" / "checkpoint.pt").is_file() and (tmp_path / "ck-late").is_symlink()


SEEN_LATE = """
import os, time
isfile, first = os.path.isfile, {{}}

def late(path):  # {name} appears to this rank {after} s after it first looks (NFS's cached view of its folder)
    if not str(path).endswith({name!r}):
        return isfile(path)
    return isfile(path) and time.monotonic() - first.setdefault(path, time.monotonic()) > {after}
os.path.isfile = late
"""


@pytest.mark.parametrize("script, name, refusal", [
    ("distributed.py", checkpoint.FILENAME,
     r"this node does not see a checkpoint\.pt \(rank 0 does\) beside the line of rank 0 \(host "),
    # Every rank looked its shards' .metadata up, missing, as DCP's save began (FileSystemWriter.prepare_local_plan).
    ("distributed_fsdp.py", ".metadata", r"no sharded checkpoint at \S+sharded-step4-[0-9a-f]{8} \(its \.metadata is "
                                         "missing")])
def test_a_checkpoint_that_a_node_sees_late_is_resumed(tmp_path, script, name, refusal):
    # A torchrun restart seconds after a save on another node: rank 0's view decides whether there is a checkpoint
    # to resume; the others look again for what it names, as for the folder's .lock, and are not refused.
    flags = [*with_flag(SMALL, "--workers", 1), "--checkpoint-dir", tmp_path / "ck"]
    torchrun(2, script, [*flags, "--max-steps", "2"])
    runner = on_rank_1(tmp_path, script, f"exec(open({str(tmp_path / 'late.py')!r}).read())")
    (tmp_path / "late.py").write_text(SEEN_LATE.format(name=name, after=2))
    resumed = torchrun(2, runner, [*flags, "--max-steps", "4", "--resume"])
    assert "resumed from" in resumed.stdout and checkpoint.load(str(tmp_path / "ck" / "checkpoint.pt"))[
        "global_step"] == 4, resumed.stdout + resumed.stderr
    # Never seen there (half of --dist-timeout): refused, the node that does not see it saying so.
    (tmp_path / "late.py").write_text(SEEN_LATE.format(name=name, after=600))
    refused = torchrun(2, runner, [*flags, "--max-steps", "6", "--resume", "--dist-timeout", "20"], check=False)
    assert refused.returncode != 0 and "exitcode  : 2" in refused.stderr, refused.stderr
    assert re.search(refusal, refused.stderr), refused.stderr


@pytest.fixture
def in_process(monkeypatch, capsys):
    """distributed.py's main behind lifecycle.run_main, as `python distributed.py` would run it."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(sys, "argv", ["distributed.py"])
    import distributed

    def run(argv):
        with pytest.raises(SystemExit) as excinfo:
            lifecycle.run_main(distributed.main, [str(a) for a in argv])
        captured = capsys.readouterr()
        assert excinfo.value.code == 2, captured.err
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert len(lines) == 1, captured.err
        assert "Traceback" not in captured.err + captured.out
        return lines[0]
    return run


@pytest.mark.parametrize("flag, value", [("--epochs", -1), ("--max-steps", 0), ("--max-steps", -2),
                                         ("--batch-size", 0), ("--batch-size", -32)])
def test_non_positive_counts_are_one_line(in_process, flag, value):
    argv = [*SMALL, flag, value] if flag == "--max-steps" else with_flag(SMALL, flag, value)
    line = in_process(argv)
    assert flag in line and str(value) in line and "at least 1" in line


def test_corrupt_checkpoint_is_one_line(in_process, tmp_path):
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(b"\x00" * 1000)
    line = in_process([*SMALL, "--resume", bad])
    assert str(bad) in line and "checkpoint" in line


def test_missing_offline_dataset_is_one_line(in_process, tmp_path):
    line = in_process(["--dataset", "cifar100", "--data-dir", tmp_path, "--model", "resnet_tiny",
                       "--workers", "0", "--epochs", "1"])
    assert str(tmp_path) in line and "--data-dir" in line and "--dataset synthetic" in line


