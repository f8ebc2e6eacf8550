r"""Train a CIFAR ResNet with DistributedDataParallel and mixed precision, launched by torchrun.

distributed.py plus mixed precision. The forward pass and the loss run under
autocast: convolutions and matrix multiplies in float16 or bfloat16 (tensor
cores, half the memory traffic), reductions and the loss in float32; weights,
gradients and optimizer state stay float32. float16 can only represent
magnitudes down to about 6e-8, so small gradients would underflow to zero: a
GradScaler multiplies the loss before backward, divides the gradients by the
same factor before the step, and skips a step whose gradients overflowed.
bfloat16 has float32's range and needs no scaler. Without GPUs the processes
run on the CPU (gloo), in bfloat16 by default.

    # one process (one GPU, or the CPU)
    python distributed_apex.py --dataset synthetic --epochs 1 --amp bf16
    python distributed_apex.py --dataset synthetic --epochs 1 --amp fp16

    # one node, all its GPUs (4 here)
    torchrun --standalone --nproc_per_node=4 distributed_apex.py --batch-size 512 --amp bf16
    torchrun --standalone --nproc_per_node=4 distributed_apex.py --batch-size 512 --amp fp16

    # two nodes with 8 GPUs each: the same command on both (c10d assigns the node ranks)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE_0:29500 distributed_apex.py --batch-size 1024 --amp bf16
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE_0:29500 distributed_apex.py --batch-size 1024 --amp fp16

--batch-size is the global batch: each of the N processes gets batch-size / N.
bf16 wants an Ampere or newer GPU (A100, H100, RTX 30xx and later); fp16 runs on any.
On the CPU prefer bf16: recent builds run fp16 too, but its convolution backward
is a slow fallback there (tens of times slower), fine for tests only.

The name is historical: torch.amp succeeds apex.amp, gone from NVIDIA apex since 2025.
`--amp-impl apex` (CUDA only) takes FusedSGD from a source build of NVIDIA apex (not
PyPI's `apex`), and apex.amp (--opt-level) if that build still has it.
"""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from models import MODEL_NAMES, build_model
from utils import cli, compat, data, distributed as dist_utils, lifecycle, metrics, replicas, schedule
from utils.precision import AMP_DTYPES, choose_precision
from utils.device_data import DeviceEvalLoader, DeviceTrainLoader
from utils.run import TrainingRun, validated



def main(argv=None):
    # --- arguments --------------------------------------------------------------------
    parser = cli.build_parser(__doc__, MODEL_NAMES)
    replicas.add_flags(parser)
    cli.add_fast_path_flags(parser, data_on_gpu=True)
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--amp", choices=sorted(AMP_DTYPES), default=None,
                   help="autocast dtype; without the flag bf16 on the CPU and on GPUs that have it in "
                        "hardware (Ampere or newer), fp16 on older GPUs")
    g.add_argument("--amp-impl", choices=["torch", "apex"], default="torch",
                   help="torch: torch.amp (autocast + GradScaler); apex: a source build of NVIDIA apex")
    g.add_argument("--opt-level", choices=["O0", "O1", "O2", "O3"], default=None,
                   help="apex.amp's level (O1 when apex.amp is used); with torch.amp: O0 = float32, "
                        "O1/O2 = autocast + GradScaler, O3 (pure fp16) is refused")
    args = cli.parse_args(parser, argv)
    plan = validated(args, check)  # every refusal before anything starts; --check-args ends here

    # --- distributed setup ------------------------------------------------------------
    # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: the processes meet
    # there (env://). Under plain `python` none is set: one process, no process group.
    env = dist_utils.setup(plan.job, plan.device, timeout_s=args.dist_timeout)
    try:
        train(args, env, plan.per_device_batch, plan.precision)
    finally:
        dist_utils.cleanup()  # also when training raises: no rank is left in the group


def check(args) -> cli.Plan:
    """Bad input that needs no process group to be seen, refused in one line (UsageError)
    before anything starts: a bad precision choice ends every rank at once. --check-args
    runs exactly this (scripts/slurm.sbatch, before srun)."""
    job = dist_utils.job_from_env(check_only=args.check_args)  # who this process is, as torchrun said
    device = dist_utils.check_job(job, args.device, args.check_args)  # its device; several nodes: the network
    per_device_batch = cli.split_batch(args.batch_size, job.world_size)
    cli.check_flags(args)
    replicas.check_flags(args, device.type)  # --sync-bn
    return cli.Plan(job.world_size, read=job.read, job=job, device=device, per_device_batch=per_device_batch,
                    precision=choose_precision(args, device.type))


