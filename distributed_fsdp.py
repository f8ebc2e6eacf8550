r"""Train a CIFAR ResNet with fully sharded data parallel (FSDP2), launched by torchrun.

One process per GPU, as with DDP, but no process holds the whole model: every parameter,
its gradient and its optimizer state are split in N shards, one per process. Before a
residual stage runs forward (and again in backward), its parameters are all-gathered from
the shards; after backward its gradients are reduce-scattered, so each process keeps and
updates only its shard of the averaged gradient. Memory per GPU falls with N; the price is
the extra all-gathers. Without GPUs the processes run on the CPU (gloo).

    # one process (one GPU, or the CPU): a group of one, the same code path
    python distributed_fsdp.py --dataset synthetic --epochs 1

    # one node, all its GPUs (4 here)
    torchrun --standalone --nproc_per_node=4 distributed_fsdp.py --batch-size 512

    # two nodes with 8 GPUs each: the same command on both (c10d assigns the node ranks);
    # scripts/launch_multi_node.sh adds the settings that real hosts often need (lesson 06)
    torchrun --nnodes=2 --nproc_per_node=8 \
        --rdzv-backend=c10d --rdzv-endpoint=HOST_OF_NODE_0:29500 distributed_fsdp.py --batch-size 1024

    # ZeRO-2 (keep the gathered parameters from forward to backward: less communication,
    # more memory) and bf16 compute with fp32 gradient reduction
    torchrun --standalone --nproc_per_node=4 distributed_fsdp.py --no-reshard-after-forward --mp-policy bf16

--batch-size is the global batch: each of the N processes gets batch-size / N.

Batch norm: FSDP shards parameters only; buffers (batch-norm running statistics) stay
whole on every rank and are never synchronised: each rank's follow its own slice of
the batch, exactly as under DDP. Evaluation uses rank 0's (metrics.evaluate broadcasts
them) and checkpoints hold rank 0's, so both see the model DDP's checkpoint would hold.

Checkpoints (--checkpoint-dir) are sharded: every rank writes its own part of the model
and optimizer with torch.distributed.checkpoint into a folder beside checkpoint.pt, which
rank 0 writes last and which names that folder; so every node must see that directory (as
under DDP, where every rank reads the checkpoint to resume: checked at the start). They load
at any number of processes: stop at 8 GPUs, resume at 4. scripts/compare_models.py reads
them without processes.
"""
import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from models import MODEL_NAMES, build_model
from utils import cli, data, distributed as dist_utils, lifecycle, metrics, schedule
from utils.sharded import ShardedState
from utils.device_data import DeviceEvalLoader, DeviceTrainLoader
from utils.run import TrainingRun, validated


def main(argv=None):
    # --- arguments --------------------------------------------------------------------
    parser = cli.build_parser(__doc__, MODEL_NAMES)
    # No --compile: inductor fails to compile the sharded model's backward on 2 CPU processes
    # (InductorError: "Cannot convert expression to float", PyTorch 2.14).
    cli.add_fast_path_flags(parser, data_on_gpu=True, torch_compile=False)
    g = parser.add_argument_group("sharding")
    g.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="free each residual stage's gathered parameters after its forward and gather them "
                        "again for backward (ZeRO-3, least memory); --no-reshard-after-forward keeps them "
                        "(ZeRO-2). The root's own (stem, classifier) stay gathered either way: backward "
                        "starts with them")
    g.add_argument("--mp-policy", choices=["none", "bf16"], default="none",
                   help="bf16: compute in bfloat16 (parameters gathered in bf16), reduce gradients "
                        "and keep the sharded weights in fp32")
    args = cli.parse_args(parser, argv)
    plan = validated(args, check, ShardedState)  # every refusal before anything starts; --check-args ends here

    # --- distributed setup ------------------------------------------------------------
    # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: the processes meet
    # there (env://). Under plain `python` none is set: one process.
    env = dist_utils.setup(plan.job, plan.device, timeout_s=args.dist_timeout)
    if not env.distributed:
        # fully_shard needs a process group even for one process: a group of one, its store
        # in memory (no port). The model, its checkpoints and the code path stay those of N.
        dist.init_process_group(dist.get_default_backend_for_device(env.device), store=dist.HashStore(),
                                rank=0, world_size=1, timeout=datetime.timedelta(seconds=args.dist_timeout))
        lifecycle.joined_a_group()
    try:
        train(args, env, plan.per_device_batch)
    finally:
        dist_utils.cleanup()  # also when training raises: no rank is left in the group


