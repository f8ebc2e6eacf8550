r"""Draw the figures of tutorials/ into tutorials/figures/ (SVG).

    # every figure; the two timelines are traced again with torch.profiler
    # (2 gloo processes on the CPU, about a minute on a 2-core machine)
    python scripts/make_figures.py

    # redraw everything from the saved traces in tutorials/figures/*.events.json (seconds)
    python scripts/make_figures.py --no-trace

    # one figure (a traced one without --no-trace: both timelines, traced together, are redrawn)
    python scripts/make_figures.py --only ring_allreduce

Figures and where their content comes from:

    dp_vs_ddp         what moves where in one step of DataParallel and of DDP (a diagram)
    ring_allreduce    every step of a ring all-reduce over 3 ranks, stepped by ring_step,
                      the index arithmetic of ring_all_reduce in scripts/collectives.py
    ddp_timeline      a real torch.profiler trace: backward of a CIFAR ResNet-18 under DDP
                      on 2 gloo CPU processes, with each bucket's all-reduce
    no_sync           a real trace: 4 micro-batches of gradient accumulation, with and
                      without no_sync(), on 2 gloo CPU processes
    stop_resume       the stop-on-signal protocol of utils/run.py and the resume
                      after it (a diagram; the check interval is read from the code)
    sharding          what each of 4 ranks holds under DDP and ZeRO-1/2/3, and the order of
                      all-gathers, compute and reduce-scatters in one step of distributed_fsdp.py
                      (a diagram; ResNet-18's per-unit parameter counts from models.build_model,
                      the units from the script's own fully_shard loop)

The traced figures keep their events in <name>.events.json beside the SVG (a few
kilobytes: the spans that are drawn, the machine and the PyTorch version), so a
redraw needs no new trace and the numbers in the picture can be checked.
"""
import argparse
import contextlib
import inspect
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FIGURES = ROOT / "tutorials" / "figures"
ALL = ["dp_vs_ddp", "ring_allreduce", "ddp_timeline", "no_sync", "stop_resume", "sharding"]
TRACED = {"ddp_timeline", "no_sync"}

COMPUTE, BACKWARD, COMM, IDLE, ACCENT = "#9ecae1", "#3182bd", "#fd8d3c", "#eeeeee", "#31a354"


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # Text stays text (small files that diff well); a fixed hash salt and no date make
    # the output the same on every run, so a redraw only changes what really changed.
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "tutorials", "font.size": 9,
                         "font.family": "DejaVu Sans"})
    return plt


def _save(fig, name: str, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.svg"
    fig.savefig(path, bbox_inches="tight", dpi=110, metadata={"Date": None})
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def _box(ax, x, y, w, h, text, fill, fontsize=8, **kw):
    from matplotlib.patches import FancyBboxPatch
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.01,rounding_size=0.02",
                                facecolor=fill, edgecolor="#555555", linewidth=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, **kw)


def _arrow(ax, x0, y0, x1, y1, color="#444444", style="-|>", lw=1.0):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                arrowprops=dict(arrowstyle=style, color=color, lw=lw, shrinkA=2, shrinkB=2))


# --- DataParallel vs DDP ---------------------------------------------------------------

