"""What torchrun does for distributed.py, done for distributed_mp.py (its own launcher), kept apart from
the script so that it shows only what differs: mp.spawn and each process's setup. add_flags, check_launch:
the launch flags, checked before any process starts (one line, not N tracebacks or N processes waiting
for a peer). Supervisor, in the parent: passes stop signals on, waits for the workers, ends as the first
that failed. worker_exit, in each worker: the exit status of bad input, a stop, a loader's bus error.
"""
import contextlib
import errno
import glob
import os
import secrets
import signal
import socket
import sys
import tempfile
from urllib.parse import urlparse

import torch
import torch.multiprocessing as mp

from . import cli, distributed as dist_utils, lifecycle, network


def add_flags(parser):
    g = parser.add_argument_group("ddp-spawn")
    g.add_argument("--nproc-per-node", "--nproc_per_node", type=cli.positive_int, default=None, metavar="N",
                   help="processes on this node; without it, one per visible GPU (2 on the CPU)")
    g.add_argument("--nodes", type=cli.positive_int, default=1, metavar="N", help="nodes in the job")
    g.add_argument("--node-rank", "--node_rank", type=cli.non_negative_int, default=0, metavar="R",
                   help="this node's number, 0 .. nodes-1; node 0 hosts the rendezvous")
    g.add_argument("--ip", default="127.0.0.1", help="address of node 0, reachable from every node")
    g.add_argument("--port", type=cli.port, default=None,
                   help="a free TCP port on node 0, the same on every node (needed with --nodes > 1, else picked)")
    g.add_argument("--init-method", "--init_method", default=None, metavar="URL",
                   help="tcp://HOST:PORT, or file:///PATH (a new file that every node sees); without it, tcp://IP:PORT")


