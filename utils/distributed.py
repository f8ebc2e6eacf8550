"""Process setup and the few helpers every rank needs.

Devices: this machine's accelerator when it has one (torch.accelerator: NVIDIA or
AMD GPUs with nccl, Intel GPUs with xccl), otherwise the CPU with gloo, with no code
change; --device cpu forces the CPU. The launcher tells us who we are through the
environment (torchrun: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT);
`python script.py` sets none of them and runs as a single process without a process
group.
"""
import contextlib
import datetime
import inspect
import os
import random
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .cli import UsageError, error_line, joined_a_group, print_line


@dataclass(frozen=True)
class DistEnv:
    rank: int               # global rank, 0 .. world_size-1
    local_rank: int         # rank within this node: picks the GPU
    world_size: int         # processes in the whole job
    local_world_size: int   # processes on this node
    device: torch.device
    distributed: bool       # a process group exists (wrap the model in DDP)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_ids(self):
        """DDP's device_ids: this rank's one device, or None on the CPU."""
        return None if self.device.type == "cpu" else [self.device.index]


def _env_int(name, default):
    """An integer the launcher set; anything else is a launch error, said in one line."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise UsageError(f"environment variable {name}={value!r} is not a rank or size: the launcher "
                         "(torchrun, srun) sets it; unset it to run one process with plain python")
    return number


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def accelerator_type():
    """This machine's accelerator as torch.device type ('cuda' for NVIDIA and AMD ROCm GPUs,
    'xpu' for Intel GPUs, 'mps' for Apple silicon, ...), or None: torch.accelerator asks the
    one PyTorch was built for, so no code here names a vendor."""
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator().type


def device_type(choice: str = "auto", distributed: bool = False) -> str:
    """The device type --device asks for, checked against this machine. `distributed`:
    the process joins a group (torchrun, mp.spawn)."""
    accelerator = accelerator_type()
    if choice == "cpu":
        return "cpu"
    if ":" in choice:  # each rank's index comes from its local rank
        raise UsageError(f"--device {choice}: name the type alone (--device {choice.split(':')[0]}); "
                         "each process takes the device of its local rank")
    if choice == "auto":
        kind = accelerator or "cpu"
    elif accelerator is None:
        raise UsageError(f"--device {choice}: PyTorch sees no accelerator on this machine "
                         "(torch.accelerator.is_available() is False): use --device cpu, or auto")
    elif choice != accelerator:
        raise UsageError(f"--device {choice}: this machine's accelerator is {accelerator}: "
                         f"use --device {accelerator}, cpu, or auto")
    else:
        kind = choice
    if kind == "mps" and distributed:
        # No backend moves MPS tensors between processes; DDP refuses them.
        raise UsageError("DDP does not run on Apple's MPS devices: train one process with plain python, "
                         "or several on the CPU with --device cpu")
    return kind


def device_count(choice: str = "auto") -> int:
    """How many devices of the --device type this node has (0 for the CPU)."""
    kind = device_type(choice)
    return 0 if kind == "cpu" else torch.accelerator.device_count()


def device_name(device: torch.device) -> str:
    """The device's product name for records and reports ("NVIDIA H100 80GB HBM3"); "cpu",
    or the device itself where its module cannot name it."""
    if device.type == "cpu":
        return "cpu"
    try:
        return torch.get_device_module(device).get_device_name(device)
    except (AttributeError, RuntimeError):
        return str(device)


def pick_device(local_rank: int, local_world_size: int, choice: str = "auto",
                distributed: bool = False) -> torch.device:
    kind = device_type(choice, distributed)
    if kind == "cpu":
        return torch.device("cpu")
    count = torch.accelerator.device_count()
    plural = "s" if count != 1 else ""
    gpus = f"GPU{plural}" if kind in ("cuda", "xpu") else f"{kind} device{plural}"
    fix = f"use --nproc_per_node={count} or fewer (one process per device), or --device cpu"
    # torchrun --virtual-local-rank shows each worker only its own GPU, as index 0: it sets
    # CUDA_VISIBLE_DEVICES to that one GPU and LOCAL_RANK=0, while LOCAL_WORLD_SIZE stays the
    # node's count (LocalElasticAgent._set_local_rank_env). The same view without the flag
    # (CUDA_VISIBLE_DEVICES=0 and 2 processes) is refused by the sibling, local rank 1, below.
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    own_device_only = count == 1 and local_rank == 0 and len(visible) == 1
    if local_rank >= count:  # this rank's device does not exist: its error, whoever else fails
        raise UsageError(f"local rank {local_rank} of {local_world_size} processes per node has no device: "
                         f"only {count} {gpus} visible: {fix}", met_by="rank")
    if local_world_size > count and not own_device_only:
        raise UsageError(f"{local_world_size} processes per node but only {count} {gpus} visible: {fix}",
                         met_by="node")
    return torch.device(kind, local_rank)


def setup(rank: int, world_size: int, local_rank: int, local_world_size: int,
          init_method: str = "env://", timeout_s: float = 1800.0, device: str = "auto") -> DistEnv:
    """Join the process group (nccl on NVIDIA and AMD GPUs, xccl on Intel's, gloo on the
    CPU) and pin this rank's device. device: --device (auto, cpu, or the accelerator's type).

    The timeout bounds how long a rank waits in a collective for a peer that died,
    so a failed job ends instead of hanging.
    """
    peer_host, store_address = _meeting_host(init_method), _store_address(init_method)
    try:
        device = pick_device(local_rank, local_world_size, device, distributed=True)  # before the watcher starts
        backend = dist.get_default_backend_for_device(device)
        if world_size > local_world_size:  # several nodes: a network setup that cannot work is refused now
            check_network(peer_host, {backend, "gloo"}, announce=local_rank == 0)  # gloo: the stop agreement's
    except UsageError as refusal:
        # The ranks of the other nodes would otherwise wait --dist-timeout to join: they read it (bounded_join).
        if world_size > local_world_size:
            _post_refusal(store_address, rank, str(refusal))
        raise
    watch_launcher()
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    # device_id binds the group to this rank's device: NCCL connects here rather than in the
    # first collective, so a broken setup fails now, with the launch, and not minutes later.
    global _timeout_s
    _timeout_s = timeout_s
    with bounded_join(rank, timeout_s, peer_host, multi_node=world_size > local_world_size, backend=backend,
                      store_address=store_address, world_size=world_size):
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type != "cpu" else None)
    joined_a_group()  # the process now ends through cli.leave (see there)
    return DistEnv(rank, local_rank, world_size, local_world_size, device, distributed=True)


def _store_address(init_method: str):
    """(host, port) of the TCP store that init_process_group meets at (env://, tcp://), or None."""
    try:
        if init_method.startswith("env://"):
            return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if init_method.startswith("tcp://"):
            host, port = init_method[len("tcp://"):].rsplit(":", 1)
            return host.strip("[]"), int(port.split("?")[0].split("/")[0])
    except (KeyError, ValueError):
        pass
    return None


REFUSED_KEY = "utils.distributed/refused-to-join/"  # + rank: the line of a rank that refused to start


def _store_client(store_address, timeout_s: float):
    host, port = store_address
    return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _post_refusal(store_address, rank: int, line: str):
    """Leave a rank's refusal where the others, waiting to join, look (best effort: a store
    that is not up yet, or unreachable, is no reason to wait)."""
    if store_address is None:
        return
    try:
        _store_client(store_address, 2.0).set(f"{REFUSED_KEY}{rank}", line)
    except Exception:  # noqa: BLE001 - the refusal itself is reported anyway
        pass


def _meeting_host(init_method: str):
    """The host every rank meets at: MASTER_ADDR (env://), tcp://HOST:PORT's HOST; None for
    file:// (a shared file, no host)."""
    if init_method.startswith("env://"):
        return os.environ.get("MASTER_ADDR") or None
    if init_method.startswith("tcp://"):
        host = init_method[len("tcp://"):].rsplit(":", 1)[0]
        return host.strip("[]") or None
    return None


def check_network(peer_host, backends, announce: bool = True):
    """Before joining a group that spans several nodes: refuse, in one line, a setup that
    cannot work (this host's name resolving to loopback, which gloo would hand the other
    nodes as its address); warn of one that may not (gloo or NCCL on an interface other
    than the one that reaches `peer_host`). utils/network.py says how each library chooses."""
    from . import network
    findings = network.multi_node_findings(peer_host, tuple(backends))
    for finding in findings:
        if finding.certain:
            raise UsageError(f"{finding.what}. Fix: {finding.fix}", met_by="node")
    if announce:  # once per node
        for finding in findings:
            print_line(error_line(f"{finding.what}. Fix: {finding.fix}", kind="warning"))


# How much longer than --dist-timeout a rank may take to join before it gives up on its own:
# the backends' own timeouts come first where they hold. (gloo's connection of the full mesh
# does not always: a rank whose peer failed to connect to it was still waiting 150 s into a
# 30 s timeout, measured on two hosts with PyTorch 2.14.)
JOIN_GRACE_S = 10.0


def _join_failure_cause(peer_host, backend: str, multi_node: bool) -> str:
    """The likeliest reason a rank could not join, for its one line."""
    cause = f"a rank did not come: it failed before joining, or cannot reach {peer_host or 'the rendezvous'}"
    if not multi_node:
        return cause
    from . import network
    findings = network.multi_node_findings(peer_host, (backend, "gloo"))
    if findings:
        return f"{findings[0].what}. Fix: {findings[0].fix}"
    gloo = network.gloo_choice()
    return (f"{cause}, or cannot be reached by the others: gloo listens here on {gloo.address} ({gloo.why}); "
            "if they cannot reach it, export GLOO_SOCKET_IFNAME=<the interface they reach this host by> "
            "(scripts/preflight.py names it)")


def _refusal_of_a_peer(store, world_size: int):
    """(rank, line) of a rank that refused to start and said so in the store, or None."""
    for peer in range(world_size):
        key = f"{REFUSED_KEY}{peer}"
        if store.check([key]):
            return peer, store.get(key).decode(errors="replace")
    return None


@contextlib.contextmanager
def bounded_join(rank: int, timeout_s: float, peer_host, multi_node: bool, backend: str,
                 store_address=None, world_size: int = 1):
    """Around init_process_group: a rank that has not joined `timeout_s` + JOIN_GRACE_S later
    prints one line with the likeliest cause and exits with status 1, instead of waiting on.
    On several nodes, a rank whose joining fails (a store timeout, a connection refused) ends
    the same way: one line, status 1, not a traceback from the depths of gloo; and one whose
    peer refused to start (a node whose host name resolves to loopback, more processes than
    GPUs) ends at once with that peer's line, rather than after --dist-timeout."""
    joined = threading.Event()

    def watch():
        deadline = time.monotonic() + timeout_s + JOIN_GRACE_S
        store = None
        while not joined.wait(min(2.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                print_line(error_line(f"rank {rank} did not join the {backend} process group within --dist-timeout "
                                      f"{timeout_s:g} s: {_join_failure_cause(peer_host, backend, multi_node)}"))
                os._exit(1)
            if not multi_node or store_address is None:
                continue
            try:
                store = store or _store_client(store_address, 5.0)
                refused = _refusal_of_a_peer(store, world_size)
            except Exception:  # noqa: BLE001 - the store is not up yet: look again later
                store, refused = None, None
            if refused is not None and not joined.is_set():
                peer, line = refused
                print_line(error_line(f"rank {rank} could not join: rank {peer} refused to start: {line}"))
                os._exit(1)

    watcher = threading.Thread(target=watch, name="bounded-join", daemon=True)
    watcher.start()
    try:
        yield
    except RuntimeError as err:  # torch's DistError and its kinds are RuntimeErrors
        joined.set()
        if not multi_node:
            raise
        print_line(error_line(f"rank {rank} could not join the {backend} process group ({type(err).__name__}: "
                              f"{first_line(err)}): {_join_failure_cause(peer_host, backend, multi_node)}"))
        raise SystemExit(1) from None
    finally:
        _stop_watching(joined, watcher)


# How long the watcher may take to come back from the store: a client's connection (5 s) and
# a check, with room to spare.
_WATCHER_RETURNS_S = 10.0


def _stop_watching(joined, watcher):
    """Tell the watcher to stop, and wait until it has. A watcher still inside a store call
    when this process exits (the SystemExit above, on its way through `finally`) is a thread
    in C++ while the interpreter finalizes: the store server it asks (rank 0's own) goes
    away, the call fails, and the thread comes back to a finalizing interpreter, which ends
    it with pthread_exit; that unwinding through PyTorch's C++ gives "terminate called
    without an active exception", SIGABRT, exit status 134 after the rank's one line (seen
    once: rank 0 alone on its rendezvous, --dist-timeout 5; cli.leave tells the same of
    gloo's threads)."""
    joined.set()
    watcher.join(_WATCHER_RETURNS_S)


_stopping = False


def stop_under_way():
    """Called once this process has a stop signal, its own or another rank's
    (utils/preemption.py): watch_launcher sends it no other."""
    global _stopping
    _stopping = True


def watch_launcher(grace_s: float = 30.0, poll_s: float = 1.0):
    """End this process when the process that started it (torchrun's agent, the
    mp.spawn parent) dies, instead of training on with nobody watching: first a SIGTERM
    to itself, which checkpoints at the next agreed step like any stop signal (none when
    a stop is under way already), then SIGKILL if it is still running `grace_s` later
    (a peer that died with the launcher never reaches the agreement).

    A thread that polls the parent's pid works on Linux and macOS alike, and unlike
    prctl(PR_SET_PDEATHSIG) it does not fire when only the thread that forked us ends.
    """
    parent = os.getppid()
    if parent <= 1:
        return None

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        # Not when a stop is under way already: mp.spawn's workers get SIGINT from the kernel
        # when their parent dies (PR_SET_PDEATHSIG, torch/multiprocessing/spawn.py), and once
        # a stop has saved its checkpoint it gives the signals back to their default action.
        # A SIGTERM from here then ended the process in the middle of its exit, before its
        # exit handlers removed what it had in /tmp.
        if not _stopping:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="watch-launcher", daemon=True)
    thread.start()
    return thread


def setup_from_env(timeout_s: float = 1800.0, device: str = "auto") -> DistEnv:
    """Set up from torchrun's environment, or as one process under plain `python`.
    device: --device (auto, cpu, or the accelerator's type)."""
    if not launched_by_torchrun():
        device = pick_device(0, 1, device)
        if device.type != "cpu":
            torch.accelerator.set_device_index(device.index)
        return DistEnv(0, 0, 1, 1, device, distributed=False)
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not (world_size >= 1 and rank < world_size and local_rank < local_world_size):
        raise UsageError(f"RANK={rank}, WORLD_SIZE={world_size}, LOCAL_RANK={local_rank}, "
                         f"LOCAL_WORLD_SIZE={local_world_size} do not fit together: start the job with torchrun")
    return setup(rank, world_size, local_rank, local_world_size, "env://", timeout_s, device)


def cleanup():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_main() -> bool:
    """Global rank 0: the only rank that prints, writes metrics and saves checkpoints."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    rank = os.environ.get("RANK", "").strip()
    return not rank.isdigit() or int(rank) == 0


def print0(*args, **kwargs):
    if is_main():
        print(*args, **kwargs, flush=True)


def all_reduce_sum(tensor: torch.Tensor, call: str = None) -> torch.Tensor:
    """Sum over ranks in place (no-op in a single process); returns the tensor.
    `call`: where every rank meets, named in the error if one never comes (see
    meeting); None where the caller names it."""
    if dist.is_available() and dist.is_initialized():
        with meeting(call) if call else contextlib.nullcontext():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def first_line(err: BaseException, limit: int = 300) -> str:
    """An error's first line, without the C++ source location that gloo puts in front
    ("[/__w/pytorch/.../pair.cc:152] "): it says nothing to a user."""
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return re.sub(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\] ?", "", line)[:limit]


class MissedCollective(RuntimeError):
    """A collective that every rank must reach failed on this rank: a peer never came."""


@contextlib.contextmanager
def meeting(call: str):
    """Around a collective that every rank must reach at the same point. If it fails
    here (--dist-timeout passed with a peer missing, or a peer died), the error names
    the call this rank was waiting in and what to look for, instead of a bare timeout
    from the backend."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, MissedCollective) or not (dist.is_available() and dist.is_initialized()):
            raise
        first = first_line(err)
        raise MissedCollective(
            f"rank {dist.get_rank()} waited in {call}, which every rank must reach at the same point, "
            f"and it failed: {first}. Another rank never came: it failed, or it skipped this call or "
            "left the training loop on its own (a rank-dependent `continue` or `break`). "
            "utils/run.py lists every collective of a training run.") from err


_cpu_group = None
_timeout_s = 1800.0  # --dist-timeout, as setup() gave it to init_process_group


def cpu_group():
    """The group for the small agreements (all_ranks_ok, the stop signal): None, the default
    group, where that is gloo's already; otherwise a gloo group of all ranks, made at the first
    call (a collective: every rank makes it at the same point) with the default group's
    timeout. On a CPU group, reading the result never waits behind the GPU's queue of kernels,
    and a peer that never comes raises here after --dist-timeout, so `meeting` can name the
    call. An NCCL collective instead returns once queued and, on its timeout, NCCL's
    watchdog ends the process with its own message (TORCH_NCCL_ASYNC_ERROR_HANDLING)."""
    global _cpu_group
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "gloo":
        return None
    if _cpu_group is None:
        # The job's timeout: a new group otherwise takes its backend's default, 30 minutes
        # for gloo (torch.distributed.constants), whatever the default group was given.
        _cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=_timeout_s))
    return _cpu_group


