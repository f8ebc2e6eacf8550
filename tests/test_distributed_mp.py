"""distributed_mp.py: processes started by mp.spawn, on one node or two simulated on
localhost, TCP or shared-file rendezvous; bad input stops in the parent, before any
process starts, with one line and exit status 2."""
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import distributed_mp
from utils import distributed as dist_utils, spawn
from conftest import (ROOT, SMALL, Proc, expect, fake_accelerator, free_port, left_in, patched_on_import,
                      private_tmpdir, read_metrics, run_script, subprocess_env, two_nodes_here)


def _one_error_line(proc):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_two_processes_on_one_node_through_a_shared_file(tmp_path):
    # The default tcp:// rendezvous is exercised by the tests below; this one meets through
    # a file, as on a shared file system.
    metrics = tmp_path / "metrics.jsonl"
    rendezvous = tmp_path / "rdzv"
    # 101 test images: shards of 51 and 50, each counted once.
    proc = run_script(["distributed_mp.py", *SMALL, "--nproc-per-node", "2", "--test-samples", "101",
                       "--init-method", f"file://{rendezvous}", "--metrics", metrics, "--verify-sync"])
    assert ("starting 2 processes on node 0 of 1 (world size 2), "
            f"rendezvous at file://{rendezvous}") in proc.stdout
    assert proc.stdout.count("done:") == 1  # only global rank 0 prints
    end = read_metrics(metrics)[-1]
    assert end["event"] == "end" and end["strategy"] == "ddp-spawn"
    assert end["world_size"] == 2 and end["global_batch"] == 32
    assert end["test_samples"] == 101 and end["step"] == 256 // 32
    # DDP keeps the parameters identical; only batch-norm statistics differ without --sync-bn.
    assert "running statistics differ unless --sync-bn" in proc.stdout
    # The store may leave its file behind; a stale one would break the next run, so it is removed.
    assert not rendezvous.exists()

@pytest.mark.parametrize("tail", ["/", "?use_libuv=1"])
def test_a_tcp_url_with_a_path_or_query_that_torch_accepts_trains(tail):
    # torch's rendezvous reads the host and port out of the URL and the query's use_libuv. Rank 1 first looks
    # for rank 0's store at the address alone: it took "PORT/" for the port and waited --dist-timeout for it.
    init_method = f"tcp://127.0.0.1:{free_port()}{tail}"
    proc = run_script(["distributed_mp.py", *SMALL, "--nproc-per-node", "2", "--init-method", init_method,
                       "--dist-timeout", "60"], check=False, timeout=120)
    assert proc.returncode == 0 and "done:" in proc.stdout, proc.stderr



