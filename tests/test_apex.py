"""distributed_apex.py: DDP + mixed precision (torch.amp; NVIDIA apex only when a real one is installed).

End to end on the CPU through the real launchers (bf16 under torchrun, fp16 with
GradScaler under python), an exact resume that carries the loss scale, the one-line
error when apex is asked for but absent, and unit tests of how the precision is chosen.
"""
import argparse
import contextlib
import importlib
import subprocess
import sys
import types

import pytest
import torch

from conftest import (ROOT, SMALL, assert_refused, expect_ok, gpu_subprocess_env, read_metrics, run_script,
                      subprocess_env, torchrun)
from utils import precision
from utils.cli import UsageError
from utils.precision import cpu_autocast_works

SCRIPT = "distributed_apex.py"
apex_script = importlib.import_module("distributed_apex")

# fp16 convolution backward is a slow fallback on the CPU (about 0.3 s per image here):
# few, tiny steps.
FP16_SMALL = ["--dataset", "synthetic", "--model", "resnet_tiny", "--train-samples", "16",
              "--test-samples", "4", "--batch-size", "2", "--workers", "0", "--epochs", "1",
              "--amp", "fp16", "--clip-grad", "1.0"]


@pytest.fixture
def start():
    """start(args): `python <args>` in the background, to overlap with another run.
    Whatever is still running when the test ends (it failed early) is killed."""
    procs = []

    def launch(args):
        procs.append(subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, env=subprocess_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return procs[-1]
    yield launch
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def finish(proc, timeout=180):
    """Wait for a process started with start(); kill it on timeout; fail with its output."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args} timed out\n{out}\n{err}")
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    return out


def end_record(path):
    records = read_metrics(path)
    assert records[-1]["event"] == "end"
    return records[-1]


# --- end to end on the CPU -------------------------------------------------------------

def test_bf16_under_torchrun_two_processes(tmp_path):
    proc = torchrun(2, SCRIPT, [*SMALL, "--amp", "bf16", "--metrics", tmp_path / "bf16.jsonl"])
    assert "no --amp given" not in proc.stdout
    bf16 = end_record(tmp_path / "bf16.jsonl")
    assert bf16["amp"] == "bf16" and bf16["amp_impl"] == "torch" and bf16["opt_level"] is None
    assert bf16["strategy"] == "ddp-amp-torch"
    assert bf16["world_size"] == 2 and bf16["global_batch"] == 32 and bf16["device"] == "cpu"
    assert bf16["step"] == 256 // 32 and bf16["epoch_complete"]
    assert bf16["test_samples"] == 100  # every test image once over the two shards


def test_autocast_changes_the_arithmetic(tmp_path, run_in_process):
    # One process, two steps each, in bf16 and in float32 (--opt-level O0): the same
    # batches and weights, so only the precision can make the numbers differ.
    amp = "bf16"
    for tag, flag in ((amp, ["--amp", amp]), ("fp32", ["--opt-level", "O0"])):
        expect_ok(run_in_process(SCRIPT, [*SMALL, *flag, "--max-steps", "2", "--metrics", tmp_path / f"{tag}.jsonl"]))
    mixed, fp32 = end_record(tmp_path / f"{amp}.jsonl"), end_record(tmp_path / "fp32.jsonl")
    assert (mixed["amp"], fp32["amp"], fp32["opt_level"]) == (amp, "fp32", "O0")
    # Close, but the 8-bit (bf16) or 11-bit (fp16) mantissa shows, in training and in evaluation.
    for key in ("train_loss", "test_loss"):
        assert 1e-6 < abs(mixed[key] - fp32[key]) < 0.05, (key, mixed[key], fp32[key])


@pytest.mark.skipif(not cpu_autocast_works(torch.float16),
                    reason="this PyTorch build has no float16 autocast on the CPU")
def test_fp16_resume_continues_with_the_same_loss_scale(tmp_path, start):
    whole, part = tmp_path / "whole", tmp_path / "part"
    uninterrupted = start([SCRIPT, *FP16_SMALL, "--max-steps", "2", "--checkpoint-dir", whole,
                           "--metrics", tmp_path / "whole.jsonl"])
    first_half = start([SCRIPT, *FP16_SMALL, "--max-steps", "1", "--checkpoint-dir", part])
    finish(first_half)
    halfway = torch.load(part / "checkpoint.pt", weights_only=True)
    assert halfway["global_step"] == 1 and halfway["scaler"]["scale"] > 0  # the scaler is saved
    out = run_script([SCRIPT, *FP16_SMALL, "--max-steps", "2", "--checkpoint-dir", part, "--resume"]).stdout
    assert "resumed from" in out
    finish(uninterrupted)

    record = end_record(tmp_path / "whole.jsonl")
    assert record["amp"] == "fp16" and record["strategy"] == "ddp-amp-torch"
    a = torch.load(whole / "checkpoint.pt", weights_only=True)
    b = torch.load(part / "checkpoint.pt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 2
    # A resume that lost the scaler would restart the growth tracker (and the scale) from scratch.
    assert a["scaler"] and a["scaler"]["scale"] > 0
    assert b["scaler"]["scale"] == a["scaler"]["scale"]
    assert b["scaler"]["_growth_tracker"] == a["scaler"]["_growth_tracker"]
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"])


@pytest.mark.skipif(not cpu_autocast_works(torch.float16),
                    reason="this PyTorch build has no float16 autocast on the CPU")
@pytest.mark.parametrize("script", ["distributed_apex.py", "dataparallel.py"])
def test_fp16_first_step_skipped_by_the_scaler_leaves_fused_sgd_clean(tmp_path, monkeypatch, run_in_process,
                                                                       script):
    # On GPUs both scripts use torch's fused SGD, which GradScaler hands the overflow flag instead of
    # skipping its step. At its first step it makes the momentum with empty_like and keeps it though the
    # kernel skipped (torch/optim/sgd.py, _fused_sgd): unless the script made zeros first, the next steps
    # run on whatever that memory held. Here: fused on the CPU too, and a first loss scale that overflows.
    steps = []

    class FusedSGD(torch.optim.SGD):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "fused": True})

        def step(self, *args, **kwargs):
            momentum = (self.state[p].get("momentum_buffer") for p in self.param_groups[0]["params"])
            steps.append([None if b is None else b.clone() for b in momentum])
            return super().step(*args, **kwargs)

    scaler = torch.amp.GradScaler
    monkeypatch.setattr(torch.optim, "SGD", FusedSGD)
    # 2**40: the float16 backward overflows; then 2**10: it does not.
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *args, **kwargs: scaler(
        *args, **kwargs, init_scale=2.0**40, backoff_factor=2.0**-30))
    argv = [*FP16_SMALL, "--max-steps", "2", "--checkpoint-dir", tmp_path]
    code, out, err = run_in_process(script, argv)
    assert code == 0, err
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["scaler"]["scale"] == 2.0**10, "the first step was not the skipped one"
    assert len(steps) == 2 and all(b is not None and not b.any() for b in steps[0]), \
        "fused SGD's first step did not find zero momentum"
    # The skipped step left the zeros as they were; the second started from them, as plain SGD's first.
    assert all(not b.any() for b in steps[1])
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


# --- NVIDIA apex: asked for but absent ------------------------------------------------

def _no_real_apex():
    try:
        precision.find_nvidia_apex()
    except UsageError:
        return True
    return False


@pytest.mark.skipif(not _no_real_apex(), reason="an NVIDIA apex is installed here")
def test_apex_absent_is_one_clear_line_and_exit_2(run_in_process):
    assert_refused(run_in_process(SCRIPT, [*SMALL, "--amp-impl", "apex"]),
                   "PyPI", "--amp-impl torch", "github.com/NVIDIA/apex")


def _module(name, **attrs):
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


@pytest.fixture
def fake_apex(monkeypatch):
    """Install a fake `apex` (and, on request, apex.optimizers / apex.amp) in sys.modules; with its CUDA
    extensions unless told (apex's multi_tensor_applier says whether they were built)."""
    def install(optimizers=None, amp=None, cuda_ext=True, **top_level):
        monkeypatch.setitem(sys.modules, "apex", _module("apex", **top_level))
        applier = types.SimpleNamespace(available=cuda_ext)
        monkeypatch.setitem(sys.modules, "apex.multi_tensor_apply",
                            _module("apex.multi_tensor_apply", multi_tensor_applier=applier))
        for name, module in (("apex.optimizers", optimizers), ("apex.amp", amp)):
            if module is None:
                # None in sys.modules makes `import` fail, as for a package without it.
                monkeypatch.setitem(sys.modules, name, None)
            else:
                monkeypatch.setitem(sys.modules, name, module)
    return install


class FakeFusedSGD(torch.optim.SGD):
    pass


def fake_amp_module():
    return _module("apex.amp", initialize=lambda model, optimizer, **kw: (model, optimizer),
                   scale_loss=lambda loss, optimizer: None)


def test_an_apex_without_the_features_is_rejected(fake_apex):
    # What the unrelated PyPI `apex` looks like to us: importable, none of NVIDIA's features.
    fake_apex(__version__="0.9.10dev", views=object())
    with pytest.raises(UsageError, match="PyPI") as err:
        precision.find_nvidia_apex()
    assert "--amp-impl torch" in str(err.value)
    # An apex.amp stub without initialize/scale_loss does not count either.
    fake_apex(amp=_module("apex.amp", something_else=1))
    with pytest.raises(UsageError, match="PyPI"):
        precision.find_nvidia_apex()


def test_an_apex_with_the_features_is_accepted(fake_apex):
    amp = fake_amp_module()
    fake_apex(optimizers=_module("apex.optimizers", FusedSGD=FakeFusedSGD), amp=amp)
    assert precision.find_nvidia_apex() == (FakeFusedSGD, amp)
    # Current apex: FusedSGD, but apex.amp is gone.
    fake_apex(optimizers=_module("apex.optimizers", FusedSGD=FakeFusedSGD))
    assert precision.find_nvidia_apex() == (FakeFusedSGD, None)


def test_an_apex_built_without_its_cuda_extensions_has_no_fused_sgd(fake_apex):
    # apex's default `pip install ./` builds no extensions: FusedSGD imports, and its constructor raises
    # "apex.optimizers.FusedSGD requires cuda extensions". Its apex.amp (an older apex) still works.
    optimizers = _module("apex.optimizers", FusedSGD=FakeFusedSGD)
    fake_apex(optimizers=optimizers, cuda_ext=False)
    with pytest.raises(UsageError, match="github.com/NVIDIA/apex"):
        precision.find_nvidia_apex()
    amp = fake_amp_module()
    fake_apex(optimizers=optimizers, amp=amp, cuda_ext=False)
    assert precision.find_nvidia_apex() == (None, amp)


# --- choosing the precision -------------------------------------------------------------

def flags(amp=None, amp_impl="torch", opt_level=None):
    return argparse.Namespace(amp=amp, amp_impl=amp_impl, opt_level=opt_level)


def gpu_with_bf16(monkeypatch, native: bool):
    """As if this machine had a GPU with (Ampere or newer) or without bfloat16 hardware."""
    monkeypatch.setattr(precision, "cuda_bf16_native", lambda device=None: native)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0) if native else (7, 0))