def all_ranks_ok(ok: bool, device: torch.device, call: str = "all_ranks_ok()") -> bool:
    """True only if `ok` holds on every rank. Use it where one rank could fail alone
    (a download, a file read): every rank learns the outcome, so none is left
    waiting in a collective for a peer that has given up. `call`: what the agreement
    is, for the error if a rank never comes. It runs on the CPU group (cpu_group) on
    GPUs too, so that the error holds there."""
    group = cpu_group()
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32,
                        device=device if group is None else "cpu")
    if dist.is_available() and dist.is_initialized():
        references = sys.getrefcount(flag)
        with meeting(call):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            agreed = bool(flag.item())  # inside: on a device, this is where the wait is
        _released_by_backend(flag, references)
        return agreed
    return bool(flag.item())


def _released_by_backend(tensor: torch.Tensor, references: int, timeout_s: float = 1.0):
    """Wait (at most timeout_s) until the process group's threads hold no reference to
    `tensor`, which had `references` (sys.getrefcount in the caller) before a collective. A
    collective returns when its result is there; the backend's thread lets go of the tensor
    a moment later, taking the GIL for it. all_ranks_ok guards the data's download and reading, just before the
    loaders fork their workers: a fork at that moment can leave the new worker stuck for
    good (see data.Loader.start_workers). While the backend holds the tensor, PyTorch keeps
    its Python object alive, so that sys.getrefcount counts one more."""
    deadline = time.monotonic() + timeout_s
    while sys.getrefcount(tensor) > references + 1 and time.monotonic() < deadline:  # +1: `tensor` here
        time.sleep(0.0002)  # releases the GIL, which the backend's thread is waiting for


