"""On a GPU: --data-on-gpu's batches against the loader's, and exact evaluation on the
device. Skipped without CUDA (conftest.py); `make gpu-check` runs them.

The batches are compared bitwise: the crop and flip are integer gathers and the
normalisation a lookup in a table computed on the CPU, so nothing in them depends on
the GPU's arithmetic. Evaluation figures are compared to float32 rounding where the
model runs (the device's convolutions may sum in another order than the CPU's), and
exactly where they are counts.
"""
import argparse

import pytest
import torch

from conftest import normalized
from models import build_model
from utils import data, device_data, metrics
from utils.distributed import DistEnv

pytestmark = pytest.mark.gpu


def sets(train=256, test=101):
    args = argparse.Namespace(dataset="synthetic", train_samples=train, test_samples=test, seed=5, workers=0)
    train_set, test_set = data.build_datasets(args, DistEnv(0, 0, 1, 1, torch.device("cpu"), distributed=False))
    return args, train_set, test_set


def cuda_env(rank=0, world_size=1):
    return DistEnv(rank, 0, world_size, 1, torch.device("cuda", 0), distributed=False)


def test_lookup_on_the_gpu_gives_the_cpu_formula(record_property):
    every_byte = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 3, 16, 16)
    cpu = normalized(every_byte[0]).unsqueeze(0)
    looked_up = data.Normalize(torch.device("cuda"))(every_byte)  # copied to the GPU, looked up there
    assert torch.equal(looked_up.cpu(), cpu)
    # What the formula itself gives on the GPU, for the record (CUDA divides by a constant
    # as a multiply by its reciprocal): the reason the table exists.
    mean = torch.tensor(data.CIFAR100_MEAN, device="cuda").view(3, 1, 1)
    std = torch.tensor(data.CIFAR100_STD, device="cuda").view(3, 1, 1)
    on_gpu = (every_byte[0].cuda().float() / 255 - mean) / std
    record_property("bytes_x_channels_where_the_gpu_formula_differs", int((on_gpu.cpu() != cpu[0]).sum()))


@pytest.mark.parametrize("channels_last, dtype", [(False, None), (True, None), (True, torch.bfloat16)])
def test_device_batches_are_the_loaders(channels_last, dtype):
    args, train_set, _ = sets()
    cpu_env = DistEnv(0, 0, 1, 1, torch.device("cpu"), distributed=False)
    loader = data.train_loader(train_set, 64, 64, cpu_env, args)
    on_device = device_data.DeviceTrainLoader(train_set, 64, 64, cuda_env(), args)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    to_model = data.model_inputs(train_set, torch.device("cuda", 0), memory_format, dtype)
    on_cpu = data.model_inputs(train_set, torch.device("cpu"), memory_format, dtype)
    for epoch, start_step in ((0, 0), (3, 2)):
        loader.sampler.set_epoch(epoch, start_step)
        on_device.sampler.set_epoch(epoch, start_step)
        pairs = list(zip(loader, on_device, strict=True))
        assert len(pairs) == 4 - start_step
        for (images, targets), (device_images, device_targets) in pairs:
            assert device_images.device.type == "cuda" and device_images.dtype == torch.uint8
            assert torch.equal(device_targets.cpu(), targets)
            assert torch.equal(device_images.cpu(), images)
            # What the model gets from either path: the CPU's values, in its dtype and layout.
            model_input = to_model(device_images)
            assert model_input.dtype == (dtype or torch.float32)
            assert model_input.is_contiguous(memory_format=memory_format)
            assert torch.equal(model_input.cpu(), on_cpu(images))
            assert torch.equal(to_model(images), model_input)


@pytest.mark.parametrize("world_size", [1, 3])
def test_evaluation_on_the_device_counts_every_sample_once(world_size, record_property):
    args, _, test_set = sets()
    torch.manual_seed(0)
    model = build_model("resnet_tiny", data.NUM_CLASSES).cuda().eval()
    cpu_env = DistEnv(0, 0, 1, 1, torch.device("cpu"), distributed=False)
    reference = metrics.evaluate(model.cpu(), data.eval_loader(test_set, 32, cpu_env, args), cpu_env.device,
                                 inputs=data.model_inputs(test_set, cpu_env.device))
    model.cuda()
    # The shards of `world_size` ranks, each evaluated in fixed-shape batches on the GPU; a
    # process group would all-reduce these sums, which is what adding them does here.
    sums = {"test_samples": 0, "top1": 0.0, "loss": 0.0}
    for rank in range(world_size):
        shard = metrics.evaluate(model, device_data.DeviceEvalLoader(test_set, 32, cuda_env(rank, world_size)),
                                 torch.device("cuda", 0), inputs=data.model_inputs(test_set, torch.device("cuda", 0)))
        sums["test_samples"] += shard["test_samples"]
        sums["top1"] += shard["test_acc1"] * shard["test_samples"] / 100
        sums["loss"] += shard["test_loss"] * shard["test_samples"]
    assert sums["test_samples"] == reference["test_samples"] == 101
    loss = sums["loss"] / sums["test_samples"]
    record_property("test_loss_gpu_minus_cpu", loss - reference["test_loss"])
    assert loss == pytest.approx(reference["test_loss"], rel=1e-4)
    # A top-1 hit can only flip where two logits tie to within float32 rounding.
    assert abs(round(sums["top1"]) - reference["test_acc1"] * 101 / 100) <= 1


def test_bf16_evaluation_with_autocast_and_channels_last():
    args, _, test_set = sets()
    torch.manual_seed(0)
    model = build_model("resnet_tiny", data.NUM_CLASSES).cuda().to(memory_format=torch.channels_last)

    def autocast():
        return torch.amp.autocast("cuda", dtype=torch.bfloat16)

    cuda = torch.device("cuda", 0)
    # The fast path hands the model bf16 images; the loader here float32 ones, which autocast casts.
    on_device = metrics.evaluate(model, device_data.DeviceEvalLoader(test_set, 32, cuda_env()), cuda,
                                 autocast=autocast,
                                 inputs=data.model_inputs(test_set, cuda, torch.channels_last, torch.bfloat16))
    loader = data.eval_loader(test_set, 32, DistEnv(0, 0, 1, 1, cuda, distributed=False), args)
    template = metrics.evaluate(model, loader, cuda, autocast=autocast,
                                inputs=data.model_inputs(test_set, cuda, torch.channels_last))
    assert on_device["test_samples"] == template["test_samples"] == 101
    # The same bf16 images (the table's rounding is autocast's): equal up to kernel choice.
    assert on_device["test_loss"] == pytest.approx(template["test_loss"], rel=1e-2)