def draw_dp_vs_ddp(out: Path):
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 4.8), gridspec_kw={"wspace": 0.05})
    for ax in (left, right):
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.axis("off")

    left.set_title("nn.DataParallel: one process, one thread per GPU", fontsize=10)
    left.add_patch(plt.Rectangle((0.01, 0.02), 0.98, 0.88, fill=False, linestyle="--", edgecolor="#888888"))
    left.text(0.03, 0.86, "one Python process, one GIL", fontsize=7, color="#666666")
    _box(left, 0.04, 0.66, 0.22, 0.13, "loader:\nthe whole batch", IDLE, fontsize=7)
    for x, label in ((0.30, "GPU 0\nmodule, optimizer"), (0.54, "GPU 1\nreplica"), (0.76, "GPU 2\nreplica")):
        _box(left, x, 0.38, 0.2, 0.14, label, BACKWARD if x < 0.4 else COMPUTE, fontsize=7,
             color="white" if x < 0.4 else "black")
    _arrow(left, 0.2, 0.66, 0.38, 0.53)
    left.text(0.31, 0.62, "1  scatter the batch (every forward)", fontsize=7)
    _arrow(left, 0.50, 0.47, 0.54, 0.47, color=ACCENT)
    left.annotate("", xy=(0.84, 0.52), xytext=(0.44, 0.52),
                  arrowprops=dict(arrowstyle="-|>", color=ACCENT, lw=1.0, connectionstyle="arc3,rad=-0.35"))
    left.text(0.56, 0.72, "2  replicate the weights\n    to every GPU (every forward)", fontsize=7, color=ACCENT)
    left.text(0.30, 0.31, "3  forward, one thread per GPU", fontsize=7)
    _arrow(left, 0.64, 0.38, 0.50, 0.19, color=COMM)
    _arrow(left, 0.86, 0.38, 0.52, 0.17, color=COMM)
    _box(left, 0.08, 0.05, 0.42, 0.13, "GPU 0: gathered outputs, loss;\nevery gradient summed here; step", IDLE,
         fontsize=7)
    left.text(0.62, 0.10, "4  gather the outputs; backward\n    sums the gradients onto GPU 0", fontsize=7,
              color=COMM)

    right.set_title("DistributedDataParallel: one process per GPU", fontsize=10)
    xs = [0.03, 0.36, 0.69]
    for rank, x in enumerate(xs):
        right.add_patch(plt.Rectangle((x - 0.015, 0.16), 0.3, 0.74, fill=False, linestyle="--",
                                      edgecolor="#888888"))
        right.text(x, 0.86, f"process, rank {rank}", fontsize=7, color="#666666")
        _box(right, x + 0.01, 0.67, 0.25, 0.12, f"loader: shard {rank}\nof every batch", IDLE, fontsize=7)
        _box(right, x + 0.01, 0.42, 0.25, 0.14, f"GPU {rank}\nforward, backward", COMPUTE, fontsize=7)
        _box(right, x + 0.01, 0.20, 0.25, 0.12, "optimizer.step()\nthe same on every rank", IDLE, fontsize=7)
        _arrow(right, x + 0.135, 0.67, x + 0.135, 0.56)
        _arrow(right, x + 0.135, 0.42, x + 0.135, 0.32)
    for a, b in ((0, 1), (1, 2)):
        _arrow(right, xs[a] + 0.26, 0.49, xs[b] + 0.01, 0.49, color=COMM, style="<|-|>", lw=1.6)
    right.text(0.5, 0.03, "all-reduce of the gradients, bucket by bucket, while backward still runs;\n"
               "the weights never move: DDP's constructor broadcast rank 0's once", fontsize=7, color=COMM,
               ha="center")
    return _save(fig, "dp_vs_ddp", out)


# --- ring all-reduce -----------------------------------------------------------------------

def ring_states(n: int = 3):
    """Every rank's chunks (as sets of contributors) after each step of the ring, with the chunk
    each rank sent: stepped by ring_step, the index arithmetic ring_all_reduce runs in
    scripts/collectives.py, so the figure cannot drift from the code."""
    from collectives import ring_step  # beside this file; imports torch, so only when drawn
    chunks = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    states = [("start", [row[:] for row in chunks], None)]
    for phase in ("scatter-reduce", "all-gather"):
        for step in range(n - 1):
            moves = [ring_step(rank, n, phase, step) for rank in range(n)]  # (sent, received) chunk indices
            sent = [chunks[rank][index] for rank, (index, _) in enumerate(moves)]
            for rank, (_, index) in enumerate(moves):
                data = sent[(rank - 1) % n]  # what the left neighbour sent
                chunks[rank][index] = chunks[rank][index] | data if phase == "scatter-reduce" else data
            states.append((f"{phase} step {step + 1}", [row[:] for row in chunks], [m[0] for m in moves]))
    return states


