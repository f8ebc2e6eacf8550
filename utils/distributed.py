"""Joining the job (the launcher's variables say who each process is; plain python runs one, no group), the
device (the accelerator's, else the CPU with gloo), and the few helpers every rank needs.

Agreements (`all_ranks_ok`, `any_rank`: may the run go on, has any rank a stop signal) go through the
job's rendezvous store, not a collective: beside NCCL they need no second network stack and never wait
behind the GPU's queue, and no backend thread touches a Python object before the loaders fork workers."""
import contextlib
import dataclasses
import datetime
import os
import random
import signal
import sys
import threading
import time
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist

from . import lifecycle, network
from .cli import UsageError, error_line, first_line, print_line


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Who this process is in its job: as its launcher said (job_from_env), with its device once joined (setup)."""
    rank: int               # global rank, 0 .. world_size-1
    local_rank: int         # rank within this node: picks the GPU
    world_size: int         # processes in the whole job
    local_world_size: int   # processes on this node
    device: torch.device = None
    distributed: bool = False    # started by a launcher: a process group (of one too), a DDP wrapper
    init_method: str = "env://"  # where the ranks meet: env:// (MASTER_ADDR:MASTER_PORT), tcp://, file://
    read: str = ""               # the launcher's variables that were read, for --check-args to show

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_ids(self):
        return None if self.device.type == "cpu" else [self.device.index]

    @property
    def rendezvous(self) -> str:  # "tcp://HOST:PORT" (IPv6 in brackets) or "file:///PATH": no path or query (torch's)
        if self.init_method.startswith("env://"):
            host = os.environ.get("MASTER_ADDR", "")
            return f"tcp://{f'[{host}]' if ':' in host else host}:{os.environ.get('MASTER_PORT', '0')}"
        url = urlparse(self.init_method)
        return f"tcp://{url.netloc}" if url.scheme == "tcp" else f"file://{url.path}"

    @property
    def meets_at(self):  # the host every rank connects to, or None (file://: no host)
        return urlparse(self.rendezvous).hostname

    @property
    def store_by_rank_0(self) -> bool:  # else torchrun's agent serves it (rendezvous.py, _create_c10d_store)
        return not self.init_method.startswith("env://") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"

    @property
    def several_nodes(self) -> bool:
        return self.world_size > self.local_world_size


def job_from_env(check_only: bool = False) -> DistEnv:
    """This process's place in its job, from the launcher's variables; one process without
    WORLD_SIZE. check_only (--check-args): a missing RANK stands for rank 0."""
    launcher_variables = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    read = " ".join(f"{name}={os.environ[name]}" for name in launcher_variables if name in os.environ)
    if "WORLD_SIZE" not in os.environ:
        if "RANK" in os.environ:
            raise UsageError(f"RANK={os.environ['RANK']} without WORLD_SIZE: a launcher (torchrun) sets both; "
                             "unset RANK to run one process with plain python")
        return DistEnv(0, 0, 1, 1, read="no launcher's variables: one process")
    if "RANK" not in os.environ and not check_only:
        raise UsageError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} without RANK: a launcher (torchrun) sets both; "
                         "unset WORLD_SIZE to run one process with plain python")
    world_size, rank, local_rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not (world_size >= 1 and rank < world_size and local_rank < local_world_size <= world_size):
        raise UsageError(f"RANK={rank}, WORLD_SIZE={world_size}, LOCAL_RANK={local_rank}, "
                         f"LOCAL_WORLD_SIZE={local_world_size} do not fit together: start the job with torchrun")
    return DistEnv(rank, local_rank, world_size, local_world_size, distributed=True, read=read)


def _env_int(name, default):
    value = os.environ.get(name) or str(default)
    if not value.strip().isdigit():
        raise UsageError(f"environment variable {name}={value!r} is not a rank or size: the launcher "
                         "(torchrun, srun) sets it; unset it to run one process with plain python")
    return int(value)


def check_job(job: DistEnv, device_choice: str = "auto", check_only: bool = False) -> torch.device:
    """This rank's device, and this node's refusals that need no process group: a device this machine lacks, more
    processes than devices, on several nodes a network on which the groups cannot form (utils/network.py)."""
    if job.distributed and not check_only:
        addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")  # go into a URL as they are
        ok = addr.split() == [addr] and "[" not in addr and port.isascii() and port.isdigit() and 0 < int(port) < 65536
        if (env := job.init_method.startswith("env://")) and not ok:  # else torch raises on rank 0, the others wait
            raise UsageError(f"MASTER_ADDR={addr!r}, MASTER_PORT={port!r} do not say where the ranks meet: the "
                             "launcher sets them: node 0's address (IPv6 without brackets), a free port", met_by="node")
        if env and job.rank == 0 and job.store_by_rank_0 and (refusal := network.store_elsewhere(addr)):
            raise UsageError(refusal)  # it would serve the store there and join it there: else a C++ trace a try
        tell_refusals_to(job)  # after the checks above: a refusal served at another host's address reaches no one
    device = pick_device(job.local_rank, job.local_world_size, device_choice, job.world_size > 1, check_only,
                         guessed_local=job.distributed and "LOCAL_WORLD_SIZE" not in os.environ)  # job_from_env's
    if job.several_nodes:
        check_network(job.meets_at, device, announce=job.local_rank == 0)
    return device


def tell_refusals_to(job: DistEnv):
    """From here on, a refusal of this process reaches the job's other ranks (lifecycle.tell_the_job)."""
    # Several nodes meeting at a loopback address reach no rank of another node there: no one to tell (None).
    alone = job.several_nodes and job.meets_at and network.loopback_for_several_nodes(job.meets_at)
    lifecycle.meets_at(None if alone else job.rendezvous, job.rank, job.world_size,
                       hosts_store=job.rank == 0 and job.store_by_rank_0 and not alone)