def check_launch(args) -> int:
    """Fill in the defaults, validate the launch flags; returns the world size."""
    if args.init_method is not None and (cli.given(args, "ip") or args.port is not None):
        raise cli.UsageError(f"--init-method {args.init_method} names the rendezvous itself: leave out "
                             "--ip and --port (they make tcp://IP:PORT when --init-method is not given)")
    # torch.distributed.launch passes --local-rank; torchrun sets TORCHELASTIC_RUN_ID, and its store variables,
    # which 2.11's workers would read for a store that nobody serves here.
    if args.local_rank is not None or "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = f"--local-rank {args.local_rank}" if args.local_rank is not None else "torchrun"
        raise cli.UsageError(f"{launcher}: this script starts and numbers its own processes (--nproc-per-node); "
                             "run it with plain python, not a launcher (torchrun runs distributed.py)")
    device_type = dist_utils.device_type(args.device, distributed=True)  # what no process group can use
    gpus = 0 if device_type == "cpu" else torch.accelerator.device_count()
    args.nproc_per_node = args.nproc_per_node or gpus or 2
    if args.node_rank >= args.nodes:
        raise cli.UsageError(f"--node-rank {args.node_rank} with --nodes {args.nodes}: "
                             f"node ranks go from 0 to {args.nodes - 1}")
    world_size, given_url = args.nodes * args.nproc_per_node, args.init_method is not None
    if not given_url:
        if args.nodes > 1 and not cli.given(args, "ip"):
            raise cli.UsageError(f"--nodes {args.nodes} needs --ip: node 0's address, which every node reaches, "
                                 "the same on every node")
        if args.nodes > 1 and args.port is None:
            raise cli.UsageError(f"--nodes {args.nodes} needs --port: the same free port of node 0 "
                                 "on every node, e.g. --port 29500")
        args.port = args.port or free_port(args.ip)
        args.init_method = f"tcp://{f'[{args.ip}]' if ':' in args.ip else args.ip}:{args.port}"  # IPv6: in brackets
    url, host, port = urlparse(args.init_method), None, None
    if url.scheme == "tcp":
        with contextlib.suppress(ValueError):  # a port that is not a number
            host, port = url.hostname, url.port
        if not host or not port:
            raise cli.UsageError(f"--init-method {args.init_method}: expected tcp://HOST:PORT")
    elif url.scheme != "file":
        raise cli.UsageError(f"--init-method {args.init_method}: use tcp://HOST:PORT or file:///PATH")
    elif url.netloc or not url.path.startswith("/"):
        raise cli.UsageError(f"--init-method {args.init_method}: expected file:///ABSOLUTE/PATH")
    # A refusal left beside the rendezvous file before this run's processes started. One of this node's ranks'
    # is an earlier run's, which every rank of this one would take for its own: removed. Another node's is this
    # run's, said at once, or an earlier run's (node 0 removes the file only once its own processes ran): node 0
    # names it below.
    refused, left = lifecycle.refusal_file(url.path), None
    if url.scheme == "file" and os.path.exists(refused):
        with open(refused, errors="replace") as f:
            peer, _, line = f.read().partition("\n")
        if not (peer.isdigit() and int(peer) // args.nproc_per_node == args.node_rank):
            left = peer, line
        elif not args.check_args:
            with contextlib.suppress(FileNotFoundError):
                os.remove(refused)
    if args.nodes > 1 and not args.check_args:  # from here on the other nodes hear of a refusal (rank 0 is node 0's)
        dist_utils.tell_refusals_to(dist_utils.DistEnv(args.node_rank * args.nproc_per_node, 0, world_size,
                                                       args.nproc_per_node, distributed=True,
                                                       init_method=args.init_method))
    if gpus and args.nproc_per_node > gpus:
        raise cli.UsageError(f"--nproc-per-node {args.nproc_per_node} but only {gpus} GPU{'s' if gpus != 1 else ''} "
                             f"visible: use {gpus} or fewer (one process per GPU), or --device cpu", met_by="node")
    if url.scheme == "tcp" and args.node_rank == 0:  # rank 0 listens there: check now that it can
        try:
            bind_port(host, port, "--init-method" if given_url else "--ip")
        except cli.UsageError as refusal:
            if args.nodes == 1 or args.check_args:  # (--check-args: no other node runs)
                raise
            raise cli.UsageError(f"{refusal}. The other nodes hear of a refusal only at {host}:{port}, so not of "
                                 "this one, and wait until their --dist-timeout: stop them") from None
    if url.scheme == "file" and not os.path.isdir(os.path.dirname(url.path) or "/"):
        raise cli.UsageError(f"--init-method {args.init_method}: directory {os.path.dirname(url.path)} does not exist")
    # A crashed run's file would be joined as this run's (several nodes: a peer may have made it; node 0
    # removes it at the end of each run, Supervisor).
    if url.scheme == "file" and args.nodes == 1 and os.path.exists(url.path) and os.path.getsize(url.path) > 0:
        raise cli.UsageError(f"--init-method {args.init_method}: the file exists (left by an earlier "
                             "run?); delete it or name a new file")
    if left and args.node_rank == 0:
        raise cli.UsageError(f"rank {left[0]} refused to start: {left[1]} (as {refused} says; if an earlier run "
                             "left it, delete it)")
    if args.nodes > 1:
        flag = "--ip" if cli.given(args, "ip") else "--init-method"
        dist_utils.check_network(host, torch.device(device_type), flag=flag)
    return world_size


def _bind(host, port) -> int:
    """Bind `port` as rank 0's store will, on every address (TCPStore's server listens on all: a port that another
    program holds on one address is taken), once `host` is known to be this machine's; let go. SO_REUSEADDR: a
    port in TIME_WAIT is free."""
    family = socket.AF_INET if ":" not in host and network.resolve(host) else socket.AF_INET6  # a name: IPv4 first
    if not network.resolve(host, family):  # (and a malformed name, which getaddrinfo meets with a UnicodeError)
        raise socket.gaierror(f"cannot resolve {host}")
    if network.own_address(host) is None:  # not a bind: any address binds under net.ipv4.ip_nonlocal_bind=1
        raise OSError(errno.EADDRNOTAVAIL, "not this machine's")
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        return s.getsockname()[1]


def bind_port(host, port=0, flag="--ip") -> int:
    """_bind, bad input raised as UsageError (`flag` named host); returns the port (port 0: any free one)."""
    try:
        return _bind(host, port)
    except socket.gaierror:
        raise cli.UsageError(f"cannot resolve {host} ({flag})") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise cli.UsageError(f"port {port} on {host} is already in use; choose another "
                                 f"--port, e.g. --port {free_port(host)}") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise cli.UsageError(f"{host} is not an address of this machine: node 0 (--node-rank 0) "
                                 f"must run on the host that {flag} names") from None
        raise cli.UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def ephemeral_ports() -> range:
    """The ports the kernel hands out to outgoing connections and to bind(port 0)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
        return range(low, high + 1)
    return range(32768, 61000)  # Linux's default


def free_port(host, tries=100) -> int:
    """A port free on host now, for rank 0's store, outside the kernel's ephemeral range: rank 0 listens on it
    seconds later, and meanwhile an outgoing connection may take an ephemeral one (bind(port 0)'s was, once)."""
    ephemeral = ephemeral_ports()
    span = range(20000, ephemeral.start) if ephemeral.start > 21000 else range(ephemeral.stop, 65536)
    for _ in range(tries if len(span) > 1000 else 0):
        try:
            return _bind(host, secrets.choice(span))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                break  # not a busy port (a bad address): bind_port says what is wrong
    return bind_port(host)  # or no room outside the range: any free port


class Supervisor:
    """The parent's side of a spawned run: `with Supervisor(args) as s:` start the workers with
    s.errors among their arguments, then s.watch(the context mp.spawn returned)."""

    def __init__(self, args):
        # Where a worker leaves its bad-input line (worker_exit): ERRORS.LOCAL_RANK, made only if there is
        # one, removed once read, as mp.spawn passes a traceback back: a launcher killed outright leaves
        # nothing (a folder would stay; a multiprocessing queue's semaphores are reported as leaked).
        self.errors = os.path.join(tempfile.gettempdir(), f"distributed_mp-{os.getpid()}-{secrets.token_hex(6)}")
        self.args, self.workers, n = args, None, args.nproc_per_node
        # As torchrun does: each process would take every core for its CPU work (OpenMP's default), and several
        # on one node would slow each other down, on the CPU by tens of times. The workers read it as they start.
        threads = n > 1 and "OMP_NUM_THREADS" not in os.environ
        if threads:
            os.environ["OMP_NUM_THREADS"] = "1"
        # Two runs started at once on one --port both pass check_launch; one's rank 0 fails to listen, its other
        # ranks join the other run's store, and there meet its ranks (gloo paired them across the runs: seen) unless
        # their keys differ (lifecycle.attempt_prefix). Several nodes would need one ID on every node: none is known.
        if args.nodes == 1:
            os.environ["SPAWNED_RUN_ID"] = secrets.token_hex(6)
        if args.node_rank == 0:
            print(f"starting {n} process{'es' if n > 1 else ''} on node 0 of {args.nodes} (world size "
                  f"{args.nodes * n}), rendezvous at {args.init_method}"
                  + ("; OMP_NUM_THREADS=1 in each, as torchrun sets it" if threads else ""), flush=True)
        # From here on a refusal is a worker's, told by that worker (worker_exit), which exit_like raises here
        # again: told once more, after every worker is gone, it would hold the job's port for a store of its
        # own (a corrected rerun: "port in use") or leave a file:// refusal that would end the next run.
        lifecycle.meets_at(None, 0, 1)  # no one to tell

    def __enter__(self):
        return self

    def watch(self, workers):
        """Wait for the workers, passing stop signals on; end as the first of them that failed."""
        self.workers = workers
        forward_stop_signals(workers)
        try:
            # When one fails, the others get 10 s to fail on their own (the same bad input), then end.
            while not workers.join(grace_period=10):
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            exit_like(err, self.args, self.errors)

    def __exit__(self, *exc_info):
        # The workers' lines; mp.spawn's traceback files, which PyTorch reads and never removes. On node 0, whose
        # workers (rank 0 among them) are gone, so the job is over: the file store's file, which the next run on the
        # same path would join and take stale addresses from (FileStore removes it as its last user goes, which the
        # workers' os._exit skips: lifecycle.leave), and a refusal's file. After a run that ended well no rank uses
        # the store any more: rank 0 waited (2 s at most) for each one's "left" (distributed.cleanup).
        leftovers = [*error_files(self.errors), *(getattr(self.workers, "error_files", None) or [])]
        if self.args.init_method.startswith("file://") and self.args.node_rank == 0:
            path = urlparse(self.args.init_method).path
            leftovers += [path, lifecycle.refusal_file(path)]
        for path in leftovers:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


@contextlib.contextmanager
def worker_exit(errors, local_rank):
    """Around a worker's life: bad input, which every rank meets, goes to a file beside `errors` for the
    parent's one line and to the other ranks (lifecycle.tell_the_job), status 2; a stop on a signal is 0;
    then lifecycle.leave. Any other exception goes to mp.spawn, which shows the parent its traceback."""
    code, message = 0, None
    try:
        yield
    except cli.UsageError as err:
        with open(f"{errors}.{local_rank:05d}", "x") as f:  # closed before this process exits
            f.write(str(err))
        lifecycle.tell_the_job(str(err))
        code = 2
    except SystemExit as stop:  # a stop on a signal (run.step_done), a join that failed, a script's own sys.exit
        code, message = lifecycle.exit_status(stop)
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler: 130 as in a shell, not mp.spawn's 0
        code = 130
    except Exception as err:
        bus_error = lifecycle.bus_error_message(err)  # a loader worker that ran out of shared memory
        # Now, not at exit: mp.spawn's sys.exit(1) runs multiprocessing's exit, which joins the loader workers
        # (which ignore its SIGTERM) before any atexit handler: the rank would hang there. See lifecycle.run_main.
        lifecycle.kill_loader_workers(wait_s=5.0)
        if bus_error is None:
            raise
        code, message = 1, cli.error_line(bus_error)
    lifecycle.leave(code, message)  # the work is done: skip the interpreter's teardown (see lifecycle.leave)


def forward_stop_signals(workers):
    """Pass the stop signals on to the workers, as torchrun does: they checkpoint at an agreed step
    and exit 0 (utils/run.py), and this parent, alive, reports their status and cleans up after them."""
    def forward(signum, frame):
        for process in workers.processes:  # not pids(): a worker reaped already may have left its pid to another
            if process.is_alive():  # not reaped: only this thread reaps, so its pid stays its own until then
                os.kill(process.pid, signum)
    for sig in lifecycle.stop_signals():
        signal.signal(sig, forward)


def exit_like(err, args, errors):
    """End as the failed worker did: bad input in one line and 2, a bug with its traceback, else its status."""
    rank = args.node_rank * args.nproc_per_node + err.error_index
    if paths := error_files(errors):  # bad input that only the workers could see: the lowest local rank's line
        with open(paths[0]) as f:
            raise cli.UsageError(f.read()) from None
    if isinstance(err, mp.ProcessExitedException) and (err.exit_code == 2 or err.exit_code - 128 in lifecycle.SIGNALS):
        # 2: the job's bad input, met by another rank: the worker has said it (distributed.joining);
        # 128 + a stop signal: stopped while joining, which the worker said; 130 is also a Ctrl-C before the
        # join, which says nothing, as in a plain `python` run
        sys.exit(err.exit_code)
    if isinstance(err, mp.ProcessRaisedException):
        cli.print_line(f"{err}".strip() + f"\n(in global rank {rank})")  # what sys.exit(text) prints, in one write
        sys.exit(1)
    cli.print_line(cli.error_line(f"{err.msg} (global rank {rank})"))
    sys.exit(err.exit_code if err.exit_code > 0 else 128 - err.exit_code)


def error_files(errors):
    """The bad-input lines the workers wrote (worker_exit), lowest local rank first."""
    return sorted(glob.glob(glob.escape(errors) + ".[0-9]*"))
