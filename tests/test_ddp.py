"""DistributedDataParallel on CPU processes (gloo), started with torch.multiprocessing:
N processes train the same problem as one process on the global batch, and
evaluation counts every test sample exactly once whatever the world size."""
import os
import re
import time

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from conftest import free_port, group_norm, normalized
from models import build_model
from utils import compat, data, metrics
from utils import distributed as dist_utils
from utils.distributed import DistEnv

STEPS, GLOBAL_BATCH, LR, MOMENTUM, WEIGHT_DECAY = 3, 8, 0.1, 0.9, 5e-4
TEST_SAMPLES, EVAL_BATCH = 101, 11  # 101 over 3 ranks: shards of 34, 34, 33; 4, 4 and 3 batches


def spawn(worker, nprocs, args, timeout=180):
    """mp.spawn with a deadline: a hung collective fails the test instead of the suite."""
    context = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{nprocs} processes still running after {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def join_group(rank, world_size, port):
    # CPU tests: gloo even on a machine with GPUs (one GPU could not host two ranks).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    job = dist_utils.DistEnv(rank, rank, world_size, world_size, distributed=True, init_method=f"tcp://127.0.0.1:{port}")
    env = dist_utils.setup(job, torch.device("cpu"), timeout_s=120)
    assert env.device.type == "cpu" and torch.distributed.get_backend() == "gloo"
    return env


def global_batches():
    g = torch.Generator().manual_seed(42)
    return [(torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=g), torch.randint(0, 100, (GLOBAL_BATCH,), generator=g))
            for _ in range(STEPS)]


def new_model_and_optimizer():
    torch.manual_seed(0)
    model = build_model("resnet_tiny", 100, norm_layer=group_norm)  # no batch statistics to depend on the split
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    return model, optimizer


def train(model, optimizer, batches, rank=0, world_size=1):
    per_device = GLOBAL_BATCH // world_size
    for images, targets in batches:
        mine = slice(rank * per_device, (rank + 1) * per_device)
        loss = F.cross_entropy(model(images[mine]), targets[mine])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _ddp_worker(rank, world_size, port, out_dir):
    env = join_group(rank, world_size, port)
    try:
        model, optimizer = new_model_and_optimizer()
        ddp_model = nn.parallel.DistributedDataParallel(model)
        train(ddp_model, optimizer, global_batches(), rank, world_size)
        torch.save(model.state_dict(), os.path.join(out_dir, f"rank{env.rank}.pt"))
    finally:
        dist_utils.cleanup()


def test_ddp_two_processes_equal_one_process_on_the_global_batch(tmp_path):
    spawn(_ddp_worker, 2, (2, free_port(), str(tmp_path)))

    model, optimizer = new_model_and_optimizer()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, optimizer, global_batches())
    single = model.state_dict()

    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert rank0.keys() == single.keys()
    for name, expected in single.items():
        assert torch.equal(rank0[name], rank1[name]), f"replicas differ in {name}"
        assert torch.allclose(rank0[name], expected, rtol=0, atol=1e-6), \
            f"{name}: max difference {(rank0[name] - expected).abs().max():.3g}"
    # The steps moved the weights far more than the tolerance: the comparison means something.
    moved = max((single[k] - initial[k]).abs().max().item() for k in single)
    assert moved > 1e-3


# --- exact evaluation ---------------------------------------------------------------------

def exemplar_classifier(test_set) -> nn.Module:
    """A linear classifier whose row c is the test image of class c for c < 50: about
    half the test set is classified right, so accuracy equality is not 0 == 0."""
    images = torch.stack([normalized(test_set[i][0]) for i in range(50)]).flatten(1)
    linear = nn.Linear(images.shape[1], 100)
    with torch.no_grad():
        linear.weight.zero_()
        linear.weight[:50] = images
        linear.bias.zero_()
    return nn.Sequential(nn.Flatten(), linear)


def evaluate_all(env):
    """(resnet_tiny, exemplar classifier) metrics on the first 101 synthetic test images."""
    test_set = data.TestImages(data.SyntheticCIFAR(False, TEST_SAMPLES))
    args = type("Args", (), {"workers": 0})()
    loader = data.eval_loader(test_set, EVAL_BATCH, env, args)
    torch.manual_seed(0)
    resnet = build_model("resnet_tiny", 100)
    # As after DDP training: same weights everywhere, but batch-norm running statistics
    # that each rank updated from its own slice. Evaluation must use rank 0's.
    drifted = build_model("resnet_tiny", 100)
    drifted.load_state_dict(resnet.state_dict())
    own = {}
    for name, buffer in drifted.named_buffers():
        if name.endswith("running_mean"):
            buffer.add_(0.5 * env.rank + 0.1)
            own[name] = buffer.clone()
    results = [metrics.evaluate(model, loader, env.device, inputs=data.model_inputs(test_set, env.device))
               for model in (resnet, exemplar_classifier(test_set), drifted)]
    for name, buffer in drifted.named_buffers():  # evaluation left the rank's own buffers alone
        if name in own:
            assert torch.equal(buffer, own[name]), name
    return results


