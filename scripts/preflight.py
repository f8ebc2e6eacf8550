r"""Pre-flight check: is this machine (or this set of nodes) ready for a long training job?

A few seconds before hours of training. One node, one process per local GPU (2 CPU processes
without one), started by the script itself:

    python scripts/preflight.py
    python scripts/preflight.py --workers 8 --batch-size 1024 --sample-shape 3,224,224 --sample-dtype float32

Several nodes: first each node alone, in seconds, against the job's rendezvous endpoint (does its
name resolve to an address the others reach, would torchrun's c10d rendezvous recognise the
endpoint as this node, which interface gloo and NCCL would take, does the endpoint answer):

    python scripts/preflight.py --rdzv-endpoint HOST_OF_NODE_0:29500

then across the nodes, launched as the job will be so that it crosses the job's network: through
scripts/torchrun_bounded.py, as launch_multi_node.sh and slurm.sbatch start the job, which settles
each node's is_host, --local_addr and GLOO_SOCKET_IFNAME (bare torchrun needs them by hand:
tutorials/06-beyond-one-machine.md):

    python scripts/torchrun_bounded.py --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE_0:29500 --rdzv-id=preflight scripts/preflight.py --workers 8

It reports the versions (Python, PyTorch, CUDA, cuDNN, NCCL), the devices and their memory, peer
access and a copy between local GPUs, a timed all-reduce of the model's gradient (bus bandwidth),
/dev/shm and cores per process against --workers, the rendezvous port and the NCCL_*/GLOO_*
variables. Every communication step is bounded by --timeout: a broken network ends with a message.

Give it the training job's own --batch-size (GLOBAL), --workers and --model. Exit status: 0 all
is well, 1 problems (each with its fix, at the end), 2 bad arguments. Only global rank 0 prints.
"""
import argparse
import contextlib
import datetime
import errno
import json
import math
import multiprocessing
import os
import platform
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

# `python scripts/preflight.py` puts scripts/ on sys.path, not the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT as C10D_PORT  # noqa: E402

from models import MODEL_NAMES, build_model  # noqa: E402
from utils import cli, distributed as dist_utils, lifecycle, network, spawn  # noqa: E402
from utils.cli import UsageError  # noqa: E402
from utils.data import NUM_CLASSES, cpu_limits, loader_workers  # noqa: E402  (NUM_CLASSES: the gradient's size)

DEFAULT_PORT = 29500      # torchrun's --master-port and the launch scripts' default rendezvous port
STORE_PORT_FIX = ("let the nodes reach each other on every TCP port: torchrun's c10d rendezvous serves the ranks' "
                  "store at a port it picks on node 0, not the endpoint's, and gloo and NCCL pick ports of their own")
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_GLOO_")
NVIDIA_DRIVER = "/proc/driver/nvidia/version"  # present where NVIDIA's kernel driver is loaded
GiB = 2**30
PREFETCH = 2  # batches each loader worker keeps ready: the training scripts' loaders keep DataLoader's default


# --- arguments ------------------------------------------------------------------------

VALUE_BYTES = {"uint8": 1, "float32": 4}


def sample_shape(text):
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes separated by commas (3,32,32), got {text!r}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"every size must be at least 1, got {text!r}")
    return shape


def endpoint(text):
    """HOST[:PORT], an IPv6 address in brackets: [ADDRESS]:PORT; without a port, c10d's default, as torchrun."""
    if text.endswith(":"):  # torchrun refuses an empty port; the default would check another endpoint
        raise argparse.ArgumentTypeError(f"{text!r} ends with a colon: give the port after it, or leave both out")
    if text.startswith("["):
        host, bracket, port = text[1:].partition("]")
        if not bracket or port and not port.startswith(":"):
            raise argparse.ArgumentTypeError(f"expected [IPV6 ADDRESS]:PORT, got {text!r}")
        port = port[1:]
    elif text.count(":") > 1:  # torchrun splits at the last colon too (parse_rendezvous_endpoint)
        host, _, port = text.rpartition(":")
        meant = f"[{host}]:{port}" if network.is_address(host) and port.isdigit() else f"[{text}]:PORT"
        raise argparse.ArgumentTypeError(f"{text} is a bare IPv6 address, which torchrun reads as host {host!r} "
                                         f"and port {port}: write it in brackets, {meant}")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise argparse.ArgumentTypeError(f"expected HOST or HOST:PORT, got {text!r}")
    return host, cli.port(port) if port else C10D_PORT


def build_parser():
    # utils.cli's parser: a bad flag is one line on stderr and exit status 2, printed by rank 0 only.
    parser = cli.Parser(description=__doc__.strip().splitlines()[0], formatter_class=cli.Help)
    g = parser.add_argument_group("the training job to check (pass its own values)")
    g.add_argument("--workers", type=cli.non_negative_int, default=None,
                   help="DataLoader worker processes per training process (default: the training scripts' default "
                        "on each node, min(4, cores per process))")
    g.add_argument("--batch-size", type=cli.positive_int, default=128,
                   help="GLOBAL batch, as in the training scripts: each process loads batch-size / processes")
    g.add_argument("--sample-shape", type=sample_shape, default="3,32,32", metavar="C,H,W",
                   help="shape of one training sample as the loader yields it (CIFAR's by default)")
    g.add_argument("--sample-dtype", choices=sorted(VALUE_BYTES), default="uint8",
                   help="its values: uint8 as our CIFAR data hands them over (normalised later, on the "
                        "device), float32 as torchvision's ToTensor makes them")
    g.add_argument("--model", choices=MODEL_NAMES, default="resnet18",
                   help="the all-reduce moves this model's gradient")
    g = parser.add_argument_group("the check")
    g.add_argument("--nproc", type=cli.positive_int, default=None,
                   help="processes to start under plain python (default: one per local GPU, 2 on a CPU); "
                        "under torchrun the launcher's processes are used")
    g.add_argument("--shm-dir", default=lifecycle.SHM_DIR,
                   help="where the loader workers' shared memory lives")
    g.add_argument("--port", type=cli.port, default=None,
                   help=f"rendezvous port the training job will use, checked on this node; without it "
                        f"{DEFAULT_PORT} under plain python, none under torchrun (whose own port is in use)")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", type=endpoint, default=None, metavar="HOST[:PORT]",
                   help="the multi-node job's rendezvous endpoint (torchrun's --rdzv-endpoint, node 0): under "
                        "plain python, check this node against it (name resolution, interfaces, the port)")
    g.add_argument("--timeout", type=cli.seconds, default=30.0, metavar="SECONDS",
                   help="limit for each communication step (start-up, joining, peer copies, all-reduce)")
    g.add_argument("--iters", type=cli.positive_int, default=10, help="timed all-reduces, after one warm-up")
    return parser


