"""distributed_fsdp.py: the same training as distributed.py with the model sharded (FSDP2),
and sharded checkpoints that resume exactly and load at another world size.

Equivalence to DDP. The same global batch and seed train the same problem: each rank
computes the gradient of its half of the batch on the same (gathered) weights, and the
halves are averaged, by DDP with an all-reduce, by FSDP with a reduce-scatter. Measured
on this CPU (gloo, 2 processes, 16 steps of 32 images): weights, batch-norm buffers and
momentum are bitwise equal (a sum of two values does not depend on its order; on NCCL
with more ranks the order may differ, hence a tolerance). With --clip-grad-norm the
global norm is summed over shards in another order than over DDP's whole tensors, 1-2
float32 ulps apart, and this small problem amplifies such a seed from its 15th step (DDP
against DDP with --clip-grad-norm 1.0000001 differs by 9.6e-4 at step 16): clipping is
tested with FSDP alone, 3 steps at 2 processes resumed at 1 against 8 steps at 1 (group
norm), where the states differ by 4.9e-7.
Anything really different (gradients summed rather than averaged, rank 1's batch-norm
statistics in the checkpoint, a norm of the local shard only) is 1e-4 or more.
"""
import enum
import os
import pathlib
import pickle
import re
import shutil
import signal

import pytest
import torch

from conftest import (FAULTS, ROOT, SMALL, assert_refused, expect_ok, fake_accelerator, group_norm,
                      max_difference, on_rank_1, read_metrics, run_script, torchrun)
from scripts import compare_models, memory_table
from utils import checkpoint, sharded
from utils.cli import UsageError

# One process: 8 steps of 32 images, no loader workers (bitwise against distributed.py).
ONE = [*SMALL, "--test-samples", "129", "--checkpoint-every", "2"]
# Two processes: 16 steps, so that the stop-signal agreement (every 10 steps) comes in the
# epoch; 129 test images, so that rank 0 has one evaluation batch more than rank 1 (its
# shard is 65 images, 3 batches of 32; rank 1's 64, 2 batches); the default --workers.
TWO = ["--dataset", "synthetic", "--model", "resnet_tiny", "--train-samples", "512", "--test-samples", "129",
       "--batch-size", "32", "--epochs", "1", "--dist-timeout", "120"]
TOLERANCE = 1e-6  # measured: 0 (4.9e-7 with --clip-grad-norm at another world size)


def shards(directory) -> pathlib.Path:
    """The shards' folder that DIRECTORY/checkpoint.pt names (sharded-step<N>-<the run's token>)."""
    return pathlib.Path(directory) / checkpoint.load(str(pathlib.Path(directory) / "checkpoint.pt"))["sharded"]["folder"]


def training_state(path) -> dict:
    """What a resumed run must have reproduced: whole weights and buffers, optimizer,
    scheduler, the epoch's training sums (plain or sharded checkpoints alike)."""
    state = compare_models.load_full(str(path))
    return {"model": state["model"], "optimizer": state["optimizer"], "scheduler": state["scheduler"],
            "step": state["global_step"], "sums": torch.tensor(state["train_sums"])}


# --- runs to compare with ---------------------------------------------------------------

@pytest.fixture(scope="module")
def one_process(tmp_path_factory, run_in_process_once):
    """distributed.py and distributed_fsdp.py, one process each as under plain python (their
    main() in this process)."""
    root = tmp_path_factory.mktemp("one")
    for script in ("distributed.py", "distributed_fsdp.py"):
        expect_ok(run_in_process_once(script, [*ONE, "--checkpoint-dir", root / script]))
    return root


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """distributed.py and distributed_fsdp.py, 2 processes each under torchrun, start to end."""
    root = tmp_path_factory.mktemp("two")
    for script in ("distributed.py", "distributed_fsdp.py"):
        torchrun(2, script, [*TWO, "--checkpoint-dir", root / script, "--metrics", root / f"{script}.jsonl"],
                 env=None)
    return root


# --- equivalence ------------------------------------------------------------------------

def test_one_process_is_bitwise_distributed_py(one_process):
    ddp = training_state(one_process / "distributed.py" / "checkpoint.pt")
    fsdp = training_state(one_process / "distributed_fsdp.py" / "checkpoint.pt")
    assert fsdp["step"] == ddp["step"] == 8
    assert max_difference(fsdp, ddp) == 0.0


def test_two_processes_match_ddp(two_processes):
    ddp = training_state(two_processes / "distributed.py" / "checkpoint.pt")
    fsdp = training_state(two_processes / "distributed_fsdp.py" / "checkpoint.pt")
    assert fsdp["step"] == ddp["step"] == 16
    # The whole weights gathered from the shards; the batch-norm buffers are rank 0's, as in
    # DDP's checkpoint (rank 1's differ from them by 1e-3 and more); momentum per parameter.
    assert max_difference(fsdp, ddp) <= TOLERANCE
    # Not vacuous: the steps moved the weights far more than the tolerance (momentum: the recent gradients).
    momentum = [state["momentum_buffer"] for state in fsdp["optimizer"]["state"].values()]
    assert len(momentum) == len(fsdp["optimizer"]["param_groups"][0]["params"])
    assert max(buffer.abs().max().item() for buffer in momentum) > 1e3 * TOLERANCE


