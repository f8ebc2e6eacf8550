"""Benchmark every training strategy on this machine.

Per row: images/s, seconds per epoch, peak memory and the share of the
hardware's peak FLOP/s that it reaches.

Every row runs a real training script through its real launcher (python,
torchrun, the script's own mp.spawn) with the same model, the same global batch
and the same number of steps per epoch, and reads the throughput that the script
itself measured (its --metrics records). Epoch 1 is warm-up (loader start, cudnn
autotuning, torch.compile) and is not counted: a row's figure is the median over
epochs 2..E. A ceiling row times the same training step in this process, on
random tensors already on the device: no data loading, no communication.

    # every row, on all local GPUs (the report records how long it took)
    python scripts/benchmark.py

    # a few rows, or the real CIFAR-100 instead of the synthetic stand-in
    python scripts/benchmark.py --rows ddp,ddp-bf16,fast-bf16-compile
    python scripts/benchmark.py --dataset cifar100 --data-dir ./data

    # a quick check of the harness on the CPU (tiny model, 2 processes, a few minutes)
    python scripts/benchmark.py --quick --device cpu --out /tmp/bench

Writes benchmark.md, benchmark.json and benchmark.png to --out (default results/).
"""
import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

# `python scripts/benchmark.py` puts scripts/ on sys.path, not the repository root.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from models import MODEL_NAMES, build_model  # noqa: E402
from utils import cli  # noqa: E402
from utils.data import NUM_CLASSES  # noqa: E402

EPOCH_IMAGES = 50_000  # one CIFAR-100 training epoch: "seconds per epoch" means per this many images
WARMUP_EPOCHS = 1      # epochs left out of a row's median

# Dense (no sparsity) bfloat16 tensor-core peak in TFLOP/s with float32 accumulation, from
# the vendor datasheets; GPUs without bfloat16 get their float16 figure (also float32
# accumulation, as autocast's matmuls and convolutions use). First match wins: the longer
# names come before the shorter ones they contain.
PEAK_TFLOPS = [
    (r"H100 PCIe", 756.0, "H100 PCIe, bf16 dense"),
    (r"H100 NVL|H200 NVL", 835.0, "H100/H200 NVL, bf16 dense"),
    (r"H100|H200|GH200", 989.0, "H100/H200 SXM, bf16 dense"),
    (r"A100", 312.0, "A100, bf16 dense"),
    (r"L40S", 362.0, "L40S, bf16 dense"),
    (r"\bL4\b", 121.0, "L4, bf16 dense"),
    (r"\bA10\b", 125.0, "A10, bf16 dense"),
    (r"RTX 4090", 165.0, "GeForce RTX 4090, bf16 dense, fp32 accumulate"),
    (r"RTX 3090", 71.0, "GeForce RTX 3090, bf16 dense, fp32 accumulate"),
    (r"V100-PCIE", 112.0, "V100 PCIe, fp16 dense (no bf16)"),
    (r"V100", 125.0, "V100 SXM2, fp16 dense (no bf16)"),
    (r"2080 Ti", 53.8, "GeForce RTX 2080 Ti, fp16 dense, fp32 accumulate (no bf16)"),
]


# --- the rows -------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    name: str
    script: str
    launcher: str              # "python", "torchrun" or "spawn" (the script's own mp.spawn)
    all_devices: bool          # every GPU (or --nproc CPU processes); False: one process, one device
    flags: tuple = ()
    about: str = ""
    needs_bf16: bool = False
    gpu_only: str = ""         # why the row is skipped on the CPU ("" = it runs there)
    fast_loader: bool = False  # --data-on-gpu: the loader needs no worker processes


FAST = ("--data-on-gpu", "--channels-last")
ROWS = [
    Row("dp", "dataparallel.py", "python", True, (), "nn.DataParallel, one process, fp32"),
    Row("dp-bf16", "dataparallel.py", "python", True, ("--amp", "bf16"), "nn.DataParallel, bf16 autocast",
        needs_bf16=True),
    Row("ddp-1proc-noddp", "distributed.py", "python", False, (), "one process, no DDP wrapper: the bare step"),
    Row("ddp-1proc", "distributed.py", "torchrun", False, (), "the same step inside DDP, one process"),
    Row("ddp", "distributed.py", "torchrun", True, (), "DDP via torchrun, fp32: the baseline"),
    Row("ddp-spawn", "distributed_mp.py", "spawn", True, (), "DDP, processes started by mp.spawn"),
    Row("ddp-bf16", "distributed_apex.py", "torchrun", True, ("--amp", "bf16"), "DDP + bf16 autocast",
        needs_bf16=True),
    Row("ddp-fp16", "distributed_apex.py", "torchrun", True, ("--amp", "fp16"), "DDP + fp16 autocast + GradScaler",
        gpu_only="fp16 convolutions on the CPU are a slow fallback, not a measurement"),
    Row("ddp-accum2", "distributed_gradient_accumulation.py", "torchrun", True, ("--accum-steps", "2"),
        "DDP, 2 accumulated micro-batches per step"),
    Row("fast-fp32", "distributed.py", "torchrun", True, FAST, "DDP, data on the device, channels_last",
        fast_loader=True),
    Row("fast-bf16", "distributed_apex.py", "torchrun", True, ("--amp", "bf16", *FAST),
        "DDP + bf16, data on the device, channels_last", needs_bf16=True, fast_loader=True),
    Row("fast-bf16-compile", "distributed_apex.py", "torchrun", True, ("--amp", "bf16", *FAST, "--compile"),
        "fast-bf16 + torch.compile", needs_bf16=True, fast_loader=True,
        gpu_only="torch.compile on the CPU spends minutes compiling for a run of seconds"),
]