def check_network(meets_at, device: torch.device, flag: str = "MASTER_ADDR", announce: bool = True):
    """Refuse a job of several nodes that cannot form its groups from here; warn of one that may not."""
    for finding in network.findings(meets_at, dist.get_default_backend_for_device(device) == "gloo", flag=flag):
        if finding.certain:
            raise UsageError(finding.line, met_by="node")
        if announce:
            print_line(error_line(finding.line, kind="warning"))


def device_type(choice: str = "auto", distributed: bool = False) -> str:
    """The device type --device asks for, checked against this machine ('cuda' for NVIDIA and AMD GPUs,
    'xpu' for Intel's, 'mps'...: torch.accelerator names no vendor). `distributed`: it joins a group."""
    accelerator = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None
    if choice == "cpu":
        return "cpu"
    if ":" in choice:  # each rank's index comes from its local rank
        raise UsageError(f"--device {choice}: name the type alone (--device {choice.split(':')[0]}); "
                         "each process takes the device of its local rank")
    if choice != "auto" and accelerator is None:
        raise UsageError(f"--device {choice}: PyTorch sees no accelerator on this machine "
                         "(torch.accelerator.is_available() is False): use --device cpu, or auto")
    if choice not in ("auto", accelerator):
        raise UsageError(f"--device {choice}: this machine's accelerator is {accelerator}: "
                         f"use --device {accelerator}, cpu, or auto")
    kind = accelerator or "cpu"  # what auto means; a named type is the accelerator's now
    if kind == "mps" and distributed:  # no backend moves MPS tensors between processes
        raise UsageError("DDP does not run on Apple's MPS devices: train one process with plain python, "
                         "or several on the CPU with --device cpu")
    return kind


def device_name(device: torch.device) -> str:
    """The device's product name for records ("NVIDIA H100 80GB HBM3"), "cpu", or the device."""
    with contextlib.suppress(AttributeError, RuntimeError):
        return "cpu" if device.type == "cpu" else torch.get_device_module(device).get_device_name(device)
    return str(device)


def pick_device(local_rank: int, local_world_size: int, choice: str = "auto",
                distributed: bool = False, check_only: bool = False, guessed_local: bool = False) -> torch.device:
    if (kind := device_type(choice, distributed)) == "cpu":
        return torch.device("cpu")
    count = torch.accelerator.device_count()
    gpus = ("GPU" if kind in ("cuda", "xpu") else f"{kind} device") + ("s" if count != 1 else "")
    fix = f"use --nproc_per_node={count} or fewer (one process per device), or --device cpu"
    if guessed_local:  # a launch by hand without LOCAL_WORLD_SIZE: WORLD_SIZE stood in for it
        fix = f"set LOCAL_WORLD_SIZE to this node's processes (without it, all {local_world_size} are taken to be here)"
    # torchrun --virtual-local-rank: LOCAL_RANK=0, one visible GPU per worker (LocalElasticAgent._set_local_rank_env).
    # Not a check (--check-args): it sees the node's devices, as the launcher does before narrowing them.
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    own_device_only = count == 1 and local_rank == 0 and len(visible) == 1 and not check_only
    if local_rank >= count:  # this rank's device does not exist: its error, whoever else fails
        raise UsageError(f"local rank {local_rank} of {local_world_size} processes per node has no device: "
                         f"only {count} {gpus} visible: {fix}", met_by="rank")
    if local_world_size > count and not own_device_only:
        raise UsageError(f"{local_world_size} processes per node but only {count} {gpus} visible: {fix}", met_by="node")
    return torch.device(kind, local_rank)