def draw_ring_allreduce(out: Path, n: int = 3):
    plt = _pyplot()
    states = ring_states(n)
    letters = "abcdefgh"
    fig, axes = plt.subplots(1, len(states), figsize=(2.3 * len(states), 2.9))
    for ax, (title, chunks, sent) in zip(axes, states):
        ax.set_xlim(-1.0, n)
        ax.set_ylim(-0.9, n + 0.1)
        ax.invert_yaxis()
        ax.axis("off")
        ax.set_title(title, fontsize=8)
        for rank in range(n):
            ax.text(-0.95, rank + 0.5, f"rank {rank}", fontsize=7, va="center")
            for index in range(n):
                who = chunks[rank][index]
                full = len(who) == n
                color = ACCENT if full else (COMM if len(who) > 1 else IDLE)
                ax.add_patch(plt.Rectangle((index + 0.05, rank + 0.08), 0.9, 0.84, facecolor=color,
                                           edgecolor="white" if sent is None or sent[rank] != index else "black",
                                           linewidth=1.6))
                label = f"S{index}" if full else "+".join(f"{letters[r]}{index}" for r in sorted(who))
                ax.text(index + 0.5, rank + 0.5, label, ha="center", va="center", fontsize=7,
                        color="white" if full else "black")
        for index in range(n):
            ax.text(index + 0.5, -0.15, f"chunk {index}", ha="center", fontsize=6, color="#666666")
    fig.text(0.5, -0.04, f"{n} ranks, each tensor cut into {n} chunks. Black frame: the chunk each rank sends "
             "to its right neighbour at that step. Orange: a partial sum; green S_i: the full sum of chunk i. "
             f"{2 * (n - 1)} steps; every rank sends 2(N-1)/N of the tensor.", ha="center", fontsize=7, wrap=True)
    return _save(fig, "ring_allreduce", out)


# --- stop on a signal, checkpoint, resume ----------------------------------------------------

def draw_stop_resume(out: Path):
    from utils.run import StopSignal
    check_every = inspect.signature(StopSignal).parameters["check_every"].default
    signal_step, stop_step, last_step = 3, check_every, 16  # the run of lesson 06
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 4.2))
    lanes = {"torchrun agent": 3.0, "rank 0": 2.0, "rank 1": 1.0, "checkpoint dir\n(shared disk)": 0.0}
    gap = stop_step + 4.0  # where the resumed run starts on the x axis
    for name, y in lanes.items():
        ax.text(-0.4, y, name, ha="right", va="center", fontsize=8)
        ax.plot([0, stop_step + 0.4], [y, y], color="#dddddd", lw=0.8, zorder=0)
        ax.plot([gap - 0.4, gap + last_step - stop_step], [y, y], color="#dddddd", lw=0.8, zorder=0)

    def steps(first, last, x0, after_signal=None):
        for step in range(first, last + 1):
            x = x0 + step - first
            late = after_signal is not None and step > after_signal
            for y in (2.0, 1.0):
                ax.add_patch(plt.Rectangle((x, y - 0.18), 0.9, 0.36, edgecolor="none",
                                           facecolor="#c6dbef" if late else COMPUTE))
            ax.text(x + 0.45, 2.26, str(step), fontsize=6, ha="center", color="#666666")

    steps(1, stop_step, 0, after_signal=signal_step)
    steps(stop_step + 1, last_step, gap)
    # The signal reaches the agent, which forwards it; the handlers only set a flag.
    ax.annotate("SIGTERM (scheduler, scancel, Ctrl-C)", xy=(signal_step, 3.0), xytext=(signal_step - 2.5, 3.55),
                fontsize=7, color="#c00000", arrowprops=dict(arrowstyle="-|>", color="#c00000"))
    for y in (2.0, 1.0):
        _arrow(ax, signal_step, 2.95, signal_step, y + 0.2, color="#c00000")
    ax.text(signal_step + 0.1, 2.6, "forwarded to every worker: the handler sets a flag, training goes on",
            fontsize=6.5, color="#c00000")
    # The agreement: every check_every steps, through the job's store (utils/distributed.py, any_rank).
    x = stop_step + 0.05
    ax.annotate("", xy=(x, 1.2), xytext=(x, 1.8), arrowprops=dict(arrowstyle="<|-|>", color=COMM, lw=1.5))
    ax.text(x + 0.15, 1.5, f"step {stop_step}: has any rank a flag? (the job's store)\nevery rank agrees to stop",
            fontsize=6.5, color=COMM, va="center")
    ax.text(stop_step / 2, 1.5, f"flags compared every {check_every} steps", fontsize=6.5, color=COMM,
            ha="center", va="center")
    _arrow(ax, stop_step - 0.4, 1.82, stop_step - 0.4, 0.12, color=ACCENT)
    ax.text(stop_step - 0.55, 0.35, "rank 0 saves: temporary file,\nfsync, os.replace", fontsize=6.5,
            color=ACCENT, ha="right")
    ax.text(stop_step + 0.15, 2.45, "all exit 0", fontsize=6.5)
    ax.text(stop_step + 0.15, 3.1, "the agent exits", fontsize=6.5)
    # Later, the same command with --resume.
    ax.text(gap - 0.2, 3.1, "later: the same command with --resume", fontsize=7)
    for y in (2.0, 1.0):
        _arrow(ax, gap - 1.2, 0.12, gap - 0.1, y - 0.2, color=ACCENT)
    ax.text(gap + 0.2, 0.3, "every rank loads the checkpoint (map_location='cpu', weights_only=True): weights, "
            f"optimizer,\nscheduler, RNG, epoch and step {stop_step}; the run continues with step {stop_step + 1}",
            fontsize=6.5, color=ACCENT)
    ax.set_xlim(-0.5, gap + last_step - stop_step + 0.2)
    ax.set_ylim(-0.3, 3.8)
    ax.axis("off")
    ax.set_title("Stop on a signal, checkpoint, resume (utils/run.py)", fontsize=10)
    return _save(fig, "stop_resume", out)


