r"""torchrun for several nodes: the same arguments, with the faults that stop most multi-node
jobs avoided, and a bound on how long it outlives its training processes.

    python scripts/torchrun_bounded.py [torchrun's arguments]     # in place of `torchrun ...`

It is torchrun itself (torch.distributed.run, in this process), plus, with a c10d rendezvous
at a TCP store (--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT; a shared file, --rdzv-conf
store_type=file, has no host to decide), what this node decides before it starts:

- whether it hosts the rendezvous store, where torchrun's own guess is wrong: --rdzv-conf
  is_host=1 on the node that HOST names (0 on another). torchrun takes HOST for itself when it is
  this host's name, or an address that this host's name resolves to: where HOST is the node's
  address and its name resolves to 127.0.1.1 (the default of Debian's and Ubuntu's installers),
  no node would host the store, and every node would fail about 2 minutes later. Where the
  guess is right it is left alone: it lets a second agent of the job on the same machine join as
  a client. An is_host given already is kept.
- --local_addr: c10d numbers the nodes in the order of this value, and node rank 0's becomes
  every rank's MASTER_ADDR; without it torchrun hands out socket.getfqdn(), which is
  "localhost" where /etc/hosts lists the name after localhost on the 127.0.0.1 line. On the
  node that HOST names: HOST itself, as every node reaches the store there (that node's own
  view of the name, a loopback line or an interface the others do not use, is no one else's).
  Elsewhere: this node's address toward HOST.
- GLOO_SOCKET_IFNAME, unless set: the interface toward HOST (utils/network.py way_out); on the
  node that HOST names by name, its one interface that is not loopback, if it has only one (the
  route to its own name says nothing of the others'). Otherwise gloo listens on the address that
  the host name resolves to (loopback, or another network). NCCL chooses its own interfaces.

then asks utils/network.py's decision, the one the training scripts make, and refuses in one
line (exit status 2) what no setting here avoids. On a node that does not host the store, it waits
for the endpoint to take a connection about as long as torchrun's client would, and says in one
line (exit status 1) when it never does: nothing listens there, or a firewall. And one watch: once this node's training
processes have run, if none has been alive for TORCHRUN_GRACE seconds (default 90) while
torchrun is still here, it says why in one line and ends torchrun (exit status 1). A finished
job (the workers succeeded) is never cut short.

Why the watch: a torchrun agent whose rendezvous store is unreachable (a network partition,
the store's node lost) can wait for it far longer than any timeout it is given. Its store
client, after a wait times out, asks the store to cancel the wait and then reads the answer
with no timeout (TCPStore::doWait, PyTorch 2.11 to 2.14), so the call returns only when the
kernel gives up on the connection: about 15 minutes with Linux's default tcp_retries2. While
it waits, it cannot restart its workers anyway. The grace covers a restart (torchrun
--max-restarts, or an elastic job's new rendezvous after a node left, while --nnodes MIN nodes
remain: torchrun's last call, 30 s by default, and a lost node's heartbeats, 15 s). It does not
cover an elastic job that waits below MIN nodes for a new one (torchrun's join timeout, 600 s by
default): give such a job a TORCHRUN_GRACE as long as the wait it allows.

With --check-args among the training script's arguments it starts no torchrun: it runs the
script's check of its arguments once, as this node's first process would run it, in the
settings above (slurm.sbatch does, before srun).

It gives each restart attempt a fresh store for its workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, unless
set; see main). scripts/launch_multi_node.sh and scripts/slurm.sbatch start torchrun through this file.
"""
import errno
import os
import socket
import sys
import threading
import time
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from utils.cli import print_line  # noqa: E402  (one write per line: torchrun's own lines may come at once)

POLL_S = 1.0

_last_state = None  # what torchrun's agent last found its workers doing


class Rendezvous(NamedTuple):
    """A c10d rendezvous as this node joins it."""
    host: str  # the endpoint's, as torchrun reads it
    port: int
    hosts_store: bool  # this node's agent serves the store: is_host given, else decided here, else torchrun's guess
    read_timeout: int  # --rdzv-conf read_timeout: how long torchrun's store client waits for an answer


