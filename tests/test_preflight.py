"""scripts/preflight.py: the real check on CPU (gloo) through plain python and torchrun,
a machine with problems (shared memory too small, port taken, a rank that never
reaches the all-reduce), bad arguments; the report's GPU and multi-node branches
from recorded facts."""
import argparse
import contextlib
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import (ROOT, assert_one_line_error, fake_accelerator, free_port, on_rank_1, run_script, subprocess_env,
                      torchrun)
from scripts import preflight
from utils import distributed as dist_utils, spawn
from utils.cli import UsageError

SCRIPT = "scripts/preflight.py"


def assert_one_report(stdout):
    # Only global rank 0 prints: one header line, one verdict.
    assert stdout.count("preflight: ") == 1, stdout
    assert len(re.findall(r"^(all checks passed|\d+ problems?:)$", stdout, re.M)) == 1, stdout


def test_plain_python_starts_two_cpu_processes_and_passes():
    proc = run_script([SCRIPT, "--port", free_port(), "--iters", "3"], timeout=240)
    out = proc.stdout
    assert "preflight: 2 processes on 1 node (plain python" in out
    assert f"PyTorch {torch.__version__}" in out and f"Python {sys.version.split()[0]}" in out
    assert "44.9 MB (resnet18's gradient, 11,220,132 float32) over 2 processes:" in out
    assert "bus bandwidth = algbw x 2(n-1)/n" in out
    assert "free on node 0" in out and "NCCL_*, GLOO_*" in out
    # Without --workers, the scripts' own default on this node (min(4, cores per process)), judged by their rule.
    assert f"per process; --workers {max(1, min(4, len(os.sched_getaffinity(0)) // 2))}\n" in out, out
    assert out.rstrip().endswith("all checks passed")
    assert_one_report(out)


def test_under_torchrun_uses_the_launchers_processes():
    proc = torchrun(2, SCRIPT, ["--workers", "0", "--iters", "3", "--model", "resnet_tiny"])
    out = proc.stdout
    assert "preflight: 2 processes on 1 node (torchrun, rendezvous" in out
    assert "reached by 2 of 2 processes" in out
    assert "(resnet_tiny's gradient" in out and "bus bandwidth" in out
    assert out.rstrip().endswith("all checks passed")
    assert_one_report(out)


