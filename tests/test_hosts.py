"""Multi-node training across real hosts: network namespaces on this machine, each with its
own address (10.231.0.0/24, never 127.0.0.1), hostname and hosts file, joined by a switch
whose ports the tests can pull (scripts/netns_hosts.py). What breaks multi-node jobs for
users is reproduced here and answered: name resolution, the interface gloo picks, a
partition, a node lost for good.

Needs root and iproute2; skipped with the reason otherwise. Every test tears its hosts down
however it ends (test_the_hosts_leave_nothing_behind checks that)."""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cifar_files import write_cifar100
from conftest import FAULTS, FRESH_STORE, ROOT, subprocess_env
from utils import lifecycle

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

    def start(self, key, host, argv, cwd=ROOT, program=sys.executable, **env):
        log = open(self.log_dir / f"{key}.log", "w")
        self.procs[key] = self.hosts.popen(host, [program, *map(str, argv)], cwd=cwd,
                                           env=subprocess_env(**env), stdout=log, stderr=subprocess.STDOUT)
        return self.procs[key]

    def wait_for(self, *paths, timeout=240):
        """Until every path exists (a marker the processes write), failing with the logs if one of
        them ends first."""
        deadline = time.monotonic() + timeout
        while not all(Path(path).exists() for path in paths):
            assert time.monotonic() < deadline and all(p.poll() is None for p in self.procs.values()), \
                "\n".join(f"--- {key}\n{self.log(key)[-3000:]}" for key in self.procs)
            time.sleep(0.1)

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
    """Lesson 06's two-node torchrun command on each host, for `hosts.popen`: c10d at node 0's address."""
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
    """In any slot, nodea is 10.231.0.1, as lesson 06 says: each slot's hosts have a switch of
    their own, so another slot's nodeb, at the same address, is another host."""
    hosts, other = make_hosts(), make_hosts()
    a, b = hosts.address("nodea"), hosts.address("nodeb")
    assert (a, b) == (other.address("nodea"), other.address("nodeb")) == ("10.231.0.1", "10.231.0.2")
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
    assert other.run("nodea", [sys.executable, "-c", connect, b]).stdout.strip() == "ConnectionRefusedError"
    hosts.cut("nodeb")
    assert hosts.run("nodea", [sys.executable, "-c", connect, b]).stdout.strip() == "TimeoutError"
    hosts.restore("nodeb")
    assert hosts.run("nodea", [sys.executable, "-c", connect, b]).stdout.strip() == "ok"


def test_the_hosts_leave_nothing_behind_however_the_test_ends():
    """An exception inside the block (a failing test), and a holder that died without
    tearing down (a killed pytest): no namespace, /etc/netns entry, mount or process stays.
    In the last slot, which no other test claims (they take the lowest free one): a slot freed
    here stays free, and the dead holder's is reclaimed here, not by another test."""
    slot = netns_hosts.SLOTS - 1
    def leftovers(slot):
        mounts = Path("/proc/self/mountinfo").read_text()
        return (netns_hosts.namespaces_of_slot(slot),
                [e for e in os.listdir(netns_hosts.NETNS_ETC) if e.startswith(f"nh{slot}-")]
                if os.path.isdir(netns_hosts.NETNS_ETC) else [],
                [line for line in mounts.splitlines() if f"/run/netns/nh{slot}-" in line])

    with pytest.raises(RuntimeError, match="the test failed"):
        with netns_hosts.Hosts(slot=slot) as hosts:
            sleeper = hosts.popen("nodeb", ["sleep", "300"])
            raise RuntimeError("the test failed")
    assert sleeper.poll() is not None
    assert leftovers(slot) == ([], [], [])

    # A holder that died: its hosts (and a process on them) are removed by the next one.
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import netns_hosts, subprocess, os\n"
            f"h = netns_hosts.Hosts(slot={slot}); h.up()\n"
            "h.popen('nodea', ['sleep', '300'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert netns_hosts.namespaces_of_slot(slot), "the dead holder's hosts should still be there"
    stray = [pid for ns in netns_hosts.namespaces_of_slot(slot) for pid in netns_hosts.processes_in(ns)]
    assert stray
    with netns_hosts.Hosts(slot=slot) as hosts:
        assert hosts.slot == slot
    assert leftovers(slot) == ([], [], [])
    assert not [pid for pid in stray if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]


def test_up_on_a_taken_slot_says_so_in_one_line(make_hosts):
    hosts = make_hosts()
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "netns_hosts.py", "--slot", str(hosts.slot), "up"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.startswith("netns_hosts.py: error: no free slot for hosts (slot "), \
        proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