def node_settings(argv: list) -> tuple:
    """(argv with is_host and --local_addr added, what was decided, the Rendezvous, or None where there is
    nothing to decide); GLOO_SOCKET_IFNAME, where decided, is set in os.environ."""
    from torch.distributed.run import get_args_parser
    args = get_args_parser().parse_args(argv)
    if args.rdzv_backend != "c10d" or not args.rdzv_endpoint or args.standalone:
        return argv, "", None
    from torch.distributed.elastic.rendezvous import RendezvousParameters, utils as rendezvous_utils
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    from utils import network
    try:
        settings = _parse_rendezvous_config(args.rdzv_conf)  # as torchrun reads them: keys and values stripped
        if settings.get("store_type", "tcp").lower() != "tcp":  # store_type=file: the endpoint is a shared file
            return argv, "", None
        # The host as torchrun reads it ("[IPV6]" with or without a port: the brackets go).
        host, port = rendezvous_utils.parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=DEFAULT_PORT)
        conf = RendezvousParameters(args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, 1, 1, **settings)
        given, read_timeout = conf.get_as_bool("is_host"), conf.get_as_int("read_timeout", 60)
    except ValueError as err:
        print_line(f"torchrun_bounded.py: error: {err}")
        sys.exit(2)
    decided, here = [], network.own_address(host) is not None
    # torchrun guesses is_host itself where it is not given, and an agent guessed the host whose port is taken
    # becomes a client: a second agent of the job on this machine (_create_tcp_store). One given is_host=1
    # fails there instead: it is given only where the guess is wrong (this host's name on a loopback line).
    try:
        guess = rendezvous_utils._matches_machine_hostname(host)
    except OSError:  # this host's own name does not resolve: torchrun's guess would fail the same way
        guess = None
    if given is None and network.resolve(host, socket.AF_UNSPEC) and here != guess:
        merged = f"{args.rdzv_conf},is_host={int(here)}" if args.rdzv_conf else f"is_host={int(here)}"
        script = len(argv) - len(args.training_script_args) - 1  # last before it: torchrun keeps the last value
        argv = [*argv[:script], f"--rdzv-conf={merged}", *argv[script:]]
        decided.append(f"is_host={int(here)}")
        given = here
    rendezvous = Rendezvous(host, port, bool(guess) if given is None else given, read_timeout)
    # HOST's node is reached at HOST as written, where every node reaches its store; another node, by its way
    # there. HOST's node's own view of a name (a loopback line, an interface the others do not use) is no one
    # else's: it says neither what to call the node nor which interface the others reach. (A loopback HOST
    # that is not this host's name, 127.0.0.1 or localhost, reaches no other node: several nodes are refused
    # below, in the endpoint's words, which the training's own check at HOST would only repeat worse.)
    # IPv4 only, as utils/network.py: an IPv6 endpoint leaves these to torchrun and gloo.
    addresses, toward = network.resolve(host), None if here and not network.is_address(host) else host
    interface, address = network.way_out(toward) if addresses else (None, None)
    named = here and bool(addresses) and (network.is_own_name(host) or not network.is_loopback(addresses[0]))
    local_addr = host if named else address
    if local_addr and not args.local_addr:
        argv = [f"--local_addr={local_addr}", *argv]
        decided.append(f"--local_addr={local_addr}")
    if interface and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        decided.append(f"GLOO_SOCKET_IFNAME={interface}")
    return argv, " ".join(decided), rendezvous


