"""scripts/plot_metrics.py on metrics written by real runs: a run stopped mid-epoch and
resumed into the same file, and a run of another strategy; labels, the picture, bad input."""
import json
import struct

import pytest

from conftest import SMALL, assert_one_line_error, expect_ok, read_metrics, run_script
from scripts import plot_metrics

TWO_EPOCHS = [*SMALL[:-2], "--epochs", "2"]  # 256 samples, batch 32: 8 steps per epoch


@pytest.fixture(scope="module")
def metrics(tmp_path_factory, run_in_process_once):
    """ddp.jsonl: distributed.py stopped at step 12 (in epoch 2), then resumed to the end,
    appending to the same file. accum.jsonl: the accumulation script, 2 micro-batches.
    (The scripts' main() in this process: the files are what is tested.)"""
    folder = tmp_path_factory.mktemp("metrics")
    ddp, accum = folder / "ddp.jsonl", folder / "accum.jsonl"
    common = [*TWO_EPOCHS, "--checkpoint-dir", folder / "ckpt", "--metrics", ddp]
    expect_ok(run_in_process_once("distributed.py", [*common, "--max-steps", "12"]))
    expect_ok(run_in_process_once("distributed.py", [*common, "--resume"]))
    expect_ok(run_in_process_once("distributed_gradient_accumulation.py",
                                  [*TWO_EPOCHS, "--accum-steps", "2", "--metrics", accum]))
    return ddp, accum


def png_size(path) -> tuple:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_a_resumed_run_is_one_curve_with_the_latest_record_of_each_epoch(metrics):
    ddp, _ = metrics
    records = read_metrics(ddp)
    # What the file holds: epoch 2 twice (cut at step 12, then complete after the resume).
    assert [(r["event"], r["epoch"], r["epoch_complete"]) for r in records] == [
        ("epoch", 1, True), ("epoch", 2, False), ("end", 2, False), ("epoch", 2, True), ("end", 2, True)]
    (run,) = plot_metrics.read_runs(str(ddp))
    assert sorted(run.epochs) == [1, 2]
    assert run.epochs[2] == records[3]
    assert run.series("test_acc1") == [records[0]["test_acc1"], records[3]["test_acc1"]]


def test_runs_are_plotted_and_labelled_by_strategy_and_processes(metrics, tmp_path):
    ddp, accum = metrics
    runs = plot_metrics.label_runs(plot_metrics.read_runs(str(ddp)) + plot_metrics.read_runs(str(accum)))
    out = tmp_path / "curves.png"
    legend = plot_metrics.plot(runs, str(out))
    assert legend == ["ddp-torchrun, 1 process", "ddp-accum, 1 process"]
    width, height = png_size(out)
    assert 1200 <= width <= 2400 and 400 <= height <= 1200, (width, height)
    assert out.stat().st_size > 20_000  # three panels with lines, not an empty canvas


def test_the_command_line_writes_the_picture_and_a_summary(metrics, tmp_path):
    ddp, accum = metrics
    out = tmp_path / "figs" / "curves.svg"
    proc = run_script(["scripts/plot_metrics.py", ddp, accum, ddp, "-o", out, "--title", "tiny runs"])
    # The same file twice: the labels would collide, the file name and a number tell them apart.
    assert "ddp-torchrun, 1 process (ddp.jsonl) " in proc.stdout
    assert "ddp-torchrun, 1 process (ddp.jsonl) #2" in proc.stdout
    assert "ddp-accum, 1 process " in proc.stdout
    last = read_metrics(accum)[-1]
    assert f"{last['test_acc1']:.2f}%" in proc.stdout
    assert f"wrote {out} (3 runs)" in proc.stdout
    assert out.read_text().lstrip().startswith("<?xml") and "tiny runs" in out.read_text()


def record(epoch, **fields):
    return {"event": "epoch", "epoch": epoch, "train_loss": 1.0, "test_loss": 1.0, "train_acc1": 50.0,
            "test_acc1": 50.0, "images_per_second": 100.0, "world_size": 2, "global_batch": 64,
            "strategy": "ddp-torchrun", "device": "cpu", **fields}


