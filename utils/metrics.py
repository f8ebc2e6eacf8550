"""Meters, exact distributed evaluation, timing and peak memory. Meters keep running sums as tensors
on the device, read once per epoch (or --log-every steps): an .item() every step makes the CPU wait for the GPU."""
import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .distributed import all_reduce_sum, meeting

# cross_entropy's default ignore_index, the target of the filler in fixed-shape evaluation batches
# (utils/device_data.py): such samples add nothing to the loss, the hits or the count.
PAD_TARGET = -100
# What an epoch records when --eval-every skips its evaluation.
NOT_EVALUATED = {"test_loss": float("nan"), "test_acc1": float("nan"), "test_acc5": float("nan"), "test_samples": 0}


def sum_dtype(device) -> torch.dtype:
    """float64 keeps the running sums exact; Apple's MPS has no float64."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


class TrainMeter:
    """Training loss and top-1 accuracy summed on the device, and the gradient norms (--clip-grad-norm)."""

    def __init__(self, device, initial=None):
        self.sums = torch.zeros(3, dtype=sum_dtype(device), device=device)  # loss x samples, correct, samples
        self.norms = torch.zeros(2, dtype=self.sums.dtype, device=device)  # sum of the finite grad norms, count
        if initial is not None:  # partial sums of an epoch interrupted by a checkpoint
            initial = torch.tensor(initial, dtype=self.sums.dtype, device=device)
            self.sums += initial[:3]
            self.norms += initial[3:] if len(initial) == 5 else 0

    def update(self, loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor):
        # n enters as a kernel argument: a tensor made from it would be a copy that waits for the device.
        n = targets.numel()
        self.sums[0] += loss.to(self.sums.dtype) * n
        self.sums[1] += (logits.argmax(dim=1) == targets).sum()
        self.sums[2] += n

    def add_grad_norm(self, norm: torch.Tensor):
        # An fp16 step that overflowed (GradScaler skips it) has an infinite norm: left out of the mean.
        finite = torch.isfinite(norm)
        self.norms[0] += torch.where(finite, norm.to(self.norms.dtype), 0.0)
        self.norms[1] += finite

    def global_sums(self) -> list:
        """[loss x samples, correct, samples] over all ranks (an all-reduce the caller names), then this rank's
        [norm sum, count]: not summed, DDP's averaged gradient has the same norm on every rank."""
        return all_reduce_sum(self.sums.clone()).tolist() + self.norms.tolist()


def evaluation_due(epoch: int, args, last: bool) -> bool:
    """--eval-every N: every N-th epoch and the last (`last`: the run has trained all it was asked to); alike on
    all ranks (a collective). Not for a stop signal: the checkpoint waits for the evaluation, within the grace
    period the launcher gives, and the epoch's record would differ from an uninterrupted run's."""
    return last or (epoch + 1) % (getattr(args, "eval_every", None) or 1) == 0


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device, autocast=None, inputs=None) -> dict:
    """Exact evaluation over all ranks: each rank sums loss and hits over its shard, and one all-reduce gives the
    numbers of one process evaluating the whole test set. Pass the UNWRAPPED module: a DDP with its default buffer sync
    broadcasts rank 0's buffers in its first forward after training, which a rank with no batch never joins. Every rank
    evaluates with rank 0's buffers: each rank's last training forward updated its batch-norm statistics from its own
    slice of the batch; with the copy every shard is scored by the model that rank 0 checkpoints. Each rank gets its own
    buffers back afterwards (--verify-sync still shows what DDP left). inputs: the training loop's data.model_inputs
    (default: the batch as loaded, to `device`). PAD_TARGET samples are not counted."""
    distributed = dist.is_available() and dist.is_initialized()
    own_buffers = [b.detach().clone() for b in model.buffers()] if distributed else []
    with meeting("metrics.evaluate() (rank 0's buffers)"):  # all ranks, before any batch
        for buffer in model.buffers() if distributed else ():
            dist.broadcast(buffer, src=0)
    was_training = model.training
    model.eval()
    sums, classes = torch.zeros(4, dtype=sum_dtype(device), device=device), None  # sums: loss, top1, top5, count
    for images, targets in loader:
        images = inputs(images) if inputs is not None else images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with autocast() if autocast is not None else contextlib.nullcontext():
            logits = model(images)
        classes = logits.shape[1]
        loss = F.cross_entropy(logits.float(), targets, reduction="sum", ignore_index=PAD_TARGET)
        sums[0] += loss.to(sums.dtype)
        # Whether the target is the top logit, and among the top 5 (or all: topk would raise); never a PAD_TARGET.
        hits = logits.topk(min(5, classes), dim=1).indices.eq(targets.unsqueeze(1))
        sums[1] += hits[:, 0].sum()
        sums[2] += hits.any(dim=1).sum()
        sums[3] += targets.ne(PAD_TARGET).sum()
    loss_sum, top1, top5, count = all_reduce_sum(sums, "metrics.evaluate() (the sums)").tolist()
    model.train(was_training)
    for buffer, own in zip(model.buffers(), own_buffers):
        buffer.copy_(own)
    if not count:  # an empty test set: nothing was measured
        return dict(NOT_EVALUATED)
    # 5 classes or fewer: every target is in the top 5, NaN as for no evaluation (None: this rank saw no batch).
    top5 = 100.0 * top5 / count if classes is None or classes > 5 else float("nan")
    return {"test_loss": loss_sum / count, "test_acc1": 100.0 * top1 / count, "test_acc5": top5,
            "test_samples": int(count)}


def peak_memory_mb(device) -> dict:
    """Memory high-water marks since reset_peak_memory: allocated (what tensors held) and reserved (what
    the caching allocator took: what the device sees). None on the CPU and where no statistics are kept."""
    with contextlib.suppress(RuntimeError, NotImplementedError):
        if device.type != "cpu":
            return {"peak_memory_mb": torch.accelerator.max_memory_allocated(device) / 2**20,
                    "peak_reserved_mb": torch.accelerator.max_memory_reserved(device) / 2**20}
    return {"peak_memory_mb": None, "peak_reserved_mb": None}


def reset_peak_memory(device):
    with contextlib.suppress(RuntimeError, NotImplementedError):
        if device.type != "cpu":
            torch.accelerator.reset_peak_memory_stats(device)


class EpochTimer:
    """Wall time of an epoch and its throughput after warm-up. The first `warmup_steps` steps of each epoch (loader
    start, cudnn autotuning, torch.compile) are timed but left out of images/s. The clock is read at the start, at
    the warm-up boundary and at the end, each time after one device sync, never inside the other steps."""

    def __init__(self, device, images_per_step: int, steps: int):
        self.device, self.images_per_step = device, images_per_step
        self.warmup_steps, self.steps = min(10, steps // 4), 0
        self.start = self.after_warmup = self._now()

    def _now(self) -> float:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)  # wait for queued work: else the clock means nothing
        return time.perf_counter()

    def step(self):
        self.steps += 1
        if self.steps == self.warmup_steps:
            self.after_warmup = self._now()

    def stop(self) -> dict:
        end = self._now()
        skipped = self.warmup_steps if self.steps > self.warmup_steps else 0  # else the whole epoch is timed
        seconds = end - (self.after_warmup if skipped else self.start)
        return {"epoch_seconds": end - self.start,
                "images_per_second": (self.steps - skipped) * self.images_per_step / seconds if seconds > 0 else 0.0}