# --- sharding: what each rank holds, and the order of one FSDP2 step -----------------------------

def fsdp_units(model_name: str = "resnet18", num_classes: int = 100):
    """[(unit, parameters)] as distributed_fsdp.py shards the model: the root first (the last
    fully_shard call, which takes what is left: stem and classifier; its gather starts forward),
    then one unit per module of the script's `for stage in (...)` loop, in forward order. The
    loop is read from the script itself."""
    import re
    from models import build_model
    source = (ROOT / "distributed_fsdp.py").read_text()
    loop = re.search(r"for stage in \(([^)]*)\):\s*\n\s*fully_shard\(stage", source)
    if loop is None:
        raise SystemExit("make_figures.py: distributed_fsdp.py no longer shards `for stage in (...)`: "
                         "update fsdp_units()")
    model = build_model(model_name, num_classes)
    units = []
    for expr in (e.strip() for e in loop.group(1).split(",") if e.strip()):
        name = expr.removeprefix("model.")
        units.append((name, sum(p.numel() for p in model.get_submodule(name).parameters())))
    total = sum(p.numel() for p in model.parameters())
    return [("root", total - sum(n for _, n in units)), *units]


def draw_sharding(out: Path, world_size: int = 4):
    plt = _pyplot()
    from matplotlib.patches import Patch
    units = fsdp_units()
    total = sum(n for _, n in units)
    mb = 4 * total / 1e6  # fp32: 4 bytes per parameter, gradient and momentum value
    fig = plt.figure(figsize=(11, 9.2))
    top = fig.add_axes([0.0, 0.47, 1.0, 0.5])
    bottom = fig.add_axes([0.0, 0.0, 1.0, 0.42])
    held_color = {"parameters": COMPUTE, "gradients": COMM, "optimizer state": ACCENT}

    # (a) four strategies x world_size ranks; each rank: three columns (parameters, gradients,
    # momentum) cut in world_size shards, filled where the rank keeps that shard.
    top.set_xlim(0, 4)
    top.set_ylim(-0.46, 1.12)
    top.axis("off")
    top.set_title(f"(a) What each of {world_size} ranks keeps: ResNet-18 ({total:,} fp32 parameters), "
                  "SGD with momentum", fontsize=10, loc="left")
    strategies = [  # name, what is sharded, what FSDP2 setting gives it
        ("DDP", set(), "everything on every rank"),
        ("ZeRO-1", {"optimizer state"}, "optimizer state sharded"),
        ("ZeRO-2", {"optimizer state", "gradients"},
         "+ gradients sharded. FSDP2 with\nreshard_after_forward=False is this\nfrom forward to backward only"),
        ("ZeRO-3", {"optimizer state", "gradients", "parameters"},
         "+ parameters sharded. FSDP2 with\nreshard_after_forward=True\n(distributed_fsdp.py's default)"),
    ]
    kinds = list(held_color)
    col_w, gap = 0.055, 0.012
    for s, (name, sharded, note) in enumerate(strategies):
        x0 = s + 0.04
        per_rank = sum(mb / world_size if kind in sharded else mb for kind in kinds)
        top.text(x0 + 0.44, 1.06, name, fontsize=10, ha="center", weight="bold")
        top.text(x0 + 0.44, 0.96, f"{per_rank:.1f} MB per rank", fontsize=8.5, ha="center")
        for rank in range(world_size):
            rx = x0 + rank * (3 * col_w + 2 * gap + 0.035)
            top.text(rx + 1.5 * col_w + gap, 0.02, f"rank {rank}", fontsize=7.5, ha="center", color="#666666")
            for k, kind in enumerate(kinds):
                cx = rx + k * (col_w + gap)
                for shard in range(world_size):  # shard 0 at the top
                    y = 0.9 - (shard + 1) * 0.8 / world_size
                    held = kind not in sharded or shard == rank
                    top.add_patch(plt.Rectangle((cx, y + 0.004), col_w, 0.8 / world_size - 0.008,
                                                facecolor=held_color[kind] if held else "white",
                                                edgecolor="#999999", linewidth=0.5))
        top.text(x0 + 0.44, -0.06, note, fontsize=8, ha="center", va="top")
    top.legend(handles=[Patch(facecolor=c, edgecolor="#999999", label=f"{k} ({mb:.1f} MB whole)")
                        for k, c in held_color.items()] +
               [Patch(facecolor="white", edgecolor="#999999", label="a shard another rank keeps")],
               loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=4, fontsize=8, frameon=False)

    # (b) the order of one ZeRO-3 step on one rank, in slots (not to scale): compute on one row,
    # all-gathers and reduce-scatters on their own (on a GPU: their own CUDA streams).
    stages = [name for name, _ in units[1:]]
    sizes = {name: f"{4 * n / 1e6:.1f} MB" for name, n in units}
    rows = {"compute": 2.0, "all-gather": 1.0, "reduce-scatter": 0.0}
    bottom.set_title("(b) One step of distributed_fsdp.py on one rank (ZeRO-3: each stage resharded after "
                     "forward, the root kept whole): the order, not the durations", fontsize=10, loc="left")
    for label, y in rows.items():
        bottom.text(-0.2, y + 0.35, label, ha="right", va="center", fontsize=8.5)

    def box(x, row, text, fill):
        bottom.add_patch(plt.Rectangle((x + 0.04, rows[row] + 0.05), 0.92, 0.6, facecolor=fill,
                                       edgecolor="#555555", linewidth=0.6))
        bottom.text(x + 0.5, rows[row] + 0.35, text, ha="center", va="center", fontsize=7.5)

    # Forward: gather a unit, then compute it while the next unit's gather runs; free it after.
    box(0, "all-gather", f"root\n{sizes['root']}", COMPUTE)
    box(1, "compute", "stem\n(root)", IDLE)
    for i, stage in enumerate(stages):
        box(1 + i, "all-gather", f"{stage}\n{sizes[stage]}", COMPUTE)
        box(2 + i, "compute", f"{stage},\nthen free", IDLE)
    forward_end = 3 + len(stages)
    box(forward_end - 1, "compute", "pool, fc;\nroot kept", IDLE)
    bottom.plot([forward_end, forward_end], [-0.05, 2.75], color="#888888", lw=0.8, ls="--")
    bottom.text(forward_end / 2, 2.85, "forward", ha="center", fontsize=9)
    # Backward: the root is still whole (distributed_fsdp.py leaves its reshard_after_forward to
    # PyTorch, which keeps the root gathered for backward), so backward starts computing at once
    # while each stage is gathered one ahead (the default prefetch, in reverse forward order); a
    # stage's gradients are reduce-scattered once its backward is done.
    b0 = forward_end + 0.1
    box(b0, "compute", "fc\nbackward", "#c6dbef")
    for i, stage in enumerate(reversed(stages)):
        box(b0 + i, "all-gather", f"{stage}\nprefetch", COMPUTE)
        box(b0 + 1 + i, "compute", f"{stage}\nbackward", "#c6dbef")
        box(b0 + 2 + i, "reduce-scatter", f"{stage}\ngradients", COMM)
    stem_x = b0 + 1 + len(stages)
    box(stem_x, "compute", "stem\nbackward", "#c6dbef")
    box(stem_x + 1, "reduce-scatter", "root\ngradients", COMM)
    box(stem_x + 2, "compute", "optimizer\nstep", ACCENT)
    end = stem_x + 3
    bottom.text((forward_end + end) / 2, 2.85, "backward, then the optimizer step", ha="center", fontsize=9)
    bottom.text(-1.3, -0.3, "Boxes one above the other run at the same time: the next unit's all-gather overlaps "
                "this unit's compute, in forward because the CPU issues it while\nthe GPU still computes, in "
                "backward by the default prefetch. A stage is freed after its backward; the root, whole since its "
                "forward, only at the end (the stem's\ngradient comes last). With --no-reshard-after-forward every "
                "stage stays whole from its forward to its backward too: no all-gathers in backward.",
                fontsize=8, va="top")
    bottom.set_xlim(-1.3, end + 0.1)
    bottom.set_ylim(-0.95, 3.05)
    bottom.axis("off")
    return _save(fig, "sharding", out)