def _run_in_process(argv, capsys, monkeypatch, gpus=0):
    """main() as the command line runs it, in this process; no worker may start."""
    def no_spawn(*args, **kwargs):
        raise AssertionError("a process was started")
    monkeypatch.setattr(distributed_mp.mp, "spawn", no_spawn)
    monkeypatch.setattr(distributed_mp.lifecycle, "_job", None)  # where a refusal goes: this run's, undone after
    fake_accelerator(monkeypatch, "cuda" if gpus else None, gpus)
    with pytest.raises(SystemExit) as exit_info:
        distributed_mp.lifecycle.run_main(distributed_mp.main, argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_each_spawned_process_takes_one_thread_as_under_torchrun(tmp_path):
    """Without OMP_NUM_THREADS, 2 processes would each take every core (OpenMP's default): torchrun sets it to 1
    for several processes, and so does the launcher here, saying so; it is passed to the workers, which read it
    as they start. One the user gave is kept."""
    (tmp_path / "probe.py").write_text(
        "import os, sys, torch, distributed_mp\n"
        "def threads(local_rank, *args):  # in place of the training, in each spawned process; one write a line\n"
        "    os.write(1, f'worker {local_rank}: {torch.get_num_threads()} thread(s)\\n'.encode())\n"
        "if __name__ == '__main__':\n"
        "    import probe\n"
        "    distributed_mp.worker = probe.threads\n"
        "    distributed_mp.main(sys.argv[1:])\n")
    for given, expected in ((None, 1), ("2", 2)):
        env = subprocess_env(PYTHONPATH=f"{ROOT}:{tmp_path}")
        env.pop("OMP_NUM_THREADS")
        if given:
            env["OMP_NUM_THREADS"] = given
        proc = run_script([tmp_path / "probe.py", *SMALL, "--nproc-per-node", "2"], env=env)
        assert ("OMP_NUM_THREADS=1 in each, as torchrun sets it" in proc.stdout) == (given is None), proc.stdout
        assert sorted(line for line in proc.stdout.splitlines() if line.startswith("worker")) == \
            [f"worker {rank}: {expected} thread(s)" for rank in (0, 1)], proc.stdout


@pytest.mark.parametrize("flags, expected", [
    (["--nproc-per-node", "2", "--batch-size", "33"],
     "batch size 33 is not divisible by 2 processes (33 / 2 = 16.5); choose a multiple of 2"),
    (["--nproc-per-node", "1", "--nodes", "2"], "--nodes 2 needs --ip: node 0's address"),
    (["--nproc-per-node", "1", "--nodes", "2", "--ip", "10.0.0.1"], "--nodes 2 needs --port"),
    # Two nodes can meet at no loopback address: each would look for the others at its own (several
    # nodes on their own addresses: tests/test_hosts.py).
    (["--nproc-per-node", "1", "--nodes", "2", "--node-rank", "1", "--ip", "127.0.0.1", "--port", "29500"],
     "--ip 127.0.0.1 is a loopback address: each node would look for the others at its own"),
    (["--nproc-per-node", "1", "--nodes", "2", "--node-rank", "2", "--port", "29500"],
     "--node-rank 2 with --nodes 2: node ranks go from 0 to 1"),
    (["--init-method", "http://127.0.0.1:29500"], "use tcp://HOST:PORT or file:///PATH"),
])
def test_bad_launch_flags_stop_in_the_parent(flags, expected, capsys, monkeypatch):
    assert expected in _run_in_process([*SMALL, *flags], capsys, monkeypatch)


def test_a_host_knows_its_own_name_in_any_case(monkeypatch):
    """Host names are case-insensitive, and --ip comes lowercased out of tcp://HOST:PORT: NodeA's
    own name on its loopback line is its own, which the other nodes may resolve to its network
    address (no finding with NCCL); another name that resolves to loopback is refused."""
    from utils import network
    monkeypatch.setattr(network.socket, "gethostname", lambda: "NodeA")
    monkeypatch.setattr(network, "resolve", lambda host, family=None: ["127.0.1.1"])
    assert network.findings("nodea", uses_gloo=False) == []
    assert network.findings("NODEA.cluster", uses_gloo=False) == []
    [finding] = network.findings("nodeb", uses_gloo=False)
    assert finding.certain and "nodeb is 127.0.1.1 here, a loopback address" in finding.what


def test_more_processes_than_gpus_is_refused(capsys, monkeypatch):
    line = _run_in_process([*SMALL, "--nproc-per-node", "4"], capsys, monkeypatch, gpus=2)
    assert "--nproc-per-node 4 but only 2 GPUs visible" in line


def test_a_stale_rendezvous_file_is_refused(tmp_path, capsys, monkeypatch):
    stale = tmp_path / "rdzv"
    stale.write_text("left by a run that crashed")
    line = _run_in_process([*SMALL, "--init-method", f"file://{stale}"], capsys, monkeypatch)
    assert "the file exists" in line and str(stale) in line
    assert stale.read_text() == "left by a run that crashed"  # refused, not deleted


@pytest.mark.parametrize("held_on", ["127.0.0.1", "127.0.0.2"])
def test_port_in_use_is_one_line_and_exit_2(capsys, monkeypatch, held_on):
    """Held on --ip's own address, or on another of this machine's: rank 0's store listens on
    every address (TCPStore), so it could not start either way."""
    with socket.socket() as held:
        held.bind((held_on, 0))
        held.listen()
        port = held.getsockname()[1]
        line = _run_in_process([*SMALL, "--port", str(port)], capsys, monkeypatch)  # no process may start
    assert f"port {port} on 127.0.0.1 is already in use" in line and "--port" in line.split("use;")[1]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"),
                    reason="a network and a hosts file of its own: root, unshare, ip")
