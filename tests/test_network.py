"""utils/network.py's decision, and the settings torchrun_bounded.py draws from it, on hosts described by
hand: this host's name, its interfaces, what each name resolves to here. (The same on real hosts, each in a
network namespace: tests/test_hosts.py.)"""
import re
import socket
import sys

import pytest

from utils import network

# Node A: eth0 (listed first, and what its name resolves to on node A) reaches no other node; eth1 does.
NODE_A = {"lo": "127.0.0.1", "eth0": "10.0.1.1", "eth1": "10.0.0.1"}


@pytest.fixture
def on_host(monkeypatch):
    """on_host(name, interfaces, {host: address}, IPv6 addresses of its own): this process sees that host."""
    def describe(name, known, names, own_ipv6=()):
        monkeypatch.setattr(network.socket, "gethostname", lambda: name)
        monkeypatch.setattr(network, "interfaces", lambda: dict(known))
        own = [*known.values(), "::1", *own_ipv6]
        monkeypatch.setattr(network, "can_bind", lambda address: address in own)
        monkeypatch.setattr(network, "is_own", lambda address: address in own)
        # The kernel's source toward an address: the address itself where it is this host's own; no route to
        # another's (the tests that need one give it).
        monkeypatch.setattr(network, "source_toward", lambda address: address if address in own else None)

        def resolve(host, family=socket.AF_INET):  # a host's addresses in the resolver's order, IPv6 ones too
            found = names.get(host, [host])
            found = found if isinstance(found, list) else [found]
            return [a for a in found if family == socket.AF_UNSPEC or (":" in a) == (family == socket.AF_INET6)]
        monkeypatch.setattr(network, "resolve", resolve)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # what node_settings sets in os.environ goes with the test
    return describe


def test_another_hosts_name_on_a_loopback_line_here_is_this_hosts_fault(on_host):
    """An image cloned from node A: node B's /etc/hosts has `127.0.1.1 nodea`, node A's is right. Node B's
    line names node B's own hosts file; localhost (node 0's socket.getfqdn() under torchrun) keeps node 0's."""
    on_host("nodeb", {"lo": "127.0.0.1", "eth0": "10.0.0.2"}, {"nodea": "127.0.1.1", "localhost": "127.0.0.1"})
    [finding] = network.findings("nodea", uses_gloo=False)
    assert finding.certain and "MASTER_ADDR nodea is 127.0.1.1 here, a loopback address" in finding.what
    assert "this host (nodeb)" in finding.what and "node 0's /etc/hosts" not in finding.fix, finding.line
    assert finding.fix == ("list nodea in nodeb's own /etc/hosts with its network address, as the other "
                           "nodes resolve it, not on a 127.x line")
    [finding] = network.findings("localhost", uses_gloo=False)
    assert "node 0's /etc/hosts" in finding.fix and "--local-addr" in finding.fix, finding.line
    [finding] = network.findings("127.0.0.1", uses_gloo=False, flag="--ip")
    assert finding.fix == "give --ip node 0's network address"
    # An address as MASTER_ADDR is not c10d's getfqdn(): by hand, or bare torchrun's default --master-addr.
    [finding] = network.findings("127.0.0.1", uses_gloo=False)
    assert finding.what.startswith("MASTER_ADDR 127.0.0.1 is a loopback address: each node"), finding.line
    assert finding.fix == "give MASTER_ADDR node 0's network address (torchrun's --master-addr, 127.0.0.1 if not given)"


@pytest.mark.parametrize("meet_at", ["0.0.0.0", "::"])
def test_an_address_to_listen_on_is_no_place_to_meet(on_host, meet_at):
    """--ip 0.0.0.0, a server's listening address copied: every other node would connect to itself."""
    on_host("nodeb", {"lo": "127.0.0.1", "eth0": "10.0.0.2"}, {"nodeb": "10.0.0.2"})
    [finding] = network.findings(meet_at, uses_gloo=False, flag="--ip")
    assert finding.certain and finding.what.startswith(f"--ip {meet_at} is an address to listen on, not to connect "
                                                       "to: each node would look for the others at its own"), finding.line
    assert finding.fix == "give --ip node 0's network address"


def test_an_ipv6_meeting_point_still_has_gloo_s_address_checked(on_host):
    """gloo's address does not depend on where the ranks meet: a Debian host (its name on 127.0.1.1) is refused
    whatever the family of the meeting point's address, not only warned that IPv6 was not read."""
    on_host("nodeb", {"lo": "127.0.0.1", "eth0": "10.0.0.2"}, {"nodeb": "127.0.1.1"}, own_ipv6=["fd00::2", "127.0.1.1"])
    warning, refusal = network.findings("fd00::1", uses_gloo=True)
    assert not warning.certain and "fd00::1 is IPv6 here" in warning.what, warning.line
    assert refusal.certain and "gloo will listen on 127.0.1.1" in refusal.what, refusal.line


