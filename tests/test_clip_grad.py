"""--clip-grad-norm: once per optimizer step, on the gradient the step uses.

Every script clips the same way (bitwise, one CPU process); with accumulation the
clipped step equals the big batch's clipped step; under DDP the norm is that of the
averaged gradient, identical on every rank; under float16 it is measured after
unscaling, and clipping costs no extra skipped steps."""
import math
import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import (SMALL, expect_ok, free_port, keep_on_cpu, load_script, max_difference, read_metrics, run_script,
                      torchrun)
from models import build_model
from utils.metrics import TrainMeter
from utils.precision import cpu_autocast_works
from utils.run import TrainingRun

MAX_NORM = 0.5  # below the tiny ResNet's gradient norms in these runs: every step is clipped
STEPS = ["--max-steps", "5", "--train-samples", "128"]  # 4 steps per epoch: crosses an epoch's end

SCRIPTS = {
    "distributed": ["distributed.py"],
    "dataparallel": ["dataparallel.py"],
    "mp_spawn": ["distributed_mp.py", "--nproc-per-node", "1"],
    "accumulation": ["distributed_gradient_accumulation.py", "--accum-steps", "1"],
    "apex_fp32": ["distributed_apex.py", "--opt-level", "O0"],
}


@pytest.fixture(scope="module")
def clipped(tmp_path_factory, run_in_process_once):
    # In this process, one script after another (each seeds what it draws), but for
    # distributed_mp.py, whose mp.spawn would start its worker from the test runner's
    # __main__: as a program.
    out = {}
    for name, argv in SCRIPTS.items():
        directory = tmp_path_factory.mktemp(name)
        flags = [*SMALL, *STEPS, "--clip-grad-norm", MAX_NORM, "--checkpoint-dir", directory,
                 "--metrics", directory / "m.jsonl"]
        if name == "mp_spawn":
            run_script([*argv, *flags])
        else:
            expect_ok(run_in_process_once(argv[0], [*argv[1:], *flags]))
        out[name] = (torch.load(directory / "checkpoint.pt", weights_only=True),
                     read_metrics(directory / "m.jsonl")[-1])
    return out


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n != "distributed"])
def test_every_script_clips_like_distributed(clipped, name):
    reference, reference_record = clipped["distributed"]
    state, record = clipped[name]
    assert max_difference(state["model"], reference["model"]) == 0, name
    assert record["grad_norm"] == reference_record["grad_norm"]


def test_clipping_happened_and_the_record_has_the_norm_before_it(clipped, tmp_path, run_in_process):
    state, record = clipped["distributed"]
    assert record["grad_norm"] > MAX_NORM  # the norm before clipping: above the bound
    expect_ok(run_in_process("distributed.py", [*SMALL, *STEPS, "--checkpoint-dir", tmp_path,
                                                "--metrics", tmp_path / "m.jsonl"]))
    unclipped = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert max_difference(state["model"], unclipped["model"]) > 1e-4  # clipping changed the steps
    assert read_metrics(tmp_path / "m.jsonl")[-1]["grad_norm"] is None  # no flag, no norm