def refuse_what_no_setting_saves(args, host: str, warn: bool):
    """The run's own network decision (exit status 2 in one line where it is sure), in this node's settings:
    here, where the job meets at the endpoint, with the backend the script will use. (The ranks meet at node
    rank 0's --local_addr, which c10d picks by their order as strings; the endpoint's node, named by name,
    sorts after the others' addresses.) args: torchrun's, as node_settings left them. warn: print what it is
    not sure of too (not after --check-args, whose script has just printed it)."""
    from utils import network
    for finding in network.findings(host, _uses_gloo(args.training_script_args), "the rendezvous endpoint"):
        if finding.certain or warn:
            print_line(f"torchrun_bounded.py: {'error' if finding.certain else 'warning'}: {finding.line}")
        if finding.certain:
            sys.exit(2)


def wait_for_the_store(rendezvous: Rendezvous):
    """On a node that does not host the store: wait until the endpoint takes a connection, twice --rdzv-conf
    read_timeout (torchrun's own client gave up after 121 s with its default, 60 s), then say so in one line
    (exit status 1) in place of torchrun's C++ stack traces: nothing listens there yet, or a firewall."""
    host, port, waited = rendezvous.host, rendezvous.port, 2 * rendezvous.read_timeout
    until = time.monotonic() + waited
    while True:
        try:
            # Each try bounded by what is left: a firewall that drops packets makes a connect wait.
            return socket.create_connection((host, port), timeout=min(5.0, max(0.1, until - time.monotonic()))).close()
        except OSError as err:
            if time.monotonic() > until:
                at = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 address in brackets
                print_line(f"torchrun_bounded.py: error: the rendezvous endpoint {at} took no connection in "
                           f"{waited:.0f} s ({err.strerror or err}): start its node's launcher with the same "
                           f"--rdzv-endpoint, and let the nodes reach each other on every TCP port, {port} and those "
                           f"torchrun, gloo and NCCL pick (python3 scripts/preflight.py --rdzv-endpoint {at} "
                           "checks it from here)")
                sys.exit(1)
            time.sleep(POLL_S)


def _uses_gloo(script_args: list) -> bool:
    """Whether the training processes will use gloo: the scripts' own choice from their --device."""
    import argparse
    import torch.distributed as dist
    from utils.cli import UsageError
    from utils.distributed import device_type
    choice = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # as the scripts' parser
    choice.add_argument("--device", default="auto")
    try:
        device = device_type(choice.parse_known_args(script_args)[0].device, distributed=True)
    except UsageError:  # the script refuses it, in its own line
        return False
    return dist.get_default_backend_for_device(device) == "gloo"