def check(args) -> cli.Plan:
    """Bad input that needs no process group to be seen, refused in one line (UsageError)
    before anything starts. --check-args runs exactly this (scripts/slurm.sbatch, before srun)."""
    job = dist_utils.job_from_env(check_only=args.check_args)  # who this process is, as torchrun said
    # Even the group of one that plain python forms takes the backend PyTorch names for MPS, gloo,
    # which moves CPU and CUDA tensors only: its first collective on the device would fail.
    if dist_utils.device_type(args.device) == "mps":
        raise cli.UsageError("distributed_fsdp.py does not run on Apple's MPS devices (its process group, "
                             "even of one process, cannot move MPS tensors): use --device cpu")
    device = dist_utils.check_job(job, args.device, args.check_args)  # its device; several nodes: the network
    per_device_batch = cli.split_batch(args.batch_size, job.world_size)
    cli.check_flags(args)
    return cli.Plan(job.world_size, read=job.read, job=job, device=device, per_device_batch=per_device_batch)


def even_eval_batches(loader, test_set, env):
    """The loader's batches, then padding batches (one zero image with target PAD_TARGET,
    which metrics.evaluate counts nowhere) until this rank has as many as the rank with the
    most. Every forward of the sharded model all-gathers parameters, so every rank must run
    the same number: shards that differ by one sample would leave a rank waiting in a gather."""
    longest = torch.tensor([len(loader)], device=env.device)
    with dist_utils.meeting("even_eval_batches() (the longest evaluation shard)"):  # all ranks, once
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    return EvenBatches(loader, test_set, int(longest.item()))


class EvenBatches:
    """Not a class made inside even_eval_batches: a class sits in a reference cycle that only the garbage
    collector frees, which lifecycle.leave never runs, so its closure kept the loader's workers alive at exit."""

    def __init__(self, loader, test_set, longest: int):
        self.loader, self.test_set, self.longest = loader, test_set, longest

    def __len__(self):
        return self.longest

    def __iter__(self):
        count, image = 0, None
        for images, targets in self.loader:
            count += 1
            image = images[:1]
            yield images, targets
        if count < self.longest:
            # Shaped like this rank's last image; a rank with no test image at all reads one
            # here, in this process, after the loader's workers have started (a data set that
            # opens its file lazily opens it in each worker first).
            padding = torch.zeros_like(image if image is not None else self.test_set[0][0].unsqueeze(0))
            for _ in range(self.longest - count):
                yield padding, torch.full((1,), metrics.PAD_TARGET, device=padding.device)


