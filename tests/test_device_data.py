"""--data-on-gpu (utils/device_data.py) gives bitwise the batches of the template path, and
its evaluation counts every test sample once. (On a GPU: tests/test_gpu_data.py.)"""
import argparse

import pytest
import torch

from conftest import SMALL, expect_ok
from models import build_model
from utils import data, device_data, metrics
from utils.distributed import DistEnv


def test_batched_crop_flip_equals_per_image():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=g)
    plan = data.augmentation_plan(seed=3, epoch=1, num_samples=16)
    padded = torch.nn.functional.pad(images, (data.PAD,) * 4)
    batched = device_data.crop_flip_batch(padded, plan[:, 0], plan[:, 1], plan[:, 2])
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


def test_data_on_device_trains_bitwise_like_the_loader(tmp_path, run_in_process):
    # 160 samples, batch 32: 5 steps per epoch, so 7 steps cross an epoch boundary.
    common = [*SMALL, "--epochs", "2", "--train-samples", "160", "--max-steps", "7"]
    common += ["--opt-level", "O0"]  # float32: distributed_apex.py is the script that offers --data-on-gpu
    expect_ok(run_in_process("distributed_apex.py", [*common, "--checkpoint-dir", tmp_path / "loader"]))
    expect_ok(run_in_process("distributed_apex.py", [*common, "--data-on-gpu", "--checkpoint-dir", tmp_path / "device"]))
    a = torch.load(tmp_path / "loader" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "device" / "checkpoint.pt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 7
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


# --- normalisation by table: the loader's values, in the layout and dtype the model wants ----

def small_sets(train=96, test=10):
    args = argparse.Namespace(dataset="synthetic", train_samples=train, test_samples=test, seed=3, workers=0,
                              channels_last=False)
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), distributed=False)
    train_set, test_set = data.build_datasets(args, env)
    return args, env, train_set, test_set


def test_table_holds_the_loaders_value_of_every_byte():
    every_byte = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(3, 16, 16)
    expected = data._normalize(every_byte).reshape(3, 256)
    assert torch.equal(device_data.normalization_table(), expected)
    # The lookup gives bitwise the loader's image, in either layout; bf16 is the float32
    # value rounded once, which is what autocast's cast at the first convolution gives.
    pixels = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    loader_batch = torch.stack([data._normalize(p) for p in pixels])
    plain = device_data.Normalize("cpu")(pixels)
    assert plain.dtype == torch.float32 and plain.is_contiguous() and torch.equal(plain, loader_batch)
    nhwc = device_data.Normalize("cpu", channels_last=True)(pixels)
    assert nhwc.is_contiguous(memory_format=torch.channels_last) and torch.equal(nhwc, loader_batch)
    bf16 = device_data.Normalize("cpu", torch.bfloat16, channels_last=True)(pixels)
    assert bf16.dtype == torch.bfloat16 and bf16.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(bf16, loader_batch.to(torch.bfloat16))


@pytest.mark.parametrize("channels_last, dtype", [(False, None), (True, torch.bfloat16)])
def test_device_batches_are_the_loaders(channels_last, dtype):
    args, env, train_set, _ = small_sets()
    args.channels_last = channels_last
    loader = data.train_loader(train_set, 32, 32, env, args)
    on_device = device_data.DeviceTrainLoader(train_set, 32, 32, env, args, dtype=dtype)
    for epoch, start_step in ((0, 0), (1, 1)):  # a resumed epoch skips the same steps
        loader.sampler.set_epoch(epoch, start_step)
        on_device.sampler.set_epoch(epoch, start_step)
        pairs = list(zip(loader, on_device, strict=True))
        assert len(pairs) == 3 - start_step
        for (images, targets), (device_images, device_targets) in pairs:
            assert torch.equal(targets, device_targets)
            assert device_images.is_contiguous(memory_format=torch.channels_last) == channels_last
            assert torch.equal(device_images, images.to(dtype or torch.float32))


def test_device_evaluation_counts_every_sample_once():
    args, _, _, test_set = small_sets(test=11)
    shards = []
    for rank in range(3):  # 11 samples over 3 ranks: 4, 4 and 3, in batches of 3 (the last one filled up)
        env = DistEnv(rank, rank, 3, 3, torch.device("cpu"), distributed=False)
        batches = list(device_data.DeviceEvalLoader(test_set, 3, env, args))
        assert all(images.shape == (3, 3, 32, 32) for images, _ in batches)
        targets = torch.cat([t for _, t in batches])
        shards.append(targets[targets != metrics.PAD_TARGET])
        assert (targets == metrics.PAD_TARGET).sum() == len(targets) - len(shards[-1])
    assert sorted(torch.cat(shards).tolist()) == sorted(test_set.base.targets)
    # evaluate() leaves the filling out: the same figures as the loader's variable-size batches.
    model = build_model("resnet_tiny", data.NUM_CLASSES).eval()
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), distributed=False)
    on_device = metrics.evaluate(model, device_data.DeviceEvalLoader(test_set, 4, env, args), env.device)
    reference = metrics.evaluate(model, data.eval_loader(test_set, 4, env, args), env.device)
    assert on_device["test_samples"] == reference["test_samples"] == 11
    assert (on_device["test_acc1"], on_device["test_acc5"]) == (reference["test_acc1"], reference["test_acc5"])
    # Different batch shapes may take different convolution kernels: equal to float32 rounding.
    assert on_device["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5)


def test_bf16_data_on_device_trains_bitwise_like_the_loader(tmp_path, run_in_process):
    # Handing the model bf16 images is what autocast does at the first convolution anyway.
    common = [*SMALL, "--amp", "bf16", "--train-samples", "64", "--max-steps", "2", "--channels-last"]
    expect_ok(run_in_process("distributed_apex.py", [*common, "--checkpoint-dir", tmp_path / "loader"]))
    expect_ok(run_in_process("distributed_apex.py", [*common, "--data-on-gpu",
                                                     "--checkpoint-dir", tmp_path / "device"]))
    a = torch.load(tmp_path / "loader" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "device" / "checkpoint.pt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 2
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
