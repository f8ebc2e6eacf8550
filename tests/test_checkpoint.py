"""Checkpoints: atomic writes, weights_only reads, and one-line errors for files
that are not ours."""
import errno
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import (FAULTS, ROOT, SMALL, assert_refused, expect_ok, lock_descriptors, make_run, observing_entry,
                      run_script, small_args, take_one_step)
from utils import checkpoint, cli, metrics


def state(value: float) -> dict:
    return {"format": checkpoint.FORMAT, "model": {"w": torch.full((64, 64), value)}, "epoch": 1}


# --- atomic writes ----------------------------------------------------------------------

@pytest.mark.parametrize("crash", [RuntimeError("No space left on device"), KeyboardInterrupt()])
def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, crash):
    path = tmp_path / "checkpoint.pt"
    checkpoint.atomic_save(state(1.0), str(path))
    real_save = torch.save
    during = {}

    def half_then_crash(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(100)  # what a full disk or a kill leaves behind
        during["files"] = sorted(os.listdir(tmp_path))
        raise crash

    monkeypatch.setattr(torch, "save", half_then_crash)
    with pytest.raises(type(crash)):
        checkpoint.atomic_save(state(2.0), str(path))
    monkeypatch.undo()

    # The new bytes went to a temporary file beside the checkpoint, never into it ...
    assert len(during["files"]) == 2 and "checkpoint.pt" in during["files"]
    # ... which is gone, and the previous checkpoint is whole.
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt"]
    loaded = checkpoint.load(str(path))
    assert torch.equal(loaded["model"]["w"], torch.full((64, 64), 1.0))


def test_save_replaces_the_previous_checkpoint(tmp_path):
    path = tmp_path / "sub" / "checkpoint.pt"  # the directory is created
    checkpoint.atomic_save(state(1.0), str(path))
    checkpoint.atomic_save(state(3.0), str(path))
    assert os.listdir(path.parent) == ["checkpoint.pt"]
    assert torch.equal(checkpoint.load(str(path))["model"]["w"], torch.full((64, 64), 3.0))


def test_the_data_is_on_disk_before_the_rename_makes_it_the_checkpoint(tmp_path, monkeypatch):
    # A kill leaves the page cache intact, so no crash test sees a missing fsync: a power cut would, with
    # checkpoint.pt renamed onto a file whose data never reached the disk.
    calls = []
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))))
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (calls.append(("replace", str(src))), replace(src, dst)))
    checkpoint.atomic_save(state(1.0), str(tmp_path / "checkpoint.pt"))
    assert [what for what, _ in calls] == ["fsync", "replace"] and calls[0][1] == calls[1][1], calls


