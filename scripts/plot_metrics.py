r"""Training curves from the scripts' --metrics files: several runs overlaid in one picture.

    python distributed.py --epochs 30 --metrics runs/ddp1.jsonl
    torchrun --nproc_per_node=4 distributed.py --epochs 30 --metrics runs/ddp4.jsonl
    python scripts/plot_metrics.py runs/ddp1.jsonl runs/ddp4.jsonl -o curves.png

Three panels per epoch: loss (test solid, train dashed), top-1 accuracy (test solid,
train dashed) and training images per second. Each run is labelled by its strategy
and number of processes, with the file name added when two labels would be the same.

A metrics file is JSON lines: one "epoch" record per epoch and one "end" record per
run, appended. A resumed run appends to the same file, so an epoch can appear twice;
the latest record of each epoch is the one plotted. Runs of another strategy, world
size, global batch or device appended to the same file are drawn as runs of their own.

Prints a summary of every run (its label, epochs, last test accuracy, median
images/s). Exit status 0, or 2 with one line for a file that is missing, unreadable
or holds no epoch records.
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

from utils import cli, lifecycle  # noqa: E402
from utils.cli import UsageError  # noqa: E402

# What makes two records parts of different runs, even in one file.
IDENTITY = ("strategy", "world_size", "global_batch", "device")


@dataclass
class Run:
    path: str
    identity: tuple
    epochs: dict = field(default_factory=dict)   # epoch -> its latest record
    label: str = ""

    def series(self, key) -> list:
        """The field per epoch in epoch order; NaN where a record lacks it (a gap in the line)."""
        values = []
        for epoch in sorted(self.epochs):
            value = self.epochs[epoch].get(key)
            values.append(float(value) if isinstance(value, (int, float)) else math.nan)
        return values

    @property
    def strategy(self):
        return self.identity[0]

    @property
    def world_size(self):
        return self.identity[1]


def read_runs(path) -> list:
    """The runs in one metrics file, in the order they first appear."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a text file of JSON lines") from None
    runs = {}
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
        run = runs.setdefault(identity, Run(path, identity))
        run.epochs[record["epoch"]] = record  # a resumed run's later record wins
    if not runs:
        raise UsageError(f"{path} holds no epoch records (was the run started with --metrics, "
                         "and did it finish an epoch?)")
    return list(runs.values())


def label_runs(runs):
    """Strategy and processes; where two labels would be the same, the file name, then
    the global batch and device, then a number (the same file given twice)."""
    def base(run):
        n = run.world_size
        return f"{run.strategy or 'run'}, {n} process{'es' if n != 1 else ''}" if n else (run.strategy or "run")

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
        from matplotlib.lines import Line2D
    except ImportError:
        raise UsageError("matplotlib is not installed: pip install matplotlib") from None

    fig, (ax_loss, ax_acc, ax_speed) = plt.subplots(1, 3, figsize=(15, 4.6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        colour = colours[i % len(colours)]
        epochs = sorted(run.epochs)
        ax_loss.plot(epochs, run.series("test_loss"), "-o", color=colour, markersize=3)
        ax_loss.plot(epochs, run.series("train_loss"), "--", color=colour)
        ax_acc.plot(epochs, run.series("test_acc1"), "-o", color=colour, markersize=3)
        ax_acc.plot(epochs, run.series("train_acc1"), "--", color=colour)
        ax_speed.plot(epochs, run.series("images_per_second"), "-o", color=colour, markersize=3)
    for ax, name in ((ax_loss, "loss"), (ax_acc, "top-1 accuracy (%)"),
                     (ax_speed, "training images / s (all processes)")):
        ax.set_xlabel("epoch")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax_speed.set_ylim(bottom=0)
    ax_loss.legend(handles=[Line2D([], [], color="grey", linestyle="-", marker="o", markersize=3, label="test"),
                            Line2D([], [], color="grey", linestyle="--", label="train")], fontsize=8)
    handles = [Line2D([], [], color=colours[i % len(colours)], linewidth=2, label=run.label)
               for i, run in enumerate(runs)]
    legend = fig.legend(handles=handles, loc="lower center", ncol=min(len(runs), 4), fontsize=9, frameon=False)
    devices = sorted({str(run.identity[3]) for run in runs if run.identity[3]})
    fig.suptitle(title or "training curves" + (f" on {', '.join(devices)}" if devices else ""), fontsize=11)
    fig.tight_layout(rect=(0, 0.06 + 0.035 * ((len(runs) - 1) // 4), 1, 1))
    directory = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(directory, exist_ok=True)
    try:
        fig.savefig(out_path, dpi=110)
    except (ValueError, OSError) as exc:  # an unknown extension, an unwritable folder
        raise UsageError(f"cannot write {out_path}: {str(exc).splitlines()[0]}") from None
    finally:
        plt.close(fig)
    return [text.get_text() for text in legend.get_texts()]


def summary(runs) -> str:
    lines = [f"{'run':40s} {'epochs':>6s} {'test acc1':>9s} {'img/s':>9s}  file"]
    # img/s: the median over epochs, so that the first epoch's warm-up does not weigh in.
    for run in runs:
        last = run.epochs[max(run.epochs)]
        speeds = [s for s in run.series("images_per_second") if not math.isnan(s)]
        acc = last.get("test_acc1")
        lines.append(f"{run.label:40s} {len(run.epochs):>6d} "
                     f"{format(acc, '.2f') + '%' if isinstance(acc, (int, float)) else '-':>9s} "
                     f"{format(statistics.median(speeds), ',.0f') if speeds else '-':>9s}  {run.path}")
    return "\n".join(lines)


def main(argv=None):
    parser = cli.Parser(description=__doc__.strip().splitlines()[0],
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("metrics", nargs="+", metavar="RUN.jsonl", help="--metrics files of the training scripts")
    parser.add_argument("-o", "--output", default="curves.png",
                        help="picture to write (.png, .svg or .pdf)")
    parser.add_argument("--title", default=None, help="the figure's title (default: the devices)")
    args = parser.parse_args(argv)
    runs = label_runs([run for path in args.metrics for run in read_runs(path)])
    plot(runs, args.output, args.title)
    print(summary(runs))
    print(f"wrote {args.output} ({len(runs)} run{'s' if len(runs) != 1 else ''})")


if __name__ == "__main__":
    lifecycle.run_main(main)
