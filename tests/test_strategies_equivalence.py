"""One problem, four ways: on two CPU processes, the DDP scripts train bitwise the same.

Each script runs through its real launcher (torchrun; distributed_mp.py's own mp.spawn) for the
same steps from the same seed; the final checkpoints must hold identical weights and optimizer
state. Any difference in seeding order, model construction, how the batch is split across ranks,
sampling, augmentation, loss scaling (a loss divided by the world size as well, which DDP's average
already does), or schedule would show here. gloo's sum of two ranks' gradients is the same on both,
in either order, so two processes are as deterministic as one. One process, DataParallel included:
tests/test_clip_grad.py.
"""
import pytest
import torch

from conftest import SMALL, assert_same_state, run_script, torchrun
from models import build_model

STEPS = ["--epochs", "3", "--max-steps", "5", "--train-samples", "128"]  # 4 steps per epoch: crosses an epoch's end

SCRIPTS = {
    "distributed": ("distributed.py", []),
    "mp_spawn": ("distributed_mp.py", ["--nproc-per-node", "2"]),
    "accumulation": ("distributed_gradient_accumulation.py", ["--accum-steps", "1"]),
    "apex_fp32": ("distributed_apex.py", ["--opt-level", "O0"]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, (script, extra) in SCRIPTS.items():
        directory = tmp_path_factory.mktemp(name)
        flags = [*extra, *SMALL, *STEPS, "--workers", "2", "--checkpoint-dir", directory]  # loader workers, as users run
        run_script([script, *flags]) if name == "mp_spawn" else torchrun(2, script, flags)
        out[name] = torch.load(directory / "checkpoint.pt", map_location="cpu", weights_only=True)
    return out


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n != "distributed"])
def test_bitwise_identical_to_distributed(checkpoints, name):
    reference, other = checkpoints["distributed"], checkpoints[name]
    assert reference["global_step"] == other["global_step"] == 5
    assert (other["epoch"], other["step_in_epoch"]) == (reference["epoch"], reference["step_in_epoch"]) == (1, 1)
    assert_same_state(reference["model"], other["model"], "model")
    # The whole optimizer (its param_groups: the rate each step used) and the schedule's position: a schedule
    # stepped once more an epoch gives the same weights for a while, and every decay early later.
    assert_same_state(reference["optimizer"], other["optimizer"], "optimizer")
    assert_same_state(reference["scheduler"], other["scheduler"], "scheduler")


def test_training_moved_the_weights(checkpoints):
    # Guard against a vacuous pass: a schedule or optimizer that never stepped would leave every script at the
    # same initial weights. They moved from --seed 0's (as the scripts build them), by a few steps, so these are
    # the initial weights of the run (another seed's differ by 0.19 on average; 5 steps moved them by 0.0024).
    torch.manual_seed(0)
    initial = build_model("resnet_tiny", 100).state_dict()
    moved = (checkpoints["distributed"]["model"]["conv1.weight"] - initial["conv1.weight"]).abs().mean().item()
    assert 0 < moved < 0.05, moved