@dataclass(frozen=True)
class Ceiling:
    name: str
    dtype: object      # autocast dtype, None for float32
    compiled: bool
    about: str
    mirrors: str       # the script row that runs the same step with real data


CEILINGS = [
    Ceiling("ceiling-fp32", None, False, "fp32, channels_last", "fast-fp32"),
    Ceiling("ceiling-bf16", torch.bfloat16, False, "bf16 autocast, channels_last", "fast-bf16"),
    Ceiling("ceiling-bf16-compile", torch.bfloat16, True, "bf16 autocast, channels_last, torch.compile",
            "fast-bf16-compile"),
]
ALL_NAMES = [row.name for row in ROWS] + [c.name for c in CEILINGS]
QUICK_ROWS = ["ddp-1proc-noddp", "ddp-1proc", "ddp", "ddp-bf16", "fast-fp32", "ceiling-fp32", "ceiling-bf16"]


# --- arithmetic -----------------------------------------------------------------------

def summarize_epochs(records: list) -> dict:
    """A row's figures from its --metrics records: the median images/s over the epochs
    after warm-up, and the largest peak memory of any epoch."""
    epochs = [r for r in records if r.get("event") == "epoch"]
    if not epochs:
        raise ValueError("no epoch records")
    steady = [r for r in epochs if r["epoch"] > WARMUP_EPOCHS]
    counted = steady or epochs  # a one-epoch run has nothing but its warm-up epoch
    peaks = [r["peak_memory_mb"] for r in epochs if r.get("peak_memory_mb") is not None]
    return {
        "median_images_per_second": statistics.median(r["images_per_second"] for r in counted),
        "counted_epochs": [r["epoch"] for r in counted],
        "warmup_included": not steady,
        "peak_memory_mb": max(peaks) if peaks else None,
        "epochs": [{key: r.get(key) for key in ("epoch", "images_per_second", "epoch_seconds", "peak_memory_mb")}
                   for r in epochs],
    }


def seconds_per_epoch_equivalent(images_per_second: float) -> float:
    return EPOCH_IMAGES / images_per_second


def share_of_peak(images_per_second: float, flops_per_image: float, peak_tflops):
    """Fraction (0..1) of the peak FLOP/s; None without a peak figure (the CPU)."""
    if peak_tflops is None:
        return None
    return images_per_second * flops_per_image / (peak_tflops * 1e12)