@dataclass(frozen=True)
class Role:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int              # node rank (torchrun's GROUP_RANK)
    launcher: str          # "python" or "torchrun"
    nodes: int = 1         # nodes in the job (torchrun's GROUP_WORLD_SIZE)


def local_devices() -> tuple:
    """(device type, count) of the devices that take one process each: none on the CPU, nor on MPS,
    which no collective backend serves (its processes then run on the CPU, with gloo)."""
    kind = dist_utils.device_type()
    return ("cpu", 0) if kind in ("cpu", "mps") else (kind, torch.accelerator.device_count())


def validate(args, job: dist_utils.DistEnv):
    """Bad input that argparse cannot see: one line and exit status 2, before any process starts."""
    if not os.path.isdir(args.shm_dir) and args.shm_dir != lifecycle.SHM_DIR:
        raise UsageError(f"--shm-dir {args.shm_dir} is not a directory")
    kind, count = local_devices()
    if job.distributed:
        if args.nproc is not None:
            raise UsageError("--nproc is for plain python; under torchrun use --nproc_per_node")
        if args.rdzv_endpoint is not None:
            raise UsageError("--rdzv-endpoint is for plain python (one node, before the job); under torchrun "
                             "the check crosses the network torchrun's own rendezvous uses")
        if count:  # the run's own rule and words (torchrun --virtual-local-rank: one visible device per worker)
            dist_utils.pick_device(job.local_rank, job.local_world_size, distributed=True)
    elif count and (args.nproc or 0) > count:
        raise UsageError(f"--nproc {args.nproc} but only {count} {kind} device{'s' if count != 1 else ''} visible "
                         f"(one process per device): use --nproc {count} or fewer")


# --- facts: what each process finds on its own, no communication --------------------------

def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "hip": torch.version.hip, "cudnn": None, "nccl": None}
    with contextlib.suppress(RuntimeError):
        out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if torch.version.cuda or out["hip"]:
        with contextlib.suppress(RuntimeError, AttributeError):  # a build without NCCL
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def host_memory() -> tuple:
    """(available, total) bytes of RAM (Linux; (None, None) elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            info = {key: int(value.split()[0]) * 1024 for key, value in (line.split(":", 1) for line in f)}
    except (OSError, ValueError):
        return None, None
    return info.get("MemAvailable"), info.get("MemTotal")


def nvidia_driver():
    """The loaded NVIDIA driver's version line, unless CUDA_VISIBLE_DEVICES hides its GPUs on purpose
    (empty, or -1); else None. Asked where PyTorch finds no GPU: a driver older than PyTorch's CUDA,
    a container without the GPUs, or a PyTorch without CUDA, each of which would train on the CPU."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1"):
        with contextlib.suppress(OSError), open(NVIDIA_DRIVER) as f:
            return f.readline().strip()
    return None


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "CPU"


def shm_facts(path) -> dict:
    out = {"path": path, "exists": os.path.isdir(path), "free": None, "total": None, "fstype": None}
    if not out["exists"]:
        return out
    st = os.statvfs(path)
    out["free"], out["total"] = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    # The file system that holds the path: the longest mount point that contains it.
    real, best = os.path.realpath(path), ""
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            mount = fields[1].replace("\\040", " ")
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, out["fstype"] = mount, fields[2]
    return out


def port_facts(port) -> dict:
    """Can a rendezvous store listen on `port` here? (It binds all interfaces, as TCPStore does.)"""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:  # a port outside the ephemeral range, which connections may take
                return {"port": port, "free": False, "suggest": spawn.free_port(host)}
            if family == socket.AF_INET:  # EACCES (a port below 1024 for a user), ...; no IPv6 here is no problem
                return {"port": port, "free": False, "error": err.strerror or str(err)}
    return {"port": port, "free": True}


def endpoint_answers(host, port, seconds=3.0) -> str:
    """How host:port answers a TCP connection from here: "listening", "refused" (nothing listens yet,
    as at a job's endpoint before the job; or a firewall that rejects, as iptables' REJECT does), or why not."""
    try:
        with socket.create_connection((host, port), timeout=seconds):
            return "listening"
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return f"no answer within {seconds:g} s"
    except OSError as err:
        return err.strerror or str(err)


def network_facts(role: Role, args, device) -> dict:
    """This node as the others see it: its name, the address gloo will listen on, the
    interface that reaches the rendezvous host, and utils/network.py's findings, the run's
    own decision. The rendezvous host: --rdzv-endpoint under plain python; under torchrun
    MASTER_ADDR, when the job has several nodes."""
    name = socket.gethostname()
    known = network.interfaces()
    gloo_address, gloo_why = network.gloo_listens_on(known)
    gloo_interface = next((i for i, a in known.items() if a == gloo_address),
                          "lo" if gloo_address and network.is_loopback(gloo_address) else None)
    out = {"hostname": name, "resolves": network.resolve(name), "interfaces": known,
           "gloo": {"address": gloo_address, "interface": gloo_interface, "why": gloo_why},
           "nccl": os.environ.get("NCCL_SOCKET_IFNAME"), "peer": None, "findings": []}
    peer, flag, findings = None, "MASTER_ADDR", []
    if role.launcher == "python" and args.rdzv_endpoint is not None:
        (peer, port), flag = args.rdzv_endpoint, "the rendezvous endpoint"
        findings += endpoint_findings(peer)
    elif role.launcher == "torchrun" and role.world_size > role.local_world_size:
        peer = os.environ.get("MASTER_ADDR")
    if peer is not None:
        here = network.own_address(peer) is not None
        # peer_addresses: how this node resolves it (the others may differ)
        out.update(peer=peer, peer_addresses=network.resolve(peer), peer_is_here=here,
                   toward=list(network.route_toward(peer, known)))
        findings += network.findings(peer, uses_gloo=device.type == "cpu", flag=flag)  # accelerators: NCCL, no gloo
        if role.launcher == "python":  # --rdzv-endpoint
            out["endpoint"] = {"host": peer, "port": port, "here": here}
            if not here and out["peer_addresses"]:
                out["endpoint"]["answers"] = endpoint_answers(peer, port)
    out["findings"] = [{"certain": f.certain, "what": f.what, "fix": f.fix} for f in findings]
    return out