def test_the_command_line_refuses_a_slot_out_of_range_and_a_failed_up_in_one_line():
    script = ROOT / "scripts" / "netns_hosts.py"
    out_of_range = subprocess.run([sys.executable, script, "--slot", str(netns_hosts.SLOTS), "up"],
                                  capture_output=True, text=True, timeout=60)
    assert out_of_range.returncode == 2 and "argument --slot: invalid choice: 64" in out_of_range.stderr, \
        out_of_range.stderr
    slot = netns_hosts.SLOTS - 3  # a slot no other test claims
    refused = subprocess.run([sys.executable, script, "--slot", str(slot), "up", "nodea", "node/b"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stderr == \
        f'netns_hosts.py: error: ip netns add nh{slot}-node/b: Invalid netns name "nh{slot}-node/b"\n', refused.stderr
    assert netns_hosts.namespaces_of_slot(slot) == [] and not os.path.exists(f"{netns_hosts.STATE_DIR}/slot{slot}")


def test_hosts_whose_names_differ_after_ten_characters_have_links_of_their_own(make_hosts):
    hosts = make_hosts(("node-gpu-01", "node-gpu-02"))
    hosts.cut("node-gpu-02")
    assert "LOWER_UP" in hosts.run("node-gpu-01", ["ip", "-o", "link", "show", "eth0"]).stdout
    assert "LOWER_UP" not in hosts.run("node-gpu-02", ["ip", "-o", "link", "show", "eth0"]).stdout


def test_a_probe_left_by_a_killed_process_is_removed_by_the_next_check():
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = f"nhprobe{gone.pid}"  # as unavailable_reason() names its probe, killed before removing it
    subprocess.run(["ip", "netns", "add", left], check=True)
    try:
        assert netns_hosts.unavailable_reason() is None
        assert left not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    finally:
        subprocess.run(["ip", "netns", "del", left], capture_output=True)


def waits_for_the_slots_lock(pid: int) -> bool:
    """Whether process pid waits to take slots_locked() (/proc/locks marks a waiting flock "->")."""
    inode = os.stat(os.path.join(netns_hosts.STATE_DIR, "lock")).st_ino
    return any(fields[1] == "->" and fields[5] == str(pid) and fields[6].endswith(f":{inode}")
               for fields in map(str.split, Path("/proc/locks").read_text().splitlines()))


def test_the_hosts_are_removed_under_the_lock_that_claims_slots(make_hosts):
    """Hosts.down() and `down` wait for slots_locked(), as a claim does: a removal never
    interleaves with a claim, which could otherwise take the slot being removed and lose its
    new hosts to the rest of the removal."""
    by_hand, by_command = make_hosts(), make_hosts()
    slots = (by_hand.slot, by_command.slot)
    with netns_hosts.slots_locked():
        thread = threading.Thread(target=by_hand.down)
        thread.start()
        command = subprocess.Popen([sys.executable, ROOT / "scripts" / "netns_hosts.py", "--slot", str(slots[1]),
                                    "down"])
        by_command.slot = None  # removed by the command, not again by the fixture (another test may hold it then)
        deadline = time.monotonic() + 60
        while not (waits_for_the_slots_lock(os.getpid()) and waits_for_the_slots_lock(command.pid)):
            assert time.monotonic() < deadline and thread.is_alive() and command.poll() is None
            time.sleep(0.05)
        assert all(netns_hosts.namespaces_of_slot(slot) for slot in slots)
    thread.join(60)
    assert command.wait(60) == 0
    assert [netns_hosts.namespaces_of_slot(slot) for slot in slots] == [[], []]


def test_a_command_past_its_timeout_ends_there_whatever_it_left_running(make_hosts):
    """Hosts.run kills the command's session at its timeout; a process that it started in a
    session of its own, which holds its output pipes, does not hold up the TimeoutExpired."""
    hosts = make_hosts()
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        hosts.run("nodea", ["sh", "-c", "setsid sleep 30 & sleep 30"], timeout=2)
    assert time.monotonic() - started < 15


# --- a. the same training, bitwise, on two hosts as on one -----------------------------------

@pytest.mark.not_on_floor("two agents on one c10d rendezvous: the killed-worker test here; across hosts: "
                          "the partition, lost-host and host-name tests here")
def test_two_hosts_train_bitwise_equal_to_the_same_processes_on_one(make_hosts, tmp_path):
    """torchrun c10d, 2 hosts x 2 processes, loader workers on: the same weights as 4
    processes on one host."""
    args = [*TINY, "--train-samples", "512", "--batch-size", "64", "--workers", "2"]
    hosts = make_hosts()
    job = Job(hosts, tmp_path)
    for name in hosts.names:
        job.start(name, name, [*torchrun_across(hosts, 2), "distributed.py", *args,
                               "--checkpoint-dir", tmp_path / "across"])
    job.wait(240)
    one = Job(hosts, tmp_path)  # after: both at once would be 8 trainers and their loader workers on the cores
    one.start("one", "nodea", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                               "distributed.py", *args, "--checkpoint-dir", tmp_path / "one"])
    one.wait(240)
    assert json.loads((tmp_path / "across" / "config.json").read_text())["world_size"] == 4
    assert_bitwise_equal(weights(tmp_path / "across"), weights(tmp_path / "one"))


# --- b. a worker killed on one host: both hosts restart together --------------------------------

def test_two_hosts_survive_a_killed_worker_with_a_restart_of_both(make_hosts, tmp_path):
    """torchrun c10d on 2 hosts x 2 processes, --max-restarts 1, a fresh store per attempt (as
    every launcher here sets it). Rank 3 is killed once at step 3: its host's torchrun counts a
    failure, the other one too when its workers fail on the broken collective first, else it
    restarts them as a membership change, uncounted. Either way every rank of the new round
    resumes from the checkpoint (none refuses it as if fresh): one 4-rank job that ends at step 8."""
    hosts = make_hosts()
    metrics, checkpoints = tmp_path / "metrics.jsonl", tmp_path / "ck"
    job = Job(hosts, tmp_path)
    for name in hosts.names:
        job.start(name, name, [*torchrun_across(hosts, 2, rdzv=["--max-restarts=1"]), FAULTS,
                               "--fault", "kill", "--rank", "3", "--step", "3", "--once-file", tmp_path / "fired",
                               "--", "distributed.py", *TINY, "--train-samples", "512", "--batch-size", "32",
                               "--workers", "0", "--max-steps", "8", "--checkpoint-every", "2", "--dist-timeout", "60",
                               "--metrics", metrics, "--checkpoint-dir", checkpoints],
                  **FRESH_STORE)
    job.wait(300)
    outputs = job.log("nodea") + job.log("nodeb")
    assert outputs.count("done: 8 steps") == 1, outputs  # global rank 0 alone, on whichever host
    assert "fault_injection: kill on rank 3 at step 3" in outputs
    assert "resuming from" in outputs and "2 steps in all" in outputs, outputs
    assert "already holds a checkpoint" not in outputs and "exitcode: 2" not in outputs, outputs
    final = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    assert (final["event"], final["world_size"], final["step"], final["global_batch"]) == ("end", 4, 8, 32)
    assert torch.load(checkpoints / "checkpoint.pt", weights_only=True)["global_step"] == 8


# --- f. a network partition mid-run ----------------------------------------------------------

def launch_multi_node(job, hosts, key_suffix, *args, **env):
    """scripts/launch_multi_node.sh on every host, as README says: the same command on each."""
    for name in hosts.names:
        job.start(f"{name}{key_suffix}", name, ["scripts/launch_multi_node.sh", *args], program="bash",
                  **{"PYTHON": sys.executable, "NNODES": len(hosts.names), "NPROC_PER_NODE": 1,
                     "RDZV_HOST": hosts.address(hosts.names[0]), "RDZV_PORT": PORT, **env})


DIST_TIMEOUT, GRACE = 10, 10  # --dist-timeout, TORCHRUN_GRACE: what the partition may cost
# 12 steps of 32 images, checkpoints every 3: the runs of the partition and mp.spawn tests.
TWELVE_STEPS = [*TINY, "--train-samples", "2048", "--batch-size", "32", "--workers", "1", "--max-steps", 12,
                "--checkpoint-every", 3, "--dist-timeout", DIST_TIMEOUT]


@pytest.fixture(scope="module")
def two_processes_on_one_host(tmp_path_factory):
    """The weights of distributed.py's 2 processes on one host (torchrun --standalone) after
    TWELVE_STEPS: what the runs across hosts must end with, bitwise. Run once for the tests
    that compare with it."""
    folder = tmp_path_factory.mktemp("reference")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "distributed.py", *map(str, TWELVE_STEPS), "--checkpoint-dir", str(folder)],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return weights(folder)


def test_a_partition_ends_every_process_on_both_hosts_and_resume_is_bitwise(make_hosts, tmp_path,
                                                                            two_processes_on_one_host):
    """Host B's link goes down mid-run for longer than --dist-timeout, both hosts running
    scripts/launch_multi_node.sh (torchrun with --max-restarts 3). Every process on both
    hosts ends within --dist-timeout + TORCHRUN_GRACE + 20 s of the cut: the workers on
    their collective's timeout, the agent on host B (cut off from the rendezvous store on
    host A) by torchrun_bounded's grace. The checkpoint on the shared folder is intact, and
    once the link is back, --resume ends bitwise equal to an uninterrupted run."""
    args = TWELVE_STEPS
    hosts = make_hosts()
    shared = tmp_path / "shared"
    marker = tmp_path / "paused"
    job = Job(hosts, tmp_path)
    launch_multi_node(job, hosts, "", *args, "--checkpoint-dir", shared, SCRIPT=FAULTS,
                      FAULT_INJECTION=f"--fault pause --rank -1 --step 6 --marker {marker} --pause-seconds 300 "
                                      "-- distributed.py", TORCHRUN_GRACE=GRACE, JOB_ID="partition")
    job.wait_for(f"{marker}.0", f"{marker}.1")  # both at step 6, checkpointed, held until the cut is made
    hosts.cut("nodeb")
    cut = time.monotonic()
    Path(f"{marker}.go").touch()
    bound = DIST_TIMEOUT + GRACE + 20  # the timeouts, and room for a loaded machine
    codes = job.wait(bound, expect=None)
    elapsed = time.monotonic() - cut
    assert all(code != 0 for code in codes.values()), codes
    left = {name: netns_hosts.processes_in(hosts.namespace(name)) for name in hosts.names}
    assert left == {"nodea": [], "nodeb": []}, left
    assert "torchrun_bounded.py: error: no training process has run on this node" in job.log("nodeb"), \
        job.log("nodeb")
    print(f"every process ended {elapsed:.1f} s after the cut (bound {bound} s)")

    saved = torch.load(shared / "checkpoint.pt", weights_only=True)  # intact: it loads
    assert saved["global_step"] == 6

    hosts.restore("nodeb")
    resumed = Job(hosts, tmp_path)
    launch_multi_node(resumed, hosts, "-resumed", *args, "--checkpoint-dir", shared, JOB_ID="partition-resumed")
    resumed.wait(180)
    assert "resumed from" in resumed.log("nodea-resumed") + resumed.log("nodeb-resumed")
    assert_bitwise_equal(weights(shared), two_processes_on_one_host)