def test_evaluation_is_exact_with_uneven_shards(two_processes):
    ddp = read_metrics(two_processes / "distributed.py.jsonl")[-1]
    fsdp = read_metrics(two_processes / "distributed_fsdp.py.jsonl")[-1]
    # Every test image once (the padding batch of rank 1 counted nowhere), and the same
    # loss and accuracy as DDP's evaluation of the same weights.
    assert fsdp["test_samples"] == ddp["test_samples"] == 129
    assert fsdp["test_loss"] == pytest.approx(ddp["test_loss"], abs=1e-5)
    assert (fsdp["test_acc1"], fsdp["test_acc5"]) == (ddp["test_acc1"], ddp["test_acc5"])
    assert (fsdp["strategy"], fsdp["world_size"], fsdp["global_batch"]) == ("fsdp2", 2, 32)
    assert fsdp["train_loss"] == pytest.approx(ddp["train_loss"], abs=1e-5)


def test_bf16_and_zero2_train(run_in_process, tmp_path):
    # --mp-policy bf16 computes in bfloat16 (batch norm in fp32) and keeps fp32 weights;
    # --no-reshard-after-forward keeps the gathered parameters from forward to backward.
    for directory, flags in (("bf16", ["--mp-policy", "bf16", "--no-reshard-after-forward"]), ("fp32", [])):
        code, out, err = run_in_process("distributed_fsdp.py", [*SMALL, "--max-steps", "2", *flags,
                                                                "--checkpoint-dir", tmp_path / directory,
                                                                "--metrics", tmp_path / f"{directory}.jsonl"])
        assert code in (0, None), err
    # The records say which run is which.
    assert [(r["mp_policy"], r["reshard_after_forward"]) for r in read_metrics(tmp_path / "bf16.jsonl")] == [
        ("bf16", False)] * 2
    assert read_metrics(tmp_path / "fp32.jsonl")[-1]["mp_policy"] == "none"
    bf16 = compare_models.load_full(str(tmp_path / "bf16" / "checkpoint.pt"))["model"]
    fp32 = compare_models.load_full(str(tmp_path / "fp32" / "checkpoint.pt"))["model"]
    assert bf16["fc.weight"].dtype == torch.float32
    # The same training, rounded differently: close, but not the same numbers.
    assert 1e-6 < max_difference(bf16, fp32) < 0.1


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["zero3", "zero2"])
def test_bf16_policy_is_bf16_layers_around_fp32_batch_norm(reshard_after_forward, tmp_path):
    # What --mp-policy bf16 computes, against the same model written out by hand: every
    # convolution and the classifier in bf16, every batch norm with fp32 weights and fp32
    # statistics on the bf16 activations. Bitwise, outputs and gradients, in one process (a
    # group of one: a reduce-scatter over one rank is a copy). Catches a batch norm left in
    # bf16, a layer left in fp32, and a batch-norm gradient reduced before backward had
    # finished it (all batch norms are one unit, reduced once, after the first layer's).
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F

    import distributed_fsdp
    from models import build_model
    from utils.distributed import DistEnv

    torch.manual_seed(0)
    model = build_model("resnet_tiny", 10)
    by_hand = copy.deepcopy(model)
    for module in by_hand.modules():  # the layers (.to() of a container would reach batch norm too)
        if not list(module.children()) and not isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.to(torch.bfloat16)
    assert {p.dtype for m in by_hand.modules() if isinstance(m, torch.nn.BatchNorm2d)
            for p in [*m.parameters(), *m.buffers()] if p.is_floating_point()} == {torch.float32}
    images, targets = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                      distributed=True)
        distributed_fsdp.shard(model, env, reshard_after_forward, "bf16")
        # One unit for all of them (one each made the step wait on the host, see shard()).
        batch_norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        assert len({id(m._get_fsdp_state()) for m in batch_norms}) == 1 < len(batch_norms)
        for step in range(2):  # the second step: after FSDP's first-step setup
            for net in (model, by_hand):
                net.zero_grad(set_to_none=True)
            logits = model(images)
            F.cross_entropy(logits.float(), targets).backward()
            expected = by_hand(images.bfloat16())
            F.cross_entropy(expected.float(), targets).backward()
            assert logits.dtype == expected.dtype == torch.bfloat16
            assert torch.equal(logits, expected), step
            hand = dict(by_hand.named_parameters())
            for name, param in model.named_parameters():
                assert param.dtype == torch.float32, name  # the sharded weights stay fp32
                assert torch.equal(param.grad.full_tensor(), hand[name].grad.float()), (step, name)
            for (name, buffer), other in zip(model.named_buffers(), by_hand.buffers()):
                assert torch.equal(buffer, other), (step, name)
    finally:
        dist.destroy_process_group()


# --- sharded checkpoints ------------------------------------------------------------------