def test_a_rank_slow_to_read_the_verdict_from_rank_0s_store_still_passes(tmp_path):
    """With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the launchers set it), torchrun's c10d rendezvous leaves
    the ranks' store to rank 0, whose exit takes it away. Rank 1 reads the verdict 3 s after it came."""
    slow = ("import time, torch.distributed as d; get = d.PrefixStore.get; d.PrefixStore.get = lambda self, key: "
            "(time.sleep(3) if key.startswith('verdict') else None, get(self, key))[1]")
    proc = torchrun(2, on_rank_1(tmp_path, SCRIPT, slow), ["--workers", "0", "--iters", "3", "--model", "resnet_tiny"],
                    env={**subprocess_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("all checks passed")


def test_problems_are_listed_with_their_fixes_and_a_stuck_rank_times_out(tmp_path):
    """A shared-memory folder too small for the loader workers, a rendezvous port in use,
    more workers than cores, and rank 1 never reaching the all-reduce: exit 1 within the
    --timeout bounds, every problem with its fix."""
    stuck = tmp_path / "stuck_rank.py"
    stuck.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from scripts import preflight
        from utils import cli, lifecycle
        real = preflight.time_all_reduce
        def stuck(numel, device, role, iters):
            if role.rank == 1:
                time.sleep(3600)  # as a rank whose network never delivers
            return real(numel, device, role, iters)
        preflight.time_all_reduce = stuck
        lifecycle.run_main(preflight.main, sys.argv[1:])
    """))
    shm = tmp_path / "shm"
    shm.mkdir()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.monotonic()
        proc = run_script([stuck, "--shm-dir", shm, "--workers", "10000", "--batch-size", "2000000",
                           "--sample-shape", "3,1024,1024", "--port", port, "--timeout", "4",
                           "--model", "resnet_tiny"], check=False, timeout=240)
        elapsed = time.monotonic() - started
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "Traceback" not in out + proc.stderr
    assert "rank 1: all-reduce timed out: did not finish within 4 s" in out
    assert "the all-reduce over 2 processes did not finish within 4 s" in out
    assert f"{shm} has" in out and "the loader workers would hold" in out
    assert "fix: lower --workers or --batch-size" in out
    assert f"port {port} is already in use" in out and f"ss -ltnp 'sport = :{port}'" in out
    assert "--workers 10000 per process, with " in out
    count = int(re.search(r"^(\d+) problems:$", out, re.M).group(1))
    assert count >= 4 and len(re.findall(r"^     fix: \S", out, re.M)) == count, out
    assert elapsed < 200
    assert_one_report(out)


def test_ctrl_c_to_the_process_group_ends_the_check_without_a_traceback(tmp_path):
    """Ctrl-C from a terminal reaches every process of its group: the check's own processes too, here while
    they wait in the all-reduce. The process that started them answers it (exit status 130) and ends them:
    no traceback from any of them, none left running."""
    waiting = tmp_path / "waiting"
    waiting.mkdir()
    entry = tmp_path / "interrupted.py"
    entry.write_text(textwrap.dedent(f"""
        import pathlib, signal, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from scripts import preflight
        from utils import lifecycle
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job ignores it)
        def wait(numel, device, role, iters):
            pathlib.Path({str(waiting)!r}, str(role.rank)).touch()
            time.sleep(3600)
        preflight.time_all_reduce = wait
        lifecycle.run_main(preflight.main, sys.argv[1:])
    """))
    proc = subprocess.Popen([sys.executable, str(entry), "--workers", "0", "--port", str(free_port()), "--timeout",
                             "120", "--model", "resnet_tiny"], cwd=ROOT, env=subprocess_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while len(os.listdir(waiting)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(os.listdir(waiting)) == 2, "the processes never reached the all-reduce"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in out + err, err
    with pytest.raises(ProcessLookupError):  # every process of the group has ended
        os.killpg(proc.pid, 0)


def test_the_stores_port_cannot_be_taken_between_its_choice_and_its_use(tmp_path):
    """A port that a process lets go of may go to another program at once (an outgoing connection takes any
    free port of the kernel's ephemeral range). Here every port this check's first process lets go of is taken
    at once: the store listens on a port the system gave it, never on one chosen before, so the check passes."""
    entry = tmp_path / "ports_taken.py"
    entry.write_text(textwrap.dedent(f"""
        import os, socket, sys
        sys.path.insert(0, {str(ROOT)!r})
        from scripts import preflight
        from utils import lifecycle
        first, close, taken = os.getpid(), socket.socket.close, []
        def close_and_take(self):
            address = self.getsockname() if self.family == socket.AF_INET and self.fileno() >= 0 else ("", 0)
            close(self)
            if address[1] and os.getpid() == first:
                other = socket.socket()
                other.bind(address)
                other.listen()
                taken.append(other)
        socket.socket.close = close_and_take
        lifecycle.run_main(preflight.main, sys.argv[1:])
    """))
    proc = run_script([entry, "--workers", "0", "--port", free_port(), "--iters", "1", "--model", "resnet_tiny"],
                      check=False, timeout=240)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("all checks passed"), proc.stdout + proc.stderr


def test_a_bad_flag_is_one_line_and_exit_2():
    proc = run_script([SCRIPT, "--workers", "-1"], check=False, timeout=120)
    assert_one_line_error(proc, "--workers", "must be 0 or more")


@pytest.mark.parametrize("argv, fragment", [
    (["--shm-dir", "/no/such/folder"], "--shm-dir /no/such/folder is not a directory"),
    (["--sample-shape", "3,x,32"], "expected sizes separated by commas"),
    (["--port", "70000"], "a TCP port is 1 .. 65535"),
    (["--timeout", "0"], "must be 1 .. 31536000 (a year)"),
    (["--timeout", "1e10"], "must be 1 .. 31536000 (a year)"),
    # torchrun splits at the last colon, as preflight did: host 'fe80:', port 1, which never resolves
    (["--rdzv-endpoint", "fe80::1"], "which torchrun reads as host 'fe80:' and port 1: write it in brackets, "
                                     "[fe80::1]:PORT"),
    # an address and a port as torchrun reads them: written in brackets, the same endpoint
    (["--rdzv-endpoint", "fd00:57::1:29400"], "host 'fd00:57::1' and port 29400: write it in brackets, "
                                              "[fd00:57::1]:29400"),
    (["--rdzv-endpoint", "[fe80::1]x"], "expected [IPV6 ADDRESS]:PORT"),
    (["--rdzv-endpoint", "nodea:"], "ends with a colon"),  # torchrun refuses it; the default port is checked
])
def test_bad_arguments_exit_2_before_starting_anything(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        preflight.lifecycle.run_main(preflight.main, argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err


@pytest.mark.parametrize("env, argv, fragment", [
    ({"WORLD_SIZE": "2"}, ["--nproc", "2"], "under torchrun use --nproc_per_node"),
    ({"WORLD_SIZE": "two"}, [], "WORLD_SIZE='two' is not a rank or size"),
    ({"WORLD_SIZE": "2"}, [], "WORLD_SIZE is set but MASTER_ADDR or MASTER_PORT is not"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"}, [], "MASTER_PORT='abc' is not a TCP port"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"}, [], "MASTER_PORT='70000' is not a TCP"),
    # Rank 0 without torchrun's agent store: it serves the store at MASTER_ADDR, a documentation address (RFC 5737).
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "198.51.100.7", "MASTER_PORT": "29500"}, [],
     "MASTER_ADDR=198.51.100.7 resolves to no address of this host, where rank 0 serves the ranks' store"),
])
def test_launcher_variables_that_cannot_be_right_are_refused(monkeypatch, capsys, env, argv, fragment):
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"RANK": "0", **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        preflight.lifecycle.run_main(preflight.main, argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err


@pytest.mark.parametrize("master_addr, cause", [
    # Bare torchrun's c10d: node 0's own name (socket.getfqdn() there), which this node cannot resolve.
    ("nodea.invalid", "MASTER_ADDR nodea.invalid, where the ranks meet, does not resolve on this host"),
    ("localhost", "MASTER_ADDR localhost is 127.0.0.1 here, a loopback address"),
])
def test_a_rank_of_another_node_that_cannot_reach_the_store_is_told_why(monkeypatch, capsys, master_addr, cause):
    """Rank 1 of node 1 under torchrun: what keeps it from node 0's store is named as the run would
    name it (utils/network.py), not a firewall; one line, status 1."""
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1",
           "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": master_addr,
           "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        preflight.lifecycle.run_main(preflight.main, ["--timeout", "2", "--workers", "0"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 1 and len(err.splitlines()) == 1, err
    assert f"rank 1 ({socket.gethostname()}) cannot reach the ranks' store at {master_addr}:{port}" in err, err
    assert cause in err and preflight.STORE_PORT_FIX not in err, err


def test_rank_0_whose_stores_port_is_taken_says_so_with_status_2(monkeypatch, capsys):
    """A launcher without torchrun's agent store: rank 0 serves the store at MASTER_PORT, held here."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        with pytest.raises(SystemExit) as exit_:
            preflight.lifecycle.run_main(preflight.main, ["--timeout", "2", "--workers", "0"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"cannot serve the ranks' store at 127.0.0.1:{port}" in err and f"port {port} is already in use" in err, err


def test_bounded_returns_raises_or_gives_up():
    assert preflight.bounded(lambda: 42, 5) == 42
    with pytest.raises(ZeroDivisionError):
        preflight.bounded(lambda: 1 / 0, 5)
    started = time.monotonic()
    with pytest.raises(preflight.Hung, match="within 0.2 s"):
        preflight.bounded(lambda: time.sleep(30), 0.2)
    assert time.monotonic() - started < 5


def test_port_in_use_is_seen():
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        taken = preflight.port_facts(port)
    assert taken["free"] is False and taken["suggest"] != port
    # The suggestion stays out of the range that outgoing connections take their ports from.
    assert taken["suggest"] not in spawn.ephemeral_ports()
    assert preflight.port_facts(free_port())["free"] is True


def test_devices_per_node_are_checked_as_the_run_checks_them(monkeypatch):
    # torchrun --virtual-local-rank: every worker is local rank 0 and sees its own GPU alone; the run trains.
    fake_accelerator(monkeypatch, "cuda", 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    args = preflight.build_parser().parse_args([])
    preflight.validate(args, dist_utils.DistEnv(0, 0, 2, 2, distributed=True))
    with pytest.raises(UsageError, match="local rank 1 of 2 processes per node has no device"):
        preflight.validate(args, dist_utils.DistEnv(1, 1, 2, 2, distributed=True))


def test_a_port_that_cannot_be_listened_on_is_not_called_free(monkeypatch):
    # As for a user's port below 1024 (EACCES): the store would fail there as surely as on a port in use.
    bind = socket.socket.bind

    def refused(self, address):
        if self.family == socket.AF_INET:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return bind(self, address)
    monkeypatch.setattr(socket.socket, "bind", refused)
    assert preflight.port_facts(80) == {"port": 80, "free": False, "error": "Permission denied"}


def test_report_names_a_port_that_cannot_be_listened_on(capsys):
    role = preflight.Role(0, 1, 0, 1, 0, "python")
    facts = {0: rank_facts(0, 0, local=node_facts(["H100"], None, 2**34))}
    facts[0]["port"] = {"port": 80, "free": False, "error": "Permission denied"}
    problems = preflight.report(facts, passed([0]), args_for(), role)
    assert "80: cannot listen on node 0" in capsys.readouterr().out
    assert any("cannot listen on port 80" in what and "1024 or above" in fix for what, fix in problems), problems


@pytest.mark.parametrize("value, expected", [
    ("eth", ["eth0", "eth1"]),         # a prefix
    ("=eth", []),                      # = asks for the exact name
    ("^lo,docker", ["eth0", "eth1"]),  # ^ excludes
    ("ib0", []),
])
def test_nccl_socket_ifname_matches_as_nccl_reads_it(value, expected):
    assert preflight.nccl_interfaces(value, ["docker0", "eth0", "eth1", "lo"]) == expected


@pytest.mark.parametrize("text", ["nodea", "nodea:29500", "10.0.0.1", "[fd00:57::1]", "[fd00:57::1]:29500"])
def test_an_endpoint_is_read_as_torchruns_c10d_rendezvous_reads_it(text):
    """The port too: without one, c10d's default (29400), which torchrun and torchrun_bounded.py use."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    assert preflight.endpoint(text) == parse_rendezvous_endpoint(text, default_port=DEFAULT_PORT)


@pytest.mark.parametrize("endpoint, torchrun_hosts, fix", [
    ("node0.cluster", False, "map nodea to 10.0.0.1 in /etc/hosts; "),  # an alias: /etc/hosts maps names to addresses
    ("fd00:57::1", True, None),  # an IPv6 address of this host, which torchrun recognises: nothing to fix
    ("node1.cluster", True, None),  # another host's: not this node's to host, whatever torchrun would guess
])
def test_this_host_as_the_endpoint_is_recognised_by_any_of_its_addresses(monkeypatch, endpoint, torchrun_hosts, fix):
    """This host is nodea, whose name is on a loopback line; 10.0.0.1 and fd00:57::1 are its addresses."""
    from torch.distributed.elastic.rendezvous import utils as rendezvous_utils
    from utils import network
    names = {"nodea": ["127.0.1.1"], "node0.cluster": ["10.0.0.1"], "fd00:57::1": ["fd00:57::1"],
             "node1.cluster": ["10.0.0.2"]}
    monkeypatch.setattr(socket, "gethostname", lambda: "nodea")
    monkeypatch.setattr(network, "resolve", lambda host, family=socket.AF_INET: [
        a for a in names.get(host, []) if family == socket.AF_UNSPEC or (":" in a) == (family == socket.AF_INET6)])
    monkeypatch.setattr(network, "is_own", lambda address: address in ("10.0.0.1", "fd00:57::1"))
    monkeypatch.setattr(rendezvous_utils, "_matches_machine_hostname", lambda host: torchrun_hosts)
    found = preflight.endpoint_findings(endpoint)
    assert len(found) == (1 if fix else 0) and all(f.fix.startswith(fix) for f in found), found


def test_this_host_as_the_endpoint_whose_own_name_does_not_resolve_makes_torchrun_fail_at_once(monkeypatch):
    """torchrun looks up this host's own name to tell whether to host the store, outside any try
    (rendezvous/utils.py, _matches_machine_hostname): its gaierror ends torchrun, nobody waits."""
    from utils import network
    monkeypatch.setattr(socket, "gethostname", lambda: "nodea.invalid")
    monkeypatch.setattr(network, "is_own", lambda address: address == "127.0.0.2")
    monkeypatch.setattr(network, "resolve", lambda host, family=socket.AF_INET: ["127.0.0.2"] * (host == "node0"))
    with pytest.raises(socket.gaierror):  # torch's own check, as torchrun would run it here
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
        _matches_machine_hostname("node0")
    [found] = preflight.endpoint_findings("node0")
    assert "nodea.invalid, this host's name, does not resolve" in found.what and "fails here at once" in found.what
    assert "about 2 minutes" not in found.what and found.fix.startswith("map nodea.invalid to 127.0.0.2 in /etc/hosts")


def test_a_loopback_endpoint_is_named_as_the_user_gave_it():
    """--rdzv-endpoint localhost: the finding names the endpoint and its fix, not MASTER_ADDR's."""
    role = preflight.Role(rank=0, world_size=2, local_rank=0, local_world_size=2, node=0, launcher="python")
    facts = preflight.network_facts(role, args_for(rdzv_endpoint=("localhost", 29500)), torch.device("cpu"))
    [finding] = [f for f in facts["findings"] if "loopback address" in f["what"]]
    assert finding["what"].startswith("the rendezvous endpoint localhost is 127.0.0.1 here"), finding
    assert finding["fix"] == "give the rendezvous endpoint node 0's network address", finding


# --- the report from recorded facts: what a GPU node or two nodes would send ------------

def node_facts(devices, peer_access, shm_free, env=None, cores=16, ram=64 * 2**30, network=None, workers=4):
    return {"local_world_size": max(len(devices), 1), "devices": devices, "peer_access": peer_access,
            "workers": workers, "nvidia_driver": None,
            "shm": {"path": "/dev/shm", "exists": True, "free": shm_free, "total": shm_free, "fstype": "tmpfs"},
            "cpus": {"affinity": cores, "quota": None, "cores": cores}, "ram": [ram, ram],
            "env": env or {}, "interfaces": ["eth0", "lo"], "network": network or network_facts()}


def network_facts(gloo="10.0.0.1", findings=(), **more):
    """A node's network as network_facts records it: gloo's address (None: GLOO_SOCKET_IFNAME names no
    interface with one), utils/network.py's findings; `more`: the peer, the endpoint."""
    return {"hostname": "host", "resolves": ["10.0.0.1"], "interfaces": {"lo": "127.0.0.1", "eth0": "10.0.0.1"},
            "gloo": {"address": gloo, "interface": "eth0" if gloo else None, "why": "the address of this host's name"},
            "nccl": None, "peer": None, "findings": list(findings), **more}


def rank_facts(rank, node, torch_version="2.11.0", local=None, gpu=True):
    facts = {"rank": rank, "node": node, "host": f"host{node}", "python": "3.11.7", "torch": torch_version,
             "cuda": "13.0", "hip": None, "cudnn": 91002, "nccl": "2.27.7",
             "device": f"cuda:{rank}" if gpu else "cpu", "device_name": "NVIDIA H100 80GB HBM3",
             "mem_free": 79 * 2**30, "mem_total": 80 * 2**30}
    if local is not None:
        facts["node_facts"] = local
    return facts


def args_for(**overrides):
    values = dict(workers=4, batch_size=256, sample_shape=(3, 224, 224), sample_dtype="float32",
                  model="resnet18", timeout=30.0, iters=10, port=None, nproc=None, shm_dir="/dev/shm",
                  rdzv_endpoint=None)
    values.update(overrides)
    return argparse.Namespace(**values)


def passed(ranks, backend="nccl"):
    """Every rank's all-reduce of 44.9 MB took 2 ms and summed right."""
    ok = {"status": "ok", "value": None}
    return {r: {"backend": backend, "join": ok, "all_reduce": {"status": "ok", "value": {"seconds": 0.002,
                                                                                         "correct": True}}}
            for r in ranks}


def test_report_two_gpus_that_hang_get_nccl_p2p_disable_and_docker_shm(capsys):
    role = preflight.Role(0, 2, 0, 2, 0, "python")
    facts = {0: rank_facts(0, 0, local=node_facts(["H100", "H100"], [[True, True], [True, True]],
                                                  shm_free=64 * 2**20)),
             1: rank_facts(1, 0)}
    facts[0]["port"] = {"port": 29500, "free": True}
    timed_out = {"status": "timed out", "error": "did not finish within 30 s"}
    results = {0: {"backend": "nccl", "join": {"status": "ok", "value": None},
                   "peer_copy": {"status": "ok", "value": []}, "all_reduce": timed_out},
               1: {"backend": "nccl", "join": {"status": "ok", "value": None}, "all_reduce": timed_out}}
    problems = preflight.report(facts, results, args_for(), role)
    out = capsys.readouterr().out
    assert "a 1 MB copy between every pair arrived intact" in out
    assert re.search(r"^ +0 +- +yes$", out, re.M) and re.search(r"^ +1 +yes +-$", out, re.M), out
    fixes = [fix for _, fix in problems]
    assert any(fix.startswith("export NCCL_P2P_DISABLE=1") for fix in fixes), fixes
    # 4 workers x 2 x (128 + 256 evaluation) samples x 602 KB = 1.8 GB per process: Docker's 64 MB is not enough.
    assert any("docker run --ipc=host (or --shm-size=" in fix for fix in fixes), fixes
    assert len(problems) == 2, problems


def test_report_two_nodes_with_different_versions_and_variables(capsys):
    role = preflight.Role(0, 2, 0, 1, 0, "torchrun", nodes=2)
    facts = {0: rank_facts(0, 0, local=node_facts(["H100"], None, 2**34, env={"NCCL_SOCKET_IFNAME": "ib",
                                                                               "NCCL_IB_DISABLE": "1"})),
             1: rank_facts(1, 1, torch_version="2.10.0", local=node_facts(["H100"], None, 2**34))}
    facts[0]["rendezvous"] = "host0:29500"
    for f in facts.values():
        f["device"] = "cuda:0"
    problems = preflight.report(facts, passed([0, 1]), args_for(sample_shape=(3, 32, 32)), role)
    out = capsys.readouterr().out
    # 44.9 MB in 2 ms: 22.4 GB/s algorithm bandwidth, x 2(2-1)/2 = the same bus bandwidth.
    assert "algbw 22.44 GB/s, bus bandwidth 22.44 GB/s" in out
    assert out.startswith("preflight: 2 processes on 2 nodes (torchrun") and "reached by 2 of 2 processes" in out
    whats = " | ".join(what for what, _ in problems)
    assert "different PyTorch versions: 2.10.0, 2.11.0" in whats
    assert "NCCL_SOCKET_IFNAME=ib does not match its interfaces" in whats
    assert "different NCCL_*/GLOO_* variables" in whats
    assert len(problems) == 3, problems
    # The heading names every kind of variable listed under it.
    assert f"environment ({', '.join(prefix + '*' for prefix in preflight.ENV_PREFIXES)})" in out, out
    # Each node's own interface, named on one node only (torchrun_bounded.py sets it where it must): no problem.
    for node, env in enumerate(({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}, {})):
        facts[node]["node_facts"]["env"] = env
    facts[1]["torch"] = "2.11.0"
    assert preflight.report(facts, passed([0, 1]), args_for(sample_shape=(3, 32, 32)), role) == []


@pytest.mark.parametrize("launcher", ["torchrun", "python"])
def test_ranks_that_never_reported_are_the_one_problem(capsys, launcher):
    """No rank starts the all-reduce without every rank's facts, so it did not fail. Under torchrun node 1 of 2
    is silent: it is not one node, and node 0's GPUs are not to blame. Under plain python the silent rank is
    this script's own process, which ended: there is no other node to start."""
    several = launcher == "torchrun"
    role = preflight.Role(0, 4, 0, 2, 0, launcher, nodes=2) if several else preflight.Role(0, 2, 0, 2, 0, launcher)
    facts = {0: rank_facts(0, 0, local=node_facts(["H100", "H100"], [[True, True], [True, True]], 2**40)),
             1: rank_facts(1, 0) if several else None, **({2: None, 3: None} if several else {})}
    facts[0]["rendezvous"] = "host0:29500"
    results = {rank: {"backend": "nccl"} if f else None for rank, f in facts.items()}
    problems = preflight.report(facts, results, args_for(), role)
    out = capsys.readouterr().out
    missing = "ranks 2, 3" if several else "rank 1"
    assert f"over {role.world_size} processes: not attempted ({missing} did not report)" in out, out
    [(what, fix)] = problems
    assert what == f"{missing} did not report within --timeout 30 s", what
    if several:
        assert out.startswith("preflight: 4 processes on 2 nodes (torchrun"), out
        assert fix.startswith(preflight.STORE_PORT_FIX), fix
    else:
        assert fix.startswith("a process that ended printed its error above;"), fix


def test_a_node_checked_alone_leaves_the_global_batch_to_the_check_across_the_nodes(capsys):
    """--rdzv-endpoint: --batch-size is the job's GLOBAL batch, divided over every node's processes, which this
    node does not know: its own 2 would make each process's batch, and the shared memory, too large."""
    role = preflight.Role(0, 2, 0, 2, 0, "python")
    net = network_facts(peer="node0", peer_addresses=["10.0.0.9"], peer_is_here=False, toward=["eth0", "10.0.0.1"],
                        endpoint={"host": "node0", "port": 29400, "here": False, "answers": "refused"})
    facts = {0: rank_facts(0, 0, local=node_facts(["H100", "H100"], None, 64 * 2**20, network=net)),
             1: rank_facts(1, 0)}
    problems = preflight.report(facts, passed([0, 1]), args_for(batch_size=1001, rdzv_endpoint=("node0", 29400)),
                                role)
    out = capsys.readouterr().out
    assert "whether --batch-size divides, is checked under torchrun across the nodes" in out, out
    assert problems == [], problems


@pytest.mark.parametrize("several", [True, False])
def test_a_gloo_interface_without_an_address_is_one_problem_with_one_fix(capsys, several):
    """GLOO_SOCKET_IFNAME=eth9, no interface here, on CPU nodes. On several, utils/network.py's finding names
    it, and the failed all-reduce points to that finding's fix; on one, the report names it itself."""
    finding = {"certain": True, "what": "gloo has no address to listen on (GLOO_SOCKET_IFNAME=eth9: a name there "
                                        "is no interface with an IPv4 address here)",
               "fix": "export GLOO_SOCKET_IFNAME=eth0"}
    net = network_facts(gloo=None, findings=[finding], peer="host0", peer_addresses=["10.0.0.1"]) if several \
        else network_facts(gloo=None)
    nodes = (0, 1) if several else (0,)
    facts = {r: rank_facts(r, node, gpu=False, local=node_facts([], None, 2**40, env={"GLOO_SOCKET_IFNAME": "eth9"},
                                                                network=net) if r == node else None)
             for r, node in ((0, 0), (1, 1 if several else 0))}
    facts[0]["node_facts"]["local_world_size"] = 1 if several else 2
    failed = {"status": "error", "error": "RuntimeError: no device"}
    results = {r: {"backend": "gloo", "join": failed} for r in (0, 1)}
    role = preflight.Role(0, 2, 0, 1, 0, "torchrun", nodes=2) if several else preflight.Role(0, 2, 0, 2, 0, "python")
    problems = preflight.report(facts, results, args_for(), role)
    capsys.readouterr()
    gloo = [fix for what, fix in problems if "GLOO_SOCKET_IFNAME=eth9" in what]
    assert len(gloo) == len(nodes) and len(set(gloo)) == 1, problems  # a problem per node, one fix
    [(what, fix)] = [(what, fix) for what, fix in problems if what.startswith("the all-reduce")]
    assert ("export GLOO_SOCKET_IFNAME=eth0" in fix) if several else fix.startswith("correct the *_SOCKET_IFNAME"), fix
    assert len(problems) == len(nodes) + 1, problems


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_where_gloo_listens_on_the_node_the_others_meet_at_is_asked_of_gloo_only(capsys, backend):
    """Node 0 is MASTER_ADDR: its name resolves to eth0's address there, to eth1's on node 1, and gloo there
    listens on eth0. With gloo, GLOO_SOCKET_IFNAME=eth1 is the fix for an all-reduce that hangs; NCCL never
    reads that variable (it chooses its own interface): its fix is the general one."""
    gpu = backend == "nccl"
    role = preflight.Role(0, 2, 0, 1, 0, "torchrun", nodes=2)
    node0 = network_facts(peer="host0", peer_addresses=["10.0.0.1"], peer_is_here=True, toward=[None, None])
    node0["interfaces"]["eth1"] = "10.1.0.1"
    node1 = network_facts(gloo="10.1.0.2", peer="host0", peer_addresses=["10.1.0.1"], peer_is_here=False,
                          toward=["eth1", "10.1.0.2"])
    facts = {rank: rank_facts(rank, rank, gpu=gpu, local=node_facts(["H100"] if gpu else [], None, 2**40, network=net))
             for rank, net in enumerate([node0, node1])}
    for f in facts.values():
        f["device"] = "cuda:0" if gpu else "cpu"
    facts[0]["rendezvous"] = "host0:29400"
    timed_out = {"status": "timed out", "error": "did not finish within 30 s"}
    results = {r: {"backend": backend, "join": {"status": "ok", "value": None}, "all_reduce": timed_out}
               for r in (0, 1)}
    [(what, fix)] = preflight.report(facts, results, args_for(sample_shape=(3, 32, 32)), role)
    out = capsys.readouterr().out
    assert what == "the all-reduce over 2 processes did not finish within 30 s", what
    if gpu:
        assert fix.startswith("set NCCL_SOCKET_IFNAME") and "GLOO_SOCKET_IFNAME=" not in out + fix, out + fix
    else:
        assert fix == "node 0 (host): export GLOO_SOCKET_IFNAME=eth1", fix


def test_a_node_of_another_accelerator_is_named_by_its_kind(capsys):
    """Two Intel GPUs: peer access is queried on CUDA and ROCm GPUs only, which is not 'no GPUs'."""
    role = preflight.Role(0, 2, 0, 2, 0, "python")
    facts = {0: rank_facts(0, 0, local=node_facts(["Intel(R) Data Center GPU Max 1550"] * 2, None, 2**40)),
             1: rank_facts(1, 0)}
    for rank, f in facts.items():
        f["device"], f["device_name"] = f"xpu:{rank}", "Intel(R) Data Center GPU Max 1550"
    assert preflight.report(facts, passed([0, 1], backend="xccl"), args_for(sample_shape=(3, 32, 32)), role) == []
    out = capsys.readouterr().out
    assert "node 0: 2 xpu devices: checked on CUDA and ROCm GPUs only" in out and "GPUs:" not in out, out


def test_a_gpu_node_whose_gpus_pytorch_cannot_use_is_a_problem(tmp_path, monkeypatch, capsys):
    """An NVIDIA driver older than PyTorch's CUDA: torch.cuda.is_available() is False, and the job would train
    on the CPU. The node's facts name the driver; the report names it with the CUDA this PyTorch needs. GPUs
    hidden on purpose (CUDA_VISIBLE_DEVICES empty, as the tests run) are no problem."""
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.256.02  Thu May  2 14:37:44 UTC 2024\n"
                      "GCC version:  gcc version 9.4.0 (Ubuntu 9.4.0-1ubuntu1~20.04.2)\n")
    monkeypatch.setattr(preflight, "NVIDIA_DRIVER", str(driver))
    monkeypatch.setattr(preflight, "local_devices", lambda: ("cpu", 0))  # what PyTorch finds there
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    role, args = preflight.Role(0, 1, 0, 1, 0, "python"), args_for(port=free_port(), sample_shape=(3, 32, 32))
    facts = {0: preflight.rank_facts(role, args, torch.device("cpu"))}
    problems = preflight.report(facts, {0: {"backend": "gloo"}}, args, role)
    assert "no accelerator: the CPU, with gloo" in capsys.readouterr().out
    [(what, fix)] = [(what, fix) for what, fix in problems if "NVIDIA" in what]
    assert "(NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.256.02" in what and "finds no GPU" in what, what
    assert (f"it must be {torch.version.cuda} or newer" if torch.version.cuda else "PyTorch built for CUDA") in fix
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert preflight.rank_facts(role, args, torch.device("cpu"))["node_facts"]["nvidia_driver"] is None


# The loaders are built, never iterated: their 4 workers per loader never start on this small CPU.
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_shared_memory_figure_is_what_the_training_scripts_loaders_hold(capsys):
    """preflight counts the bytes that real loaders built with the same flags may hold at once: prefetched
    batches of both loaders (they keep their workers), samples as a worker hands them over, both processes."""
    from utils import data
    from utils.distributed import DistEnv
    role = preflight.Role(0, 2, 0, 2, 0, "python")
    facts = {0: rank_facts(0, 0, local=node_facts(["H100", "H100"], None, 2**40)), 1: rank_facts(1, 0)}
    preflight.report(facts, passed([0, 1]), args_for(sample_shape=(3, 32, 32), sample_dtype="uint8", batch_size=128), role)
    out = capsys.readouterr().out
    args = argparse.Namespace(dataset="synthetic", train_samples=256, test_samples=100, seed=0, workers=4)
    env = DistEnv(0, 0, 2, 2, torch.device("cpu"), True)
    train_set, test_set = data.build_datasets(args, env)
    loaders = [data.train_loader(train_set, 64, 128, env, args), data.eval_loader(test_set, 128, env, args)]
    in_process = argparse.Namespace(**{**vars(args), "workers": 0})
    images, labels = next(iter(data.train_loader(train_set, 64, 128, env, in_process)))  # as a worker hands it over
    sample_bytes = (images.nbytes + labels.nbytes) // len(labels)
    need = sum(loader.num_workers * loader.prefetch_factor * loader.batch_size for loader in loaders) * sample_bytes * 2
    assert f"{preflight.size(need)} for 2 on the node" in out, out


@pytest.mark.gpu
def test_on_the_local_gpus():
    env = subprocess_env(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        env.pop("CUDA_VISIBLE_DEVICES")
    proc = run_script([SCRIPT, "--workers", "0", "--port", free_port()], env=env, check=False, timeout=300)
    out = proc.stdout
    assert f"{torch.cuda.device_count()} process" in out, out + proc.stderr
    assert "backend nccl" in out and "NCCL " in out
    if torch.cuda.device_count() > 1:
        assert "bus bandwidth" in out and "peer-to-peer" in out
    assert proc.returncode in (0, 1), out + proc.stderr
