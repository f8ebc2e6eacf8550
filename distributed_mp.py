r"""Train a CIFAR ResNet with DistributedDataParallel, processes started by torch.multiprocessing.spawn.

The same training as distributed.py; only the start differs. Instead of torchrun,
this script starts its own processes, one per GPU, and they meet through a TCP
address (--ip/--port) or a file on a shared file system (--init-method file://).
Without GPUs the processes run on the CPU (gloo).

    # one node: all its GPUs (2 processes on the CPU)
    python distributed_mp.py --dataset synthetic --epochs 1

    # one node, 4 GPUs
    python distributed_mp.py --nproc-per-node 4 --batch-size 512

    # two nodes with 8 GPUs each: run on both, with --node-rank 1 on the second
    python distributed_mp.py --nodes 2 --node-rank 0 --nproc-per-node 8 \
        --ip HOST_OF_NODE_0 --port 29500 --batch-size 1024

    # the same, meeting through a file that both nodes can see
    python distributed_mp.py --nodes 2 --node-rank 0 --nproc-per-node 8 \
        --init-method file:///shared/job42.rdzv --batch-size 1024

--batch-size is the global batch: each of the N processes gets batch-size / N.
"""
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from models import MODEL_NAMES, build_model
from utils import cli, compat, data, distributed as dist_utils, lifecycle, metrics, replicas, schedule, spawn
from utils.run import TrainingRun, validated


def main(argv=None):
    # --- arguments --------------------------------------------------------------------
    parser = cli.build_parser(__doc__, MODEL_NAMES)
    replicas.add_flags(parser)
    cli.add_fast_path_flags(parser)
    spawn.add_flags(parser)  # --nproc-per-node, --nodes, --node-rank, --ip, --port, --init-method
    args = cli.parse_args(parser, argv)
    plan = validated(args, check)  # every refusal before a process starts; --check-args ends here

    # --- distributed setup ------------------------------------------------------------
    # worker(local_rank, ...) runs in nproc_per_node fresh Python processes ("spawn": CUDA
    # cannot be used in a forked child). This one passes stop signals on to them, waits for
    # them, and ends as the first that failed, as torchrun would.
    with spawn.Supervisor(args) as supervisor:
        workers = mp.spawn(worker, args=(args, plan.world_size, plan.per_device_batch, supervisor.errors),
                           nprocs=args.nproc_per_node, join=False)
        supervisor.watch(workers)


def check(args) -> cli.Plan:
    """Bad input that needs no process group to be seen, refused in one line (UsageError)
    before a process starts: not N tracebacks, nor N processes waiting for a peer that never
    comes. --check-args runs exactly this."""
    world_size = spawn.check_launch(args)  # the launch flags (utils/spawn.py); several nodes: the network
    device_type = dist_utils.device_type(args.device, distributed=True)
    cli.check_flags(args)
    replicas.check_flags(args, device_type)  # --sync-bn
    return cli.Plan(world_size, per_device_batch=cli.split_batch(args.batch_size, world_size))


def worker(local_rank, args, world_size, per_device_batch, errors):
    job = dist_utils.DistEnv(args.node_rank * args.nproc_per_node + local_rank, local_rank, world_size,
                             args.nproc_per_node, distributed=True, init_method=args.init_method)
    with spawn.worker_exit(errors, local_rank):  # exit status 2 for bad input, 0 after a stop signal
        device = dist_utils.pick_device(local_rank, args.nproc_per_node, args.device, distributed=True)
        env = dist_utils.setup(job, device, timeout_s=args.dist_timeout)
        try:
            train(args, env, per_device_batch)
        finally:
            dist_utils.cleanup()  # also when training raises: no rank is left in the group


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
                      strategy="ddp-spawn")  # all ranks meet here; resumes with --resume

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