def test_ip_may_name_a_host_that_has_an_ipv6_address_only(tmp_path):
    """--ip NAME where NAME has only an IPv6 address: in a network namespace of the test's own, fd00:57::2 on its
    loopback interface, named in a hosts file bind-mounted over /etc/hosts (::1 would not do: glibc answers an IPv4
    lookup of a name on a ::1 line with 127.0.0.1). The run trains there (TCPStore and gloo take such a name). The
    check of the port looked NAME up for IPv4 alone, and refused it with "cannot resolve"."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost {socket.gethostname()}\nfd00:57::2 v6only\n")
    args = ["--dataset", "synthetic", "--model", "resnet_tiny", "--train-samples", "64", "--test-samples", "32",
            "--batch-size", "32", "--epochs", "1", "--nproc-per-node", "2", "--ip", "v6only"]
    run = (f"ip link set lo up && ip address add fd00:57::2/128 dev lo && mount --bind {shlex.quote(str(hosts))} "
           f"/etc/hosts && exec {shlex.join([sys.executable, 'distributed_mp.py', *args])}")
    proc = subprocess.run(["unshare", "--net", "--mount", "sh", "-c", run], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "rendezvous at tcp://v6only:" in proc.stdout, proc.stdout + proc.stderr
    assert "done: 2 steps" in proc.stdout and "Traceback" not in proc.stderr, proc.stdout + proc.stderr


def test_port_in_use_on_node_0_says_the_other_nodes_wait(capsys, monkeypatch):
    """The other nodes would hear of node 0's refusal at that very port: none can be told, and the
    line says what they do meanwhile (rank 0's store could not listen to tell them)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = _run_in_process([*SMALL, "--nproc-per-node", "1", "--nodes", "2", "--ip", "127.0.0.1",
                                "--port", str(port)], capsys, monkeypatch)
    assert f"port {port} on 127.0.0.1 is already in use" in line
    assert f"hear of a refusal only at 127.0.0.1:{port}, so not of this one, and wait until their --dist-timeout: " \
           "stop them" in line


def test_two_runs_started_at_once_on_one_port_one_trains_and_the_other_says_the_port_was_taken(tmp_path):
    """Default flags (loader workers on). Both parents find the port free; one run's rank 0 then fails to listen,
    and its rank 1 joins the other run's store. There the two runs' ranks must not meet (gloo paired them across
    the runs: the run whose rank 0 listened failed too, in 1 of 4 tries): that run trains, and the other ends with
    status 2 and the cause, not 'another rank did not come'."""
    port, args = free_port(), ["--dataset", "synthetic", "--model", "resnet_tiny", "--train-samples", "1024",
                               "--test-samples", "100", "--batch-size", "32", "--epochs", "2"]
    runs = [Proc(["distributed_mp.py", *args, "--nproc-per-node", "2", "--port", port, "--dist-timeout", "60",
                  "--checkpoint-dir", tmp_path / name]) for name in ("a", "b")]
    trained, other = sorted((run.wait(300) for run in runs), key=lambda run: run.rc)
    assert "done: 64 steps" in expect(trained), trained.output()
    said = expect(other, 2)
    lines = [line for line in said.splitlines() if "error:" in line]
    # Both parents start within a second; a parent that came seconds later (a loaded machine) finds the port held.
    assert "rank 0 could not join" in lines[0] and "took the port after it was checked" in lines[0] \
        or f"port {port} on 127.0.0.1 is already in use" in lines[0], said
    assert "did not come" not in lines[0] and "Traceback" not in said, said


