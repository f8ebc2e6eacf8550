"""Gradient accumulation with DDP: same weights as one big batch, one all-reduce
per optimizer step, and distributed_gradient_accumulation.py end to end and resumed."""
import contextlib
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import (ROOT, SMALL, assert_refused, assert_same_training_state, free_port, keep_on_cpu, load_script,
                      max_difference, observing_entry, read_metrics, subprocess_env, torchrun, with_flag)
from models import build_model

SCRIPT = "distributed_gradient_accumulation.py"
WORLD_SIZE = 2
ACCUM_STEPS = 4
GLOBAL_BATCH = 16          # per optimizer step: 2 processes x 4 micro-batches x 2 images
OPTIMIZER_STEPS = 3
LR, MOMENTUM = 0.1, 0.9


def make_model():
    # No batch norm: its statistics depend on how the global batch is cut into
    # micro-batches, so only without it is accumulation exact up to rounding. (Group
    # norm with one channel per group is exact too, but its float32 rounding grows
    # fast from step to step.)
    torch.manual_seed(0)
    return build_model("resnet_tiny", 100, norm_layer=torch.nn.Identity)


def make_data():
    g = torch.Generator().manual_seed(1)
    images = torch.randn(OPTIMIZER_STEPS, GLOBAL_BATCH, 3, 32, 32, generator=g)
    targets = torch.randint(0, 100, (OPTIMIZER_STEPS, GLOBAL_BATCH), generator=g)
    return images, targets


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=5e-4)