# --- traces ------------------------------------------------------------------------------------

def hardware() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        name = names[0] if names else name
    except OSError:
        pass
    # The affinity mask (taskset, Slurm), where there is one (not on macOS).
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} CPU cores visible"


def spans_from_chrome_trace(path: str, backward_ops: bool = True):
    """The events a figure draws, from one rank's chrome trace: our record_function
    phases, the all-reduce launches on the training thread (c10d::allreduce_) and the
    gloo all-reduces on gloo's own threads. Times in ms, to the microsecond (small files)."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    main_tid = next(e["tid"] for e in events if e["name"].startswith("phase:"))  # the training thread
    keep = []
    for e in events:
        name, start, end = e["name"], round(e["ts"] / 1e3, 3), round((e["ts"] + e["dur"]) / 1e3, 3)
        if e["tid"] == main_tid and (name.startswith("phase:") or name == "c10d::allreduce_"):
            keep.append([name, start, end, "main"])
        elif name == "gloo:all_reduce":
            keep.append([name, start, end, "comm"])
        elif backward_ops and e["tid"] == main_tid and name.startswith("autograd::engine::evaluate_function"):
            keep.append(["backward op", start, end, "main"])
    return keep


def _trace_worker(rank, init_file, trace_dir, world_size):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile, record_function

    from models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    buckets = []

    def log_bucket(state, bucket):  # the default all-reduce, noting each bucket's size
        buckets.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return default_hooks.allreduce_hook(None, bucket)

    # ddp_timeline: ResNet-18 with 5 MiB buckets, so that several buckets show.
    torch.manual_seed(0)
    model = build_model("resnet18", 100)
    ddp_model = DDP(model, bucket_cap_mb=5)
    ddp_model.register_comm_hook(None, log_bucket)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    images, targets = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 100, (16,), generator=g)

    def step():
        with record_function("phase:forward"):
            loss = F.cross_entropy(ddp_model(images), targets)
        with record_function("phase:backward"):
            loss.backward()
        with record_function("phase:optimizer step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # the buckets are rebuilt after the first step; warm up past it
        step()
    buckets.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    prof.export_chrome_trace(f"{trace_dir}/ddp_timeline.rank{rank}.json")
    with open(f"{trace_dir}/ddp_timeline.rank{rank}.buckets.json", "w") as f:
        json.dump(buckets, f)

    # no_sync: 4 micro-batches of 8 on the tiny ResNet, all-reduced every time or once.
    torch.manual_seed(0)
    model = build_model("resnet_tiny", 100)
    ddp_model = DDP(model)
    micro_images = torch.randn(4, 8, 3, 32, 32, generator=g)
    micro_targets = torch.randint(0, 100, (4, 8), generator=g)

    def accumulate(use_no_sync):
        for i in range(4):
            last = i == 3
            with ddp_model.no_sync() if use_no_sync and not last else contextlib.nullcontext():
                with record_function(f"phase:forward {i + 1}"):
                    loss = F.cross_entropy(ddp_model(micro_images[i]), micro_targets[i]) / 4
                with record_function(f"phase:backward {i + 1}"):
                    loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):
        accumulate(False)
    for variant in ("without", "with"):
        dist.barrier()  # both ranks start the traced step together
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            accumulate(variant == "with")
        prof.export_chrome_trace(f"{trace_dir}/no_sync_{variant}.rank{rank}.json")
    dist.destroy_process_group()


def trace(out: Path, world_size: int = 2):
    """Run the traced programs on `world_size` gloo processes; save the events to draw."""
    import torch
    import torch.multiprocessing as mp
    meta = {"torch": torch.__version__, "hardware": hardware(), "backend": "gloo", "world_size": world_size,
            "threads_per_process": 1, "command": "python scripts/make_figures.py"}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_trace_worker, args=(f"{tmp}/rendezvous", tmp, world_size), nprocs=world_size)
        ranks = []
        for rank in range(world_size):
            with open(f"{tmp}/ddp_timeline.rank{rank}.buckets.json") as f:
                bucket_bytes = json.load(f)
            ranks.append({"spans": spans_from_chrome_trace(f"{tmp}/ddp_timeline.rank{rank}.json"),
                          "bucket_bytes": bucket_bytes})
        _write_events(out, "ddp_timeline", dict(meta, model="resnet18 (CIFAR)", batch_per_rank=16,
                                                bucket_cap_mb=5), ranks)
        variants = {v: [{"spans": spans_from_chrome_trace(f"{tmp}/no_sync_{v}.rank{r}.json", backward_ops=False)}
                        for r in range(world_size)] for v in ("without", "with")}
        _write_events(out, "no_sync", dict(meta, model="resnet_tiny", micro_batch=8, accum_steps=4), variants)


def _write_events(out: Path, name: str, meta: dict, data):
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.events.json", "w") as f:
        json.dump({"meta": meta, "data": data}, f, separators=(",", ":"))
        f.write("\n")


def _read_events(out: Path, name: str):
    """The out folder's events; the saved ones where it has none (a redraw elsewhere)."""
    path = out / f"{name}.events.json"
    with open(path if path.is_file() else FIGURES / path.name) as f:
        return json.load(f)


