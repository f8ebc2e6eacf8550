"""scripts/benchmark.py: the quick mode end to end on the CPU (the real scripts through
their real launchers), and the arithmetic behind every figure it writes."""
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import FAULTS, ROOT, gpu_subprocess_env, run_script, subprocess_env

TOOL = ROOT / "scripts" / "benchmark.py"
MEMORY_TOOL = ROOT / "scripts" / "memory_table.py"
QUICK_SCRIPT_ROWS = ["ddp-1proc-noddp", "ddp-1proc", "ddp", "ddp-bf16", "fast-fp32"]
QUICK_CEILINGS = ["ceiling-bf16-nchw", "ceiling-bf16-channels-last"]
QUICK_GPU_ONLY = ["ceiling-bf16-cudagraphs"]  # in --quick's rows, skipped on the CPU
PEAK_TFLOPS = 0.5  # given on the command line, so that the CPU run fills the % of peak column too


def load_tool():
    spec = importlib.util.spec_from_file_location("benchmark", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return load_tool()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One --quick run on the CPU, as a user starts it (no PYTHONPATH)."""
    out = tmp_path_factory.mktemp("bench")
    env = subprocess_env(TMPDIR=str(tmp_path_factory.mktemp("tmp")))  # where the synthetic files go
    env.pop("PYTHONPATH")
    started = time.perf_counter()
    # Every row, one after another: 364 s once in the full suite on a slower 2-core machine.
    proc = run_script([TOOL, "--quick", "--device", "cpu", "--peak-tflops", PEAK_TFLOPS, "--out", out],
                      timeout=720, check=False, env=env)
    print(f"benchmark --quick took {time.perf_counter() - started:.0f} s")
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert "the synthetic set written as CIFAR-100 files" in proc.stdout
    assert not [name for name in os.listdir(env["TMPDIR"]) if name.startswith("benchmark-synthetic-")]
    with open(out / "benchmark.json") as f:
        report = json.load(f)
    return proc, out, report


def rows_by_name(report):
    return {r["name"]: r for r in report["rows"]}


# --- the quick run ---------------------------------------------------------------------

def test_quick_run_writes_the_three_files(quick_run):
    _, out, _ = quick_run
    assert (out / "benchmark.md").stat().st_size > 0
    with open(out / "benchmark.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_header_names_the_machine_and_the_command(quick_run):
    _, _, report = quick_run
    header = report["header"]
    assert header["torch"] == torch.__version__
    assert "scripts/benchmark.py --quick --device cpu" in header["command"]
    assert header["hardware"].startswith("CPU: ") and f"{os.cpu_count()} logical cores" in header["hardware"]
    assert header["python"] == ".".join(map(str, sys.version_info[:3]))
    assert report["peak"] == {"tflops": PEAK_TFLOPS, "source": "--peak-tflops"}


def test_every_quick_row_ran_and_its_figures_follow_from_its_epochs(quick_run):
    _, _, report = quick_run
    rows = rows_by_name(report)
    assert list(rows) == QUICK_SCRIPT_ROWS + QUICK_CEILINGS + QUICK_GPU_ONLY
    assert report["state"] == "complete"
    train_flops = report["flops"]["train_step_per_image"]
    for name in QUICK_SCRIPT_ROWS:
        row = rows[name]
        assert row["status"] == "ok", row
        # 3 epochs of 4 steps; epoch 1 is warm-up, the medians are over epochs 2 and 3.
        assert [e["epoch"] for e in row["epochs"]] == [1, 2, 3]
        assert all(e["images_per_second"] > 0 and e["epoch_seconds"] > 0 for e in row["epochs"])
        assert row["counted_epochs"] == [2, 3] and not row["warmup_included"]
        steady = row["epochs"][1:]
        assert row["median_images_per_second"] == pytest.approx(statistics.median(e["images_per_second"]
                                                                                  for e in steady))
        # The epoch figure is the scripts' measured epoch, not 50,000 images divided by a rate.
        assert row["median_epoch_seconds"] == pytest.approx(statistics.median(e["epoch_seconds"] for e in steady))
        assert (row["steps_per_epoch"], row["epoch_images"]) == (4, 4 * row["global_batch"])
        # The spread of the same epochs, and the whole epoch's rate: every step over the measured epoch.
        rates = [e["images_per_second"] for e in steady]
        assert (row["min_images_per_second"], row["max_images_per_second"]) == (min(rates), max(rates))
        assert row["min_images_per_second"] <= row["median_images_per_second"] <= row["max_images_per_second"]
        assert (row["timed_count"], row["timed_unit"]) == (2, "epochs")
        for e in row["epochs"]:
            assert e["steps"] == 4
            assert e["whole_epoch_images_per_second"] == pytest.approx(4 * row["global_batch"] / e["epoch_seconds"])
        whole = [e["whole_epoch_images_per_second"] for e in steady]
        assert row["median_whole_epoch_images_per_second"] == pytest.approx(statistics.median(whole))
        assert (row["min_whole_epoch_images_per_second"], row["max_whole_epoch_images_per_second"]) == (
            min(whole), max(whole))
        per_device = row["median_images_per_second"] / row["devices"]
        assert row["share_of_peak"] == pytest.approx(per_device * train_flops / (PEAK_TFLOPS * 1e12))
        assert row["vs_baseline"] == pytest.approx(per_device / (rows["ddp"]["median_images_per_second"] / 2))
        assert row["timed_steps"] == 3  # of 4: the scripts leave out min(10, 4 // 4) = 1
        assert row["device"] == "cpu" and row["peak_memory_mb"] is None
        assert os.path.getsize(row["log"]) > 0  # the row's output is kept
    # The same global batch everywhere; one-process rows take one process's share of it.
    for name in ("ddp", "ddp-bf16", "fast-fp32"):
        assert (rows[name]["processes"], rows[name]["global_batch"], rows[name]["world_size"]) == (2, 32, 2)
    for name in ("ddp-1proc-noddp", "ddp-1proc"):
        assert (rows[name]["processes"], rows[name]["global_batch"], rows[name]["world_size"]) == (1, 16, 1)
    assert rows["ddp-1proc-noddp"]["launcher"] == "python" and rows["ddp-1proc"]["launcher"] == "torchrun"
    assert rows["ddp-bf16"]["amp"] == "bf16" and rows["ddp"]["amp"] == "fp32"


def test_each_row_names_what_it_runs(quick_run):
    """On the CPU fp32 is fp32 (no TF32); the one-process rows say which of them is wrapped
    in DDP; no row carries the template script's own "ddp-torchrun" label, which it writes
    under plain python too."""
    _, out, report = quick_run
    rows = rows_by_name(report)
    assert report["settings"]["tf32_convolutions"] is False
    for name in ("ddp-1proc-noddp", "ddp-1proc", "ddp", "fast-fp32"):
        assert (rows[name]["amp"], rows[name]["precision"]) == ("fp32", "fp32"), rows[name]
    for name in ("ddp-bf16", *QUICK_CEILINGS, *QUICK_GPU_ONLY):
        assert (rows[name]["amp"], rows[name]["precision"]) == ("bf16", "bf16 autocast"), rows[name]
    assert rows["ddp-1proc-noddp"]["wrapper"] == "no wrapper, no process group (plain python)"
    assert rows["ddp-1proc"]["wrapper"] == rows["ddp"]["wrapper"] == "DDP"
    assert "DDP's own cost" in rows["ddp-1proc"]["about"]
    assert "ddp-torchrun" not in json.dumps(rows["ddp-1proc-noddp"])
    md = (out / "benchmark.md").read_text()
    assert "| ddp-bf16 | torchrun x2 distributed_apex.py --amp bf16 | bf16 autocast | 2 | 32 |" in md
    assert ("- ddp-1proc-noddp (fp32; no wrapper, no process group (plain python)): distributed.py under plain "
            "python: one process, no process group, no DDP wrapper") in md
    assert "fp32 rows compute in float32 (no TF32 on this device)" in md


def test_ceiling_rows(quick_run):
    """The step alone in NCHW and in channels_last runs in --quick on the CPU; the CUDA-graphed
    one is reported as skipped, with its reason, in the json, the markdown and the console."""
    proc, out, report = quick_run
    rows = rows_by_name(report)
    for name, channels_last in zip(QUICK_CEILINGS, (False, True)):
        row = rows[name]
        assert row["status"] == "ok", row
        assert (row["channels_last"], row["compile_mode"]) == (channels_last, None)
        assert len(row["window_seconds"]) == 3
        # one device's rate (16 images per step) times the 2 devices of the multi-process rows
        per_device = [4 * 16 / s for s in row["window_seconds"]]
        assert row["median_images_per_second"] == pytest.approx(2 * statistics.median(per_device))
        assert row["min_images_per_second"] == pytest.approx(2 * min(per_device))
        assert row["max_images_per_second"] == pytest.approx(2 * max(per_device))
        assert row["min_images_per_second"] <= row["median_images_per_second"] <= row["max_images_per_second"]
        assert (row["timed_count"], row["timed_unit"]) == (3, "windows")
        assert row["median_whole_epoch_images_per_second"] is None  # no epochs, no whole-epoch figure
        assert row["median_images_per_second"] > 0 and row["global_batch"] == 32
    assert "the step alone: NCHW, eager, 16 random images on cpu" in rows["ceiling-bf16-nchw"]["short_command"]
    graphs = rows["ceiling-bf16-cudagraphs"]
    assert (graphs["status"], graphs["reason"]) == ("skipped", "CUDA graphs need a GPU")
    assert graphs["compile_mode"] == "reduce-overhead" and graphs["mirrors"] == "fast-bf16-cudagraphs"
    assert "- ceiling-bf16-cudagraphs: skipped: CUDA graphs need a GPU" in (out / "benchmark.md").read_text()
    assert "    skipped: CUDA graphs need a GPU" in proc.stdout
    # The console's summary is the markdown's table.
    table = next(line for line in proc.stdout.splitlines() if line.startswith("| ceiling-bf16-cudagraphs |"))
    assert table in (out / "benchmark.md").read_text().splitlines() and "| skipped |" in table


def test_ratios_are_computed_from_rows_of_the_same_run(quick_run):
    _, out, report = quick_run
    rows = rows_by_name(report)
    # Per device: the one-process rows do one device's share of the all-device rows' work.
    rate = {name: rows[name]["median_images_per_second"] / rows[name]["devices"]
            for name in rows if rows[name]["status"] == "ok"}
    ratios = {tuple(c["rows"]): c["ratio"] for c in report["comparisons"]}
    pairs = [("ddp-1proc", "ddp-1proc-noddp"), ("ddp", "ddp-1proc"), ("ddp-bf16", "ddp"),
             ("ceiling-bf16-channels-last", "ceiling-bf16-nchw"), ("ddp-bf16", "ceiling-bf16-channels-last")]
    assert ratios == {(a, b): pytest.approx(rate[a] / rate[b]) for a, b in pairs}
    # Measured figures and ratios only: no goal typed into the report, no verdict on it.
    text = (out / "benchmark.md").read_text() + (out / "benchmark.json").read_text()
    for word in ("PASS", "FAIL", "target", "70,000"):
        assert word not in text


def test_markdown_table_has_every_row(quick_run):
    _, out, report = quick_run
    text = (out / "benchmark.md").read_text()
    assert f"PyTorch {torch.__version__}" in text
    assert report["header"]["command"] in text
    rows = rows_by_name(report)
    for name in QUICK_SCRIPT_ROWS + QUICK_CEILINGS:
        line = next((line for line in text.splitlines() if line.startswith(f"| {name} |")), None)
        assert line is not None, f"no table line for {name}"
        row = rows[name]
        spread = f"{row['min_images_per_second']:,.0f}-{row['max_images_per_second']:,.0f}"
        two = " (mean of 2)" if name in QUICK_SCRIPT_ROWS else ""  # 2 timed epochs; the ceilings time 3 windows
        assert f"| {row['median_images_per_second']:,.0f}{two} | {spread} |" in line, line
    ddp = rows["ddp"]
    whole = (f"| {ddp['median_whole_epoch_images_per_second']:,.0f} (mean of 2) "
             f"| {ddp['min_whole_epoch_images_per_second']:,.0f}-{ddp['max_whole_epoch_images_per_second']:,.0f} |")
    assert (f"| ddp | torchrun x2 distributed.py | fp32 | 2 | 32 | {ddp['median_images_per_second']:,.0f} (mean of 2) |"
            in text)
    assert f"{whole} 4 x 32 = 128 | {ddp['median_epoch_seconds']:.2f} |" in text
    assert f"| {ddp['min_images_per_second']:,.0f}-{ddp['max_images_per_second']:,.0f} | 2 x 3 | " in text
    assert "| ceiling-bf16-nchw |" in text and "| 3 x 4 |" in text  # 3 windows of 4 steps
    assert "| ddp-bf16 / ddp | bf16 autocast against fp32, template path |" in text


def test_flops_per_image_are_flop_counter_s_own_count(quick_run):
    from torch.utils.flop_counter import FlopCounterMode

    from models import build_model

    _, _, report = quick_run
    model = build_model("resnet_tiny", 100)
    image = torch.randn(1, 3, 32, 32)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(image), torch.tensor([7])).backward()
    assert report["flops"]["train_step_per_image"] == counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        model(image)
    assert report["flops"]["forward_per_image"] == counter.get_total_flops()


@pytest.mark.gpu
def test_the_ceilings_on_a_gpu(tmp_path):
    """The three ceilings of the bf16 step on one GPU, the CUDA-graphed one included (it fails
    if torch.compile ran any graph without CUDA graphs), and fp32's label there."""
    if torch.cuda.get_device_capability(0) < (8, 0):
        pytest.skip("the bf16 ceilings need bfloat16 hardware (Ampere or newer)")
    names = ["ceiling-bf16-nchw", "ceiling-bf16-channels-last", "ceiling-bf16-cudagraphs", "ceiling-fp32"]
    run_script([TOOL, "--quick", "--device", "cuda", "--nproc", "1", "--rows", ",".join(names),
                "--row-timeout", "120", "--out", tmp_path], timeout=140, env=gpu_subprocess_env())
    report = json.loads((tmp_path / "benchmark.json").read_text())
    rows = rows_by_name(report)
    assert sorted(rows) == sorted(names)  # in the table's order, not --rows'
    for name in names:
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["min_images_per_second"] <= rows[name]["max_images_per_second"]
    assert report["settings"]["tf32_convolutions"] is True  # Ampere or newer, cuDNN's default
    assert rows["ceiling-fp32"]["precision"] == "fp32 (TF32 convolutions and matmuls)"


# --- the arithmetic, on hand-made records ----------------------------------------------------

def test_medians_and_share_of_peak(tool):
    # Epoch 1's peak is the largest, as cudnn's autotuning made it on an H200 (7,887 MiB, then 2,521).
    records = [
        {"event": "epoch", "epoch": 1, "images_per_second": 10.0, "epoch_seconds": 9.0, "peak_memory_mb": 900.0},
        {"event": "epoch", "epoch": 2, "images_per_second": 300.0, "epoch_seconds": 2.0, "peak_memory_mb": 120.0},
        {"event": "epoch", "epoch": 3, "images_per_second": 100.0, "epoch_seconds": 3.0, "peak_memory_mb": 110.0},
        {"event": "epoch", "epoch": 4, "images_per_second": 200.0, "epoch_seconds": 2.5, "peak_memory_mb": 115.0},
        {"event": "end", "epoch": 4, "images_per_second": 999.0, "epoch_seconds": 1.0, "peak_memory_mb": 500.0},
    ]
    for step, r in enumerate(records[:4], 1):  # 8 steps of 50 images per epoch
        r.update(step=8 * step, global_batch=50)
    summary = tool.summarize_epochs(records)
    assert summary["median_images_per_second"] == 200.0  # epochs 2..4; the warm-up's 10 and the end record left out
    assert (summary["min_images_per_second"], summary["max_images_per_second"]) == (100.0, 300.0)
    # Whole epochs: 8 x 50 = 400 images over 2.0, 3.0 and 2.5 s.
    assert summary["median_whole_epoch_images_per_second"] == 160.0
    assert (summary["min_whole_epoch_images_per_second"], summary["max_whole_epoch_images_per_second"]) == (
        pytest.approx(400 / 3), 200.0)
    assert summary["median_epoch_seconds"] == 2.5
    assert summary["counted_epochs"] == [2, 3, 4] and not summary["warmup_included"]
    assert summary["peak_memory_mb"] == 120.0  # of the counted epochs: not the warm-up's 900
    assert [e["peak_memory_mb"] for e in summary["epochs"]] == [900.0, 120.0, 110.0, 115.0]
    assert summary["timed_steps"] == 6  # 8 steps an epoch, the first min(10, 8 // 4) = 2 left out
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2, 3, 4]
    assert tool.share_of_peak(200.0, 3e9, 1.0) == pytest.approx(0.6)  # 6e11 FLOP/s of 1e12
    assert tool.share_of_peak(200.0, 3e9, None) is None
    # An even number of epochs after warm-up: the mean of the middle two.
    assert tool.summarize_epochs(records[:3])["median_images_per_second"] == 200.0
    # One epoch only: it is all there is, and the summary says so. No GPU: no memory figure.
    assert tool.summarize_epochs(records[:1])["peak_memory_mb"] == 900.0
    alone = tool.summarize_epochs([dict(records[0], peak_memory_mb=None)])
    assert alone["median_images_per_second"] == 10.0 and alone["warmup_included"]
    assert alone["peak_memory_mb"] is None