def _eval_worker(rank, world_size, port, out_dir):
    env = join_group(rank, world_size, port)
    try:
        local_batches = len(data.eval_loader(data.TestImages(data.SyntheticCIFAR(False, TEST_SAMPLES)),
                                             EVAL_BATCH, env, type("Args", (), {"workers": 0})()))
        torch.save({"results": evaluate_all(env), "local_batches": local_batches},
                   os.path.join(out_dir, f"eval{rank}.pt"))
    finally:
        dist_utils.cleanup()


def test_evaluation_over_three_processes_is_exact(tmp_path):
    spawn(_eval_worker, 3, (3, free_port(), str(tmp_path)))
    single = evaluate_all(DistEnv(0, 0, 1, 1, torch.device("cpu"), False))
    assert [r["test_samples"] for r in single] == [TEST_SAMPLES] * 3
    assert 30 <= single[1]["test_acc1"] < 100  # the exemplar model is right about half the time

    per_rank = [torch.load(tmp_path / f"eval{rank}.pt", weights_only=True) for rank in range(3)]
    assert [r["local_batches"] for r in per_rank] == [4, 4, 3]  # uneven shards did not hang
    for rank in per_rank:
        for got, expected in zip(rank["results"], single):
            assert got["test_samples"] == TEST_SAMPLES  # 34 + 34 + 33, no padding duplicates
            assert got["test_acc1"] == expected["test_acc1"]
            assert got["test_acc5"] == expected["test_acc5"]
            assert got["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-6, abs=1e-6)


# --- batch-norm buffers under DDP ------------------------------------------------------------

def _buffers_worker(rank, world_size, port, out_dir):
    import warnings
    env = join_group(rank, world_size, port)
    try:
        torch.manual_seed(0)
        model = build_model("resnet_tiny", 10)
        with torch.no_grad():  # each rank's own statistics, as if it had trained alone
            for name, buffer in model.named_buffers():
                if name.endswith("running_mean"):
                    buffer.add_(float(rank + 1))
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # the current flag, on every version
            ddp_model = nn.parallel.DistributedDataParallel(model, **compat.buffers_synced_once(model))
        after_wrap = {k: v.clone() for k, v in model.named_buffers()}
        ddp_model.train()
        ddp_model(torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(rank)))
        ddp_model.eval()  # a forward that changes no statistic: a broadcast before it would show
        with torch.no_grad():
            ddp_model(torch.randn(2, 3, 32, 32))
        torch.save({"after_wrap": after_wrap, "after_forwards": dict(model.named_buffers())},
                   os.path.join(out_dir, f"buffers{rank}.pt"))
    finally:
        dist_utils.cleanup()


def test_rank_0s_buffers_reach_every_rank_once_when_wrapped_and_never_before_a_forward(tmp_path):
    """What the scripts' buffers_synced_once gives on every PyTorch version: PyTorch 2.13
    renamed DDP's broadcast_buffers to forward_sync_buffers, and the old name's False also
    skipped the broadcast of buffers when wrapping, the new one's does not."""
    spawn(_buffers_worker, 2, (2, free_port(), str(tmp_path)))
    rank0, rank1 = (torch.load(tmp_path / f"buffers{r}.pt", weights_only=True) for r in (0, 1))
    means = [name for name in rank0["after_wrap"] if name.endswith("running_mean")]
    assert means
    for name in rank0["after_wrap"]:
        assert torch.equal(rank0["after_wrap"][name], rank1["after_wrap"][name]), name
    torch.manual_seed(0)
    fresh = dict(build_model("resnet_tiny", 10).named_buffers())
    assert all(torch.equal(rank0["after_wrap"][name], fresh[name] + 1) for name in means)  # rank 0's
    # Each rank's training forward moved its own statistics, and nothing made them equal again.
    assert all(not torch.equal(rank0["after_forwards"][name], rank1["after_forwards"][name]) for name in means)


def _verify_sync_worker(rank, world_size, port, out_dir):
    import contextlib
    import io

    from utils import replicas
    join_group(rank, world_size, port)
    try:
        model = nn.Linear(2, 2)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[float("nan"), 1.0], [2.0, float("inf")]]))  # alike on both ranks
            model.bias.copy_(torch.tensor([0.0, float(rank)]))  # rank 1's differs
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            replicas.verify_sync(model)
            with torch.no_grad():
                model.bias.zero_()
            replicas.verify_sync(model)
        with open(os.path.join(out_dir, f"said{rank}.txt"), "w") as f:
            f.write(printed.getvalue())
    finally:
        dist_utils.cleanup()