@pytest.mark.parametrize("libuv", ["1", "0"], ids=["libuv", "USE_LIBUV=0"])
def test_rank_0_whose_port_was_taken_after_the_check_says_so_with_status_2(libuv):
    """Rank 0 joining at a port that another program took after the launcher found it free (two runs started at
    once): one line that says so, status 2, whichever TCPStore server (libuv's, the default, or the older one, which
    USE_LIBUV=0 or ?use_libuv=0 chooses, and which words it differently), not "another rank did not come"."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        join = ("import torch; from utils import distributed as d; "
                f"d.setup(d.DistEnv(0, 0, 2, 2, distributed=True, init_method='tcp://127.0.0.1:{port}'), "
                "torch.device('cpu'), timeout_s=60)")
        proc = subprocess.run([sys.executable, "-c", join], cwd=ROOT, capture_output=True, text=True, timeout=180,
                              env=dict(os.environ, OMP_NUM_THREADS="1", USE_LIBUV=libuv))
    *logged, line = proc.stderr.strip().splitlines()  # the older server logs its failed binds first (socket.cpp)
    assert proc.returncode == 2 and all("] [c10d] " in entry for entry in logged) and bool(logged) == (libuv == "0")
    assert line.startswith("-c: error: rank 0 could not join the gloo process group (DistNetworkError: "), proc.stderr
    assert line.endswith("another program (another run?) took the port after it was checked: start again on "
                         "another port"), line


@pytest.mark.parametrize("listening", [True, False], ids=["held", "closed"])
def test_a_node_waiting_where_no_store_answers_says_so(tmp_path, listening):
    """A node joining at HOST:PORT where no store answers: another program listens there and never answers
    (TCPStore's client waits past its own timeout there), or nothing does (node 0 not started yet, a wrong
    --port). It ends --dist-timeout later in one line, saying that no store ever answered there, not that a
    rank did not come nor that other ports are closed; without TCPStore's C++ traces."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        if listening:
            held.listen()
        port = held.getsockname()[1]
        join = ("import torch; from utils import distributed as d; print('imported', flush=True); "
                f"d.setup(d.DistEnv(1, 0, 2, 1, distributed=True, init_method='tcp://127.0.0.1:{port}'), "
                "torch.device('cpu'), timeout_s=2)")
        with subprocess.Popen([sys.executable, "-c", join], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, OMP_NUM_THREADS="1")) as proc:
            hung = threading.Timer(120, proc.kill)  # the reads below have no timeout of their own
            hung.start()
            try:
                assert proc.stdout.readline() == "imported\n"  # timed from here: the imports take long on a busy CPU
                started = time.monotonic()
                first = proc.stderr.readline()
                said = time.monotonic() - started
                # It ends too: after its store probe's 10 s at most (held: the probe hangs in the store's
                # handshake) and the interpreter's teardown, seconds of CPU on a busy machine.
                rest = proc.communicate(timeout=2 + 10 + 60)[1]
            finally:
                hung.cancel()
            stderr = first + rest
    # The line at --dist-timeout (2 s), not at the join's deadline (+ JOIN_GRACE_S, 10 s): 7 s to say it.
    assert proc.returncode == 1 and said < 2 + dist_utils.JOIN_GRACE_S - 3, (said, stderr)
    assert "Exception raised from" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.strip().splitlines()[-1] == (
        "-c: error: rank 1 did not join the gloo process group within --dist-timeout 2 s: no store ever answered "
        f"at 127.0.0.1:{port}: rank 0 did not start one (it was not started, or failed first), another program "
        "holds that port, or this node cannot reach it; scripts/preflight.py checks each node's network"), stderr