def test_other_runs_appended_to_one_file_stay_apart(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [record(1), record(2), {"event": "end"}, record(1, world_size=4), record(2, world_size=4), "",
             record(1, global_batch=128)]
    path.write_text("\n".join(json.dumps(x) if x else "" for x in lines))
    runs = plot_metrics.label_runs(plot_metrics.read_runs(str(path)))
    assert [r.label for r in runs] == ["ddp-torchrun, 2 processes, batch 64, cpu (mixed.jsonl)",
                                       "ddp-torchrun, 4 processes",
                                       "ddp-torchrun, 2 processes, batch 128, cpu (mixed.jsonl)"]
    assert [sorted(r.epochs) for r in runs] == [[1, 2], [1, 2], [1]]


def test_a_missing_field_is_a_gap_not_an_error(tmp_path):
    path = tmp_path / "gap.jsonl"
    path.write_text(json.dumps(record(1, train_acc1=None)) + "\n" + json.dumps(record(2)) + "\n")
    (run,) = plot_metrics.read_runs(str(path))
    acc = run.series("train_acc1")
    assert acc[0] != acc[0] and acc[1] == 50.0  # NaN, then the value
    assert plot_metrics.plot([run], str(tmp_path / "gap.png"))


def test_epochs_without_evaluation_are_skipped_by_the_test_curves(tmp_path, monkeypatch):
    """--eval-every 2: odd epochs record no test figures. The test curves join the evaluated epochs into a
    line (NaN between them left dots), and the summary gives the last evaluated accuracy, not '-'."""
    path = tmp_path / "every2.jsonl"
    # One slow epoch's throughput, a tenth of the others': the summary's median (102) leaves it out, a mean would not.
    speeds = [101.0, 102.0, 103.0, 104.0, 10.0]
    path.write_text("".join(json.dumps(record(epoch, images_per_second=speeds[epoch - 1], **(
        {"test_loss": None, "test_acc1": None} if epoch % 2 else {"test_acc1": 10.0 * epoch}))) + "\n"
                            for epoch in range(1, 6)))
    runs = plot_metrics.label_runs(plot_metrics.read_runs(str(path)))
    assert plot_metrics.summary(runs).splitlines()[1].split()[3:6] == ["5", "40.00%", "102"]
    import matplotlib.pyplot as plt
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_metrics.plot(runs, str(tmp_path / "every2.png"))
    loss, acc, speed = (ax.get_lines()[0] for ax in figures[0].axes[:3])
    assert list(loss.get_xdata()) == list(acc.get_xdata()) == [2, 4] and list(acc.get_ydata()) == [20.0, 40.0]
    assert list(speed.get_xdata()) == [1, 2, 3, 4, 5] and list(speed.get_ydata()) == speeds  # what its title says


def test_a_missing_file_is_one_line_and_exit_2(tmp_path):
    proc = run_script(["scripts/plot_metrics.py", tmp_path / "nope.jsonl", "-o", tmp_path / "x.png"], check=False)
    assert_one_line_error(proc, "cannot read", "nope.jsonl")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("content, fragment", [
    ('{"event": "epoch", "epoch": 1}\n{"event": "epo', "line 2: not JSON"),
    ('{"event": "end", "epoch": 3}\n', "holds no epoch records"),
    ("", "holds no epoch records"),
    ("[1, 2]\n", "line 1: a JSON list, not a record"),
    ('{"event": "epoch", "epoch": "one"}\n', "without a whole-number"),
])
def test_bad_metrics_files_exit_2_with_one_line(content, fragment, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    assert plot_metrics.main([str(path), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err and str(path) in err, err


def test_an_unknown_picture_format_exits_2_and_makes_no_folder(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps(record(1)) + "\n")
    proc = run_script(["scripts/plot_metrics.py", path, "-o", tmp_path / "new" / "curves.xyz"], check=False)
    assert_one_line_error(proc, "cannot write", "curves.xyz", "'xyz'")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("output", ["curves", "pictures/"])
def test_a_picture_without_an_extension_exits_2_and_writes_nothing(output, tmp_path, monkeypatch, capsys):
    """matplotlib would add .png: a curves.png reported as "curves", a hidden pictures/.png."""
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps(record(1)) + "\n")
    (tmp_path / "pictures").mkdir()
    monkeypatch.chdir(tmp_path)
    assert plot_metrics.main([str(path), "-o", output]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cannot write {output}: format '' is not supported" in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ok.jsonl", "pictures"]


def test_an_empty_title_is_no_title(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps(record(1)) + "\n")
    runs = plot_metrics.label_runs(plot_metrics.read_runs(str(path)))
    plot_metrics.plot(runs, str(tmp_path / "default.svg"))
    plot_metrics.plot(runs, str(tmp_path / "none.svg"), title="")
    assert "training curves on cpu" in (tmp_path / "default.svg").read_text()
    assert "training curves" not in (tmp_path / "none.svg").read_text()


def test_a_folder_that_cannot_be_made_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps(record(1)) + "\n")
    # A file where the folder should be: os.makedirs fails, as it does under /proc or without write permission.
    (tmp_path / "taken").write_text("")
    proc = run_script(["scripts/plot_metrics.py", path, "-o", tmp_path / "taken" / "sub" / "x.png"], check=False)
    assert_one_line_error(proc, "cannot write", "x.png")


def test_torch_is_not_imported(tmp_path):
    """A tool that reads JSON and draws: `import torch` would be most of its start-up time."""
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps(record(1)) + "\n")
    proc = run_script(["-X", "importtime", "scripts/plot_metrics.py", path, "-o", tmp_path / "x.png"])
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "matplotlib" in imported  # the list is the real one
    assert "torch" not in imported


# --- runs in one file: a resume continues its run, a fresh run starts another ------------

def steps(*records):
    """Hand-made records of one identity: (epoch, step, whole epoch?) or "end"."""
    return [{"event": "end"} if r == "end" else record(r[0], step=r[1], epoch_complete=r[2]) for r in records]


@pytest.mark.parametrize("records, runs", [
    # Run again with the same flags: the steps start over.
    (steps((1, 8, True), (2, 16, True), (3, 24, True), "end", (1, 8, True), (2, 16, True)), [[1, 2, 3], [1, 2]]),
    # --max-steps 12 stops in epoch 2 (its record, then the end record); --resume finishes epoch 2.
    (steps((1, 8, True), (2, 12, False), "end", (2, 16, True), "end"), [[1, 2]]),
    # Cut twice in epoch 2, then finished; or stopped by a signal mid-epoch 2 (no record), then resumed.
    (steps((1, 8, True), (2, 10, False), (2, 12, False), (2, 16, True)), [[1, 2]]),
    (steps((1, 8, True), (2, 16, True), (3, 24, True)), [[1, 2, 3]]),
    # A fresh run on more samples: its steps pass the last run's, its epochs start over.
    (steps((1, 4, True), (2, 8, True), (1, 10, True)), [[1, 2], [1]]),
    # A fresh run repeats a whole epoch; a resume repeats only one cut short.
    (steps((1, 8, True), (1, 9, True)), [[1], [1]]),
    # A fresh run after one cut short, stopping earlier than it.
    (steps((1, 5, False), (1, 3, False)), [[1], [1]]),
])
def test_a_resume_continues_its_run_and_a_fresh_run_starts_another(records, runs, tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [sorted(run.epochs) for run in plot_metrics.read_runs(str(path))] == runs


def test_the_same_flags_run_twice_into_one_file_are_two_runs(tmp_path):
    path = tmp_path / "twice.jsonl"
    first = [record(e, step=8 * e, epoch_complete=True, test_acc1=acc) for e, acc in ((1, 10), (2, 20), (3, 30))]
    again = [record(e, step=8 * e, epoch_complete=True, test_acc1=acc) for e, acc in ((1, 11), (2, 21))]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*first, dict(first[-1], event="end"), *again]))
    runs = plot_metrics.label_runs(plot_metrics.read_runs(str(path)))
    assert [run.series("test_acc1") for run in runs] == [[10, 20, 30], [11, 21]]
    rows = plot_metrics.summary(runs).splitlines()[1:]
    assert len(rows) == 2 and " 30.00% " in rows[0] and " 21.00% " in rows[1], rows