def endpoint_findings(endpoint: str) -> list:
    """The trap of torchrun's c10d rendezvous, for a node given the job's --rdzv-endpoint: the
    agent hosts the store where the endpoint is "localhost", a loopback address, this host's name
    or an address that name resolves to (torch.distributed.elastic.rendezvous.utils.
    _matches_machine_hostname, asked here); an address of this host that its name does not
    resolve to is not recognised, and nobody hosts the store. An endpoint that is not this host's is
    not asked about: an agent that took itself for its host would serve a store nobody uses, and
    connect to the endpoint's as the others do (c10d_rendezvous_backend._create_tcp_store)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    here, name = network.own_address(endpoint), socket.gethostname()  # the endpoint's address that is this host's
    if not here:
        return []
    try:
        if _matches_machine_hostname(endpoint):
            return []
        what = (f"torchrun's c10d rendezvous will not host its store here: it recognises itself by its name, and "
                f"{name} resolves to {', '.join(network.resolve(name))}; every node then waits for a store that "
                "nobody serves, and fails about 2 minutes later with RendezvousConnectionError")
    except OSError:  # its getaddrinfo of this host's own name, outside any try in torch (2.11 to 2.14)
        what = (f"{name}, this host's name, does not resolve: torchrun's c10d rendezvous looks it up to tell "
                "whether to host the store, and fails here at once (socket.gaierror)")
    return [network.Finding(
        True, f"this host is the rendezvous endpoint {endpoint}, but {what}",
        f"map {name} to {here} in /etc/hosts; or add --rdzv-conf is_host=1 to torchrun on this node only "
        "(scripts/torchrun_bounded.py, which the launchers use, does); or use the static rendezvous: "
        f"--master-addr {endpoint} --master-port PORT --node-rank 0 here (1, 2... elsewhere)")]


def rank_facts(role: Role, args, device) -> dict:
    facts = {"rank": role.rank, "node": role.node, "host": socket.gethostname(), **versions(),
             "device": str(device), "device_name": cpu_model() if device.type == "cpu" else
             dist_utils.device_name(device)}
    # (free, total) bytes of this rank's device, seen by all processes on it; host RAM for the CPU
    facts["mem_free"], facts["mem_total"] = (host_memory() if device.type == "cpu" else
                                             torch.accelerator.get_memory_info(device.index))
    if role.local_rank == 0:  # the node's own facts, once per node
        kind, count = local_devices()
        affinity, quota = cpu_limits()  # the cores the training scripts count
        facts["node_facts"] = {
            "local_world_size": role.local_world_size,
            "devices": [dist_utils.device_name(torch.device(kind, i)) for i in range(count)],
            # [i][j]: device i can read and write device j's memory directly (None: not a CUDA/ROCm node)
            "peer_access": [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(count)]
                            for i in range(count)] if kind == "cuda" and count > 1 else None,
            "nvidia_driver": None if count else nvidia_driver(),
            "shm": shm_facts(args.shm_dir),
            "cpus": {"affinity": affinity, "quota": quota, "cores": min(affinity, quota or affinity)},
            # --workers, or the training scripts' own default here (they count the cores as this process does)
            "workers": loader_workers(argparse.Namespace(workers=args.workers), role),
            "ram": host_memory(),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
            "interfaces": sorted(name for _, name in socket.if_nameindex()),
            "network": network_facts(role, args, device),
        }
    if role.rank == 0:
        endpoint = facts["node_facts"]["network"].get("endpoint")  # --rdzv-endpoint, under plain python
        # An endpoint on another node: its port is that node's to check.
        if (endpoint is None or endpoint["here"]) and (role.launcher == "python" or args.port is not None):
            facts["port"] = port_facts(args.port or (endpoint["port"] if endpoint else DEFAULT_PORT))
        if role.launcher == "torchrun":
            facts["rendezvous"] = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    return facts


# --- communication, every step bounded in time ------------------------------------------

class Hung(Exception):
    """A step did not finish within --timeout (the thread doing it is left behind)."""


def bounded(fn, seconds, device=None):
    """fn() in a daemon thread; its result, its exception, or Hung after `seconds`. A collective stuck
    in NCCL cannot be interrupted; waiting for it in another thread lets this process still report,
    and then leave with os._exit."""
    box = {}

    def target():
        try:
            if device is not None and device.type != "cpu":
                torch.accelerator.set_device_index(device.index)  # the current device is per thread
            box["value"] = fn()
        except BaseException as exc:  # reported, never lost in the thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise Hung(f"did not finish within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def copy_between_peers(count):
    """Copy 1 MB from every GPU to every other one and compare: some machines report
    peer access but deliver wrong data or never finish (IOMMU/ACS on consumer boards)."""
    wrong = []
    for i in range(count):
        source = torch.arange(2**18, dtype=torch.float32, device=f"cuda:{i}")
        for j in range(count):
            if i != j:
                copied = source.to(f"cuda:{j}")
                torch.cuda.synchronize(j)
                if not torch.equal(copied.cpu(), source.cpu()):
                    wrong.append([i, j])
    return wrong


def gradient_numel(model_name) -> int:
    with torch.device("meta"):  # shapes only, no memory and no initialisation
        model = build_model(model_name, NUM_CLASSES)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def time_all_reduce(numel, device, role: Role, iters) -> dict:
    # Called by every rank: all of them must reach it (a collective).
    t = torch.full((numel,), float(role.rank + 1), device=device)
    dist.all_reduce(t)  # warm-up: connections and communicators are made here, not in the timing
    correct = bool((t == role.world_size * (role.world_size + 1) / 2).all())
    t.zero_()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    synchronize(device)
    return {"seconds": (time.perf_counter() - start) / iters, "correct": correct}


def synchronize(device):
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def communicate(role: Role, args, device, node_facts) -> tuple:
    """Join the process group, copy between peers, time the all-reduce.
    Returns (result, hung): a hung rank must leave with os._exit."""
    result = {"backend": dist.get_default_backend_for_device(device)}
    steps = []
    if role.world_size > 1:
        # The process group's own timeout is longer than ours: NCCL's watchdog would end the
        # process without a word, our watchdog reports first.
        steps.append(("join", lambda: dist.init_process_group(
            result["backend"], store=dist.PrefixStore("pg", STORE), rank=role.rank, world_size=role.world_size,
            timeout=datetime.timedelta(seconds=args.timeout + 60))))
    if node_facts and node_facts["peer_access"]:
        steps.append(("peer_copy", lambda: copy_between_peers(len(node_facts["devices"]))))
    if role.world_size > 1:
        numel = gradient_numel(args.model)
        steps.append(("all_reduce", lambda: time_all_reduce(numel, device, role, args.iters)))
    for name, step in steps:
        try:
            result[name] = {"status": "ok", "value": bounded(step, args.timeout, device)}
        except Hung as exc:
            result[name] = {"status": "timed out", "error": str(exc)}
            return result, True
        except Exception as exc:  # a communication failure is a finding, not a crash
            result[name] = {"status": "error", "error": cli.first_line(exc, typed=True)}
            break
    return result, False


# --- the exchange: facts and results travel through the ranks' store ----------------------
# The store at MASTER_ADDR:MASTER_PORT (under torchrun's c10d rendezvous a port it picks on
# node 0, not the endpoint's; under plain python this script's parent): one connection per
# rank, which works even when the data network the collectives use does not.

STORE = None


def post(name, rank, value):
    STORE.set(f"{name}/{rank}", json.dumps(value))


def collect(name, world_size, seconds) -> dict:
    """{rank: value, or None for a rank that did not post within `seconds`}."""
    deadline = time.monotonic() + seconds
    out = {}
    for rank in range(world_size):
        key = f"{name}/{rank}"
        try:
            STORE.wait([key], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
            out[rank] = json.loads(STORE.get(key))
        except Exception:  # not posted in time (DistStoreError), or the store is gone
            out[rank] = None
    return out


def check_this_rank(role: Role, args) -> int:
    kind, _ = local_devices()
    device = torch.device("cpu") if kind == "cpu" else torch.device(kind, role.local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    facts = rank_facts(role, args, device)
    post("facts", role.rank, facts)
    # Every rank waits for every rank's facts: a start-up barrier that cannot hang.
    all_facts = collect("facts", role.world_size, args.timeout)
    result, hung = communicate(role, args, device, facts.get("node_facts")) if all(all_facts.values()) else ({}, False)
    post("result", role.rank, result)
    if role.rank == 0:
        results = collect("result", role.world_size, args.timeout + 10)
        code = 1 if report(all_facts, results, args, role) else 0
        post("verdict", 0, code)
        # Where rank 0 serves the store (a launcher without torchrun's agent store, as with
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), its exit takes the store away: a rank still reading the
        # verdict would fail. It waits, 10 s at most, until every rank that reported has read it.
        readers, until = sum(r is not None for r in results.values()) - 1, time.monotonic() + 10
        with contextlib.suppress(Exception):
            while STORE.add("read", 0) < readers and time.monotonic() < until:
                time.sleep(0.01)
    else:
        # Wait for rank 0 to print: under torchrun, a rank that ends first with an error
        # would get rank 0 killed before its report.
        verdict = collect("verdict", 1, 3 * args.timeout + 30)[0]
        code = 1 if verdict is None else verdict
        with contextlib.suppress(Exception):
            STORE.add("read", 1)
    sys.stdout.flush()
    sys.stderr.flush()
    if hung:
        os._exit(code)  # a thread is stuck in a collective: no clean teardown is possible
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


# --- the report (global rank 0) -----------------------------------------------------------

def size(n) -> str:
    if n is None:
        return "?"
    for unit, scale in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def nccl_interfaces(value, names) -> list:
    """The interfaces NCCL_SOCKET_IFNAME selects: names that begin with one of its prefixes (= exact
    names, ^ all but those). How gloo reads GLOO_SOCKET_IFNAME is utils/network.py's."""
    exclude = value.startswith("^")
    exact = value.lstrip("^").startswith("=")
    items = [v for v in value.lstrip("^=").split(",") if v]
    hit = [n for n in names if any(n == v or (not exact and n.startswith(v)) for v in items)]
    return [n for n in names if n not in hit] if exclude else hit