def _draw_rank_rows(ax, spans, origin, y, label, phase_colors):
    """One rank: its training thread (phases, backward ops, launches) and gloo's threads."""
    ax.set_yticks([])  # the rows are named in the plot
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.text(-0.01, y + 0.55, label, transform=ax.get_yaxis_transform(), ha="right", va="center", fontsize=8)
    for name, start, end, row in spans:
        start, end = start - origin, end - origin
        if row == "main" and name.startswith("phase:"):
            kind = name[len("phase:"):].split(" ")[0]
            ax.broken_barh([(start, end - start)], (y + 0.62, 0.3), facecolors=phase_colors.get(kind, IDLE),
                           edgecolor="white", linewidth=0.5)
        elif name == "backward op":
            ax.broken_barh([(start, end - start)], (y + 0.55, 0.05), facecolors=BACKWARD)
        elif name == "c10d::allreduce_":
            ax.plot([start, start], [y + 0.25, y + 0.95], color=COMM, lw=0.9)
        elif name == "gloo:all_reduce":
            ax.broken_barh([(start, end - start)], (y + 0.08, 0.3), facecolors=COMM, edgecolor="white",
                           linewidth=0.5)


def draw_ddp_timeline(out: Path):
    plt = _pyplot()
    from matplotlib.patches import Patch
    events = _read_events(out, "ddp_timeline")
    meta, ranks = events["meta"], events["data"]
    origin = min(s[1] for r in ranks for s in r["spans"] if s[0] == "phase:forward")
    fig, ax = plt.subplots(figsize=(11, 2.2 + 0.9 * len(ranks)))
    colors = {"forward": COMPUTE, "backward": "#c6dbef", "optimizer": ACCENT}
    for rank, data in enumerate(ranks):
        y = (len(ranks) - 1 - rank) * 1.2
        _draw_rank_rows(ax, data["spans"], origin, y, f"rank {rank}", colors)
        launches = sorted(s[1] - origin for s in data["spans"] if s[0] == "c10d::allreduce_")
        for i, x in enumerate(launches):
            mib = data["bucket_bytes"][i] / 2**20 if i < len(data["bucket_bytes"]) else float("nan")
            ax.text(x, y + 0.97, f"b{i}\n{mib:.1f}", fontsize=5.5, ha="center", va="bottom", color=COMM)
    ax.set_xlabel("time since the first rank started forward (ms)")
    ax.legend(handles=[Patch(color=COMPUTE, label="forward"), Patch(color="#c6dbef", label="backward"),
                       Patch(color=BACKWARD, label="backward ops (autograd)"),
                       Patch(color=ACCENT, label="optimizer step"),
                       Patch(color=COMM, label="bucket all-reduce (gloo thread); tick: launch, bN MiB")],
              loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=7, frameon=False)
    ax.set_title(f"One DDP step of {meta['model']}, {meta['batch_per_rank']} images per rank, "
                 f"bucket_cap_mb={meta['bucket_cap_mb']}: torch.profiler trace, {meta['world_size']} {meta['backend']} "
                 f"processes on the CPU ({meta['hardware']}), torch {meta['torch']}", fontsize=8)
    return _save(fig, "ddp_timeline", out)