# --- g. a host lost for good under elastic torchrun -------------------------------------------

def test_elastic_torchrun_goes_on_without_a_lost_host_with_the_same_global_batch(make_hosts, tmp_path):
    """--nnodes=1:2 --max-restarts=2, host B lost for good at step 6 (its link cut, its
    processes killed). The survivor's worker fails on its collective's timeout, torchrun
    restarts it alone, and it resumes from the checkpoint with the same global batch (32 now
    in one process instead of 16 in each of two): it ends with the weights of the same
    checkpoint resumed by one process, bitwise. (Not those of a run that stayed on two: batch
    norm then normalises over 16 images per process, not 32.) The reference resumes the very
    checkpoint of step 6 that the survivor resumed; that two processes across hosts train
    those steps as they do on one host is the partition test's bitwise comparison (the same
    flags, torchrun's c10d rendezvous on both hosts), and here the checkpoint says that both
    hosts wrote it."""
    args = TWELVE_STEPS
    hosts = make_hosts()
    shared, marker = tmp_path / "shared", tmp_path / "paused"
    job = Job(hosts, tmp_path)
    elastic = [f"--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={hosts.address('nodea')}:{PORT}", "--rdzv-id=elastic", "--max-restarts=2",
               "--rdzv-conf=last_call_timeout=5"]
    for name in hosts.names:
        job.start(name, name, ["-m", "torch.distributed.run", *elastic, FAULTS, "--fault", "pause",
                               "--rank", "-1", "--step", "6", "--marker", marker, "--pause-seconds", "300", "--once",
                               "--", "distributed.py", *args, "--checkpoint-dir", shared])
    job.wait_for(f"{marker}.0", f"{marker}.1")  # both at step 6, held until host B is gone
    # The checkpoint of step 6 (written before the pause), kept: the survivor resumes it, and
    # so does the one process of the reference below.
    reference = tmp_path / "reference"
    reference.mkdir()
    shutil.copy2(shared / "checkpoint.pt", reference / "checkpoint.pt")
    hosts.cut("nodeb")
    for pid in netns_hosts.processes_in(hosts.namespace("nodeb")):  # the machine is gone
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    Path(f"{marker}.go").touch()
    assert job.wait(DIST_TIMEOUT + 120, expect=None)["nodea"] == 0, job.log("nodea")
    log = job.log("nodea")
    assert "torchrun restart: resuming from" in log, log
    assert json.loads((shared / "config.json").read_text())["world_size"] == 1
    assert torch.load(shared / "checkpoint.pt", weights_only=True)["global_step"] == 12

    # The same checkpoint of step 6 (written by the job of two), resumed by one process.
    saved = torch.load(reference / "checkpoint.pt", weights_only=True)
    assert (saved["global_step"], saved["world_size"]) == (6, 2)
    one = Job(hosts, tmp_path)
    one.start("one", "nodea", ["distributed.py", *args, "--checkpoint-dir", reference, "--resume"])
    one.wait(120)
    assert "resumed from" in one.log("one"), one.log("one")
    assert_bitwise_equal(weights(shared), weights(reference))


# --- b. mp.spawn across hosts, by tcp:// and by file:// ---------------------------------------

NODE_0_LATE_S = 12  # s: node 0 is started that much after node B (mp.spawn), whose watcher looks every second


@pytest.mark.not_on_floor("tcp:// and file:// with mp.spawn: test_distributed_mp.py (two nodes, a shared file); "
                          "addresses across hosts: the other tests here")
def test_mp_spawn_across_hosts_by_tcp_and_by_a_shared_file(make_hosts, tmp_path, two_processes_on_one_host):
    """distributed_mp.py --nodes 2 on both hosts, meeting at host A's address (tcp://) or
    through a file in a folder both see (file://): the weights of distributed.py's 2
    processes on one host, bitwise. By tcp://, node B starts first and waits quietly for node 0,
    started NODE_0_LATE_S later: no trace of a store client that found no one there."""
    # The later --dist-timeout wins: each host's processes wait in init_process_group for the
    # other host's to start, which takes longer than 10 s on a loaded machine.
    args = [*TWELVE_STEPS, "--dist-timeout", "120"]
    hosts = make_hosts()
    job = Job(hosts, tmp_path)
    for rank, name in reversed(list(enumerate(hosts.names))):
        if rank == 0:
            time.sleep(NODE_0_LATE_S)
        job.start(f"tcp-{name}", name, ["distributed_mp.py", *args, "--nodes", "2", "--node-rank", rank,
                                        "--nproc-per-node", "1", "--ip", hosts.address("nodea"), "--port", PORT,
                                        "--checkpoint-dir", tmp_path / "tcp"])
        job.start(f"file-{name}", name, ["distributed_mp.py", *args, "--nodes", "2", "--node-rank", rank,
                                         "--nproc-per-node", "1", "--init-method",
                                         f"file://{tmp_path / 'rendezvous'}", "--checkpoint-dir", tmp_path / "file"])
    job.wait(240)
    for way in ("tcp", "file"):
        assert json.loads((tmp_path / way / "config.json").read_text())["world_size"] == 2
        assert_bitwise_equal(weights(tmp_path / way), two_processes_on_one_host)
    assert "Exception raised from" not in job.log("tcp-nodeb"), job.log("tcp-nodeb")[-3000:]


# --- c. sharded checkpoints written from two hosts, resumed on one ----------------------------

def full_state(checkpoint_dir) -> dict:
    from scripts import compare_models
    return compare_models.load_full(str(Path(checkpoint_dir) / "checkpoint.pt"))


@pytest.mark.not_on_floor("the sharded save and resume of FSDP2: test_fsdp.py; torchrun across hosts: the other tests here")
def test_fsdp_checkpoint_written_from_two_hosts_resumes_on_one(make_hosts, tmp_path):
    """distributed_fsdp.py, 2 hosts x 1 process, 4 steps: each host writes its own shard
    files into the shared folder, and the checkpoint holds what 2 processes on one host
    write, bitwise. One process on one host then resumes it to step 8, as it resumes the
    one-host checkpoint: the same weights."""
    args = [*TINY, "--train-samples", "512", "--batch-size", "32", "--workers", "1"]
    hosts = make_hosts()
    job = Job(hosts, tmp_path)
    for name in hosts.names:
        job.start(name, name, [*torchrun_across(hosts, 1), "distributed_fsdp.py", *args, "--max-steps", "4",
                               "--checkpoint-dir", tmp_path / "across"])
    job.start("one-host", "nodea", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                    "distributed_fsdp.py", *args, "--max-steps", "4",
                                    "--checkpoint-dir", tmp_path / "one-host"])
    job.wait(240)
    shard_files = sorted(p.name for p in (tmp_path / "across").rglob("*.distcp"))
    assert len(shard_files) == 2, shard_files  # one per rank, so one written from each host
    across, one_host = full_state(tmp_path / "across"), full_state(tmp_path / "one-host")
    assert_bitwise_equal(across["model"], one_host["model"])
    resumed = Job(hosts, tmp_path)
    for folder in ("across", "one-host"):
        resumed.start(f"resume-{folder}", "nodeb", ["distributed_fsdp.py", *args, "--max-steps", "8",
                                                    "--resume", "--checkpoint-dir", tmp_path / folder])
    resumed.wait(240)
    for folder in ("across", "one-host"):
        assert "resumed from" in resumed.log(f"resume-{folder}")
    across, one_host = full_state(tmp_path / "across"), full_state(tmp_path / "one-host")
    assert across["global_step"] == 8
    assert_bitwise_equal(across["model"], one_host["model"])


