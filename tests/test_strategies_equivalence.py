"""One problem, five ways: on one CPU process, the scripts train bitwise the same.

Each script runs through its real launcher (plain python; mp.spawn with one
process) for the same steps from the same seed; the final checkpoints must hold
identical weights and optimizer state. Any difference in seeding order, model
construction, sampling, augmentation, loss scaling or schedule would show here.
"""
import pytest
import torch

from conftest import SMALL, assert_same_state, expect_ok, run_script

STEPS = ["--max-steps", "5", "--train-samples", "128"]  # 4 steps per epoch: crosses an epoch boundary

SCRIPTS = {
    "distributed": ["distributed.py"],
    "dataparallel": ["dataparallel.py"],
    "mp_spawn": ["distributed_mp.py", "--nproc-per-node", "1"],
    "accumulation": ["distributed_gradient_accumulation.py", "--accum-steps", "1"],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, argv in SCRIPTS.items():
        directory = tmp_path_factory.mktemp(name)
        run_script([*argv, *SMALL, "--epochs", "3", *STEPS, "--checkpoint-dir", directory])
        out[name] = torch.load(directory / "checkpoint.pt", map_location="cpu", weights_only=True)
    return out


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n != "distributed"])
def test_bitwise_identical_to_distributed(checkpoints, name):
    reference, other = checkpoints["distributed"], checkpoints[name]
    assert reference["global_step"] == other["global_step"] == 5
    assert (other["epoch"], other["step_in_epoch"]) == (reference["epoch"], reference["step_in_epoch"]) == (1, 1)
    assert_same_state(reference["model"], other["model"], "model")
    assert_same_state(reference["optimizer"]["state"], other["optimizer"]["state"], "optimizer")


def test_training_moved_the_weights(checkpoints, tmp_path, run_in_process):
    # Guard against a vacuous pass: a different seed gives different weights.
    expect_ok(run_in_process("distributed.py", [*SMALL, "--epochs", "3", *STEPS, "--seed", "1",
                                                "--checkpoint-dir", tmp_path]))
    other = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert not torch.equal(other["model"]["fc.weight"], checkpoints["distributed"]["model"]["fc.weight"])
