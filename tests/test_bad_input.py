"""What can be checked before training is checked before training: one line on stderr,
exit status 2, no traceback, no epoch trained, nothing already saved lost. Also the files
read from --data-dir are data, never code."""
import os
import pickle
import subprocess
import time

import pytest
import torch

from cifar_files import write_cifar100
from conftest import (ROOT, SMALL, assert_one_line_error, assert_refused, cli_args, expect_ok, make_run,
                      one_cpu_process, run_script, small_args, subprocess_env, take_one_step, torchrun)
from models import MODEL_NAMES
from utils import checkpoint, cli, data, lifecycle

import numpy as np


# --- flags -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["--lr", "inf"], "--lr: expected a finite number"),
    (["--lr", "nan"], "--lr: expected a finite number"),
    (["--warmup-epochs", "inf"], "--warmup-epochs: expected a finite number"),
    (["--momentum", "nan"], "--momentum: expected a finite number"),
    (["--lr", "1e300"], "--lr: expected a finite number of float32's range"),  # else SGD's step fails
    (["--seed", "-1"], "--seed: must be in 0 .. 2**64-1"),
    (["--seed", str(2**64)], "--seed: must be in 0 .. 2**64-1"),
    (["--checkpoint-dir", ""], "--checkpoint-dir is empty"),
    (["--metrics", ""], "--metrics is empty: name a file"),  # --metrics "$UNSET": no record, and status 0
    (["--profile", " "], "--profile is empty: name a directory"),
    (["--tensorboard", ""], "--tensorboard is empty: name a directory"),
    (["--resume", "", "--checkpoint-dir", "x"], "--resume is empty"),
])
def test_bad_flag_values_are_one_line(capsys, argv, fragment):
    with pytest.raises(SystemExit) as excinfo:
        lifecycle.run_main(lambda flags: cli.parse_args(cli.build_parser("", MODEL_NAMES), flags), argv)
    assert excinfo.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines


def test_largest_seed_is_accepted_and_trains(run_in_process, tmp_path):
    # 2**64-1 reaches every seeded generator of a real run: the weights', the augmentation plan's
    # (seed x 1,000,003 + epoch, kept to 63 bits) and the sampler's (seed + epoch, which wraps to 0 in
    # the second epoch). Two epochs of one step each: both epochs' generators are seeded.
    seed = 2**64 - 1
    argv = [*SMALL, "--seed", seed, "--checkpoint-dir", tmp_path / "ck"]
    argv[argv.index("--train-samples") + 1] = argv[argv.index("--batch-size") + 1]  # one step an epoch
    argv[argv.index("--epochs") + 1] = "2"
    expect_ok(run_in_process("distributed.py", argv))
    saved = torch.load(tmp_path / "ck" / "checkpoint.pt", weights_only=True)
    assert (saved["epoch"], saved["global_step"], saved["config"]["seed"]) == (1, 2, seed)


def test_compare_models_refuses_a_nan_tolerance(tmp_path):
    proc = run_script(["scripts/compare_models.py", tmp_path / "a.pt", tmp_path / "b.pt", "--atol", "nan"],
                      check=False, timeout=60)
    assert_one_line_error(proc, "--atol", "finite")


@pytest.mark.parametrize("env, fragment", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "do not fit together"),
])
def test_garbage_in_the_launchers_variables_is_one_line(run_in_process, env, fragment):
    assert_refused(run_in_process("distributed.py", SMALL, **env), fragment)


@pytest.mark.parametrize("addr, port", [("127.0.0.1", "70000"), ("127.0.0.1", "abc"), ("", "29500"), ("[::1]", "29500"),
                                        (" 127.0.0.1", "29500"), ("127.0.0.1", " 29500"),
                                        ("127.0.0.1", "\u0662\u0669\u0665\u0660\u0660")])  # Arabic-Indic digits
def test_a_meeting_point_that_torch_or_a_url_cannot_read_is_one_line(run_in_process, addr, port):
    # The first three: a ValueError in torch's rendezvous, a trace on rank 0. The next two: a host no resolver
    # reads. The last two: torch's int() reads them, urllib does not, in the URL the other ranks watch (rendezvous).
    assert_refused(run_in_process("distributed.py", SMALL, RANK=0, WORLD_SIZE=2, MASTER_ADDR=addr, MASTER_PORT=port),
                   f"MASTER_ADDR={addr!r}, MASTER_PORT={port!r} do not say where the ranks meet")