# --- d. each host's own name on a loopback line -----------------------------------------------

# The three forms of /etc/hosts that put a host's own name on a loopback line
# (scripts/netns_hosts.py, --own-name), and the address gloo would then listen on.
LOOPBACK_FORMS = {"loopback": "127.0.1.1",   # Debian's and Ubuntu's installers: 127.0.1.1 nodea
                  "localhost": "127.0.0.1",  # a hand edit: 127.0.0.1 localhost nodea
                  "fqdn": "::1"}             # cloud-init's Red Hat template: 127.0.0.1 and ::1 nodea.cluster nodea
# s from the start of both nodes' torchrun to the end of every process: far below their --dist-timeout (300 s), with
# room for a loaded machine (in the full suite on 2 cores, a rank's start alone took 25 s, and on a slower machine a
# refusal took 46 s in all)
REFUSED_WITHIN = 90
SLOW_START = 3  # s: node B's process starts that much later than node A's
BY_HAND_S = 15  # s: node B started later by hand, within a refusal's lifecycle.DELIVERY_S
QUICK = [*TINY, "--train-samples", "256", "--batch-size", "32", "--workers", "1"]


def the_error_line(log: str) -> str:
    lines = [line for line in log.splitlines() if line.startswith("distributed.py: error:")]
    assert len(lines) == 1, log
    return lines[0]


@pytest.mark.parametrize("form", LOOPBACK_FORMS)
def test_a_host_name_on_a_loopback_line_is_refused_on_every_host_within_seconds(make_hosts, tmp_path, form):
    """Lesson 06's two-node command (bare torchrun, its shared store), CPU (gloo), --dist-timeout
    300: every host refuses by itself within REFUSED_WITHIN seconds, node 0's too, in one line
    with the cause and the fix. (Node A is given --rdzv-conf is_host=1: past torchrun's own
    trap, which preflight names and scripts/torchrun_bounded.py avoids, below.)
    - loopback: gloo would listen on 127.0.1.1 on both hosts;
    - localhost: torchrun hands every rank MASTER_ADDR=localhost (socket.getfqdn() on node A);
    - fqdn: MASTER_ADDR=nodea.cluster reaches node A, but gloo would listen on ::1 (then 127.0.0.1: the
      fix names both lines).
    Node B's process starts SLOW_START s late (a slower host): node A's agent, which serves
    the store, must not end with its refusing rank before node B's rank has refused too (B's
    agent would then fail on the lost store and end its rank before its line)."""
    hosts = make_hosts(own_name=form)
    job = Job(hosts, tmp_path)
    # Node B starts SLOW_START s later. Meeting at localhost, no node can tell the others: each holds
    # its agent up DELIVERY_S (tell_the_job).
    bound = REFUSED_WITHIN + SLOW_START + (lifecycle.DELIVERY_S if form == "localhost" else 0)
    started = time.monotonic()
    for name in hosts.names:
        slow = ["--no-python", "sh", "-c", f'sleep {SLOW_START} && exec "$0" "$@"', sys.executable] * (name == "nodeb")
        job.start(name, name, [*torchrun_across(hosts, 1, rdzv=["--rdzv-conf=is_host=1"] if name == "nodea" else []),
                               *slow, "distributed.py", *QUICK, "--dist-timeout", "300"])
    codes = job.wait(bound + 30, expect=None)
    elapsed = time.monotonic() - started
    assert all(code != 0 for code in codes.values()), codes
    lines = {name: the_error_line(job.log(name)) for name in hosts.names}
    for name, line in lines.items():
        assert "a loopback address" in line and ". Fix: " in line, line
        if form == "localhost":
            assert "MASTER_ADDR localhost is 127.0.0.1 here" in line and "--local-addr" in line, line
        else:
            assert f"gloo will listen on {LOOPBACK_FORMS[form]} (the address of this host's name {name})" in line
            assert f"list {name} with {hosts.address(name)} in /etc/hosts, on no loopback line (127.x, ::1)" in line
            assert "GLOO_SOCKET_IFNAME=eth0" in line, line
    print(f"{form}: every process on both hosts ended {elapsed:.1f} s after the start (bound {bound:.0f} s)")
    assert elapsed < bound, elapsed


@pytest.mark.parametrize("form, endpoint", [("loopback", "address"), ("localhost", "name")])
def test_a_host_name_on_a_loopback_line_is_named_by_preflight_and_avoided_by_the_launcher(make_hosts, tmp_path,
                                                                                         form, endpoint):
    """preflight, run on each node as README says, names the trap with its fixes, in seconds;
    scripts/launch_multi_node.sh does not fall into it (is_host, --local_addr, GLOO_SOCKET_IFNAME
    from torchrun_bounded.py): it trains. RDZV_HOST is node A's address, or its name as
    slurm.sbatch gives it (which node A resolves to a loopback address)."""
    hosts = make_hosts(own_name=form)
    a = hosts.address("nodea")
    job = Job(hosts, tmp_path)
    for name in hosts.names:
        job.start(f"preflight-{name}", name, ["scripts/preflight.py", "--nproc", "1", "--workers", "0",
                                              "--rdzv-endpoint", f"{a}:{PORT}", "--timeout", "5"])
    job.wait(120, expect=1)
    nodea, nodeb = job.log("preflight-nodea"), job.log("preflight-nodeb")
    assert "this host is the rendezvous endpoint" in nodea and "will not host its store here" in nodea, nodea
    assert "--rdzv-conf is_host=1" in nodea and f"map nodea to {a} in /etc/hosts" in nodea, nodea
    assert f"gloo will listen on {LOOPBACK_FORMS[form]}" in nodeb and "export GLOO_SOCKET_IFNAME=eth0" in nodeb, nodeb
    assert "answers (nothing listens yet" in nodeb, nodeb

    launched = Job(hosts, tmp_path)
    launch_multi_node(launched, hosts, "-launcher", *QUICK, "--dist-timeout", "15",
                      "--checkpoint-dir", tmp_path / "launched", JOB_ID=form,
                      **({"RDZV_HOST": "nodea"} if endpoint == "name" else {}))
    launched.wait(180)
    logs = launched.log("nodea-launcher") + launched.log("nodeb-launcher")
    assert "done: 8 steps" in logs and f"--local_addr={a if endpoint == 'address' else 'nodea'}" in logs, logs


def test_the_check_before_srun_accepts_the_job_that_the_launcher_runs(make_hosts, tmp_path):
    """slurm.sbatch's --check-args on the head node, named as Slurm names it, where that name
    resolves to 127.0.1.1: the training alone would refuse gloo there, but torchrun_bounded.py
    sets GLOO_SOCKET_IFNAME for the job it starts (the test above trains), and its check of
    the arguments runs in those settings, so it accepts the job."""
    hosts = make_hosts(own_name="loopback")
    job = Job(hosts, tmp_path)
    job.start("check", "nodea", ["scripts/torchrun_bounded.py", *torchrun_across(hosts, 1, endpoint=f"nodea:{PORT}",
                                                                                 launcher=()),
                                 "distributed.py", *QUICK, "--check-args"])
    assert job.wait(60) == {"check": 0}, job.log("check")
    assert "arguments OK for 2 processes" in job.log("check"), job.log("check")


