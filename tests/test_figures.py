"""The lessons' figures: every one a lesson shows exists, every one is shown, and
scripts/make_figures.py can draw them again (from the saved traces, which is what
keeps this test cheap; re-tracing takes a minute on 2 cores and is not done here)."""
import json
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ElementTree

from conftest import ROOT, TUTORIALS, lesson_files, links_of, subprocess_env

sys.path.insert(0, str(ROOT / "scripts"))
import make_figures  # noqa: E402

FIGURES = TUTORIALS / "figures"


def linked_figures():
    return {(lesson.parent / target).resolve(): lesson.name for lesson in lesson_files()
            for target in links_of(lesson) if target.startswith("figures/")}


def test_every_figure_a_lesson_links_exists_and_every_figure_is_linked():
    linked = linked_figures()
    missing = [f"{lesson}: {path.name}" for path, lesson in linked.items() if not path.is_file()]
    assert not missing, f"linked but not in tutorials/figures/: {missing}"
    drawn = {(FIGURES / f"{name}.svg").resolve() for name in make_figures.ALL}
    unlinked = sorted(p.name for p in drawn if p not in linked)
    assert not unlinked, f"drawn by make_figures.py but shown in no lesson: {unlinked}"


def test_the_figures_redraw_from_their_saved_events(tmp_path):
    """Into another folder, which has no events: those saved in tutorials/figures/ are drawn."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_figures.py"), "--no-trace",
                           "--out", str(tmp_path)], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in make_figures.ALL:
        svg = tmp_path / f"{name}.svg"
        assert svg.is_file(), name
        assert ElementTree.parse(svg).getroot().tag.endswith("svg"), name
        assert svg.stat().st_size < 200_000, f"{name}.svg is {svg.stat().st_size} bytes: keep figures small"


def test_a_trace_for_one_figure_redraws_both_it_rewrote(tmp_path, monkeypatch):
    """One trace writes both timelines' events: --only ddp_timeline must not leave a no_sync.svg
    that disagrees with its new events file."""
    def trace(out):  # what a trace writes, with a PyTorch version of its own
        for name in make_figures.TRACED:
            events = json.loads((FIGURES / f"{name}.events.json").read_text())
            events["meta"]["torch"] = "9.9.9-new-trace"
            make_figures._write_events(out, name, events["meta"], events["data"])
    monkeypatch.setattr(make_figures, "trace", trace)
    make_figures.main(["--only", "ddp_timeline", "--out", str(tmp_path)])
    for name in make_figures.TRACED:
        assert "9.9.9-new-trace" in (tmp_path / f"{name}.svg").read_text(), name


def test_the_saved_traces_say_where_they_were_measured():
    for name in make_figures.TRACED:
        with open(FIGURES / f"{name}.events.json") as f:
            meta = json.load(f)["meta"]
        assert meta["torch"] and meta["hardware"] and meta["backend"] == "gloo", meta
        assert meta["world_size"] == 2


def test_the_ddp_timeline_shows_buckets_launched_during_backward():
    with open(FIGURES / "ddp_timeline.events.json") as f:
        ranks = json.load(f)["data"]
    for rank in ranks:
        spans = rank["spans"]
        backward = next(s for s in spans if s[0] == "phase:backward")
        launches = [s[1] for s in spans if s[0] == "c10d::allreduce_"]
        assert len(launches) == len(rank["bucket_bytes"]) >= 3
        # Overlap, the point of the figure: all but the last bucket leave before backward ends.
        assert sum(backward[1] < t < backward[2] for t in launches) >= len(launches) - 1


def test_the_ring_figure_follows_the_ring_all_reduce():
    """ring_states steps collectives.ring_step, the arithmetic ring_all_reduce runs (whose sums
    tests/test_collectives.py checks in real processes): what the figure and lesson 07 say of
    the ring is checked here, once, of that one function."""
    from collectives import ring_step
    for n in (2, 3, 4, 5):
        states = make_figures.ring_states(n)
        assert len(states) == 1 + 2 * (n - 1)
        steps = [(phase, step) for phase in ("scatter-reduce", "all-gather") for step in range(n - 1)]
        for (phase, step), (_, _, sent) in zip(steps, states[1:], strict=True):  # sent: the black frames
            assert sent == [ring_step(rank, n, phase, step)[0] for rank in range(n)]
        _, after_scatter_reduce, _ = states[n - 1]
        for rank in range(n):  # rank r holds the full sum of chunk r+1
            assert after_scatter_reduce[rank][(rank + 1) % n] == frozenset(range(n))
        _, final, _ = states[-1]
        assert all(chunk == frozenset(range(n)) for row in final for chunk in row)


PARSE_A_REAL_TRACE = textwrap.dedent(r"""
    import json, sys, tempfile
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile, record_function
    sys.path.insert(0, sys.argv[1])
    import make_figures
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
        for _ in range(2):
            model(torch.ones(4, 8)).sum().backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("phase:backward"):
                model(torch.ones(4, 8)).sum().backward()
        prof.export_chrome_trace(f"{tmp}/trace.json")
        spans = make_figures.spans_from_chrome_trace(f"{tmp}/trace.json")
        dist.destroy_process_group()
    print(json.dumps(sorted({s[0] for s in spans})))
""")


def test_the_trace_parser_reads_this_pytorch_s_profiler():
    """The event names the figures rely on are those this PyTorch's profiler writes."""
    proc = subprocess.run([sys.executable, "-c", PARSE_A_REAL_TRACE, str(ROOT / "scripts")], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert {"phase:backward", "c10d::allreduce_", "gloo:all_reduce", "backward op"} <= names, names
