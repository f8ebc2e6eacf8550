"""scripts/benchmark.py: the quick mode end to end on the CPU (the real scripts through
their real launchers), and the arithmetic behind every figure it writes."""
import importlib.util
import json
import os
import statistics
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, run_script, subprocess_env

TOOL = ROOT / "scripts" / "benchmark.py"
QUICK_SCRIPT_ROWS = ["ddp-1proc-noddp", "ddp-1proc", "ddp", "ddp-bf16", "fast-fp32"]
QUICK_CEILINGS = ["ceiling-fp32", "ceiling-bf16"]
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
    env = subprocess_env()
    env.pop("PYTHONPATH")
    started = time.perf_counter()
    proc = run_script([TOOL, "--quick", "--device", "cpu", "--peak-tflops", PEAK_TFLOPS, "--out", out],
                      timeout=420, check=False, env=env)
    print(f"benchmark --quick took {time.perf_counter() - started:.0f} s")
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
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
    assert list(rows) == QUICK_SCRIPT_ROWS + QUICK_CEILINGS
    train_flops = report["flops"]["train_step_per_image"]
    for name in QUICK_SCRIPT_ROWS:
        row = rows[name]
        assert row["status"] == "ok", row
        # 3 epochs of 4 steps; epoch 1 is warm-up, the median is over epochs 2 and 3.
        assert [e["epoch"] for e in row["epochs"]] == [1, 2, 3]
        assert all(e["images_per_second"] > 0 and e["epoch_seconds"] > 0 for e in row["epochs"])
        assert row["counted_epochs"] == [2, 3] and not row["warmup_included"]
        steady = [e["images_per_second"] for e in row["epochs"][1:]]
        assert row["median_images_per_second"] == pytest.approx(statistics.median(steady))
        assert row["seconds_per_epoch_equivalent"] == pytest.approx(50_000 / row["median_images_per_second"])
        per_device = row["median_images_per_second"] / row["devices"]
        assert row["share_of_peak"] == pytest.approx(per_device * train_flops / (PEAK_TFLOPS * 1e12))
        assert row["vs_ddp"] == pytest.approx(row["median_images_per_second"]
                                              / rows["ddp"]["median_images_per_second"])
        assert row["device"] == "cpu" and row["peak_memory_mb"] is None
    # The same global batch everywhere; one-process rows take one process's share of it.
    for name in ("ddp", "ddp-bf16", "fast-fp32"):
        assert (rows[name]["processes"], rows[name]["global_batch"], rows[name]["world_size"]) == (2, 32, 2)
    for name in ("ddp-1proc-noddp", "ddp-1proc"):
        assert (rows[name]["processes"], rows[name]["global_batch"], rows[name]["world_size"]) == (1, 16, 1)
    assert rows["ddp-1proc-noddp"]["launcher"] == "python" and rows["ddp-1proc"]["launcher"] == "torchrun"
    assert rows["ddp-bf16"]["amp"] == "bf16" and rows["ddp"]["amp"] == "fp32"


def test_ceiling_rows(quick_run):
    _, _, report = quick_run
    rows = rows_by_name(report)
    for name in QUICK_CEILINGS:
        row = rows[name]
        assert row["status"] == "ok", row
        assert len(row["window_seconds"]) == 3
        # one device's rate (16 images per step) times the 2 devices of the multi-process rows
        per_device = [4 * 16 / s for s in row["window_seconds"]]
        assert row["median_images_per_second"] == pytest.approx(2 * statistics.median(per_device))
        assert row["median_images_per_second"] > 0 and row["global_batch"] == 32


def test_targets_are_computed_not_typed(quick_run):
    _, _, report = quick_run
    rows = rows_by_name(report)
    targets = {t["target"]: t for t in report["targets"]}
    assert len(targets) == 4
    assert all(t["status"] == "n.a." for t in targets.values())  # not on a GPU
    rate = {name: rows[name]["median_images_per_second"] for name in rows}
    assert targets["DDP overhead, one process"]["value"] == pytest.approx(rate["ddp-1proc"] / rate["ddp-1proc-noddp"])
    assert targets["mixed precision speed-up"]["value"] == pytest.approx(rate["ddp-bf16"] / rate["ddp"])
    # fast-bf16-compile and fast-bf16 are not quick rows; ceiling-bf16 is
    assert targets["fast path throughput"]["value"] is None
    assert targets["fast path throughput"]["reason"] == "not measured: fast-bf16-compile"
    assert targets["fast path vs ceiling"]["reason"] == "not measured: fast-bf16"


def test_markdown_table_has_every_row(quick_run):
    _, out, report = quick_run
    text = (out / "benchmark.md").read_text()
    assert f"PyTorch {torch.__version__}" in text
    assert report["header"]["command"] in text
    rows = rows_by_name(report)
    for name in QUICK_SCRIPT_ROWS + QUICK_CEILINGS:
        line = next((line for line in text.splitlines() if line.startswith(f"| {name} |")), None)
        assert line is not None, f"no table line for {name}"
        assert f"| {rows[name]['median_images_per_second']:,.0f} |" in line, line
    for name in ("fast path throughput", "fast path vs ceiling", "DDP overhead, one process",
                 "mixed precision speed-up"):
        assert f"| {name} |" in text


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


# --- the arithmetic, on hand-made records ----------------------------------------------------