# --- joining ------------------------------------------------------------------------------------

# How much longer than --dist-timeout a rank may take to join before it gives up by itself: gloo's
# full-mesh connect ignored its timeout (still waiting 150 s into 30 s; two hosts, PyTorch 2.14).
JOIN_GRACE_S = 10.0
_store = None  # the job's store for the agreements (setup); its timeout is --dist-timeout
_agreements = 0  # how many agreements this rank has made: the same count on every rank
_served = None  # rank 0's store for them, where torchrun's would die with torchrun (_rank_0s_store)


def setup(job: DistEnv, device: torch.device, timeout_s: float = 1800.0) -> DistEnv:
    """Join the job's process group (the device's backend: nccl, xccl, gloo on the CPU) and pin this
    rank's device; one process without a launcher joins none. The timeout bounds every wait for a
    peer, to form the group and in each collective after it: a failed job ends, not hangs."""
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    if not job.distributed:
        return dataclasses.replace(job, device=device)
    global _store, _agreements
    tell_refusals_to(job)
    launcher = lifecycle.watch_launcher()
    backend, timeout = dist.get_default_backend_for_device(device), datetime.timedelta(seconds=timeout_s)
    with joining(job, timeout_s, backend, launcher):
        # init_process_group(init_method=...)'s own rendezvous (distributed_c10d.py), its store kept for agreements.
        store, _, _ = next(dist.rendezvous(job.init_method, job.rank, job.world_size, timeout=timeout))
        store.set_timeout(timeout)
        # This attempt's keys: a torchrun restart may meet in a store that still holds the last attempt's addresses.
        attempt = lifecycle.attempt_prefix()
        # device_id: NCCL connects now, not in the first collective: a broken setup fails with the launch.
        dist.init_process_group(backend, store=dist.PrefixStore(f"{attempt}/pg", store), rank=job.rank,
                                world_size=job.world_size, timeout=timeout,
                                device_id=device if device.type != "cpu" else None)
        agreements = store if job.store_by_rank_0 or job.several_nodes else _rank_0s_store(
            job, store, f"{attempt}/agreements-at", timeout)
    _store, _agreements = dist.PrefixStore(f"{attempt}/agreements", agreements), 0
    lifecycle.joined_a_group(store)  # the process now ends through lifecycle.leave (see there)
    return dataclasses.replace(job, device=device)


def _rank_0s_store(job: DistEnv, shared, key: str, timeout):
    """A store that rank 0 serves on this node, its port told through torchrun's `shared` one: that store lives in
    torchrun's agent and dies with it, and the agreements, the stop's among them, must outlive a launcher that dies.
    (On several nodes no address of rank 0 is known to reach it from every other: there, set
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the launchers do, and rank 0 serves the job's store.)"""
    global _served
    if job.rank == 0:  # a free port; served until this process ends, not until cleanup: a slower rank may still ask
        _served = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
        shared.set(key, str(_served.port))
        return _served
    return dist.TCPStore("127.0.0.1", int(shared.get(key)), None, False, timeout)