def test_gloo_socket_ifname_on_loopback_is_fixed_by_the_variable_not_the_hosts_file(on_host, monkeypatch):
    """GLOO_SOCKET_IFNAME=lo, copied from a one-machine recipe: gloo reads the variable, not /etc/hosts."""
    on_host("nodeb", {"lo": "127.0.0.1", "eth0": "10.0.0.2"}, {"nodeb": "10.0.0.2", "nodea": "10.0.0.1"})
    monkeypatch.setattr(network, "route_toward", lambda host, known: ("eth0", "10.0.0.2"))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    [finding] = network.findings("nodea", uses_gloo=True)
    assert finding.certain and finding.fix == "export GLOO_SOCKET_IFNAME=eth0", finding.line


def test_a_name_of_this_host_says_nothing_of_the_interface_the_others_reach(on_host, monkeypatch):
    """On node A, the job meets at its name, which resolves here to eth0's address; gloo is told eth1. The
    others resolve the name themselves: no advice to move gloo to eth0. Met at an address (the one every node
    is given), eth0 is where they reach this host: the warning stays."""
    on_host("nodea", NODE_A, {"nodea": "10.0.1.1"})
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    assert network.findings("nodea", uses_gloo=True) == []
    [finding] = network.findings("10.0.1.1", uses_gloo=True)
    assert not finding.certain and "10.0.1.1 is reached through eth0" in finding.what
    assert finding.fix == "export GLOO_SOCKET_IFNAME=eth0"


def test_another_hosts_name_reached_through_another_interface_than_gloo_s_is_warned_of(on_host, monkeypatch):
    """Node B, whose own name resolves to eth0, meets at nodea (distributed_mp.py --ip nodea, or bare torchrun's
    MASTER_ADDR, node 0's name), which its route reaches through eth1: gloo would give the others eth0's."""
    on_host("nodeb", {"lo": "127.0.0.1", "eth0": "10.0.1.2", "eth1": "10.0.0.2"},
            {"nodeb": "10.0.1.2", "nodea": "10.0.0.1"})
    monkeypatch.setattr(network, "route_toward", lambda host, known: ("eth1", "10.0.0.2"))
    [finding] = network.findings("nodea", uses_gloo=True)
    assert not finding.certain and "gloo will listen on 10.0.1.2" in finding.what, finding.line
    assert "nodea is reached through eth1 (10.0.0.2)" in finding.what and finding.fix == "export GLOO_SOCKET_IFNAME=eth1"


def test_gloo_takes_the_first_address_of_this_hosts_name_ipv6_included(on_host, monkeypatch):
    """gloo resolves this host's name for IPv4 and IPv6 and listens on the first address it can bind: with
    `::1 localhost nodea` before `10.0.0.1 nodea` in /etc/hosts, on ::1, which no other node reaches."""
    on_host("nodea", {"lo": "127.0.0.1", "eth0": "10.0.0.1"}, {"nodea": ["::1", "10.0.0.1"], "nodeb": "10.0.0.2"})
    monkeypatch.setattr(network, "route_toward", lambda host, known: ("eth0", "10.0.0.1"))
    assert network.gloo_listens_on() == ("::1", "the address of this host's name nodea")
    [finding] = network.findings("nodeb", uses_gloo=True)
    assert finding.certain and "gloo will listen on ::1" in finding.what and "a loopback address" in finding.what
    # cloud-init's Red Hat template lists the name on 127.0.0.1 too: a fix that names one line is followed by the other
    assert finding.fix.startswith("list nodea with 10.0.0.1 in /etc/hosts, on no loopback line (127.x, ::1)"), \
        finding.line


@pytest.mark.parametrize("value, address", [("eth1", "10.0.0.1"), ("eth1,eth0", "10.0.0.1"), ("eth", None),
                                            ("eth1,eth9", None)])
def test_gloo_socket_ifname_is_read_as_gloo_reads_it(on_host, monkeypatch, value, address):
    """Whole interface names, not prefixes; one that is no interface here and gloo cannot start (None). The
    report of scripts/preflight.py reads this too, so that one bad value is one problem."""
    on_host("nodea", NODE_A, {"nodea": "10.0.1.1"})
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", value)
    assert network.gloo_listens_on() == (address, f"GLOO_SOCKET_IFNAME={value}")