def test_a_refusal_left_by_a_node_s_flags_is_named_by_node_0_of_the_next_run(tmp_path, capsys, monkeypatch):
    # Node 1 refused its flags before any process started: its line waits in PATH.refused for the other nodes,
    # and no node 0 ran to remove it. The corrected command on node 0 names it, instead of every node ending
    # at once with the old line as this run's.
    iface, _ = two_nodes_here()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", iface)
    rendezvous = tmp_path / "rdzv"
    meet = ["--nodes", "2", "--nproc-per-node", "1", "--init-method", f"file://{rendezvous}"]
    node_1 = run_script(["distributed_mp.py", *SMALL, *meet, "--node-rank", "1", "--batch-size", "33"], check=False,
                        env=subprocess_env(GLOO_SOCKET_IFNAME=iface))
    assert node_1.returncode == 2 and "batch size 33 is not divisible by 2 processes" in node_1.stderr, node_1.stderr
    line = _run_in_process([*SMALL, *meet, "--node-rank", "0"], capsys, monkeypatch)
    assert ": error: rank 1 refused to start: batch size 33 is not divisible" in line, line
    assert f"(as {rendezvous}.refused says; if an earlier run left it, delete it)" in line


def test_a_node_rerun_with_its_flags_corrected_is_not_ended_by_its_own_old_refusal(tmp_path, start_two_nodes):
    # Node 1 refused its flags before any process started, and its line waits in PATH.refused. Rerun corrected,
    # node 1 removes it (a rank of its own, from before this run started them): with node 0 started after, the
    # job trains, where every rank took the old line for this run's and ended at once with it.
    iface, _ = two_nodes_here()
    rendezvous = tmp_path / "rdzv"
    meet = ["--nodes", "2", "--nproc-per-node", "1", "--init-method", f"file://{rendezvous}"]
    node_1 = run_script(["distributed_mp.py", *SMALL, *meet, "--node-rank", "1", "--batch-size", "33"], check=False,
                        env=subprocess_env(GLOO_SOCKET_IFNAME=iface))
    assert node_1.returncode == 2 and os.path.exists(f"{rendezvous}.refused"), node_1.stderr
    node_1 = start_two_nodes.node(iface, 1, meet, 1)
    deadline = time.monotonic() + 60
    while os.path.exists(f"{rendezvous}.refused"):
        assert node_1.poll() is None and time.monotonic() < deadline, node_1.communicate()
        time.sleep(0.2)
    node_0 = start_two_nodes.node(iface, 0, meet, 1)
    for node in (node_0, node_1):
        out, err = node.communicate(timeout=180)
        assert node.returncode == 0 and "batch size 33" not in err, err


def test_torchrun_is_refused_in_one_line(tmp_path):
    # The script starts its own processes. Under torchrun its workers inherited the agent's store variables: on
    # 2.11 each waited --dist-timeout for a store that nobody served there; on 2.14 each torchrun worker trained
    # a job of its own.
    proc = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "distributed_mp.py",
                       *SMALL, "--dist-timeout", "60"], check=False, timeout=60)
    first, *_ = proc.stderr.splitlines()  # then torchrun's own report of a failed worker
    assert proc.returncode == 1 and 'distributed_mp.py", line' not in proc.stderr, proc.stderr
    assert first == ("distributed_mp.py: error: torchrun: this script starts and numbers its own processes "
                     "(--nproc-per-node); run it with plain python, not a launcher (torchrun runs distributed.py)")


