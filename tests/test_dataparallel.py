"""dataparallel.py: DataParallel takes the plain module's step (on 2 GPUs or more: with no
GPU, or one, DataParallel calls the module itself), autocast reaches the replicas' threads,
the script runs end to end through plain `python`, and a resumed run continues with the exact
next batch."""
import os
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dataparallel
from conftest import (SMALL, assert_refused, assert_same_training_state, expect_ok, read_metrics, run_script,
                      subprocess_env, torchrun, with_flag)
from models import build_model


def _one_step(model, forward, images, targets):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    loss = F.cross_entropy(forward(images), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


@pytest.mark.gpu
def test_dataparallel_on_two_gpus_takes_the_plain_modules_step():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.manual_seed(0)
    images = torch.randn(64, 3, 32, 32, device="cuda:0")
    targets = torch.randint(0, 100, (64,), device="cuda:0")
    torch.manual_seed(1)
    plain = build_model("resnet_tiny", 100).cuda(0)
    wrapped = build_model("resnet_tiny", 100).cuda(0)
    wrapped.load_state_dict(plain.state_dict())
    # Eval mode: in training mode batch norm normalises each GPU's half of the batch with
    # that half's statistics, a different (and intended) computation, not a rounding error.
    plain.eval(), wrapped.eval()

    expected = _one_step(plain, plain, images, targets)
    got = _one_step(wrapped, nn.DataParallel(wrapped, device_ids=[0, 1]), images, targets)

    for name in expected:  # gradients summed across GPUs in another order: not bitwise
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


def _in_a_thread(fn):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", fn()))
    thread.start()
    thread.join(timeout=60)
    return result["out"]


def test_autocast_inside_forward_reaches_replica_threads():
    """DataParallel runs replicas in threads; autocast is thread-local."""
    model = nn.Linear(8, 4)
    x = torch.randn(2, 8)
    # Entered in the calling thread, autocast does not apply in a replica's thread...
    with torch.amp.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16
        assert _in_a_thread(lambda: model(x)).dtype == torch.float32
    # ...entered inside forward, it does, with the dtype asked for.
    wrapped = dataparallel.AutocastForward(model, "cpu", torch.bfloat16)
    assert _in_a_thread(lambda: wrapped(x)).dtype == torch.bfloat16
    assert set(dict(wrapped.module.named_parameters())) == {"weight", "bias"}


def test_end_to_end_on_the_cpu(tmp_path, run_in_process):
    metrics = tmp_path / "metrics.jsonl"
    out = expect_ok(run_in_process("dataparallel.py", [*SMALL, "--metrics", metrics]))  # CUDA hidden: the CPU path
    assert "no GPU visible: training the plain module on the CPU" in out
    records = read_metrics(metrics)
    assert [r["event"] for r in records] == ["epoch", "end"]
    end = records[-1]
    assert end["world_size"] == 1 and end["strategy"] == "dataparallel"
    assert end["test_samples"] == 100 and end["global_batch"] == 32 and end["step"] == 256 // 32
    assert end["amp"] == "fp32" and end["gpus"] == 0 and end["device"] == "cpu"
    for field in ("epoch", "train_loss", "train_acc1", "test_loss", "test_acc1", "test_acc5",
                  "epoch_seconds", "images_per_second", "device"):
        assert field in end, field


def test_bf16_autocast_on_the_cpu(run_in_process, tmp_path, monkeypatch):
    # The same 3 steps in bf16 and in float32: the same batches and initial weights, so only the
    # precision can make the numbers differ.
    logits = {}  # run: {(training?, dtype of the classifier's output)}
    build_model = dataparallel.build_model

    def watched_model(name, num_classes):
        model = build_model(name, num_classes)
        model.fc.register_forward_hook(lambda module, inputs, out: logits[tag].add((module.training, out.dtype)))
        return model
    monkeypatch.setattr(dataparallel, "build_model", watched_model)
    for tag, flags in (("bf16", ["--amp", "bf16"]), ("fp32", [])):
        logits[tag] = set()
        expect_ok(run_in_process("dataparallel.py", [*SMALL, *flags, "--max-steps", "3", "--metrics",
                                                     tmp_path / f"{tag}.jsonl", "--checkpoint-dir", tmp_path / tag]))
    # Autocast reaches the training forward (inside the replicas' forward) and the evaluation (entered
    # around the unwrapped model).
    assert logits == {"bf16": {(True, torch.bfloat16), (False, torch.bfloat16)},
                      "fp32": {(True, torch.float32), (False, torch.float32)}}
    mixed, fp32 = read_metrics(tmp_path / "bf16.jsonl")[-1], read_metrics(tmp_path / "fp32.jsonl")[-1]
    assert (mixed["amp"], fp32["amp"]) == ("bf16", "fp32")
    assert mixed["step"] == fp32["step"] == 3 and mixed["test_samples"] == fp32["test_samples"] == 100
    # bfloat16's 8-bit mantissa shows in the losses, within bfloat16's precision of the float32 figures.
    for key in ("train_loss", "test_loss"):
        assert mixed[key] != fp32[key], (key, mixed[key])
        assert mixed[key] == pytest.approx(fp32[key], rel=torch.finfo(torch.bfloat16).eps), key
    state = torch.load(tmp_path / "bf16" / "checkpoint.pt", map_location="cpu", weights_only=True)
    reference = torch.load(tmp_path / "fp32" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert not state["scaler"]  # bfloat16 needs no loss scaling
    assert state["model"]["fc.weight"].dtype == torch.float32  # autocast keeps float32 weights
    assert not torch.equal(state["model"]["fc.weight"], reference["model"]["fc.weight"])  # other gradients


def test_resume_continues_with_the_exact_next_batch(tmp_path):
    """Stopped mid-epoch (--max-steps 3 of 8) and resumed into the same --checkpoint-dir, with a loader
    worker as users run it: the weights, optimizer and schedule of one uninterrupted run, bitwise."""
    argv = ["dataparallel.py", *with_flag(SMALL, "--workers", 1)]
    straight, ck = tmp_path / "straight", tmp_path / "ck"
    run_script([*argv, "--checkpoint-dir", straight])
    run_script([*argv, "--max-steps", "3", "--checkpoint-dir", ck])
    saved = torch.load(ck / "checkpoint.pt", weights_only=True)
    assert (saved["epoch"], saved["step_in_epoch"], saved["global_step"]) == (0, 3, 3)  # stopped mid-epoch
    out = run_script([*argv, "--checkpoint-dir", ck, "--resume"]).stdout
    assert f"resumed from {ck / 'checkpoint.pt'}: epoch 1, step 3 of 8" in out, out
    assert_same_training_state(straight / "checkpoint.pt", ck / "checkpoint.pt", global_step=8)


def test_gpus_without_gpus_is_one_line_and_exit_2(run_in_process):
    assert_refused(run_in_process("dataparallel.py", [*SMALL, "--gpus", "0,1"]), "--gpus 0,1", "none is visible")


def test_under_torchrun_it_refuses_in_one_line_and_trains_nothing(tmp_path):
    """torchrun sets WORLD_SIZE and passes no flag: 2 copies would each train the whole run, into one --metrics
    file and one --checkpoint-dir."""
    metrics = tmp_path / "metrics.jsonl"
    proc = torchrun(2, "dataparallel.py", [*SMALL, "--metrics", metrics, "--checkpoint-dir", tmp_path / "ck"],
                    check=False, timeout=120)
    line = ("dataparallel.py: error: this script is one process that no launcher starts (it drives every GPU "
            "itself): run it with plain python, without torchrun or --local-rank")
    lines = [text for text in proc.stderr.splitlines() if text.strip()]
    assert lines[0] == line and lines.count(line) == 1, proc.stderr  # rank 0's line; then torchrun's summary
    assert "exitcode  : 2" in proc.stderr and "exitcode  : 1" not in proc.stderr, proc.stderr
    assert not metrics.exists() and not (tmp_path / "ck").exists()


def test_gpu_list_rejects_duplicates_and_unknown_ids(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert dataparallel.pick_gpus(None) == [0, 1, 2, 3]
    assert dataparallel.pick_gpus([2, 0]) == [2, 0]
    with pytest.raises(dataparallel.cli.UsageError, match="more than once"):
        dataparallel.pick_gpus([0, 0])
    with pytest.raises(dataparallel.cli.UsageError, match="no GPU 4"):
        dataparallel.pick_gpus([0, 4])


@pytest.mark.gpu
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_end_to_end_on_every_gpu(tmp_path, amp):
    count = torch.cuda.device_count()
    env = subprocess_env(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES",
                                                             ",".join(map(str, range(count)))))
    metrics = tmp_path / "metrics.jsonl"
    run_script(["dataparallel.py", *SMALL, "--amp", amp, "--metrics", metrics,
                "--checkpoint-dir", tmp_path / "ckpt"], env=env)
    end = read_metrics(metrics)[-1]
    assert end["gpus"] == count and end["amp"] == amp and end["test_samples"] == 100
    state = torch.load(tmp_path / "ckpt" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert bool(state["scaler"]) == (amp == "fp16")  # the loss scale is checkpointed