def test_a_rank_given_a_port_that_is_not_one_is_refused_at_once(run_in_process):
    # Rank 1 (its node's first: the values may be its node's own) says so too, and at once: not after waiting
    # --dist-timeout for a store at "127.0.0.1:abc".
    started = time.monotonic()
    outcome = run_in_process("distributed.py", [*SMALL, "--dist-timeout", "20"], RANK=1, WORLD_SIZE=2,
                             MASTER_ADDR="127.0.0.1", MASTER_PORT="abc")
    assert_refused(outcome, "MASTER_ADDR='127.0.0.1', MASTER_PORT='abc' do not say where the ranks meet")
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("addr", ["198.51.100.7", "nodea.invalid"])  # a documentation address (RFC 5737); no name
def test_rank_0_given_an_address_of_another_host_is_refused_at_once(run_in_process, addr):
    # Rank 0 serves the store there, and its own client found no one: a C++ trace at each try, then a line that
    # blamed a rank that did not come, --dist-timeout later.
    started = time.monotonic()
    outcome = run_in_process("distributed.py", [*SMALL, "--dist-timeout", "20"], RANK=0, WORLD_SIZE=2,
                             MASTER_ADDR=addr, MASTER_PORT="29500")
    assert_refused(outcome, f"MASTER_ADDR={addr} resolves to no address of this host, where rank 0 serves the ranks' "
                   "store: start rank 0 on the host it names, or give MASTER_ADDR this host's address")
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("env", [{"RANK": "x", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "-1"}])
def test_collectives_tour_bad_input_exits_2(env):
    proc = run_script(["scripts/collectives.py"], check=False, timeout=120, env=subprocess_env(**env))
    assert_one_line_error(proc, "environment variable")


# --- outputs that cannot be written: refused before the first step --------------------------

@pytest.mark.parametrize("flag, path", [
    ("--metrics", "a-file/m.jsonl"), ("--metrics", "a-folder"), ("--tensorboard", "a-file/sub/tb"),
    ("--profile", "a-file/trace"), ("--checkpoint-dir", "a-file"), ("--checkpoint-dir", "a-file/sub/ck"),
    ("--checkpoint-dir", "/proc/self/ck")])