def test_whole_epochs_and_the_spread_on_hand_made_records(tool):
    """Epochs of 20 steps of 64 images, the first 5 left out of the steady rate (min(10, 20/4)).
    When those first steps are slower than the rest, the whole epoch's rate is below the
    steady one; with one epoch after warm-up there is a median and no spread, and the report
    says so instead of printing a min-max of one value."""
    def epoch(n, first_seconds, rest_seconds):
        return {"event": "epoch", "epoch": n, "step": 20 * n, "global_batch": 64,
                "images_per_second": 15 * 64 / rest_seconds, "epoch_seconds": first_seconds + rest_seconds}

    records = [epoch(1, 3.0, 1.5), epoch(2, 0.9, 1.2), epoch(3, 0.6, 1.0), epoch(4, 0.8, 1.1)]
    summary = tool.summarize_epochs(records)
    for e in summary["epochs"]:
        assert e["steps"] == 20
        assert e["whole_epoch_images_per_second"] == pytest.approx(20 * 64 / e["epoch_seconds"])
        assert e["whole_epoch_images_per_second"] < e["images_per_second"]  # the slow first steps count
    for what in ("", "whole_epoch_"):
        low, median, high = (summary[f"{k}_{what}images_per_second"] for k in ("min", "median", "max"))
        assert low < median < high
    assert summary["median_whole_epoch_images_per_second"] < summary["median_images_per_second"]
    assert summary["median_whole_epoch_images_per_second"] == pytest.approx(20 * 64 / 1.9)  # epoch 4's 1.9 s
    assert (summary["timed_count"], summary["timed_unit"]) == (3, "epochs")
    assert tool.spread_text(summary) == f"{15 * 64 / 1.2:,.0f}-{15 * 64 / 1.0:,.0f}"

    one = tool.summarize_epochs(records[:2])
    assert one["timed_count"] == 1 and one["median_images_per_second"] == pytest.approx(15 * 64 / 1.2)
    assert one["min_images_per_second"] is None and one["max_images_per_second"] is None
    assert one["min_whole_epoch_images_per_second"] is None
    assert tool.spread_text(one) == tool.spread_text(one, "whole_epoch_") == "one timed epoch"
    assert tool.spread_text(tool.summarize_epochs(records[:1])) == "one timed epoch (warm-up)"