def test_verify_sync_names_what_differs_and_takes_nan_on_every_rank_for_agreement(tmp_path):
    """Weights that diverged to NaN alike on every rank are in sync (torch.equal calls NaN unequal to
    itself); a tensor that one rank holds otherwise is named."""
    spawn(_verify_sync_worker, 2, (2, free_port(), str(tmp_path)))
    assert (tmp_path / "said0.txt").read_text().splitlines() == [
        "verify-sync: 1 tensors differ across 2 ranks: bias",
        "verify-sync: all parameters and buffers agree across 2 ranks"]
    assert (tmp_path / "said1.txt").read_text() == ""  # rank 0 speaks for all


def _grad_layout_worker(rank, world_size, port, out_dir, device, channels_last):
    """A DDP model compiled as the scripts compile it (bf16 autocast on a GPU), trained 2 steps:
    the layout of every gradient as it reaches AccumulateGrad (a hook on each parameter), and
    DDP's "Grad strides" warning. On a GPU ResNet-18 itself: Inductor's GPU heuristic leaves a
    model of at most 64 channels (resnet_tiny) in NCHW."""
    import warnings
    if device == "cpu":
        env = join_group(rank, world_size, port)
    else:  # NCCL on one GPU
        job = DistEnv(rank, rank, world_size, world_size, distributed=True, init_method=f"tcp://127.0.0.1:{port}")
        env = dist_utils.setup(job, torch.device("cuda", rank), timeout_s=120)
    try:
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        torch.manual_seed(0)
        model = build_model("resnet_tiny" if device == "cpu" else "resnet18", 10)
        model = model.to(env.device, memory_format=memory_format)
        arrived = []  # a hook that returns None leaves the gradient as it is
        for name, param in model.named_parameters():
            param.register_hook(lambda grad, name=name, param=param:
                                arrived.append((name, tuple(grad.shape), grad.stride(), param.stride())))
        ddp_model = torch.compile(nn.parallel.DistributedDataParallel(model, device_ids=env.device_ids,
                                                                      gradient_as_bucket_view=True))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for images, targets in global_batches()[:2]:
                images = images.to(env.device, memory_format=memory_format)
                with torch.autocast(env.device.type, torch.bfloat16, enabled=device == "cuda"):
                    loss = F.cross_entropy(ddp_model(images), targets.to(env.device) % 10)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        torch.save({"arrived": arrived, "params": len(list(model.parameters())),
                    "warnings": [str(w.message) for w in caught if "Grad strides" in str(w.message)]},
                   os.path.join(out_dir, "layouts.pt"))
    finally:
        dist_utils.cleanup()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
def test_compiled_ddp_gradients_and_the_grad_strides_warning(tmp_path, record_property, device, channels_last):
    """--compile computes convolutions in channels_last (Inductor's layout optimization: on the
    CPU always, on GPUs by a heuristic). For an NCHW model its weight gradients then come back
    in another memory order than their parameters', and autograd copies each into the
    parameter's layout on every step (grad_layout_contract.h, whose rule decides the copy
    that this test infers from each gradient's strides); a 1x1 kernel's gradient is the same
    memory order with other strides on its size-1 dimensions, which autograd's contract
    ignores and DDP's check does not: its "Grad strides do not match bucket view strides",
    a warning about no copy of its own. With --channels-last nothing is copied or warned.
    On a GPU what the heuristic chose is recorded, and only the rules are asserted."""
    spawn(_grad_layout_worker, 1, (1, free_port(), str(tmp_path), device, channels_last), timeout=600)
    result = torch.load(tmp_path / "layouts.pt", weights_only=True)
    assert len(result["arrived"]) == 2 * result["params"]  # every gradient of both steps was seen
    copied, renamed = set(), set()  # other memory order; same order, other strides on size-1 dims
    for name, shape, grad_stride, param_stride in result["arrived"]:
        differ = [d for d in range(len(shape)) if grad_stride[d] != param_stride[d]]
        if any(shape[d] != 1 or grad_stride[d] == 0 for d in differ):
            copied.add(name)
        elif differ:
            renamed.add(name)
    record_property("copied_by_autograd", sorted(copied))
    record_property("grad_strides_warning", result["warnings"])
    for message in result["warnings"]:  # what DDP printed: only size-1 dimensions differ
        sizes, grad_stride, _, view_stride = ([int(n) for n in m.split(",")]
                                              for m in re.findall(r"= \[([\d, ]+)\]", message))
        assert all(sizes[d] == 1 for d in range(len(sizes)) if grad_stride[d] != view_stride[d]), message
    shortcuts = {name for name, shape, *_ in result["arrived"] if len(shape) == 4 and shape[2:] == (1, 1)}
    kernels = {name for name, shape, *_ in result["arrived"] if len(shape) == 4 and shape[2:] != (1, 1)}
    if channels_last:
        assert not copied and not renamed and not result["warnings"], (copied, renamed)
    elif device == "cpu":  # what lesson 03 says, seen here: every kernel larger than 1x1 copied
        assert copied == kernels and renamed == shortcuts and result["warnings"], (copied, renamed)
    else:  # only convolution weights may arrive in another layout
        assert copied <= kernels and renamed <= shortcuts, (copied, renamed)