@pytest.mark.parametrize("refusing, launch", [
    ("nodea", "torchrun, a store of its own"),  # rank 0 refuses and hosts the store to say so
    ("nodeb", "torchrun, the agent's store"),
    ("nodea", "mp.spawn tcp://"),               # node 0's launching process refuses, before any worker
    ("nodeb", "mp.spawn file://"),
])
def test_a_refusal_on_one_host_ends_the_other_host_too_with_its_line(make_hosts, tmp_path, refusing, launch):
    """One host refuses (its own name on 127.0.1.1: gloo could not be reached there), the other
    is set up right and would wait --dist-timeout (300 s) to form the group: it ends within
    REFUSED_WITHIN seconds of the last start, saying which rank refused and why. With mp.spawn
    and tcp://, node B is started BY_HAND_S after node A has refused, as in a second terminal."""
    hosts = make_hosts(own_name={refusing: "loopback"})
    other = next(name for name in hosts.names if name != refusing)
    job = Job(hosts, tmp_path)
    shared = tmp_path / "rendezvous"
    for node, name in enumerate(hosts.names):
        if node and launch == "mp.spawn tcp://":
            time.sleep(BY_HAND_S)
        started = time.monotonic()
        if launch.startswith("torchrun"):
            own_store = FRESH_STORE if "own" in launch else {}
            job.start(name, name, [*torchrun_across(hosts, 1, rdzv=["--rdzv-conf=is_host=1"] if name == "nodea" else []),
                                   "distributed.py", *QUICK, "--dist-timeout", "300"], **own_store)
        else:
            meet = (["--ip", hosts.address("nodea"), "--port", PORT] if "tcp" in launch
                    else ["--init-method", f"file://{shared}"])
            job.start(name, name, ["distributed_mp.py", *QUICK, "--dist-timeout", "300", "--nodes", 2,
                                   "--node-rank", node, "--nproc-per-node", 1, *meet])
    codes = job.wait(REFUSED_WITHIN + 30, expect=None)
    elapsed = time.monotonic() - started
    assert all(code != 0 for code in codes.values()), codes
    script = "distributed.py" if launch.startswith("torchrun") else "distributed_mp.py"
    refusal = [line for line in job.log(refusing).splitlines() if line.startswith(f"{script}: error:")]
    assert len(refusal) == 1 and "gloo will listen on 127.0.1.1" in refusal[0], job.log(refusing)
    told = [line for line in job.log(other).splitlines() if line.startswith(f"{script}: error:")]
    assert len(told) == 1 and "refused to start: " in told[0] and "gloo will listen on 127.0.1.1" in told[0], \
        job.log(other)
    print(f"{launch}, {refusing} refusing: every process ended {elapsed:.1f} s after the last start "
          f"(bound {REFUSED_WITHIN} s)")
    assert elapsed < REFUSED_WITHIN, elapsed


@pytest.mark.not_on_floor("loading a data set differs in no release: the refusal tests here run there")
def test_a_node_without_the_data_set_says_why_and_the_other_node_names_it(make_hosts, tmp_path):
    """Each node reads its own ./data (--data-dir data, relative): node 0's holds CIFAR-100 (in its real
    format), nodeb's is empty and nodeb has no network to download into it. nodeb says why; node 0, whose
    copy is fine, says that another rank could not load it, not that its own folder lacks the files."""
    rng = np.random.default_rng(0)
    write_cifar100(tmp_path / "nodea" / "data", rng.integers(0, 256, (64, 3, 32, 32)), rng.integers(0, 100, 64),
                   rng.integers(0, 256, (16, 3, 32, 32)), rng.integers(0, 100, 16))
    (tmp_path / "nodeb").mkdir()
    hosts = make_hosts()
    job = Job(hosts, tmp_path)
    started = time.monotonic()
    for name in hosts.names:
        job.start(name, name, [*torchrun_across(hosts, 1), ROOT / "distributed.py", "--dataset", "cifar100",
                               "--data-dir", "data", "--model", "resnet_tiny", "--epochs", "1", "--batch-size", "32",
                               "--dist-timeout", "300"], cwd=tmp_path / name)
    codes = job.wait(REFUSED_WITHIN + 30, expect=None)
    assert all(code != 0 for code in codes.values()), codes
    lines = {name: [line for line in job.log(name).splitlines() if line.startswith("distributed.py: error:")]
             for name in hosts.names}
    assert len(lines["nodeb"]) == 1 and "not in --data-dir data and could not be downloaded" in lines["nodeb"][0], \
        job.log("nodeb")
    assert lines["nodea"] == ["distributed.py: error: CIFAR-100 could not be loaded on another rank "
                              "(its node says why)"], job.log("nodea")
    assert time.monotonic() - started < REFUSED_WITHIN


# --- e. the interface each host names first reaches no other host -----------------------------

def test_the_wrong_interface_is_named_by_preflight_and_the_variable_fixes_it(make_hosts, tmp_path):
    """Each host has eth0 (listed first, and the address its own name resolves to), which
    reaches no other host, and eth1, the link. gloo takes eth0. preflight under torchrun on
    both hosts fails (torchrun's exit status 1) and names GLOO_SOCKET_IFNAME=eth1; with it
    set, training works."""
    hosts = make_hosts(two_interfaces=True)
    job = Job(hosts, tmp_path)
    started = time.monotonic()
    for name in hosts.names:  # is_host=1 on node A: its name does not resolve to the endpoint here either
        job.start(f"preflight-{name}", name, [*torchrun_across(hosts, 1, rdzv=["--rdzv-conf=is_host=1"]
                                                               if name == "nodea" else []),
                                              "scripts/preflight.py", "--workers", "0", "--model", "resnet_tiny",
                                              "--timeout", "10"])
    codes = job.wait(120, expect=None)
    elapsed = time.monotonic() - started
    report = job.log("preflight-nodea") + job.log("preflight-nodeb")
    assert codes == {"preflight-nodea": 1, "preflight-nodeb": 1}, report  # torchrun's: a worker failed
    assert "FAILED" in report and "export GLOO_SOCKET_IFNAME=eth1" in report, report
    assert "NCCL: its own choice (NCCL_DEBUG=INFO prints it)" in report, report  # nothing here imitates NCCL
    print(f"preflight ended in {elapsed:.0f} s")

    args = [*TINY, "--train-samples", "256", "--batch-size", "32", "--workers", "1", "--dist-timeout", "20"]
    fixed = Job(hosts, tmp_path)
    for name in hosts.names:
        fixed.start(f"fixed-{name}", name, [*torchrun_across(hosts, 1, rdzv=["--rdzv-conf=is_host=1"]
                                                             if name == "nodea" else []), "distributed.py", *args],
                    GLOO_SOCKET_IFNAME="eth1")
    fixed.wait(180)
    assert "done: 8 steps" in fixed.log("fixed-nodea") + fixed.log("fixed-nodeb")