def test_precision_labels_follow_the_flags_and_the_device(tool, monkeypatch):
    """fp32 on a CUDA GPU from Ampere on runs its convolutions in TF32: cuDNN's default, which no
    script turns off; distributed_apex.py (and the ceilings' process) also turn it on for
    matmuls. The CPU has no TF32. FSDP2's bf16 row has no --amp: its precision is its policy."""
    assert torch.backends.cudnn.allow_tf32 is True  # the default the label rests on
    rows = {r.name: r for r in [*tool.ROWS, *tool.CEILINGS]}
    on_gpu, on_cpu = gpu_plan(tool, procs=1), gpu_plan(tool, procs=1)
    on_gpu.tf32, on_cpu.use_cuda = True, False
    expected = {
        "dp": ("fp32", "fp32 (TF32 convolutions)"),
        "ddp": ("fp32", "fp32 (TF32 convolutions)"),
        "ddp-1proc-noddp": ("fp32", "fp32 (TF32 convolutions)"),
        "fsdp2": ("fp32", "fp32 (TF32 convolutions)"),
        "fast-fp32": ("fp32", "fp32 (TF32 convolutions and matmuls)"),
        "ceiling-fp32": ("fp32", "fp32 (TF32 convolutions and matmuls)"),
        "ddp-bf16": ("bf16", "bf16 autocast"),
        "ddp-fp16": ("fp16", "fp16 autocast + GradScaler"),
        "fsdp2-bf16": ("bf16", "bf16 (FSDP2 MixedPrecisionPolicy: bf16 compute, fp32 gradient reduction)"),
        "ceiling-bf16-nchw": ("bf16", "bf16 autocast"),
        "ceiling-bf16-cudagraphs": ("bf16", "bf16 autocast"),
    }
    for name, (amp, label) in expected.items():
        assert tool.row_precision(rows[name], on_gpu) == (amp, label), name
        assert tool.base_result(rows[name], on_gpu)["precision"] == label
        cpu_label = "fp32" if amp == "fp32" else label
        assert tool.row_precision(rows[name], on_cpu) == (amp, cpu_label), name
    assert tool.base_result(rows["fsdp2-bf16"], on_gpu)["amp"] == "bf16"
    # TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, which every row inherits, turns TF32 matmuls on in all of them.
    overridden = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_float32_matmul_precision())"],
                                env={**os.environ, "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"},
                                capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setattr(tool.torch, "get_float32_matmul_precision", lambda: overridden)
    assert tool.row_precision(rows["ddp"], on_gpu) == ("fp32", "fp32 (TF32 convolutions and matmuls)")
    # Which GPUs have TF32: Ampere (8.0) and newer.
    monkeypatch.setattr(tool.torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert tool.tf32_convolutions(True) is False
    monkeypatch.setattr(tool.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert tool.tf32_convolutions(True) is True and tool.tf32_convolutions(False) is False


def test_every_row_says_what_wraps_its_model(tool):
    """Under a launcher the scripts wrap the model at every world size, one process included;
    under plain python in nothing. No `about` claims otherwise."""
    rows = {r.name: r for r in tool.ROWS}
    plan = gpu_plan(tool, procs=1)
    assert tool.row_wrapper(rows["ddp-1proc-noddp"], plan) == "no wrapper, no process group (plain python)"
    assert tool.row_wrapper(rows["fast-bf16-cudagraphs"], plan) == "no wrapper, no process group (plain python)"
    assert tool.row_wrapper(rows["ddp-1proc"], plan) == tool.row_wrapper(rows["ddp-spawn"], plan) == "DDP"
    assert tool.row_wrapper(rows["fsdp2-bf16"], plan) == "FSDP2 fully_shard"
    assert tool.row_wrapper(rows["dp"], plan) == "nn.DataParallel"
    assert tool.base_result(rows["ddp-1proc"], plan)["wrapper"] == "DDP"
    assert "DDP's own cost" in rows["ddp-1proc"].about and "no DDP" in rows["ddp-1proc-noddp"].about
    plan.tf32 = True
    for row in tool.ROWS:  # precision is the report's own column, derived from the flags
        assert "TF32" not in row.about and (tool.row_precision(row, plan)[0] != "fp32" or "fp32" not in row.about), row


def test_the_ceiling_rows_and_their_skips(tool):
    """Three ceilings of the same bf16 step: NCHW, channels_last, CUDA graphs (GPU only, as are
    the compiled ones); bf16 ones are skipped where bf16 does not run."""
    ceilings = {c.name: c for c in tool.CEILINGS}
    nchw, channels_last, graphs = (ceilings[f"ceiling-bf16-{n}"] for n in ("nchw", "channels-last", "cudagraphs"))
    assert (nchw.channels_last, nchw.compile_mode) == (False, "")
    assert (channels_last.channels_last, channels_last.compile_mode) == (True, "")
    assert (graphs.channels_last, graphs.compile_mode) == (True, "reduce-overhead")
    assert {nchw.dtype, channels_last.dtype, graphs.dtype} == {"bf16"}
    assert graphs.about == "channels_last, torch.compile reduce-overhead (CUDA graphs)"
    gpu = gpu_plan(tool, procs=2)
    cpu = cpu_plan(tool, epochs=3)
    assert [tool.skip_reason(c, gpu) for c in (nchw, channels_last, graphs)] == ["", "", ""]
    assert [tool.skip_reason(c, cpu) for c in (nchw, channels_last)] == ["", ""]
    assert tool.skip_reason(graphs, cpu) == "CUDA graphs need a GPU"
    assert {tool.skip_reason(c, cpu) for c in tool.CEILINGS if c.compile_mode} == {
        "torch.compile on the CPU spends minutes compiling for a run of seconds", "CUDA graphs need a GPU"}
    gpu.bf16 = False
    assert tool.skip_reason(graphs, gpu) == "this GPU has no bfloat16 hardware (Ampere or newer needed)"


# What inductor prints for each graph it runs without CUDA graphs, 2.14 (cudagraph_utils.py:401; 2.11: :207).
SKIP_LINE = ("W1130 11:13:30.308000 28975 torch/_inductor/cudagraph_utils.py:401] [__cudagraphs] skipping "
             "cudagraphs due to mutated inputs (1 instances)")


@pytest.mark.parametrize("name", ["ceiling-bf16-cudagraphs", "fast-bf16-cudagraphs", "fast-bf16-cudagraphs-ddp"])
def test_a_cuda_graphed_row_that_ran_without_graphs_fails(tool, tmp_path, monkeypatch, name):
    """If torch.compile falls back to running a graph without CUDA graphs, a row named for them
    measures something else: failed, with the reason from its log, which its environment asks
    inductor for (TORCH_LOGS, whatever the user's quiets). The same output without that line is ok."""
    plan = gpu_plan(tool, procs=2)
    plan.ceiling_steps, plan.ceiling_windows = 4, 2
    row = {r.name: r for r in [*tool.ROWS, *tool.CEILINGS]}[name]
    monkeypatch.setenv("TORCH_LOGS", "-inductor")
    skipped = True

    def measured(cmd, env, timeout, log_path, finished=None, budget=None):
        assert env["TORCH_LOGS"] == "-inductor,cudagraphs"
        out = cmd[cmd.index("--out" if "--measure-ceiling" in cmd else "--metrics") + 1]
        with open(out, "w") as f:
            if "--measure-ceiling" in cmd:
                json.dump({"window_seconds": [0.5, 0.25], "warmup_steps": 20, "peak_memory_mb": 1.0}, f)
            else:
                for epoch in (1, 2, 3):
                    f.write(json.dumps({"event": "epoch", "epoch": epoch, "step": 12 * epoch, "global_batch": 1024,
                                        "world_size": tool.row_shape(row, plan)[0], "images_per_second": 9e4,
                                        "epoch_seconds": 0.2}) + "\n")
                f.write(json.dumps({"event": "end", "epoch": 3}) + "\n")
        assert finished()
        return 0, "compiling\n" + (f"{SKIP_LINE}\n" if skipped else "") + "epoch 3/3\n"

    monkeypatch.setattr(tool, "run_process", measured)
    run = tool.run_ceiling if name.startswith("ceiling") else tool.run_row
    result = run(row, plan, str(tmp_path))
    assert result["status"] == "failed", result
    assert result["reason"] == ("torch.compile ran without CUDA graphs (1 skip(s) logged): " + SKIP_LINE)
    assert result["median_images_per_second"] > 0  # timed all the same, in the json
    skipped = False
    assert run(row, plan, str(tmp_path))["status"] == "ok"


def test_the_ceiling_s_peak_memory_leaves_out_its_warm_up(tool, monkeypatch):
    """cudnn's autotuning and torch.compile take their memory in the first steps: the peak is
    read over the timed steps only, after a reset, as the rows' is over their counted epochs."""
    events = []
    real_cross_entropy = tool.F.cross_entropy

    def counted_cross_entropy(*args, **kwargs):
        events.append("step")
        return real_cross_entropy(*args, **kwargs)

    monkeypatch.setattr(tool.F, "cross_entropy", counted_cross_entropy)
    monkeypatch.setattr(tool.metrics, "reset_peak_memory", lambda device: events.append("reset"))
    monkeypatch.setattr(tool.metrics, "peak_memory_mb",
                        lambda device: {"peak_memory_mb": float(len(events) - events.index("reset") - 1)})
    spec = {"device": "cpu", "dtype": "fp32", "batch": 2, "model": "resnet_tiny", "channels_last": False,
            "compile_mode": "", "warmup": 3, "steps": 2, "windows": 2}
    measured = tool.measure_ceiling(spec)
    assert events == ["step"] * 3 + ["reset"] + ["step"] * 4
    assert measured["peak_memory_mb"] == 4.0  # what the fake says of the steps after the reset


def test_the_rows_read_the_synthetic_set_from_cifar_files(tool, monkeypatch, tmp_path):
    """Written image for image in CIFAR-100's layout, read back by the scripts' own reader as the
    same images and labels; only a run with script rows writes them, and main removes them."""
    import argparse
    from utils import data
    from utils.distributed import DistEnv
    monkeypatch.setattr(tool.tempfile, "tempdir", str(tmp_path))
    plan = cpu_plan(tool, steps=2, names=["ceiling-bf16-nchw"])
    tool.write_synthetic_files(plan)
    assert plan.synthetic_files == "" and os.listdir(tmp_path) == []  # the step alone reads no data
    # A folder left by a run that was killed goes; one of a run still alive (this process) stays.
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"benchmark-synthetic-{dead.pid}-killed").mkdir()
    (tmp_path / f"benchmark-synthetic-{os.getpid()}-running").mkdir()
    plan.names = ["ddp-1proc", "ddp", "ceiling-bf16-nchw"]
    tool.write_synthetic_files(plan)
    assert os.path.dirname(plan.synthetic_files) == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([f"benchmark-synthetic-{os.getpid()}-running",
                                                   os.path.basename(plan.synthetic_files)])
    ddp = {r.name: r for r in tool.ROWS}["ddp"]
    command = tool.row_command(ddp, plan, "m.jsonl", 0)
    assert command[command.index("--dataset") + 1] == "cifar100"
    assert command[command.index("--data-dir") + 1] == plan.synthetic_files
    typed = tool.row_command(ddp, plan, "m.jsonl", 0, as_typed=True)  # the report's: the same images
    assert typed[typed.index("--dataset") + 1] == "synthetic" and "--data-dir" not in typed
    args = argparse.Namespace(dataset="cifar100", data_dir=plan.synthetic_files, train_samples=None,
                              test_samples=None, seed=0)
    train, test = data.build_datasets(args, DistEnv(0, 0, 1, 1, torch.device("cpu"), distributed=False))
    assert (len(train), len(test)) == (64, 2)  # ddp: 2 steps of 32; a row evaluates one image per process
    for files, synthetic in ((train.base, data.SyntheticCIFAR(True, 64)), (test.base, data.SyntheticCIFAR(False, 2))):
        assert files.targets == synthetic.targets and files.classes == synthetic.classes
        assert all(np.array_equal(files[i][0], synthetic[i][0]) for i in range(len(synthetic)))


def test_timed_steps_are_those_the_scripts_time(tool):
    """The timed column's steps per epoch are the ones utils.metrics.EpochTimer counts in images/s:
    on 8 GPUs an epoch of 12 steps times 9 of them, on one GPU 87 of 97."""
    from utils.metrics import EpochTimer

    for steps in (1, 3, 4, 12, 48, 97, 400):
        timer = EpochTimer(torch.device("cpu"), 1, steps)
        for _ in range(steps):
            timer.step()
        timer.stop()
        assert tool.timed_steps(steps) == steps - (timer.warmup_steps if steps > timer.warmup_steps else 0), steps
    assert (tool.timed_steps(12), tool.timed_steps(97)) == (9, 87)


@pytest.mark.parametrize("new_session", [False, True], ids=["its-group", "a-session-of-its-own"])
def test_a_process_that_outlives_its_launcher_is_reported(tool, tmp_path, monkeypatch, new_session):
    """A row whose launcher exits 0 with a process it started still running EXIT_SECONDS later
    (a job that would hold its node) keeps its figures and says so, as when its processes do
    not exit after its end record; the process is ended. So is one in a session of its own, as
    torchrun starts its workers (start_new_session). One that ends within the time is no fault."""
    monkeypatch.setattr(tool, "EXIT_SECONDS", 3.0)
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "leaves_a_child.py"
    script.write_text(
        "import json, subprocess, sys\n"
        "metrics = sys.argv[sys.argv.index('--metrics') + 1]\n"
        "with open(metrics, 'w') as f:\n"
        "    for epoch in (1, 2):\n"
        "        f.write(json.dumps({'event': 'epoch', 'epoch': epoch, 'step': 4 * epoch, 'global_batch': 16,\n"
        "                            'world_size': 1, 'images_per_second': 100.0, 'epoch_seconds': 0.64}) + '\\n')\n"
        "    f.write(json.dumps({'event': 'end', 'epoch': 2}) + '\\n')\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import sys, time; time.sleep(float(sys.argv[1]))', "
        f"sys.argv[sys.argv.index('--child-seconds') + 1]], start_new_session={new_session})\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n")
    plan = cpu_plan(tool)
    result = tool.run_row(tool.Row("leaves-a-child", str(script), "python", False, ("--child-seconds", "120")),
                          plan, str(tmp_path))
    assert result["status"] == "ok" and result["median_images_per_second"] == 100.0, result
    assert result["did_not_exit"] == ("wrote its figures, but 1 of its processes still ran 3 s after its launcher "
                                      "exited: they were ended"), result
    assert not is_running(int(pid_file.read_text()))
    result = tool.run_row(tool.Row("leaves-a-child", str(script), "python", False, ("--child-seconds", "1")),
                          plan, str(tmp_path))
    assert result["status"] == "ok" and "did_not_exit" not in result, result


def test_a_group_of_zombies_is_ended_at_once(tool):
    """A process group whose members have all exited but are not reaped (zombies: a container's
    init may never reap an orphan) has nothing left to end: ending the row does not wait for it."""
    pid = os.fork()
    if pid == 0:  # a group of its own, then exit without being reaped
        os.setpgid(0, 0)
        os._exit(0)
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # it has exited; it stays a zombie
        os.killpg(pid, 0)  # the group is still there
        launcher = types.SimpleNamespace(pid=pid, poll=lambda: 0)  # the launcher, reaped
        started = time.monotonic()
        tool.end_group(launcher, "no-such-row")
        assert time.monotonic() - started < tool.TERM_SECONDS / 2
    finally:
        os.waitpid(pid, 0)


def test_the_dp_rows_on_the_cpu_say_what_they_train(tool):
    """Without GPUs dataparallel.py trains the plain module on one device: the row says so and
    trains one device's batch, as the other one-device rows do."""
    plan = cpu_plan(tool)
    for name in ("dp", "dp-bf16"):
        result = tool.base_result(rows_by_name_of(tool)[name], plan)
        assert result["wrapper"] == "no wrapper (CPU: nn.DataParallel needs GPUs)"
        assert (result["processes"], result["global_batch"], result["devices"]) == (1, 16, 1)
        assert result["about"] == rows_by_name_of(tool)[name].about  # the wrapper column says it, once
    assert tool.base_result(rows_by_name_of(tool)["dp"], gpu_plan(tool, 2))["wrapper"] == "nn.DataParallel"


@pytest.mark.parametrize("name, record, reason", [
    ("ddp", {"world_size": 1}, "the row asks for world_size 2 but its script recorded 1"),
    ("ddp-bf16", {"world_size": 2, "amp": "fp16"}, "the row asks for amp 'bf16' but its script recorded 'fp16'"),
    ("fsdp2-bf16", {"world_size": 2, "mp_policy": "none"}, "the row asks for mp_policy 'bf16' but its script "
                                                           "recorded 'none'"),
    ("fsdp2-bf16", {"world_size": 2}, "the row asks for mp_policy 'bf16' but its script recorded None"),
])
def test_a_record_that_contradicts_its_row_fails_it(tool, tmp_path, monkeypatch, name, record, reason):
    """What the script recorded it ran (its world size; its amp; FSDP2's mixed-precision policy)
    must be what the row asked for; the row fails otherwise, with the claim that differs."""
    plan = gpu_plan(tool, procs=2)

    def measured(cmd, env, timeout, log_path, finished=None, budget=None):
        with open(cmd[cmd.index("--metrics") + 1], "w") as f:
            for epoch in (1, 2):
                f.write(json.dumps({"event": "epoch", "epoch": epoch, "step": 4 * epoch, "global_batch": 1024,
                                    "images_per_second": 9e4, "epoch_seconds": 0.2, **record}) + "\n")
            f.write(json.dumps({"event": "end", "epoch": 2}) + "\n")
        return 0, "done\n"

    monkeypatch.setattr(tool, "run_process", measured)
    result = tool.run_row(rows_by_name_of(tool)[name], plan, str(tmp_path))
    assert (result["status"], result["reason"]) == ("failed", reason)
    good = {"world_size": 2, **({"amp": "bf16"} if name == "ddp-bf16" else {}),
            **({"mp_policy": "bf16"} if name == "fsdp2-bf16" else {})}
    record = good  # what measured() writes from here on
    assert tool.run_row(rows_by_name_of(tool)[name], plan, str(tmp_path))["status"] == "ok"


def test_a_median_of_two_epochs_is_called_their_mean(tool):
    """With two timed epochs their median is their mean: the table and the console say so; with
    three it is a median and says nothing more."""
    def row(epochs):
        records = [{"event": "epoch", "epoch": n, "step": 4 * n, "global_batch": 16, "images_per_second": 100.0 * n,
                    "epoch_seconds": 1.0} for n in range(1, epochs + 1)]
        return {"name": "ddp", "short_command": "torchrun x2 distributed.py", "precision": "fp32", "processes": 2,
                "global_batch": 16, "status": "ok", "share_of_peak": None, "vs_baseline": 1.0,
                "steps_per_epoch": 4, **tool.summarize_epochs(records)}

    two, three = (tool.summary_lines({"rows": [row(n)], "comparisons": []})[2] for n in (3, 4))
    assert two.startswith("| ddp | torchrun x2 distributed.py | fp32 | 2 | 16 | 250 (mean of 2) | 200-300 | 2 x 3 "
                          "| 64 (mean of 2) | 64-64 |"), two
    assert "| 300 | 200-400 |" in three and "mean" not in three, three


def test_an_epoch_is_the_whole_batches_of_cifar(tool):
    ddp = rows_by_name_of(tool)["ddp"]
    steps = {procs: tool.row_shape(ddp, gpu_plan(tool, procs))[3] for procs in (1, 2, 8)}
    assert steps == {1: 97, 2: 48, 8: 12} and 97 * 512 == 49_664
    plan = gpu_plan(tool, 1)
    plan.steps = 5
    assert tool.row_shape(ddp, plan)[3] == 5  # --steps wins


def test_row_shapes_on_a_gpu(tool):
    plan = gpu_plan(tool, procs=1)
    rows = {r.name: r for r in tool.ROWS}
    # (processes, global batch, devices, steps per epoch)
    assert tool.row_shape(rows["ddp"], plan) == (1, 512, 1, 97)
    assert tool.row_shape(rows["fast-bf16-compile-1024"], plan) == (1, 1024, 1, 48)
    plan = gpu_plan(tool, procs=8)
    assert tool.row_shape(rows["ddp"], plan) == (8, 4096, 8, 12)
    assert tool.row_shape(rows["ddp-1proc-noddp"], plan) == (1, 512, 1, 97)
    assert tool.row_shape(rows["fast-bf16-cudagraphs"], plan) == (1, 512, 1, 97)
    assert tool.row_shape(rows["dp"], plan) == (1, 4096, 8, 12)
    command = tool.row_command(rows["fast-bf16-compile-1024"], plan, "m.jsonl", 0)
    assert command[command.index("--batch-size") + 1] == "8192"
    assert command[command.index("--train-samples") + 1] == str(6 * 8192)  # 50,000 // 8192 = 6 steps


def test_loader_workers_on_a_gpu_fit_in_shared_memory(tool, monkeypatch):
    """16 cores and one GPU: 15 workers by the cores. Each holds up to 2 prefetched training
    batches of 512 uint8 images in /dev/shm, 3.2 MB, and as many evaluation batches of one
    image (a row evaluates one image per process): Docker's 64 MB hold all 15. With less
    the benchmark starts as many as fit (more would die of a bus error), and says why."""
    fake_gpus(tool, monkeypatch, 1, cores=16)
    args = tool.build_parser().parse_args(["--rows", "ddp"])
    ddp = rows_by_name_of(tool)["ddp"]
    command = tool.row_command(ddp, tool.resolve_plan(args), "m.jsonl", 0)
    assert command[command.index("--test-samples") + 1] == "1"  # the evaluation batch counted here

    def estimate(workers):  # DataLoader's prefetch_factor, 2: batches of training (512) and evaluation (1)
        return workers * 2 * (512 + 1) * tool.LOADER_SAMPLE_BYTES

    for free, expected in ((None, 15), (2**40, 15), (64 * 2**20, 15), (40 * 2**20, 13), (20 * 2**20, 6),
                           (2 * 2**20, 0)):
        monkeypatch.setattr(tool.lifecycle, "shm_free_bytes", lambda path=None: free)
        plan = tool.resolve_plan(args)
        workers, note = tool.row_workers(ddp, plan)
        assert workers == expected, (free, workers)
        assert tool.base_result(ddp, plan)["workers"] == workers
        if free is not None and expected < 15:
            assert estimate(workers) <= free < estimate(workers + 1)
            assert note.startswith(f"15 by the cores, {expected} by the {free / 2**20:,.0f} MiB free")
        else:
            assert note == ""
    # Two GPUs: 7 workers each by the cores; both processes' workers share the one /dev/shm.
    fake_gpus(tool, monkeypatch, 2, cores=16)
    monkeypatch.setattr(tool.lifecycle, "shm_free_bytes", lambda path=None: 6 * estimate(1))
    assert tool.row_workers(ddp, tool.resolve_plan(args))[0] == 3  # 2 processes x 3 workers fill it: not 6, as for one
    # --workers is every row's, but for the rows whose data is on the device.
    plan = tool.resolve_plan(tool.build_parser().parse_args(["--workers", "5"]))
    assert [tool.row_workers(rows_by_name_of(tool)[n], plan)[0] for n in ("ddp", "dp", "fast-bf16")] == [5, 5, 0]


def test_a_data_dir_from_home_is_where_the_scripts_look(tool, monkeypatch, tmp_path):
    """--data-dir=~/data (the shell expands no ~ after "="): the scripts, and the benchmark's one load before the
    rows, read the home folder's; the rows, run in the repository root, were given ROOT/~/data."""
    monkeypatch.setenv("HOME", str(tmp_path))
    ddp = rows_by_name_of(tool)["ddp"]
    plan = tool.resolve_plan(tool.build_parser().parse_args(["--rows", "ddp", "--dataset", "cifar100", "--data-dir=~/data"]))
    command = tool.row_command(ddp, plan, "m.jsonl", 0)
    assert command[command.index("--data-dir") + 1] == str(tmp_path / "data")


def test_each_row_gets_the_loader_workers_of_its_own_processes(tool, monkeypatch):
    """8 GPUs, 32 cores: a DDP row's 8 processes get 32 // 8 - 1 = 3 workers each; dataparallel.py's
    one process, which loads the batch of all 8 GPUs, gets 16 (the cap), as do the one-process
    rows. /dev/shm is counted on the row's own batches: dp's one process holds as much as ddp's 8."""
    fake_gpus(tool, monkeypatch, 8, cores=32)
    monkeypatch.setattr(tool.lifecycle, "shm_free_bytes", lambda path=None: None)
    plan = tool.resolve_plan(tool.build_parser().parse_args([]))
    rows = rows_by_name_of(tool)

    def workers(name):
        return tool.row_workers(rows[name], plan)[0]

    assert workers("dp") >= 16 and workers("ddp-1proc") == 16
    assert workers("ddp") == workers("ddp-spawn") == 3 and workers("fast-bf16") == 0
    per_worker = 2 * (8 * 512 + 1) * tool.LOADER_SAMPLE_BYTES  # dp: one process, 4,096 images a step
    monkeypatch.setattr(tool.lifecycle, "shm_free_bytes", lambda path=None: 5 * per_worker)
    assert (workers("dp"), workers("ddp"), workers("ddp-1proc")) == (5, 3, 16)


def fake_gpus(tool, monkeypatch, count, cores):
    """`count` GPUs, and `cores` that this process may use (its affinity: taskset, a container's
    cpuset) on a machine that has more: the loader workers are sized from the former."""
    monkeypatch.setattr(tool.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tool.torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(tool.precision, "cuda_bf16_native", lambda *a: True)
    monkeypatch.setattr(tool.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(tool.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(tool.os, "cpu_count", lambda: 8 * cores)
    monkeypatch.setattr(tool.data, "CGROUP", "/no/cgroup/here")  # no container limit, whatever this machine has


def rows_by_name_of(tool):
    return {r.name: r for r in tool.ROWS}


def gpu_plan(tool, procs):
    return tool.Plan(use_cuda=True, gpus=procs, procs=procs, global_batch=512 * procs, per_device_batch=512,
                     steps=0, epochs=4, workers=8, model="resnet18", dataset="synthetic", data_dir="./data",
                     timeout=300, bf16=True, min_row_seconds=30, ceiling_warmup=20, ceiling_steps=50,
                     ceiling_windows=5)


def cpu_plan(tool, **changes):
    """--quick's plan on the CPU: 2 processes of 16 images, 2 epochs of 4 steps."""
    plan = tool.Plan(use_cuda=False, gpus=0, procs=2, global_batch=32, per_device_batch=16, steps=4, epochs=2,
                     workers=0, model="resnet_tiny", dataset="synthetic", data_dir="./data", timeout=60, bf16=True,
                     min_row_seconds=10, ceiling_warmup=2, ceiling_steps=4, ceiling_windows=3)
    return dataclasses.replace(plan, **changes)


def test_each_named_ratio_compares_rows_that_differ_in_what_it_names(tool):
    """A ratio credited to one change compares rows that differ in that change alone: two
    ceilings differ in one of precision, layout, compilation, CUDA graphs or batch; two script
    rows under different launchers (with DDP and without), or on all devices against one, say so;
    no caption names a per-device batch that --batch-size changes."""
    rows = {r.name: r for r in [*tool.ROWS, *tool.CEILINGS]}

    def ceiling_traits(c):
        return c.dtype, c.channels_last, c.compile_mode != "", c.compile_mode == "reduce-overhead", c.per_device_batch

    for a, b, what in tool.COMPARISONS:
        first, second = rows[a], rows[b]
        if isinstance(first, tool.Ceiling) and isinstance(second, tool.Ceiling):
            assert sum(x != y for x, y in zip(ceiling_traits(first), ceiling_traits(second))) == 1, (a, b, what)
        elif isinstance(first, tool.Row) and isinstance(second, tool.Row):
            if first.launcher != second.launcher:
                assert "DDP" in what, (a, b, what)
            if first.all_devices != second.all_devices:  # on several GPUs, scaling is in the ratio too
                assert "all devices" in what and re.search(r"\bone\b", what), (a, b, what)
        assert not re.search(r"\b(128|256|512)\b", what), (a, b, what)


def test_ratios_against_the_baseline_on_hand_made_rows(tool):
    rates = {"ddp": 10_000, "ddp-bf16": 17_000, "fast-bf16": 40_000, "ceiling-bf16-channels-last": 50_000,
             "dp": 5_000}
    rows = [{"name": n, "status": "ok", "median_images_per_second": r, "devices": 1} for n, r in rates.items()]
    rows.append({"name": "fast-bf16-compile", "status": "failed", "devices": 1})
    tool.add_derived(rows, {"train_step_per_image": 3e9}, 1000.0)
    by_name = {r["name"]: r for r in rows}
    assert by_name["fast-bf16"]["vs_baseline"] == pytest.approx(4.0)
    assert by_name["dp"]["vs_baseline"] == pytest.approx(0.5)
    assert by_name["fast-bf16"]["share_of_peak"] == pytest.approx(40_000 * 3e9 / 1e15)
    ratios = {tuple(c["rows"]): c["ratio"] for c in tool.comparisons(rows)}
    assert ratios == {("ddp-bf16", "ddp"): pytest.approx(1.7), ("fast-bf16", "ddp-bf16"): pytest.approx(40 / 17),
                      ("ddp-bf16", "ceiling-bf16-channels-last"): pytest.approx(0.34),
                      ("fast-bf16", "ceiling-bf16-channels-last"): pytest.approx(0.8)}  # nothing with the failed row
    # On 8 GPUs: ddp's 80,000 img/s are 10,000 per device; the one-process row's 20,000 are one
    # device's, twice ddp's per device (not a quarter of its total).
    rows = [{"name": "ddp", "status": "ok", "median_images_per_second": 80_000, "devices": 8},
            {"name": "fast-bf16-cudagraphs", "status": "ok", "median_images_per_second": 20_000, "devices": 1},
            {"name": "fast-bf16-cudagraphs-ddp", "status": "ok", "median_images_per_second": 96_000, "devices": 8}]
    tool.add_derived(rows, {"train_step_per_image": 3e9}, 1000.0)
    assert [r["vs_baseline"] for r in rows] == [pytest.approx(1.0), pytest.approx(2.0), pytest.approx(1.2)]
    assert [c["ratio"] for c in tool.comparisons(rows)] == [pytest.approx(12 / 20)]  # under DDP / without
    # Without the baseline row there is no ratio to it.
    rows = [r for r in rows if r["name"] != "ddp"]
    tool.add_derived(rows, {"train_step_per_image": 3e9}, None)
    assert all(r.get("vs_baseline") is None for r in rows)


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10", 125.0), ("NVIDIA L4", 121.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA GeForce RTX 4090", 165.0), ("Tesla V100-SXM2-16GB", 125.0),
    ("Tesla V100-PCIE-16GB", 112.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA RTX A1000", None), ("NVIDIA RTX A1000 6GB Laptop GPU", None),  # not an A100
    ("Some Future GPU", None),
])
def test_default_peak_by_gpu_name(tool, name, tflops):
    assert tool.default_peak(name)[0] == tflops


# --- bad input and failing rows --------------------------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["--rows", "ddp,nope"], "unknown row 'nope'"),
    (["--quick", "--device", "cpu", "--batch-size", "33"], "batch size 33 is not divisible by 2 processes"),
    (["--quick", "--device", "cpu", "--batch-size", "34", "--rows", "ddp-accum2"],
     "row ddp-accum2: global batch 34 does not split into 2 processes x 2 micro-batches"),
    (["--device", "cpu", "--batch-size", "30"], "row ddp-accum2: .* or leave the row out"),  # the default rows
    (["--quick", "--device", "cpu", "--epochs", "1"], "epoch 1 is warm-up"),
    (["--dataset", "cifar100", "--device", "cpu", "--steps", "2000", "--batch-size", "64"], "lower --steps"),
])
def test_bad_input_is_a_usage_error(tool, argv, fragment):
    from utils import cli
    with pytest.raises(cli.UsageError, match=fragment):
        tool.main(argv)