@pytest.mark.parametrize("endpoint, gloo", [("nodea", None), ("10.0.0.1", "eth1")])
def test_the_endpoints_node_is_named_to_the_others_as_the_endpoint(on_host, monkeypatch, endpoint, gloo):
    """torchrun_bounded.py on node A, the rendezvous endpoint's node: --local_addr (every rank's MASTER_ADDR
    where node A is node rank 0) is the endpoint as the user wrote it, which every node reaches, not the
    address the name has here (eth0's, which no other node reaches). is_host=1 is given where torchrun's
    own guess misses node A (its name on a loopback line, say). GLOO_SOCKET_IFNAME: the interface of the
    address every node is given; by name, node A's route to its own name (eth0) says nothing of the others'
    (the run would then advise eth1 toward node rank 0's address): none, where node A has two."""
    from scripts import torchrun_bounded
    from torch.distributed.elastic.rendezvous import utils as rendezvous_utils
    on_host("nodea", NODE_A, {"nodea": "10.0.1.1"})
    monkeypatch.setattr(rendezvous_utils, "_matches_machine_hostname", lambda host: False)
    argv, decided, found = torchrun_bounded.node_settings(["--nnodes=2", "--rdzv-backend=c10d",
                                                           f"--rdzv-endpoint={endpoint}:29500", "distributed.py"])
    assert decided == f"is_host=1 --local_addr={endpoint}" + (f" GLOO_SOCKET_IFNAME={gloo}" if gloo else "")
    assert found[:3] == (endpoint, 29500, True)  # host, port, and this node hosts the store
    assert f"--local_addr={endpoint}" in argv and "--rdzv-conf=is_host=1" in argv


@pytest.mark.parametrize("here, guess, given", [("nodea", True, None), ("nodea", False, "is_host=1"),
                                                ("nodeb", False, None), ("nodeb", True, "is_host=0")])
def test_is_host_is_given_only_where_torchruns_guess_is_wrong(on_host, monkeypatch, here, guess, given):
    """torchrun makes an agent it guesses to be the store's host a client when the port is taken (a second
    agent of the job on the same machine, tests/test_hosts.py); one given is_host=1 fails. So the launcher
    leaves a right guess alone."""
    from scripts import torchrun_bounded
    from torch.distributed.elastic.rendezvous import utils as rendezvous_utils
    on_host(here, NODE_A if here == "nodea" else {"lo": "127.0.0.1", "eth0": "10.0.0.2"}, {"nodea": "10.0.0.1"})
    monkeypatch.setattr(rendezvous_utils, "_matches_machine_hostname", lambda host: guess)
    argv, decided, _ = torchrun_bounded.node_settings(["--nnodes=2", "--rdzv-backend=c10d",
                                                       "--rdzv-endpoint=nodea:29500", "distributed.py"])
    conf = [a for a in argv if a.startswith("--rdzv-conf")]
    assert conf == ([f"--rdzv-conf={given}"] if given else []), argv
    assert ("is_host" in decided) == bool(given), decided


def test_is_host_joins_the_users_rdzv_conf_however_spelt_and_leaves_the_scripts_arguments_alone(on_host, monkeypatch):
    """The --rdzv-conf with is_host added is the one torchrun reads: the last before the training script (an
    abbreviation, which torchrun's parser takes, was left after it, and won without is_host), and the training
    script's own arguments are its own, an --rdzv-conf among them too (it was removed)."""
    from scripts import torchrun_bounded
    from torch.distributed.elastic.rendezvous import utils as rendezvous_utils
    from torch.distributed.run import get_args_parser
    on_host("nodea", NODE_A, {"nodea": "10.0.1.1"})
    monkeypatch.setattr(rendezvous_utils, "_matches_machine_hostname", lambda host: False)
    script = ["train.py", "--rdzv-conf", "theirs", "--out", "o"]
    argv, decided, _ = torchrun_bounded.node_settings(["--nnodes=2", "--rdzv-backend=c10d", "--rdzv_c",
                                                       "join_timeout=900", "--rdzv-endpoint=nodea:29500", *script])
    args = get_args_parser().parse_args(argv)
    assert "is_host=1" in decided and args.rdzv_conf == "join_timeout=900,is_host=1", argv
    assert [args.training_script, *args.training_script_args] == script, argv