def test_two_writers_of_one_checkpoint_with_one_pid_each_write_a_whole_file(tmp_path, monkeypatch):
    # Two runs on a folder whose file system has no locks (lock_directory warns and goes on), their rank 0s of one pid
    # (two containers): the second's save comes while the first's is under way. Each writes a file of its own; the
    # last rename wins with a whole checkpoint, not one file that both wrote into.
    path, real_save = tmp_path / "checkpoint.pt", torch.save

    def second_save_meanwhile(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        monkeypatch.setattr(torch, "save", real_save)
        checkpoint.atomic_save(state(2.0) | {"model": {"w": torch.full((8, 8), 2.0)}}, str(path))

    monkeypatch.setattr(torch, "save", second_save_meanwhile)
    checkpoint.atomic_save(state(1.0), str(path))
    assert torch.equal(checkpoint.load(str(path))["model"]["w"], torch.full((64, 64), 1.0))
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


def test_checkpoint_gets_the_permissions_of_any_new_file(tmp_path):
    # A checkpoint in a shared project folder must be readable by whoever may resume
    # the run, as torch.save(obj, path) would leave it: the umask decides, not the
    # private 0600 of a temporary file.
    umask = os.umask(0o022)
    try:
        checkpoint.atomic_save(state(1.0), str(tmp_path / "checkpoint.pt"))
        torch.save(state(1.0), tmp_path / "plain.pt")
    finally:
        os.umask(umask)
    mode = os.stat(tmp_path / "checkpoint.pt").st_mode & 0o777
    assert mode == os.stat(tmp_path / "plain.pt").st_mode & 0o777 == 0o644


# --- reading files that are not checkpoints -----------------------------------------------

def _write_bytes(path, raw):
    path.write_bytes(raw)
    return path


class NotATensor:
    pass


@pytest.mark.parametrize("make, fragment", [
    # Fixed bytes, not os.urandom: random ones made torch warn in some runs (a pickle protocol byte).
    (lambda p: _write_bytes(p, random.Random(0).randbytes(4096)), "corrupt"),
    (lambda p: _write_bytes(p, b""), "corrupt"),
    (lambda p: (checkpoint.atomic_save(state(1.0), str(p)),
                _write_bytes(p, p.read_bytes()[:len(p.read_bytes()) // 2]))[1], "corrupt"),
    (lambda p: torch.save({"w": torch.zeros(3)}, p), "not a checkpoint written by these scripts"),
    (lambda p: torch.save(torch.zeros(3), p), "not a checkpoint written by these scripts"),
    (lambda p: torch.save({"format": "someone-else/1"}, p), "not a checkpoint written by these scripts"),
    # Pickled code: weights_only refuses to run it, and so do we.
    (lambda p: torch.save({"format": checkpoint.FORMAT, "x": NotATensor()}, p), "could run code"),
])
def test_unreadable_files_are_a_usage_error(tmp_path, make, fragment):
    path = tmp_path / "model.pt"
    make(path)
    with pytest.raises(cli.UsageError) as excinfo:
        checkpoint.load(str(path))
    message = str(excinfo.value)
    assert fragment in message and str(path) in message
    assert "\n" not in message and len(message) < 400


def test_missing_checkpoint_is_a_usage_error(tmp_path):
    with pytest.raises(cli.UsageError, match="no checkpoint at"):
        checkpoint.load(str(tmp_path / "nope.pt"))


# --- a real checkpoint ----------------------------------------------------------------------

def test_checkpoint_reads_with_weights_only_and_resumes(tmp_path):
    directory = tmp_path / "run"
    run, model, optimizer = make_run(small_args("--checkpoint-dir", directory))
    take_one_step(run, model, optimizer)
    path = directory / "checkpoint.pt"
    # .lock: this run's claim on the directory (see checkpoint.lock_directory)
    assert sorted(os.listdir(directory)) == [".lock", "checkpoint.pt", "config.json"]

    saved = torch.load(path, map_location="cpu", weights_only=True)  # no pickled code needed
    assert saved["format"] == checkpoint.FORMAT
    assert {"model", "optimizer", "scheduler", "scaler", "epoch", "step_in_epoch", "global_step",
            "train_sums", "rng", "config"} <= set(saved)
    assert (saved["epoch"], saved["step_in_epoch"], saved["global_step"]) == (0, 1, 1)
    assert saved["train_sums"][2] == 4  # the four images of the step
    for name, tensor in model.state_dict().items():
        assert torch.equal(saved["model"][name], tensor), name
    assert all("momentum_buffer" in s for s in saved["optimizer"]["state"].values())
    assert saved["config"]["batch_size"] == 32 and saved["config"]["model"] == "resnet_tiny"

    # What the saved run would draw next from each global generator (dropout, a user's own augmentation);
    # make_run's manual_seed and these draws are what the resume must undo.
    checkpoint.set_rng_state(saved["rng"])
    expected = (torch.rand(3), np.random.rand(3), random.random())
    resumed, model2, optimizer2 = make_run(small_args("--checkpoint-dir", directory, "--resume"))
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], expected[0]) and np.array_equal(drawn[1], expected[1]) and drawn[2] == expected[2]
    assert (resumed.epoch, resumed.step_in_epoch, resumed.global_step) == (0, 1, 1)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.scheduler.last_epoch == run.scheduler.last_epoch == 1
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_an_epochs_end_reduces_its_training_sums_once(tmp_path, monkeypatch):
    # The record's training figures and the checkpoint's sums come from one all-reduce, which every rank waits in.
    run, model, optimizer = make_run(small_args("--checkpoint-dir", tmp_path, "--max-steps", 1))
    take_one_step(run, model, optimizer)
    reduced = []
    monkeypatch.setattr(metrics, "all_reduce_sum", lambda tensor, call=None: reduced.append(tensor.clone()) or tensor)
    run.end_epoch(dict(metrics.NOT_EVALUATED))
    assert len(reduced) == 1
    loss_sum, _, samples, *_ = checkpoint.load(tmp_path / "checkpoint.pt")["train_sums"]
    assert samples == 4 and run.last_record["train_loss"] == loss_sum / samples


@pytest.mark.parametrize("no_lock", [errno.ENOLCK, errno.ENOSYS])
def test_a_checkpoint_folder_without_locks_trains_with_a_warning(tmp_path, monkeypatch, capsys, no_lock):
    # NFS without its lock daemon, Lustre mounted noflock: often the only folder every node sees. The run
    # trains and checkpoints there, saying that a second run at the same time would not be refused.
    def lockf(*_):
        raise OSError(no_lock, os.strerror(no_lock))
    monkeypatch.setattr(checkpoint.fcntl, "lockf", lockf)
    directory = tmp_path / "run"
    run, model, optimizer = make_run(small_args("--checkpoint-dir", directory))
    take_one_step(run, model, optimizer)
    assert checkpoint.load(directory / "checkpoint.pt")["global_step"] == 1
    warning = capsys.readouterr().err
    assert f"warning: cannot lock --checkpoint-dir {directory} ({os.strerror(no_lock)})" in warning, warning
    # A fresh run there is still refused once the folder holds a checkpoint.
    with pytest.raises(cli.UsageError, match="already holds a checkpoint"):
        make_run(small_args("--checkpoint-dir", directory))


def test_a_lock_that_fails_otherwise_is_refused(tmp_path, monkeypatch):
    # Only a file system without locks trains unlocked; any other failure to lock is a refusal.
    def lockf(*_):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(checkpoint.fcntl, "lockf", lockf)
    with pytest.raises(cli.UsageError, match=f"cannot lock --checkpoint-dir {tmp_path}: Input/output error"):
        checkpoint.lock_directory(str(tmp_path))


def test_resume_refuses_another_model(tmp_path):
    directory = tmp_path / "run"
    run, model, optimizer = make_run(small_args("--checkpoint-dir", directory))
    take_one_step(run, model, optimizer)
    args = small_args("--resume", directory / "checkpoint.pt")
    args.model = "resnet18"
    with pytest.raises(cli.UsageError, match="--model resnet_tiny"):
        make_run(args, "resnet18")


def test_fresh_run_does_not_overwrite_a_checkpoint(tmp_path):
    directory = tmp_path / "run"
    run, model, optimizer = make_run(small_args("--checkpoint-dir", directory))
    take_one_step(run, model, optimizer)
    before = (directory / "checkpoint.pt").read_bytes()
    with pytest.raises(cli.UsageError, match="--resume"):
        make_run(small_args("--checkpoint-dir", directory))
    assert (directory / "checkpoint.pt").read_bytes() == before


BEFORE_A_RUN = {}


def test_a_run_made_in_a_test_holds_the_stop_signals_and_its_folder(tmp_path):
    # Until its finish() (the stop signals) or the process's exit (the lock): the next test must not inherit them.
    BEFORE_A_RUN.update(handler=signal.getsignal(signal.SIGTERM), locks=lock_descriptors())
    run = make_run(small_args("--checkpoint-dir", tmp_path))[0]
    assert signal.getsignal(signal.SIGTERM) != BEFORE_A_RUN["handler"] and lock_descriptors() != BEFORE_A_RUN["locks"]
    run.finish()  # a script's main() called from one's own process (a notebook) gives the stop signals back
    assert signal.getsignal(signal.SIGTERM) == BEFORE_A_RUN["handler"] and lock_descriptors() != BEFORE_A_RUN["locks"]


def test_the_next_test_finds_the_process_as_it_was():
    if not BEFORE_A_RUN:
        pytest.skip("runs after the test above")
    assert signal.getsignal(signal.SIGTERM) == BEFORE_A_RUN["handler"] and lock_descriptors() == BEFORE_A_RUN["locks"]


def test_check_args_refuses_what_the_resume_would(tmp_path, run_in_process):
    """--check-args (what slurm.sbatch runs before srun, where a refusal would be restarted) and the run refuse a
    checkpoint folder alike, in the same line: a changed recipe, a checkpoint a fresh run would overwrite, a folder
    given as --resume's file, one that another run holds. The matching resume passes."""
    ck = tmp_path / "ck"
    recipe = [*SMALL, "--no-nesterov"]

    def refused_alike(argv, fragment):
        lines = [assert_refused(run_in_process("distributed.py", [*recipe, *argv, *check]), fragment)
                 for check in (["--check-args"], [])]
        assert lines[0] == lines[1]

    expect_ok(run_in_process("distributed.py", [*recipe, "--max-steps", "2", "--checkpoint-dir", ck]))
    resume = ["--checkpoint-dir", ck, "--resume"]
    refused_alike([*resume, "--epochs", "2"], "written with --epochs 1, this run has --epochs 2")
    refused_alike([*resume, "--nesterov"], "written with --no-nesterov, this run has --nesterov")
    refused_alike(["--checkpoint-dir", ck], "already holds a checkpoint: add --resume")
    refused_alike(["--resume", ck], f"no checkpoint at {ck}: a folder; name its file, {ck / 'checkpoint.pt'}")
    check = [*recipe, *resume, "--check-args"]
    assert "arguments OK" in expect_ok(run_in_process("distributed.py", check))
    # The lock's holders are other processes, as another node's check and another run are: this process's own
    # locks would not stop it. Another node's check tests the lock at the same moment (a shared lock, for an
    # instant): both pass. A run holding it (an exclusive lock) is refused.
    for holder, passes in (("f = open(sys.argv[1] + '/.lock'); fcntl.lockf(f, fcntl.LOCK_SH)", True),
                           ("from utils import checkpoint; checkpoint.lock_directory(sys.argv[1])", False)):
        held = subprocess.Popen([sys.executable, "-c", f"import fcntl, sys, time; {holder}; print('held', flush=True); "
                                 "time.sleep(120)", str(ck)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert held.stdout.readline() == "held\n"
            if passes:
                assert "arguments OK" in expect_ok(run_in_process("distributed.py", check))
            else:
                refused_alike(resume, f"--checkpoint-dir {ck} is in use by another")
        finally:
            held.kill()
            held.wait()
    assert checkpoint.load(str(ck / "checkpoint.pt"))["global_step"] == 2  # refused, never overwritten


@pytest.mark.parametrize("saved_in, loaded_in", [(torch.channels_last, torch.contiguous_format),
                                                  (torch.contiguous_format, torch.channels_last)])
def test_a_momentum_saved_in_another_layout_is_loaded_in_its_parameters(saved_in, loaded_in):
    """distributed_mp.py on a recent NVIDIA GPU trains in channels_last, dataparallel.py in NCHW, and a flag or
    another GPU changes it: optimizer.load_state_dict keeps a buffer's saved strides, which CUDA's fused SGD
    refuses beside a parameter of other strides (a traceback at the first step of the resume)."""
    from models import build_model
    models, optimizers = [], []
    for layout in (saved_in, loaded_in):
        torch.manual_seed(0)
        models.append(build_model("resnet_tiny", 10).to(memory_format=layout))
        optimizers.append(torch.optim.SGD(models[-1].parameters(), lr=0.1, momentum=0.9))
    images = torch.randn(4, 3, 32, 32).contiguous(memory_format=saved_in)
    torch.nn.functional.cross_entropy(models[0](images), torch.arange(4)).backward()
    optimizers[0].step()
    state = checkpoint.WholeState(models[0], optimizers[0]).save(1, "")
    checkpoint.WholeState(models[1], optimizers[1]).load(state, "")
    for saved, loaded in zip(models[0].parameters(), models[1].parameters()):
        momentum, expected = (optimizers[1].state[loaded]["momentum_buffer"],
                              optimizers[0].state[saved]["momentum_buffer"])
        assert momentum.stride() == loaded.stride() and torch.equal(momentum, expected)


def test_rng_state_round_trip():
    checkpoint.set_rng_state(checkpoint.rng_state())  # exercises the numpy/python conversions
    saved = checkpoint.rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()
    checkpoint.set_rng_state(saved)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0])
    assert np.array_equal(expected[1], again[1]) and expected[2] == again[2]


def test_script_with_a_corrupt_checkpoint_is_one_line(tmp_path, run_in_process):
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(b"PK\x03\x04 not really a zip archive" + os.urandom(512))
    line = assert_refused(run_in_process("distributed.py", [*SMALL, "--resume", bad]))
    assert str(bad) in line and "checkpoint" in line
    assert bad.stat().st_size > 512  # left as it was


def test_resume_from_a_file_without_a_checkpoint_dir_says_that_nothing_will_be_saved(tmp_path, run_in_process):
    assert run_in_process("distributed.py", [*SMALL, "--max-steps", "2", "--checkpoint-dir", tmp_path / "a"])[0] == 0
    code, out, err = run_in_process("distributed.py", [*SMALL, "--resume", tmp_path / "a" / "checkpoint.pt"])
    assert code == 0, err
    assert f"--resume {tmp_path / 'a' / 'checkpoint.pt'} without --checkpoint-dir: this run saves no checkpoint" in out


def test_a_stop_without_a_checkpoint_dir_does_not_say_continue_with_resume(capsys):
    from utils.run import StopSignal
    stop = StopSignal(distributed=False)
    try:
        stop.received = "SIGTERM"
        stop.announce(7, None)
    finally:
        stop.close()
    out = capsys.readouterr().out
    assert "stopping at step 7 on SIGTERM: no --checkpoint-dir, nothing saved; this run cannot be continued" in out
    assert "--resume" not in out


# Every checkpoint write, by step, on stdout; then the script named first among the arguments (conftest).
COUNT_SAVES = """
from utils import checkpoint
atomic_save = checkpoint.atomic_save
def counted(state, path):
    print("saved step", state["global_step"], flush=True)
    atomic_save(state, path)
checkpoint.atomic_save = counted
"""


@pytest.mark.parametrize("how", ["--max-steps", "a stop signal"])
def test_a_step_is_checkpointed_once(tmp_path, how):
    """--checkpoint-every 2 meets the run's end at step 4 (--max-steps 4, or SIGTERM at step 4): one write
    of step 4, not the periodic one and then the end's (a second full write inside a launcher's grace)."""
    entry = observing_entry(tmp_path, COUNT_SAVES)
    end = (["--max-steps", "4"] if how == "--max-steps" else
           [FAULTS, "--fault", "sigterm-self", "--step", "4", "--"])
    script = ["distributed.py", *SMALL, "--checkpoint-every", "2", "--checkpoint-dir", tmp_path / "ckpt"]
    argv = [*script, *end] if how == "--max-steps" else [*end, *script]
    out = run_script([entry, *argv]).stdout
    assert [line for line in out.splitlines() if line.startswith("saved step")] == ["saved step 2", "saved step 4"], out
    assert checkpoint.load(tmp_path / "ckpt" / "checkpoint.pt")["global_step"] == 4