@pytest.mark.parametrize("node_rank_0", ["nodea", "nodeb"])
def test_the_launcher_names_node_0_as_the_endpoint_not_as_node_0_resolves_its_name(make_hosts, tmp_path,
                                                                                   node_rank_0):
    """The endpoint by name, as slurm.sbatch gives it (head_node); node A resolves its own name to eth0's
    address, which no other host reaches (node B resolves it to eth1's). Node A's --local_addr, every rank's
    MASTER_ADDR where node A is node rank 0, is the name as the other host reaches it. Node A's route to its
    own name says nothing of the interface the others reach it by: its launcher sets no GLOO_SOCKET_IFNAME
    (it had set eth0, and the run then advised eth1 toward node B's address). Node B's sets eth1. Any advice
    on either node names eth1, the link: where node B is node rank 0, node A's run, which meets at node B's
    address, may warn that gloo listens on eth0 (a warning: the job trains all the same here)."""
    hosts = make_hosts(two_interfaces=True)
    job = Job(hosts, tmp_path)
    for name in hosts.names:
        # c10d numbers the nodes in the order of their --local_addr, as strings: node B's own, its address,
        # sorts before "nodea"; given its name (as socket.getfqdn() gives it to bare torchrun), after.
        own = [f"--local_addr={name}"] if name == "nodeb" and node_rank_0 == "nodea" else []
        job.start(name, name, ["scripts/torchrun_bounded.py", *torchrun_across(hosts, 1, endpoint=f"nodea:{PORT}",
                                                                               rdzv=own, launcher=()),
                               "distributed.py", *TINY, "--train-samples", "64", "--batch-size", "32",
                               "--workers", "0", "--dist-timeout", "20"])
    job.wait(120)
    assert "done: 2 steps" in job.log(node_rank_0), job.log(node_rank_0)  # global rank 0
    for name in hosts.names:
        log = job.log(name)
        [decided] = [line for line in log.splitlines() if line.startswith(f"torchrun_bounded.py on {name}: ")]
        chosen = set(re.findall(r"GLOO_SOCKET_IFNAME=(\w+)", decided))
        assert chosen == ({"eth1"} if name == "nodeb" else set()), decided
        advised = set(re.findall(r"export GLOO_SOCKET_IFNAME=(\w+)", log))
        assert advised <= {"eth1"}, log


def test_a_c10d_rendezvous_in_a_shared_file_trains_through_the_launcher(make_hosts, tmp_path):
    """torchrun's c10d rendezvous with --rdzv-conf store_type=file: the endpoint is a file both hosts see (the
    test's folder), not HOST:PORT. torchrun_bounded.py leaves it to torchrun (it read the path as a host: a path
    with a slash was refused, status 2), and the job trains."""
    hosts = make_hosts()
    job = Job(hosts, tmp_path)
    for name in hosts.names:
        job.start(name, name, ["scripts/torchrun_bounded.py",
                               *torchrun_across(hosts, 1, endpoint=tmp_path / "rendezvous", rdzv=["--rdzv-conf",
                                                                                                  "store_type=file"],
                                                launcher=()),
                               "distributed.py", *TINY, "--train-samples", "64", "--batch-size", "32"])
    job.wait(150)
    assert "done: 2 steps" in job.log("nodea") + job.log("nodeb"), job.log("nodea") + job.log("nodeb")


def test_a_floating_address_is_the_endpoint_of_the_node_that_holds_it_alone(make_hosts, tmp_path):
    """The endpoint is a floating address (keepalived's, Pacemaker's): node A holds it as a secondary address
    in its subnet, whose route's source is node A's primary address, and both nodes let a socket bind addresses
    they do not have (net.ipv4.ip_nonlocal_bind=1, so that the address can move). A bind to it succeeds on both,
    yet only node A is its node: node A's launcher decides is_host=1 (torchrun's own guess, by node A's name,
    is no), node B's neither is_host=1 nor --local_addr=<the endpoint>, and the job trains, node A, whose
    --local_addr 10.231.0.100 sorts first, as node rank 0. (A bind took node B for the endpoint's node; the
    route's source alone missed node A.) distributed_mp.py's node 0 with --ip at the address: on node A alone.
    Node A's name is on a loopback line (Debian's): gloo's interface there is the one that holds the floating
    address, found by its primary (an interface's address, as read, is its primary alone)."""
    hosts = make_hosts(own_name={"nodea": "loopback"})
    floating = "10.231.0.100"
    hosts.run("nodea", ["ip", "addr", "add", f"{floating}/24", "dev", hosts.link_interface]).check_returncode()
    for name in hosts.names:
        hosts.run(name, ["sysctl", "-q", "-w", "net.ipv4.ip_nonlocal_bind=1"]).check_returncode()
    probe = ("import sys\nfrom utils import cli, network, spawn\na = sys.argv[1]\n"
             "try:\n    node_0 = spawn.bind_port(a) and 'yes'\nexcept cli.UsageError:\n    node_0 = 'refused'\n"
             "print(network.can_bind(a), network.source_toward(a), network.own_address(a), node_0)")
    seen = {name: hosts.run(name, [sys.executable, "-c", probe, floating], cwd=ROOT).stdout.split()
            for name in hosts.names}
    assert seen == {"nodea": ["True", hosts.address("nodea"), floating, "yes"],
                    "nodeb": ["True", hosts.address("nodeb"), "None", "refused"]}, seen
    job = Job(hosts, tmp_path)
    for name in hosts.names:
        job.start(name, name, ["scripts/torchrun_bounded.py", *torchrun_across(hosts, 1, endpoint=f"{floating}:{PORT}",
                                                                               launcher=()),
                               "distributed.py", *TINY, "--train-samples", "64", "--batch-size", "32",
                               "--dist-timeout", "20"])  # loader workers as by default
    job.wait(120)
    assert "done: 2 steps" in job.log("nodea"), job.log("nodea")  # global rank 0
    decided = {name: next(line for line in job.log(name).splitlines()
                          if line.startswith(f"torchrun_bounded.py on {name}: ")).split()[3:] for name in hosts.names}
    assert {"is_host=1", f"--local_addr={floating}", f"GLOO_SOCKET_IFNAME={hosts.link_interface}"} <= set(
        decided["nodea"]), decided
    assert "is_host=1" not in decided["nodeb"] and f"--local_addr={hosts.address('nodeb')}" in decided["nodeb"], \
        decided


def test_two_agents_of_a_job_on_one_host_meet_as_torchrun_would(make_hosts, tmp_path):
    """A job of 2 nodes whose two torchrun agents run on node A (a machine split in two, or a first try of
    several nodes on one machine), through the launcher: torchrun guesses both to be the store's host, and
    the one that finds the port taken becomes a client. Given is_host=1, it failed instead, and the other
    waited out the rendezvous (600 s)."""
    hosts = make_hosts()
    job = Job(hosts, tmp_path)
    for key in ("first", "second"):
        job.start(key, "nodea", ["scripts/torchrun_bounded.py", *torchrun_across(hosts, 1, launcher=()),
                                 "distributed.py", *TINY, "--train-samples", "64", "--batch-size", "32",
                                 "--dist-timeout", "20"])  # loader workers as by default
    job.wait(120)
    assert "done: 2 steps" in job.log("first") + job.log("second")
    assert "is_host" not in job.log("first") + job.log("second")  # torchrun's guess is right here


NO_NFT = None if shutil.which("nft") else "`nft` is not installed (Debian: apt-get install nftables)"


@pytest.mark.parametrize("endpoint_port", ["closed", pytest.param("dropped", marks=pytest.mark.skipif(
    NO_NFT is not None, reason=f"a firewall that drops packets: {NO_NFT}"))])
