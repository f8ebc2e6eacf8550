"""--data-on-gpu (utils/device_data.py) gives bitwise the batches of the template path, and
its evaluation counts every test sample once. (On a GPU: tests/test_gpu_data.py.)"""
import argparse

import pytest
import torch

from conftest import SMALL, expect_ok, normalized
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


# --- normalisation by table: the values of conftest.normalized, in the layout and dtype the model wants ----

def small_sets(train=96, test=10):
    args = argparse.Namespace(dataset="synthetic", train_samples=train, test_samples=test, seed=3, workers=0,
                              channels_last=False)
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), distributed=False)
    train_set, test_set = data.build_datasets(args, env)
    return args, env, train_set, test_set


def test_table_holds_the_normalised_value_of_every_byte():
    every_byte = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(3, 16, 16)
    expected = normalized(every_byte).reshape(-1)
    assert torch.equal(data.Normalize("cpu").table, expected)
    # The lookup gives bitwise normalized's image, in either layout; bf16 is the float32
    # value rounded once, which is what autocast's cast at the first convolution gives.
    pixels = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    per_image = torch.stack([normalized(p) for p in pixels])
    plain = data.Normalize("cpu")(pixels)
    assert plain.dtype == torch.float32 and plain.is_contiguous() and torch.equal(plain, per_image)
    nhwc = data.Normalize("cpu", memory_format=torch.channels_last)(pixels)
    assert nhwc.is_contiguous(memory_format=torch.channels_last) and torch.equal(nhwc, per_image)
    bf16 = data.Normalize("cpu", torch.bfloat16, torch.channels_last)(pixels)
    assert bf16.dtype == torch.bfloat16 and bf16.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(bf16, per_image.to(torch.bfloat16))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_hands_over_bytes_and_the_model_gets_normalised_images(workers):
    args, env, train_set, test_set = small_sets(train=64, test=10)
    args.workers = workers  # 2: the bytes cross the workers' shared memory
    for dataset, loader in ((train_set, data.train_loader(train_set, 16, 16, env, args)),
                            (test_set, data.eval_loader(test_set, 4, env, args))):
        if dataset is train_set:
            loader.sampler.set_epoch(1)
        keys = list(loader.sampler)
        images, targets = next(iter(loader))
        assert images.dtype == torch.uint8 and images[0].nbytes + targets[0].nbytes == 3 * 32 * 32 + 8
        # What the model sees: each sample's crop and flip, normalised as conftest.normalized defines it.
        expected = torch.stack([normalized(dataset[key][0]) for key in keys[:len(images)]])
        for memory_format in (torch.contiguous_format, torch.channels_last):
            model_input = data.model_inputs(dataset, env.device, memory_format)(images)
            assert model_input.dtype == torch.float32 and torch.equal(model_input, expected)
            assert model_input.is_contiguous(memory_format=memory_format)
    # Any other data set: its batches as loaded, in the layout asked for.
    own = data.model_inputs(torch.utils.data.TensorDataset(torch.zeros(2, 3, 4, 4)), env.device, torch.channels_last)
    floats = torch.rand(2, 3, 4, 4)
    assert torch.equal(own(floats), floats) and own(floats).is_contiguous(memory_format=torch.channels_last)


def test_device_batches_are_the_loaders():
    args, env, train_set, _ = small_sets()
    loader = data.train_loader(train_set, 32, 32, env, args)
    on_device = device_data.DeviceTrainLoader(train_set, 32, 32, env, args)
    for epoch, start_step in ((0, 0), (1, 1)):  # a resumed epoch skips the same steps
        loader.sampler.set_epoch(epoch, start_step)
        on_device.sampler.set_epoch(epoch, start_step)
        pairs = list(zip(loader, on_device, strict=True))
        assert len(pairs) == 3 - start_step
        for (images, targets), (device_images, device_targets) in pairs:
            assert torch.equal(targets, device_targets)
            assert device_images.dtype == torch.uint8 and torch.equal(device_images, images)


def test_device_batches_are_each_ranks_of_cifar_files_cut_to_size(tmp_path):
    """CIFAR-100 in its real files, cut by --train-samples and --test-samples (a Subset), at world size 2: each
    rank's batches on the device are that rank's loader batches, training and evaluation."""
    import numpy as np
    from cifar_files import write_cifar100
    rng = np.random.default_rng(0)
    write_cifar100(tmp_path, rng.integers(0, 256, (40, 3, 32, 32), dtype=np.uint8), rng.integers(0, 100, 40),
                   rng.integers(0, 256, (12, 3, 32, 32), dtype=np.uint8), rng.integers(0, 100, 12))
    args = argparse.Namespace(dataset="cifar100", data_dir=str(tmp_path), train_samples=24, test_samples=7, seed=3,
                              workers=0, channels_last=False)
    for rank in range(2):
        env = DistEnv(rank, rank, 2, 2, torch.device("cpu"), distributed=False)
        train_set, test_set = data.build_datasets(args, env)
        assert isinstance(train_set.base, torch.utils.data.Subset) and len(train_set) == 24
        loader, on_device = data.train_loader(train_set, 4, 8, env, args), \
            device_data.DeviceTrainLoader(train_set, 4, 8, env, args)
        for epoch, start_step in ((0, 0), (1, 1)):
            loader.sampler.set_epoch(epoch, start_step)
            on_device.sampler.set_epoch(epoch, start_step)
            for (images, targets), (device_images, device_targets) in zip(loader, on_device, strict=True):
                assert torch.equal(device_targets, targets) and torch.equal(device_images, images)
        images, targets = (torch.cat(parts) for parts in zip(*device_data.DeviceEvalLoader(test_set, 3, env)))
        real = targets != metrics.PAD_TARGET
        loader_images, loader_targets = (torch.cat(parts) for parts in zip(*data.eval_loader(test_set, 3, env, args)))
        assert real.sum() == (4, 3)[rank] and torch.equal(targets[real], loader_targets)
        assert torch.equal(images[real], loader_images)


def test_device_evaluation_counts_every_sample_once():
    args, _, _, test_set = small_sets(test=11)
    shards = []
    for rank in range(3):  # 11 samples over 3 ranks: 4, 4 and 3, in batches of 3 (the last one filled up)
        env = DistEnv(rank, rank, 3, 3, torch.device("cpu"), distributed=False)
        batches = list(device_data.DeviceEvalLoader(test_set, 3, env))
        assert all(images.shape == (3, 3, 32, 32) for images, _ in batches)
        images, targets = (torch.cat(parts) for parts in zip(*batches))
        real = targets != metrics.PAD_TARGET
        shards.append(targets[real])
        # Each rank's own samples, image with label, as the loader gives that rank.
        loader_images, loader_targets = (torch.cat(parts) for parts in zip(*data.eval_loader(test_set, 3, env, args)))
        assert torch.equal(targets[real], loader_targets) and torch.equal(images[real], loader_images)
    assert [len(shard) for shard in shards] == [4, 4, 3]
    assert sorted(torch.cat(shards).tolist()) == sorted(test_set.base.targets)
    # evaluate() leaves the filling out: the same figures as the loader's variable-size batches.
    model = build_model("resnet_tiny", data.NUM_CLASSES).eval()
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), distributed=False)
    inputs = data.model_inputs(test_set, env.device)
    on_device = metrics.evaluate(model, device_data.DeviceEvalLoader(test_set, 4, env), env.device, inputs=inputs)
    reference = metrics.evaluate(model, data.eval_loader(test_set, 4, env, args), env.device, inputs=inputs)
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