def count_flops(model_name: str, batch: int = 2) -> dict:
    """FLOPs per image of one forward and of one training step (forward + backward), as
    torch.utils.flop_counter counts them: convolutions and matrix multiplies only, a
    multiply-add counted as 2 FLOPs. Counted once on the CPU: the count does not depend
    on the device, dtype or memory format."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(model_name, NUM_CLASSES)
    images = torch.randn(batch, 3, 32, 32)
    targets = torch.arange(batch) % NUM_CLASSES
    with FlopCounterMode(display=False) as counter:
        model(images)
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(images), targets).backward()
    return {"forward_per_image": forward / batch, "train_step_per_image": counter.get_total_flops() / batch,
            "counted_with": "torch.utils.flop_counter.FlopCounterMode (convolutions and matmuls, "
                            "2 FLOPs per multiply-add), one forward + backward"}


def default_peak(gpu_name: str):
    """(TFLOP/s, source) for a known GPU, (None, why) otherwise."""
    for pattern, tflops, what in PEAK_TFLOPS:
        if re.search(pattern, gpu_name):
            return tflops, f"vendor datasheet: {what}"
    return None, f"unknown GPU {gpu_name!r}: give --peak-tflops"


# --- the machine ----------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_hardware(use_cuda: bool, gpus_used: int) -> str:
    if not use_cuda:
        return f"CPU: {cpu_model()}, {os.cpu_count()} logical cores (no GPU used)"
    names = [torch.cuda.get_device_name(i) for i in range(gpus_used)]
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    kinds = ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
    return f"{kinds} ({memory:.0f} GiB each); CPU: {cpu_model()}, {os.cpu_count()} logical cores"


# --- the plan: what every row runs ----------------------------------------------------

@dataclass
class Plan:
    use_cuda: bool
    gpus: int
    procs: int                  # processes of the all-device rows
    global_batch: int
    per_device_batch: int
    steps: int
    epochs: int
    workers: int
    model: str
    dataset: str
    data_dir: str
    timeout: float
    bf16: bool
    names: list = field(default_factory=list)


def resolve_plan(args) -> Plan:
    """Fill in --quick's and the machine's defaults; bad combinations raise UsageError."""
    quick = args.quick
    if args.device == "cuda" and not torch.cuda.is_available():
        raise cli.UsageError("--device cuda but no CUDA GPU is visible; use --device cpu")
    use_cuda = args.device != "cpu" and torch.cuda.is_available()
    gpus = torch.cuda.device_count() if use_cuda else 0
    procs = args.nproc or gpus or 2
    if use_cuda and procs > gpus:
        raise cli.UsageError(f"--nproc {procs} but only {gpus} GPU{'s' if gpus != 1 else ''} visible "
                             "(one process per GPU)")
    global_batch = args.batch_size or (32 if quick else 512 * procs)
    steps = args.steps or (4 if quick else 60)
    epochs = args.epochs or (3 if quick else 4)
    if epochs <= WARMUP_EPOCHS:
        raise cli.UsageError(f"--epochs {epochs}: epoch 1 is warm-up and not counted; use 2 or more")
    names = args.rows.split(",") if args.rows else (QUICK_ROWS if quick else ALL_NAMES)
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in ALL_NAMES]
    if unknown:
        raise cli.UsageError(f"--rows: unknown row {unknown[0]!r}; choose from {', '.join(ALL_NAMES)}")
    if not names:
        raise cli.UsageError("--rows names no row")
    per_device_batch = cli.split_batch(global_batch, procs)
    if "ddp-accum2" in names:
        cli.split_batch(global_batch, procs, 2)  # the same batch must also split into 2 micro-batches
    if args.dataset == "cifar100" and steps * global_batch > EPOCH_IMAGES:
        raise cli.UsageError(f"--steps {steps} x global batch {global_batch} = {steps * global_batch} images "
                             f"per epoch, more than CIFAR-100's {EPOCH_IMAGES}: lower --steps")
    if args.workers is not None:
        workers = args.workers
    elif not use_cuda:
        workers = 0  # CPU processes already share the cores with the training itself
    else:
        # Enough loader processes to feed a GPU; the cores are shared by every training process.
        workers = max(1, min(16, (os.cpu_count() or 2) // procs - 1))
    return Plan(use_cuda=use_cuda, gpus=gpus, procs=procs, global_batch=global_batch,
                per_device_batch=per_device_batch, steps=steps, epochs=epochs, workers=workers,
                model=args.model or ("resnet_tiny" if quick else "resnet18"), dataset=args.dataset,
                data_dir=os.path.abspath(args.data_dir),  # the rows run in the repository root
                bf16=bf16_available(use_cuda), names=names,
                timeout=args.row_timeout or (180.0 if quick else 600.0))


def bf16_available(use_cuda: bool) -> bool:
    return torch.cuda.is_bf16_supported() if use_cuda else True


def skip_reason(row: Row, plan: Plan) -> str:
    if row.gpu_only and not plan.use_cuda:
        return row.gpu_only
    if row.needs_bf16 and not plan.bf16:
        return "this GPU has no bfloat16 (Ampere or newer needed)"
    return ""


def row_shape(row: Row, plan: Plan) -> tuple:
    """(processes, global batch, devices): one-process rows take one device's share of the
    batch, so that they do the same work per device as the all-device rows."""
    if row.launcher == "python" and row.all_devices:  # DataParallel: one process drives every GPU
        return 1, plan.global_batch, plan.procs if plan.use_cuda else 1
    if row.all_devices:
        return plan.procs, plan.global_batch, plan.procs
    return 1, plan.per_device_batch, 1


def row_command(row: Row, plan: Plan, metrics_path: str) -> list:
    procs, batch, devices = row_shape(row, plan)
    train_args = [
        row.script, "--dataset", plan.dataset, "--model", plan.model, "--batch-size", str(batch),
        "--epochs", str(plan.epochs), "--train-samples", str(plan.steps * batch),
        # Evaluation runs inside the scripts' timed epoch (see the notes): one image per process.
        "--test-samples", str(procs),
        "--workers", str(0 if row.fast_loader else plan.workers), "--metrics", metrics_path, *row.flags,
    ]
    if plan.dataset == "cifar100":
        train_args += ["--data-dir", plan.data_dir]
    if row.script == "dataparallel.py" and plan.use_cuda:  # the GPUs that the other rows use
        train_args += ["--gpus", ",".join(str(i) for i in range(devices))]
    if row.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
                *train_args]
    if row.launcher == "spawn":
        return [sys.executable, *train_args, "--nproc-per-node", str(procs)]
    return [sys.executable, *train_args]


def short_command(row: Row, plan: Plan) -> str:
    procs = row_shape(row, plan)[0]
    launcher = {"python": "python", "torchrun": f"torchrun x{procs}", "spawn": f"mp.spawn x{procs}"}[row.launcher]
    return " ".join([launcher, row.script, *row.flags])


def subprocess_env(plan: Plan) -> dict:
    env = dict(os.environ)
    # A launcher's identity in our own environment would be inherited by the row's processes.
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(key, None)
    # One thread per training process (torchrun's choice too): several processes share the cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if not plan.use_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def row_threads(plan: Plan) -> int:
    """Threads per training process, as the rows run them (OMP_NUM_THREADS)."""
    try:
        return max(1, int(subprocess_env(plan)["OMP_NUM_THREADS"]))
    except ValueError:
        return 1


# --- running a row --------------------------------------------------------------------

def run_process(cmd: list, env: dict, timeout: float, log_dir: str, name: str) -> tuple:
    """(exit status, or None after a timeout; stderr; stdout). The row runs in a session of
    its own, so that a timeout ends the launcher and every worker it started, not the launcher alone."""
    out_path, err_path = os.path.join(log_dir, f"{name}.out"), os.path.join(log_dir, f"{name}.err")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = None
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
    with open(err_path) as f:
        stderr = f.read()
    with open(out_path) as f:
        stdout = f.read()
    return status, stderr, stdout


def last_message(text: str) -> str:
    """The last informative line: torchrun closes its failure report with a rule of ===."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if re.search(r"[A-Za-z0-9]", line)]
    return lines[-1][:300] if lines else "(no output)"