def test_a_batch_refused_on_one_node_reaches_the_other_at_once():
    """distributed.py typed on each node by hand, node 1 with another --batch-size: node 0 says node 1's line at
    once, not "1/2 clients joined" once --dist-timeout has passed (the batch was checked before a refusal
    could reach the job)."""
    iface, address = two_nodes_here()
    flags = [*SMALL, "--device", "cpu", "--dist-timeout", "300"]  # far beyond the time a loaded CPU takes to start
    env = dict(WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR=address, MASTER_PORT=free_port(),
               GLOO_SOCKET_IFNAME=iface)
    nodes = [subprocess.Popen([sys.executable, "distributed.py", *flags, "--batch-size", str(32 + rank)], cwd=ROOT,
                              env=subprocess_env(RANK=rank, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in (0, 1)]
    try:
        node_0 = nodes[0].communicate(timeout=120)[1]  # not --dist-timeout later
    finally:
        for node in nodes:
            node.kill()
            node.communicate()
    assert "rank 1 refused to start: batch size 33 is not divisible" in node_0, node_0


def test_a_stop_signal_while_a_refusal_is_being_delivered_ends_with_the_refusal_alone():
    """Three nodes typed by hand, node 1 with another --batch-size, node 2 not started yet: node 0 says node 1's
    line, then, as the store's host, holds on for node 2 to read it. Ctrl-C or a launcher's SIGTERM to its group
    meanwhile ends it with the refusal's status, 2, and no second line blaming a rank that did not come."""
    iface, address = two_nodes_here()
    env = dict(WORLD_SIZE=3, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR=address, MASTER_PORT=free_port(),
               GLOO_SOCKET_IFNAME=iface)
    nodes = [subprocess.Popen([sys.executable, "distributed.py", *SMALL, "--device", "cpu", "--dist-timeout", "300",
                               "--batch-size", str(30 + rank)], cwd=ROOT, env=subprocess_env(RANK=rank, **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for rank in (0, 1)]
    try:
        said = nodes[0].stderr.readline()
        assert "rank 1 refused to start: batch size 31 is not divisible" in said, said
        os.killpg(nodes[0].pid, signal.SIGTERM)
        rest = nodes[0].communicate(timeout=30)[1]
    finally:
        for node in nodes:
            node.kill()
            node.communicate()
    assert nodes[0].returncode == 2 and "error:" not in rest, said + rest


@pytest.fixture
def start_two_nodes():
    """start(iface, *flags, nproc=1): distributed_mp.py --nodes 2, `nproc` processes each, started by hand as
    a user does: node 0, then node 1 once node 0 says it starts its processes (or has ended). Returns the two
    Popen (output piped); what is still running at the end of the test is killed, workers too."""
    started = []

    def node(iface, rank, flags, nproc):
        started.append(subprocess.Popen(
            [sys.executable, "distributed_mp.py", *map(str, SMALL), "--max-steps", "2", "--dist-timeout", "120",
             "--nodes", "2", "--node-rank", str(rank), "--nproc-per-node", str(nproc), *map(str, flags)],
            cwd=ROOT, env=subprocess_env(GLOO_SOCKET_IFNAME=iface), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True))
        return started[-1]

    def start(iface, *flags, nproc=1):
        node_0 = node(iface, 0, flags, nproc)
        node_0.first_line = node_0.stdout.readline()  # "starting 1 process on node 0 of 2 ...", or "" if it ended
        return node_0, node(iface, 1, flags, nproc)
    start.node = node  # one node, started by the test itself
    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def ended(node, timeout=240):
    """(exit status, stdout, stderr) of a node that start_two_nodes started."""
    out, err = node.communicate(timeout=timeout)
    return node.returncode, getattr(node, "first_line", "") + out, err


@pytest.mark.parametrize("meet", ["file", "tcp"])
def test_a_refusal_then_the_corrected_command_run_again_and_again(tmp_path, meet, start_two_nodes):
    """Two nodes on this host, as a user runs them: a refusal met by the workers (rank 0's --checkpoint-dir,
    after the group formed), then the corrected command, started as soon as node 1 ended; with a file, that
    command once more. Each run finds nothing of the one before. The parents used to tell the refusal again
    once their workers were gone: node 0's on a store of its own on the job's port, held 10 s for reads that
    never came (the rerun: "port in use"), or in a .refused file that ended the rerun with the old line. And
    the rendezvous file outlived every run of several nodes: the next run's node 0 took node 1's old address
    from it ("Connection refused", as if the network failed) while node 1 waited --dist-timeout."""
    iface, address = two_nodes_here()
    rendezvous = tmp_path / "rdzv"
    meet_flags = (["--init-method", f"file://{rendezvous}"] if meet == "file"
                  else ["--ip", address, "--port", spawn.free_port(address)])
    not_a_folder = tmp_path / "not-a-folder"
    not_a_folder.write_text("")
    node_0, node_1 = start_two_nodes(iface, *meet_flags, "--checkpoint-dir", not_a_folder, nproc=2)
    code_1, _, err_1 = ended(node_1)
    runs = [start_two_nodes(iface, *meet_flags)]  # at once, as node 0 may still be ending
    code_0, _, err_0 = ended(node_0)
    assert (code_0, code_1) == (2, 2), err_0 + err_1
    assert err_0.splitlines() == [f"distributed_mp.py: error: cannot write --checkpoint-dir {not_a_folder}: it is a "
                                  "file, not a directory"], err_0
    assert len(err_1.splitlines()) == 1, err_1  # that rank 0 refused, once
    for run in range(2 if meet == "file" else 1):
        if run:
            runs.append(start_two_nodes(iface, *meet_flags))
        (code_0, out_0, err_0), (code_1, _, err_1) = map(ended, runs[-1])
        assert (code_0, code_1) == (0, 0) and "done: 2 steps" in out_0, f"run {run + 1}:\n{out_0}{err_0}{err_1}"
        assert not rendezvous.exists() and not Path(f"{rendezvous}.refused").exists()


def test_the_launcher_names_a_requeued_jobs_file_apart():
    """A requeued Slurm job keeps its id: its start after a kill would join the file the killed start
    left. Slurm's restart count names each start's file."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("JOB_ID", "RDZV_FILE", "SLURM_JOB_ID", "SLURM_RESTART_COUNT")}

    def rendezvous(**slurm):
        proc = subprocess.run(["bash", "scripts/launch_mp_spawn.sh"], cwd=ROOT, capture_output=True, text=True,
                              env=dict(env, MODE="file", PYTHON="echo", **slurm), timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split("--init-method ")[1].split()[0]
    assert rendezvous(SLURM_JOB_ID="4242") == "file:///shared/path/rdzv.4242"
    assert rendezvous(SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1") == "file:///shared/path/rdzv.4242.1"


def rank_1_tells_late(tell, lifecycle):
    """utils.lifecycle.tell_the_job, as a loaded machine can make it: rank 1 tells its refusal 3 s
    after rank 0. Rank 0 serves the store: it must stay until rank 1 is done with it."""
    import time

    def late(refusal):
        if lifecycle._job is not None and lifecycle._job[1] == 1:
            time.sleep(3)
        return tell(refusal)
    return late


@pytest.mark.parametrize("rank_1", ["in step", "late"])
def test_bad_input_seen_by_the_workers_is_one_line_and_exit_2(tmp_path, rank_1):
    # Met after the group formed (each rank reads --resume's file), by every rank. Rank 0 used to
    # tell through a store of its own on the group's port (EADDRINUSE, passed over) and exit at once:
    # a rank still telling lost the store, and its client's C++ retries filled stderr until the
    # parent ended it 10 s later (seen under load).
    missing = tmp_path / "nothing.pt"
    tmp = private_tmpdir()
    env = subprocess_env(TMPDIR=tmp)
    if rank_1 == "late":
        hook = patched_on_import(tmp_path, "utils.lifecycle", "tell_the_job", rank_1_tells_late)
        env["PYTHONPATH"] = os.pathsep.join([hook, env["PYTHONPATH"]])
    proc = run_script(["distributed_mp.py", *SMALL, "--nproc-per-node", "2", "--resume", missing],
                      check=False, timeout=180, env=env)
    assert _one_error_line(proc) == f"distributed_mp.py: error: no checkpoint at {missing}"
    assert left_in(tmp) == []  # the workers' lines, read, are removed (utils/spawn.py)


@pytest.mark.parametrize("where", ["before training", "mid-epoch"])
def test_a_bug_in_a_worker_shows_its_traceback(tmp_path, where):
    # A copy of the script whose rank 0 fails as a bug would: before training (one process), or at its
    # third step, 2 processes with loader workers, which ignore SIGTERM (multiprocessing's exit in the
    # worker joins them before any atexit handler: the job hung, and a SIGTERM only asked for a stop).
    source = (ROOT / "distributed_mp.py").read_text()
    marker, bug, flags = {
        "before training": ("    dist_utils.seed_everything(args.seed)\n",
                            "    raise RuntimeError('a bug in rank %d' % env.rank)\n", ["--nproc-per-node", "1"]),
        "mid-epoch": ("            loss.backward()  # DDP's hooks all-reduce the gradients during this call\n",
                      "            if run.global_step == 2 and env.rank == 0: raise RuntimeError('a bug in rank 0')\n",
                      ["--nproc-per-node", "2", "--workers", "2"])}[where]
    assert marker in source
    buggy = tmp_path / "buggy_mp.py"
    buggy.write_text(source.replace(marker, marker + bug))
    tmp = private_tmpdir()
    proc = Proc([buggy, *SMALL, *flags], TMPDIR=tmp).wait(120)
    output = proc.output()
    assert proc.rc == 1, output
    assert "Traceback" in output and "RuntimeError: a bug in rank 0" in output
    assert "(in global rank 0)" in output
    assert left_in(tmp) == []  # nor the file mp.spawn passed the traceback in (pytorch-errorfile-*)


def test_the_port_chosen_for_one_node_is_free_and_outside_the_ephemeral_range():
    ephemeral = spawn.ephemeral_ports()
    for _ in range(50):
        port = spawn.free_port("127.0.0.1")
        assert port not in ephemeral and 1024 < port < 65536
        with socket.socket() as s:  # free: it can be listened on
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()


def test_sigterm_to_the_parent_checkpoints_and_exits_0(tmp_path):
    """Like torchrun, the parent forwards SIGTERM: the worker saves, stops and exits 0."""
    proc = subprocess.Popen(
        [sys.executable, "distributed_mp.py", *SMALL, "--nproc-per-node", "1", "--epochs", "100",
         "--checkpoint-dir", tmp_path],
        cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(240, proc.kill)  # bounds the wait for output below
    watchdog.start()
    try:
        lines = []
        for line in proc.stdout:  # wait until training is under way
            lines.append(line)
            if line.startswith("epoch 1/100"):
                break
        assert lines and lines[-1].startswith("epoch 1/100"), "".join(lines)
        # The port it chose itself: outside the ephemeral range, where no outgoing connection
        # can take it before rank 0 listens (utils.spawn.free_port).
        port = int(lines[0].split("rendezvous at tcp://127.0.0.1:")[1])
        assert port not in spawn.ephemeral_ports(), lines[0]
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, "".join(lines) + rest
    assert "on SIGTERM: checkpoint saved" in rest and rest.count("stopping at step") == 1
    stopped_at = int(rest.split("stopping at step ")[1].split(":")[0].split()[0])
    state = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    # Saved where it stopped: in epoch 2, or at the end of epoch 1 when the signal landed
    # while that epoch was being closed (the stop is agreed once more after evaluation).
    assert state["global_step"] == stopped_at >= 256 // 32


@pytest.mark.gpu
def test_one_process_per_gpu(tmp_path):
    count = torch.cuda.device_count()
    env = subprocess_env(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES",
                                                             ",".join(map(str, range(count)))))
    metrics = tmp_path / "metrics.jsonl"
    batch = 32 * count
    proc = run_script(["distributed_mp.py", *SMALL, "--batch-size", batch, "--train-samples", 4 * batch,
                       "--metrics", metrics], env=env)  # --nproc-per-node defaults to the GPU count
    assert f"starting {count} process" in proc.stdout
    end = read_metrics(metrics)[-1]
    assert end["world_size"] == count and end["test_samples"] == 100 and end["device"] != "cpu"