def test_an_endpoint_that_takes_no_connection_is_one_line_within_torchruns_own_wait(make_hosts, tmp_path,
                                                                                    endpoint_port):
    """Node B's launcher where nothing takes connections at the endpoint (node A's launcher not started,
    another port there: closed; a firewall that drops them: no answer at all): it waits as long as
    torchrun's own client would (two connects of --rdzv-conf read_timeout, here 3 s), then ends with one
    line and exit status 1, where torchrun printed C++ stack traces and its RendezvousConnectionError
    (after two minutes by default). Node A started within that wait: the job trains."""
    hosts = make_hosts()
    if endpoint_port == "dropped":
        hosts.firewall("nodea")
    training = ["distributed.py", *TINY, "--train-samples", "64", "--batch-size", "32", "--workers", "0",
                "--dist-timeout", "20"]

    def launcher(read_timeout):
        return ["scripts/torchrun_bounded.py", *torchrun_across(hosts, 1, endpoint=f"nodea:{PORT}", launcher=(),
                                                                rdzv=[f"--rdzv-conf=read_timeout={read_timeout}"]),
                *training]
    alone = Job(hosts, tmp_path)
    started = time.monotonic()
    alone.start("nodeb", "nodeb", launcher(3))
    alone.wait(100, expect=1)
    log = alone.log("nodeb")
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    why = "Connection refused" if endpoint_port == "closed" else "timed out"
    assert errors == [f"torchrun_bounded.py: error: the rendezvous endpoint nodea:{PORT} took no connection in 6 s "
                      f"({why}): start its node's launcher with the same --rdzv-endpoint, and let the nodes reach "
                      f"each other on every TCP port, {PORT} and those torchrun, gloo and NCCL pick (python3 "
                      f"scripts/preflight.py --rdzv-endpoint nodea:{PORT} checks it from here)"], log
    # Within far less than torchrun's own two minutes, on a loaded machine too (its imports came first).
    assert "Traceback" not in log and "frame #" not in log and time.monotonic() - started < 90, log
    if endpoint_port == "dropped":
        hosts.firewall("nodea", None)
    # Ctrl-C while it waits (here up to 2 minutes): status 130 at once, no traceback. Started as a terminal's shell
    # starts a job, SIGINT at its default (a suite started in the background has it ignored, and Python keeps that).
    stopped = Job(hosts, tmp_path / "stopped")
    (tmp_path / "stopped").mkdir()
    proc = stopped.start("nodeb", "nodeb", ["-c", "import runpy, signal, sys; signal.signal(signal.SIGINT, "
                                            "signal.default_int_handler); sys.argv = sys.argv[1:]; "
                                            "runpy.run_path(sys.argv[0], run_name='__main__')", *launcher(60)])
    deadline = time.monotonic() + 90
    while "torchrun_bounded.py on nodeb: " not in stopped.log("nodeb"):  # what it decided, said before the wait
        assert proc.poll() is None and time.monotonic() < deadline, stopped.log("nodeb")
        time.sleep(0.2)
    time.sleep(1)
    os.killpg(proc.pid, signal.SIGINT)
    stopped.wait(60, expect=130)  # the interpreter's exit, with torch loaded: seconds on a loaded machine
    assert "Traceback" not in stopped.log("nodeb") and "error" not in stopped.log("nodeb"), stopped.log("nodeb")
    late = Job(hosts, tmp_path / "late")
    (tmp_path / "late").mkdir()
    late.start("nodeb", "nodeb", launcher(15))
    time.sleep(5)
    late.start("nodea", "nodea", launcher(15))
    late.wait(120)
    assert "done: 2 steps" in late.log("nodea") + late.log("nodeb")


def job_behind_a_firewall(make_hosts, tmp_path, dist_timeouts):
    """A one-rank-per-node job whose node A lets only the rendezvous endpoint's port through, each node
    with its own --dist-timeout; returns once both nodes have ended."""
    hosts = make_hosts()
    hosts.firewall("nodea", [PORT])
    job = Job(hosts, tmp_path)
    for name, timeout in zip(hosts.names, dist_timeouts):
        job.start(name, name, ["scripts/torchrun_bounded.py", *torchrun_across(hosts, 1, launcher=()),
                               "distributed.py", *TINY, "--train-samples", "64", "--batch-size", "32",
                               "--dist-timeout", timeout])  # loader workers as by default
    job.wait(150, expect=1)
    return hosts, job


@pytest.mark.skipif(NO_NFT is not None, reason=f"a firewall: {NO_NFT}")
def test_a_firewall_open_only_at_the_endpoint_is_named_by_the_job_and_by_preflight(make_hosts, tmp_path):
    """Node A lets only the rendezvous endpoint's port through, a common setup: the nodes meet, but the ranks'
    store (a port torchrun's c10d rendezvous picks on node 0) and gloo's ports take no connection. The job
    ends on both nodes within --dist-timeout, each with one line that says every port must be open; preflight,
    launched as the job is, says the same in its report, and node B's ranks in one line, not a traceback.
    Node B's rank times out first: one that came later than node A's time out would be stopped by its agent
    when node A's agent, done, takes the rendezvous store away (that line: test_fault_tolerance.py)."""
    hosts, job = job_behind_a_firewall(make_hosts, tmp_path, ("30", "15"))
    every_port = "the nodes must reach each other on every TCP port, not only the rendezvous endpoint's"
    for rank, name in enumerate(hosts.names):
        lines = [line for line in job.log(name).splitlines() if line.startswith("distributed.py: error:")]
        assert len(lines) == 1 and f"rank {rank} could not join the gloo process group" in lines[0] \
            and every_port in lines[0], job.log(name)
    check = Job(hosts, tmp_path / "preflight")
    (tmp_path / "preflight").mkdir()
    for name in hosts.names:
        check.start(name, name, [*torchrun_across(hosts, 1), "scripts/preflight.py", "--workers", "0",
                                 "--timeout", "10"])
    check.wait(180, expect=1)
    store_port_fix = "let the nodes reach each other on every TCP port: torchrun's c10d rendezvous serves"
    report = check.log("nodea")
    assert "rank 1 did not report within --timeout 10 s" in report and store_port_fix in report, report
    assert re.search(r"nodea:\d+ \(the ranks' store, MASTER_ADDR:MASTER_PORT\): reached by 1 of 2", report), report
    said = [line for line in check.log("nodeb").splitlines() if line.startswith("preflight:")]
    assert len(said) == 1 and re.match(r"preflight: rank 1 \(nodeb\) cannot reach the ranks' store at nodea:\d+ "
                                       r"\(DistNetworkError: .*timed out", said[0]) and store_port_fix in said[0], \
        check.log("nodeb")
    assert 'preflight.py", line' not in check.log("nodeb"), check.log("nodeb")


@pytest.mark.skipif(NO_NFT is not None, reason=f"a firewall: {NO_NFT}")
def test_a_rank_its_agent_stops_while_it_waits_to_join_says_what_it_waited_for(make_hosts, tmp_path):
    """The same firewall, and node B's rank waits longer than node A's (it came later, or was given a longer
    --dist-timeout): node A's agent, its rank failed, ends and takes the rendezvous store with it; node B's
    agent then stops its rank (SIGTERM), which had died without a word. It says that nothing ever answered
    at the ranks' store, where it waited."""
    hosts, job = job_behind_a_firewall(make_hosts, tmp_path, ("10", "300"))
    lines = [line for line in job.log("nodeb").splitlines() if line.startswith("distributed.py: error:")]
    assert len(lines) == 1 and re.fullmatch(
        rf"distributed\.py: error: rank 1 was stopped by SIGTERM after waiting \d+ s to join the gloo process group: "
        rf"no store ever answered at {re.escape(hosts.address('nodea'))}:\d+: .*this node cannot "
        r"reach it; scripts/preflight\.py checks each node's network", lines[0]), job.log("nodeb")

STORE_OF_A_LIVE_JOB = """
import datetime, os, time
from torch.distributed import TCPStore
store = TCPStore("0.0.0.0", {port}, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
before = store.num_keys()
open({ready!r}, "w").close()
while not os.path.exists({done!r}):
    time.sleep(0.1)
print(f"keys: {{before}} before, {{store.num_keys()}} after")
"""