def report(all_facts, results, args, role) -> list:
    """Print the report (global rank 0); return the problems as (what, fix) pairs."""
    return Report(all_facts, results, args, role).run()


class Report:
    """One method per section, in the order printed; each adds the problems it finds."""

    def __init__(self, all_facts, results, args, role):
        self.all_facts, self.results, self.args, self.role = all_facts, results, args, role
        self.world = role.world_size
        self.present = {r: f for r, f in all_facts.items() if f}
        # One rank per node (its local rank 0) carries the node's facts.
        self.nodes = {f["node"]: f for f in self.present.values() if "node_facts" in f}
        self.missing = [r for r, f in all_facts.items() if not f]
        self.backend = (results.get(0) or {}).get("backend", "?")
        nets = {node: nf["network"] for node, _, nf in self.each_node()}
        # utils/network.py's findings on each node, after what the other nodes' facts say of it
        self.findings = {node: self.seen_by_the_others(node, net, nets) + net["findings"] for node, net in nets.items()}
        self.problems = []

    def problem(self, what, fix):
        self.problems.append((what, fix))

    def run(self) -> list:
        for section in (self.header, self.versions, self.devices, self.peer_to_peer, self.network, self.all_reduce,
                        self.shared_memory, self.cpu, self.port, self.environment):
            section()
        if self.problems:
            print(f"\n{len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}:")
            for i, (what, fix) in enumerate(self.problems, 1):
                print(f"  {i}. {what}\n     fix: {fix}")
        else:
            print("\nall checks passed")
        return self.problems

    def each_node(self):
        for node, f in sorted(self.nodes.items()):
            yield node, f, f["node_facts"]

    def header(self):
        f0, world, nodes = self.all_facts[0], self.world, self.role.nodes
        launched = ("plain python: this script started them" if self.role.launcher == "python"
                    else f"torchrun, rendezvous {f0.get('rendezvous')}")
        print(f"preflight: {world} process{'es' if world != 1 else ''} on {nodes} node{'s' if nodes != 1 else ''} "
              f"({launched}), backend {self.backend}")
        if self.missing:
            # Under torchrun every node passed the rendezvous before its ranks started; under plain
            # python the missing ranks are this script's own processes, which ended or are slow.
            self.problem(f"{self.ranks(self.missing)} did not report within --timeout {self.args.timeout:g} s",
                         (f"{STORE_PORT_FIX} (each node's own output says if its ranks could not reach "
                          f"{f0.get('rendezvous')})" if self.role.launcher == "torchrun" else
                          "a process that ended printed its error above")
                         + "; a slow start (busy file system) needs a larger --timeout")

    @staticmethod
    def ranks(ranks) -> str:
        return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"

    def versions(self):
        print("\nversions")
        for node, f, _ in self.each_node():
            cuda = f"CUDA {f['cuda']}" if f["cuda"] else (f"ROCm {f['hip']}" if f["hip"] else "no CUDA build")
            print(f"  node {node} ({f['host']}): Python {f['python']}, PyTorch {f['torch']}, {cuda}, "
                  f"cuDNN {f['cudnn'] or '-'}, NCCL {f['nccl'] or '-'}")
        for key, what in (("torch", "PyTorch"), ("nccl", "NCCL"), ("python", "Python")):
            seen = {f[key] for f in self.present.values()}
            if len(seen) > 1:
                self.problem(f"the processes run different {what} versions: {', '.join(sorted(map(str, seen)))}",
                             f"install the same {what} on every node (one container image or environment)")

    def devices(self):
        print("\ndevices")
        for node, f, nf in self.each_node():
            names = nf["devices"]
            listed = ", ".join(f"{i}: {n}" for i, n in enumerate(names))
            print(f"  node {node}: " + (f"{len(names)} device{'s' if len(names) != 1 else ''}: {listed}" if names
                                        else "no accelerator: the CPU, with gloo"))
            if nf["nvidia_driver"]:
                self.problem(f"node {node}: the NVIDIA driver is loaded ({nf['nvidia_driver']}), but PyTorch "
                             f"{f['torch']} finds no GPU: the job would run on the CPU",
                             f"nvidia-smi shows the newest CUDA the driver runs: it must be {f['cuda']} or newer "
                             "(else update the driver, or install a PyTorch built for that CUDA); in a container, "
                             "give it the GPUs (docker run --gpus all)" if f["cuda"] else
                             "install a PyTorch built for CUDA: this one is not")
        for rank, f in sorted(self.present.items()):
            free, total = f["mem_free"], f["mem_total"]
            print(f"  rank {rank} (node {f['node']}): {f['device']} {f['device_name']}, {size(free)} "
                  f"{'RAM available' if f['device'] == 'cpu' else 'free'} of {size(total)}")
            # Our own process holds a few hundred MB there; more is another job (or a leftover one).
            if f["device"] != "cpu" and free is not None and total and total - free > max(GiB, 0.10 * total):
                self.problem(f"{f['device']} on node {f['node']} already has {size(total - free)} of {size(total)} "
                             "in use by other processes",
                             "find and stop them (nvidia-smi lists them; a killed job may have left some)")

    def peer_to_peer(self):
        print("\npeer-to-peer (can device i read device j's memory directly?)")
        for node, f, nf in self.each_node():
            access = nf["peer_access"]
            if not access:
                count, kind = len(nf["devices"]), f["device"].split(":")[0]
                print(f"  node {node}: " + ("no accelerator: nothing to check" if not count else
                                            "one device: nothing to check" if count == 1 else
                                            f"{count} {kind} devices: checked on CUDA and ROCm GPUs only"))
                continue
            n = len(access)
            print(f"  node {node}:   " + " ".join(f"{j:>3}" for j in range(n)))
            for i in range(n):
                print(f"  {'':>9}{i:>3} " + " ".join(f"{'-' if i == j else ('yes' if access[i][j] else 'no'):>3}"
                                                  for j in range(n)))
            without = sum(not access[i][j] for i in range(n) for j in range(n) if i != j)
            if without:
                print(f"  {without} pair(s) without peer access: NCCL goes through host memory there "
                      "(slower, not an error)")
            copy = (self.results.get(f["rank"]) or {}).get("peer_copy")
            if copy and copy["status"] == "ok" and copy["value"]:
                self.problem(f"node {node}: a copy between GPUs returned wrong data for pairs "
                             f"{', '.join(f'{i}->{j}' for i, j in copy['value'])}",
                             "export NCCL_P2P_DISABLE=1 (and disable IOMMU/ACS in the BIOS for the lasting fix)")
            elif copy and copy["status"] != "ok":
                self.problem(f"node {node}: copying between GPUs {copy['status']}: {copy['error']}",
                             "export NCCL_P2P_DISABLE=1 (GPUs that report peer-to-peer but cannot use it); "
                             "disabling IOMMU/ACS in the BIOS is the lasting fix")
            elif copy:
                print("  a 1 MB copy between every pair arrived intact")

    def network(self):
        """Each node as the others see it; what cannot work is a problem, what may not is a
        note (and the likeliest cause if the all-reduce fails)."""
        print("\nnetwork (utils/network.py: how gloo chooses, and what keeps the nodes apart)")
        for node, _, nf in self.each_node():
            net = nf["network"]
            gloo, nccl = net["gloo"], net["nccl"]
            print(f"  node {node} ({net['hostname']}): its name resolves to {', '.join(net['resolves']) or 'nothing'}; "
                  f"gloo listens on {gloo['address']} ({gloo['interface'] or '?'}: {gloo['why']}); NCCL: "
                  + (f"NCCL_SOCKET_IFNAME={nccl}" if nccl else "its own choice (NCCL_DEBUG=INFO prints it)"))
            if net.get("peer") and net.get("peer_is_here"):
                print(f"  node {node}: {net['peer']}, where the nodes meet, is this node")
            elif net.get("peer"):
                interface, address = net.get("toward") or (None, None)
                print(f"  node {node}: {net['peer']} is reached through "
                      + (f"{interface} ({address})" if interface else "no interface found"))
            endpoint = net.get("endpoint")
            if endpoint and not endpoint["here"]:  # here: said above
                where = f"{endpoint['host']}:{endpoint['port']}"
                if endpoint.get("answers") in ("refused", "listening"):
                    print(f"  node {node}: the rendezvous endpoint {where} answers ("
                          + ("nothing listens yet, as before the job starts, or a firewall rejects the port)"
                             if endpoint["answers"] == "refused"
                             else "something listens already: the job's node 0, or one left running)"))
                elif endpoint.get("answers"):
                    self.problem(f"node {node} ({net['hostname']}) cannot reach the rendezvous endpoint {where}: "
                                 f"{endpoint['answers']}",
                                 f"check the address, the route (ip route get {endpoint['host']}) and the firewall "
                                 f"between the nodes (port {endpoint['port']}/tcp, and the ports gloo and NCCL open)")
            for finding in self.findings[node]:
                if finding["certain"]:
                    self.problem(f"node {node} ({net['hostname']}): {finding['what']}", finding["fix"])
                else:
                    print(f"  node {node}: note: {finding['what']} (fix: {finding['fix']})")

    def seen_by_the_others(self, node, net, nets) -> list:
        """On the node that MASTER_ADDR names (node 0 under torchrun, by its own name), the
        interface the others reach it by is the one holding the address they resolve that
        name to; gloo there must listen on it too. Only gloo: NCCL chooses its own interface."""
        if self.backend != "gloo" or not net.get("peer_is_here") or net["gloo"]["address"] is None:
            return []
        theirs = {other_net["peer_addresses"][0] for other, other_net in nets.items()
                  if other != node and other_net.get("peer_addresses")}
        wanted = {name for name, address in net["interfaces"].items() if address in theirs}
        if not wanted or net["gloo"]["interface"] in wanted:
            return []
        interface = sorted(wanted)[0]
        return [{"certain": False,
                 "what": f"the other nodes reach {net['peer']} at {net['interfaces'][interface]} ({interface}), but "
                         f"gloo listens here on {net['gloo']['address']} ({net['gloo']['interface']}: "
                         f"{net['gloo']['why']})",
                 "fix": f"export GLOO_SOCKET_IFNAME={interface}"}]

    def bad_interface_variables(self) -> list:
        """NCCL_SOCKET_IFNAME or GLOO_SOCKET_IFNAME that selects no interface of its node."""
        found = []
        for node, f, nf in self.each_node():
            env, net, bad = nf["env"], nf["network"], []
            if "NCCL_SOCKET_IFNAME" in env and nf["interfaces"] and \
                    not nccl_interfaces(env["NCCL_SOCKET_IFNAME"], nf["interfaces"]):
                bad.append(("NCCL_SOCKET_IFNAME", nf["interfaces"]))
            # gloo's reading is utils/network.py's (no address to listen on), whose findings already name it
            # on several CPU nodes: one bad value, one problem.
            if "GLOO_SOCKET_IFNAME" in env and net["gloo"]["address"] is None and \
                    not (net["peer"] and f["device"] == "cpu"):
                bad.append(("GLOO_SOCKET_IFNAME", list(net["interfaces"])))  # gloo needs an IPv4 address
            found += [(f"node {node}: {var}={env[var]} does not match its interfaces ({', '.join(names)})",
                       f"export {var}=<the interface that reaches the other nodes>, one of: {', '.join(names)}")
                      for var, names in bad]
        return found

    def all_reduce(self):
        print("\nall-reduce")
        args, world = self.args, self.world
        numel = gradient_numel(args.model)
        nbytes = numel * 4
        what = f"{nbytes / 1e6:.1f} MB ({args.model}'s gradient, {numel:,} float32)"
        if world == 1:
            print("  one process: nothing to all-reduce (start several: --nproc, or torchrun --nproc_per_node)")
            return
        if self.missing:  # no rank starts it without every rank's facts; the missing ranks are the problem
            print(f"  {what} over {world} processes: not attempted ({self.ranks(self.missing)} did not report)")
            return

        def failed_steps(res):
            return [(step, o) for step, o in res.items() if isinstance(o, dict) and o["status"] != "ok"]

        failed = {r: res for r, res in self.results.items()
                  if res is None or failed_steps(res) or "all_reduce" not in res}
        # Several nodes by the launcher, not by the nodes that reported: one may be silent.
        network_fix = self.role.world_size > self.role.local_world_size and (
            "set NCCL_SOCKET_IFNAME (GLOO_SOCKET_IFNAME with gloo) to the interface that reaches the other nodes and "
            "open the firewall between them")
        if not failed:
            timings = [res["all_reduce"]["value"] for res in self.results.values()]
            slowest = max(t["seconds"] for t in timings)  # the collective ends when its slowest rank does
            algbw = nbytes / slowest / 1e9
            busbw = algbw * 2 * (world - 1) / world
            print(f"  {what} over {world} processes: {slowest * 1e3:.2f} ms (slowest rank, mean of {args.iters}), "
                  f"algbw {algbw:.2f} GB/s, bus bandwidth {busbw:.2f} GB/s")
            print("  (bus bandwidth = algbw x 2(n-1)/n, the nccl-tests convention: comparable with the links' "
                  "speed whatever the number of processes)")
            wrong = [r for r, res in self.results.items() if not res["all_reduce"]["value"]["correct"]]
            if wrong:
                self.problem(f"the all-reduce gave a wrong sum on {self.ranks(wrong)}",
                             network_fix or "export NCCL_P2P_DISABLE=1 (peer-to-peer that corrupts data), "
                             "then look for hardware errors (nvidia-smi -q, dmesg)")
            return
        print(f"  {what} over {world} processes: FAILED")
        for rank, res in sorted(failed.items()):
            if res is None:
                print(f"  rank {rank}: no result within the timeout (stuck, or ended)")
            elif not failed_steps(res):
                print(f"  rank {rank}: did not take part (not every rank had started)")
            for step, outcome in failed_steps(res or {}):
                print(f"  rank {rank}: {step.replace('_', '-')} {outcome['status']}: {outcome['error']}")
        timed_out = any(res is None or any(o["status"] == "timed out" for _, o in failed_steps(res))
                        for res in failed.values())
        own_fixes = "; ".join(f"node {node} ({self.nodes[node]['node_facts']['network']['hostname']}): "
                              + " and ".join(dict.fromkeys(f["fix"] for f in found))
                              for node, found in self.findings.items() if found)
        # The likeliest cause first: a variable that names no interface, the network between
        # nodes (the nodes' own fixes, else the general one), peer-to-peer between GPUs, then
        # gloo's choice of address on one node.
        if self.bad_interface_variables():
            fix = "correct the *_SOCKET_IFNAME variable named below"
        elif network_fix:
            fix = own_fixes or network_fix + " (NCCL_DEBUG=INFO shows which interface it took)"
        elif any(nf["peer_access"] for _, _, nf in self.each_node()):
            fix = "export NCCL_P2P_DISABLE=1 (GPUs that hang with peer-to-peer); NCCL_DEBUG=INFO shows where it stops"
        elif self.backend == "gloo":
            fix = ("on one node: export GLOO_SOCKET_IFNAME=lo (gloo connects to the address the host name "
                   "resolves to: check /etc/hosts); TORCH_DISTRIBUTED_DEBUG=DETAIL shows more")
        else:
            fix = "rerun with NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL to see where it stops"
        self.problem(f"the all-reduce over {world} processes "
                     + (f"did not finish within {args.timeout:g} s" if timed_out else "failed"), fix)

    def shared_memory(self):
        print("\nshared memory (what the DataLoader workers hold: workers x prefetch x batch bytes per process)")
        args, world = self.args, self.world
        sample_bytes = math.prod(args.sample_shape) * VALUE_BYTES[args.sample_dtype] + 8  # + an int64 label
        per_process_batch = math.ceil(args.batch_size / world)
        eval_batch = 2 * per_process_batch  # the training scripts evaluate with twice the batch
        # The training and the evaluation loader: both keep their workers between epochs, and a training epoch
        # cut short leaves its prefetched batches while evaluation runs.
        # --rdzv-endpoint: this node alone, not knowing the job's processes, over which the GLOBAL batch is
        # divided; the check under torchrun across the nodes knows them.
        alone = self.role.launcher == "python" and args.rdzv_endpoint is not None
        if args.batch_size % world and not alone:
            multiple = max(world, args.batch_size // world * world)
            self.problem(f"--batch-size {args.batch_size} is not divisible by {world} processes "
                         "(the training scripts refuse it)", f"--batch-size {multiple} (a multiple of {world})")
        for node, _, nf in self.each_node():
            shm, local, workers = nf["shm"], nf["local_world_size"], nf["workers"]
            per_process = workers * PREFETCH * (per_process_batch + eval_batch) * sample_bytes
            need = per_process * local
            formula = ("what the loader workers need, and whether --batch-size divides, is checked under torchrun "
                       "across the nodes" if alone else
                       f"{workers} workers x {PREFETCH} x ({per_process_batch} training + "
                       f"{eval_batch} evaluation samples) x {sample_bytes:,} B = {size(per_process)} per process, "
                       f"{size(need)} for {local} on the node")
            if not shm["exists"]:
                print(f"  node {node}: no {shm['path']} (not Linux?): {formula}")
                continue
            print(f"  node {node}: {shm['path']} ({shm['fstype'] or '?'}) {size(shm['free'])} free of "
                  f"{size(shm['total'])}; {formula}")
            if workers and not alone and need > shm["free"]:
                ram = nf["ram"][1]
                lower = "lower --workers or --batch-size"
                if ram and need * 1.5 > ram:
                    fix = f"{lower}: {size(need)} is more than this node's memory can hold ({size(ram)} RAM)"
                else:
                    gib = max(1, math.ceil(need * 1.5 / GiB))  # with room for the processes' own shared tensors
                    fix = (f"in Docker: docker run --ipc=host (or --shm-size={gib}g); otherwise "
                           f"mount -o remount,size={gib}G {shm['path']}, or {lower}")
                self.problem(f"node {node}: {shm['path']} has {size(shm['free'])} free, the loader workers would "
                             f"hold {size(need)} (a DataLoader worker then dies with a bus error)", fix)

    def cpu(self):
        print("\nCPU (a core for each loader worker of each process: more would wait for one)")
        for node, _, nf in self.each_node():
            cpus, local, workers = nf["cpus"], nf["local_world_size"], nf["workers"]
            per = cpus["cores"] / local
            limit = f", container limit {cpus['quota']:g}" if cpus["quota"] else ""
            print(f"  node {node}: {cpus['cores']:g} cores usable ({cpus['affinity']} in the affinity mask{limit}) "
                  f"for {local} process{'es' if local != 1 else ''}: {per:.1f} per process; --workers {workers}")
            if per < 1:
                self.problem(f"node {node}: {local} processes share {cpus['cores']:g} cores",
                             f"start at most {math.floor(cpus['cores']) or 1} processes on this node")
            elif workers > per:
                self.problem(f"node {node}: --workers {workers} per process, with {per:.1f} cores per process",
                             f"--workers {math.floor(per)}")

    def port(self):
        print("\nrendezvous port")
        f0 = self.all_facts[0]
        if self.role.launcher == "torchrun":
            print(f"  {f0.get('rendezvous')} (the ranks' store, MASTER_ADDR:MASTER_PORT): reached by "
                  f"{len(self.present)} of {self.world} processes")
        port, endpoint = f0.get("port"), f0["node_facts"]["network"].get("endpoint")
        if not port and endpoint and not endpoint["here"]:
            print(f"  {endpoint['port']}: on {endpoint['host']}, another node: checked by its own preflight")
        if not port:
            return
        where = f"node {f0['node']} ({f0['host']})"
        if port["free"]:
            print(f"  {port['port']}: free on {where}")
            return
        if "error" in port:
            print(f"  {port['port']}: cannot listen on {where}: {port['error']}")
            self.problem(f"a store cannot listen on port {port['port']} on {f0['host']}: {port['error']}",
                         "use another port: torchrun --master-port PORT / --rdzv-endpoint HOST:PORT (1024 or above)")
            return
        print(f"  {port['port']}: IN USE on {where}")
        self.problem(f"port {port['port']} is already in use on {f0['host']} (another job, or one that did not end)",
                     f"stop it (ss -ltnp 'sport = :{port['port']}' names it) or use another port, e.g. "
                     f"torchrun --master-port {port['suggest']} / --rdzv-endpoint HOST:{port['suggest']}")

    def environment(self):
        print(f"\nenvironment ({', '.join(prefix + '*' for prefix in ENV_PREFIXES)})")
        envs = {node: nf["env"] for node, _, nf in self.each_node()}
        for node, env in envs.items():
            print(f"  node {node}: " + (" ".join(f"{k}={v}" for k, v in env.items()) or "none set"))
        for what, fix in self.bad_interface_variables():
            self.problem(what, fix)
        # An interface's name is each node's own (scripts/torchrun_bounded.py sets GLOO_SOCKET_IFNAME per node),
        # checked above against that node's interfaces; the rest must agree.
        shared = [{k: v for k, v in env.items() if not k.endswith("_SOCKET_IFNAME")} for env in envs.values()]
        if len({json.dumps(env, sort_keys=True) for env in shared}) > 1:
            self.problem("the nodes have different NCCL_*/GLOO_* variables (other than *_SOCKET_IFNAME)",
                         "export the same ones on every node (in the job script, not a login shell)")


# --- launching ------------------------------------------------------------------------

def connect_store(addr, port, world_size, timeout, host_it=False):
    global STORE
    store = dist.TCPStore(addr, port, world_size if host_it else None, host_it,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    STORE = dist.PrefixStore(f"preflight/{attempt}", store)  # apart from the launcher's own keys


def spawned(role: Role, args, port):
    """A process started by this script under plain python; `port`: where the store's port comes from."""
    if not port.poll(args.timeout):  # the process that started this one is gone
        sys.exit(1)
    connect_store("127.0.0.1", port.recv(), role.world_size, args.timeout)
    sys.exit(check_this_rank(role, args))


def start_local(args) -> int:
    """Plain python: start one process per local device (2 on a CPU) and wait for rank 0's verdict."""
    _, count = local_devices()
    nproc = args.nproc or count or 2
    # Without a device, fork: the processes start at once instead of importing torch again.
    # A GPU needs spawn (CUDA cannot be used in a process forked from one that touched it).
    method = "fork" if count == 0 and "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    # A pipe each (a queue's semaphore would be reported as leaked if this process were killed outright).
    ports = [context.Pipe(duplex=False) for _ in range(nproc)]
    processes = [context.Process(target=spawned, args=(Role(r, nproc, r, nproc, 0, "python"), args, ports[r][0]))
                 for r in range(nproc)]
    # Start-up (importing torch in every process) is not bounded by --timeout; this is the last resort.
    limit = 120 + 4 * args.timeout
    deadline = time.monotonic() + limit
    # Ctrl-C reaches the whole process group: this process answers it (exit status 130) and ends the others
    # (finally, below), which ignore it: they inherit SIG_IGN, which a spawned Python keeps (no KeyboardInterrupt).
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for p in processes:
            p.start()
        signal.signal(signal.SIGINT, interrupt)
        # This process hosts the rendezvous store, after the processes started (so that no fork copies its
        # server thread), on a port the system picks and hands them: --port is only examined, never taken,
        # and no other program can take the store's port between its choice and its use.
        store = dist.TCPStore("127.0.0.1", 0, None, True,
                              timeout=datetime.timedelta(seconds=args.timeout), wait_for_workers=False)
        for _, to_process in ports:
            to_process.send(store.port)
        while processes[0].exitcode is None and time.monotonic() < deadline:
            processes[0].join(0.2)
        code = processes[0].exitcode
        for p in processes[1:]:
            p.join(max(0.0, min(10.0, deadline - time.monotonic())))
        del store  # served until every process is done with it
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join()
    if code is None:
        print(f"preflight: rank 0 did not finish within {limit:g} s", file=sys.stderr)
        return 1
    if code not in (0, 1, 2):
        print(f"preflight: rank 0 ended with exit status {code} before its report", file=sys.stderr)
        return 1
    return code


def main(argv=None):
    args = build_parser().parse_args(argv)
    job = dist_utils.job_from_env()  # a RANK or WORLD_SIZE that cannot be right: one line, exit status 2
    validate(args, job)
    if not job.distributed:
        sys.exit(start_local(args))
    if not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        raise UsageError("WORLD_SIZE is set but MASTER_ADDR or MASTER_PORT is not: the launcher (torchrun) sets them")
    role = Role(job.rank, job.world_size, job.local_rank, job.local_world_size, dist_utils._env_int("GROUP_RANK", 0),
                "torchrun", dist_utils._env_int("GROUP_WORLD_SIZE", 1))
    # Under torchrun the agent hosts the rendezvous store (TORCHELASTIC_USE_AGENT_STORE);
    # with a launcher that does not, rank 0 hosts it, as env:// initialisation would.
    host_it = role.rank == 0 and job.store_by_rank_0
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    if not (port.isascii() and port.isdigit() and 0 < int(port) <= 65535):  # as utils/distributed.py's check_job
        raise UsageError(f"MASTER_PORT={port!r} is not a TCP port (1 .. 65535): the launcher (torchrun) sets it")
    if host_it and (refusal := network.store_elsewhere(addr)):  # it would serve the store there and join it there
        raise UsageError(refusal)  # as the run refuses it (utils/distributed.py, check_job)
    try:
        connect_store(addr, int(port), role.world_size, args.timeout, host_it=host_it)
    except RuntimeError as err:  # torch's DistNetworkError: no report can come from this rank
        # Why, as the run itself would say it: the port this rank was to serve taken (USE_LIBUV=0's wording
        # too); on several nodes, MASTER_ADDR (bare torchrun's c10d: node 0's name) unresolvable or loopback
        # here; else a firewall.
        busy = "address already in use" in str(err).lower()
        certain = [f.line for f in network.findings(addr, uses_gloo=False)
                   if f.certain] if job.several_nodes and not busy else []
        why = (f"port {port} is already in use on this host: stop what holds it (ss -ltnp 'sport = :{port}') or "
               "use another" if busy else (certain or [STORE_PORT_FIX])[0])
        if role.local_rank == 0:
            print(f"preflight: rank {role.rank} ({socket.gethostname()}) cannot {'serve' if busy else 'reach'} the "
                  f"ranks' store at {addr}:{port} ({cli.first_line(err, typed=True)}): {why}", file=sys.stderr)
        sys.exit(2 if busy else 1)
    sys.exit(check_this_rank(role, args))


if __name__ == "__main__":
    lifecycle.run_main(main)
