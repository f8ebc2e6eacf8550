r"""Training curves from the scripts' --metrics files: several runs overlaid in one picture.

    python distributed.py --epochs 30 --metrics runs/ddp1.jsonl
    torchrun --nproc_per_node=4 distributed.py --epochs 30 --metrics runs/ddp4.jsonl
    python scripts/plot_metrics.py runs/ddp1.jsonl runs/ddp4.jsonl -o curves.png

Three panels per epoch: loss (test solid, train dashed), top-1 accuracy (test solid,
train dashed) and training images per second. Each run is labelled by its strategy
and number of processes, with the file name added when two labels would be the same.

A metrics file is JSON lines: one "epoch" record per epoch and one "end" record per
run, appended. A resumed run appends to the same file and continues its curves (an
epoch cut short by --max-steps, then finished, is plotted as finished); the same
command run again starts over at step 0 and is drawn as a run of its own, as are runs
of another strategy, world size, global batch or device. An epoch cut short and not
finished has a hollow marker.

Prints a summary of every run (its label, epochs, last test accuracy, median
images/s of its whole epochs). Exit status 0, or 2 with one line for a file that is
missing, unreadable or holds no epoch records.
"""
import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, field

# `python scripts/plot_metrics.py` puts scripts/ on sys.path, not the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Not utils.lifecycle, the scripts' exit: it imports torch, most of this tool's start-up time.
from utils import cli  # noqa: E402
from utils.cli import UsageError  # noqa: E402

# What makes two records parts of different runs, even in one file.
IDENTITY = ("strategy", "world_size", "global_batch", "device")


@dataclass
class Run:
    path: str
    identity: tuple
    epochs: dict = field(default_factory=dict)   # epoch -> its latest record
    label: str = ""

    def cut_short(self, epoch) -> bool:
        """Whether the epoch's record is of part of it (--max-steps stopped the run inside it)."""
        return self.epochs[epoch].get("epoch_complete") is False

    def series(self, key) -> list:
        """The field per epoch in epoch order; NaN where a record lacks it (a gap in the line)."""
        values = []
        for epoch in sorted(self.epochs):
            value = self.epochs[epoch].get(key)
            values.append(float(value) if isinstance(value, (int, float)) else math.nan)
        return values


def continues(last: dict, record: dict) -> bool:
    """Whether `record` belongs to the run whose latest record is `last`, resumed or not. A run checkpoints
    before it writes an epoch's record and resumes from its checkpoint: its steps keep growing and its epochs
    never go back; it repeats only an epoch cut short by --max-steps, to go on with it. A fresh run starts
    over at step 0, epoch 1. (A fresh run after one cut short in its first epoch, taking more steps than
    it did, reads as its resume: no field of the records tells them apart.)"""
    if record["epoch"] < last["epoch"] or (record["epoch"] == last["epoch"] and last.get("epoch_complete", True)):
        return False
    step, last_step = record.get("step"), last.get("step")
    return not (isinstance(step, int) and isinstance(last_step, int)) or step > last_step