def test_median_epoch_equivalent_and_share_of_peak(tool):
    records = [
        {"event": "epoch", "epoch": 1, "images_per_second": 10.0, "epoch_seconds": 9.0, "peak_memory_mb": 100.0},
        {"event": "epoch", "epoch": 2, "images_per_second": 300.0, "epoch_seconds": 2.0, "peak_memory_mb": 120.0},
        {"event": "epoch", "epoch": 3, "images_per_second": 100.0, "epoch_seconds": 3.0, "peak_memory_mb": 110.0},
        {"event": "epoch", "epoch": 4, "images_per_second": 200.0, "epoch_seconds": 2.5, "peak_memory_mb": 115.0},
        {"event": "end", "epoch": 4, "images_per_second": 999.0, "epoch_seconds": 1.0, "peak_memory_mb": 500.0},
    ]
    summary = tool.summarize_epochs(records)
    assert summary["median_images_per_second"] == 200.0  # epochs 2..4; the warm-up's 10 and the end record left out
    assert summary["counted_epochs"] == [2, 3, 4] and not summary["warmup_included"]
    assert summary["peak_memory_mb"] == 120.0
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2, 3, 4]
    assert tool.seconds_per_epoch_equivalent(200.0) == 250.0  # 50,000 images at 200 images/s
    assert tool.share_of_peak(200.0, 3e9, 1.0) == pytest.approx(0.6)  # 6e11 FLOP/s of 1e12
    assert tool.share_of_peak(200.0, 3e9, None) is None
    # An even number of epochs after warm-up: the mean of the middle two.
    assert tool.summarize_epochs(records[:3])["median_images_per_second"] == 200.0
    # One epoch only: it is all there is, and the summary says so. No GPU: no memory figure.
    alone = tool.summarize_epochs([dict(records[0], peak_memory_mb=None)])
    assert alone["median_images_per_second"] == 10.0 and alone["warmup_included"]
    assert alone["peak_memory_mb"] is None


def test_targets_on_a_gpu(tool):
    plan = tool.Plan(use_cuda=True, gpus=1, procs=1, global_batch=512, per_device_batch=512, steps=60, epochs=4,
                     workers=8, model="resnet18", dataset="synthetic", data_dir="./data", timeout=600, bf16=True)
    rates = {"fast-bf16-compile": 75_000, "ceiling-bf16-compile": 78_000, "ddp-1proc": 9_800,
             "ddp-1proc-noddp": 10_000, "ddp-bf16": 17_000, "ddp": 10_000}
    results = {name: {"status": "ok", "median_images_per_second": rate} for name, rate in rates.items()}
    targets = {t["target"]: t for t in tool.evaluate_targets(results, plan, "NVIDIA H100 80GB HBM3")}
    assert targets["fast path throughput"]["status"] == "PASS"
    assert targets["fast path vs ceiling"]["value"] == pytest.approx(75 / 78)
    assert targets["fast path vs ceiling"]["status"] == "PASS"
    assert targets["DDP overhead, one process"]["status"] == "PASS"
    assert targets["mixed precision speed-up"]["value"] == pytest.approx(1.7)
    assert targets["mixed precision speed-up"]["status"] == "FAIL"
    # Another GPU: the absolute target is for H100/H200 only; without the compiled ceiling the
    # comparison falls back to the uncompiled pair.
    del results["ceiling-bf16-compile"]
    results["fast-bf16"] = {"status": "ok", "median_images_per_second": 50_000}
    results["ceiling-bf16"] = {"status": "ok", "median_images_per_second": 60_000}
    targets = {t["target"]: t for t in tool.evaluate_targets(results, plan, "NVIDIA A100-SXM4-80GB")}
    assert targets["fast path throughput"]["status"] == "n.a."
    assert "for an H100/H200, this is NVIDIA A100" in targets["fast path throughput"]["reason"]
    assert targets["fast path vs ceiling"]["value"] == pytest.approx(5 / 6)
    assert targets["fast path vs ceiling"]["status"] == "FAIL"


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10", 125.0), ("NVIDIA L4", 121.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA GeForce RTX 4090", 165.0), ("Tesla V100-SXM2-16GB", 125.0),
    ("Tesla V100-PCIE-16GB", 112.0),
    ("Some Future GPU", None),
])
def test_default_peak_by_gpu_name(tool, name, tflops):
    assert tool.default_peak(name)[0] == tflops


# --- bad input and failing rows --------------------------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["--rows", "ddp,nope"], "unknown row 'nope'"),
    (["--quick", "--device", "cpu", "--batch-size", "33"], "batch size 33 is not divisible by 2 processes"),
    (["--quick", "--device", "cpu", "--batch-size", "34", "--rows", "ddp-accum2"], "x 2 accumulation steps"),
    (["--quick", "--device", "cpu", "--epochs", "1"], "epoch 1 is warm-up"),
    (["--dataset", "cifar100", "--device", "cpu", "--steps", "2000", "--batch-size", "64"], "lower --steps"),
])
def test_bad_input_is_a_usage_error(tool, argv, fragment):
    from utils import cli
    with pytest.raises(cli.UsageError, match=fragment):
        tool.main(argv)


def test_bad_flag_is_one_line_and_exit_2(tool, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tool.build_parser().parse_args(["--rows", "ddp", "--nproc", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--nproc" in err, err


def test_failed_row_is_recorded_and_timeouts_end_every_process(tool, tmp_path):
    plan = tool.Plan(use_cuda=False, gpus=0, procs=2, global_batch=32, per_device_batch=16, steps=4, epochs=3,
                     workers=0, model="resnet_tiny", dataset="synthetic", data_dir="./data", timeout=60, bf16=True)
    broken = tool.Row("broken", str(tmp_path / "no_such_script.py"), "python", False)
    result = tool.run_row(broken, plan, str(tmp_path))
    assert result["status"] == "failed"
    assert result["reason"].startswith("exit status 2: ") and "No such file" in result["reason"]

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
    child = int(pid_file.read_text())
    deadline = time.time() + 10
    while is_running(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not is_running(child), "the hung row's child process outlived the timeout"


def is_running(pid) -> bool:
    """Alive and not a zombie waiting for its parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