def accumulate_step(ddp_model, optimizer, micro_batches, variant="script"):
    """One optimizer step over this rank's micro-batches, as the script takes it.

    The other variants are the mistakes the tests must be able to tell apart:
    "no_divide" forgets loss / k, "never_sync" keeps the last micro-batch inside
    no_sync too, "backward_only" puts only backward inside no_sync (the known bug).
    """
    k = len(micro_batches)
    for i, (images, targets) in enumerate(micro_batches):
        last = i == k - 1
        skip_sync = variant == "never_sync" or not last
        if variant == "backward_only":
            logits = ddp_model(images)
            with ddp_model.no_sync() if skip_sync else contextlib.nullcontext():
                (F.cross_entropy(logits, targets) / k).backward()
            continue
        with ddp_model.no_sync() if skip_sync else contextlib.nullcontext():
            loss = F.cross_entropy(ddp_model(images), targets)
            (loss if variant == "no_divide" else loss / k).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def my_micro_batches(images, targets, rank, k):
    """This rank's half of a global batch, cut into k micro-batches."""
    share = images.shape[0] // WORLD_SIZE
    mine = slice(rank * share, (rank + 1) * share)
    return list(zip(images[mine].chunk(k), targets[mine].chunk(k)))


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=60))
    try:
        images, targets = make_data()
        results = {}

        # Equivalence: final parameters of each variant after OPTIMIZER_STEPS steps.
        for variant in ("script", "no_divide", "never_sync"):
            ddp_model = DDP(make_model())
            optimizer = sgd(ddp_model)
            for step in range(OPTIMIZER_STEPS):
                accumulate_step(ddp_model, optimizer,
                                my_micro_batches(images[step], targets[step], rank, ACCUM_STEPS), variant)
            results[variant] = {k: v.detach().clone() for k, v in ddp_model.module.named_parameters()}

        # All-reduce count: a comm hook sees one call per gradient bucket all-reduced.
        calls = [0]

        def counting_allreduce(state, bucket):
            calls[0] += 1
            return default_hooks.allreduce_hook(state, bucket)

        # Small buckets, so that one backward pass all-reduces several of them.
        ddp_model = DDP(make_model(), bucket_cap_mb=0.05)
        ddp_model.register_comm_hook(None, counting_allreduce)
        optimizer = sgd(ddp_model)
        counts = {}
        # The first step lets DDP rebuild its buckets in the order gradients arrive;
        # measure from the second on.
        for name, k, variant in (("warmup", 1, "script"), ("k1", 1, "script"),
                                 ("k4", ACCUM_STEPS, "script"), ("k4_again", ACCUM_STEPS, "script"),
                                 ("k4_backward_only", ACCUM_STEPS, "backward_only")):
            calls[0] = 0
            accumulate_step(ddp_model, optimizer, my_micro_batches(images[0], targets[0], rank, k), variant)
            counts[name] = calls[0]
        results["counts"] = counts
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("accum")
    mp.start_processes(_worker, args=(free_port(), str(out_dir)), nprocs=WORLD_SIZE,
                       start_method="spawn", join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def big_batch_params():
    """One process, plain module, the whole global batch per step."""
    torch.set_num_threads(1)
    model = make_model()
    optimizer = sgd(model)
    images, targets = make_data()
    for step in range(OPTIMIZER_STEPS):
        F.cross_entropy(model(images[step]), targets[step]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_accumulation_with_no_sync_equals_one_big_batch(ddp_results, big_batch_params):
    start = make_model()
    moved = max_difference({k: v.detach() for k, v in start.named_parameters()}, big_batch_params)
    assert moved > 1e-3  # the steps changed the weights: equality below means something

    for rank in range(WORLD_SIZE):
        assert max_difference(ddp_results[rank]["script"], big_batch_params) < 1e-6, f"rank {rank}"


def test_mistakes_are_caught(ddp_results, big_batch_params):
    # Without loss / k the step is k times too large.
    assert max_difference(ddp_results[0]["no_divide"], big_batch_params) > 1e-3
    # Never leaving no_sync: each rank steps on its own half, the replicas drift apart.
    assert max_difference(ddp_results[0]["never_sync"], big_batch_params) > 1e-3
    assert max_difference(ddp_results[0]["never_sync"], ddp_results[1]["never_sync"]) > 1e-3


def test_one_all_reduce_per_optimizer_step(ddp_results):
    counts = ddp_results[0]["counts"]
    buckets_per_backward = counts["k1"]
    assert buckets_per_backward >= 2, counts  # bucket_cap_mb small enough to mean something
    assert counts["k4"] == buckets_per_backward, counts
    assert counts["k4_again"] == buckets_per_backward, counts
    # The known bug: forward outside no_sync still all-reduces every micro-batch.
    assert counts["k4_backward_only"] == ACCUM_STEPS * buckets_per_backward, counts
    assert ddp_results[1]["counts"] == counts


def test_script_accumulates_like_one_big_batch(tmp_path, monkeypatch):
    """The script's own loop, in this process: 4 micro-batches per step end the epoch
    with the weights and the train loss of distributed.py on the whole batch."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)  # one process, no process group
    keep_on_cpu(monkeypatch)  # the 1e-6 below is a CPU figure (see keep_on_cpu)
    flags = [*SMALL, "--warmup-epochs", "0"]  # the full learning rate from the first step
    load_script("distributed.py").main(
        [*flags, "--checkpoint-dir", str(tmp_path / "big"), "--metrics", str(tmp_path / "big.jsonl")])
    load_script(SCRIPT).main([*flags, "--accum-steps", "4", "--checkpoint-dir", str(tmp_path / "accum"),
                              "--metrics", str(tmp_path / "accum.jsonl")])

    big = torch.load(tmp_path / "big" / "checkpoint.pt", weights_only=True)
    accum = torch.load(tmp_path / "accum" / "checkpoint.pt", weights_only=True)
    torch.manual_seed(0)  # --seed 0: the scripts' initial weights
    initial = load_script(SCRIPT).build_model("resnet_tiny", 100).state_dict()
    assert max_difference(big["model"], initial) > 1e-3
    assert max_difference(accum["model"], big["model"]) < 1e-6
    assert accum["global_step"] == big["global_step"] == 256 // 32  # one scheduler step per optimizer step

    big_record, accum_record = read_metrics(tmp_path / "big.jsonl")[0], read_metrics(tmp_path / "accum.jsonl")[0]
    assert accum_record["accum_steps"] == 4 and accum_record["step"] == 8
    # The logged loss is the mean over micro-batches: the big batch's mean loss.
    assert accum_record["train_loss"] == pytest.approx(big_record["train_loss"], abs=1e-6)
    assert accum_record["lr"] == pytest.approx(big_record["lr"])


# DDP's gradient all-reduces, counted: a comm hook that does the default all-reduce and, after
# each backward's last bucket, writes how many backward passes have all-reduced to COUNT_DIR/RANK.
COUNT_ALL_REDUCES = """
    import os
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel
    init, synced = DistributedDataParallel.__init__, [0]
    def hook(group, bucket):
        if bucket.is_last():
            synced[0] += 1
            with open(os.path.join(os.environ["COUNT_DIR"], os.environ["RANK"]), "w") as out:
                out.write(str(synced[0]))
        return default_hooks.allreduce_hook(group, bucket)
    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_comm_hook(None, hook)
    DistributedDataParallel.__init__ = counting_init
    """


# Loader workers on, as users run the script.
TORCHRUN_ARGS = [SCRIPT, *with_flag(SMALL, "--workers", 1), "--accum-steps", "2"]


def counted_torchrun(tmp_path, name, args):
    """The script under torchrun, 2 processes, DDP's all-reduces counted into tmp_path/name-counts/."""
    count_dir = tmp_path / f"{name}-counts"
    count_dir.mkdir()
    proc = torchrun(2, observing_entry(tmp_path, COUNT_ALL_REDUCES), [*TORCHRUN_ARGS, *args], timeout=120,
                    env=subprocess_env(COUNT_DIR=str(count_dir)))
    return proc, count_dir


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """One uninterrupted epoch under torchrun, 2 processes x 2 micro-batches, checkpointed into ck/."""
    out = tmp_path_factory.mktemp("torchrun")
    proc, count_dir = counted_torchrun(out, "straight", ["--metrics", out / "metrics.jsonl", "--verify-sync",
                                                         "--checkpoint-dir", out / "ck"])
    return proc, count_dir, out


def test_torchrun_two_processes_end_to_end(two_process_run):
    """The script itself all-reduces once per optimizer step, not once per micro-batch."""
    proc, count_dir, out = two_process_run
    # 256 samples, 32 a step: 8 optimizer steps of 2 micro-batches, 16 backward passes.
    assert [(count_dir / rank).read_text() for rank in ("0", "1")] == ["8", "8"]
    # The replicas' parameters agree: only batch-norm running statistics (each rank's
    # own micro-batches) may differ. A missed all-reduce would list weights here.
    assert ("verify-sync: all parameters and buffers agree" in proc.stdout
            or "(batch-norm running statistics differ unless --sync-bn)" in proc.stdout), proc.stdout
    records = read_metrics(out / "metrics.jsonl")
    assert [r["event"] for r in records] == ["epoch", "end"]
    for record in records:
        assert record["strategy"] == "ddp-accum"
        assert record["accum_steps"] == 2
        assert record["world_size"] == 2
        assert record["global_batch"] == 32
        assert record["step"] == 256 // 32
        assert record["epoch_complete"] is True
        assert record["test_samples"] == 100
        assert 0 < record["train_loss"] < 10


def test_torchrun_resume_continues_with_the_exact_next_batch(two_process_run, tmp_path):
    """Stopped mid-epoch (--max-steps 3 of 8) and resumed into the same --checkpoint-dir: the weights,
    optimizer and schedule of the uninterrupted run, bitwise. The same entry point as that run (its
    all-reduce hook counts), so that nothing but the interruption differs."""
    *_, straight = two_process_run
    ck = tmp_path / "ck"
    counted_torchrun(tmp_path, "first", ["--max-steps", "3", "--checkpoint-dir", ck])
    saved = torch.load(ck / "checkpoint.pt", weights_only=True)
    assert (saved["epoch"], saved["step_in_epoch"], saved["global_step"]) == (0, 3, 3)  # stopped mid-epoch
    proc, count_dir = counted_torchrun(tmp_path, "resumed", ["--checkpoint-dir", ck, "--resume"])
    assert proc.stdout.count(f"resumed from {ck / 'checkpoint.pt'}: epoch 1, step 3 of 8") == 1, proc.stdout
    # The 5 steps left, each of 2 micro-batches and one all-reduce.
    assert [(count_dir / rank).read_text() for rank in ("0", "1")] == ["5", "5"]
    assert_same_training_state(straight / "ck" / "checkpoint.pt", ck / "checkpoint.pt", global_step=8)


# The model built without batch norm, whose statistics depend on how a rank's share is cut into micro-batches
# (with it, accumulation is not the big batch).
WITHOUT_BATCH_NORM = """
    import models, torch
    build = models.build_model
    models.build_model = lambda name, classes: build(name, classes, norm_layer=torch.nn.Identity)
    """


def test_two_processes_accumulate_like_distributed_py(tmp_path):
    """At 2 processes, 2 micro-batches each: the weights of distributed.py's whole batches at 2 processes
    (loader workers on, across an epoch's end). The micro-batches of both ranks make up distributed.py's
    global batch, the loss is divided by k, the last micro-batch all-reduces. (No --clip-grad-norm: a clip on every
    step would hide a loss not divided by k. It is tested with accumulation in tests/test_clip_grad.py.)"""
    runner = observing_entry(tmp_path, WITHOUT_BATCH_NORM)
    # 128 samples, 32 a step: 4 steps an epoch, 6 in all
    flags = [*with_flag(with_flag(SMALL, "--workers", 2), "--train-samples", 128), "--epochs", "2",
             "--max-steps", "6", "--warmup-epochs", "0"]
    for name, script, extra in (("big", "distributed.py", []), ("accum", SCRIPT, ["--accum-steps", "2"])):
        torchrun(2, runner, [ROOT / script, *flags, *extra, "--checkpoint-dir", tmp_path / name], timeout=180)
    big, accum = (torch.load(tmp_path / name / "checkpoint.pt", weights_only=True) for name in ("big", "accum"))
    assert accum["global_step"] == big["global_step"] == 6 and accum["config"]["accum_steps"] == 2
    torch.manual_seed(0)  # --seed 0: the scripts' initial weights
    initial = build_model("resnet_tiny", 100, norm_layer=torch.nn.Identity).state_dict()
    assert max_difference(big["model"], initial) > 1e-3
    worst = max_difference(accum["model"], big["model"])
    print(f"largest difference {worst:.3g}")
    assert worst < 1e-6
    assert max_difference(accum["optimizer"]["state"], big["optimizer"]["state"]) < 1e-6


def test_batch_not_divisible_by_accumulation_is_a_usage_error(run_in_process):
    assert_refused(run_in_process(SCRIPT, [*SMALL, "--batch-size", "30", "--accum-steps", "4"]),
                   "batch size 30 is not divisible by 1 process x 4 accumulation steps", "e.g. 28")