def test_an_output_that_cannot_be_written_is_refused_before_training_and_by_check_args(run_in_process, tmp_path,
                                                                                     flag, path):
    """The run and --check-args (which makes nothing) refuse it in the same line, which names the file in the
    way (not the path under it), or the folder that cannot be written."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    target = tmp_path / path
    why = {"a-file": f"{tmp_path / 'a-file'} is a file, not a directory", "a-folder": "Is a directory",
           "/proc": "/proc/self is not writable"}[path.split("/")[0] or "/proc"]
    why = "it is a file, not a directory" if path == "a-file" else why  # the path itself
    lines = []
    for check in (["--check-args"], []):
        outcome = run_in_process("distributed.py", [*SMALL, flag, target, *check])
        lines.append(assert_refused(outcome, f"cannot write {flag} {target}: {why}"))
        assert "epoch 1" not in outcome[1]  # nothing trained
    assert lines[0] == lines[1]
    assert sorted(os.listdir(tmp_path)) == ["a-file", "a-folder"]  # nothing made


@pytest.mark.parametrize("flag", ["--tensorboard", "--profile"])
def test_an_unwritable_observer_folder_under_torchrun_is_one_line_and_exit_2(tmp_path, flag):
    # Made once the group has formed (rank 0 --tensorboard's, every rank its --profile's), so the ranks
    # agree on it: rank 0 refusing alone left rank 1 to fail in its next collective, with tracebacks.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = torchrun(2, "distributed.py", [*SMALL, flag, blocker / "out"], check=False, timeout=120)
    line = f"distributed.py: error: cannot write {flag} {blocker / 'out'}: {blocker} is a file, not a directory"
    lines = [text for text in proc.stderr.splitlines() if text.strip()]
    assert lines[0] == line and sum(text == line for text in lines) == 1, proc.stderr  # one node: said once
    # torchrun's summary names a refusal (2), and no rank failed otherwise (1: a peer lost mid-collective).
    assert "exitcode  : 2" in proc.stderr and "exitcode  : 1" not in proc.stderr, proc.stderr
    assert "Connection closed" not in proc.stderr, proc.stderr
    assert "epoch 1" not in proc.stdout


def test_unwritable_checkpoint_dir_is_refused_before_training(run_in_process, tmp_path):
    target = tmp_path / "ck"
    target.mkdir()
    if os.geteuid() != 0:
        os.chmod(target, 0o500)
        assert_refused(run_in_process("distributed.py", [*SMALL, "--checkpoint-dir", target]), "is not writable")
        return
    # Root writes into a folder of mode 0500 anyway, not into a read-only file system.
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mount.stderr.strip()}")
    try:
        assert_refused(run_in_process("distributed.py", [*SMALL, "--checkpoint-dir", target]), "is not writable")
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_metrics_failure_after_an_epoch_keeps_its_checkpoint(tmp_path, monkeypatch):
    # Checkpoint first, then the record: an epoch whose record cannot be written is not lost.
    args = small_args("--checkpoint-dir", tmp_path / "ck", "--metrics", tmp_path / "m.jsonl")
    run, model, optimizer = make_run(args)
    take_one_step(run, model, optimizer)

    def broken(record):
        raise OSError("disk full")
    monkeypatch.setattr(run, "record", broken)
    with pytest.raises(OSError):
        run.end_epoch({"test_loss": 1.0, "test_acc1": 0.0, "test_acc5": 0.0, "test_samples": 1})
    assert checkpoint.load(tmp_path / "ck" / "checkpoint.pt")["global_step"] == 1


# --- checkpoints that do not fit ---------------------------------------------------------

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, run_in_process_once):
    directory = tmp_path_factory.mktemp("finished")
    expect_ok(run_in_process_once("distributed.py", [*SMALL, "--checkpoint-dir", directory]))
    return directory


@pytest.mark.parametrize("flag, value", [("--lr", "0.2"), ("--momentum", "0.8"), ("--weight-decay", "0.001")])
def test_changed_optimizer_flags_on_resume_are_refused(run_in_process, finished_run, flag, value):
    assert_refused(run_in_process("distributed.py", [*SMALL, "--checkpoint-dir", finished_run, "--resume", flag, value]),
                   f"was written with {flag}", f"{flag} {float(value)}", "resume with the same value")


def test_resume_on_a_training_set_of_another_size_is_refused(run_in_process, tmp_path):
    # Your own data that gained samples, no flag changed: 64 then 72 images are 4 steps of 16 either way,
    # but each epoch's order is a permutation of another size, so step 2 would name other samples.
    rng = np.random.default_rng(0)

    def write(n):
        write_cifar100(tmp_path, rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8), rng.integers(0, 100, n),
                       rng.integers(0, 256, (8, 3, 32, 32), dtype=np.uint8), rng.integers(0, 100, 8))
    argv = ["--dataset", "cifar100", "--data-dir", tmp_path, "--model", "resnet_tiny", "--workers", "0",
            "--epochs", "1", "--batch-size", "16", "--checkpoint-dir", tmp_path / "ck"]
    write(64)
    expect_ok(run_in_process("distributed.py", [*argv, "--max-steps", "2"]))
    saved = (tmp_path / "ck" / "checkpoint.pt").read_bytes()
    write(72)
    assert_refused(run_in_process("distributed.py", [*argv, "--resume"]),
                   "was trained on 64 training samples, this run has 72", "resume with the same data")
    assert (tmp_path / "ck" / "checkpoint.pt").read_bytes() == saved
    write(64)  # 64 samples again (the size is what is checked, not the pixels): it resumes
    output = expect_ok(run_in_process("distributed.py", [*argv, "--resume", "--max-steps", "2"]))
    assert "epoch 1, step 2 of 4 in it" in output  # and it stands where --max-steps stopped, in its first epoch
    assert "nothing to train: the run already stands at epoch 1 of 1, step 2" in output, output


def test_resume_through_a_symbolic_link_is_the_same_checkpoint(run_in_process, finished_run, tmp_path):
    link = tmp_path / "latest.pt"
    link.symlink_to(finished_run / "checkpoint.pt")
    code, out, err = run_in_process("distributed.py", [*SMALL, "--checkpoint-dir", finished_run, "--resume", link])
    assert code in (0, None) and "nothing to train" in out, out + err


def test_checkpoint_without_the_keys_a_run_needs_is_one_line(run_in_process, finished_run, tmp_path):
    state = checkpoint.load(finished_run / "checkpoint.pt")
    del state["rng"], state["train_sums"]
    checkpoint.atomic_save(state, str(tmp_path / "partial.pt"))
    for check in ([], ["--check-args"]):  # the same line from the check that a batch script runs first
        assert_refused(run_in_process("distributed.py", [*SMALL, "--resume", tmp_path / "partial.pt", *check]),
                       "lacks train_sums, rng")


# --- data files are data --------------------------------------------------------------------

class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_cifar_file_is_refused_and_runs_nothing(run_in_process, tmp_path):
    rng = np.random.default_rng(0)
    write_cifar100(tmp_path, rng.integers(0, 256, (8, 3, 32, 32), dtype=np.uint8), rng.integers(0, 100, 8),
                   rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8), rng.integers(0, 100, 4))
    marker = tmp_path / "pwned"
    train = tmp_path / "cifar-100-python" / "train"
    with open(train, "wb") as f:
        pickle.dump({"data": _Payload(marker)}, f, protocol=2)
    outcome = run_in_process("distributed.py", ["--dataset", "cifar100", "--data-dir", tmp_path, "--model",
                                                "resnet_tiny", "--workers", "0", "--epochs", "1", "--batch-size", "4"])
    assert_refused(outcome, f"cannot read CIFAR-100 file {train}", "posix.system")
    assert not marker.exists()


def test_cifar100_without_torchvision_says_so(tmp_path):
    """torchvision is optional for the template's copy, but reads CIFAR-100: without it, the line says to
    install it, not that the files (there) are missing."""
    rng = np.random.default_rng(3)
    write_cifar100(tmp_path, rng.integers(0, 256, (6, 3, 32, 32), dtype=np.uint8), rng.integers(0, 100, 6),
                   rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8), rng.integers(0, 100, 3))
    hidden = tmp_path / "hidden" / "torchvision"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named torchvision (hidden by the test)')\n")
    proc = run_script(["distributed.py", "--dataset", "cifar100", "--data-dir", tmp_path, "--model", "resnet_tiny",
                       "--workers", "0", "--epochs", "1", "--batch-size", "4"], check=False,
                      env=subprocess_env(PYTHONPATH=f"{hidden.parent}:{ROOT}"))
    assert_one_line_error(proc, "--dataset cifar100 needs torchvision (ImportError: No module named torchvision",
                          "pip install torchvision, or use --dataset synthetic")


def test_a_re_pickled_subset_with_plain_types_still_loads(tmp_path):
    # Protocol 4 and protocol 2 (bytes through _codecs.encode) copies, as people make them.
    rng = np.random.default_rng(1)
    write_cifar100(tmp_path, rng.integers(0, 256, (6, 3, 32, 32), dtype=np.uint8), rng.integers(0, 100, 6),
                   rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8), rng.integers(0, 100, 3))
    folder = tmp_path / "cifar-100-python"
    for name, protocol in (("train", 4), ("test", 2)):
        with open(folder / name, "rb") as f:
            entry = pickle.load(f, encoding="bytes")
        entry = {k.decode(): v for k, v in entry.items()}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=protocol)
    train, test = data.build_datasets(cli_args("--dataset", "cifar100", "--data-dir", tmp_path), one_cpu_process())
    assert (len(train), len(test)) == (6, 3)


def test_more_samples_than_the_data_set_has_is_one_line(tmp_path):
    rng = np.random.default_rng(2)
    write_cifar100(tmp_path, rng.integers(0, 256, (6, 3, 32, 32), dtype=np.uint8), rng.integers(0, 100, 6),
                   rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8), rng.integers(0, 100, 3))
    with pytest.raises(cli.UsageError, match="--train-samples 7 is more than the 6 samples"):
        data.build_datasets(cli_args("--dataset", "cifar100", "--data-dir", tmp_path, "--train-samples", "7"),
                            one_cpu_process())


# --- --check-args reads the launcher's variables as README says -------------------------------

def test_check_args_takes_the_world_size_alone_and_says_what_it_read(run_in_process):
    """A batch script sets WORLD_SIZE and LOCAL_WORLD_SIZE and asks --check-args: it checks as
    rank 0 of that job (RANK may be left out), and says which variables it read."""
    code, out, err = run_in_process("distributed.py", [*SMALL, "--batch-size", "63", "--check-args"],
                                    WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
    assert code == 2 and "batch size 63 is not divisible by 2 processes" in err, err
    code, out, err = run_in_process("distributed.py", [*SMALL, "--batch-size", "64", "--check-args"],
                                    WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
    assert code == 0, err
    assert out.strip() == "arguments OK for 2 processes (WORLD_SIZE=2 LOCAL_WORLD_SIZE=2)", out


def test_a_run_refuses_what_a_launcher_would_not_set_alone(run_in_process):
    # WORLD_SIZE without RANK: one of the launcher's variables is missing, not a job of one.
    code, out, err = run_in_process("distributed.py", SMALL, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
    assert code == 2 and "WORLD_SIZE=2 without RANK: a launcher (torchrun) sets both" in err, err
