"""--data-on-gpu (utils/device_data.py) gives bitwise the batches of the template path."""
import torch

from conftest import SMALL, run_script
from utils import data


def test_batched_crop_flip_equals_per_image():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=g)
    plan = data.augmentation_plan(seed=3, epoch=1, num_samples=16)
    padded = torch.nn.functional.pad(images, (data.PAD,) * 4)
    batched = data.crop_flip_batch(padded, plan[:, 0], plan[:, 1], plan[:, 2])
    for i in range(16):
        dy, dx, flip = plan[i].tolist()
        assert torch.equal(batched[i], data.crop_flip(images[i], dy, dx, flip))
    # The plan really varies: not every image is the identity crop.
    assert len({tuple(row) for row in plan.tolist()}) > 4


def test_augmentation_plan_depends_on_epoch_and_seed_only():
    a = data.augmentation_plan(0, 0, 100)
    assert torch.equal(a, data.augmentation_plan(0, 0, 100))
    assert not torch.equal(a, data.augmentation_plan(0, 1, 100))
    assert not torch.equal(a, data.augmentation_plan(1, 0, 100))
    assert a[:, :2].min() >= 0 and a[:, :2].max() <= 2 * data.PAD and set(a[:, 2].tolist()) == {0, 1}


def test_data_on_device_trains_bitwise_like_the_loader(tmp_path):
    # 160 samples, batch 32: 5 steps per epoch, so 7 steps cross an epoch boundary.
    common = [*SMALL, "--epochs", "2", "--train-samples", "160", "--max-steps", "7"]
    run_script(["distributed.py", *common, "--checkpoint-dir", tmp_path / "loader"])
    run_script(["distributed.py", *common, "--data-on-gpu", "--checkpoint-dir", tmp_path / "device"])
    a = torch.load(tmp_path / "loader" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "device" / "checkpoint.pt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 7
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
