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
import contextlib
import errno
import os
import signal
import socket
import sys
import tempfile
from urllib.parse import urlparse

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from models import MODEL_NAMES, build_model
from utils import cli, data, distributed as dist_utils, metrics, preemption, replicas, schedule
from utils.device_data import DeviceEvalLoader, DeviceTrainLoader
from utils.run import TrainingRun


def main(argv=None):
    # --- arguments --------------------------------------------------------------------
    parser = cli.build_parser(__doc__, MODEL_NAMES)
    replicas.add_flags(parser)
    cli.add_fast_path_flags(parser)
    g = parser.add_argument_group("ddp-spawn")
    g.add_argument("--nproc-per-node", "--nproc_per_node", type=cli.positive_int, default=None, metavar="N",
                   help="processes on this node; without it, one per visible GPU (2 on the CPU)")
    g.add_argument("--nodes", type=cli.positive_int, default=1, metavar="N", help="nodes in the job")
    g.add_argument("--node-rank", "--node_rank", type=cli.non_negative_int, default=0, metavar="R",
                   help="this node's number, 0 .. nodes-1; node 0 hosts the rendezvous")
    g.add_argument("--ip", default="127.0.0.1", help="address of node 0, reachable from every node")
    g.add_argument("--port", type=cli.port, default=None,
                   help="a free TCP port on node 0, the same on every node; required with --nodes > 1, "
                        "picked for you on one node")
    g.add_argument("--init-method", "--init_method", default=None, metavar="URL",
                   help="tcp://HOST:PORT, or file:///PATH: a new file on a file system that every node "
                        "sees; without it, tcp://IP:PORT")
    args = cli.parse_args(parser, argv)

    # --- distributed setup ------------------------------------------------------------
    # Everything is checked here, before a process starts: bad input ends with one line,
    # not with N tracebacks or N processes waiting for a peer that will never come.
    world_size = check_launch(args)
    per_device_batch = cli.split_batch(args.batch_size, world_size)
    if args.node_rank == 0:
        print(f"starting {args.nproc_per_node} process{'es' if args.nproc_per_node > 1 else ''} on node 0 "
              f"of {args.nodes} (world size {world_size}), rendezvous at {args.init_method}", flush=True)
    # worker(local_rank, ...) runs in nproc_per_node fresh Python processes ("spawn": CUDA
    # cannot be used in a forked child); this one waits for them and reports how they ended.
    with tempfile.TemporaryDirectory(prefix="distributed_mp-") as error_dir:
        try:
            workers = mp.spawn(worker, args=(args, world_size, per_device_batch, error_dir),
                               nprocs=args.nproc_per_node, join=False)
            forward_stop_signals(workers)
            # When one fails, the others get 10 s to finish failing on their own (the same bad
            # input reaches every rank), then are terminated.
            while not workers.join(grace_period=10):
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            exit_like(err, args, error_dir)
        finally:
            remove_rendezvous_file(args)


def worker(local_rank, args, world_size, per_device_batch, error_dir):
    rank = args.node_rank * args.nproc_per_node + local_rank
    code = 0
    try:
        env = dist_utils.setup(rank, world_size, local_rank, args.nproc_per_node, args.init_method,
                               timeout_s=args.dist_timeout)
        try:
            train(args, env, per_device_batch)
        finally:
            dist_utils.cleanup()  # also when training raises: no rank is left in the group
    except cli.UsageError as err:
        # Each rank meets the same bad input; the parent prints one line for all of them.
        with open(os.path.join(error_dir, f"{local_rank:05d}"), "w") as f:
            f.write(str(err))
        code = 2
    except preemption.Preempted:
        code = 0  # stopped on a signal, checkpoint saved
    cli.leave(code)  # the work is done: skip the interpreter's teardown (see cli.leave)


