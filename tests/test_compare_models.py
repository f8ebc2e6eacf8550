"""scripts/compare_models.py: real checkpoints through the command line, and the
comparison rules (module. prefix, shapes, missing tensors, --atol) in process."""
import importlib.util

import pytest
import torch

from conftest import ROOT, SMALL, keep_on_cpu, run_script, subprocess_env

TOOL = "scripts/compare_models.py"


def run_tool(args, cwd=ROOT):
    """As a user runs it: no PYTHONPATH, so the tool must find utils/ by itself."""
    env = subprocess_env()
    env.pop("PYTHONPATH")
    return run_script([ROOT / TOOL, *args], timeout=60, check=False, env=env, cwd=cwd)


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_tool():
    return load_module("compare_models", ROOT / TOOL)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two runs of distributed.py with the same flags, one with another seed and one with
    another --lr, 2 steps each; in this process, which spares four `import torch` subprocesses.
    On the CPU on a GPU machine too: "the same flags give the same weights" is a bitwise claim there."""
    root = tmp_path_factory.mktemp("runs")
    paths = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            mp.delenv(name, raising=False)  # one process, no process group
        keep_on_cpu(mp)
        runs = {"first": [], "again": [], "other_seed": ["--seed", "1"], "other_lr": ["--lr", "0.05"]}
        for name, flags in runs.items():
            script = load_module("distributed", ROOT / "distributed.py")
            script.main([*SMALL, "--max-steps", "2", *flags, "--checkpoint-dir", str(root / name)])
            paths[name] = root / name / "checkpoint.pt"
    return paths


def test_identical_runs_match(checkpoints):
    proc = run_tool([checkpoints["first"], checkpoints["again"], "--what", "all"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "match:" in proc.stdout
    assert "differs" not in proc.stdout


def test_different_seeds_differ(checkpoints, capsys):
    # In process: one more `import torch` in a subprocess would add seconds, not coverage.
    assert load_tool().main([str(checkpoints["first"]), str(checkpoints["other_seed"])]) == 1
    out = capsys.readouterr().out
    assert "differs: model.conv1.weight max |A-B| = " in out
    assert "differs: model.fc.weight max |A-B| = " in out
    assert "match:" not in out


def test_another_learning_rate_is_named_in_the_optimizer_state(checkpoints, capsys):
    """Plain values (lr, momentum) are compared too, not only tensors."""
    assert load_tool().main([str(checkpoints["first"]), str(checkpoints["other_lr"]), "--what", "optimizer"]) == 1
    out = capsys.readouterr().out
    # --lr is per 128 samples a step (linear scaling): batch 32 gives a quarter.
    assert "differs: optimizer.param_groups.0.initial_lr 0.025 vs 0.0125" in out
    assert "differs: optimizer.param_groups.0.lr " in out
    assert "differs: optimizer.state.0.momentum_buffer max |A-B| = " in out
    assert "optimizer.param_groups.0.momentum" not in out  # the same value on both sides
    assert "model." not in out  # --what optimizer: the weights, different too, are not compared


def test_the_optimizers_kernel_is_not_compared(checkpoints, tmp_path, capsys):
    """On a GPU the DDP scripts save fused=True and distributed_fsdp.py fused=None (DTensor has no fused
    SGD): the same state, which must match; a flag that changes the step (nesterov) still differs."""
    state = torch.load(checkpoints["first"], weights_only=True)
    for flags, name in (({"fused": True, "foreach": False}, "fused"), ({"nesterov": False}, "nesterov")):
        changed = tmp_path / f"{name}.pt"
        torch.save(dict(state, optimizer=dict(state["optimizer"], param_groups=[
            dict(group, **flags) for group in state["optimizer"]["param_groups"]])), changed)
        code = load_tool().main([str(checkpoints["first"]), str(changed), "--what", "all"])
        out = capsys.readouterr().out
        assert (code, "match:" in out) == ((0, True) if name == "fused" else (1, False)), out
    assert "differs: optimizer.param_groups.0.nesterov True vs False" in out


def test_corrupt_file_is_one_line_and_exit_2(checkpoints, tmp_path):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(checkpoints["first"].read_bytes()[:1000])  # a save cut short
    proc = run_tool([checkpoints["first"], corrupt], cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot read" in lines[0] and str(corrupt) in lines[0], proc.stderr


# --- the rules, in process on small hand-made files ---------------------------------------

def state_dict():
    torch.manual_seed(0)
    return {"conv.weight": torch.randn(4, 3, 3, 3), "fc.weight": torch.randn(10, 4),
            "fc.bias": torch.zeros(10), "bn.num_batches_tracked": torch.tensor(7)}


def test_plain_state_dict_with_ddp_prefix_matches(tmp_path, capsys):
    tool = load_tool()
    torch.save(state_dict(), tmp_path / "plain.pt")
    torch.save({"module." + k: v for k, v in state_dict().items()}, tmp_path / "wrapped.pt")
    assert tool.main([str(tmp_path / "plain.pt"), str(tmp_path / "wrapped.pt")]) == 0
    assert "match: 4 entries" in capsys.readouterr().out


def test_shape_missing_and_value_differences_are_listed(tmp_path, capsys):
    tool = load_tool()
    changed = state_dict()
    changed["fc.weight"] = changed["fc.weight"][:5]
    del changed["fc.bias"]
    changed["extra.weight"] = torch.ones(2)
    changed["conv.weight"] = changed["conv.weight"] + 0.25
    torch.save(state_dict(), tmp_path / "a.pt")
    torch.save(changed, tmp_path / "b.pt")
    assert tool.main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]) == 1
    out = capsys.readouterr().out
    assert "shape differs: model.fc.weight (10, 4) vs (5, 4)" in out
    assert "only in A: model.fc.bias" in out
    assert "only in B: model.extra.weight" in out
    assert "differs: model.conv.weight max |A-B| = 0.25" in out
    assert "bn.num_batches_tracked" not in out


def test_atol_allows_small_differences(tmp_path, capsys):
    tool = load_tool()
    nudged = state_dict()
    nudged["fc.weight"] = nudged["fc.weight"] + 1e-7
    torch.save(state_dict(), tmp_path / "a.pt")
    torch.save(nudged, tmp_path / "b.pt")
    assert tool.main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]) == 1
    assert tool.main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--atol", "1e-6"]) == 0
    capsys.readouterr()


def test_the_same_infinity_matches_and_another_dtype_differs(tmp_path, capsys):
    """inf - inf is NaN: the same infinity on both sides was reported as a difference. And
    float64 beside float32 of the same values is not the same state under --atol 0."""
    tool = load_tool()
    torch.save({"w": torch.tensor([1.0, float("inf"), -float("inf")])}, tmp_path / "a.pt")
    torch.save({"w": torch.tensor([1.0, float("inf"), -float("inf")])}, tmp_path / "b.pt")
    torch.save({"w": torch.tensor([1.0, -float("inf"), -float("inf")])}, tmp_path / "flipped.pt")
    torch.save({"w": torch.tensor([1.0, float("inf"), -float("inf")], dtype=torch.float64)}, tmp_path / "f64.pt")
    assert tool.main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]) == 0
    assert tool.main([str(tmp_path / "a.pt"), str(tmp_path / "flipped.pt")]) == 1
    assert "differs: model.w max |A-B| = inf" in capsys.readouterr().out
    assert tool.main([str(tmp_path / "a.pt"), str(tmp_path / "f64.pt")]) == 1
    assert "dtype differs: model.w torch.float32 vs torch.float64" in capsys.readouterr().out


def test_bool_tensors_differ_by_one(tmp_path, capsys):
    """A mask that differs in some place counts as a difference of 1, as True - False."""
    tool = load_tool()
    mask = torch.tensor([True, False, True])
    assert tool.max_abs_diff(mask, mask.clone()) == 0.0
    assert tool.max_abs_diff(mask, ~mask) == 1.0
    assert tool.max_abs_diff(torch.tensor(True), torch.tensor(False)) == 1.0
    torch.save({"mask": mask}, tmp_path / "a.pt")
    torch.save({"mask": torch.tensor([True, True, True])}, tmp_path / "b.pt")
    assert tool.main([str(tmp_path / "a.pt"), str(tmp_path / "a.pt")]) == 0
    assert tool.main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]) == 1
    assert "differs: model.mask max |A-B| = 1" in capsys.readouterr().out
    assert tool.main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--atol", "1"]) == 0
    capsys.readouterr()


def test_not_a_state_dict_is_exit_2(tmp_path, capsys):
    tool = load_tool()
    torch.save([1, 2, 3], tmp_path / "list.pt")
    torch.save(state_dict(), tmp_path / "a.pt")
    assert tool.main([str(tmp_path / "a.pt"), str(tmp_path / "list.pt")]) == 2
    assert tool.main([str(tmp_path / "a.pt"), str(tmp_path / "missing.pt")]) == 2
    assert tool.main([str(tmp_path / "a.pt"), str(tmp_path / "a.pt"), "--what", "optimizer"]) == 2
    err = capsys.readouterr().err
    assert "not a checkpoint or a state_dict" in err and "no file at" in err and "no optimizer state" in err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as meant
def test_a_folder_is_named_for_what_it_holds(tmp_path, capsys):
    """A --checkpoint-dir: the file to name in it. A shard folder alone: its model, and for the
    optimizer the checkpoint.pt beside it (which numbers the optimizer state)."""
    import torch.distributed.checkpoint as dcp
    tool = load_tool()
    (tmp_path / "run").mkdir()
    torch.save(state_dict(), tmp_path / "run" / "checkpoint.pt")
    assert tool.main([str(tmp_path / "run"), str(tmp_path / "run" / "checkpoint.pt")]) == 2
    err = capsys.readouterr().err
    assert f"a folder; name its file, {tmp_path / 'run' / 'checkpoint.pt'}" in err, err
    shards = tmp_path / "sharded-step1"
    dcp.save({f"model.{k}": v for k, v in state_dict().items()}, checkpoint_id=str(shards), no_dist=True)
    assert tool.main([str(shards), str(tmp_path / "run" / "checkpoint.pt")]) == 0
    assert tool.main([str(shards), str(shards), "--what", "optimizer"]) == 2
    err = capsys.readouterr().err
    assert "for the optimizer, name the checkpoint.pt beside it" in err and "plain state_dict" not in err, err