def train(args, env, per_device_batch, precision):
    dist_utils.seed_everything(args.seed)
    # The input shape never changes: cudnn times its convolution algorithms once, keeps the fastest.
    torch.backends.cudnn.benchmark = env.device.type == "cuda"
    if env.device.type == "cuda":
        # What autocast leaves in float32 (and all of an O0 run) may use TF32 tensor cores
        # on Ampere and later: float32 range, 10-bit mantissa in the multiply, float32 sums.
        # Convolutions do by default (torch.backends.cudnn.allow_tf32); matrix multiplies from here.
        # (The newer spelling is fp32_precision = "tf32"; set TF32 one way only: reading
        # allow_tf32 after setting fp32_precision raises.)
        torch.backends.cuda.matmul.allow_tf32 = True

    # --- data -------------------------------------------------------------------------
    train_set, test_set = data.build_datasets(args, env)
    if args.data_on_gpu:  # fast path: the data in device memory, augmented there
        train_loader = DeviceTrainLoader(train_set, per_device_batch, args.batch_size, env, args)
        test_loader = DeviceEvalLoader(test_set, 2 * per_device_batch, env)
    else:
        train_loader = data.train_loader(train_set, per_device_batch, args.batch_size, env, args)
        test_loader = data.eval_loader(test_set, 2 * per_device_batch, env, args)
    steps_per_epoch = data.steps_per_epoch(len(train_set), args.batch_size)

    # --- model ------------------------------------------------------------------------
    # NHWC (channels_last) by default on recent GPUs, the layout tensor-core convolutions want.
    memory_format = data.memory_format(args, env.device)
    model = build_model(args.model, data.num_classes(train_set)).to(env.device, memory_format=memory_format)
    # Our CIFAR batches come as bytes (a quarter of float32's, through the workers' shared memory
    # and to the device) and are normalised there; your own data's go there as loaded.
    # (--data-on-gpu: they are there from the start.) Handed over in the autocast dtype:
    # autocast would cast them at the first convolution anyway.
    to_model = data.model_inputs(train_set, env.device, memory_format, dtype=precision.dtype)
    if args.sync_bn:  # batch statistics over the global batch instead of each GPU's slice
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)

    # --- optimizer --------------------------------------------------------------------
    # Linear scaling (Goyal et al., 2017): --lr is the rate for 128 samples a step, the recipe's batch.
    lr = args.lr * args.batch_size / 128
    # fused on accelerators: one kernel does the whole update; the default runs several (foreach on CUDA).
    # --amp-impl apex: apex's FusedSGD. Not on MPS: its fused kernel did not honour the scaler's
    # grad_scale and found_inf before a fix that came after PyTorch 2.11 (a step on scaled or overflowed gradients).
    if precision.fused_sgd is not None:
        optimizer = precision.fused_sgd(model.parameters(), lr=lr, momentum=args.momentum,
                                        nesterov=args.nesterov, weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, nesterov=args.nesterov,
                                    weight_decay=args.weight_decay,
                                    fused=True if env.device.type not in ("cpu", "mps") else None)

    # --- mixed precision --------------------------------------------------------------
    apex_amp, dtype = precision.apex_amp, precision.dtype
    if apex_amp is not None:
        # apex.amp patches (O1) or recasts (O2/O3) the model and wraps the optimizer; it
        # must see them before DDP does, whose gradient buckets follow the parameters' dtype.
        model, optimizer = apex_amp.initialize(model, optimizer, opt_level=precision.opt_level,
                                               verbosity=0)

    use_autocast = dtype is not None and apex_amp is None  # apex.amp casts by itself

    def autocast():  # forward and loss in `dtype`; a no-op for float32
        return torch.amp.autocast(env.device.type, dtype=dtype, enabled=use_autocast)

    # Loss scaling for float16 only. Disabled, every scaler call below passes straight
    # through (scale returns the loss, step calls optimizer.step), so one loop serves all.
    scaler = torch.amp.GradScaler(env.device.type, enabled=dtype == torch.float16 and apex_amp is None)
    if scaler.is_enabled() and args.momentum:
        # torch's fused SGD makes its momentum with empty_like at its first step and keeps it when the scaler
        # skips that step (an fp16 overflow): garbage in every later step. From zeros, the same first step.
        for p in model.parameters():
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)

    if env.distributed:  # under a launcher, a group of one too; wrapped last, after apex.amp may have recast the model
        # DDP broadcasts rank 0's weights to every rank here, then all-reduces (averages)
        # gradients bucket by bucket while backward is still running.
        # gradient_as_bucket_view: .grad tensors are views into DDP's all-reduce buckets: the
        # memory of a second copy of the gradients, and the copy of the average back out, saved.
        # buffers_synced_once: rank 0's batch-norm statistics go to every rank here, and are
        # not broadcast again before every forward (evaluation and checkpoints take rank 0's
        # anyway); the flag for it was renamed in PyTorch 2.13, see utils/compat.py.
        ddp_model = DDP(model, device_ids=env.device_ids, gradient_as_bucket_view=True,
                        **compat.buffers_synced_once(model))
    else:
        ddp_model = model  # plain python: one process, no group, no DDP hooks to run
    if args.compile:
        # Compiled around DDP: its optimizer splits the graph at bucket boundaries, so the
        # all-reduces still overlap backward. The first steps compile (excluded from timing).
        ddp_model = torch.compile(ddp_model, mode=args.compile_mode)
    scheduler = schedule.warmup_multistep(optimizer, args, steps_per_epoch)
    run = TrainingRun(args, env, model, optimizer, scheduler, train_size=len(train_set),
                      strategy=f"ddp-amp-{args.amp_impl}",  # all ranks meet here
                      scaler=apex_amp or scaler,  # the loss scale is checkpointed and resumed too
                      extra_record={"amp": precision.name, "amp_impl": args.amp_impl,
                                    "opt_level": precision.opt_level})  # resumes here with --resume

    # --- training loop ----------------------------------------------------------------
    for epoch in run.epochs():
        # A new shuffle every epoch; without set_epoch every epoch repeats the first order.
        # start_step (DistributedSampler has none): a resumed epoch goes on at its next batch.
        train_loader.sampler.set_epoch(epoch, start_step=run.step_in_epoch)
        ddp_model.train()
        for images, targets in run.progress(train_loader):
            images = to_model(images)  # to the device (non-blocking: from pinned memory), in the model's layout
            targets = targets.to(env.device, non_blocking=True)
            with autocast():  # forward and loss only: backward follows the forward's dtypes
                logits = ddp_model(images)
                loss = F.cross_entropy(logits, targets)  # autocast computes the loss in float32
            if apex_amp is None:
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()  # DDP's hooks all-reduce the (scaled) gradients here
            else:
                # apex.amp's O2 replaces optimizer.zero_grad with one that takes no set_to_none and detaches
                # gradients in place, which DDP's bucket views refuse: the model's go first, its fp32 copies then.
                model.zero_grad(set_to_none=True)
                optimizer.zero_grad()
                with apex_amp.scale_loss(loss, optimizer) as scaled_loss:  # unscales on exit
                    scaled_loss.backward()
            if args.clip_grad_norm is not None:  # the norm of the averaged gradient, on every rank
                scaler.unscale_(optimizer)  # the true gradients, before their norm is measured
                run.clip_grad_norm(apex_amp.master_params(optimizer) if apex_amp else model.parameters())
            scaler.step(optimizer)  # skipped if a gradient is inf/nan (the scale was too high)
            scaler.update()  # halve the scale after an overflow, double it after 2000 clean steps
            # Stepped even when the scaler skipped optimizer.step: the schedule stays aligned
            # with the step count that checkpoints and --max-steps use (common practice; a
            # skip is rare after the first few steps). torch may warn once about it.
            scheduler.step()
            run.meter.update(loss.detach(), logits.detach(), targets)
            if run.step_done():  # all ranks, every step: counts it, checkpoints when due; True when training ends
                break
        # Evaluate the unwrapped model, in the same precision: exact over all ranks, see metrics.evaluate.
        # All ranks: evaluate and end_epoch communicate (utils/run.py lists every collective).
        if metrics.evaluation_due(epoch, args, last=run.trained()):  # --eval-every
            run.end_epoch(metrics.evaluate(model, test_loader, env.device, autocast=autocast, inputs=to_model))
        else:
            run.end_epoch(metrics.NOT_EVALUATED)
    run.finish()
    if args.verify_sync:
        replicas.verify_sync(model)  # all ranks: a broadcast and an all-reduce per tensor, compared with rank 0's


if __name__ == "__main__":
    lifecycle.run_main(main)