def shard(model, env, reshard_after_forward: bool, mp_policy: str):
    """Shard the model in place over all ranks with fully_shard (scripts/memory_table.py
    measures what this leaves on each rank)."""
    # Every rank built the same weights from the same seed; fully_shard keeps its slice of each
    # (dim 0 split in N) as a DTensor. Each residual stage is a unit of its own: its
    # parameters are gathered just before it runs and freed after, so only one stage is
    # whole at a time, and the gather of the next stage overlaps this one's compute. The
    # root call takes what is left (stem, classifier) and starts the gathers in order.
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mp_policy == "bf16" else MixedPrecisionPolicy())
    if mp_policy == "bf16":
        # Batch norm stays in fp32, as under autocast: its running statistics are fp32 buffers,
        # which a bf16 weight beside them makes the kernel refuse, and bf16 statistics would
        # drift. All batch-norm layers together are one unit that keeps fp32 and casts nothing:
        # each takes the bf16 activations as they come, with its fp32 weights (the kernels
        # accumulate in fp32 and return bf16). Why one unit: FSDP2's hooks run on the host for
        # every unit, and with one unit per layer, casting in and out, a step waits on the host.
        # One unit works here because the first batch norm (the stem's) runs before all the
        # others and the last after them: gathered at the first, its gradients reduced once
        # backward has passed the first. Made before the stages and the root, which then leave
        # these parameters to it.
        batch_norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        if batch_norms:  # the default policy: no param_dtype, so nothing cast (FSDPState's pre-forward)
            fully_shard(batch_norms, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        fully_shard(stage, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    # The root is left to PyTorch's default (reshard_after_forward=None): it stays whole from
    # forward to backward, which needs it at once (FSDPState._lazy_init), whatever the flag:
    # freed after forward, it would be gathered again first thing in backward: 10 all-gathers a step, not 9.
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def train(args, env, per_device_batch):
    dist_utils.seed_everything(args.seed)
    # The input shape never changes: cudnn times its convolution algorithms once, keeps the fastest.
    torch.backends.cudnn.benchmark = env.device.type == "cuda"

    # --- data -------------------------------------------------------------------------
    train_set, test_set = data.build_datasets(args, env)
    if args.data_on_gpu:  # fast path: the data in device memory, augmented there
        train_loader = DeviceTrainLoader(train_set, per_device_batch, args.batch_size, env, args)
        test_loader = DeviceEvalLoader(test_set, 2 * per_device_batch, env)
    else:
        train_loader = data.train_loader(train_set, per_device_batch, args.batch_size, env, args)
        test_loader = data.eval_loader(test_set, 2 * per_device_batch, env, args)
    test_loader = even_eval_batches(test_loader, test_set, env)
    steps_per_epoch = data.steps_per_epoch(len(train_set), args.batch_size)

    # --- model ------------------------------------------------------------------------
    # channels_last (by default on recent GPUs): the inputs, and so every activation, in NHWC,
    # the layout tensor-core convolutions want. The weights stay NCHW: fully_shard refuses
    # parameters that are not contiguous, and it gathers each unit into contiguous tensors anyway.
    # cuDNN (and oneDNN on the CPU) run a convolution in NHWC when its input is, converting the
    # small weight on the way in; the activations, the large part, never need a transpose.
    memory_format = data.memory_format(args, env.device)
    model = build_model(args.model, data.num_classes(train_set)).to(env.device)
    # Our CIFAR batches come as bytes (a quarter of float32's, through the workers' shared memory
    # and to the device) and are normalised there; your own data's go there as loaded.
    # (--data-on-gpu: they are there from the start.)
    to_model = data.model_inputs(train_set, env.device, memory_format)
    shard(model, env, args.reshard_after_forward, args.mp_policy)  # all ranks: fully_shard (shard() above)

    # --- optimizer --------------------------------------------------------------------
    # Linear scaling (Goyal et al., 2017): --lr is the rate for 128 samples a step, the recipe's batch.
    lr = args.lr * args.batch_size / 128
    # Built on the sharded parameters: each rank keeps momentum for its shard only.
    # Not fused=True as the DDP scripts do on GPUs: DTensor has no sharding rule for the fused
    # SGD kernel (NotImplementedError in step()). The default picks foreach for DTensors on GPUs.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                nesterov=args.nesterov, weight_decay=args.weight_decay)
    scheduler = schedule.warmup_multistep(optimizer, args, steps_per_epoch)
    run = TrainingRun(args, env, model, optimizer, scheduler, train_size=len(train_set),
                      strategy="fsdp2",  # all ranks meet here; resumes with --resume
                      extra_record={"mp_policy": args.mp_policy, "reshard_after_forward": args.reshard_after_forward},
                      state=ShardedState(model, optimizer))  # each rank's shards in a folder beside checkpoint.pt

    # --- training loop ----------------------------------------------------------------
    for epoch in run.epochs():
        # A new shuffle every epoch; without set_epoch every epoch repeats the first order.
        # start_step (DistributedSampler has none): a resumed epoch goes on at its next batch.
        train_loader.sampler.set_epoch(epoch, start_step=run.step_in_epoch)
        model.train()
        for images, targets in run.progress(train_loader):
            images = to_model(images)  # to the device (non-blocking: from pinned memory), in NHWC under channels_last
            targets = targets.to(env.device, non_blocking=True)
            logits = model(images)  # all-gathers each stage's parameters as it comes
            loss = F.cross_entropy(logits.float(), targets)  # bf16 logits under --mp-policy bf16
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # gathers again (ZeRO-3), reduce-scatters the gradients to their shards
            run.clip_grad_norm(model.parameters())  # --clip-grad-norm: an all-reduce of the shards' norms
            optimizer.step()  # each rank updates its own shard
            scheduler.step()
            run.meter.update(loss.detach(), logits.detach(), targets)
            if run.step_done():  # all ranks, every step: counts it, checkpoints when due; True when training ends
                break
        # Evaluate the sharded model itself: its forward all-gathers, so every rank runs the
        # same number of batches (even_eval_batches). Exact over all ranks, see metrics.evaluate.
        # All ranks: evaluate and end_epoch communicate (utils/run.py lists every collective).
        if metrics.evaluation_due(epoch, args, last=run.trained()):  # --eval-every
            run.end_epoch(metrics.evaluate(model, test_loader, env.device, inputs=to_model))
        else:
            run.end_epoch(metrics.NOT_EVALUATED)
    run.finish()


if __name__ == "__main__":
    lifecycle.run_main(main)