def test_a_check_of_the_arguments_that_refuses_tells_no_job(make_hosts, tmp_path):
    """distributed_mp.py --check-args on node B (its own name on 127.0.1.1: refused) while a job
    runs at node A's --ip and --port: the check says its line and writes nothing into that
    job's store (a refusal there would end the job's ranks that are still joining)."""
    hosts = make_hosts(own_name={"nodeb": "loopback"})
    job = Job(hosts, tmp_path)
    ready, done = tmp_path / "store-ready", tmp_path / "check-done"
    job.start("store", "nodea", ["-c", STORE_OF_A_LIVE_JOB.format(port=PORT, ready=str(ready), done=str(done))])
    job.wait_for(ready)
    check = job.start("check", "nodeb", ["distributed_mp.py", *QUICK, "--nodes", 2, "--node-rank", 1,
                                         "--nproc-per-node", 1, "--ip", hosts.address("nodea"), "--port", PORT,
                                         "--check-args"])
    assert check.wait(120) == 2, job.log("check")
    assert "distributed_mp.py: error: gloo will listen on 127.0.1.1" in job.log("check"), job.log("check")
    done.touch()
    assert job.wait(30, expect=None)["store"] == 0, job.log("store")
    keys = [line for line in job.log("store").splitlines() if line.startswith("keys:")]
    assert len(keys) == 1 and keys[0].split()[1] == keys[0].split()[3], job.log("store")


REFUSAL_AS_ITS_STORE_GOES = """
import sys, time
sys.path.insert(0, {root!r})
from utils import cli, distributed as dist_utils, lifecycle

def main(argv):
    job = dist_utils.job_from_env()
    device = dist_utils.check_job(job, "cpu")  # from here on a refusal reaches the other rank
    if job.rank == 0:
        raise cli.UsageError("rank 0's own refusal")
    said = lifecycle.record_for_torchrun

    def late(line, when=None):  # a slow write of torchrun's error file: rank 0 and its store must still be there
        time.sleep(1.5)
        said(line, when)

    lifecycle.record_for_torchrun = late
    dist_utils.setup(job, device, timeout_s=30)

lifecycle.run_main(main)
"""


def test_a_refusal_read_as_its_store_goes_is_the_only_line(make_hosts, tmp_path):
    """Rank 0 refuses and serves the store until rank 1 has said its line; rank 1, joining, is
    blocked in a call to that store, which fails once rank 0 ends: its one line is rank 0's
    refusal, not also a failure to join."""
    hosts = make_hosts()
    program = tmp_path / "refuse.py"
    program.write_text(REFUSAL_AS_ITS_STORE_GOES.format(root=str(ROOT)))
    job = Job(hosts, tmp_path)
    for rank in (0, 1):  # two "nodes" of one process each, both on node A
        job.start(f"rank{rank}", "nodea", [program], RANK=rank, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1,
                  MASTER_ADDR=hosts.address("nodea"), MASTER_PORT=PORT)
    assert job.wait(150, expect=2) == {"rank0": 2, "rank1": 2}
    errors = [line for line in job.log("rank1").splitlines() if ": error:" in line]
    assert len(errors) == 1 and "rank 0 refused to start: rank 0's own refusal" in errors[0], job.log("rank1")


REFUSAL_READ_LATE = """
import sys, time
sys.path.insert(0, {root!r})
from utils import cli, distributed as dist_utils, lifecycle

def main(argv):
    job = dist_utils.job_from_env()
    device = dist_utils.check_job(job, "cpu")
    if job.rank == 2:
        raise cli.UsageError("rank 2's own refusal")
    if job.rank == 1:  # it looks for a refusal 4 s late: rank 0 has read it long before
        look, started = lifecycle.refusal_of_a_peer, time.monotonic()
        lifecycle.refusal_of_a_peer = lambda *args: look(*args) if time.monotonic() > started + 4 else None
    dist_utils.setup(job, device, timeout_s=30)

lifecycle.run_main(main)
"""


def test_the_store_stays_until_every_rank_has_read_a_refusal(make_hosts, tmp_path):
    """Rank 2 refuses; rank 0, which serves the store, reads the refusal first and ends, but not
    before rank 1, which reads it 4 s later, has: rank 1's one line is rank 2's refusal, not a
    failure to join, with a store gone, that blames the network."""
    hosts = make_hosts()
    program = tmp_path / "refuse.py"
    program.write_text(REFUSAL_READ_LATE.format(root=str(ROOT)))
    job = Job(hosts, tmp_path)
    for rank in (0, 1, 2):  # three "nodes" of one process each, all on node A
        job.start(f"rank{rank}", "nodea", [program], RANK=rank, WORLD_SIZE=3, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1,
                  MASTER_ADDR=hosts.address("nodea"), MASTER_PORT=PORT)
    assert job.wait(150, expect=2) == {"rank0": 2, "rank1": 2, "rank2": 2}, job.log("rank1")
    for rank in (0, 1):
        errors = [line for line in job.log(f"rank{rank}").splitlines() if ": error:" in line]
        assert len(errors) == 1 and "rank 2 refused to start: rank 2's own refusal" in errors[0], job.log(f"rank{rank}")


# --- h. a partition while the ranks agree through the store -------------------------------------

AGREE_ACROSS_A_CUT = """
import os, sys, time
sys.path.insert(0, {root!r})
import torch
from utils import distributed as dist_utils, lifecycle

def main(argv):
    job = dist_utils.job_from_env()
    env = dist_utils.setup(job, dist_utils.check_job(job, "cpu"), timeout_s=5)
    try:
        assert dist_utils.all_ranks_ok(True, "before the cut")
        open({marker!r} + f".{{env.rank}}", "w").close()
        while not os.path.exists({marker!r} + ".cut"):
            time.sleep(0.05)
        dist_utils.any_rank(False, "the agreement across the cut")
    finally:
        dist_utils.cleanup()

lifecycle.run_main(main)
"""


def test_a_rank_cut_off_from_the_store_ends_within_its_timeout(make_hosts, tmp_path):
    """A TCPStore call across a cut link keeps no timeout (it waits for the kernel, about 15
    minutes): the agreement's own deadline ends the rank cut off from rank 0's store, --dist-timeout
    (5 s) + 10 s after it began, with a line that says why; rank 0 times out in the agreement."""
    hosts = make_hosts()
    program, marker = tmp_path / "agree.py", tmp_path / "at"
    program.write_text(AGREE_ACROSS_A_CUT.format(root=str(ROOT), marker=str(marker)))
    job = Job(hosts, tmp_path)
    for rank, name in enumerate(hosts.names):
        job.start(name, name, [program], RANK=rank, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1,
                  MASTER_ADDR=hosts.address("nodea"), MASTER_PORT=PORT)
    job.wait_for(f"{marker}.0", f"{marker}.1")
    hosts.cut("nodeb")
    cut = time.monotonic()
    Path(f"{marker}.cut").touch()
    codes = job.wait(40, expect=None)
    elapsed = time.monotonic() - cut
    assert codes == {"nodea": 1, "nodeb": 1}, codes
    assert "waited in the agreement across the cut, and the job's store gave no answer within --dist-timeout 5 s" \
        in job.log("nodeb"), job.log("nodeb")
    assert "waited in the agreement across the cut" in job.log("nodea"), job.log("nodea")
    print(f"both ranks ended {elapsed:.1f} s after the cut (bound: 5 + 10 s and the checks' second)")
    assert elapsed < 25, elapsed