# DDP's switch for broadcasting rank 0's buffers (batch-norm statistics) before every forward
# is `broadcast_buffers` up to PyTorch 2.12 and `forward_sync_buffers` from 2.13, where the old
# name warns (FutureWarning) on every wrap. It is not a plain rename: broadcast_buffers=False
# also leaves the buffers out of the constructor's broadcast of rank 0's state, while
# forward_sync_buffers=False keeps them in it (torch/nn/parallel/distributed.py, __init__).
_DDP_HAS_FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in inspect.signature(
    torch.nn.parallel.DistributedDataParallel.__init__).parameters


def buffers_synced_once(model: torch.nn.Module) -> dict:
    """DDP keyword arguments that broadcast rank 0's buffers to every rank once, when DDP
    wraps the model, and never again before a forward: what forward_sync_buffers=False
    does from PyTorch 2.13 on. On older versions (broadcast_buffers=False, which skips
    the wrap's broadcast of buffers too) the buffers are broadcast here instead, so that
    every version starts every rank from rank 0's buffers.

    Call it on every rank, just before DDP(...): on PyTorch before 2.13 it broadcasts."""
    if _DDP_HAS_FORWARD_SYNC_BUFFERS:
        return {"forward_sync_buffers": False}
    if dist.is_available() and dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer.data, src=0)  # all ranks meet here, as in DDP's constructor
    return {"broadcast_buffers": False}


def seed_everything(seed: int):
    """Same seed on every rank: identical initial weights (DDP broadcasts them anyway)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def world_size_from_env() -> int:
    """The job's size before joining it, to validate arguments first."""
    return _env_int("WORLD_SIZE", 1) if launched_by_torchrun() else 1