@contextlib.contextmanager
def joining(job: DistEnv, timeout_s: float, backend: str, launcher: int = None):
    """Around forming the group: a rank not joined `timeout_s` + JOIN_GRACE_S later ends with one line and status 1;
    one whose peer refused to start (lifecycle.tell_the_job) with that peer's line and status 2, also if stopped then;
    one stopped (Ctrl-C, a launcher's SIGTERM) at once, saying what it waited for or that `launcher` (its pid) died,
    status 128 + the signal's number; a rank 0 whose port was taken, status 2; any failure in one line, no trace."""
    joined, answered, said, told = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def watch():  # another rank's refusal, at once and every second; on rank 0 until a second before the store's
        store = [None]  # own wait ends (--dist-timeout): its store ends with it, and a call then prints a C++ trace
        while not joined.is_set() and not (job.rank == 0 and time.monotonic() > began + timeout_s - 1.0):
            refused = lifecycle.refusal_of_a_peer(job.rendezvous, store)
            if store[0] is not None:  # a store answers at the rendezvous
                answered.set()
            if refused is not None and not joined.is_set():
                peer, line = refused.split("\n", 1)
                line = error_line(f"rank {job.rank} could not join: rank {peer} refused to start: {line}")
                said.set()  # before the line: a stop signal from here on (a launcher ending the job) adds none
                if job.local_rank == 0:
                    print_line(line)
                lifecycle.record_for_torchrun(line)
                told.set()
                lifecycle.refusal_said(store)  # the refusing rank may end now: nothing after this uses the store
                os._exit(2)
            soon = job.rendezvous.startswith("tcp://") and not answered.is_set()  # a rank may wait for it
            joined.wait(0.1 if soon else 1.0)

    def cause():  # what this rank knows of why it has not joined yet (nothing ever answered: no rank failed to come)
        return (f"no store ever answered at {job.rendezvous[len('tcp://'):]}: rank 0 did not start one (it was not "
                "started, or failed first), another program holds that port, or this node cannot reach it"
                if job.rank and job.rendezvous.startswith("tcp://") and not answered.is_set() else
                f"a rank did not come (it failed before joining, or cannot reach {job.meets_at or 'the rendezvous'}), "
                "or cannot be reached by the others") + "; scripts/preflight.py checks each node's network"

    def late():
        return error_line(f"rank {job.rank} did not join the {backend} process group within --dist-timeout "
                          f"{timeout_s:g} s: {cause()}")

    def stopped(signals):  # a stop signal's number, one byte each (signal.set_wakeup_fd)
        while byte := os.read(signals, 1):
            if byte[0] in stops and said.is_set():  # this rank's line is the refusal's: no second one
                told.wait(5.0)  # until it is printed and in torchrun's error file
                os._exit(2)
            if byte[0] in stops:  # a launcher that died sends it too (lifecycle.watch_launcher, mp.spawn's SIGINT)
                why = f"its launcher (pid {launcher}) died" if launcher and os.getppid() != launcher else cause()
                line = error_line(f"rank {job.rank} was stopped by {signal.Signals(byte[0]).name} after waiting "
                                  f"{time.monotonic() - began:.0f} s to join the {backend} process group: {why}")
                if job.local_rank == 0:
                    print_line(line)
                lifecycle.record_for_torchrun(line)
                os._exit(128 + byte[0])
        os.close(signals)

    # The main thread waits in C++, where no Python handler runs: a thread reads the wakeup fd, set before the handlers.
    began, stops, (signals, wakeup) = time.monotonic(), lifecycle.stop_signals(), os.pipe()
    os.set_blocking(wakeup, False)
    wakeup_before, handlers = signal.set_wakeup_fd(wakeup), {sig: signal.signal(sig, lambda *_: None) for sig in stops}
    threading.Thread(target=stopped, args=(signals,), name="stopped-while-joining", daemon=True).start()
    watcher = threading.Thread(target=watch, name="joining", daemon=True)
    watcher.start()
    try:
        with lifecycle.deadline(timeout_s + JOIN_GRACE_S, late):
            # Until a store answers (the watcher's probe): TCPStore's client that finds no one prints a C++ trace at
            # each try. Not under torchrun, whose store's port it picked: the line below (every port) says more then.
            if job.rank and job.rendezvous.startswith("tcp://") and "TORCHELASTIC_RUN_ID" not in os.environ \
                    and not answered.wait(timeout_s):
                print_line(late())
                raise SystemExit(1)
            yield
    except RuntimeError as err:  # torch's DistError and its kinds are RuntimeErrors
        # The store's and the backend's own waits end at --dist-timeout, before the deadline above: a rank that
        # did not come. Several nodes: under torchrun the ranks' store is at a port it picks on node 0, and gloo
        # and NCCL listen on ports of their own: a firewall that lets only the endpoint's port through stops here.
        said = first_line(err).lower()  # a wait that ran out or a peer gone: a rank absent, not gloo failing here
        busy = "address already in use" in str(err).lower()  # rank 0's store (libuv's or not): free when checked
        absent = any(words in said for words in ("timed out", "timeout", "by peer", "broken pipe"))
        why = ("another program (another run?) took the port after it was checked: start again on another port"
               if busy else ("the nodes must reach each other on every TCP port, not only the rendezvous endpoint's: "
                             if job.several_nodes else "another rank did not come in time (it failed or was slow to "
                             "start): " if absent else "") + "scripts/preflight.py checks each node's network")
        print_line(error_line(f"rank {job.rank} could not join the {backend} process group ({type(err).__name__}: "
                              f"{first_line(err)}); {why}"))
        raise SystemExit(2 if busy else 1) from None
    finally:
        # Stopped first: a watcher in a store call at exit meets a finalizing interpreter: SIGABRT (seen once).
        joined.set()
        for sig, handler in handlers.items():  # joined or failed: the stop signals are the run's again
            signal.signal(sig, handler)
        os.close(signal.set_wakeup_fd(wakeup_before))  # the thread reads the pipe's end, and ends
        watcher.join(10.0)