def read_records(path: str) -> list:
    """The --metrics records; a line cut short by a killed process is left out."""
    records = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return records


def run_row(row: Row, plan: Plan, work_dir: str) -> dict:
    procs, batch, devices = row_shape(row, plan)
    result = {"name": row.name, "kind": "script", "about": row.about, "script": row.script,
              "launcher": row.launcher, "flags": list(row.flags), "processes": procs, "global_batch": batch,
              "devices": devices, "short_command": short_command(row, plan), "status": "skipped", "reason": ""}
    if row.name.startswith("dp") and not plan.use_cuda:
        result["about"] += " (CPU: DataParallel needs GPUs, this trains the plain module)"
    reason = skip_reason(row, plan)
    if reason:
        result["reason"] = reason
        return result
    metrics_path = os.path.join(work_dir, f"{row.name}.jsonl")
    cmd = row_command(row, plan, metrics_path)
    result["command"] = shlex.join(cmd)
    # As a reader would type it: no interpreter path, no temporary directory.
    result["display_command"] = shlex.join(["python", *row_command(row, plan, f"{row.name}.jsonl")[1:]])
    started = time.perf_counter()
    status, stderr, stdout = run_process(cmd, subprocess_env(plan), plan.timeout, work_dir, row.name)
    result["wall_seconds"] = time.perf_counter() - started
    records = read_records(metrics_path)
    if status != 0 or not any(r.get("event") == "epoch" for r in records):
        result["status"] = "failed"
        if status is None:
            result["reason"] = f"timed out after {plan.timeout:.0f} s (--row-timeout)"
        else:
            result["reason"] = f"exit status {status}: {last_message(stderr or stdout)}"
        result["output_tail"] = (stderr or stdout).splitlines()[-30:]
        return result
    result.update(summarize_epochs(records), status="ok")
    first = records[0]
    result.update(device=first.get("device"), world_size=first.get("world_size"),
                  strategy=first.get("strategy"), amp=first.get("amp", "fp32"))
    return result


# --- the ceiling: the same step on tensors already on the device ---------------------

def time_steps(step, device, warmup: int, steps: int, windows: int) -> list:
    """Seconds taken by each of `windows` windows of `steps` steps, after `warmup` untimed steps.
    On a GPU the windows are timed with CUDA events: no sync between steps."""
    for _ in range(warmup):
        step()
    seconds = []
    for _ in range(windows):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                step()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            for _ in range(steps):
                step()
            seconds.append(time.perf_counter() - began)
    return seconds