def test_precision_defaults_and_opt_level_mapping(capsys, monkeypatch):
    cpu_default = precision.choose_precision(flags(), "cpu")
    assert (cpu_default.name, cpu_default.dtype) == ("bf16", torch.bfloat16)
    assert "no --amp given: using bf16 on the CPU" in capsys.readouterr().out
    # bf16 by default where the GPU has it in hardware (no loss scaling), fp16 elsewhere.
    gpu_with_bf16(monkeypatch, True)
    gpu_default = precision.choose_precision(flags(), "cuda")
    assert (gpu_default.name, gpu_default.dtype, gpu_default.apex_amp) == ("bf16", torch.bfloat16, None)
    assert "no --amp given: using bf16 on the GPU" in capsys.readouterr().out
    gpu_with_bf16(monkeypatch, False)
    gpu_default = precision.choose_precision(flags(), "cuda")
    assert (gpu_default.name, gpu_default.dtype, gpu_default.apex_amp) == ("fp16", torch.float16, None)
    with pytest.raises(UsageError, match=r"compute capability 7\.0.*use --amp fp16"):
        precision.choose_precision(flags(amp="bf16"), "cuda")

    fp32 = precision.choose_precision(flags(opt_level="O0"), "cuda")
    assert (fp32.name, fp32.dtype, fp32.opt_level) == ("fp32", None, "O0")
    for level in ("O1", "O2"):
        mixed = precision.choose_precision(flags(opt_level=level), "cuda")
        assert (mixed.name, mixed.dtype, mixed.opt_level) == ("fp16", torch.float16, level)
    with pytest.raises(UsageError, match="O3"):
        precision.choose_precision(flags(opt_level="O3"), "cuda")
    with pytest.raises(UsageError, match="contradicts"):
        precision.choose_precision(flags(amp="fp16", opt_level="O0"), "cuda")


