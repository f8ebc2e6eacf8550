r"""Train a CIFAR ResNet with DistributedDataParallel, launched by torchrun.

One process per GPU; each holds a full copy of the model, trains on its own
shard of every global batch, and DDP averages the gradients with an all-reduce
that overlaps the backward pass. Without GPUs the processes run on the CPU (gloo).

    # one process (one GPU, or the CPU)
    python distributed.py --dataset synthetic --epochs 1

    # one node, all its GPUs (4 here)
    torchrun --standalone --nproc_per_node=4 distributed.py --batch-size 512

    # two nodes with 8 GPUs each: the same command on both (c10d assigns the node ranks);
    # scripts/launch_multi_node.sh adds the settings that real hosts often need (lesson 06)
    torchrun --nnodes=2 --nproc_per_node=8 \
        --rdzv-backend=c10d --rdzv-endpoint=HOST_OF_NODE_0:29500 distributed.py --batch-size 1024

--batch-size is the global batch: each of the N processes gets batch-size / N.
"""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from models import MODEL_NAMES, build_model
from utils import cli, compat, data, distributed as dist_utils, lifecycle, metrics, replicas, schedule
from utils.run import TrainingRun, validated


def main(argv=None):
    # --- arguments --------------------------------------------------------------------
    parser = cli.build_parser(__doc__, MODEL_NAMES)
    replicas.add_flags(parser)
    cli.add_fast_path_flags(parser)
    args = cli.parse_args(parser, argv)
    plan = validated(args, check)  # every refusal before anything starts; --check-args ends here

    # --- distributed setup ------------------------------------------------------------
    # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: the processes meet
    # there (env://). Under plain `python` none is set: one process, no process group.
    env = dist_utils.setup(plan.job, plan.device, timeout_s=args.dist_timeout)
    try:
        train(args, env, plan.per_device_batch)
    finally:
        dist_utils.cleanup()  # also when training raises: no rank is left in the group


def check(args) -> cli.Plan:
    """Bad input that needs no process group to be seen, refused in one line (UsageError)
    before anything starts. --check-args runs exactly this (scripts/slurm.sbatch, before srun)."""
    job = dist_utils.job_from_env(check_only=args.check_args)  # who this process is, as torchrun said
    device = dist_utils.check_job(job, args.device, args.check_args)  # its device; several nodes: the network
    per_device_batch = cli.split_batch(args.batch_size, job.world_size)
    cli.check_flags(args)
    replicas.check_flags(args, device.type)  # --sync-bn
    return cli.Plan(job.world_size, read=job.read, job=job, device=device, per_device_batch=per_device_batch)


def train(args, env, per_device_batch):
    dist_utils.seed_everything(args.seed)
    # The input shape never changes: cudnn times its convolution algorithms once, keeps the fastest.
    torch.backends.cudnn.benchmark = env.device.type == "cuda"

    # --- data -------------------------------------------------------------------------
    train_set, test_set = data.build_datasets(args, env)
    train_loader = data.train_loader(train_set, per_device_batch, args.batch_size, env, args)
    test_loader = data.eval_loader(test_set, 2 * per_device_batch, env, args)
    steps_per_epoch = data.steps_per_epoch(len(train_set), args.batch_size)

    # --- model ------------------------------------------------------------------------
    # NHWC (channels_last) by default on recent GPUs, the layout tensor-core convolutions want.
    memory_format = data.memory_format(args, env.device)
    model = build_model(args.model, data.num_classes(train_set)).to(env.device, memory_format=memory_format)
    # Our CIFAR batches come as bytes (a quarter of float32's, through the workers' shared memory
    # and to the device) and are normalised there; your own data's go there as loaded.
    to_model = data.model_inputs(train_set, env.device, memory_format)
    if args.sync_bn:  # batch statistics over the global batch instead of each GPU's slice
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if env.distributed:  # under a launcher, a group of one too: DDP's own cost is then measured
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

    # --- optimizer --------------------------------------------------------------------
    # Linear scaling (Goyal et al., 2017): --lr is the rate for 128 samples a step, the recipe's batch.
    lr = args.lr * args.batch_size / 128
    # fused on accelerators: one kernel does the whole update; the default runs several (foreach on CUDA).
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, nesterov=args.nesterov,
                                weight_decay=args.weight_decay, fused=True if env.device.type != "cpu" else None)
    scheduler = schedule.warmup_multistep(optimizer, args, steps_per_epoch)
    run = TrainingRun(args, env, model, optimizer, scheduler, train_size=len(train_set),
                      strategy="ddp-torchrun")  # all ranks meet here; resumes with --resume

    # --- training loop ----------------------------------------------------------------
    for epoch in run.epochs():
        # A new shuffle every epoch; without set_epoch every epoch repeats the first order.
        # start_step (DistributedSampler has none): a resumed epoch goes on at its next batch.
        train_loader.sampler.set_epoch(epoch, start_step=run.step_in_epoch)
        ddp_model.train()
        for images, targets in run.progress(train_loader):
            images = to_model(images)  # to the device (non-blocking: from pinned memory), in the model's layout
            targets = targets.to(env.device, non_blocking=True)
            logits = ddp_model(images)
            loss = F.cross_entropy(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP's hooks all-reduce the gradients during this call
            run.clip_grad_norm(model.parameters())  # --clip-grad-norm: of the averaged gradient, on every rank
            optimizer.step()
            scheduler.step()
            run.meter.update(loss.detach(), logits.detach(), targets)
            if run.step_done():  # all ranks, every step: counts it, checkpoints when due; True when training ends
                break
        # Evaluate the unwrapped model: exact over all ranks, see metrics.evaluate.
        # All ranks: evaluate and end_epoch communicate (utils/run.py lists every collective).
        if metrics.evaluation_due(epoch, args, last=run.trained()):  # --eval-every
            run.end_epoch(metrics.evaluate(model, test_loader, env.device, inputs=to_model))
        else:
            run.end_epoch(metrics.NOT_EVALUATED)
    run.finish()
    if args.verify_sync:
        replicas.verify_sync(model)  # all ranks: a broadcast and an all-reduce per tensor, compared with rank 0's


if __name__ == "__main__":
    lifecycle.run_main(main)