def cleanup():
    """Leave the group. After a run that ended well (or stopped on a signal), rank 0 first waits, 2 s
    at most, until every rank is done with the store: where rank 0 serves it, a rank still reading
    the last agreement lost its connection to a rank 0 that had exited ("Connection reset by
    peer", seen under load). After a failure nobody waits: the peers may be gone."""
    global _store
    failure = sys.exc_info()[1]  # what is propagating through the script's `finally`, if anything
    if _store is not None and dist.is_initialized() and (failure is None or isinstance(failure, SystemExit)
                                                         and not failure.code):
        # The work is done: a store that stops answering (lifecycle.deadline) ends this process with 0.
        with contextlib.suppress(Exception), lifecycle.deadline(5.0, code=0):  # a store already gone
            _store.set_timeout(datetime.timedelta(seconds=2))
            _store.add("left", 1)
            until = time.monotonic() + 2.0
            while dist.get_rank() == 0 and _store.add("left", 0) < dist.get_world_size() and time.monotonic() < until:
                time.sleep(0.01)
    _store = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def print0(*args, **kwargs):
    """Print on global rank 0 alone (before the group forms: RANK's; none is rank 0)."""
    rank = str(dist.get_rank()) if dist.is_available() and dist.is_initialized() else os.environ.get("RANK", "").strip()
    if not rank.isdigit() or int(rank) == 0:
        with contextlib.suppress(OSError):  # a terminal that hung up (EIO): the run goes on, or stops, unheard
            print(*args, **kwargs, flush=True)


# --- meeting points -----------------------------------------------------------------------------

def all_reduce_sum(tensor: torch.Tensor, call: str = None) -> torch.Tensor:
    """Sum over ranks in place (no-op alone); `call` names the meeting (None: the caller does)."""
    if dist.is_available() and dist.is_initialized():
        with meeting(call) if call else contextlib.nullcontext():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class MissedCollective(RuntimeError):
    """A call that every rank must reach failed on this rank: a peer never came."""


@contextlib.contextmanager
def meeting(call: str):
    """Around a call every rank must reach at the same point: if a peer never comes, the error names
    the call this rank waited in and what to look for, not a bare timeout of the backend."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, MissedCollective) or not (dist.is_available() and dist.is_initialized()):
            raise
        raise MissedCollective(
            f"rank {dist.get_rank()} waited in {call}, which every rank must reach at the same point, "
            f"and it failed: {first_line(err)}. Another rank never came: it failed, or it skipped this call or "
            "left the training loop on its own (a rank-dependent `continue` or `break`). "
            "utils/run.py lists every call where the ranks meet.") from err


def _votes(vote: bool, call: str) -> int:
    """How many ranks voted yes, once all have (every rank calls it at the same points). Through the
    store: each adds 1, plus world_size + 1 for yes, to a counter; the last posts the total, which
    the others wait for (get: up to --dist-timeout), and deletes the agreement before, read by all."""
    global _agreements
    world, _agreements, timeout_s = dist.get_world_size(), _agreements + 1, _store.timeout.total_seconds()
    # A store across a partition keeps no timeout (lifecycle.deadline): this rank ends by its own.
    silent = error_line(f"rank {dist.get_rank()} waited in {call}, and the job's store gave no answer within "
                        f"--dist-timeout {timeout_s:g} s + {JOIN_GRACE_S:g}: a network partition, or its node "
                        "lost; once the nodes reach each other again, continue with --resume")
    with meeting(call), lifecycle.deadline(timeout_s + JOIN_GRACE_S, silent):
        total = _store.add(f"{_agreements}", 1 + (world + 1 if vote else 0))
        if total % (world + 1) == world:
            _store.set(f"{_agreements}/total", str(total))
            if _agreements > 1:
                _store.delete_key(f"{_agreements - 1}")
                _store.delete_key(f"{_agreements - 1}/total")
        total = int(_store.get(f"{_agreements}/total"))
    return total // (world + 1)


def all_ranks_ok(ok: bool, call: str = "all_ranks_ok()") -> bool:
    """True only if `ok` holds on every rank: where one rank could fail alone (a file read), every
    rank learns it, and none waits for a peer that gave up. `call` names it for the error."""
    return ok if _store is None else _votes(ok, call) == dist.get_world_size()


def any_rank(flag: bool, call: str = "any_rank()") -> bool:
    """True on every rank if `flag` holds on any (an agreement, as all_ranks_ok)."""
    return flag if _store is None else _votes(flag, call) > 0


def seed_everything(seed: int):
    """Same seed on every rank: identical initial weights (DDP broadcasts them anyway)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