def test_precision_with_apex(fake_apex, monkeypatch):
    amp = fake_amp_module()
    fake_apex(optimizers=_module("apex.optimizers", FusedSGD=FakeFusedSGD), amp=amp)
    chosen = precision.choose_precision(flags(amp_impl="apex"), "cuda")
    # apex.amp does its own casting: no torch autocast, opt level O1 by default.
    assert chosen == ("fp16", None, "O1", FakeFusedSGD, amp)
    assert precision.choose_precision(flags(amp_impl="apex", opt_level="O3"), "cuda").opt_level == "O3"
    with pytest.raises(UsageError, match="bf16"):
        precision.choose_precision(flags(amp="bf16", amp_impl="apex"), "cuda")
    with pytest.raises(UsageError, match="contradicts --amp fp16"):  # as without apex.amp
        precision.choose_precision(flags(amp="fp16", amp_impl="apex", opt_level="O0"), "cuda")
    assert precision.choose_precision(flags(amp_impl="apex", opt_level="O0"), "cuda").name == "fp32"
    with pytest.raises(UsageError, match="CUDA"):
        precision.choose_precision(flags(amp_impl="apex"), "cpu")

    # FusedSGD without apex.amp: torch.amp does the mixed precision, the opt levels are mapped.
    # With fp16, GradScaler.step would read FusedSGD's inf check back with .item() every
    # step (it has no built-in scaling support): torch's fused SGD is used instead.
    fake_apex(optimizers=_module("apex.optimizers", FusedSGD=FakeFusedSGD))
    chosen = precision.choose_precision(flags(amp_impl="apex", amp="fp16"), "cuda")
    assert chosen == ("fp16", torch.float16, None, None, None)
    assert not getattr(FakeFusedSGD([torch.zeros(1, requires_grad=True)], lr=0.1), "_step_supports_amp_scaling",
                       False)
    assert torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, fused=True)._step_supports_amp_scaling
    # bf16 needs no scaler: apex's FusedSGD stays.
    gpu_with_bf16(monkeypatch, True)
    chosen = precision.choose_precision(flags(amp_impl="apex", amp="bf16"), "cuda")
    assert chosen == ("bf16", torch.bfloat16, None, FakeFusedSGD, None)
    with pytest.raises(UsageError, match="O3"):
        precision.choose_precision(flags(amp_impl="apex", opt_level="O3"), "cuda")


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_apex_amp_branch_of_the_loop(tmp_path, monkeypatch, run_in_process, level):
    """The loop with apex.amp, on the CPU, through a stand-in with apex.amp's interface:
    amp.initialize before DDP, backward inside amp.scale_loss, clipping on
    amp.master_params, FusedSGD as the optimizer, amp's state in the checkpoint. At O2 (fp32
    master weights) apex replaces optimizer.zero_grad with its own, which takes no set_to_none
    and detaches the model's gradients in place (apex/amp/_process_optimizer.py)."""
    calls = {"initialize": [], "scale_loss": 0, "master_params": 0, "load_state_dict": []}

    def initialize(model, optimizer, opt_level, verbosity=1):
        calls["initialize"].append((type(optimizer), opt_level))
        if opt_level == "O2":
            def new_zero_grad(self):
                for param in model.parameters():
                    if param.grad is not None:
                        param.grad.detach_()
                        param.grad.zero_()
            optimizer.zero_grad = types.MethodType(new_zero_grad, optimizer)
        return model, optimizer

    @contextlib.contextmanager
    def scale_loss(loss, optimizer):
        calls["scale_loss"] += 1
        yield loss * 1.0

    def master_params(optimizer):
        calls["master_params"] += 1
        for group in optimizer.param_groups:
            yield from group["params"]

    amp = _module("apex.amp", initialize=initialize, scale_loss=scale_loss, master_params=master_params,
                  state_dict=lambda: {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": calls["scale_loss"]}},
                  load_state_dict=lambda state: calls["load_state_dict"].append(state))
    # The CPU has no real apex: hand train() the precision that a GPU with an old apex would get.
    monkeypatch.setattr(apex_script, "choose_precision",
                        lambda args, device_type: precision.Precision("fp16", None, level, FakeFusedSGD, amp))
    common = [*SMALL, "--amp-impl", "apex", "--clip-grad", "1.0", "--checkpoint-dir", tmp_path / "ckpt"]
    expect_ok(run_in_process(SCRIPT, [*common, "--max-steps", "2", "--metrics", tmp_path / "m.jsonl"]))
    assert calls["initialize"] == [(FakeFusedSGD, level)]
    assert calls["scale_loss"] == calls["master_params"] == 2
    record = end_record(tmp_path / "m.jsonl")
    assert (record["strategy"], record["amp"], record["amp_impl"], record["opt_level"]) == \
        ("ddp-amp-apex", "fp16", "apex", level)
    saved = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=True)
    assert saved["scaler"] == {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 2}}
    expect_ok(run_in_process(SCRIPT, [*common, "--max-steps", "3", "--resume"]))
    assert calls["load_state_dict"] == [saved["scaler"]]  # amp's loss scale is resumed


# --- GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_fp16_on_cuda(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    torchrun(nproc, SCRIPT, [*SMALL, "--amp", "fp16", "--metrics", tmp_path / "m.jsonl",
                             "--checkpoint-dir", tmp_path / "ckpt"], env=gpu_subprocess_env())
    record = end_record(tmp_path / "m.jsonl")
    assert record["amp"] == "fp16" and record["device"] != "cpu" and record["world_size"] == nproc
    assert record["test_samples"] == 100
    state = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=True)
    assert state["scaler"]["scale"] > 0 and state["global_step"] == 256 // 32