def train(args, env, per_device_batch):
    dist_utils.seed_everything(args.seed)
    # The input shape never changes: cudnn times its convolution algorithms once, keeps the fastest.
    torch.backends.cudnn.benchmark = env.device.type == "cuda"

    # --- data -------------------------------------------------------------------------
    train_set, test_set = data.build_datasets(args, env)
    if args.data_on_gpu:  # fast path: the data in device memory, augmented and normalised there
        train_loader = DeviceTrainLoader(train_set, per_device_batch, args.batch_size, env, args)
        test_loader = DeviceEvalLoader(test_set, 2 * per_device_batch, env, args)
    else:
        train_loader = data.train_loader(train_set, per_device_batch, args.batch_size, env, args)
        test_loader = data.eval_loader(test_set, 2 * per_device_batch, env, args)
    steps_per_epoch = data.steps_per_epoch(len(train_set), args.batch_size)

    # --- model ------------------------------------------------------------------------
    # channels_last (NHWC) is the layout tensor-core convolutions want: no transposes.
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = build_model(args.model, data.num_classes(train_set)).to(env.device, memory_format=memory_format)
    if args.sync_bn:  # batch statistics over the global batch instead of each GPU's slice
        model = replicas.convert_sync_bn(model, env)
    if env.world_size > 1:
        # DDP broadcasts rank 0's weights to every rank here, then all-reduces (averages)
        # gradients bucket by bucket while backward is still running.
        # gradient_as_bucket_view: .grad tensors are views into DDP's all-reduce buckets,
        # which saves a copy of every gradient and the memory for it.
        # broadcast_buffers=False: no broadcast of rank 0's batch-norm statistics before
        # every forward; evaluation and checkpoints take rank 0's buffers anyway.
        ddp_model = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                        gradient_as_bucket_view=True, broadcast_buffers=False)
    else:
        ddp_model = model  # one process: no gradients to average, no DDP hooks to run
    if args.compile:
        # Compiled around DDP: its optimizer splits the graph at bucket boundaries, so the
        # all-reduces still overlap backward. The first steps compile (excluded from timing).
        ddp_model = torch.compile(ddp_model, mode=args.compile_mode)

    # --- optimizer --------------------------------------------------------------------
    # fused on GPUs: one kernel updates every parameter instead of a few per tensor.
    optimizer = torch.optim.SGD(model.parameters(), lr=schedule.scaled_lr(args), momentum=args.momentum,
                                nesterov=args.nesterov, weight_decay=args.weight_decay,
                                fused=True if env.device.type == "cuda" else None)
    scheduler = schedule.warmup_multistep(optimizer, args, steps_per_epoch)
    run = TrainingRun(args, env, model, optimizer, scheduler, steps_per_epoch=steps_per_epoch,
                      strategy="ddp-spawn")  # all ranks meet here; resumes with --resume

    # --- training loop ----------------------------------------------------------------
    for epoch in run.epochs():
        # A new shuffle every epoch; without set_epoch every epoch repeats the first order.
        # start_step (DistributedSampler has none): a resumed epoch goes on at its next batch.
        train_loader.sampler.set_epoch(epoch, start_step=run.step_in_epoch)
        ddp_model.train()
        for images, targets in run.progress(train_loader):
            images = images.to(env.device, non_blocking=True, memory_format=memory_format)
            targets = targets.to(env.device, non_blocking=True)
            logits = ddp_model(images)
            loss = F.cross_entropy(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP's hooks all-reduce the gradients during this call
            optimizer.step()
            scheduler.step()
            run.meter.update(loss.detach(), logits.detach(), targets)
            if run.step_done():  # all ranks, every step: counts it, checkpoints when due; True at --max-steps
                break
        # Evaluate the unwrapped model: exact over all ranks, see metrics.evaluate.
        # All ranks: evaluate and end_epoch communicate (utils/run.py lists every collective).
        if metrics.evaluation_due(epoch, args, last=run.done()):  # --eval-every
            run.end_epoch(metrics.evaluate(model, test_loader, env.device, memory_format=memory_format))
        else:
            run.end_epoch(metrics.NOT_EVALUATED)
    run.finish()
    if args.verify_sync:
        replicas.verify_sync(model)


# --- starting and supervising the processes -------------------------------------------

def check_launch(args) -> int:
    """Fill in the defaults, validate the launch flags; returns the world size."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.nproc_per_node is None:
        args.nproc_per_node = gpus or 2
    elif gpus and args.nproc_per_node > gpus:
        raise cli.UsageError(f"--nproc-per-node {args.nproc_per_node} but only {gpus} GPU"
                             f"{'s' if gpus != 1 else ''} visible: use {gpus} or fewer (one process per GPU)")
    if args.node_rank >= args.nodes:
        raise cli.UsageError(f"--node-rank {args.node_rank} with --nodes {args.nodes}: "
                             f"node ranks go from 0 to {args.nodes - 1}")
    world_size = args.nodes * args.nproc_per_node

    if args.init_method is None:
        if args.port is None:
            if args.nodes > 1:
                raise cli.UsageError(f"--nodes {args.nodes} needs --port: the same free port of node 0 "
                                     "on every node, e.g. --port 29500")
            args.port = bind_port(args.ip)
        host = f"[{args.ip}]" if ":" in args.ip else args.ip  # an IPv6 address needs brackets
        args.init_method = f"tcp://{host}:{args.port}"
    url = urlparse(args.init_method)
    if url.scheme == "tcp":
        try:
            host, port = url.hostname, url.port
        except ValueError:
            host, port = None, None
        if not host or not port:
            raise cli.UsageError(f"--init-method {args.init_method}: expected tcp://HOST:PORT")
        if args.node_rank == 0:  # rank 0 listens there: check now that it can
            bind_port(host, port)
    elif url.scheme == "file":
        path = url.path
        if url.netloc or not path.startswith("/"):
            raise cli.UsageError(f"--init-method {args.init_method}: expected file:///ABSOLUTE/PATH")
        if not os.path.isdir(os.path.dirname(path) or "/"):
            raise cli.UsageError(f"--init-method {args.init_method}: directory {os.path.dirname(path)} "
                                 "does not exist")
        # A file left by an earlier run that crashed would be joined as if it were this
        # run's. With several nodes a peer may already have created it, so only one node checks.
        if args.nodes == 1 and os.path.exists(path) and os.path.getsize(path) > 0:
            raise cli.UsageError(f"--init-method {args.init_method}: the file exists (left by an earlier "
                                 "run?); delete it or name a new file")
    else:
        raise cli.UsageError(f"--init-method {args.init_method}: use tcp://HOST:PORT or file:///PATH")
    return world_size


def bind_port(host, port=0) -> int:
    """Bind host:port as rank 0's rendezvous server will, then let it go; returns the port
    (port 0: any free one). Bad input raises UsageError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        # As the rendezvous server does: a port still in TIME_WAIT after an earlier run is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror:
            raise cli.UsageError(f"cannot resolve --ip {host}") from None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise cli.UsageError(f"port {port} on {host} is already in use; choose another "
                                     f"--port, e.g. --port {bind_port(host)}") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise cli.UsageError(f"{host} is not an address of this machine: node 0 (--node-rank 0) "
                                     "must run on the host that --ip names") from None
            raise cli.UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        return s.getsockname()[1]


def forward_stop_signals(workers):
    """Pass SIGTERM/SIGUSR1 on to the workers, as torchrun does: they checkpoint at a step
    all ranks agree on and exit 0 (utils/preemption.py). Dying here instead would take
    them down mid-step, before they could save."""
    def forward(signum, frame):
        for pid in workers.pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # already gone
                pass
    for sig in preemption.SIGNALS:
        signal.signal(sig, forward)


def exit_like(err, args, error_dir):
    """End this process as its failed worker ended: bad input as one line and exit status 2,
    a bug with the worker's traceback (not ours), a signal or exit status as such."""
    rank = args.node_rank * args.nproc_per_node + err.error_index
    names = sorted(os.listdir(error_dir))
    if names:  # bad input that only the workers could see: the lowest local rank's line
        with open(os.path.join(error_dir, names[0])) as f:
            raise cli.UsageError(f.read()) from None
    if isinstance(err, mp.ProcessRaisedException):
        sys.exit(f"{err}".strip() + f"\n(in global rank {rank})")
    prog = os.path.basename(sys.argv[0])
    print(f"{prog}: error: {err.msg} (global rank {rank})", file=sys.stderr, flush=True)
    sys.exit(err.exit_code if err.exit_code > 0 else 128 - err.exit_code)


def remove_rendezvous_file(args):
    # The file store often leaves its file behind, and a stale file would be joined as if it
    # were the next run's. On one node, every process that used it has exited by now.
    if args.nodes == 1 and args.init_method.startswith("file://"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(urlparse(args.init_method).path)


if __name__ == "__main__":
    cli.run_main(main)
