"""Benchmark every training strategy on this machine.

Every row runs a real training script through its real launcher (python, torchrun, the
script's own mp.spawn) on a CIFAR-sized epoch and reads the figures that the script itself
measured (its --metrics records); epoch 1 is warm-up (loader start, cudnn autotuning,
torch.compile), the figures are over epochs 2..E. The ceiling rows time the training step
alone, in a process of their own, on random tensors already on the device. benchmark.md says
what each column means; it, benchmark.json and benchmark.png (in --out) are rewritten after
every row and each row's output is kept in --log-dir, so a run cut short (--time-budget, a row
timeout, SIGTERM or Ctrl-C; a second one kills the running row at once) still leaves every
finished row behind. One run at a time owns --out. A row whose processes
outlive its work (EXIT_SECONDS after its end record, or its launcher) keeps its figures and
makes the exit status 1: a job that would hold its nodes is a bug to see, not a slow row.

    # every row, on all local GPUs (the report records how long it took)
    python scripts/benchmark.py

    # a few rows, in this order, or the real CIFAR-100 instead of the synthetic stand-in
    python scripts/benchmark.py --rows ddp,ddp-bf16,fast-bf16-compile
    python scripts/benchmark.py --dataset cifar100 --data-dir ./data

    # all of it within 5 minutes: rows that no longer fit are reported as not run, one that the
    # budget ends as cut short (neither is a failure: the exit status stays 0)
    python scripts/benchmark.py --time-budget 300

    # a quick check of the harness on the CPU (tiny model, 2 processes, a few minutes)
    python scripts/benchmark.py --quick --device cpu --out /tmp/bench

What each rank holds under DDP and FSDP2 is scripts/memory_table.py's table.
"""
import argparse
import contextlib
import ctypes
import datetime
import fcntl
import glob
import json
import os
import pickle
import platform
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

STARTED = time.monotonic()  # --time-budget counts from here, before PyTorch's import

# `python scripts/benchmark.py` puts scripts/ on sys.path, not the repository root.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from models import MODEL_NAMES, build_model  # noqa: E402
from utils import cli, data, device_data, lifecycle, metrics, precision  # noqa: E402
from utils.data import NUM_CLASSES  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "scripts"))  # also when this file is imported from elsewhere (tests)
from preflight import PREFETCH, cpu_model  # noqa: E402  (PREFETCH: batches per loader worker)
from torchrun_bounded import live_children  # noqa: E402

EPOCH_IMAGES = 50_000  # one CIFAR-100 training epoch: a row's epoch is the whole global batches it holds
WARMUP_EPOCHS = 1      # epochs left out of a row's median
BASELINE = "ddp"       # the plain row every other row is compared with


@dataclass(frozen=True)
class Defaults:
    """What the benchmark runs when a flag is not given: the one place these numbers live."""
    model: str
    per_device_batch: int   # images per device and step
    steps: int              # optimizer steps per epoch; 0: as many whole batches as EPOCH_IMAGES hold
    epochs: int             # the first is warm-up
    row_timeout: float      # seconds before a row is ended
    ceiling_warmup: int     # untimed steps of a ceiling row
    ceiling_steps: int      # steps per timed window
    ceiling_windows: int    # timed windows (the median is reported)
    min_row_seconds: float  # under --time-budget, a row is not started with less left


# min_row_seconds: an uncompiled full row of 3 epochs took 18 to 27 s on an H200 (ResNet-18, batch 512, its
# start included; the default's fourth epoch adds 1 to 2.5 s); a --quick row 5 to 11 s on the 2-core build
# machine under the test suite.
DEFAULTS = {
    "full": Defaults(model="resnet18", per_device_batch=512, steps=0, epochs=4, row_timeout=300.0,
                     ceiling_warmup=20, ceiling_steps=50, ceiling_windows=5, min_row_seconds=30.0),
    "quick": Defaults(model="resnet_tiny", per_device_batch=16, steps=4, epochs=3, row_timeout=180.0,
                      ceiling_warmup=2, ceiling_steps=4, ceiling_windows=3, min_row_seconds=10.0),
}

