"""Multi-node training across real hosts: network namespaces on this machine, each with its
own address (10.231.k.0/24, never 127.0.0.1), hostname and hosts file, joined by a switch
whose ports the tests can pull (scripts/netns_hosts.py). What breaks multi-node jobs for
users is reproduced here and answered: name resolution, the interface gloo picks, a
partition, a node lost for good.

Needs root and iproute2; skipped with the reason otherwise. Every test tears its hosts down
however it ends (test_the_hosts_leave_nothing_behind checks that)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, subprocess_env

sys.path.insert(0, str(ROOT / "scripts"))
import netns_hosts  # noqa: E402

REASON = netns_hosts.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"hosts need network namespaces: {REASON}")

PORT = 29500  # each host has a network of its own: the default port is free on every one
TINY = ["--dataset", "synthetic", "--model", "resnet_tiny", "--test-samples", "64", "--epochs", "1"]


@pytest.fixture
def make_hosts():
    """make_hosts(**kwargs) -> an up netns_hosts.Hosts, torn down when the test ends."""
    made = []

    def make(*args, **kwargs):
        hosts = netns_hosts.Hosts(*args, **kwargs)
        made.append(hosts)
        hosts.up()
        return hosts

    yield make
    for hosts in made:
        hosts.down()


class Job:
    """Processes started on hosts, each logging to a file; `wait` bounds them all."""

    def __init__(self, hosts, log_dir: Path):
        self.hosts, self.log_dir, self.procs = hosts, log_dir, {}

    def start(self, key, host, argv, **env):
        log = open(self.log_dir / f"{key}.log", "w")
        self.procs[key] = self.hosts.popen(host, [sys.executable, *map(str, argv)], cwd=ROOT,
                                           env=subprocess_env(**env), stdout=log, stderr=subprocess.STDOUT)
        return self.procs[key]

    def log(self, key) -> str:
        return (self.log_dir / f"{key}.log").read_text()

    def wait(self, timeout, expect=0) -> dict:
        """Every process's exit status within `timeout` s of now (a test failure otherwise,
        with the logs); `expect`: the status every process must end with (None: any)."""
        deadline = time.monotonic() + timeout
        codes = {}
        for key, proc in self.procs.items():
            try:
                codes[key] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[key] = None
        if None in codes.values() or (expect is not None and set(codes.values()) != {expect}):
            logs = "\n".join(f"--- {key} (exit {codes[key]})\n{self.log(key)[-3000:]}" for key in self.procs)
            pytest.fail(f"exit statuses {codes} within {timeout} s, expected {expect}\n{logs}")
        return codes


def torchrun_across(hosts, nproc, *, endpoint=None, rdzv=(), launcher=("-m", "torch.distributed.run")):
    """README's two-node command on each host, for `hosts.popen`: c10d at node 0's address."""
    endpoint = endpoint or f"{hosts.address(hosts.names[0])}:{PORT}"
    return [*launcher, f"--nnodes={len(hosts.names)}", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", "--rdzv-id=hosts-test", *rdzv]


def weights(checkpoint_dir) -> dict:
    return torch.load(Path(checkpoint_dir) / "checkpoint.pt", weights_only=True)["model"]


def assert_bitwise_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, first {different[:3]}"


# --- the test bed itself ---------------------------------------------------------------------

def test_the_hosts_have_their_own_names_addresses_and_a_link_that_can_be_cut(make_hosts):
    hosts = make_hosts()
    a, b = hosts.address("nodea"), hosts.address("nodeb")
    assert a.startswith("10.231.") and not a.startswith("127.")
    probe = ("import socket, sys; print(socket.gethostname(), socket.gethostbyname(sys.argv[1]))")
    seen = hosts.run("nodea", [sys.executable, "-c", probe, "nodeb"]).stdout.split()
    assert seen == ["nodea", b]
    listener = hosts.popen("nodeb", [sys.executable, "-c",
                                      "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', 5001)); "
                                      "s.listen(); print('up', flush=True); time.sleep(60)"],
                           stdout=subprocess.PIPE, text=True)
    assert listener.stdout.readline().strip() == "up"
    connect = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], 5001), timeout=2); print('ok')\n"
               "except OSError as e:\n    print(type(e).__name__)")
    assert hosts.run("nodea", [sys.executable, "-c", connect, b]).stdout.strip() == "ok"
    hosts.cut("nodeb")
    assert hosts.run("nodea", [sys.executable, "-c", connect, b]).stdout.strip() in ("TimeoutError", "timeout")
    hosts.restore("nodeb")
    assert hosts.run("nodea", [sys.executable, "-c", connect, b]).stdout.strip() == "ok"


def test_the_hosts_leave_nothing_behind_however_the_test_ends():
    """An exception inside the block (a failing test), and a holder that died without
    tearing down (a killed pytest): no namespace, /etc/netns entry, mount or process stays."""
    def leftovers(slot):
        mounts = Path("/proc/self/mountinfo").read_text()
        return (netns_hosts.namespaces_of_slot(slot),
                [e for e in os.listdir(netns_hosts.NETNS_ETC) if e.startswith(f"nh{slot}-")]
                if os.path.isdir(netns_hosts.NETNS_ETC) else [],
                [line for line in mounts.splitlines() if f"/run/netns/nh{slot}-" in line])

    with pytest.raises(RuntimeError, match="the test failed"):
        with netns_hosts.Hosts() as hosts:
            slot = hosts.slot
            sleeper = hosts.popen("nodeb", ["sleep", "300"])
            raise RuntimeError("the test failed")
    assert sleeper.poll() is not None
    assert leftovers(slot) == ([], [], [])

    # A holder that died: its hosts (and a process on them) are removed by the next one.
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import netns_hosts, subprocess, os\n"
            "h = netns_hosts.Hosts(); h.up(); print(h.slot, flush=True)\n"
            "h.popen('nodea', ['sleep', '300'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); os._exit(0)")
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    slot = int(dead.stdout.split()[0])
    assert netns_hosts.namespaces_of_slot(slot), "the dead holder's hosts should still be there"
    stray = [pid for ns in netns_hosts.namespaces_of_slot(slot) for pid in netns_hosts.processes_in(ns)]
    assert stray
    with netns_hosts.Hosts(slot=slot) as hosts:
        assert hosts.slot == slot
    assert leftovers(slot) == ([], [], [])
    assert not [pid for pid in stray if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]


# --- a. the same training, bitwise, on two hosts as on one -----------------------------------

def test_two_hosts_train_bitwise_equal_to_the_same_processes_on_one(make_hosts, tmp_path):
    """torchrun c10d, 2 hosts x 2 processes, loader workers on: the same weights as 4
    processes on one host."""
    args = [*TINY, "--train-samples", "512", "--batch-size", "64", "--workers", "2"]
    hosts = make_hosts()
    job = Job(hosts, tmp_path)
    for name in hosts.names:
        job.start(name, name, [*torchrun_across(hosts, 2), "distributed.py", *args,
                               "--checkpoint-dir", tmp_path / "across"])
    one = Job(hosts, tmp_path)
    one.start("one", "nodea", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                               "distributed.py", *args, "--checkpoint-dir", tmp_path / "one"])
    job.wait(240)
    one.wait(240)
    assert "world_size" in json.loads((tmp_path / "across" / "config.json").read_text())
    assert json.loads((tmp_path / "across" / "config.json").read_text())["world_size"] == 4
    assert_bitwise_equal(weights(tmp_path / "across"), weights(tmp_path / "one"))