def read_runs(path) -> list:
    """The runs in one metrics file, in the order they first appear."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a text file of JSON lines") from None
    runs, current = [], {}  # current: identity -> the run that its next record may continue
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}, line {number}: not JSON ({exc.msg}); "
                             "is it a --metrics file of these scripts?") from None
        if not isinstance(record, dict):
            raise UsageError(f"{path}, line {number}: a JSON {type(record).__name__}, not a record")
        if record.get("event") != "epoch":
            continue  # the "end" record repeats the last epoch's numbers
        if not isinstance(record.get("epoch"), int):
            raise UsageError(f"{path}, line {number}: an epoch record without a whole-number \"epoch\"")
        identity = tuple(record.get(key) for key in IDENTITY)
        run = current.get(identity)
        if run is None or not continues(run.epochs[max(run.epochs)], record):
            run = current[identity] = Run(path, identity)
            runs.append(run)
        run.epochs[record["epoch"]] = record  # an epoch cut short, then finished after a resume: the later record
    if not runs:
        raise UsageError(f"{path} holds no epoch records (was the run started with --metrics, "
                         "and did it finish an epoch?)")
    return runs


def label_runs(runs):
    """Strategy and processes; where two labels would be the same, the file name, then
    the global batch and device, then a number (the same file given twice)."""
    def base(run):
        strategy, n = run.identity[0] or "run", run.identity[1]
        return f"{strategy}, {n} process{'es' if n != 1 else ''}" if n else strategy

    def colliding():
        groups = {}
        for run in runs:
            groups.setdefault(run.label, []).append(run)
        return [group for group in groups.values() if len(group) > 1]

    for run in runs:
        run.label = base(run)
    for group in colliding():
        for run in group:
            run.label += f" ({os.path.basename(run.path)})"
    for group in colliding():
        if len({run.identity for run in group}) > 1:  # one file, runs that differ in batch or device
            for run in group:
                run.label = f"{base(run)}, batch {run.identity[2]}, {run.identity[3]} ({os.path.basename(run.path)})"
    for group in colliding():
        for number, run in enumerate(group[1:], 2):
            run.label += f" #{number}"
    return runs


def plot(runs, out_path, title=None) -> list:
    """Draw the runs into out_path (format from its extension); return the legend's texts."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
        from matplotlib.backend_bases import FigureCanvasBase
        from matplotlib.lines import Line2D
    except ImportError:
        raise UsageError("matplotlib is not installed: pip install matplotlib") from None

    # Refused before anything is drawn or made: matplotlib would refuse it only once the folder exists.
    extension = os.path.splitext(out_path)[1][1:].lower()
    if extension not in FigureCanvasBase.get_supported_filetypes():  # none: matplotlib would add .png
        raise UsageError(f"cannot write {out_path}: format {extension!r} is not supported (.png, .svg or .pdf)")
    fig, (ax_loss, ax_acc, ax_speed) = plt.subplots(1, 3, figsize=(15, 4.6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        colour = colours[i % len(colours)]
        epochs = sorted(run.epochs)
        for ax, key in ((ax_loss, "test_loss"), (ax_acc, "test_acc1"), (ax_speed, "images_per_second")):
            # The epochs that have the value: with --eval-every N the others have no test figures, and NaN
            # between them would leave dots, not a line.
            shown = [(epoch, value) for epoch, value in zip(epochs, run.series(key)) if not math.isnan(value)]
            whole = [index for index, (epoch, _) in enumerate(shown) if not run.cut_short(epoch)]
            ax.plot(*(zip(*shown) if shown else ([], [])), "-o", color=colour, markersize=3, markevery=whole)
            if cut := [(epoch, value) for epoch, value in shown if run.cut_short(epoch)]:
                ax.plot(*zip(*cut), "o", color=colour, markersize=5, markerfacecolor="white")
        ax_loss.plot(epochs, run.series("train_loss"), "--", color=colour)
        ax_acc.plot(epochs, run.series("train_acc1"), "--", color=colour)
    for ax, name in ((ax_loss, "loss"), (ax_acc, "top-1 accuracy (%)"),
                     (ax_speed, "training images / s (all processes)")):
        ax.set_xlabel("epoch")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax_speed.set_ylim(bottom=0)
    styles = [Line2D([], [], color="grey", linestyle="-", marker="o", markersize=3, label="test"),
              Line2D([], [], color="grey", linestyle="--", label="train")]
    if any(run.cut_short(epoch) for run in runs for epoch in run.epochs):
        styles.append(Line2D([], [], color="grey", linestyle="", marker="o", markersize=5,
                             markerfacecolor="white", label="epoch cut short"))
    ax_loss.legend(handles=styles, fontsize=8)
    handles = [Line2D([], [], color=colours[i % len(colours)], linewidth=2, label=run.label)
               for i, run in enumerate(runs)]
    legend = fig.legend(handles=handles, loc="lower center", ncol=min(len(runs), 4), fontsize=9, frameon=False)
    devices = sorted({str(run.identity[3]) for run in runs if run.identity[3]})
    if title is None:
        title = "training curves" + (f" on {', '.join(devices)}" if devices else "")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06 + 0.035 * ((len(runs) - 1) // 4), 1, 1))
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        fig.savefig(out_path, dpi=110)
    except OSError as exc:  # a folder that cannot be made or written
        raise UsageError(f"cannot write {out_path}: {str(exc).splitlines()[0]}") from None
    finally:
        plt.close(fig)
    return [text.get_text() for text in legend.get_texts()]


def summary(runs) -> str:
    lines = [f"{'run':40s} {'epochs':>6s} {'test acc1':>9s} {'img/s':>9s}  file"]
    # img/s: the median over whole epochs, which one slow epoch does not move (each epoch's warm-up is left
    # out already); an epoch cut short may have timed its warm-up steps too (utils/metrics.py, EpochTimer).
    for run in runs:
        speeds = [s for epoch, s in zip(sorted(run.epochs), run.series("images_per_second"))
                  if not run.cut_short(epoch) and not math.isnan(s)]
        acc = next((a for a in reversed(run.series("test_acc1")) if not math.isnan(a)), None)  # the last evaluated
        whole = sum(not run.cut_short(epoch) for epoch in run.epochs)
        epochs = f"{whole}+" if whole < len(run.epochs) else str(whole)
        lines.append(f"{run.label:40s} {epochs:>6s} "
                     f"{format(acc, '.2f') + '%' if isinstance(acc, (int, float)) else '-':>9s} "
                     f"{format(statistics.median(speeds), ',.0f') if speeds else '-':>9s}  {run.path}")
    if any(run.cut_short(epoch) for run in runs for epoch in run.epochs):
        lines.append("N+: N whole epochs and one cut short (--max-steps), left out of img/s")
    return "\n".join(lines)


def main(argv=None):
    parser = cli.Parser(description=__doc__.strip().splitlines()[0],
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("metrics", nargs="+", metavar="RUN.jsonl", help="--metrics files of the training scripts")
    parser.add_argument("-o", "--output", default="curves.png",
                        help="picture to write (.png, .svg or .pdf)")
    parser.add_argument("--title", default=None, help="the figure's title (default: the devices; \"\": none)")
    try:
        args = parser.parse_args(argv)
        runs = label_runs([run for path in args.metrics for run in read_runs(path)])
        plot(runs, args.output, args.title)
    except UsageError as err:  # bad input: one line, exit status 2, as the training scripts
        print(f"plot_metrics.py: error: {err}", file=sys.stderr)
        return 2
    print(summary(runs))
    print(f"wrote {args.output} ({len(runs)} run{'s' if len(runs) != 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