def test_sigterm_to_every_process_stops_and_resumes_bitwise(two_processes, tmp_path):
    # A preemption: SIGTERM to torchrun's agent, both workers and their loader workers. The
    # ranks agree on step 10, each writes its shards, rank 0 commits checkpoint.pt.
    stopped = torchrun(2, FAULTS, ["--fault", "signal-job", "--send", "TERM", "--rank", "0", "--step", "3", "--",
                                   "distributed_fsdp.py", *TWO, "--checkpoint-dir", tmp_path],
                       check=False, env=None)
    output = stopped.stdout + stopped.stderr
    assert "stopping at step 10 on SIGTERM" in output, output
    assert "DataLoader worker" not in output, output
    saved = checkpoint.load(str(tmp_path / "checkpoint.pt"))
    assert saved["global_step"] == 10 and shards(tmp_path).name.startswith("sharded-step10-")
    # Every rank wrote its part; the previous folder is gone: one checkpoint in the directory.
    assert sorted(p.name for p in shards(tmp_path).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert list(tmp_path.glob("sharded-step*")) == [shards(tmp_path)]

    resumed = torchrun(2, "distributed_fsdp.py", [*TWO, "--checkpoint-dir", tmp_path, "--resume"])
    assert "resumed from" in resumed.stdout and "epoch 1, step 10 of 16 in it, 10 steps in all" in resumed.stdout
    reference = training_state(two_processes / "distributed_fsdp.py" / "checkpoint.pt")
    assert max_difference(training_state(tmp_path / "checkpoint.pt"), reference) == 0.0


GROUP_NORM_RUNNER = """
import runpy, sys
sys.path.insert(0, {root!r})
import models, torch
build = models.build_model
models.build_model = lambda name, classes: build(name, classes, norm_layer=lambda c: torch.nn.GroupNorm(min(32, c), c))
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def test_resume_at_another_world_size(tmp_path, run_in_process, monkeypatch):
    # Stopped at 2 processes, resumed at 1. Batch norm would make the two differ by design
    # (its statistics are per process), so the model uses group norm here: then 1 and 2
    # processes train the same problem and only the order of sums differs.
    runner = tmp_path / "group_norm.py"
    runner.write_text(GROUP_NORM_RUNNER.format(root=str(ROOT), script=str(ROOT / "distributed_fsdp.py")))
    # --clip-grad-norm: the norm over both shards (at 2 processes) is the norm of the whole
    # tensors (at 1); a norm of the local shard alone would differ by far more than TOLERANCE.
    flags = [*TWO, "--workers", "0", "--train-samples", "256", "--clip-grad-norm", "1"]  # 8 steps
    # The run to compare with: one process, start to end, its main() in this process (the same
    # problem as at 2 processes, as above).
    import distributed_fsdp
    import models
    monkeypatch.setattr(distributed_fsdp, "build_model",
                        lambda name, classes: models.build_model(name, classes, norm_layer=group_norm))
    expect_ok(run_in_process("distributed_fsdp.py", [*flags, "--checkpoint-dir", tmp_path / "straight"]))
    torchrun(2, runner, [*flags, "--max-steps", "3", "--checkpoint-dir", tmp_path / "moved"])
    assert checkpoint.load(str(tmp_path / "moved" / "checkpoint.pt"))["world_size"] == 2
    resumed = run_script([runner, *flags, "--checkpoint-dir", tmp_path / "moved", "--resume"])
    assert "epoch 1, step 3 of 8 in it, 3 steps in all" in resumed.stdout, resumed.stdout
    moved = training_state(tmp_path / "moved" / "checkpoint.pt")
    straight = training_state(tmp_path / "straight" / "checkpoint.pt")
    assert checkpoint.load(str(tmp_path / "moved" / "checkpoint.pt"))["world_size"] == 1
    assert moved["step"] == straight["step"] == 8
    # The training sums (loss x images, about 1200) carry the fp32 rounding of each loss.
    assert torch.allclose(moved.pop("sums"), straight.pop("sums"), rtol=1e-6, atol=0)
    worst = max_difference(moved, straight)
    print(f"largest difference {worst:.3g}")  # measured 4.9e-7 (PyTorch 2.11 and 2.14, CPU)
    assert worst <= TOLERANCE


def test_crash_during_a_sharded_save_keeps_the_previous_checkpoint(one_process, tmp_path, run_in_process):
    # Killed while rank 0 commits its second save (step 4): the shards of step 4 are on disk,
    # checkpoint.pt still names those of step 2, which are whole.
    crashed = run_script([FAULTS, "--fault", "kill-during-save", "--save", "2", "--",
                          "distributed_fsdp.py", *ONE, "--checkpoint-dir", tmp_path], check=False)
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    assert shards(tmp_path).name.startswith("sharded-step2-") and (shards(tmp_path) / ".metadata").exists()
    assert len(list(tmp_path.glob("sharded-step4-*"))) == 1
    resumed = expect_ok(run_in_process("distributed_fsdp.py", [*ONE, "--checkpoint-dir", tmp_path, "--resume"]))
    assert "step 2 of 8 in it, 2 steps in all" in resumed, resumed
    # The orphaned shards are removed, and the run ends where the uninterrupted one did.
    assert list(tmp_path.glob("sharded-step*")) == [shards(tmp_path)]
    assert shards(tmp_path).name.startswith("sharded-step8-")
    reference = training_state(one_process / "distributed_fsdp.py" / "checkpoint.pt")
    assert max_difference(training_state(tmp_path / "checkpoint.pt"), reference) == 0.0


def test_checkpoints_refuse_what_does_not_fit(run_in_process, one_process, tmp_path):
    fsdp_checkpoint = one_process / "distributed_fsdp.py" / "checkpoint.pt"
    # DDP cannot continue a sharded checkpoint, nor FSDP a plain one: one line, exit 2, from --check-args too.
    for check in ([], ["--check-args"]):
        assert_refused(run_in_process("distributed.py", [*SMALL, "--resume", fsdp_checkpoint, *check]),
                       f"{fsdp_checkpoint} is sharded", "resume it with the script that wrote it (fsdp2)")
        ddp_checkpoint = one_process / "distributed.py" / "checkpoint.pt"
        assert_refused(run_in_process("distributed_fsdp.py", [*SMALL, "--resume", ddp_checkpoint, *check]),
                       f"{ddp_checkpoint} is not sharded", "resume it with the script that wrote it (ddp-torchrun)")
    expect_ok(run_in_process("distributed_fsdp.py", [*SMALL, "--resume", fsdp_checkpoint, "--check-args"]))
    # Flags that would change the run are refused as for the other scripts.
    assert_refused(run_in_process("distributed_fsdp.py", [*SMALL, "--lr", "0.2", "--resume", fsdp_checkpoint]),
                   "--lr 0.1", "resume with the same value")
    # A shard folder whose save never finished (no metadata) is not read, and --check-args says so too.
    copy = tmp_path / "copy"
    shutil.copytree(fsdp_checkpoint.parent, copy)
    os.unlink(shards(copy) / ".metadata")
    with pytest.raises(Exception, match="is missing"):
        compare_models.load_full(str(copy / "checkpoint.pt"))
    for check in ([], ["--check-args"]):
        assert_refused(run_in_process("distributed_fsdp.py", [*SMALL, "--resume", copy / "checkpoint.pt", *check]),
                       f"no sharded checkpoint at {shards(copy)} (its .metadata is missing")


def test_a_resume_that_fails_in_dcp_names_the_cause(run_in_process, one_process, tmp_path, monkeypatch):
    # DCP's own failure (CheckpointException) says only which ranks failed: the line gives each
    # one's error, and tells a shard file that cannot be read from a model that does not fit.
    saved = one_process / "distributed_fsdp.py"
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    os.truncate(shards(copy) / "__0_0.distcp", 1000)
    line = assert_refused(run_in_process("distributed_fsdp.py", [*SMALL, "--resume", copy / "checkpoint.pt"]),
                          f"cannot read sharded checkpoint {shards(copy)}: rank 0: RuntimeError: ")
    assert "CheckpointException" not in line  # the reader's own error (a zip archive cut short here)
    import distributed_fsdp
    import models
    monkeypatch.setattr(distributed_fsdp, "build_model", lambda name, classes: models.build_model(name, classes + 1))
    line = assert_refused(run_in_process("distributed_fsdp.py", [*SMALL, "--resume", saved / "checkpoint.pt"]),
                          "does not fit this model/optimizer: rank 0: ValueError: Size mismatch")
    assert "fc.weight" in line


def test_checkpoints_kept_under_other_names_keep_their_shards(run_in_process, tmp_path):
    # Copies kept beside checkpoint.pt, whatever their names, keep the folders they name: through the
    # saves of a resumed run (each replaces checkpoint.pt's folder) and the start of a new run in the
    # folder (which clears the folders that no checkpoint names); and a new run never writes into one.
    run = tmp_path / "run"

    def train(steps, *flags):
        expect_ok(run_in_process("distributed_fsdp.py", [*ONE, "--max-steps", str(steps), "--checkpoint-dir", run,
                                                         *flags]))
    train(2)
    shutil.copy(run / "checkpoint.pt", run / "checkpoint.pt.bak")
    train(4, "--resume")
    os.rename(run / "checkpoint.pt", run / "run1.ckpt")
    kept = {name: compare_models.load_full(str(run / name)) for name in ("checkpoint.pt.bak", "run1.ckpt")}
    train(4, "--seed", "7")  # another run, through the same steps
    for name, step in (("checkpoint.pt.bak", 2), ("run1.ckpt", 4)):
        state = compare_models.load_full(str(run / name))
        assert state["global_step"] == step and max_difference(state, kept[name]) == 0.0, name
    new = compare_models.load_full(str(run / "checkpoint.pt"))
    assert max_difference(new["model"], kept["run1.ckpt"]["model"]) > 1e-3  # another run indeed
    assert len(list(run.glob("sharded-step*"))) == 3
    # Resumed from in the run's own folder under another name (nothing left to train): its folder stays.
    os.unlink(run / "checkpoint.pt")
    train(4, "--resume", run / "run1.ckpt")
    assert max_difference(compare_models.load_full(str(run / "run1.ckpt")), kept["run1.ckpt"]) == 0.0


def test_a_checkpoint_names_a_folder_beside_it_only(one_process, tmp_path):
    # A crafted name would be read elsewhere, and deleted there once a save replaced it.
    state = checkpoint.load(str(one_process / "distributed_fsdp.py" / "checkpoint.pt"))
    for name in ("../elsewhere/sharded-step8", "/tmp/sharded-step8", "data"):
        state["sharded"]["folder"] = name
        torch.save(state, tmp_path / "crafted.pt")
        with pytest.raises(UsageError, match="not a folder beside it"):
            compare_models.load_full(str(tmp_path / "crafted.pt"))


def test_resume_through_a_symbolic_link(run_in_process, one_process, tmp_path):
    link = tmp_path / "latest.pt"
    link.symlink_to(one_process / "distributed_fsdp.py" / "checkpoint.pt")
    out = expect_ok(run_in_process("distributed_fsdp.py", [*SMALL, "--resume", link]))
    assert f"resumed from {link}: " in out and "8 steps in all" in out, out


def test_mps_is_refused_in_one_line(run_in_process, monkeypatch):
    # The group of one that a single process forms takes gloo for MPS, which moves no MPS tensor.
    # No MPS here: a stand-in machine, and --check-args, which runs the same check as the run.
    fake_accelerator(monkeypatch, "mps", 1)
    for launched in ({}, {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2,
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1}):
        assert_refused(run_in_process("distributed_fsdp.py", [*SMALL, "--check-args"], **launched),
                       "distributed_fsdp.py does not run on Apple's MPS devices", "use --device cpu")
        for key in launched:
            monkeypatch.delenv(key)
    assert "arguments OK" in expect_ok(run_in_process("distributed_fsdp.py", [*SMALL, "--device", "cpu",
                                                                              "--check-args"]))


def test_compile_is_not_offered(run_in_process):
    # inductor fails on the sharded model's backward: the flags are not offered at all.
    assert "--compile" not in expect_ok(run_in_process("distributed_fsdp.py", ["--help"]))
    for flags in (["--compile"], ["--compile-mode", "default"]):
        assert_refused(run_in_process("distributed_fsdp.py", [*SMALL, *flags]), f"unrecognized arguments: {flags[0]}")


def test_a_ctrl_c_inside_a_sharded_save_or_load_is_a_ctrl_c(run_in_process, one_process, tmp_path, monkeypatch):
    # DCP turns any BaseException of a rank into a CheckpointException on every rank. A Ctrl-C that
    # lands while DCP reads or writes (raised where a shard's bytes move) ends the run as any Ctrl-C
    # does, with status 130 and nothing more: not "does not fit" (a resume then refused, the
    # checkpoint looking broken), nor a failed save's traceback.
    import torch.distributed.checkpoint as dcp

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    saved = one_process / "distributed_fsdp.py" / "checkpoint.pt"
    with monkeypatch.context() as patch:
        patch.setattr(dcp.FileSystemReader, "read_data", ctrl_c)
        code, out, err = run_in_process("distributed_fsdp.py", [*ONE, "--resume", saved, "--checkpoint-dir",
                                                                tmp_path / "resumed"])
        assert code == 130 and "Traceback" not in err and "checkpoint" not in err, (code, err)
        with pytest.raises(KeyboardInterrupt):
            compare_models.load_full(str(saved))
    with monkeypatch.context() as patch:
        patch.setattr(dcp.FileSystemWriter, "write_data", ctrl_c)
        code, out, err = run_in_process("distributed_fsdp.py", [*ONE, "--checkpoint-dir", tmp_path / "saved"])
        assert code == 130 and "Traceback" not in err and "SaveFailed" not in err, (code, err)


def test_the_sharded_metadata_is_on_disk_before_the_save_returns(tmp_path, monkeypatch):
    # fsync makes a file's bytes durable. 2.11 fsyncs .metadata before it flushes Python's buffer,
    # which a small metadata (a small model's, under the buffer's size) has not left: after a power
    # loss it may come back empty, with checkpoint.pt naming its folder and the old one gone.
    # 2.14's DCP flushes first: only make test-floor (2.11) fails without sharded.py's own fsync.
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    synced, fsync = [], os.fsync

    def recording(fd):
        synced.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), os.fstat(fd).st_size))
        return fsync(fd)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        monkeypatch.setattr(os, "fsync", recording)
        sharded.save_sharded(model, optimizer, str(tmp_path / "shards"))
    finally:
        dist.destroy_process_group()
    size = (tmp_path / "shards" / ".metadata").stat().st_size
    assert 0 < size < 4096 and ((".metadata", size) in synced or (".metadata.tmp", size) in synced), synced


def test_a_failed_sharded_save_names_each_ranks_error(tmp_path):
    # Rank 1 may write files of 100 kB at most (a quota; Python ignores SIGXFSZ: the write fails
    # with EFBIG); its shards take 400 kB. No loader worker: their batches would hit it too.
    runner = on_rank_1(tmp_path, "distributed_fsdp.py",
                       "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))")
    proc = torchrun(2, runner, [*TWO, "--workers", "0", "--max-steps", "2", "--checkpoint-dir", tmp_path / "ck"],
                    check=False)
    output = proc.stdout + proc.stderr
    folder = re.escape(str(tmp_path / "ck" / "sharded-step2-")) + "[0-9a-f]{8}"
    line = rf"SaveFailed: the sharded checkpoint could not be written to {folder}: rank 1: OSError: \[Errno 27\] File too"
    assert proc.returncode == 1 and re.search(line, output), output
    # An ordinary exception: in torchrun's error file (its summary's root cause), not DCP's BaseException.
    root_cause = output.split("Root Cause (first observed failure):", 1)[1]
    assert "error_file: <N/A>" not in root_cause and "CheckpointException" not in output, output
    assert not (tmp_path / "ck" / "checkpoint.pt").exists()


def test_a_failure_on_many_ranks_is_still_one_short_line():
    import torch.distributed.checkpoint as dcp
    failures = {rank: (OSError(13, f"Permission denied: '/ck/__{rank}_0.distcp'"), None) for rank in range(64)}
    line = sharded.causes(dcp.CheckpointException("failed", failures))
    assert line.startswith("rank 0: PermissionError: [Errno 13] Permission denied: '/ck/__0_0.distcp'; rank 1: ")
    assert line.endswith("; and 61 more") and line.count("rank ") == 3 and "\n" not in line, line


class _EnumsByName(pickle.Pickler):
    """Pickles an Enum member as early Python 3.11 releases do (Debian 12's 3.11.2 among them):
    getattr(its class, its name). Later ones, and 3.10, pickle it by value."""

    def reducer_override(self, obj):
        return (getattr, (type(obj), obj.name)) if isinstance(obj, enum.Enum) else NotImplemented


class _Getattr:
    """Unpickles as getattr(PosixPath, "write_text"): a method that writes a file."""

    def __reduce__(self):
        return getattr, (pathlib.PosixPath, "write_text")

    def __call__(self):  # never called here: pickle wants the first item of a reduce to be callable
        pass


class _Write:
    """Unpickles as PosixPath.write_text(path, "pwned")."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return _Getattr(), (pathlib.PosixPath(self.path), "pwned")


def test_metadata_with_enums_by_name_is_read_and_no_other_getattr_is(one_process, tmp_path):
    folder = shards(one_process / "distributed_fsdp.py")
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    by_name = tmp_path / "by-name"
    shutil.copytree(folder, by_name)
    with open(by_name / ".metadata", "wb") as f:
        _EnumsByName(f).dump(metadata)
    assert b"getattr" in (by_name / ".metadata").read_bytes()
    # What such a Python wrote reads as what this one wrote, tensor for tensor.
    reference, read = compare_models.read_sharded(str(folder)), compare_models.read_sharded(str(by_name))
    assert read.keys() == reference.keys() and len(read) == 112, sorted(read)  # 74 model, 38 momentum
    assert all(torch.equal(read[name], reference[name]) for name in read)
    # getattr for anything but an enum member is refused, before it is called.
    marker = tmp_path / "marker"
    crafted = tmp_path / "crafted"
    shutil.copytree(folder, crafted)
    with open(crafted / ".metadata", "wb") as f:
        pickle.dump(_Write(marker), f)
    with pytest.raises(UsageError, match="asks getattr for 'write_text', which is not a member of an enum"):
        compare_models.read_sharded(str(crafted))
    assert not marker.exists()


def _str(text: str) -> bytes:
    return b"X" + len(text.encode()).to_bytes(4, "little") + text.encode()  # BINUNICODE


def test_a_metadata_that_reads_one_way_when_checked_and_another_when_used_writes_nothing(one_process, tmp_path):
    """A pickle that rewrites the enum's member table (BUILD on the class), so that getattr by
    member (the checking unpickler) and the real getattr (a plain pickle.load) resolve the same
    names to different things: PosixPath's write_text for the latter. It ends with the real
    metadata, so that the check would pass it. The load must use what was checked. In a
    process of its own: the pickle changes the enum class of the process that reads it."""
    folder = shards(one_process / "distributed_fsdp.py")
    crafted = tmp_path / "crafted"
    shutil.copytree(folder, crafted)
    marker = tmp_path / "marker"
    enum_class = b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
    path_class = b"cpathlib\nPosixPath\n"
    get = b"cbuiltins\ngetattr\n"
    attack = (b"\x80\x02"
              # _member_map_ = {}, X = PosixPath: then _member_map_ = {X: the class, write_text: PosixPath}
              + enum_class + b"N}(" + _str("_member_map_") + b"}" + _str("X") + path_class + b"u\x86b0"
              + enum_class + b"N}(" + _str("_member_map_") + b"}(" + _str("X") + enum_class
              + _str("write_text") + path_class + b"uu\x86b0"
              # getattr(getattr(the class, "X"), "write_text")(PosixPath(marker), "pwned")
              + get + get + enum_class + _str("X") + b"\x86R" + _str("write_text") + b"\x86R"
              + path_class + _str(str(marker)) + b"\x85R" + _str("pwned") + b"\x86R0")
    (crafted / ".metadata").write_bytes(attack + (folder / ".metadata").read_bytes())
    reference = one_process / "distributed.py" / "checkpoint.pt"
    proc = run_script(["scripts/compare_models.py", reference, crafted], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "asks getattr for 'X', which is not a member of an enum" in proc.stderr, proc.stderr
    assert not marker.exists()


def test_compare_models_reads_a_sharded_checkpoint(two_processes, tmp_path):
    ddp = two_processes / "distributed.py" / "checkpoint.pt"
    fsdp = two_processes / "distributed_fsdp.py" / "checkpoint.pt"
    # The 2-process shards read whole, without processes; the optimizer numbered as DDP's.
    proc = run_script(["scripts/compare_models.py", ddp, fsdp, "--what", "all", "--atol", str(TOLERANCE)],
                      check=False)
    # 157: SGD's kernel flags (fused, foreach, differentiable) are not compared
    assert proc.returncode == 0 and "match: 157 entries (all)" in proc.stdout, proc.stdout + proc.stderr
    # The folder alone: its model.
    proc = run_script(["scripts/compare_models.py", ddp, shards(fsdp.parent)], check=False)
    assert proc.returncode == 0 and "match: 74 entries (model)" in proc.stdout, proc.stdout + proc.stderr
    # A shard file cut short: one line, exit 2.
    broken = tmp_path / "broken"
    shutil.copytree(shards(fsdp.parent), broken)
    shard = broken / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = run_script(["scripts/compare_models.py", ddp, broken], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "cannot read sharded checkpoint" in proc.stderr
    assert f"{broken}: EOFError" in proc.stderr and "CheckpointException" not in proc.stderr, proc.stderr



class Untouchable(torch.utils.data.Dataset):
    """A test set that must not be read here (as an HDF5 file opened on first access must be
    read in the loader workers only), unless `allowed`."""

    def __init__(self):
        self.allowed = False

    def __len__(self):
        return 3

    def __getitem__(self, index):
        assert self.allowed, "a test sample was loaded in the training process"
        return torch.ones(3, 4, 4), 1


def test_evaluation_padding_is_shaped_like_the_real_batches(monkeypatch):
    """A rank with fewer evaluation batches than the longest shard pads with zero images of
    its own batches' shape (and layout), without loading a sample itself; only a rank with
    no batch at all reads one to learn the shape."""
    import distributed_fsdp
    from utils import metrics
    from utils.distributed import DistEnv

    def longest_is_4(tensor, op=None):  # as if another rank had 4 batches
        tensor.fill_(4)
    monkeypatch.setattr(distributed_fsdp.dist, "all_reduce", longest_is_4)
    env = DistEnv(0, 0, 2, 2, torch.device("cpu"), True)
    test_set = Untouchable()
    real = [(torch.rand(2, 3, 4, 4).to(memory_format=torch.channels_last), torch.tensor([5, 6]))] * 2
    batches = list(distributed_fsdp.even_eval_batches(real, test_set, env))
    assert len(batches) == 4 and batches[:2] == real
    for images, targets in batches[2:]:
        assert images.shape == (1, 3, 4, 4) and not images.any()
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert targets.tolist() == [metrics.PAD_TARGET]
    test_set.allowed = True  # no batch of its own: one sample gives the shape
    batches = list(distributed_fsdp.even_eval_batches([], test_set, env))
    assert len(batches) == 4 and all(images.shape == (1, 3, 4, 4) for images, _ in batches)


def test_evaluation_batches_let_their_loader_go_with_the_last_reference(monkeypatch):
    """The loader (and with it its persistent workers) goes when the script lets go of it,
    not at the garbage collector's next pass, which may never come before the exit: its
    workers are then stopped in order by the loader, not killed by the exit handlers."""
    import gc
    import weakref
    import distributed_fsdp
    from utils.distributed import DistEnv

    class Batches(list):  # a list that can be referred to weakly, as a DataLoader can
        pass

    monkeypatch.setattr(distributed_fsdp.dist, "all_reduce", lambda tensor, op=None: None)
    loader = Batches([(torch.rand(2, 3, 4, 4), torch.tensor([5, 6]))])
    gone = weakref.ref(loader)
    gc.disable()  # only reference counting frees anything here
    try:
        env = DistEnv(0, 0, 1, 1, torch.device("cpu"), False)
        batches = distributed_fsdp.even_eval_batches(loader, Untouchable(), env)
        assert len(list(batches)) == 1
        del loader, batches
        assert gone() is None
    finally:
        gc.enable()


# --- memory per rank: scripts/memory_table.py ---------------------------------------------------

def test_the_formula_splits_dim_0_as_torch_chunk_does():
    for rows in (1, 3, 7, 8, 9, 64, 100):
        for world_size in (1, 2, 3, 4):
            chunks = [c.numel() for c in torch.empty(rows).chunk(world_size)]
            chunks += [0] * (world_size - len(chunks))  # torch.chunk returns fewer pieces when they run out
            for rank in range(world_size):
                assert memory_table.shard_rows(rows, world_size, rank) == (chunks[rank], max(chunks)), \
                    (rows, world_size, rank)


@pytest.mark.parametrize("gpus, sizes", [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8])])
def test_memory_table_measures_every_gpu_by_default(gpus, sizes):
    args = memory_table.build_parser().parse_args([])
    assert memory_table.sizes_to_measure(args, True, gpus) == sizes  # 6 GPUs: all six too, not only 4
    assert memory_table.sizes_to_measure(args, False, 0) == [1, 2, 4]


def test_memory_table_measures_what_each_rank_holds(tmp_path):
    """Three processes, so that dim 0 of resnet_tiny's tensors (8, 16, 32, 64, 100 rows) does
    not divide and the shards are padded, unevenly. The figures are read from the tool's
    json and checked against our own arithmetic here, rank by rank."""
    import json
    import math
    from models import build_model
    proc = run_script(["scripts/memory_table.py", "--device", "cpu", "--model", "resnet_tiny",
                       "--world-sizes", "3", "--memory-batch", "4", "--out", tmp_path], timeout=240)
    assert "| fsdp2 | 3 |" in proc.stdout
    report = json.loads((tmp_path / "memory.json").read_text())
    assert "| ddp | 3 |" in (tmp_path / "memory.md").read_text()
    assert memory_table.ONE_PROCESS_NOTE not in (tmp_path / "memory.md").read_text()
    # The same table measured at one process (all a single GPU allows) says that it shows no sharding.
    memory_table.write_markdown(str(tmp_path / "one.md"),
                                dict(report, rows=[dict(r, world_size=1) for r in report["rows"]]))
    one = (tmp_path / "one.md").read_text()
    assert memory_table.ONE_PROCESS_NOTE in one and memory_table.ONE_GPU_NOTE not in one  # CPU processes
    on_one_gpu = dict(report, settings=dict(report["settings"], device="cuda", gpus=1))
    memory_table.write_markdown(str(tmp_path / "gpu.md"),
                                dict(on_one_gpu, rows=[dict(r, world_size=1) for r in report["rows"]]))
    assert f"{memory_table.ONE_PROCESS_NOTE} {memory_table.ONE_GPU_NOTE}" in (tmp_path / "gpu.md").read_text()
    # A table with one row at one process and others at more shows sharding: no note.
    mixed = [dict(r, world_size=1) if i == 0 else r for i, r in enumerate(report["rows"])]
    memory_table.write_markdown(str(tmp_path / "mixed.md"), dict(report, rows=mixed))
    assert memory_table.ONE_PROCESS_NOTE not in (tmp_path / "mixed.md").read_text()
    assert not list(tmp_path.rglob("memory-w*.json"))  # the raw files (in logs/) are folded into memory.json

    model = build_model("resnet_tiny", 100)
    numel = sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("layer"))
    largest_stage = max(sum(p.numel() for p in getattr(model, f"layer{i}").parameters()) for i in range(1, 5))
    [result] = report["measurements"]
    ranks = {(r["strategy"], r["rank"]): r for r in result["ranks"]}
    assert len(ranks) == 12
    # Each strategy starts from a clean process: nothing of the one before is still alive.
    assert all(r["live_bytes_before"] < 1024 for r in result["ranks"]), result["ranks"]
    batch_norm = {f"{m}.{p}" for m, module in model.named_modules()
                  if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
                  for p, _ in module.named_parameters(recurse=False)}
    for rank in range(3):
        ddp = ranks["ddp", rank]
        assert ddp["params"] == ddp["grads"] == ddp["optimizer"] == 4 * numel  # everything, on every rank
        assert ddp["whole_params_peak"] == 4 * numel
        padded = held = 0
        for p in model.parameters():
            pieces = [c.shape[0] for c in torch.empty(p.shape[0]).chunk(3)] + [0, 0]
            rest = math.prod(p.shape[1:])
            padded += max(pieces) * rest
            held += pieces[rank] * rest
        for name in ("fsdp2", "fsdp2-zero2", "fsdp2-bf16"):
            fsdp = ranks[name, rank]
            # parameters and gradients in FSDP2's padded shards, momentum only the rank's rows
            assert (fsdp["params"], fsdp["grads"], fsdp["optimizer"]) == (4 * padded, 4 * padded, 4 * held)
        # ZeRO-3: one residual stage whole at a time, beside the root's own parameters; ZeRO-2:
        # every stage gathered in forward is still whole when the last one runs.
        assert ranks["fsdp2", rank]["whole_params_peak"] == 4 * (root + largest_stage)
        assert ranks["fsdp2-zero2", rank]["whole_params_peak"] == 4 * numel
        # bf16 policy: the same shards in fp32; gathered, the weights take 2 bytes, batch norm's 4
        # (all of them one unit: whole from the first batch norm's forward to the last's, and
        # again through backward).
        stage = max((f"layer{i}" for i in range(1, 5)),
                    key=lambda s: sum(p.numel() for p in getattr(model, s).parameters()))
        gathered_bf16 = sum(p.numel() for name, p in model.named_parameters() if name not in batch_norm
                            and (name.startswith(stage) or not name.startswith("layer")))
        all_bn = sum(p.numel() for name, p in model.named_parameters() if name in batch_norm)
        assert 2 * gathered_bf16 <= ranks["fsdp2-bf16", rank]["whole_params_peak"] <= 2 * gathered_bf16 + 4 * all_bn
    rows = {(r["strategy"], r["world_size"]): r for r in report["rows"]}
    assert all(r["matches_formula"] for r in rows.values())
    assert rows["fsdp2", 3]["total"] < 0.4 * rows["ddp", 3]["total"]
    assert rows["fsdp2", 3]["vs_ddp"] == pytest.approx(rows["fsdp2", 3]["total"] / rows["ddp", 3]["total"])


@pytest.mark.parametrize("argv, fragment", [
    (["--world-sizes", "0,2"], "give process counts"),
    (["--world-sizes", "two"], "give process counts"),
    (["--device", "cuda"], "no CUDA GPU is visible"),
    (["--quick"], "unrecognized arguments: --quick"),  # the benchmark's rows, which the table does not run
    (["--batch-size", "6"], "unrecognized arguments: --batch-size 6"),
])
def test_memory_table_bad_input_is_one_line(argv, fragment, tmp_path, run_in_process, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # run_in_process imports the script by name
    assert_refused(run_in_process("memory_table.py", [*argv, "--out", tmp_path]), fragment)


@pytest.mark.gpu
def test_memory_table_on_a_gpu_reads_the_peak(tmp_path, record_property):
    """On CUDA the table adds max_memory_allocated of the measured step: at least what the
    rank holds between steps (parameters, gradients, momentum), plus the activations."""
    import json
    from conftest import gpu_subprocess_env
    run_script(["scripts/memory_table.py", "--world-sizes", "1", "--memory-batch", "64",
                "--out", tmp_path], timeout=240, env=gpu_subprocess_env())
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert {r["strategy"] for r in rows} == {"ddp", "fsdp2", "fsdp2-zero2", "fsdp2-bf16"}
    for row in rows:
        assert row["matches_formula"], row
        assert row["peak_allocated"] > row["total"], row
    MiB = 2 ** 20
    ranks = json.loads((tmp_path / "memory.json").read_text())["measurements"][0]["ranks"]
    first = ranks[0]["allocated_before"]
    for r in ranks:
        # Nothing of the strategy before is left (a model is 128 MiB with its state), and what the
        # process's first step keeps for good (65 MiB of library workspaces on an H200) was
        # allocated by the warm-up before the first strategy, so every strategy starts level.
        assert abs(r["allocated_before"] - first) <= 1 * MiB, r
        # After the step: the rank's parameters, gradients and momentum and the batch, little else
        # (measured on an H200 with 2.11, batch 512: 2.7 to 3.2 MiB more).
        held = r["allocated"] - r["allocated_before"]
        own = r["params"] + r["grads"] + r["optimizer"] + r["batch_bytes"]
        # In the junit report of a GPU run: what the bounds here were set from.
        record_property(f"{r['strategy']}_held_beyond_own_MiB", round((held - own) / MiB, 2))
        record_property(f"{r['strategy']}_allocated_before_beyond_first_MiB",
                        round((r["allocated_before"] - first) / MiB, 2))
        assert own <= held <= own + 16 * MiB, r
