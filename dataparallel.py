r"""Train a CIFAR ResNet with nn.DataParallel: one process drives all the GPUs.

At every step DataParallel copies the model to each GPU, splits the batch over
them, runs the copies in parallel threads and gathers the outputs on the first
GPU. It is the shortest way to use several GPUs and the slowest (see "why
DistributedDataParallel is faster" below). It is for CUDA GPUs (NVIDIA's, or
AMD's under ROCm) by nature; without them, or with --device cpu, the plain
module trains on the CPU.

    # all visible GPUs (or the CPU)
    python dataparallel.py --dataset synthetic --epochs 1

    # GPUs 0 to 3, mixed precision in bfloat16
    python dataparallel.py --gpus 0,1,2,3 --batch-size 512 --amp bf16

--batch-size is the global batch: the one process loads all of it and
DataParallel hands each of the N GPUs batch-size / N.

Unlike its siblings, this script is not distributed.py plus a few lines: one
process, no process group, a list of GPUs instead of one GPU per process, and
autocast inside each GPU's thread. What it shares with them (data, evaluation,
checkpoints, metrics) is the same code in utils/.
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import MODEL_NAMES, build_model
from utils import cli, data, distributed as dist_utils, lifecycle, metrics, precision, schedule
from utils.run import TrainingRun, validated

# --- why DistributedDataParallel is faster --------------------------------------------
# DataParallel is one Python process. At every step it
#   - copies the weights and buffers from the first GPU to every other GPU (the copies
#     live for one forward pass only);
#   - launches every GPU's kernels from threads of that one process, which take turns
#     holding the GIL: one CPU core has to keep all the GPUs fed;
#   - gathers the outputs on the first GPU, computes the loss there and, in backward,
#     sums every gradient there too; the first GPU does more work and holds more memory
#     than the others, and runs the optimizer step alone;
#   - keeps batch-norm running statistics from the first GPU's copy only; the others'
#     updates are thrown away with the copies.
# DistributedDataParallel (distributed.py) runs one process per GPU: the weights are
# copied once at the start, gradients are all-reduced in buckets while backward is still
# running, and every GPU does the same work.



def main(argv=None):
    # --- arguments --------------------------------------------------------------------
    parser = cli.build_parser(__doc__, MODEL_NAMES)
    g = parser.add_argument_group("dataparallel")
    g.add_argument("--gpus", "--gpu", type=gpu_list, default=None, metavar="IDS",
                   help="GPU ids separated by commas, e.g. 0,1,2,3; without it, every visible GPU")
    g.add_argument("--amp", choices=sorted(precision.AMP_DTYPES), default=None,
                   help="mixed precision with torch.amp autocast; without it, float32")
    args = cli.parse_args(parser, argv)
    plan = validated(args, check)  # every refusal before anything starts; --check-args ends here

    # --- devices ----------------------------------------------------------------------
    # One process and no process group: DataParallel threads the GPUs of this process.
    device_ids = plan.device_ids
    device = torch.device("cuda", device_ids[0]) if device_ids else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the replicas are copied from, and gathered on, this GPU
    env = dist_utils.DistEnv(0, 0, 1, 1, device, distributed=False)
    train(args, env, plan.per_process_batch, device_ids, plan.amp_dtype)


def check(args) -> cli.Plan:
    """Bad input, refused in one line (UsageError) before anything starts. --check-args
    runs exactly this."""
    device_ids = pick_gpus(args.gpus, args.device)
    device_type = "cuda" if device_ids else "cpu"
    # Started by torchrun (WORLD_SIZE: a launcher's, as the other scripts read it) or torch.distributed.launch
    # (--local-rank), N copies would each train the whole run on every GPU, into the same files.
    if args.local_rank is not None or "WORLD_SIZE" in os.environ:
        raise cli.UsageError("this script is one process that no launcher starts (it drives every GPU itself): "
                             "run it with plain python, without torchrun or --local-rank")
    if cli.given(args, "dist_timeout"):
        raise cli.UsageError("--dist-timeout bounds a wait for another process; this script is one process "
                             "and joins no process group: leave it out")
    cli.check_flags(args)
    # DataParallel splits the batch as Tensor.chunk does: 130 over 4 GPUs is 33, 33, 33 and 31, and a
    # batch-norm layer sees other slices than DDP's 4 processes would. An even split, or refused.
    cli.split_batch(args.batch_size, max(len(device_ids), 1), unit="GPU")
    return cli.Plan(1, device_ids=device_ids,
                    amp_dtype=precision.autocast_dtype(args.amp, device_type) if args.amp else None,  # None: fp32
                    per_process_batch=args.batch_size)  # all of it: DataParallel splits it


def train(args, env, per_process_batch, device_ids, amp_dtype):
    dist_utils.seed_everything(args.seed)
    # The input shape never changes: cudnn times its convolution algorithms once, keeps the fastest.
    torch.backends.cudnn.benchmark = env.device.type == "cuda"

    # --- data -------------------------------------------------------------------------
    train_set, test_set = data.build_datasets(args, env)
    train_loader = data.train_loader(train_set, per_process_batch, args.batch_size, env, args)
    test_loader = data.eval_loader(test_set, 2 * per_process_batch, env, args)
    steps_per_epoch = data.steps_per_epoch(len(train_set), args.batch_size)

    # --- model ------------------------------------------------------------------------
    model = build_model(args.model, data.num_classes(train_set)).to(env.device)
    # Our CIFAR batches come as bytes (a quarter of float32's, through the workers' shared memory
    # and to the device) and are normalised there; your own data's go there as loaded.
    # The device is the first GPU: DataParallel scatters the batch from there.
    to_model = data.model_inputs(train_set, env.device)
    forward_model = AutocastForward(model, env.device.type, amp_dtype) if amp_dtype else model
    if device_ids:
        # Every forward: scatter the batch over device_ids, copy the model to each GPU,
        # run the copies in threads, gather the outputs on device_ids[0].
        dp_model = nn.DataParallel(forward_model, device_ids=device_ids)
    else:
        dist_utils.print0("no GPU visible: training the plain module on the CPU (DataParallel needs GPUs)")
        dp_model = forward_model

    # --- optimizer --------------------------------------------------------------------
    # Linear scaling (Goyal et al., 2017): --lr is the rate for 128 samples a step, the recipe's batch.
    lr = args.lr * args.batch_size / 128
    # fused on accelerators: one kernel does the whole update; the default runs several (foreach on CUDA).
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, nesterov=args.nesterov,
                                weight_decay=args.weight_decay, fused=True if env.device.type != "cpu" else None)
    scheduler = schedule.warmup_multistep(optimizer, args, steps_per_epoch)
    # float16 gradients can underflow to zero: the scaler multiplies the loss before backward
    # and divides the gradients before the step. bfloat16 has float32's range: no scaler.
    scaler = torch.amp.GradScaler(env.device.type, enabled=amp_dtype == torch.float16)
    if scaler.is_enabled() and args.momentum:
        # torch's fused SGD makes its momentum with empty_like at its first step and keeps it when the scaler
        # skips that step (an fp16 overflow): garbage in every later step. From zeros, the same first step.
        for p in model.parameters():
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    run = TrainingRun(args, env, model, optimizer, scheduler, train_size=len(train_set),
                      strategy="dataparallel", scaler=scaler,  # resumes here with --resume
                      extra_record={"gpus": len(device_ids), "amp": args.amp or "fp32"})

    # --- training loop ----------------------------------------------------------------
    for epoch in run.epochs():
        # A new shuffle every epoch; without set_epoch every epoch repeats the first order.
        # start_step (DistributedSampler has none): a resumed epoch goes on at its next batch.
        train_loader.sampler.set_epoch(epoch, start_step=run.step_in_epoch)
        dp_model.train()
        for images, targets in run.progress(train_loader):
            images = to_model(images)  # to the device (non-blocking: from pinned memory)
            targets = targets.to(env.device, non_blocking=True)
            logits = dp_model(images)  # gathered on the first GPU
            loss = F.cross_entropy(logits.float(), targets)  # float32 loss, as autocast would
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # gradients of every copy are summed on the first GPU
            if args.clip_grad_norm is not None:
                scaler.unscale_(optimizer)  # the true gradients, before their norm is measured
                run.clip_grad_norm(model.parameters())
            scaler.step(optimizer)  # skipped if float16 gradients overflowed
            scaler.update()
            scheduler.step()
            run.meter.update(loss.detach(), logits.detach(), targets)
            if run.step_done():  # counts the step, checkpoints when due; True when training ends
                break
        # Evaluate forward_model (with --amp, under autocast), not DataParallel, on the first GPU: exact, see
        # metrics.evaluate.
        run.end_epoch(metrics.evaluate(forward_model, test_loader, env.device, inputs=to_model))
    run.finish()


# --- helpers --------------------------------------------------------------------------

class AutocastForward(nn.Module):
    """Runs the wrapped module's forward under torch.amp.autocast.

    Autocast is thread-local, and DataParallel runs each GPU's copy of the model in a
    thread of its own. It carries over only whether autocast is on, not the dtype, so an
    autocast(dtype=bfloat16) around dp_model(images) would leave the copies running in
    float16, CUDA's default (parallel_apply.py, 2.11 and 2.14). Entering autocast inside
    forward applies it in whichever thread runs the copy, with the dtype we asked for.
    """

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype):
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def forward(self, images):
        with torch.amp.autocast(self.device_type, dtype=self.dtype):
            return self.module(images)


def gpu_list(text):
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU ids separated by commas, like 0,1,2,3; "
                                         f"got {text!r}") from None


def pick_gpus(requested, device="auto"):
    """The GPU ids to use (all visible ones by default); [] without CUDA or with --device cpu."""
    if device not in ("auto", "cpu", "cuda"):
        raise cli.UsageError(f"--device {device}: DataParallel runs on CUDA GPUs only; use --device cuda, "
                             "cpu or auto, or distributed.py, which runs on any accelerator")
    if device == "cpu" and requested is not None:
        raise cli.UsageError("--gpus with --device cpu: leave out one or the other")
    visible = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    if device == "cuda" and visible == 0:
        raise cli.UsageError("--device cuda but no CUDA GPU is visible: use --device cpu, or auto")
    if requested is None:
        return list(range(visible))
    if visible == 0:
        raise cli.UsageError(f"--gpus {','.join(map(str, requested))} asks for GPUs but none is visible; "
                             "leave out --gpus to train on the CPU")
    if len(set(requested)) != len(requested):
        raise cli.UsageError(f"--gpus {','.join(map(str, requested))} names a GPU more than once")
    missing = [i for i in requested if not 0 <= i < visible]
    if missing:
        raise cli.UsageError(f"--gpus: no GPU {missing[0]}; the visible ones are 0 to {visible - 1}")
    return requested


if __name__ == "__main__":
    lifecycle.run_main(main)