def _record_states():
    """Note the state of the workers each time the agent checks them (HEALTHY, FAILED,
    SUCCEEDED...): a node whose workers all succeeded is waiting for the others to finish,
    which is not for us to cut short."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    monitor = LocalElasticAgent._monitor_workers

    def monitored(self, worker_group):
        global _last_state
        result = monitor(self, worker_group)
        _last_state = getattr(getattr(result, "state", None), "name", None)
        return result

    LocalElasticAgent._monitor_workers = monitored


def live_children(pid: int) -> list:
    """This process's children that are running (not zombies: a worker that exited but that
    a blocked agent has not reaped yet is one)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    alive = []
    for child in found:
        try:
            with open(f"/proc/{child}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            alive.append(child)
    return alive


def _watch(pid: int, grace: float):
    had_workers, since = False, None
    while True:
        time.sleep(POLL_S)
        if live_children(pid):
            had_workers, since = True, None
            continue
        if not had_workers or _last_state == "SUCCEEDED":
            continue
        since = since or time.monotonic()
        if time.monotonic() - since >= grace:
            print_line(f"torchrun_bounded.py: error: no training process has run on this node for {grace:g} s "
                       "and torchrun is still waiting, most likely for a node it cannot reach (a network partition, "
                       "or a node lost): ending it. Check the links between the nodes, then start the job again "
                       "with --resume")
            os._exit(1)


def check_args(args, rendezvous):
    """`SCRIPT ... --check-args` as this node's first training process would run it, in this node's settings
    (node_settings: args and os.environ have them): one of nnodes x nproc_per_node ranks, meeting at this
    node's --local_addr on the node that hosts the store, elsewhere at the endpoint (without c10d, torchrun's
    --master-addr and --master-port). An elastic job (--nnodes=MIN:MAX) is checked at every node count it may
    run with: a batch that 2 and 4 nodes split, 3 may not. Exits with its status where that is not 0. The
    launchers run it before torchrun: a refused worker would be restarted."""
    import subprocess
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes
    # Without c10d: --master-port, None by default in 2.14, 29500 in 2.11
    host, port, hosts_store = rendezvous[:3] if rendezvous else (args.master_addr, args.master_port or 29500, False)
    try:
        nprocs = determine_local_world_size(args.nproc_per_node)  # a number, or gpu, cpu, auto... as torchrun
    except ValueError as err:
        print_line(f"torchrun_bounded.py: error: --nproc_per_node={args.nproc_per_node}: {err}")
        sys.exit(2)
    try:  # N or MIN:MAX, read and refused as torchrun does (MIN above MAX too)
        fewest, most = parse_min_max_nnodes(str(args.nnodes))
        RendezvousParameters(args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, fewest, most)
    except (ValueError, RuntimeError) as err:
        print_line(f"torchrun_bounded.py: error: --nnodes={args.nnodes}: {err}")
        sys.exit(2)
    # TORCHELASTIC_RUN_ID, as torchrun sets it: a --checkpoint-dir that this job (its --rdzv-id) holds is no refusal
    # (a node that joins it, or comes back), one that another run holds is.
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(nprocs), MASTER_PORT=str(port),
               MASTER_ADDR=args.local_addr if args.local_addr and hosts_store else host, TORCHELASTIC_RUN_ID=args.rdzv_id)
    for nodes in range(most, fewest - 1, -1):  # the most first: a fixed job's line
        env["WORLD_SIZE"] = str(nodes * nprocs)
        status = subprocess.run([sys.executable, args.training_script, *args.training_script_args], env=env).returncode
        if status:
            sys.exit(status)


def main():
    from torch.distributed.run import get_args_parser
    try:
        grace = float(os.environ.get("TORCHRUN_GRACE", "90"))
    except ValueError:
        grace = -1.0
    if not 0 < grace < float("inf"):  # nan fails this too
        print_line(f"torchrun_bounded.py: error: TORCHRUN_GRACE={os.environ['TORCHRUN_GRACE']}: give the seconds, "
                   "a number above 0 (90 by default)")
        sys.exit(2)
    argv, decided, rendezvous = node_settings(sys.argv[1:])
    args = get_args_parser().parse_args(argv)
    several_nodes = rendezvous is not None and str(args.nnodes).split(":")[-1] != "1"
    checking = "--check-args" in args.training_script_args  # check them, start nothing
    try:
        if checking:
            check_args(args, rendezvous)  # first: its line names a bad flag
        if several_nodes:
            refuse_what_no_setting_saves(args, rendezvous.host, warn=not checking)
        if checking:
            sys.exit(0)
        if decided:
            print_line(f"torchrun_bounded.py on {socket.gethostname()}: {decided}")
        if several_nodes and not rendezvous.hosts_store:
            wait_for_the_store(rendezvous)
    except KeyboardInterrupt:  # Ctrl-C before torchrun started (waiting for the store: 2 minutes by default)
        sys.exit(130)  # nothing started, nothing to say: the status of a Ctrl-C, without a traceback
    # Each attempt in a store of its own (kept where given): torchrun's agent lends the workers its store, which
    # outlives a restart, and its nodes may count attempts apart (an agent whose workers were healthy when another
    # node's failed restarts them as a membership change, not counted): those ranks would look for each other under
    # keys the others do not use (utils/lifecycle.py, attempt_prefix) until --dist-timeout.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.run import main as torchrun
    sys.argv = ["torchrun", *argv]
    if sys.platform.startswith("linux"):  # /proc: the watch is Linux's; elsewhere plain torchrun
        _record_states()
        threading.Thread(target=_watch, args=(os.getpid(), grace), name="torchrun-bounded", daemon=True).start()
    torchrun()


if __name__ == "__main__":
    main()