@pytest.mark.parametrize("rows", ["", ",", " , "])
def test_rows_that_name_no_row_are_refused(tool, rows):
    from utils import cli
    with pytest.raises(cli.UsageError, match="--rows names no row"):
        tool.resolve_plan(tool.build_parser().parse_args(["--quick", "--device", "cpu", "--rows", rows]))


def test_cifar100_that_cannot_be_had_is_refused_before_any_row(tmp_path):
    """--dataset cifar100 with an empty --data-dir and no way to download it (every proxy a closed
    port: no test waits on the internet): one line, exit status 2, no row started, nothing made in
    --out; the same check every script makes, once."""
    closed = "http://127.0.0.1:9"
    env = subprocess_env(http_proxy=closed, https_proxy=closed, HTTP_PROXY=closed, HTTPS_PROXY=closed)
    for key in ("no_proxy", "NO_PROXY"):
        env.pop(key, None)
    out = tmp_path / "out"
    proc = run_script([TOOL, "--quick", "--device", "cpu", "--rows", "ddp-1proc-noddp", "--dataset", "cifar100",
                       "--data-dir", tmp_path / "data", "--out", out], timeout=120, check=False, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and re.fullmatch(
        rf"benchmark\.py: error: CIFAR-100 is not in --data-dir {re.escape(str(tmp_path / 'data'))} and could not "
        r"be downloaded \(.*\); put cifar-100-python/ there or use --dataset synthetic for an offline run", line), line
    assert not out.exists() and "ddp-1proc-noddp" not in proc.stdout


def test_bf16_rows_are_skipped_where_the_cpu_has_no_bf16_autocast(tool, monkeypatch):
    monkeypatch.setattr(tool.precision, "cpu_autocast_works", lambda dtype: dtype != torch.bfloat16)
    plan = tool.resolve_plan(tool.build_parser().parse_args(["--quick", "--device", "cpu"]))
    rows = {r.name: r for r in [*tool.ROWS, *tool.CEILINGS]}
    for name in ("ddp-bf16", "ceiling-bf16-nchw"):
        assert tool.skip_reason(rows[name], plan) == "this PyTorch build has no bfloat16 autocast on the CPU"
    assert tool.skip_reason(rows["ddp"], plan) == tool.skip_reason(rows["ceiling-fp32"], plan) == ""


def test_bad_flag_is_one_line_and_exit_2(tool, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tool.build_parser().parse_args(["--rows", "ddp", "--nproc", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--nproc" in err, err


def test_failed_row_is_recorded_and_timeouts_end_every_process(tool, tmp_path):
    plan = cpu_plan(tool, epochs=3)
    broken = tool.Row("broken", str(tmp_path / "no_such_script.py"), "python", False)
    result = tool.run_row(broken, plan, str(tmp_path))
    assert result["status"] == "failed"
    assert result["reason"].startswith("exit status 2: ") and "No such file" in result["reason"]
    assert "No such file" in (tmp_path / "broken.log").read_text()  # the row's log is kept

    # A "script" that starts a child and then hangs: the timeout must end both.
    pid_file = tmp_path / "child.pid"
    hang = tmp_path / "hang.py"
    hang.write_text("import subprocess, sys, time\n"
                    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                    f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
                    "time.sleep(120)\n")
    plan.timeout = 3
    result = tool.run_row(tool.Row("hangs", str(hang), "python", False), plan, str(tmp_path))
    assert result["status"] == "failed" and result["reason"].startswith("timed out after 3 s")
    # Where it hung is in its log, as for a row that hangs after its work.
    log = (tmp_path / "hangs.log").read_text()
    assert re.search(r'File ".*hang\.py", line 4 in <module>', log.split("the Python stacks of its processes")[-1]), log
    child = int(pid_file.read_text())
    deadline = time.time() + 10
    while is_running(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not is_running(child), "the hung row's child process outlived the timeout"


def test_a_row_s_command_and_its_report_show_the_workers_it_ran_with(tool, tmp_path, monkeypatch):
    """/dev/shm fills up while the benchmark runs: the loader workers are read once per row, so
    that its command, the command the report shows and its workers column agree."""
    free = iter([2**40] + [0] * 10)  # room for the first read, none after
    monkeypatch.setattr(tool.lifecycle, "shm_free_bytes", lambda path=None: next(free))
    monkeypatch.setattr(tool.data, "cpu_limits", lambda: (4, None))  # 3 workers by the cores
    broken = tool.Row("broken", str(tmp_path / "no_such_script.py"), "python", False)
    result = tool.run_row(broken, cpu_plan(tool, workers=None), str(tmp_path))
    given = [re.search(r"--workers (\d+)", result[key])[1] for key in ("command", "display_command")]
    assert given == [str(result["workers"])] * 2 == ["3"] * 2, (given, result["workers"])


def test_a_run_without_a_chart_leaves_no_earlier_chart_behind(tool, tmp_path):
    """No row measured (or no matplotlib): no chart, and none of an earlier run beside the new md and json."""
    (tmp_path / "benchmark.png").write_bytes(b"an earlier run's chart")
    report = tool.Report(str(tmp_path), cpu_plan(tool), tool.describe_run(False, 0, 0, []),
                         tool.count_flops("resnet_tiny"), (None, "CPU"))
    assert report.write("complete")["chart"] is None
    assert sorted(os.listdir(tmp_path)) == ["benchmark.json", "benchmark.md"]


def test_a_row_that_is_skipped_here_is_reported_skipped_when_the_budget_is_used_up(tool, tmp_path):
    """A row that cannot run here is reported skipped, with its reason, when --time-budget is used up too."""
    tool.main(["--quick", "--device", "cpu", "--rows", "ceiling-bf16-cudagraphs,ceiling-fp32",
               "--time-budget", "1", "--out", str(tmp_path)])  # its stop handlers: conftest gives them back
    rows = rows_by_name(json.loads((tmp_path / "benchmark.json").read_text()))
    assert (rows["ceiling-bf16-cudagraphs"]["status"], rows["ceiling-bf16-cudagraphs"]["reason"]) == (
        "skipped", "CUDA graphs need a GPU")
    assert (rows["ceiling-fp32"]["status"], rows["ceiling-fp32"]["reason"]) == ("not run", "--time-budget 1 s used up")


def end_record_then_sleep(tmp_path, seconds) -> str:
    """A row's script that writes its figures and its end record at once, then takes `seconds` to exit."""
    script = tmp_path / "slow_exit.py"
    script.write_text(
        "import json, sys, time\n"
        "with open(sys.argv[sys.argv.index('--metrics') + 1], 'w') as f:\n"
        "    for epoch in (1, 2):\n"
        "        f.write(json.dumps({'event': 'epoch', 'epoch': epoch, 'step': 4 * epoch, 'global_batch': 16,\n"
        "                            'world_size': 1, 'images_per_second': 100.0, 'epoch_seconds': 0.64}) + '\\n')\n"
        "    f.write(json.dumps({'event': 'end', 'epoch': 2}) + '\\n')\n"
        f"time.sleep({seconds})\n")
    return str(script)


def test_an_end_record_near_the_timeout_leaves_the_processes_their_exit_seconds(tool, tmp_path):
    """The end record lands before the row's timeout and the processes exit 7 s later, after
    it but well within EXIT_SECONDS: they had their time to exit, so no hang. With --time-budget
    running out first, the row is cut short by the budget, not reported as hung."""
    plan = cpu_plan(tool, timeout=5)
    row = tool.Row("slow-exit", end_record_then_sleep(tmp_path, 7), "python", False)
    result = tool.run_row(row, plan, str(tmp_path))
    assert result["status"] == "ok" and "did_not_exit" not in result, result
    assert result["median_images_per_second"] == 100.0 and result["wall_seconds"] > 6
    plan.timeout = 60
    result = tool.run_row(row, plan, str(tmp_path), budget=3)
    assert result["status"] == "cut short" and "did_not_exit" not in result, result
    assert result["reason"] == ("--time-budget had 3 s left for it, and it needed more; its end record was written, "
                                "but its processes had not exited; its processes were ended")
    assert "Python stacks" not in (tmp_path / "slow-exit.log").read_text()  # not a hang


def test_ending_a_row_is_bounded(tool, tmp_path):
    """A row that ignores SIGTERM (and SIGABRT, so that the stack dump does not end it either)
    past its timeout of 2 s: its stacks, SIGTERM, then SIGKILL, all within ENDING_SECONDS, which
    --time-budget keeps back (REPORT_SECONDS) with time to write the report."""
    assert tool.ENDING_SECONDS + 5 <= tool.REPORT_SECONDS
    stubborn = tmp_path / "stubborn.py"
    stubborn.write_text("import signal, time\n"
                        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                        "signal.signal(signal.SIGABRT, signal.SIG_IGN)\n"
                        "time.sleep(600)\n")
    started = time.monotonic()
    status, _ = tool.run_process([sys.executable, str(stubborn)], subprocess_env(), 2, str(tmp_path / "s.log"))
    took = time.monotonic() - started
    # About 11 s: the timeout, then STACK_SECONDS and TERM_SECONDS waited out in full (it ignores
    # both signals), then SIGKILL; 5 s more for a busy CPU.
    assert status is None and took < 2 + tool.ENDING_SECONDS + 5, took
    assert not row_commands(str(stubborn))


def test_a_row_whose_processes_do_not_exit_keeps_its_figures_and_its_stacks(tool, tmp_path, monkeypatch):
    """torchrun, 2 processes; rank 1 never returns from the scripts' last call (cleanup(),
    where destroy_process_group runs), as a real job can hang after its work. The row is
    measured all the same and ended EXIT_SECONDS after its end record: the stacks of the
    launcher and of the ranks still running are in its log, one after the other, the hung
    rank's naming the call it is stuck in; the result says so; nothing outlives the row."""
    monkeypatch.setattr(tool, "EXIT_SECONDS", 5.0)  # 30 s by default: the same path, less waiting
    monkeypatch.setenv("FAULT_INJECTION", "--fault hang-at-exit --rank 1 -- distributed.py")
    plan = cpu_plan(tool, workers=1, timeout=120)
    row = tool.Row("ddp-hangs", FAULTS, "torchrun", True)
    result = tool.run_row(row, plan, str(tmp_path))
    log = (tmp_path / "ddp-hangs.log").read_text()
    assert result["status"] == "ok" and result["median_images_per_second"] > 0, (result, log)
    assert "hang-at-exit on rank 1" in log, log
    assert result["wall_seconds"] < 100, result  # ended by the exit rule, before the timeout
    assert re.fullmatch(r"wrote its figures, but its processes had not exited \d+ s after its end record: they were "
                        r"ended; their stacks are in its log", result["did_not_exit"]), result
    stacks = log.split("the Python stacks of its processes follow (SIGABRT) ---", 1)[1]
    # Rank 1 (rank 0 has exited), then torchrun's agent: two whole dumps, in that order, each
    # printed by the process's main thread (its "Current thread"), whose stack stands still while
    # it prints; a dump printed by another thread can crash on the running main thread's frames.
    dumps = stacks.split("Fatal Python error: Aborted")[1:]
    assert len(dumps) == 2, stacks
    printer = [re.search(r"\nCurrent thread 0x[0-9a-f]+ \(most recent call first\):\n(.*?)\n\n", dump, re.S)
               for dump in dumps]
    assert all(printer), stacks
    assert re.search(r'File ".*fault_injection\.py", line \d+ in cleanup\n', printer[0][1]), dumps[0]
    assert "torch/distributed/elastic/agent" in printer[1][1], dumps[1]
    assert_no_process_outlives(str(tmp_path), "the row that did not exit")


def is_running(pid) -> bool:
    """Alive and not a zombie waiting for its parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


# --- cut short: a time budget, a stop signal -------------------------------------------------

# The benchmark with one row's script replaced: by tests/fault_injection.py (FAULT_INJECTION names
# the fault and the script), or by a test's own; the same command line, rows and budget as the user's.
WITH_FAULTY_ROW = """
import dataclasses, sys
sys.path.insert(0, {scripts!r})
import benchmark
{setup}benchmark.ROWS = [dataclasses.replace(row, script={script!r}) if row.name == {row!r} else row
                  for row in benchmark.ROWS]
sys.argv[0] = benchmark.__file__
benchmark.lifecycle.run_main(benchmark.main)
"""


def test_the_time_budget_cuts_a_row_short_and_leaves_the_rest_not_run(tmp_path, quick_run, tool):
    """A budget of the time kept for the report (REPORT_SECONDS), the benchmark's own start (30 s: its imports and
    the FLOP count took 2 s idle, 24 s beside eight busy processes) and the row's share: `ddp-1proc` (torchrun and
    one worker) starts with the last two, less the time the start took. After its first step it
    pauses for longer than all of that (the worker sleeps, so that the wait costs no CPU, and
    a stop signal ends the pause), so the budget ends it; the ceiling row then has less than
    10 s and is not started. Neither is a failure: exit 0, no process left.

    The share must let the row reach its first step, or the budget ends it while it starts
    and the test checks something else: twice what the whole `ddp-1proc` row of this
    module's --quick run took (start, 3 epochs, exit), on this machine under its load at the
    time, and at least 30 s (on a loaded 2-core machine the row once needed more than 30 s
    to start)."""
    _, _, quick = quick_run
    row_share = max(30, math.ceil(2 * rows_by_name(quick)["ddp-1proc"]["wall_seconds"]))
    budget = int(tool.REPORT_SECONDS) + 30 + row_share
    logs = tmp_path / "logs"
    code = WITH_FAULTY_ROW.format(scripts=str(ROOT / "scripts"), row="ddp-1proc", script=FAULTS, setup="")
    env = subprocess_env(FAULT_INJECTION=f"--fault pause --rank 0 --step 1 --pause-seconds 600 "
                                         f"--marker {tmp_path / 'paused'} -- distributed.py")
    proc = run_script(["-c", code, "--quick", "--device", "cpu", "--rows", "ddp-1proc,ceiling-fp32",
                       "--time-budget", str(budget), "--out", tmp_path, "--log-dir", logs],
                      timeout=budget + 75, check=False, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "paused.0").exists(), (logs / "ddp-1proc.log").read_text()  # the row got to its step
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert report["state"] == "complete" and report["settings"]["time_budget_s"] == budget
    ddp, ceiling = report["rows"]
    assert (ddp["name"], ddp["status"]) == ("ddp-1proc", "cut short"), ddp
    given = re.fullmatch(r"--time-budget had (\d+) s left for it, and it needed more; its processes were ended",
                         ddp["reason"])
    assert given and 10 <= int(given[1]) <= 30 + row_share, ddp["reason"]  # less the benchmark's own start
    assert int(given[1]) - 1 <= ddp["wall_seconds"] < int(given[1]) + 15, ddp["wall_seconds"]
    assert (ceiling["name"], ceiling["status"], ceiling["reason"]) == (
        "ceiling-fp32", "not run", f"--time-budget {budget} s used up")
    assert f"- ddp-1proc: cut short: {ddp['reason']}" in (tmp_path / "benchmark.md").read_text()
    assert_no_process_outlives(logs, "the row the budget ended")


def test_sigterm_mid_row_keeps_finished_rows_and_ends_the_running_one(tmp_path):
    """SIGTERM while the second row trains: the first row's figures are in the report,
    the second is marked interrupted, the third never starts, and none of the second
    row's processes (torchrun and its two workers) outlives the benchmark."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    # Long enough epochs for the signal to land while `ddp` trains.
    cmd = [sys.executable, str(TOOL), "--quick", "--device", "cpu", "--rows", "ceiling-fp32,ddp,ddp-1proc-noddp",
           "--steps", "2", "--epochs", "2", "--out", str(out), "--log-dir", str(logs)]
    with benchmark_process(cmd) as proc:
        deadline = time.time() + 240
        # The report is rewritten after the first row; the second row's log then appears.
        while not ((out / "benchmark.json").exists() and (logs / "ddp.log").exists()):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        partial = json.loads((out / "benchmark.json").read_text())
        assert partial["state"] == "partial: rows still to run"
        assert [(r["name"], r["status"]) for r in partial["rows"]] == [("ceiling-fp32", "ok")]
        wait_for_workers(proc, logs, "distributed.py", 2, deadline)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stdout + stderr
    assert "SIGTERM: the benchmark stopped" in stderr and "Traceback" not in stderr
    report = json.loads((out / "benchmark.json").read_text())
    assert report["state"] == "interrupted by SIGTERM"
    rows = rows_by_name(report)
    assert rows["ceiling-fp32"]["status"] == "ok" and rows["ceiling-fp32"]["median_images_per_second"] > 0
    assert rows["ddp"]["status"] == "interrupted"
    assert rows["ddp-1proc-noddp"]["status"] == "not run"
    md = (out / "benchmark.md").read_text()
    assert "- state: interrupted by SIGTERM" in md
    assert "| ddp | torchrun x2 distributed.py | fp32 | 2 | 32 | interrupted |" in md
    assert (logs / "ceiling-fp32.log").stat().st_size > 0
    assert_no_process_outlives(logs, "the interrupted row")


PAUSED_ROW = "import time\nopen({marker!r}, 'w').close()\ntime.sleep(600)\n"
STUBBORN_ROW = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nopen({marker!r}, 'w').close()\n" \
               "time.sleep(600)\n"
LEAVES_A_STUBBORN_CHILD = (
    "import subprocess, sys\n"
    "code = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'\n"
    "subprocess.Popen([sys.executable, '-c', code, {marker!r}], start_new_session=True)\n"
    "open({marker!r}, 'w').close()\n")


def with_own_row(tmp_path, text: str, exit_seconds: float = None) -> list:
    """The benchmark's argv (before its flags) with ddp-1proc-noddp's script replaced by `text`, a
    script that writes tmp_path/started when it runs; `exit_seconds`: the time a row's processes
    have to follow their launcher, if not EXIT_SECONDS."""
    script = tmp_path / "own_row.py"
    script.write_text(text.format(marker=str(tmp_path / "started")))
    return ["-c", WITH_FAULTY_ROW.format(scripts=str(ROOT / "scripts"), row="ddp-1proc-noddp", script=str(script),
                                         setup=f"benchmark.EXIT_SECONDS = {exit_seconds}\n" if exit_seconds else "")]


@pytest.mark.parametrize("text", [STUBBORN_ROW, LEAVES_A_STUBBORN_CHILD], ids=["hangs", "leaves-a-child"])
def test_the_time_budget_bounds_the_benchmark(tmp_path, text):
    """--time-budget 90 with a row that ignores SIGTERM and never ends, or whose launcher exits 0
    leaving such a process: the benchmark ends within the 90 s, counted from its start, its
    interpreter's exit included (the row is cut short, not a failure), and nothing outlives it.
    (90: the row starts only with REPORT_SECONDS + min_row_seconds, 40 s, left, and the imports
    and the FLOP count before it take 2 s on an idle CPU but 24 s beside eight busy processes. The
    processes left have 10 minutes to follow their launcher, not EXIT_SECONDS, 30 s: only the
    budget ends that wait here, however long the start took; with the 30 s they are ended
    first where the start was quick, and the row fails, as it should, with its processes named.)"""
    budget = 90
    started = time.monotonic()
    proc = run_script([*with_own_row(tmp_path, text, exit_seconds=600.0), "--quick", "--device", "cpu", "--rows",
                       "ddp-1proc-noddp", "--time-budget", str(budget), "--out", tmp_path / "out"],
                      timeout=budget + 70, check=False)
    took = time.monotonic() - started
    report = json.loads((tmp_path / "out" / "benchmark.json").read_text())
    assert took <= budget, (took, proc.stdout, proc.stderr)
    assert proc.returncode == 0 and rows_by_name(report)["ddp-1proc-noddp"]["status"] == "cut short", report
    assert_no_process_outlives(str(tmp_path), "the row cut short")


def test_a_second_run_on_the_same_out_is_refused(tmp_path):
    """Two runs on one --out would delete and append each other's logs: the second is refused in
    one line, exit status 2, while the first runs; the first is not disturbed."""
    out = tmp_path / "out"
    cmd = [sys.executable, *with_own_row(tmp_path, PAUSED_ROW), "--quick", "--device", "cpu", "--rows",
           "ddp-1proc-noddp", "--out", str(out)]
    with benchmark_process(cmd) as first:
        deadline = time.time() + 120
        while not (tmp_path / "started").exists():
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.2)
        second = run_script([TOOL, "--quick", "--device", "cpu", "--rows", "ceiling-fp32", "--ceiling-steps", "1",
                             "--ceiling-windows", "1", "--out", out], timeout=120, check=False)
        assert second.returncode == 2, second.stdout + second.stderr
        line = second.stderr.strip()
        assert line == (f"benchmark.py: error: --out {out} is in use by another run (pid {first.pid}): wait until "
                        "it ends, or give another --out"), line
        assert first.poll() is None and not (out / "logs" / "ceiling-fp32.log").exists()
        assert sorted(os.listdir(out)) == ["logs"]  # the lock adds no file to --out


def test_a_second_stop_signal_kills_the_row_at_once(tmp_path):
    """Ctrl-C, then Ctrl-C again while the row (which ignores SIGTERM) is being ended: the second
    kills its processes (SIGKILL) and the benchmark exits at once, 128 + SIGINT, in one line."""
    cmd = [sys.executable, *with_own_row(tmp_path, STUBBORN_ROW), "--quick", "--device", "cpu", "--rows",
           "ddp-1proc-noddp", "--out", str(tmp_path / "out")]
    with benchmark_process(cmd) as proc:
        deadline = time.time() + 120
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        time.sleep(1)  # the row is being ended: SIGTERM sent, which it ignores
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)  # (no bound in seconds: writing the report under load varies)
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, stdout + stderr)
    assert "SIGINT again: stopped at once, the running row's processes killed (SIGKILL)" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert_no_process_outlives(str(tmp_path), "the killed row", within=2)