# --- an epoch cut short (--max-steps): drawn and counted as part of one ------------------

def test_an_epoch_cut_short_is_marked_and_left_out_of_images_per_second(tmp_path, monkeypatch):
    path = tmp_path / "cut.jsonl"
    # Epoch 2 stopped by --max-steps after a few steps: its images/s may include the warm-up.
    path.write_text(json.dumps(record(1, step=8, epoch_complete=True, images_per_second=100.0)) + "\n"
                    + json.dumps(record(2, step=10, epoch_complete=False, images_per_second=10.0)) + "\n")
    runs = plot_metrics.label_runs(plot_metrics.read_runs(str(path)))
    header, row, *notes = plot_metrics.summary(runs).splitlines()
    assert row.split()[3:6] == ["1+", "50.00%", "100"], row  # not 2 epochs, not the median 55
    assert any("cut short" in note for note in notes), notes

    import matplotlib.pyplot as plt
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at its lines
    plot_metrics.plot(runs, str(tmp_path / "cut.png"))
    (figure,) = figures
    for ax in figure.axes:
        hollow = [line for line in ax.get_lines() if line.get_markerfacecolor() == "white"]
        assert [list(line.get_xdata()) for line in hollow] == [[2]], ax.get_title()
        filled = [line for line in ax.get_lines() if line.get_marker() == "o" and line not in hollow]
        assert [line.get_markevery() for line in filled] == [[0]], ax.get_title()  # epoch 1's dot only
    assert any("cut short" in text.get_text() for text in figure.axes[0].get_legend().get_texts())