def launched(monkeypatch, argv: list):
    """scripts/torchrun_bounded.py ARGV to where it starts torchrun (stubbed: nothing starts), with every
    connection to the endpoint refused: ("torchrun", its argv), ("check", the first check's environment),
    or else ("exit", status)."""
    import subprocess
    from torch.distributed import run
    from scripts import torchrun_bounded
    started = []
    monkeypatch.setattr(sys, "argv", ["torchrun_bounded.py", *argv])
    monkeypatch.setattr(sys, "platform", "test")  # no watch: nothing to watch
    monkeypatch.setattr(torchrun_bounded, "POLL_S", 0.05)
    monkeypatch.setattr(run, "main", lambda: started.append(("torchrun", sys.argv[1:])))
    monkeypatch.setattr(subprocess, "run", lambda cmd, env: started.append(("check", env)) or
                        subprocess.CompletedProcess(cmd, 0))

    def refused(*args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")
    monkeypatch.setattr(socket, "create_connection", refused)
    try:
        torchrun_bounded.main()
    except SystemExit as stop:
        return started[0] if started else ("exit", stop.code)
    return started[0]


JOB = ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=[fd00:57::1]:29400"]
SCRIPT = ["distributed.py", "--device", "cpu"]


def test_an_ipv6_endpoint_on_its_own_node_is_served_there_at_once(on_host, monkeypatch):
    """[fd00:57::1] is an address of node A, and torchrun's own guess says so: node A's agent will serve the
    store, so the launcher starts it at once, rather than wait for that store to take a connection (a wait
    that could only end in its one line, exit status 1, where bare torchrun works)."""
    from torch.distributed.elastic.rendezvous import utils as rendezvous_utils
    on_host("nodea", NODE_A, {"nodea": "10.0.0.1"}, own_ipv6=["fd00:57::1"])
    monkeypatch.setattr(rendezvous_utils, "_matches_machine_hostname", lambda host: True)
    assert launched(monkeypatch, [*JOB, "--rdzv-conf=read_timeout=1", *SCRIPT]) == \
        ("torchrun", [*JOB, "--rdzv-conf=read_timeout=1", *SCRIPT])


def test_an_ipv6_endpoint_that_takes_no_connection_is_named_as_torchrun_and_preflight_read_it(on_host, monkeypatch,
                                                                                            capsys):
    from scripts import preflight
    on_host("nodeb", {"lo": "127.0.0.1", "eth0": "10.0.0.2"}, {"nodeb": "10.0.0.2"})
    assert launched(monkeypatch, [*JOB, "--rdzv-conf=read_timeout=1", *SCRIPT]) == ("exit", 1)
    [line] = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "the rendezvous endpoint [fd00:57::1]:29400 took no connection in 2 s" in line, line
    named = re.search(r"preflight.py --rdzv-endpoint (\S+) checks", line).group(1)
    assert preflight.endpoint(named) == ("fd00:57::1", 29400), line


@pytest.mark.parametrize("is_host", ["yes", " Y ", "true", "1"])
def test_is_host_is_read_as_torchrun_reads_it(on_host, monkeypatch, is_host):
    """--rdzv-conf is_host in any of torchrun's spellings of true, spaces around it too (torchrun strips
    keys and values): this node serves the store, though the endpoint is none of its addresses (a DNS
    name that resolves to another address here, say). The launcher starts torchrun at once, and the
    check of the arguments meets at this node's --local_addr, where the job will."""
    on_host("nodeb", {"lo": "127.0.0.1", "eth0": "10.0.0.2"}, {"nodea": "10.0.0.1", "nodeb": "10.0.0.2"})
    job = ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=nodea:29400", "--local_addr=10.0.0.2",
           f"--rdzv-conf=read_timeout=1,is_host={is_host}"]
    assert launched(monkeypatch, [*job, *SCRIPT])[0] == "torchrun"
    what, env = launched(monkeypatch, [*job, *SCRIPT, "--check-args"])
    assert what == "check" and env["MASTER_ADDR"] == "10.0.0.2", (what, env)


def test_where_netlink_is_refused_the_hosts_primary_addresses_are_still_its_own(monkeypatch):
    """is_own asks the kernel's route lookup over netlink; where a sandbox refuses netlink sockets (gVisor, a
    seccomp profile), it falls back to the route's source, which names a primary address: the answers for this
    host's first network address and for an address of no host here are the same both ways."""
    own = next((a for a in network.interfaces().values() if not network.is_loopback(a)), None)
    if own is None:
        pytest.skip("this host has no network address but loopback")
    foreign = "198.51.100.7"  # TEST-NET-2 (RFC 5737): documentation only, no host's address
    assert network.is_own(own) and not network.is_own(foreign) and network.is_own("::1")
    real = socket.socket

    def without_netlink(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_NETLINK:
            raise PermissionError(1, "Operation not permitted")
        return real(family, *args, **kwargs)
    monkeypatch.setattr(network.socket, "socket", without_netlink)
    assert network.is_own(own) and not network.is_own(foreign) and network.is_own("::1")
    assert not network.is_own("not an address")