def test_accumulation_with_clipping_equals_the_big_batch_with_clipping(tmp_path, monkeypatch):
    """k=4 micro-batches and one clip per optimizer step end where the whole batch
    and one clip end (no batch norm: see test_gradient_accumulation). Clipping each
    micro-batch's share instead would clip other vectors and end elsewhere."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    keep_on_cpu(monkeypatch)
    flags = [*SMALL, "--warmup-epochs", "0", "--clip-grad-norm", str(MAX_NORM)]
    runs = {}
    for name, script, extra in [("big", "distributed.py", []), ("accum", "distributed_gradient_accumulation.py",
                                                                 ["--accum-steps", "4"])]:
        load_script(script).main([*flags, *extra, "--checkpoint-dir", str(tmp_path / name),
                                  "--metrics", str(tmp_path / f"{name}.jsonl")])
        runs[name] = (torch.load(tmp_path / name / "checkpoint.pt", weights_only=True),
                      read_metrics(tmp_path / f"{name}.jsonl")[0])
    (big, big_record), (accum, accum_record) = runs["big"], runs["accum"]
    assert big_record["grad_norm"] > MAX_NORM
    assert accum_record["grad_norm"] == pytest.approx(big_record["grad_norm"], rel=1e-5)
    assert max_difference(accum["model"], big["model"]) < 1e-6


def _rank_norm(rank, port, out_dir, images, targets):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = build_model("resnet_tiny", 100, norm_layer=torch.nn.Identity)
    ddp_model = DDP(model)
    half = len(images) // 2
    F.cross_entropy(ddp_model(images[rank * half:(rank + 1) * half]), targets[rank * half:(rank + 1) * half]).backward()
    # The script's call, with a stand-in for the rest of TrainingRun.
    run = SimpleNamespace(args=SimpleNamespace(clip_grad_norm=MAX_NORM), meter=TrainMeter(torch.device("cpu")))
    TrainingRun.clip_grad_norm(run, model.parameters())
    norm = run.meter.norms[0]  # the one norm of the step
    torch.save({"norm": norm, "grads": [p.grad for p in model.parameters()]}, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()
    os._exit(0)  # see tutorials/09-debugging.md: a DDP process leaves through os._exit


def test_under_ddp_every_rank_clips_by_the_same_norm_that_of_the_averaged_gradient(tmp_path):
    g = torch.Generator().manual_seed(1)
    images, targets = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 100, (8,), generator=g)
    context = mp.start_processes(_rank_norm, args=(free_port(), tmp_path, images, targets), nprocs=2,
                                 start_method="spawn", join=False)
    deadline = time.monotonic() + 180
    while not context.join(timeout=10):
        assert time.monotonic() < deadline, "the two ranks did not end within 180 s"
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0]["norm"].item() == ranks[1]["norm"].item()  # bitwise: the same clip on both ranks
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["grads"], ranks[1]["grads"]))
    # One process on the whole batch: the same norm (DDP averaged the halves' gradients).
    torch.manual_seed(0)
    model = build_model("resnet_tiny", 100, norm_layer=torch.nn.Identity)
    F.cross_entropy(model(images), targets).backward()
    whole = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert whole.item() > MAX_NORM
    assert ranks[0]["norm"].item() == pytest.approx(whole.item(), rel=1e-5)


def test_torchrun_two_processes_keep_the_replicas_equal_with_clipping(tmp_path):
    # As users run it: torchrun and the default loader workers.
    i = SMALL.index("--workers")
    default_workers = [*SMALL[:i], *SMALL[i + 2:]]
    proc = torchrun(2, "distributed.py", [*default_workers, *STEPS, "--clip-grad-norm", MAX_NORM, "--verify-sync",
                                          "--metrics", tmp_path / "m.jsonl"])
    # A rank that clipped by its own norm would leave its weights apart from rank 0's.
    assert ("verify-sync: all parameters and buffers agree" in proc.stdout
            or "(batch-norm running statistics differ unless --sync-bn)" in proc.stdout), proc.stdout
    assert read_metrics(tmp_path / "m.jsonl")[-1]["grad_norm"] > MAX_NORM


@pytest.mark.skipif(not cpu_autocast_works(torch.float16), reason="no float16 autocast on this CPU")
def test_fp16_clips_the_unscaled_gradient_and_skips_no_more_steps(tmp_path, run_in_process):
    # float16 backward is a slow fallback on the CPU: a few tiny steps.
    tiny = ["--dataset", "synthetic", "--model", "resnet_tiny", "--train-samples", "16", "--test-samples", "4",
            "--batch-size", "2", "--workers", "0", "--epochs", "1", "--max-steps", "4"]
    out = {}
    for name, extra in [("fp16_clip", ["--amp", "fp16", "--clip-grad-norm", MAX_NORM]),
                        ("fp16", ["--amp", "fp16"]),
                        ("fp32_clip", ["--opt-level", "O0", "--clip-grad-norm", MAX_NORM])]:
        directory = tmp_path / name
        expect_ok(run_in_process("distributed_apex.py", [*tiny, *extra, "--checkpoint-dir", directory,
                                                         "--metrics", directory / "m.jsonl"]))
        out[name] = (torch.load(directory / "checkpoint.pt", weights_only=True)["scaler"],
                     read_metrics(directory / "m.jsonl")[-1])
    # Each skipped step halves the scale (no growth within 2000 steps): equal scales, equal skips.
    assert out["fp16_clip"][0]["scale"] >= out["fp16"][0]["scale"]
    # Measured after unscale_: the true gradient's size, not 65536 times it.
    fp16_norm, fp32_norm = out["fp16_clip"][1]["grad_norm"], out["fp32_clip"][1]["grad_norm"]
    assert fp16_norm is not None and math.isfinite(fp16_norm)
    assert 0.5 < fp16_norm / fp32_norm < 2, (fp16_norm, fp32_norm)