def run_ceiling(ceiling: Ceiling, plan: Plan, args) -> dict:
    device = torch.device("cuda", 0) if plan.use_cuda else torch.device("cpu")
    # One device's share of the global batch, times the number of devices (GPUs, or CPU
    # processes with the rows' threads each): what the rows would reach with nothing but the step.
    batch, multiplier = plan.per_device_batch, plan.procs
    result = {"name": ceiling.name, "kind": "ceiling", "about": ceiling.about, "mirrors": ceiling.mirrors,
              "processes": 1, "global_batch": batch * multiplier, "per_device_batch": batch,
              "multiplier": multiplier, "devices": multiplier, "status": "skipped", "reason": ""}
    result["short_command"] = (f"in process: {ceiling.about}, {batch} random images on {device.type}"
                               + (f", x {multiplier} {'GPUs' if plan.use_cuda else 'processes'} (no communication)"
                                  if multiplier > 1 else ""))
    compile_ceiling = args.compile_ceiling if args.compile_ceiling is not None else plan.use_cuda
    if ceiling.compiled and not compile_ceiling:
        result["reason"] = ("torch.compile is off for the ceiling (on by default on CUDA; "
                            "--compile-ceiling turns it on)")
        return result
    if ceiling.dtype is torch.bfloat16 and not plan.bf16:
        result["reason"] = "this GPU has no bfloat16 (Ampere or newer needed)"
        return result

    threads = torch.get_num_threads()
    try:
        if device.type == "cuda":
            # As the scripts do: cudnn picks the fastest algorithms for the fixed shape, and
            # distributed_apex.py lets what autocast leaves in float32 use TF32.
            torch.backends.cudnn.benchmark = True
            if ceiling.dtype is not None:
                torch.backends.cuda.matmul.allow_tf32 = True
                torch.backends.cudnn.allow_tf32 = True
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        else:
            torch.set_num_threads(row_threads(plan))
        torch.manual_seed(0)
        model = build_model(plan.model, NUM_CLASSES).to(device, memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4,
                                    fused=True if device.type == "cuda" else None)
        images = torch.randn(batch, 3, 32, 32, device=device).contiguous(memory_format=torch.channels_last)
        targets = torch.randint(0, NUM_CLASSES, (batch,), device=device)
        forward = torch.compile(model) if ceiling.compiled else model

        def step():  # the scripts' step, minus loading, DDP and bookkeeping
            with torch.amp.autocast(device.type, dtype=ceiling.dtype, enabled=ceiling.dtype is not None):
                loss = F.cross_entropy(forward(images), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        started = time.perf_counter()
        windows = time_steps(step, device, args.ceiling_warmup, args.ceiling_steps, args.ceiling_windows)
        result["wall_seconds"] = time.perf_counter() - started
        per_device = [args.ceiling_steps * batch / s for s in windows]
        result.update(status="ok", window_seconds=windows, window_images_per_second_per_device=per_device,
                      median_images_per_second=statistics.median(per_device) * multiplier,
                      peak_memory_mb=(torch.cuda.max_memory_allocated(device) / 2**20
                                      if device.type == "cuda" else None))
        del model, optimizer, forward, images, targets
    except Exception as exc:  # a ceiling that cannot run must not cost the rows already measured
        result.update(status="failed", reason=f"{type(exc).__name__}: {last_message(str(exc))}")
    finally:
        torch.set_num_threads(threads)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


# --- targets --------------------------------------------------------------------------

def evaluate_targets(results: dict, plan: Plan, gpu_name: str) -> list:
    """The issue's four targets, computed from the measured rows: PASS, FAIL, or n.a. with
    the reason (a row not measured, no GPU, another GPU than the one a target is for)."""

    def rate(name):
        r = results.get(name)
        return r["median_images_per_second"] if r and r["status"] == "ok" else None

    def target(name, goal, rows, value_of, threshold, not_here=""):
        missing = [row for row in rows if rate(row) is None]
        value = None if missing else value_of(*(rate(row) for row in rows))
        if missing:
            status, reason = "n.a.", f"not measured: {', '.join(missing)}"
        elif not plan.use_cuda:
            status, reason = "n.a.", "not on a GPU: the targets are for GPUs"
        elif not_here:
            status, reason = "n.a.", not_here
        else:
            status, reason = ("PASS" if value >= threshold else "FAIL"), ""
        return {"target": name, "goal": goal, "rows": list(rows), "value": value, "threshold": threshold,
                "status": status, "reason": reason}

    hopper = bool(re.search(r"H100|H200", gpu_name or ""))
    # The fast path against the ceiling that runs the same step: compiled if both were measured.
    pair = ("fast-bf16-compile", "ceiling-bf16-compile")
    if rate(pair[0]) is None or rate(pair[1]) is None:
        pair = ("fast-bf16", "ceiling-bf16")
    return [
        target("fast path throughput", ">= 70,000 images/s per H100/H200 (fast-bf16-compile)",
               ["fast-bf16-compile"], lambda fast: fast / plan.procs, 70_000,
               not_here="" if hopper else f"the target is for an H100/H200, this is {gpu_name}"),
        target("fast path vs ceiling", f">= 0.95 x ceiling ({pair[0]} / {pair[1]})",
               pair, lambda fast, ceiling: fast / ceiling, 0.95),
        target("DDP overhead, one process", ">= 0.97 x the same step without DDP (ddp-1proc / ddp-1proc-noddp)",
               ["ddp-1proc", "ddp-1proc-noddp"], lambda ddp, bare: ddp / bare, 0.97),
        target("mixed precision speed-up", ">= 1.8 x fp32 on the template path (ddp-bf16 / ddp)",
               ["ddp-bf16", "ddp"], lambda bf16, fp32: bf16 / fp32, 1.8),
    ]


# --- the report -----------------------------------------------------------------------

def fmt_rate(x):
    return f"{x:,.0f}" if x is not None else "n/a"


def fmt(x, spec, unit=""):
    return f"{x:{spec}}{unit}" if x is not None else "n/a"


def fmt_target_value(t):
    if t["value"] is None:
        return "n/a"
    return f"{t['value']:,.0f} img/s" if t["target"] == "fast path throughput" else f"{t['value']:.3f}x"


def add_derived(rows: list, flops: dict, peak_tflops):
    """Seconds per epoch-equivalent, share of peak per device, ratio to the ddp row."""
    base = next((r for r in rows if r["name"] == "ddp" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] != "ok":
            continue
        rate = r["median_images_per_second"]
        r["seconds_per_epoch_equivalent"] = seconds_per_epoch_equivalent(rate)
        # The peak is one device's: N devices together are compared with N peaks.
        r["share_of_peak"] = share_of_peak(rate / r["devices"], flops["train_step_per_image"], peak_tflops)
        r["vs_ddp"] = rate / base["median_images_per_second"] if base else None


def write_markdown(path: str, report: dict):
    h, plan = report["header"], report["settings"]
    lines = [
        "# Training throughput benchmark",
        "",
        f"- date: {h['date']}",
        f"- hardware: {h['hardware']}",
        f"- PyTorch {h['torch']}, CUDA {h['cuda'] or 'none'}" + ("" if h["cuda_used"] else " (not used)")
        + (f", cuDNN {h['cudnn']}" if h["cudnn"] else "") + f", Python {h['python']}",
        f"- command: `{h['command']}`",
        f"- model {plan['model']}, dataset {plan['dataset']}, global batch {plan['global_batch']} "
        f"({plan['per_device_batch']} per device), {plan['steps']} steps per epoch, {plan['epochs']} epochs "
        f"(epoch 1 is warm-up: the median is over epochs 2..{plan['epochs']}), loader workers per process "
        f"{plan['workers']}",
        f"- FLOPs per image: {report['flops']['forward_per_image'] / 1e9:.4g} GFLOP forward "
        f"({report['flops']['forward_per_image'] / 2e9:.4g} G multiply-adds), "
        f"{report['flops']['train_step_per_image'] / 1e9:.4g} GFLOP per training step (forward + backward), "
        f"counted by {report['flops']['counted_with']}",
        "- peak: " + (f"{report['peak']['tflops']:g} TFLOP/s per device ({report['peak']['source']})"
                       if report["peak"]["tflops"] else f"n/a ({report['peak']['source']})"),
        "",
        "| row | what runs | processes | global batch | median img/s | s per 50k images | peak MiB "
        "| % of peak per device | vs ddp |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        if r["status"] == "ok":
            share = r["share_of_peak"]
            lines.append(
                f"| {r['name']} | {r['short_command']} | {r['processes']} | {r['global_batch']} "
                f"| {fmt_rate(r['median_images_per_second'])} | {fmt(r['seconds_per_epoch_equivalent'], '.2f')} "
                f"| {fmt(r['peak_memory_mb'], ',.0f')} | {fmt(share * 100 if share is not None else None, '.1f', '%')} "
                f"| {fmt(r['vs_ddp'], '.2f', 'x')} |")
        else:
            lines.append(f"| {r['name']} | {r['short_command']} | {r['processes']} | {r['global_batch']} "
                         f"| {r['status']} | | | | |")
    lines += ["", "## Targets", "", "| target | goal | measured | result |", "| --- | --- | ---: | --- |"]
    for t in report["targets"]:
        result = t["status"] + (f" ({t['reason']})" if t["reason"] else "")
        lines.append(f"| {t['target']} | {t['goal']} | {fmt_target_value(t)} | {result} |")
    notes = [f"- {r['name']}: {r['status']}: {r['reason']}" for r in report["rows"] if r["status"] != "ok"]
    notes += [f"- {r['name']}: {r['about']}" for r in report["rows"] if "CPU:" in r.get("about", "")]
    lines += ["", "## Notes", ""] + notes + [
        "- images/s are the scripts' own figures (their --metrics records): the first min(10, steps/4) steps "
        "of each epoch are left out; the rest of the epoch is timed, including its end-of-epoch evaluation, "
        "which is why every row evaluates one test image per process.",
        "- one-process rows (ddp-1proc, ddp-1proc-noddp) run one device's share of the global batch, "
        "the same work per device as the all-device rows.",
        "- ceiling rows time the training step in the benchmark's own process on random tensors already "
        "on the device (no loading, no DDP, no communication), median of timed windows after warm-up; "
        "with several devices, one device's figure times their number.",
        "- % of peak: images/s per device x FLOPs per training step per image / the device's peak FLOP/s; "
        "fp32 rows are measured against the same (bf16 tensor-core) peak.",
        f"- the whole benchmark took {report['header']['total_seconds']:.0f} s.",
        "",
        "## Per-epoch images/s (epoch 1 is warm-up)",
        "",
    ]
    for r in report["rows"]:
        if r["status"] == "ok" and r["kind"] == "script":
            samples = ", ".join(f"{e['epoch']}: {fmt_rate(e['images_per_second'])}" for e in r["epochs"])
            lines.append(f"- {r['name']}: {samples}")
        elif r["status"] == "ok":
            samples = ", ".join(fmt_rate(x) for x in r["window_images_per_second_per_device"])
            lines.append(f"- {r['name']} (windows, per device): {samples}")
    lines += ["", "## Commands", ""]
    lines += [f"- {r['name']}: `{r['display_command']}`" for r in report["rows"] if r.get("command")]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_chart(path: str, report: dict) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return False
    rows = [r for r in report["rows"] if r["status"] == "ok"]
    if not rows:
        return False
    names = [r["name"] for r in rows][::-1]  # barh draws bottom-up: keep the table's order top-down
    rates = [r["median_images_per_second"] for r in rows][::-1]
    colours = ["#9aa7b4" if r["kind"] == "ceiling" else "#2f6db5" for r in rows][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.8))
    ax.barh(names, rates, color=colours)
    for y, rate in enumerate(rates):
        ax.text(rate, y, f" {rate:,.0f}", va="center", fontsize=8)
    ceilings = {r["name"]: r["median_images_per_second"] for r in rows if r["kind"] == "ceiling"}
    top = next((n for n in ("ceiling-bf16-compile", "ceiling-bf16", "ceiling-fp32") if n in ceilings), None)
    if top:
        ax.axvline(ceilings[top], color="#c0392b", linestyle="--", linewidth=1, label=f"{top}")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("images per second (median over epochs after warm-up)")
    ax.set_xlim(0, max(rates) * 1.18)
    s = report["settings"]
    ax.set_title(f"{s['model']}, global batch {s['global_batch']}, PyTorch {report['header']['torch']}\n"
                 f"{report['header']['hardware'][:100]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_summary(report: dict):
    print()
    print(f"{'row':22s} {'img/s':>10s} {'s/50k':>8s} {'peak MiB':>9s} {'% peak':>7s}  status")
    for r in report["rows"]:
        if r["status"] == "ok":
            share = r["share_of_peak"]
            print(f"{r['name']:22s} {fmt_rate(r['median_images_per_second']):>10s} "
                  f"{fmt(r['seconds_per_epoch_equivalent'], '.2f'):>8s} {fmt(r['peak_memory_mb'], ',.0f'):>9s} "
                  f"{fmt(share * 100 if share is not None else None, '.1f'):>7s}  ok")
        else:
            print(f"{r['name']:22s} {'':>10s} {'':>8s} {'':>9s} {'':>7s}  {r['status']}: {r['reason']}")
    print("\ntargets:")
    for t in report["targets"]:
        print(f"  {t['status']:5s} {t['target']}: {fmt_target_value(t)} (goal {t['goal']})"
              + (f" - {t['reason']}" if t["reason"] else ""))


# --- main -----------------------------------------------------------------------------

def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message} (see --help)\n")
    g = parser.add_argument_group("what to run")
    g.add_argument("--rows", default=None,
                   help=f"comma-separated rows (default: all; with --quick: {','.join(QUICK_ROWS)}); "
                        f"choose from {', '.join(ALL_NAMES)}")
    g.add_argument("--quick", action="store_true",
                   help="a quick check of the harness: resnet_tiny, batch 32, 3 epochs of 4 steps, a few rows")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cpu: CPU processes even where GPUs are visible (default auto: GPUs when there are any)")
    g.add_argument("--nproc", type=cli.positive_int, default=None,
                   help="processes of the multi-process rows (default: every visible GPU, or 2 on the CPU)")
    g = parser.add_argument_group("the training problem (the same in every row)")
    g.add_argument("--model", choices=MODEL_NAMES, default=None, help="default resnet18 (--quick: resnet_tiny)")
    g.add_argument("--dataset", choices=["synthetic", "cifar100"], default="synthetic",
                   help="synthetic (default): the scripts' offline stand-in of CIFAR-100's shape")
    g.add_argument("--data-dir", default="./data", help="where CIFAR-100 is, with --dataset cifar100 (default ./data)")
    g.add_argument("--batch-size", type=cli.positive_int, default=None,
                   help="GLOBAL batch per optimizer step (default 512 per GPU; --quick: 32)")
    g.add_argument("--steps", type=cli.positive_int, default=None,
                   help="optimizer steps per epoch (default 60; --quick: 4)")
    g.add_argument("--epochs", type=cli.positive_int, default=None,
                   help="epochs per row, the first one warm-up (default 4; --quick: 3)")
    g.add_argument("--workers", type=cli.non_negative_int, default=None,
                   help="loader workers per process (default: CPU cores / processes - 1 on GPUs, 0 on the CPU)")
    g.add_argument("--row-timeout", type=cli.positive_float, default=None, metavar="SECONDS",
                   help="end a row that runs longer (default 600; --quick: 180)")
    g = parser.add_argument_group("ceiling and peak")
    g.add_argument("--compile-ceiling", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the ceiling with torch.compile (default: on with CUDA)")
    g.add_argument("--ceiling-warmup", type=cli.positive_int, default=None,
                   help="untimed steps first (default 20; --quick: 2)")
    g.add_argument("--ceiling-steps", type=cli.positive_int, default=None,
                   help="steps per timed window (default 50; --quick: 4)")
    g.add_argument("--ceiling-windows", type=cli.positive_int, default=None,
                   help="timed windows, the median is reported (default 5; --quick: 3)")
    g.add_argument("--peak-tflops", type=cli.positive_float, default=None,
                   help="the device's peak TFLOP/s for the %% of peak column (default: the vendor's dense "
                        "bf16 figure for known GPUs; none on the CPU)")
    g.add_argument("--out", default=os.path.join(ROOT, "results"),
                   help="where the report files go (default: results/ in the repository)")
    return parser


def describe_run(plan: Plan, argv) -> dict:
    """The report's header: when, on what, with which software, started how."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": describe_hardware(plan.use_cuda, plan.procs),
        "gpu_name": torch.cuda.get_device_name(0) if plan.use_cuda else None, "gpus": plan.gpus,
        "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_used": plan.use_cuda,
        "cudnn": torch.backends.cudnn.version() if plan.use_cuda else None,
        "python": platform.python_version(),
        "command": shlex.join(["python", *(sys.argv if argv is None else [sys.argv[0], *argv])]),
    }


def main(argv=None):
    args = build_parser().parse_args(argv)
    plan = resolve_plan(args)
    args.ceiling_warmup = args.ceiling_warmup or (2 if args.quick else 20)
    args.ceiling_steps = args.ceiling_steps or (4 if args.quick else 50)
    args.ceiling_windows = args.ceiling_windows or (3 if args.quick else 5)
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        raise cli.UsageError(f"--out {args.out}: cannot create it ({exc.strerror})") from None

    header = describe_run(plan, argv)
    gpu_name = header["gpu_name"]
    if args.peak_tflops:
        peak, peak_source = args.peak_tflops, "--peak-tflops"
    elif plan.use_cuda:
        peak, peak_source = default_peak(gpu_name)
    else:
        peak, peak_source = None, "CPU: no peak figure; --peak-tflops gives one"
    started = time.perf_counter()
    flops = count_flops(plan.model)
    print(f"{header['hardware']}; PyTorch {header['torch']}")
    if not plan.use_cuda and not args.quick:
        print("note: without GPUs, --quick is the practical mode (the full rows train ResNet-18 on the CPU)")
    print(f"{plan.model}: {flops['train_step_per_image'] / 1e9:.4g} GFLOP per image per training step")

    results = {}
    selected_rows = [row for row in ROWS if row.name in plan.names]
    selected_ceilings = [c for c in CEILINGS if c.name in plan.names]
    with tempfile.TemporaryDirectory(prefix="benchmark-") as work_dir:
        for i, row in enumerate(selected_rows, 1):
            print(f"[{i}/{len(selected_rows)}] {row.name}: {short_command(row, plan)}", flush=True)
            r = run_row(row, plan, work_dir)
            results[row.name] = r
            detail = (f"{fmt_rate(r['median_images_per_second'])} img/s" if r["status"] == "ok" else r["reason"])
            print(f"    {r['status']}: {detail}" + (f" ({r['wall_seconds']:.0f} s)" if "wall_seconds" in r else ""),
                  flush=True)
    # The ceilings run last, in this process: nothing they allocate (a CUDA context, cached
    # blocks, compiled kernels) is held on the GPU while the rows run.
    for ceiling in selected_ceilings:
        print(f"{ceiling.name}: {ceiling.about}", flush=True)
        r = run_ceiling(ceiling, plan, args)
        results[ceiling.name] = r
        print(f"    {r['status']}: " + (f"{fmt_rate(r['median_images_per_second'])} img/s"
                                        if r["status"] == "ok" else r["reason"]), flush=True)

    rows = [results[n] for n in ALL_NAMES if n in results]
    add_derived(rows, flops, peak)
    report = {
        "header": header,
        "settings": {"model": plan.model, "dataset": plan.dataset, "global_batch": plan.global_batch,
                     "per_device_batch": plan.per_device_batch, "processes": plan.procs, "steps": plan.steps,
                     "epochs": plan.epochs, "warmup_epochs": WARMUP_EPOCHS, "workers": plan.workers,
                     "device": "cuda" if plan.use_cuda else "cpu", "row_timeout_s": plan.timeout,
                     "ceiling_warmup": args.ceiling_warmup, "ceiling_steps": args.ceiling_steps,
                     "ceiling_windows": args.ceiling_windows, "epoch_images": EPOCH_IMAGES},
        "flops": flops,
        "peak": {"tflops": peak, "source": peak_source},
        "rows": rows,
        "targets": evaluate_targets(results, plan, gpu_name),
    }
    header["total_seconds"] = time.perf_counter() - started
    md_path, json_path, png_path = (os.path.join(args.out, f"benchmark.{ext}") for ext in ("md", "json", "png"))
    report["chart"] = png_path if write_chart(png_path, report) else None
    write_markdown(md_path, report)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print_summary(report)
    print(f"\nwrote {md_path}, {json_path}" + (f", {png_path}" if report["chart"] else ""))
    failed = [r["name"] for r in rows if r["status"] == "failed"]
    if failed:
        print(f"failed rows: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli.run_main(main)