def draw_no_sync(out: Path):
    plt = _pyplot()
    from matplotlib.patches import Patch
    events = _read_events(out, "no_sync")
    meta, variants = events["meta"], events["data"]
    fig, axes = plt.subplots(2, 1, figsize=(11, 4.8))
    colors = {"forward": COMPUTE, "backward": "#c6dbef"}
    titles = {"without": "without no_sync(): every micro-batch's backward all-reduces",
              "with": "no_sync() around forward and backward of micro-batches 1-3: one all-reduce, after the last"}
    for ax, variant in zip(axes, ("without", "with")):
        ranks = variants[variant]
        origin = min(s[1] for r in ranks for s in r["spans"] if s[0].startswith("phase:forward"))
        for rank, data in enumerate(ranks):
            y = (len(ranks) - 1 - rank) * 1.2
            _draw_rank_rows(ax, data["spans"], origin, y, f"rank {rank}", colors)
            for name, start, end, row in data["spans"]:
                if name.startswith("phase:forward") and rank == 0:
                    ax.text(start - origin, y + 1.0, "micro-batch " + name.rsplit(" ", 1)[1], fontsize=6)
        n_reduce = sum(1 for s in ranks[0]["spans"] if s[0] == "gloo:all_reduce")
        ax.set_title(f"{titles[variant]}  ({n_reduce} all-reduce{'s' if n_reduce != 1 else ''} on rank 0)",
                     fontsize=8, loc="left")
    axes[-1].set_xlabel("time (ms) since the first forward of the step")
    axes[-1].legend(handles=[Patch(color=COMPUTE, label="forward"), Patch(color="#c6dbef", label="backward"),
                             Patch(color=COMM, label="all-reduce (gloo thread); tick: launch")],
                    loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=3, fontsize=7, frameon=False)
    fig.suptitle(f"Gradient accumulation, {meta['accum_steps']} micro-batches of {meta['micro_batch']} "
                 f"({meta['model']}): torch.profiler traces of {meta['world_size']} {meta['backend']} processes "
                 f"on the CPU ({meta['hardware']}), torch {meta['torch']}", fontsize=8)
    fig.tight_layout()
    return _save(fig, "no_sync", out)


DRAW = {"dp_vs_ddp": draw_dp_vs_ddp, "ring_allreduce": draw_ring_allreduce, "ddp_timeline": draw_ddp_timeline,
        "no_sync": draw_no_sync, "stop_resume": draw_stop_resume, "sharding": draw_sharding}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=ALL, action="append", help="draw only this figure (repeatable)")
    parser.add_argument("--no-trace", action="store_true",
                        help="draw the traced figures from their saved events instead of tracing again")
    parser.add_argument("--out", type=Path, default=FIGURES,
                        help="output folder (default: %(default)s); --no-trace reads the events there, "
                        "or the default folder's where it has none")
    args = parser.parse_args(argv)
    names = args.only or ALL
    if not args.no_trace and TRACED & set(names):
        trace(args.out)
        # Both were traced (one program): both redrawn, so that no SVG disagrees with its events file.
        names = [name for name in ALL if name in names or name in TRACED]
    for name in names:
        print(DRAW[name](args.out))


if __name__ == "__main__":
    main()