@contextlib.contextmanager
def benchmark_process(cmd):
    """The benchmark started as a user starts it; killed on the way out if still running."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def assert_no_process_outlives(logs, what, within=20):
    """No process of `what` (every launcher and worker has the log directory in its command
    line) is still running `within` seconds after the benchmark ended."""
    deadline = time.time() + within
    while row_commands(str(logs)) and time.time() < deadline:
        time.sleep(0.2)
    assert not row_commands(str(logs)), f"processes of {what} outlived the benchmark"


def wait_for_workers(proc, logs, marker: str, count: int, deadline: float):
    """Until `count` workers that torchrun started run: processes whose command line holds `logs`
    and `marker`, but for torchrun's own."""
    while sum(marker in line and "torch.distributed.run" not in line
              for line in row_commands(str(logs)).splitlines()) < count:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)


def row_commands(marker: str) -> str:
    """Command lines of the live processes whose command line holds `marker` (the row's
    metrics path lies in the log directory, so every launcher and worker of a row has it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and is_running(int(pid)):
            found.append(cmdline)
    return "\n".join(found)


def exit_status_of_main(tool, argv):
    """The benchmark's main() in this process, which must end in sys.exit (the stop handlers it
    installs: conftest gives them back after the test)."""
    with pytest.raises(SystemExit) as stop:
        tool.main(argv)
    return stop.value.code


def test_a_stop_signal_after_the_last_row_leaves_the_report_whole(tmp_path, monkeypatch, capsys):
    """SIGTERM while the benchmark removes its synthetic files, after every row has run (sent
    from inside that removal, which takes well under a second, so that it lands there every
    time): the files are gone, the report is complete, no traceback; exit status 128 + SIGTERM."""
    tool = load_tool()  # its own module: main() keeps the signal it saw
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real_rmtree = shutil.rmtree

    def rmtree_under_a_signal(path, *args, **kwargs):
        if os.path.basename(path).startswith(f"benchmark-synthetic-{os.getpid()}-"):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at once, in this thread
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_under_a_signal)
    out = tmp_path / "out"
    status = exit_status_of_main(tool, ["--quick", "--device", "cpu", "--rows", "ddp-1proc-noddp", "--out", str(out),
                                        "--log-dir", str(tmp_path / "logs")])
    stderr = capsys.readouterr().err
    assert status == 128 + signal.SIGTERM, stderr
    assert "SIGTERM came after the last row; the report is whole" in stderr, stderr
    assert not [name for name in os.listdir(tmp_path) if name.startswith("benchmark-synthetic-")]
    report = json.loads((out / "benchmark.json").read_text())
    assert report["state"] == "complete"
    assert [(r["name"], r["status"]) for r in report["rows"]] == [("ddp-1proc-noddp", "ok")]


def test_sigterm_during_the_memory_table_ends_its_launch_and_writes_what_it_has(tmp_path):
    """memory_table.py launches torchrun as the benchmark launches a row: SIGTERM to it ends the launch
    and its workers (their command line holds the log directory) and leaves a report that says so."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    cmd = [sys.executable, str(MEMORY_TOOL), "--device", "cpu", "--model", "resnet_tiny",
           "--world-sizes", "2", "--out", str(out), "--log-dir", str(logs)]
    with benchmark_process(cmd) as proc:
        deadline = time.time() + 120
        wait_for_workers(proc, logs, "--worker", 2, deadline)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stdout + stderr
    assert "Traceback" not in stderr, stderr
    assert "not measured: SIGTERM ended the benchmark" in (out / "memory.md").read_text()
    assert f"SIGTERM: the memory table stopped; what it measured is in {out / 'memory.md'}" in stderr, stderr
    assert_no_process_outlives(logs, "the memory launch")


def test_a_stop_signal_after_the_last_memory_launch_leaves_the_table_whole(tmp_path, monkeypatch, capsys):
    """SIGTERM once every world size is measured (sent from inside the table's arithmetic, so
    that it lands there every time): the table is written whole, with its one line; exit
    status 128 + SIGTERM."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import benchmark
    import memory_table
    monkeypatch.setattr(benchmark, "_stopping", [])  # the signal this run sees, not an earlier one's
    real_rows = memory_table.table_rows

    def rows_under_a_signal(results):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at once, in this thread
        return real_rows(results)

    monkeypatch.setattr(memory_table, "table_rows", rows_under_a_signal)
    out = tmp_path / "out"
    status = exit_status_of_main(memory_table, ["--device", "cpu", "--model", "resnet_tiny", "--world-sizes", "1",
                                                "--out", str(out), "--log-dir", str(tmp_path / "logs")])
    stderr = capsys.readouterr().err
    assert status == 128 + signal.SIGTERM, stderr
    assert "SIGTERM came after the last launch; the memory table is whole" in stderr, stderr
    report = json.loads((out / "memory.json").read_text())
    assert [(r["world_size"], "error" in r) for r in report["measurements"]] == [(1, False)]