# Dense (no sparsity) bfloat16 tensor-core peak in TFLOP/s with float32 accumulation, from
# the vendor datasheets; GPUs without bfloat16 get their float16 figure (also float32
# accumulation, as autocast's matmuls and convolutions use). First match wins: the longer
# names come before the shorter ones they contain.
PEAK_TFLOPS = [
    (r"H100 PCIe", 756.0, "H100 PCIe, bf16 dense"),
    (r"H100 NVL|H200 NVL", 835.0, "H100/H200 NVL, bf16 dense"),
    (r"H100|H200|GH200", 989.0, "H100/H200 SXM, bf16 dense"),
    (r"\bA100\b", 312.0, "A100, bf16 dense"),  # not the RTX A1000
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
    per_device_batch: int = 0  # 0: the run's per-device batch


FAST = ("--data-on-gpu", "--channels-last")
COMPILE_ON_CPU = "torch.compile on the CPU spends minutes compiling for a run of seconds"
# Each row's precision is not in its `about`: the report derives it from the row's flags and
# the device (row_precision), so that it cannot drift from what runs.
ROWS = [
    Row("dp", "dataparallel.py", "python", True, (), "nn.DataParallel: one process drives every GPU, in NCHW "
                                                     "(dataparallel.py has no --channels-last)"),
    Row("dp-bf16", "dataparallel.py", "python", True, ("--amp", "bf16"), "nn.DataParallel with bf16 autocast",
        needs_bf16=True),
    Row("ddp-1proc-noddp", "distributed.py", "python", False, (),
        "distributed.py under plain python: one process, no process group, no DDP wrapper"),
    Row("ddp-1proc", "distributed.py", "torchrun", False, (),
        "distributed.py under torchrun, one process: wrapped in DDP on a group of one, so that beside "
        "ddp-1proc-noddp it shows DDP's own cost (its hooks and buckets, no other rank to wait for)"),
    Row(BASELINE, "distributed.py", "torchrun", True, (), "DDP via torchrun, the template path: the baseline"),
    Row("ddp-nchw", "distributed.py", "torchrun", True, ("--no-channels-last",),
        "the template path in NCHW: beside ddp on a GPU, what the default channels_last gains (the CPU's "
        "default is NCHW)"),
    Row("ddp-spawn", "distributed_mp.py", "spawn", True, (), "DDP, processes started by mp.spawn"),
    Row("ddp-bf16", "distributed_apex.py", "torchrun", True, ("--amp", "bf16"),
        "DDP + bf16 autocast, the loader, the default layout", needs_bf16=True),
    Row("ddp-bf16-nchw", "distributed_apex.py", "torchrun", True, ("--amp", "bf16", "--no-channels-last"),
        "DDP + bf16 autocast, the loader, NCHW", needs_bf16=True),
    Row("ddp-fp16", "distributed_apex.py", "torchrun", True, ("--amp", "fp16"), "DDP + fp16 autocast + GradScaler",
        gpu_only="fp16 convolutions on the CPU are a slow fallback, not a measurement"),
    Row("ddp-accum2", "distributed_gradient_accumulation.py", "torchrun", True, ("--accum-steps", "2"),
        "DDP, 2 accumulated micro-batches per step"),
    Row("fsdp2", "distributed_fsdp.py", "torchrun", True, (), "FSDP2 fully_shard (ZeRO-3), the template path"),
    Row("fsdp2-bf16", "distributed_fsdp.py", "torchrun", True, ("--mp-policy", "bf16"),
        "FSDP2 with the bf16 MixedPrecisionPolicy (bf16 compute, fp32 gradient reduction)", needs_bf16=True),
    Row("fast-fp32", "distributed_apex.py", "torchrun", True, ("--opt-level", "O0", *FAST),
        "DDP, no autocast, data on the device, channels_last", fast_loader=True),
    Row("fast-bf16", "distributed_apex.py", "torchrun", True, ("--amp", "bf16", *FAST),
        "DDP + bf16 autocast, data on the device, channels_last", needs_bf16=True, fast_loader=True),
    Row("fast-bf16-compile", "distributed_apex.py", "torchrun", True, ("--amp", "bf16", *FAST, "--compile"),
        "fast-bf16 + torch.compile", needs_bf16=True, fast_loader=True, gpu_only=COMPILE_ON_CPU),
    Row("fast-bf16-compile-1024", "distributed_apex.py", "torchrun", True, ("--amp", "bf16", *FAST, "--compile"),
        "fast-bf16-compile at 1024 images per device", needs_bf16=True, fast_loader=True, gpu_only=COMPILE_ON_CPU,
        per_device_batch=1024),
    Row("fast-bf16-cudagraphs", "distributed_apex.py", "python", False,
        ("--amp", "bf16", *FAST, "--compile", "--compile-mode", "reduce-overhead"),
        "fast-bf16-compile with CUDA graphs, one process under plain python (no DDP: no hooks between the graphs)",
        needs_bf16=True, fast_loader=True, gpu_only="CUDA graphs need a GPU"),
    Row("fast-bf16-cudagraphs-ddp", "distributed_apex.py", "torchrun", True,
        ("--amp", "bf16", *FAST, "--compile", "--compile-mode", "reduce-overhead"),
        "fast-bf16-cudagraphs under DDP, as several GPUs would run it: the graphs split at DDP's buckets, "
        "whose all-reduces run between them", needs_bf16=True, fast_loader=True, gpu_only="CUDA graphs need a GPU"),
    Row("fast-bf16-autotune", "distributed_apex.py", "torchrun", True,
        ("--amp", "bf16", *FAST, "--compile", "--compile-mode", "max-autotune-no-cudagraphs"),
        "fast-bf16-compile with kernels tuned for this GPU (minutes of tuning first)",
        needs_bf16=True, fast_loader=True, gpu_only=COMPILE_ON_CPU),
]


@dataclass(frozen=True)
class Ceiling:
    """The training step alone, in a process of its own, on a batch already on the device:
    no loader, no DDP, no communication. Its name says its precision and what else differs
    from the eager NCHW step."""
    name: str
    dtype: str               # autocast dtype name, "fp32" for none
    channels_last: bool
    compile_mode: str        # torch.compile's mode, "" for eager
    mirrors: str             # the script row that runs the same step with real data
    per_device_batch: int = 0
    gpu_only: str = ""       # why it is skipped on the CPU ("" = it runs there)

    @property
    def about(self) -> str:
        """Its layout and how it runs: "NCHW, eager", "channels_last, torch.compile reduce-overhead (CUDA graphs)"."""
        mode = f"torch.compile {self.compile_mode}" if self.compile_mode else "eager"
        graphs = " (CUDA graphs)" if self.compile_mode == "reduce-overhead" else ""
        return f"{'channels_last' if self.channels_last else 'NCHW'}, {mode}{graphs}"


CEILINGS = [
    Ceiling("ceiling-fp32", "fp32", True, "", "fast-fp32"),
    Ceiling("ceiling-bf16-nchw", "bf16", False, "", "ddp-bf16-nchw"),
    Ceiling("ceiling-bf16-channels-last", "bf16", True, "", "fast-bf16"),
    Ceiling("ceiling-bf16-compile", "bf16", True, "default", "fast-bf16-compile", gpu_only=COMPILE_ON_CPU),
    Ceiling("ceiling-bf16-cudagraphs", "bf16", True, "reduce-overhead", "fast-bf16-cudagraphs",
            gpu_only="CUDA graphs need a GPU"),
    Ceiling("ceiling-bf16-compile-1024", "bf16", True, "default", "fast-bf16-compile-1024", per_device_batch=1024,
            gpu_only=COMPILE_ON_CPU),
]
ALL_NAMES = [row.name for row in ROWS] + [c.name for c in CEILINGS]
DEFAULT_NAMES = [n for n in ALL_NAMES if n not in ("fast-bf16-autotune", "ceiling-bf16-compile-1024")]
QUICK_ROWS = ["ddp-1proc-noddp", "ddp-1proc", BASELINE, "ddp-bf16", "fast-fp32",
              "ceiling-bf16-nchw", "ceiling-bf16-channels-last", "ceiling-bf16-cudagraphs"]
# Ratios the report spells out (numerator row, denominator row, what the ratio tells), of
# images/s per device, beside every row's ratio to the baseline.
COMPARISONS = [
    ("ddp-1proc", "ddp-1proc-noddp", "DDP's own cost: one process wrapped in DDP (torchrun) against none "
                                     "(plain python)"),
    ("ddp", "ddp-1proc", "all devices against one, both under DDP (scaling efficiency; 1.00 is perfect)"),
    ("ddp-bf16", "ddp", "bf16 autocast against fp32, template path"),
    ("ddp", "ddp-nchw", "the default layout against NCHW through the loader, fp32: channels_last's gain on "
                        "NVIDIA GPUs of compute capability 8.0+ (elsewhere both are NCHW)"),
    ("ddp-bf16", "ddp-bf16-nchw", "the default layout against NCHW through the loader, bf16"),
    ("fsdp2", "ddp", "sharded (FSDP2) against replicated (DDP), fp32"),
    ("fsdp2-bf16", "ddp-bf16", "FSDP2 bf16 policy against DDP bf16 autocast"),
    ("fast-bf16", "ddp-bf16", "data on the device (channels_last) against the loader (the default layout), bf16"),
    ("fast-bf16-compile", "fast-bf16", "torch.compile against eager"),
    ("fast-bf16-compile-1024", "fast-bf16-compile", "1024 images per device against the run's batch, compiled"),
    ("fast-bf16-cudagraphs-ddp", "fast-bf16-compile", "CUDA graphs against plain torch.compile, both under DDP"),
    ("fast-bf16-cudagraphs-ddp", "fast-bf16-cudagraphs", "both with CUDA graphs: all devices under DDP against one "
                                                         "without DDP (one GPU: DDP's own cost; more: scaling too)"),
    ("ceiling-bf16-channels-last", "ceiling-bf16-nchw", "channels_last against NCHW, the step alone, bf16"),
    ("ceiling-bf16-compile", "ceiling-bf16-channels-last", "torch.compile against eager, the step alone, bf16"),
    ("ceiling-bf16-cudagraphs", "ceiling-bf16-compile", "CUDA graphs against plain torch.compile, the step alone, "
                                                        "bf16"),
    ("ddp-bf16", "ceiling-bf16-channels-last", "the loader path (the default layout) against the channels_last "
                                               "step alone, bf16"),
]
# Each ceiling against the script row whose step it times.
COMPARISONS += [(c.mirrors, c.name, f"{c.mirrors} against its step alone ({c.about})") for c in CEILINGS]


# --- precision: what each row computes in -------------------------------------------

# TF32 (float32 range, a 10-bit mantissa in the multiply, float32 sums) came with Ampere.
TF32_MIN_CAPABILITY = (8, 0)
# The scripts that also let float32 matmuls use TF32 (torch.backends.cuda.matmul.allow_tf32 is
# False by default); the ceilings' own process does as distributed_apex.py does. Every row
# inherits this process's environment, where TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 turns them on
# everywhere (torch.get_float32_matmul_precision() is then "high").
MATMUL_TF32_SCRIPTS = ("distributed_apex.py",)


def tf32_convolutions(use_cuda: bool) -> bool:
    """Whether float32 convolutions run in TF32 here: cuDNN's default (torch.backends.cudnn.allow_tf32,
    which no script turns off), on a GPU that has TF32 (Ampere or newer)."""
    return use_cuda and torch.cuda.get_device_capability(0) >= TF32_MIN_CAPABILITY


def flag_value(row, flag: str, default=None):
    """What a script row gives `flag` (the item after it in its flags), or `default`."""
    return row.flags[row.flags.index(flag) + 1] if flag in row.flags else default


def row_precision(row, plan) -> tuple:
    """(amp, label): the dtype the row computes in ("fp32", "bf16", "fp16"), and the label
    that the report prints, read from the row's own flags."""
    if isinstance(row, Ceiling):
        amp, matmul_tf32 = row.dtype, True
    else:
        amp = flag_value(row, "--amp", "fp32")
        if flag_value(row, "--mp-policy") == "bf16":
            return "bf16", "bf16 (FSDP2 MixedPrecisionPolicy: bf16 compute, fp32 gradient reduction)"
        matmul_tf32 = row.script in MATMUL_TF32_SCRIPTS or torch.get_float32_matmul_precision() != "highest"
    if amp == "bf16":
        return amp, "bf16 autocast"
    if amp == "fp16":
        return amp, "fp16 autocast + GradScaler"
    if plan.tf32:
        return amp, "fp32 (TF32 convolutions and matmuls)" if matmul_tf32 else "fp32 (TF32 convolutions)"
    return amp, "fp32"


def row_wrapper(row, plan) -> str:
    """What wraps the model in a script row: the launcher decides (the scripts wrap in DDP
    under any launcher, a group of one included, and in nothing under plain python)."""
    if row.script == "dataparallel.py":
        return "nn.DataParallel" if plan.use_cuda else "no wrapper (CPU: nn.DataParallel needs GPUs)"
    if row.launcher == "python":
        return "no wrapper, no process group (plain python)"
    return "FSDP2 fully_shard" if row.script == "distributed_fsdp.py" else "DDP"


# --- arithmetic -----------------------------------------------------------------------

def spread(values: list, what: str = "") -> dict:
    """A row's median_WHATimages_per_second, min_... and max_... of the timed figures; min and max
    only where there are two or more of them (the min-max of one value is not a spread)."""
    values = [v for v in values if v is not None]
    several = len(values) > 1
    return {f"median_{what}images_per_second": statistics.median(values) if values else None,
            f"min_{what}images_per_second": min(values) if several else None,
            f"max_{what}images_per_second": max(values) if several else None}


def timed_steps(steps: int) -> int:
    """The steps of an epoch that the scripts' images/s counts: all but the first
    min(10, steps // 4), or all of them when that leaves none (utils.metrics.EpochTimer)."""
    warmup = min(10, steps // 4)
    return steps - warmup if steps > warmup else steps


def summarize_epochs(records: list) -> dict:
    """A row's figures from its --metrics records, over the epochs after warm-up: the
    steady images/s (the scripts' own figure, over timed_steps of each epoch) and the whole
    epoch's (every step of it: steps x global batch / the measured epoch), each as median,
    min and max; the median measured epoch duration; the largest peak memory of those
    epochs (epoch 1's, cudnn's autotuning and torch.compile included, is in `epochs`)."""
    epochs = [r for r in records if r.get("event") == "epoch"]
    if not epochs:
        raise ValueError("no epoch records")
    summary_epochs, previous_step = [], 0
    for r in epochs:
        # The record's `step` counts optimizer steps from the start: this epoch's are the difference.
        steps = r["step"] - previous_step if "step" in r else None
        whole = (steps * r["global_batch"] / r["epoch_seconds"]
                 if steps and r.get("global_batch") and r["epoch_seconds"] > 0 else None)
        summary_epochs.append({"epoch": r["epoch"], "steps": steps,
                               "timed_steps": timed_steps(steps) if steps else None,
                               "images_per_second": r["images_per_second"], "whole_epoch_images_per_second": whole,
                               "epoch_seconds": r["epoch_seconds"], "peak_memory_mb": r.get("peak_memory_mb")})
        previous_step = r.get("step", previous_step)
    steady = [e for e in summary_epochs if e["epoch"] > WARMUP_EPOCHS]
    counted = steady or summary_epochs  # a one-epoch run has nothing but its warm-up epoch
    peaks = [e["peak_memory_mb"] for e in counted if e["peak_memory_mb"] is not None]
    return {
        **spread([e["images_per_second"] for e in counted]),
        **spread([e["whole_epoch_images_per_second"] for e in counted], "whole_epoch_"),
        "timed_count": len(counted), "timed_unit": "epochs",
        "timed_steps": counted[-1]["timed_steps"],  # per epoch; every epoch of a row has as many steps
        "median_epoch_seconds": statistics.median(e["epoch_seconds"] for e in counted),
        "counted_epochs": [e["epoch"] for e in counted],
        "warmup_included": not steady,
        "peak_memory_mb": max(peaks) if peaks else None,
        "epochs": summary_epochs,
    }


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
    steps: int                  # 0: one CIFAR-sized epoch of whole batches, per row
    epochs: int
    workers: int                # --workers; None: each row's own (row_workers)
    model: str
    dataset: str
    data_dir: str
    timeout: float              # --row-timeout
    bf16: bool
    min_row_seconds: float      # under time_budget, a row is not started with less left
    ceiling_warmup: int
    ceiling_steps: int
    ceiling_windows: int
    names: list = field(default_factory=list)  # in the order they run
    tf32: bool = False          # float32 convolutions run in TF32 (tf32_convolutions)
    time_budget: float = None   # seconds for the whole benchmark; None: no limit
    log_dir: str = ""
    synthetic_files: str = ""   # --dataset synthetic: the folder the rows read it from (write_synthetic_files)


def visible_gpus(args) -> tuple:
    """(use_cuda, GPUs to use): --device, or (auto) every visible GPU."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise cli.UsageError("--device cuda but no CUDA GPU is visible; use --device cpu")
    use_cuda = args.device != "cpu" and torch.cuda.is_available()
    return use_cuda, torch.cuda.device_count() if use_cuda else 0


def resolve_plan(args) -> Plan:
    """Fill in DEFAULTS and the machine's; bad combinations raise UsageError."""
    d = DEFAULTS["quick" if args.quick else "full"]
    use_cuda, gpus = visible_gpus(args)
    procs = args.nproc or gpus or 2
    if use_cuda and procs > gpus:
        raise cli.UsageError(f"--nproc {procs} but only {gpus} GPU{'s' if gpus != 1 else ''} visible "
                             "(one process per GPU)")
    global_batch = args.batch_size or d.per_device_batch * procs
    per_device_batch = cli.split_batch(global_batch, procs)
    steps = args.steps if args.steps is not None else d.steps
    epochs = args.epochs or d.epochs
    if epochs <= WARMUP_EPOCHS:
        raise cli.UsageError(f"--epochs {epochs}: epoch 1 is warm-up and not counted; use 2 or more")
    names = args.rows.split(",") if args.rows is not None else (QUICK_ROWS if args.quick else DEFAULT_NAMES)
    names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    unknown = [n for n in names if n not in ALL_NAMES]
    if unknown:
        raise cli.UsageError(f"--rows: unknown row {unknown[0]!r}; choose from {', '.join(ALL_NAMES)}")
    if not names:
        raise cli.UsageError("--rows names no row")
    plan = Plan(use_cuda=use_cuda, gpus=gpus, procs=procs, global_batch=global_batch,
                per_device_batch=per_device_batch, steps=steps, epochs=epochs, workers=0,
                model=args.model or d.model, dataset=args.dataset,
                data_dir=os.path.abspath(os.path.expanduser(args.data_dir)),  # rows run in the root
                timeout=args.row_timeout or d.row_timeout, names=names,
                # bfloat16 in hardware: Ampere or newer (older GPUs emulate it, slower than float16)
                bf16=precision.cuda_bf16_native() if use_cuda else precision.cpu_autocast_works(torch.bfloat16),
                tf32=tf32_convolutions(use_cuda),
                time_budget=args.time_budget, min_row_seconds=d.min_row_seconds,
                ceiling_warmup=d.ceiling_warmup,
                ceiling_steps=args.ceiling_steps or d.ceiling_steps,
                ceiling_windows=args.ceiling_windows or d.ceiling_windows)
    for row in ROWS:
        if row.name not in names:
            continue
        procs_, batch, _, steps_ = row_shape(row, plan)
        accum = int(flag_value(row, "--accum-steps", 1))
        if batch % (procs_ * accum):  # the same global batch in `accum` micro-batches
            raise cli.UsageError(f"row {row.name}: global batch {batch} does not split into {procs_} processes x "
                                 f"{accum} micro-batches: use a multiple of {procs_ * accum}, or leave the row out "
                                 "(--rows)")
        if args.dataset == "cifar100" and steps_ * batch > EPOCH_IMAGES:
            raise cli.UsageError(f"row {row.name}: --steps {steps_} x global batch {batch} = {steps_ * batch} "
                                 f"images per epoch, more than CIFAR-100's {EPOCH_IMAGES}: lower --steps")
    # On the CPU the training processes already share the cores: no loader workers.
    plan.workers = args.workers if args.workers is not None or use_cuda else 0
    return plan


# The shared memory one loader sample takes: a uint8 3x32x32 image (normalised later, on the
# device) and an int64 label.
LOADER_SAMPLE_BYTES = 3 * 32 * 32 + 8


def row_workers(row, plan: Plan) -> tuple:
    """(loader workers per process, why fewer than the cores allow, or ""): --workers, or
    enough to feed a GPU from the cores that the row's own processes share (dataparallel.py's
    one process loads every GPU's batch), as many as fit in /dev/shm; 0 with the data on the device."""
    if row.fast_loader:
        return 0, ""
    if plan.workers is not None:
        return plan.workers, ""
    procs, batch = row_shape(row, plan)[:2]
    # The cores this process may use (taskset, a container's cpuset or CPU limit), as utils/data.py counts them.
    affinity, quota = data.cpu_limits()
    cores = int(min(affinity, quota or affinity))
    wanted = max(1, min(16, cores // procs - 1))
    free = lifecycle.shm_free_bytes(lifecycle.SHM_DIR)
    workers = workers_that_fit(wanted, procs, batch // procs, free)
    return workers, "" if workers == wanted else (
        f"{wanted} by the cores, {workers} by the {free / 2**20:,.0f} MiB free in {lifecycle.SHM_DIR} "
        "(each worker's prefetched batches are held there)")


def workers_that_fit(wanted: int, procs: int, per_device_batch: int, free) -> int:
    """`wanted` loader workers per process, or fewer if the batches that they may hold in
    shared memory at once would not fit in its `free` bytes: PREFETCH per worker of
    the training loader, and of the evaluation loader, whose batch is one image (a row
    evaluates one image per process, row_command), in each of `procs` processes. A worker
    that finds /dev/shm full dies of a bus error, and Docker gives a container 64 MB of it.
    free None (no such folder): `wanted`. Can be 0: the process loads its own batches."""
    if free is None:
        return wanted
    per_worker = procs * PREFETCH * (per_device_batch + 1) * LOADER_SAMPLE_BYTES
    return max(0, min(wanted, free // per_worker))


def skip_reason(row, plan: Plan) -> str:
    if row.gpu_only and not plan.use_cuda:
        return row.gpu_only
    if (row.dtype == "bf16" if isinstance(row, Ceiling) else row.needs_bf16) and not plan.bf16:
        return ("this GPU has no bfloat16 hardware (Ampere or newer needed)" if plan.use_cuda
                else "this PyTorch build has no bfloat16 autocast on the CPU")
    return ""


def row_shape(row: Row, plan: Plan) -> tuple:
    """(processes, global batch, devices, steps per epoch): one-process rows take one
    device's batch, so that they do the same work per device as the all-device rows (so do
    the dp rows on the CPU, where dataparallel.py trains the plain module)."""
    per_device = row.per_device_batch or plan.per_device_batch
    if row.launcher == "python" and row.all_devices and plan.use_cuda:  # DataParallel: one process, every GPU
        procs, batch, devices = 1, per_device * plan.procs, plan.procs
    elif row.all_devices and row.launcher != "python":
        procs, batch, devices = plan.procs, per_device * plan.procs, plan.procs
    else:
        procs, batch, devices = 1, per_device, 1
    return procs, batch, devices, plan.steps or max(1, EPOCH_IMAGES // batch)  # steps 0: a CIFAR-100 epoch


def row_command(row: Row, plan: Plan, metrics_path: str, workers: int, as_typed: bool = False) -> list:
    """`workers`: its result's (row_workers, read once: /dev/shm's free space changes). as_typed: as a
    reader would give it, --dataset synthetic (the same images as the files the row read)."""
    procs, batch, devices, steps = row_shape(row, plan)
    files = plan.synthetic_files and not as_typed
    dataset, data_dir = ("cifar100", plan.synthetic_files) if files else (plan.dataset, plan.data_dir)
    train_args = [
        row.script, "--dataset", dataset, "--model", plan.model, "--batch-size", str(batch),
        "--epochs", str(plan.epochs), "--train-samples", str(steps * batch),
        # Evaluation runs after each epoch's clock has stopped; one image per process keeps
        # the rows short while still running it.
        "--test-samples", str(procs),
        "--workers", str(workers), "--metrics", metrics_path, *row.flags,
    ]
    if dataset == "cifar100":
        train_args += ["--data-dir", data_dir]
    if row.script == "dataparallel.py" and plan.use_cuda:  # the GPUs that the other rows use
        train_args += ["--gpus", ",".join(str(i) for i in range(devices))]
    if row.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
                *train_args]
    if row.launcher == "spawn":
        return [sys.executable, *train_args, "--nproc-per-node", str(procs)]
    return [sys.executable, *train_args]


def write_synthetic_files(plan: Plan):
    """--dataset synthetic, image for image, written in CIFAR-100's file layout to a new folder
    (plan.synthetic_files, removed after the run) for the rows to read with --dataset cifar100, as
    the real data set is read: an array in memory that the loader workers index. Made image by
    image in the workers instead, its generator takes most of a worker's time (one worker on a
    2-core CPU: 7,189 synthetic samples/s, 25,489 from CIFAR files;
    results/cpu-loader-bytes-2026-11-28). As many images as the largest row trains on."""
    rows = [row_shape(row, plan) for row in ROWS if row.name in plan.names]
    if plan.dataset != "synthetic" or not rows:
        return
    for stale in glob.glob(os.path.join(tempfile.gettempdir(), "benchmark-synthetic-*-*")):
        try:  # its run's pid: gone, the run was killed before it could remove the folder
            os.kill(int(os.path.basename(stale).split("-")[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except (ValueError, OSError):  # not a pid, or another user's process: not ours to judge
            pass
    plan.synthetic_files = tempfile.mkdtemp(prefix=f"benchmark-synthetic-{os.getpid()}-")
    folder = os.path.join(plan.synthetic_files, "cifar-100-python")
    os.mkdir(folder)
    for split, count in (("train", max(batch * steps for _, batch, _, steps in rows)),
                         ("test", max(procs for procs, *_ in rows))):  # a row evaluates one image per process
        synthetic = data.SyntheticCIFAR(split == "train", count)
        pixels, labels = device_data.uint8_images(synthetic)  # N x H x W x C; a file row is C x H x W
        with open(os.path.join(folder, split), "wb") as f:  # protocol 2, as the release's files
            pickle.dump({"data": pixels.transpose(0, 3, 1, 2).reshape(count, -1), "fine_labels": labels}, f,
                        protocol=2)
    with open(os.path.join(folder, "meta"), "wb") as f:
        pickle.dump({"fine_label_names": synthetic.classes}, f, protocol=2)


def short_command(row, plan: Plan) -> str:
    if isinstance(row, Ceiling):
        batch, multiplier = row.per_device_batch or plan.per_device_batch, plan.procs
        device = "cuda" if plan.use_cuda else "cpu"
        return (f"the step alone: {row.about}, {batch} random images on {device}"
                + (f", x {multiplier} {'GPUs' if plan.use_cuda else 'processes'} (no communication)"
                   if multiplier > 1 else ""))
    procs = row_shape(row, plan)[0]
    launcher = {"python": "python", "torchrun": f"torchrun x{procs}", "spawn": f"mp.spawn x{procs}"}[row.launcher]
    return " ".join([launcher, row.script, *row.flags])


def subprocess_env(plan: Plan, graphs: bool = False) -> dict:
    """graphs: the row runs torch.compile's mode reduce-overhead, whose every fall-back to running
    a graph without CUDA graphs inductor logs as "skipping cudagraphs due to ..." (a warning of
    its log artifact `cudagraphs`, on by default); named in TORCH_LOGS, so that a TORCH_LOGS of
    ours that quiets inductor cannot hide it (cudagraph_utils.log_cudagraph_skip_and_bump_counter,
    2.11 and 2.14)."""
    env = dict(os.environ)
    if graphs:
        env["TORCH_LOGS"] = ",".join(filter(None, [env.get("TORCH_LOGS"), "cudagraphs"]))
    # A launcher's identity in our own environment would be inherited by the row's processes.
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(key, None)
    # One thread per training process (torchrun's choice too): several processes share the cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # stacks on SIGABRT (dump_stacks) and on a crash
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not plan.use_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# --- ending rows: timeouts and stop signals -------------------------------------------

class Interrupted(BaseException):
    """SIGTERM or SIGINT reached the benchmark. A BaseException, so that no handler meant
    for a failing row swallows it on its way to main()."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


_stopping = []  # the signal that is ending the benchmark, once one has arrived
_running = {}   # tag -> launcher of the row running now (run_process): what a second signal kills


def _on_stop_signal(signum, frame):
    if _stopping:  # a second signal while the first ends the row: the user will not wait for it
        for tag, proc in list(_running.items()):
            signal_row(proc, tag, signal.SIGKILL)
        print(f"\n{signal.Signals(signum).name} again: stopped at once, the running row's processes killed "
              "(SIGKILL); the report holds the rows finished before", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)
    _stopping.append(signum)
    raise Interrupted(signum)


def _record_stop_signal(signum, frame):
    """Once only the report is left to write: the signal is kept for the exit status and cuts
    nothing short (raised there, it would leave a traceback and the report half-written)."""
    if not _stopping:
        _stopping.append(signum)


def install_stop_handlers(handler=_on_stop_signal):
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def _die_with_parent():
    """In the row's launcher, before it starts: if the benchmark dies without ending it
    (SIGKILL), the kernel sends it SIGTERM, which torchrun and the scripts pass on to
    their workers. Linux only; elsewhere the stop handlers are the only guard."""
    os.setsid()  # a session of its own: the whole row can be signalled as one group
    # No core file for dump_stacks' SIGABRT (the soft limit only: a row may raise it again).
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def end_group(proc, tag: str):
    """SIGTERM to every process of the row, as a cluster signals a job step, then SIGKILL to
    those still running TERM_SECONDS later, and at most KILL_SECONDS for the kernel to take them."""
    for sig, wait in ((signal.SIGTERM, TERM_SECONDS), (signal.SIGKILL, KILL_SECONDS)):
        signal_row(proc, tag, sig)
        deadline = time.monotonic() + wait
        while (proc.poll() is None or row_processes(tag)) and time.monotonic() < deadline:
            time.sleep(0.1)


def signal_row(proc, tag: str, sig):
    """`sig` to the row's process group and to the processes of the row outside it (row_processes;
    torchrun starts its workers in sessions of their own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    for pid in row_processes(tag):
        _signal(pid, sig)


ROW_TAG = "BENCHMARK_ROW"  # in the environment of a row's launcher, and so of every process it starts


def row_processes(tag: str) -> list:
    """The running processes whose environment holds ROW_TAG=tag: the row's, in its process
    group or not (torchrun starts its workers with start_new_session), whoever their parent is
    by now (an orphan's is init). A zombie is none: its environment is gone with its memory,
    and a container's init may never reap it."""
    needle = f"\0{ROW_TAG}={tag}\0".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # gone, a zombie, or another user's
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in b"\0" + f.read():
                    found.append(int(pid))
    return found


def dump_stacks(proc, log, why: str):
    """The Python stacks of the row's launcher and of the processes it started (the training
    processes; their loader workers are not asked), into its log, one process after another
    so that their lines do not mix: the rows run with PYTHONFAULTHANDLER=1, whose handler
    prints every thread's stack on SIGABRT and then lets the process die. end_group ends
    what is left."""
    log.write(f"\n--- benchmark: {why}; the Python stacks of its processes follow (SIGABRT) ---\n")
    log.flush()
    # All stopped first (SIGSTOP), then each one asked and let go in turn: otherwise a launcher
    # that sees its worker die of the first SIGABRT moves on (torchrun to its shutdown) before
    # its own turn, and its stack no longer shows where the row hung. The launcher last (it may
    # forward signals); each waited for until it is gone, all of them within STACK_SECONDS.
    pids = [*live_children(proc.pid), proc.pid]
    for pid in pids:
        _signal(pid, signal.SIGSTOP)
    deadline = time.monotonic() + STACK_SECONDS
    for pid in pids:
        if not _abort_main_thread(pid):
            continue
        _signal(pid, signal.SIGCONT)  # the main thread handles its pending SIGABRT before any other code
        while time.monotonic() < deadline and (pid in live_children(proc.pid) if pid != proc.pid
                                               else proc.poll() is None):
            time.sleep(0.05)
    for pid in pids:  # one that did not die stays stopped no longer: end_group's SIGTERM must reach it
        _signal(pid, signal.SIGCONT)


def _abort_main_thread(pid: int) -> bool:
    """SIGABRT to the main thread of process `pid` (whose thread id is its pid). The fault handler
    prints the other threads' stacks without the GIL, while they run; only the stack of the thread
    that took the signal stands still. Sent to the process, SIGABRT goes to whichever thread
    wakes first from SIGCONT, often one of PyTorch's C++ threads (torchrun's TCPStore server): the
    main thread then runs Python code while its stack is printed, and the print can read a frame
    as it is freed and crash half-way (seen: a segmentation fault in the middle of torchrun's
    stack). glibc's tgkill (2.30 and later); elsewhere, to the process."""
    try:
        tgkill = ctypes.CDLL(None).tgkill
    except (OSError, AttributeError):
        return _signal(pid, signal.SIGABRT)
    return tgkill(pid, pid, signal.SIGABRT) == 0


def _signal(pid: int, sig) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


# How long a row's processes may take to end after its end record. They end within seconds
# (a whole --quick row, its start and exit included, took 5 to 11 s on the 2-core build
# machine under the test suite); far longer is a hang.
EXIT_SECONDS = 30.0
# Ending a row: its stacks first where it hung (dump_stacks), SIGTERM (torchrun passes it on, the
# scripts stop at their next step), then SIGKILL and a second for the kernel to take them. Their
# sum is the most that ending a row takes; REPORT_SECONDS keeps it back from --time-budget.
STACK_SECONDS, TERM_SECONDS, KILL_SECONDS = 4.0, 5.0, 1.0
ENDING_SECONDS = STACK_SECONDS + TERM_SECONDS + KILL_SECONDS
# Then the report and the interpreter's exit, which with PyTorch loaded is not quick: 0.5 s and
# 1.2 s idle on the 2-core build machine, 4 s and 8 s beside eight busy processes.
REPORT_SECONDS = ENDING_SECONDS + 20.0
CUT_SHORT = "cut short"  # run_process's status for a row that --time-budget ended


def run_process(cmd: list, env: dict, timeout: float, log_path: str, finished=None, budget: float = None) -> tuple:
    """(status, the output): the exit status; None after its `timeout` (its stacks go to the
    log first, dump_stacks); CUT_SHORT when the `budget` (seconds, None: no limit) ran out
    first; or a str: why processes of a row that did its work had to be ended. The row runs in
    a session of its own, its processes tagged (row_processes), so that ending it ends the
    launcher and every process it started, within ENDING_SECONDS; stdout and stderr go to
    log_path, which is kept.

    finished(): whether the row's work is done (its end record written). From then on its
    processes have EXIT_SECONDS to exit, its timeout or not (only the budget cuts that short);
    if they have not, their stacks go to the log and they are ended: a job that would have
    held its nodes until the scheduler's time limit, whose figures are whole all the same. So
    is a launcher that exits 0 with processes of the row still running EXIT_SECONDS later
    (ended, without their stacks)."""
    tag = f"{os.getpid()}:{log_path}"
    started = time.monotonic()
    deadline, cut, done_at = started + timeout, started + (budget if budget is not None else float("inf")), None
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, ROW_TAG: tag}, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)
        _running[tag] = proc
        try:
            while True:
                try:
                    until = cut if done_at is not None else min(deadline, cut)  # the next thing to act on
                    status = proc.wait(timeout=max(0.01, min(1.0, until - time.monotonic())))
                    # Its processes have EXIT_SECONDS to follow the launcher (an orphaned loader
                    # worker notices within 5 s); one still running then would outlive a job.
                    until = time.monotonic() + EXIT_SECONDS
                    while row_processes(tag) and time.monotonic() < min(until, cut):
                        time.sleep(0.1)
                    left = row_processes(tag)
                    if left:
                        why = (f"{len(left)} of its processes still ran {EXIT_SECONDS:.0f} s after its launcher exited"
                               if until <= cut else "--time-budget ran out while its processes exited")
                        log.write(f"\n--- benchmark: {why}; ended ---\n")
                        end_group(proc, tag)
                        if status == 0:
                            status = f"{why}: they were ended" if until <= cut else CUT_SHORT
                    break
                except subprocess.TimeoutExpired:
                    now = time.monotonic()
                    if done_at is None and finished is not None and finished():
                        done_at = now
                    if done_at is not None and now - done_at >= EXIT_SECONDS:
                        why = f"its processes had not exited {now - done_at:.0f} s after its end record"
                        dump_stacks(proc, log, why)
                        end_group(proc, tag)
                        status = f"{why}: they were ended; their stacks are in its log"
                        break
                    if now >= cut or (now >= deadline and done_at is None):
                        status = CUT_SHORT if now >= cut else None
                        if status is None:  # a hang mid-run shows where it is stuck, as one at its end does
                            dump_stacks(proc, log, f"it ran past its {timeout:.0f} s timeout")
                        end_group(proc, tag)
                        break
        except BaseException:  # Interrupted (a stop signal), or anything else: end the row first
            end_group(proc, tag)
            raise
        finally:
            _running.pop(tag, None)
    with open(log_path, errors="replace") as f:
        return status, f.read()


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


# --- running a row --------------------------------------------------------------------

def base_result(row, plan: Plan) -> dict:
    amp, precision_label = row_precision(row, plan)
    if isinstance(row, Ceiling):
        batch = row.per_device_batch or plan.per_device_batch
        return {"name": row.name, "kind": "ceiling", "about": row.about, "mirrors": row.mirrors,
                "amp": amp, "precision": precision_label, "channels_last": row.channels_last,
                "compile_mode": row.compile_mode or None,
                "processes": 1, "global_batch": batch * plan.procs, "per_device_batch": batch,
                "multiplier": plan.procs, "devices": plan.procs, "short_command": short_command(row, plan),
                "status": "skipped", "reason": ""}
    procs, batch, devices, steps = row_shape(row, plan)
    workers, workers_note = row_workers(row, plan)
    return {"name": row.name, "kind": "script", "about": row.about, "script": row.script,
            "launcher": row.launcher, "flags": list(row.flags), "amp": amp, "precision": precision_label,
            "wrapper": row_wrapper(row, plan), "processes": procs, "global_batch": batch,
            "devices": devices, "steps_per_epoch": steps, "epoch_images": steps * batch,
            "workers": workers, "workers_note": workers_note,
            "short_command": short_command(row, plan), "status": "skipped", "reason": ""}


def launch(row, plan: Plan, work_dir: str, budget, suffix: str, command, finished, graphs: bool) -> tuple:
    """What every row does first: its result, skipped with the reason where it cannot run here;
    else its command, command(out, result), run (run_process: --row-timeout, and the `budget`'s
    seconds) into work_dir/NAME.log, where `out`, work_dir/NAME + suffix, takes its figures (a file
    an earlier run left there is removed: it would be appended to, or read as this run's) and
    finished(out) says whether they are written. The result is marked failed (status, reason, the
    output's tail) unless the command exited 0 with its figures and, for `graphs` (reduce-overhead),
    ran every graph in CUDA graphs. Returns (result, out, whether it has figures to read)."""
    result = base_result(row, plan)
    result["reason"] = skip_reason(row, plan)
    if result["reason"]:
        return result, None, False
    out = os.path.join(work_dir, f"{row.name}{suffix}")
    if os.path.exists(out):
        os.remove(out)
    cmd = command(out, result)
    result.update(command=shlex.join(cmd), log=os.path.join(work_dir, f"{row.name}.log"))
    started = time.perf_counter()
    try:
        status, output = run_process(cmd, subprocess_env(plan, graphs), plan.timeout, result["log"],
                                     lambda: finished(out), budget)
    finally:
        result["wall_seconds"] = time.perf_counter() - started
    if status == CUT_SHORT:
        # Not a failure: nothing is known to be wrong with the row (a first torch.compile alone
        # can take minutes).
        done = "; its end record was written, but its processes had not exited" if finished(out) else ""
        result.update(status="cut short", reason=f"--time-budget had {budget:.0f} s left for it, and it needed more"
                                                 f"{done}; its processes were ended")
        return result, out, False
    if isinstance(status, str):  # the figures are whole; the processes are the problem
        result["did_not_exit"], status = f"wrote its figures, but {status}", 0
    if status != 0 or not finished(out):
        result.update(status="failed", output_tail=output.splitlines()[-30:],
                      reason=f"timed out after {plan.timeout:.0f} s (row timeout); the stacks of its processes are "
                             "in its log" if status is None else f"exit status {status}: {last_message(output)}")
        return result, out, False
    result["status"] = "ok"
    skips = re.findall(r".*skipping cudagraphs? due to.*", output) if graphs else []
    if skips:
        # Timed all the same, but not what the row's name says: a failure to see, not a figure to quote.
        result.update(status="failed", cudagraph_skips=len(skips),
                      reason=f"torch.compile ran without CUDA graphs ({len(skips)} skip(s) logged): "
                             f"{skips[-1].strip()[:200]}")
    return result, out, True


def run_row(row: Row, plan: Plan, work_dir: str, budget: float = None) -> dict:
    result, metrics_path, measured = launch(
        row, plan, work_dir, budget, ".jsonl", lambda out, result: row_command(row, plan, out, result["workers"]),
        lambda out: any(r.get("event") == "end" for r in read_records(out)), graphs="reduce-overhead" in row.flags)
    if "command" in result:  # as a reader would type it: no interpreter path, no log directory
        typed = row_command(row, plan, f"{row.name}.jsonl", result["workers"], as_typed=True)
        result["display_command"] = shlex.join(["python", *typed[1:]])
    if not measured:
        return result
    records = read_records(metrics_path)
    result.update(summarize_epochs(records))
    first = records[0]
    # Not the records' `strategy`: it names the script, not what this launch wrapped the model in
    # (distributed.py writes "ddp-torchrun" under plain python too); the row's `wrapper` says that.
    # What they say they ran must be what the row asked for.
    result.update(device=first.get("device"), world_size=first.get("world_size"))
    claims = [("world_size", result["processes"], first.get("world_size")),
              ("amp", result["amp"], first.get("amp", result["amp"]))]  # by distributed_apex.py and dataparallel.py
    if flag_value(row, "--mp-policy"):  # distributed_fsdp.py records its policy as mp_policy
        claims.append(("mp_policy", flag_value(row, "--mp-policy"), first.get("mp_policy")))
    wrong = [(key, asked, got) for key, asked, got in claims if asked != got]
    if result["status"] == "ok" and wrong:
        key, asked, got = wrong[0]
        result.update(status="failed", reason=f"the row asks for {key} {asked!r} but its script recorded {got!r}")
    return result


# --- the ceiling: the same step on tensors already on the device ---------------------

def time_steps(step, device, steps: int, windows: int) -> list:
    """Seconds taken by each of `windows` windows of `steps` steps. On a GPU the windows are
    timed with CUDA events: no sync between steps."""
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


def measure_ceiling(spec: dict) -> dict:
    """The ceiling's measurement, in a process of its own (the --measure-ceiling mode)."""
    device = torch.device(spec["device"])
    dtype = precision.AMP_DTYPES.get(spec["dtype"])  # None for fp32
    batch = spec["batch"]
    memory_format = torch.channels_last if spec["channels_last"] else torch.contiguous_format
    if device.type == "cuda":
        # As distributed_apex.py does: cudnn picks the fastest algorithms for the fixed shape,
        # and float32 matmuls (all of them in fp32, what autocast leaves in float32 otherwise)
        # may use TF32, as convolutions do by default.
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    model = build_model(spec["model"], NUM_CLASSES).to(device, memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4,
                                fused=True if device.type == "cuda" else None)
    images = torch.randn(batch, 3, 32, 32, device=device).contiguous(memory_format=memory_format)
    targets = torch.randint(0, NUM_CLASSES, (batch,), device=device)
    mode = spec["compile_mode"]
    graphs = mode == "reduce-overhead"
    forward = torch.compile(model, mode=mode) if mode else model

    def step():  # the scripts' step, minus loading, DDP and bookkeeping
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs may be overwritten now
        with torch.amp.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(forward(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    # CUDA graphs: the first call compiles, the second records, the third is the first replay.
    warmup = max(spec["warmup"], 3) if graphs else spec["warmup"]
    for _ in range(warmup):
        step()
    # The timed steps' peak, as the rows' is their counted epochs': not cudnn's autotuning or compilation.
    metrics.reset_peak_memory(device)
    windows = time_steps(step, device, spec["steps"], spec["windows"])
    return {"window_seconds": windows, "warmup_steps": warmup,
            "peak_memory_mb": metrics.peak_memory_mb(device)["peak_memory_mb"]}


def run_ceiling(ceiling: Ceiling, plan: Plan, work_dir: str, budget: float = None) -> dict:
    """One device's share of the batch, timed in a process of its own, times the number of
    devices (GPUs, or CPU processes with the rows' threads each): what the rows would
    reach with nothing but the step. Its spread is over the timed windows; it has no
    epochs, so no whole-epoch figure."""
    batch = ceiling.per_device_batch or plan.per_device_batch
    spec = {"device": "cuda:0" if plan.use_cuda else "cpu", "dtype": ceiling.dtype, "batch": batch,
            "model": plan.model, "channels_last": ceiling.channels_last, "compile_mode": ceiling.compile_mode,
            "warmup": plan.ceiling_warmup, "steps": plan.ceiling_steps, "windows": plan.ceiling_windows}
    result, out_path, measured = launch(
        ceiling, plan, work_dir, budget, ".json",
        lambda out, _: [sys.executable, os.path.abspath(__file__), "--measure-ceiling", json.dumps(spec), "--out", out],
        os.path.exists, graphs=ceiling.compile_mode == "reduce-overhead")
    if not measured:
        return result
    with open(out_path) as f:
        measured = json.load(f)
    per_device = [plan.ceiling_steps * batch / s for s in measured["window_seconds"]]
    result.update(window_seconds=measured["window_seconds"],
                  window_images_per_second_per_device=per_device, warmup_steps=measured["warmup_steps"],
                  **spread([x * plan.procs for x in per_device]), **spread([], "whole_epoch_"),
                  timed_count=len(per_device), timed_unit="windows", timed_steps=plan.ceiling_steps,
                  peak_memory_mb=measured["peak_memory_mb"])
    return result


# --- the report -----------------------------------------------------------------------

def fmt(x, spec, unit=""):
    return f"{x:{spec}}{unit}" if x is not None else "n/a"


def per_device(r) -> float:
    """A row's median images/s per device: a one-process row does one device's share of the
    all-device rows' work, so totals would put it at 1/N of them on N devices."""
    return r["median_images_per_second"] / r["devices"]


def add_derived(rows: list, flops: dict, peak_tflops):
    """Share of peak per device, ratio to the baseline row of this run per device."""
    base = next((r for r in rows if r["name"] == BASELINE and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] != "ok":
            continue
        r["share_of_peak"] = share_of_peak(per_device(r), flops["train_step_per_image"], peak_tflops)
        r["vs_baseline"] = per_device(r) / per_device(base) if base else None


def comparisons(rows: list) -> list:
    """The named ratios of COMPARISONS whose two rows were both measured in this run, of
    images/s per device: a one-process row is compared with the same work per device."""
    rate = {r["name"]: per_device(r) for r in rows if r["status"] == "ok"}
    return [{"rows": [a, b], "what": what, "ratio": rate[a] / rate[b], "per": "device"}
            for a, b, what in COMPARISONS if a in rate and b in rate]


def epoch_text(r) -> str:
    steps, batch = r.get("steps_per_epoch"), r["global_batch"]
    return f"{steps} x {batch:,} = {steps * batch:,}" if steps else "n/a"


def spread_text(r, what: str = "") -> str:
    """min-max of the timed epochs (ceilings: windows), or why there is none."""
    low, high = r[f"min_{what}images_per_second"], r[f"max_{what}images_per_second"]
    if r[f"median_{what}images_per_second"] is None:
        return "n/a"
    if r["timed_count"] == 1:
        return f"one timed {r['timed_unit'][:-1]}" + (" (warm-up)" if r.get("warmup_included") else "")
    return f"{low:,.0f}-{high:,.0f}"


def median_text(r, what: str = "") -> str:
    """The median images/s, and "mean of 2" where two values were timed (their median is their mean)."""
    median = r[f"median_{what}images_per_second"]
    return fmt(median, ",.0f") + (" (mean of 2)" if median is not None and r["timed_count"] == 2 else "")


def timed_text(r) -> str:
    """What the median images/s is a median of: timed epochs (ceilings: windows) x the steps timed in each."""
    return f"{r['timed_count']} x {r['timed_steps']}" if r.get("timed_steps") else "n/a"


def summary_lines(report: dict) -> list:
    """The table of rows and the table of ratios: the markdown's, and the console's summary."""
    lines = [
        "| row | what runs | precision | processes | global batch | img/s after warm-up steps: median | min-max "
        "| timed: epochs (windows) x steps | whole-epoch img/s: median | min-max | epoch: steps x batch = images "
        f"| s per epoch (measured) | peak MiB | % of peak per device | vs {BASELINE} per device |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        start = f"| {r['name']} | {r['short_command']} | {r['precision']} | {r['processes']} | {r['global_batch']} "
        if r["status"] == "ok":
            share = r["share_of_peak"]
            lines.append(
                start + f"| {median_text(r)} | {spread_text(r)} | {timed_text(r)} "
                f"| {median_text(r, 'whole_epoch_')} | {spread_text(r, 'whole_epoch_')} "
                f"| {epoch_text(r)} | {fmt(r.get('median_epoch_seconds'), '.2f')} "
                f"| {fmt(r['peak_memory_mb'], ',.0f')} | {fmt(share * 100 if share is not None else None, '.1f', '%')} "
                f"| {fmt(r['vs_baseline'], '.2f', 'x')} |")
        else:
            lines.append(start + f"| {r['status']} | | | | | | | | | |")
    lines += ["", "## Ratios measured in this run (images/s per device)", "", "| rows | what the ratio tells | ratio |",
              "| --- | --- | ---: |"]
    lines += [f"| {c['rows'][0]} / {c['rows'][1]} | {c['what']} | {c['ratio']:.2f}x |"
              for c in report["comparisons"]]
    if not report["comparisons"]:
        lines.append("| (none: no pair of rows measured) | | |")
    return lines


def write_markdown(path: str, report: dict):
    h, plan = report["header"], report["settings"]
    lines = [
        "# Training throughput benchmark",
        "",
        f"- state: {report['state']}",
        f"- date: {h['date']}",
        f"- hardware: {h['hardware']}",
        f"- PyTorch {h['torch']}, CUDA {h['cuda'] or 'none'}" + ("" if h["cuda_used"] else " (not used)")
        + (f", cuDNN {h['cudnn']}" if h["cudnn"] else "") + f", Python {h['python']}",
        f"- command: `{h['command']}`",
        f"- model {plan['model']}, dataset {plan['dataset']}"
        + (" (written as CIFAR-100 files, which the rows read as the real data set)" if plan.get("synthetic_files")
           else "") + f", {plan['per_device_batch']} images per device and "
        f"step unless the row says otherwise, {plan['epochs']} epochs per row (epoch 1 is warm-up: the figures "
        f"are over epochs 2..{plan['epochs']}), loader workers per process "
        + (str(plan["workers"]) if plan["workers"] is not None else "by the row (its command's --workers: CPU cores "
           "/ its processes - 1, at most 16, no more than /dev/shm holds)"),
        f"- FLOPs per image: {report['flops']['forward_per_image'] / 1e9:.4g} GFLOP forward "
        f"({report['flops']['forward_per_image'] / 2e9:.4g} G multiply-adds), "
        f"{report['flops']['train_step_per_image'] / 1e9:.4g} GFLOP per training step (forward + backward), "
        f"counted by {report['flops']['counted_with']}",
        "- peak: " + (f"{report['peak']['tflops']:g} TFLOP/s per device ({report['peak']['source']})"
                       if report["peak"]["tflops"] else f"n/a ({report['peak']['source']})"),
        "",
        *summary_lines(report),
    ]
    notes = [f"- {r['name']}: {r['status']}: {r['reason']}" for r in report["rows"] if r["status"] != "ok"]
    notes += [f"- {r['name']}: {r['did_not_exit']}" for r in report["rows"] if r.get("did_not_exit")]
    notes += [f"- {r['name']}: loader workers {r['workers_note']}" for r in report["rows"] if r.get("workers_note")]
    lines += ["", "## Notes", ""] + notes + [
        "- img/s after warm-up steps: the scripts' own figure, without the first min(10, steps // 4) steps of "
        "each epoch; whole-epoch img/s counts every step over the measured epoch (evaluation is off the clock).",
        "- precision: fp32 rows " + ("run convolutions in TF32 on this GPU (cuDNN's default); the precision "
                                     "column says which run matmuls in TF32 too" if plan.get("tf32_convolutions")
                                     else "compute in float32 (no TF32 on this device)") + ".",
        "- peak MiB: the largest peak allocated of the timed epochs (windows); epoch 1's is in the list below.",
        "- one-process rows train one device's batch; % of peak (fp32 against the same bf16 peak), vs "
        f"{BASELINE}, the ratios and the chart are per device.",
        "- ceiling rows: the step alone on random tensors already on the device (no loader, no DDP, no "
        "communication), one device's figure times the devices.",
        f"- the benchmark took {report['header']['total_seconds']:.0f} s"
        + (f" of a {report['settings']['time_budget_s']:.0f} s budget" if report['settings']['time_budget_s']
           else "") + ".",
        "",
        "## What each row runs",
        "",
    ]
    for r in report["rows"]:
        how = f"{r['precision']}; " + (r["wrapper"] if r["kind"] == "script" else f"the step of {r['mirrors']}")
        lines.append(f"- {r['name']} ({how}): {r['about']}")
    lines += [
        "",
        "## Per-epoch images/s (epoch 1 is warm-up): after warm-up steps / whole epoch (seconds, peak MiB)",
        "",
    ]
    for r in report["rows"]:
        if r["status"] == "ok" and r["kind"] == "script":
            samples = ", ".join(f"{e['epoch']}: {fmt(e['images_per_second'], ',.0f')} / "
                                f"{fmt(e['whole_epoch_images_per_second'], ',.0f')} ({e['epoch_seconds']:.2f} s"
                                + (f", {e['peak_memory_mb']:,.0f} MiB)" if e.get("peak_memory_mb") is not None
                                   else ")") for e in r["epochs"])
            lines.append(f"- {r['name']}: {samples}")
        elif r["status"] == "ok":
            samples = ", ".join(fmt(x, ',.0f') for x in r["window_images_per_second_per_device"])
            lines.append(f"- {r['name']} (windows, per device): {samples}")
    lines += ["", "## Commands", ""]
    lines += [f"- {r['name']}: `{r['display_command']}`" for r in report["rows"] if r.get("display_command")]
    write_atomically(path, "\n".join(lines) + "\n")


def write_atomically(path: str, text: str):
    """A reader (or a kill) never meets half a report: write aside, then rename."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_chart(path: str, report: dict) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in report["rows"] if r["status"] == "ok"]
    if not rows:
        return False
    names = [r["name"] for r in rows][::-1]  # barh draws bottom-up: keep the table's order top-down
    rates = [per_device(r) for r in rows][::-1]
    # The timed epochs' (windows') min-max as a line across each bar; none where only one was timed.
    low = [(r["median_images_per_second"] - (r["min_images_per_second"] or r["median_images_per_second"]))
           / r["devices"] for r in rows][::-1]
    high = [((r["max_images_per_second"] or r["median_images_per_second"]) - r["median_images_per_second"])
            / r["devices"] for r in rows][::-1]
    colours = ["#9aa7b4" if r["kind"] == "ceiling" else "#2f6db5" for r in rows][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.8))
    ax.barh(names, rates, color=colours, xerr=[low, high], error_kw={"elinewidth": 1, "capsize": 2})
    for y, (rate, above) in enumerate(zip(rates, high)):
        ax.text(rate + above, y, f" {rate:,.0f}", va="center", fontsize=8)  # past the min-max line
    base = next((r for r in rows if r["name"] == BASELINE), None)
    if base:
        ax.axvline(per_device(base), color="#c0392b", linestyle="--", linewidth=1, label=f"{BASELINE} (baseline)")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("images per second per device after each epoch's warm-up steps: median and min-max over the "
                  "epochs after the first (ceilings: timed windows)", fontsize=8)
    ax.set_xlim(0, max(rate + above for rate, above in zip(rates, high)) * 1.18)
    s = report["settings"]
    ax.set_title(f"{s['model']}, {s['per_device_batch']} images per device, PyTorch {report['header']['torch']}\n"
                 f"{report['header']['hardware'][:100]}", fontsize=9)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return True


# --- main -----------------------------------------------------------------------------

def build_parser():
    full, quick = DEFAULTS["full"], DEFAULTS["quick"]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message} (see --help)\n")
    g = parser.add_argument_group("what to run")
    g.add_argument("--rows", default=None,
                   help=f"comma-separated rows, run in this order (default: {','.join(DEFAULT_NAMES)}; "
                        f"with --quick: {','.join(QUICK_ROWS)}); choose from {', '.join(ALL_NAMES)}")
    g.add_argument("--quick", action="store_true",
                   help=f"a quick check of the harness: {quick.model}, {quick.per_device_batch} images per process, "
                        f"{quick.epochs} epochs of {quick.steps} steps, a few rows")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cpu: CPU processes even where GPUs are visible (default auto: GPUs when there are any)")
    g.add_argument("--nproc", type=cli.positive_int, default=None,
                   help="processes of the multi-process rows (default: every visible GPU, or 2 on the CPU)")
    g = parser.add_argument_group("the training problem (the same in every row)")
    g.add_argument("--model", choices=MODEL_NAMES, default=None,
                   help=f"default {full.model} (--quick: {quick.model})")
    g.add_argument("--dataset", choices=["synthetic", "cifar100"], default="synthetic",
                   help="synthetic (default): the scripts' offline stand-in of CIFAR-100's shape")
    g.add_argument("--data-dir", default="./data", help="where CIFAR-100 is, with --dataset cifar100 (default ./data)")
    g.add_argument("--batch-size", type=cli.positive_int, default=None,
                   help=f"GLOBAL batch per optimizer step (default {full.per_device_batch} per device; "
                        f"--quick: {quick.per_device_batch} per process); rows with their own per-device "
                        "batch (fast-bf16-compile-1024) keep it")
    g.add_argument("--steps", type=cli.positive_int, default=None,
                   help=f"optimizer steps per epoch (default: as many whole global batches as {EPOCH_IMAGES:,} "
                        f"images hold; --quick: {quick.steps})")
    g.add_argument("--epochs", type=cli.positive_int, default=None,
                   help=f"epochs per row, the first one warm-up (default {full.epochs}; --quick: {quick.epochs})")
    g.add_argument("--workers", type=cli.non_negative_int, default=None,
                   help="loader workers per process (default on GPUs: CPU cores / the row's processes - 1, at most "
                        "16, and no more than the free space of /dev/shm holds; 0 on the CPU)")
    g = parser.add_argument_group("time")
    g.add_argument("--row-timeout", type=cli.positive_float, default=None, metavar="SECONDS",
                   help=f"end a row that runs longer (default {full.row_timeout:.0f}; --quick: {quick.row_timeout:.0f})")
    g.add_argument("--time-budget", type=cli.positive_float, default=None, metavar="SECONDS",
                   help="the whole benchmark ends within this many seconds of its start: a row still running "
                        f"when {REPORT_SECONDS:.0f} s are left (kept for ending it and writing the report) is cut "
                        f"short, and none is started with less than {full.min_row_seconds:.0f} s left (--quick: "
                        f"{quick.min_row_seconds:.0f} s; default: no limit)")
    g = parser.add_argument_group("ceiling and peak")
    g.add_argument("--ceiling-steps", type=cli.positive_int, default=None,
                   help=f"steps per timed window (default {full.ceiling_steps}; --quick: {quick.ceiling_steps})")
    g.add_argument("--ceiling-windows", type=cli.positive_int, default=None,
                   help=f"timed windows, the median is reported (default {full.ceiling_windows}; "
                        f"--quick: {quick.ceiling_windows})")
    g.add_argument("--peak-tflops", type=cli.positive_float, default=None,
                   help="the device's peak TFLOP/s for the %% of peak column (default: the vendor's dense "
                        "bf16 figure for known GPUs; none on the CPU)")
    g = parser.add_argument_group("output")
    g.add_argument("--out", default=os.path.join(ROOT, "results"),
                   help="where benchmark.md, .json and .png go (default: results/ in the repository)")
    g.add_argument("--log-dir", default=None,
                   help="where each row's output (ROW.log) and metrics (ROW.jsonl) are kept (default: OUT/logs)")
    # The ceiling's own process: python scripts/benchmark.py --measure-ceiling SPEC --out FILE
    parser.add_argument("--measure-ceiling", default=None, metavar="JSON", help=argparse.SUPPRESS)
    return parser


def describe_run(use_cuda: bool, gpus_used: int, gpus: int, argv) -> dict:
    """The report's header: when, on what, with which software, started how."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": describe_hardware(use_cuda, gpus_used),
        "gpu_name": torch.cuda.get_device_name(0) if use_cuda else None, "gpus": gpus,
        "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_used": use_cuda,
        "cudnn": torch.backends.cudnn.version() if use_cuda else None,
        "python": platform.python_version(),
        "command": shlex.join(["python", *(sys.argv if argv is None else [sys.argv[0], *argv])]),
    }


def output_folders(args) -> str:
    """Make --out and the folder of the launches' logs (--log-dir, default OUT/logs), this run's
    alone while it lives (lock_folder); returns the latter."""
    log_dir = os.path.abspath(args.log_dir or os.path.join(args.out, "logs"))
    try:
        os.makedirs(args.out, exist_ok=True)
        os.makedirs(log_dir, exist_ok=True)
    except OSError as exc:
        raise cli.UsageError(f"--out/--log-dir: cannot create {exc.filename} ({exc.strerror})") from None
    lock_folder(args.out, "--out")
    if args.log_dir and os.path.realpath(log_dir) != os.path.realpath(args.out):  # flock: one lock per folder
        lock_folder(log_dir, "--log-dir")
    return log_dir


_locks = []  # the locked folders' descriptors: a lock lasts as long as its descriptor is open


def lock_folder(folder: str, flag: str):
    """Refuse a second run on a folder in use (UsageError): two runs would delete and append each
    other's logs/ROW.jsonl and report each other's figures. flock() on the folder itself, which the
    kernel releases however the process ends, and which adds no file to it (the GPU check brings
    --out back, at most 8 files); close-on-exec, so the rows' processes do not hold it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        st, holder = os.stat(folder), "pid unknown"
        with contextlib.suppress(OSError), open("/proc/locks") as f:  # "1: FLOCK ADVISORY WRITE PID MA:MI:INODE ..."
            key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
            holder = next((f"pid {line.split()[4]}" for line in f if line.split()[5:6] == [key]), holder)
        raise cli.UsageError(f"{flag} {folder} is in use by another run ({holder}): wait until it ends, "
                             f"or give another {flag}") from None
    except OSError:
        pass  # a file system without locks (NFS without its lock daemon): run unguarded
    _locks.append(fd)


def finish(cut_short: bool, stopped: str, whole: str, failure: str):
    """The end of a run, on stderr: after a stop signal, its name and `stopped` (it cut the run
    short) or `whole` (it came after the last launch), and exit status 128 + its number; else
    `failure`, if any, and exit status 1."""
    if _stopping:
        name = signal.Signals(_stopping[0]).name
        print(f"\n{name}: {stopped}" if cut_short else f"{name} {whole}", file=sys.stderr, flush=True)
        sys.exit(128 + _stopping[0])
    if failure:
        print(failure, file=sys.stderr)
        sys.exit(1)


class Report:
    """The benchmark's results so far, written out (md, json, png) after every row."""

    def __init__(self, out: str, plan: Plan, header: dict, flops: dict, peak: tuple):
        self.plan, self.header, self.flops, self.peak = plan, header, flops, peak
        self.results = {}
        self.started = time.perf_counter()
        self.paths = {ext: os.path.join(out, f"benchmark.{ext}") for ext in ("md", "json", "png")}

    def build(self, state: str) -> dict:
        plan = self.plan
        order = {n: i for i, n in enumerate(ALL_NAMES)}
        rows = sorted(self.results.values(), key=lambda r: order[r["name"]])  # the table's order
        add_derived(rows, self.flops, self.peak[0])
        self.header["total_seconds"] = time.perf_counter() - self.started
        return {
            "state": state,
            "header": self.header,
            "settings": {"model": plan.model, "dataset": plan.dataset, "synthetic_files": bool(plan.synthetic_files),
                         "global_batch": plan.global_batch,
                         "per_device_batch": plan.per_device_batch, "processes": plan.procs,
                         "steps": plan.steps or "one CIFAR-sized epoch per row", "epochs": plan.epochs,
                         "warmup_epochs": WARMUP_EPOCHS, "workers": plan.workers,  # None: each row's own
                         "device": "cuda" if plan.use_cuda else "cpu", "row_timeout_s": plan.timeout,
                         "tf32_convolutions": plan.tf32,
                         "time_budget_s": plan.time_budget, "ceiling_warmup": plan.ceiling_warmup,
                         "ceiling_steps": plan.ceiling_steps, "ceiling_windows": plan.ceiling_windows,
                         "epoch_images": EPOCH_IMAGES, "rows_requested": plan.names, "log_dir": plan.log_dir,
                         "baseline": BASELINE},
            "flops": self.flops,
            "peak": {"tflops": self.peak[0], "source": self.peak[1]},
            "rows": rows,
            "comparisons": comparisons(rows),
        }

    def write(self, state: str) -> dict:
        report = self.build(state)
        report["chart"] = self.paths["png"] if write_chart(self.paths["png"], report) else None
        if report["chart"] is None:  # an earlier run's chart would pass for this one's
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.paths["png"])
        write_markdown(self.paths["md"], report)
        write_atomically(self.paths["json"], json.dumps(report, indent=1, default=str) + "\n")
        return report


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.measure_ceiling:
        result = measure_ceiling(json.loads(args.measure_ceiling))
        write_atomically(args.out, json.dumps(result))
        return
    plan = resolve_plan(args)
    if plan.dataset == "cifar100" and any(row.name in plan.names for row in ROWS):
        # Once, here: not in every row, each failing alone, nor in the first row's time.
        data._load_cifar100(args)
    plan.log_dir = output_folders(args)
    header = describe_run(plan.use_cuda, plan.procs, plan.gpus, argv)
    if args.peak_tflops:
        peak = args.peak_tflops, "--peak-tflops"
    elif plan.use_cuda:
        peak = default_peak(header["gpu_name"])
    else:
        peak = None, "CPU: no peak figure; --peak-tflops gives one"
    deadline = STARTED + plan.time_budget if plan.time_budget else None
    report = Report(args.out, plan, header, count_flops(plan.model), peak)
    print(f"{header['hardware']}; PyTorch {header['torch']}")
    if not plan.use_cuda and not args.quick:
        print("note: without GPUs, --quick is the practical mode (the full rows train ResNet-18 on the CPU)")
    print(f"{plan.model}: {report.flops['train_step_per_image'] / 1e9:.4g} GFLOP per image per training step",
          flush=True)

    by_name = {r.name: r for r in [*ROWS, *CEILINGS]}
    current = stopped = None
    install_stop_handlers()  # from here on a stop signal ends the running row and keeps the rest
    try:
        started = time.monotonic()
        write_synthetic_files(plan)
        if plan.synthetic_files:
            print(f"the synthetic set written as CIFAR-100 files in {time.monotonic() - started:.1f} s: "
                  f"{plan.synthetic_files}", flush=True)
        for i, name in enumerate(plan.names, 1):
            row, current = by_name[name], name
            budget = None if deadline is None else deadline - time.monotonic() - REPORT_SECONDS
            if budget is not None and budget < plan.min_row_seconds and not skip_reason(row, plan):
                report.results[name] = dict(base_result(row, plan), status="not run",
                                            reason=f"--time-budget {plan.time_budget:.0f} s used up")
                continue
            print(f"[{i}/{len(plan.names)}] {name}: {short_command(row, plan)}", flush=True)
            run = run_ceiling if isinstance(row, Ceiling) else run_row
            r = report.results[name] = run(row, plan, plan.log_dir, budget)
            current = None
            detail = r["reason"]
            if r["status"] == "ok":
                detail = f"{median_text(r)} img/s ({spread_text(r)})"
                if r["median_whole_epoch_images_per_second"] is not None:
                    detail += f", whole epoch {median_text(r, 'whole_epoch_')}"
            if r.get("did_not_exit"):
                detail += f"; {r['did_not_exit']}"
            print(f"    {r['status']}: {detail}" + (f" ({r['wall_seconds']:.0f} s)" if "wall_seconds" in r else ""),
                  flush=True)
            report.write("partial: rows still to run")
        install_stop_handlers(_record_stop_signal)  # every row has run
    except Interrupted as stop:
        stopped = signal.Signals(stop.signum).name
        if current is not None:
            report.results[current] = dict(base_result(by_name[current], plan), status="interrupted",
                                           reason=f"{stopped} during the row; its processes were ended")
        for rest in plan.names:
            report.results.setdefault(rest, dict(base_result(by_name[rest], plan), status="not run",
                                                 reason=f"{stopped} ended the benchmark first"))
    finally:
        if plan.synthetic_files:
            shutil.rmtree(plan.synthetic_files, ignore_errors=True)

    final = report.write(f"interrupted by {stopped}" if stopped else "complete")
    if not stopped:
        print("\n" + "\n".join(summary_lines(final)))
        print(f"\nwrote {report.paths['md']}, {report.paths['json']}"
              + (f", {report.paths['png']}" if final["chart"] else "") + f"; row logs in {plan.log_dir}")
    failures = [f"{what}: {', '.join(names)}" for what, names in (
        ("failed rows", [r["name"] for r in final["rows"] if r["status"] == "failed"]),
        ("rows whose processes did not exit after their work (see their logs)",
         [r["name"] for r in final["rows"] if r.get("did_not_exit")])) if names]
    finish(stopped, f"the benchmark stopped; finished rows are in {report.paths['md']}",
           "came after the last row; the report is whole", "\n".join(failures))


if __name__ == "__main__":
    lifecycle.run_main(main)
