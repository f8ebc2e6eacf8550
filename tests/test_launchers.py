"""The launchers in scripts/: syntax, one real run, and what the others would run.

launch_single_node.sh runs for real (torchrun, 2 CPU processes). The multi-node, SLURM
and mp.spawn launchers need machines we do not have, so they run against stand-ins on
PATH (python, srun, scontrol, scancel) that record their command line instead; the
training script's own parser then checks every flag they pass. The SLURM test also
walks the time-limit path: SIGUSR1 to the batch shell -> SIGTERM to the job step ->
wait for it -> requeue.
"""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import (ROOT, Proc, assert_one_line_error, expect, free_port, read_metrics, run_script, subprocess_env,
                      two_nodes_here)

LAUNCHERS = ["scripts/launch_single_node.sh", "scripts/launch_multi_node.sh",
             "scripts/slurm.sbatch", "scripts/launch_mp_spawn.sh"]
TINY = ["--dataset", "synthetic", "--model", "resnet_tiny", "--train-samples", "256",
        "--test-samples", "64", "--batch-size", "32", "--workers", "0", "--epochs", "1"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_bash_syntax(launcher):
    proc = subprocess.run(["bash", "-n", launcher], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_single_node_launcher_trains_with_the_flags_passed_through(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("the CPU fallback is what this checks; see the gpu test below")
    metrics = tmp_path / "metrics.jsonl"
    proc = Proc(["scripts/launch_single_node.sh", *TINY, "--max-steps", "2",
                 "--checkpoint-dir", tmp_path / "ckpt", "--metrics", metrics],
                program=["bash"], SCRIPT="distributed.py", PYTHON=sys.executable)
    output = expect(proc.wait(300))
    assert "no GPU found: 2 processes on the CPU (gloo)" in output
    # The defaults of SCRIPT_ARGS were accepted; --resume on an empty directory starts fresh.
    assert "starting from scratch" in output
    final = read_metrics(metrics)[-1]
    assert (final["world_size"], final["step"], final["global_batch"]) == (2, 2, 32)


@pytest.mark.gpu
def test_single_node_launcher_uses_every_gpu(tmp_path):
    import torch
    metrics = tmp_path / "metrics.jsonl"
    gpus = torch.cuda.device_count()
    proc = Proc(["scripts/launch_single_node.sh", *TINY, "--batch-size", str(32 * gpus),
                 "--max-steps", "2", "--checkpoint-dir", tmp_path / "ckpt", "--metrics", metrics],
                program=["bash"], PYTHON=sys.executable,
                # Proc's environment hides the GPUs from CPU tests; this one needs them.
                CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))))
    expect(proc.wait(600))
    final = read_metrics(metrics)[-1]
    assert final["world_size"] == gpus and final["device"] != "cpu"


def _running(pid) -> bool:
    """Whether process `pid` is alive: not gone, and not a zombie that nobody has reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # gone before the open, or between the open and the read (ESRCH)
        return False


def test_quickstart_stopped_stops_its_workers(tmp_path):
    """`make train` runs bash scripts/quickstart.sh, and a SIGTERM to make goes on to that process alone. It must
    be torchrun by then, which stops its workers: a shell would die and leave them training. A copy in tmp_path
    (it empties its runs/), whose .venv/bin/python answers the GPU count (none) and the download (failed) without
    torch or the network, and whose distributed.py waits."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/quickstart.sh", tmp_path / "scripts")
    python = tmp_path / ".venv/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/bash\ncase "$*" in *device_count*) echo 0; exit ;; *torchvision*) exit 1 ;; esac\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (tmp_path / "distributed.py").write_text("import os, time\nopen(f'worker.{os.getpid()}', 'w').close()\n"
                                             "time.sleep(120)\n")
    proc = Proc([tmp_path / "scripts/quickstart.sh"], program=["bash"])
    try:
        deadline = time.time() + 60
        while len(workers := [int(p.suffix[1:]) for p in tmp_path.glob("worker.*")]) < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert len(workers) == 2, proc.output()
        proc.popen.send_signal(signal.SIGTERM)  # what make does
        deadline = time.time() + 20  # torchrun passes it on at once
        while any(map(_running, workers)) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(map(_running, workers)), proc.output()
    finally:
        proc.kill()  # whatever it left behind


# --- stand-ins for the commands of other machines -----------------------------------------

STUB = textwrap.dedent("""\
    #!{python}
    # Stand-in for `{name}`: records its command line (and one variable) as a JSON line.
    import json, os, signal, sys, time
    name, argv = {name!r}, sys.argv[1:]
    with open(os.environ["STUB_LOG"], "a") as log:
        log.write(json.dumps({{"cmd": name, "argv": argv, "cwd": os.getcwd(),
                              "cpus": os.environ.get("SRUN_CPUS_PER_TASK")}}) + "\\n")
    if name == "scontrol" and argv[:2] == ["show", "hostnames"]:
        print(os.environ.get("STUB_NODES", "gpu01 gpu02").replace(" ", "\\n"))
    if name == "python" and argv[:1] == ["-c"] and "device_count" in argv[1]:
        print(os.environ.get("STUB_GPUS", "0"))  # the launcher counting this machine's GPUs
    if name == "srun" and os.environ.get("STUB_SRUN", "").startswith("until-signalled"):
        # Like the job step: runs until SLURM signals it; torchrun then exits 1. With
        # "...-then-checkpoint", the training writes its stop checkpoint first, as it should.
        with open(os.environ["STUB_LOG"] + ".srun_pid", "w") as f:
            f.write(str(os.getpid()))
        def ended(*_):
            if os.environ["STUB_SRUN"].endswith("then-checkpoint"):
                # Where the training writes: the last --checkpoint-dir, as argparse takes it.
                directory = None
                for i, token in enumerate(argv):
                    if token == "--checkpoint-dir":
                        directory = argv[i + 1]
                    elif token.startswith("--checkpoint-dir="):
                        directory = token.split("=", 1)[1]
                os.makedirs(directory, exist_ok=True)
                open(os.path.join(directory, "checkpoint.pt"), "w").close()
                if "STUB_CLOCK_BEHIND" in os.environ:  # written by a node whose clock is behind the head node's
                    past = time.time() - float(os.environ["STUB_CLOCK_BEHIND"])
                    os.utime(os.path.join(directory, "checkpoint.pt"), (past, past))
            with open(os.environ["STUB_LOG"], "a") as log:
                log.write(json.dumps({{"cmd": "srun ended", "argv": []}}) + "\\n")
            sys.exit(1)
        signal.signal(signal.SIGTERM, ended)
        time.sleep(60)
        sys.exit(3)
    if name == "scancel":
        # A controller that does not answer in time, the first STUB_SCANCEL_FAILS times.
        if sum(1 for line in open(os.environ["STUB_LOG"]) if '"scancel"' in line) <= int(
                os.environ.get("STUB_SCANCEL_FAILS", "0")):
            sys.exit("scancel: error: Socket timed out on send/recv operation")
        # What `scancel --signal=TERM JOB` does to the step: SIGTERM to its processes; here the step
        # ends before scancel returns, the batch shell's trap still running (as a fast step may).
        with open(os.environ["STUB_LOG"] + ".srun_pid") as f:
            pid = int(f.read())
        try:
            os.kill(pid, signal.SIGTERM)
            while open(f"/proc/{{pid}}/stat").read().split(") ")[1][0] != "Z":
                time.sleep(0.01)
        except OSError:  # ended, and reaped by the batch shell's wait meanwhile: scancel does not fail then
            pass
        time.sleep(0.2)
""")


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "srun", "scontrol", "scancel"):
        path = bin_dir / name
        path.write_text(STUB.format(python=sys.executable, name=name))
        path.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(bin_dir / "python"),
               STUB_LOG=str(log))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "JOB_ID", "SLURM_JOB_ID", "SLURM_RESTART_COUNT",
                "RDZV_FILE"):  # a job's own
        env.pop(key, None)

    def calls():
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines()]

    return env, calls


def launch(launcher, env, *args, timeout=30, cwd=ROOT, **extra):
    proc = subprocess.run(["bash", launcher, *args], cwd=cwd, env=dict(env, **extra),
                          capture_output=True, text=True, timeout=timeout)
    return proc


def script_and_args(argv):
    """Split `python [-m torch.distributed.run OPTIONS] SCRIPT ARGS` at the script."""
    index = next(i for i, token in enumerate(argv) if token.endswith(".py"))
    return argv[:index], argv[index], argv[index + 1:]


@pytest.fixture(scope="module")
def script_help():
    """--help of each launched script, from one Python process (one torch import)."""
    code = textwrap.dedent("""\
        import runpy, sys
        for script in sys.argv[1:]:
            print(f"=== {script}", flush=True)
            sys.argv = [script, "--help"]
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit:
                pass
    """)
    scripts = ["distributed.py", "distributed_mp.py"]
    proc = subprocess.run([sys.executable, "-c", code, *scripts], cwd=ROOT, capture_output=True,
                          text=True, timeout=180, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    parts = re.split(r"^=== (\S+)\n", proc.stdout, flags=re.M)[1:]
    return dict(zip(parts[::2], parts[1::2]))


def assert_flags_accepted(script, args, script_help):
    for flag in {token.split("=")[0] for token in args if token.startswith("--")}:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", script_help[script]), \
            f"{flag} is passed to {script}, whose parser does not know it"


# --- multi-node torchrun ---------------------------------------------------------------------

def test_multi_node_launcher_command(stubs, script_help):
    env, calls = stubs
    proc = launch("scripts/launch_multi_node.sh", env, "--epochs", "3", RDZV_HOST="10.1.2.3")
    assert proc.returncode == 0, proc.stderr
    # torchrun through torchrun_bounded.py, which decides this node's network settings itself;
    # the same command with --check-args first.
    check, call = calls()
    assert check["argv"] == [*call["argv"], "--check-args"]
    assert call["argv"][0] == "scripts/torchrun_bounded.py"
    launcher, script, args = script_and_args(call["argv"][1:])
    for option in ("--nnodes=2", "--nproc_per_node=8", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=10.1.2.3:29500", "--rdzv-id=cifar100-ddp", "--max-restarts=3"):
        assert option in launcher, launcher
    assert not any(o.startswith("--node_rank") for o in launcher)  # c10d numbers the nodes
    assert script == "distributed.py" and args[-2:] == ["--epochs", "3"] and "--resume" in args
    assert_flags_accepted(script, args, script_help)


@pytest.mark.parametrize("endpoint, host", [("[::1]", "::1"), ("[::1]:29500", "::1"), ("127.0.0.1", "127.0.0.1")])
def test_torchrun_bounded_reads_the_endpoint_as_torchrun_does(endpoint, host, capsys, monkeypatch):
    """An IPv6 address in brackets, with or without a port: the host is the address (a loopback
    one here, refused in its own name), not the text before the last colon."""
    from scripts import torchrun_bounded
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # what node_settings sets in os.environ goes with the test
    from torch.distributed.run import get_args_parser
    argv, _, found = torchrun_bounded.node_settings(["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                                                     "distributed.py", "--device", "cpu"])
    assert found.host == host
    with pytest.raises(SystemExit) as refused:
        torchrun_bounded.refuse_what_no_setting_saves(get_args_parser().parse_args(argv), found.host, warn=True)
    assert refused.value.code == 2
    assert f"the rendezvous endpoint {host} is a loopback address" in capsys.readouterr().err


def test_a_check_of_the_arguments_says_each_warning_once():
    """torchrun_bounded.py --check-args runs the script's own check, which prints what it is not sure of (an
    IPv6 endpoint, here another host's); the launcher's check of the same endpoint adds no second line."""
    iface, _ = two_nodes_here()  # gloo on an interface the other nodes may reach: no refusal of its address
    proc = run_script(["scripts/torchrun_bounded.py", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                       "--rdzv-endpoint=[fd00:57::1]:29400", "distributed.py", *TINY, "--device", "cpu",
                       "--check-args"], timeout=120, env=subprocess_env(GLOO_SOCKET_IFNAME=iface))
    warnings = [line for line in proc.stderr.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "fd00:57::1 is IPv6 here" in warnings[0], proc.stderr


def test_a_check_of_the_arguments_refuses_a_checkpoint_folder_in_use(tmp_path):
    """A second launch on a folder that a run holds: refused by the launchers' check, once, in one line, not by
    the run on every attempt that torchrun would restart. A folder that no one holds passes."""
    folder = tmp_path / "ck"
    command = ["scripts/torchrun_bounded.py", "--nnodes=1", "--nproc_per_node=2", "distributed.py", *TINY,
               "--device", "cpu", "--checkpoint-dir", tmp_path / "other", f"--checkpoint-dir={folder}", "--check-args"]
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from utils import checkpoint; "
                               "checkpoint.lock_directory(sys.argv[1]); print('held', flush=True); time.sleep(120)",
                               str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, TORCHELASTIC_RUN_ID="my-job"))  # as torchrun's rank 0
    try:
        assert holder.stdout.readline() == "held\n"
        proc = run_script(command, check=False, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert_one_line_error(proc, f"--checkpoint-dir {folder} is in use by another run (host ",
                              ", torchrun run my-job)")
        # The job that holds it (its --rdzv-id): a node that joins it, or comes back, is not refused.
        assert run_script([command[0], "--rdzv-id=my-job", *command[1:]], check=False, timeout=120).returncode == 0
    finally:
        holder.kill()
        holder.wait()
    assert run_script(command, check=False, timeout=120).returncode == 0  # the lock died with its process


@pytest.mark.parametrize("grace", ["90s", "0", "nan"])
def test_torchrun_bounded_refuses_a_grace_that_is_not_seconds_in_one_line(grace):
    proc = run_script(["scripts/torchrun_bounded.py", "--nnodes=1", "distributed.py", "--device", "cpu"],
                      check=False, timeout=60, env=subprocess_env(TORCHRUN_GRACE=grace))
    assert_one_line_error(proc, f"TORCHRUN_GRACE={grace}: give the seconds")


@pytest.mark.parametrize("given, shared", [(None, "False"), ("0", "True")])
def test_torchrun_bounded_gives_each_attempt_a_fresh_store_unless_told_otherwise(tmp_path, given, shared):
    # After a restart the nodes' agents may count attempts apart: in a store that outlives the attempt (the
    # agent's), the ranks would look for each other under keys of their own counts.
    worker = tmp_path / "worker.py"
    worker.write_text("import os\nprint('agent store:', os.environ['TORCHELASTIC_USE_AGENT_STORE'])\n")
    env = {key: value for key, value in subprocess_env().items() if key != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": given} if given else {})
    proc = run_script(["scripts/torchrun_bounded.py", "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{free_port()}", worker], timeout=120, env=env)
    assert f"agent store: {shared}" in proc.stdout, proc.stdout + proc.stderr


def test_torchrun_bounded_does_not_end_a_node_whose_workers_succeeded(tmp_path):
    """Two nodes on this host (a static rendezvous): node 0's worker runs 3 s (seen by the watch, which looks
    every second), node 1's 10 s more. Node 0's torchrun waits for node 1 with no training process of its own,
    5 times its grace: a finished node, which the watch leaves alone. Both end well, without the watch's line."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, time\ntime.sleep(3 + 10 * int(os.environ['GROUP_RANK']))\n")
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "scripts/torchrun_bounded.py", "--nnodes=2", f"--node-rank={rank}",
                               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", str(worker)],
                              cwd=ROOT, env=subprocess_env(TORCHRUN_GRACE="2"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert not any("no training process has run" in output for output in outputs), outputs


@pytest.mark.parametrize("nproc, processes", [("8", "16 processes"), ("cpu", "")])  # cpu: as torchrun counts
def test_multi_node_launcher_refuses_bad_arguments_in_one_line(stubs, nproc, processes):
    env, calls = stubs
    iface, address = two_nodes_here()  # a head node that the network checks pass, to come to the batch's
    proc = launch("scripts/launch_multi_node.sh", dict(env, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES=""),
                  "--batch-size", "1001", NPROC_PER_NODE=nproc, RDZV_HOST=address, GLOO_SOCKET_IFNAME=iface,
                  timeout=120)  # two imports of torch, under load
    assert proc.returncode == 2
    assert_one_line_error(proc, f"batch size 1001 is not divisible by {processes}")


@pytest.mark.parametrize("nnodes, checked", [("2", [16]), ("1:2", [16, 8]), ("2:4", [32, 24])])
def test_an_elastic_job_is_checked_at_every_node_count_it_may_run_with(monkeypatch, nnodes, checked):
    # 8 processes a node: 2 and 4 nodes split a batch of 64, 3 do not, and a round of 3 would refuse on
    # every node, --max-restarts times. The check stops at the first refusal, the largest job's first.
    import subprocess
    from torch.distributed.run import get_args_parser
    from scripts import torchrun_bounded
    sizes = []

    def check(cmd, env):
        sizes.append(int(env["WORLD_SIZE"]))
        return subprocess.CompletedProcess(cmd, 2 if 64 % sizes[-1] else 0)
    monkeypatch.setattr(subprocess, "run", check)
    args = get_args_parser().parse_args([f"--nnodes={nnodes}", "--nproc_per_node=8", "distributed.py",
                                         "--batch-size", "64", "--check-args"])
    with pytest.raises(SystemExit) if 24 in checked else contextlib.nullcontext() as refused:
        torchrun_bounded.check_args(args, torchrun_bounded.Rendezvous("10.0.0.1", 29500, False, 60))
    assert sizes == checked and (refused is None or refused.value.code == 2)


@pytest.mark.parametrize("nnodes, why", [("4:2", "must be greater than or equal to the minimum"),
                                         ("2:4:6", 'is not in "MIN:MAX" format'), ("two", "invalid literal")])
def test_a_check_of_the_arguments_refuses_an_nnodes_that_torchrun_would(nnodes, why):
    """--nnodes as torchrun reads and refuses it: MAX below MIN was checked at no node count, and passed; a third
    number or a word was a traceback. One line, status 2, as the script's own refusals."""
    proc = run_script(["scripts/torchrun_bounded.py", f"--nnodes={nnodes}", "--nproc-per-node=1", "distributed.py",
                       "--dataset", "synthetic", "--check-args"], check=False, timeout=120)
    assert_one_line_error(proc, f"torchrun_bounded.py: error: --nnodes={nnodes}: ", why)
    assert "arguments OK" not in proc.stdout, proc.stdout


# --- SLURM ---------------------------------------------------------------------------------

SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "cifar", "SLURM_JOB_NODELIST": "gpu[01-02]",
             "SLURM_NNODES": "2", "SLURM_SUBMIT_DIR": str(ROOT)}


def test_slurm_batch_script_directives():
    text = (ROOT / "scripts/slurm.sbatch").read_text()
    directives = re.findall(r"^#SBATCH\s+(\S+)", text, re.M)
    for wanted in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--signal=B:USR1@120",
                   "--requeue", "--open-mode=append"):
        assert wanted in directives, directives
    # sbatch reads #SBATCH lines only up to the first command.
    lines = text.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command


def test_slurm_batch_script_command(stubs, script_help, tmp_path):
    env, calls = stubs
    # Submitted from elsewhere with sbatch -D ROOT: the batch shell starts in ROOT, and stays there.
    proc = launch("scripts/slurm.sbatch", dict(env, CHECKPOINT_DIR=str(tmp_path / "ck")), "--epochs", "3",
                  **dict(SLURM_ENV, SLURM_SUBMIT_DIR=str(tmp_path), SLURM_CPUS_PER_TASK="32"))
    assert proc.returncode == 0, proc.stderr
    srun = [c for c in calls() if c["cmd"] == "srun"]
    assert srun[0]["cwd"] == str(ROOT) and srun[0]["cpus"] == "32"  # srun does not inherit sbatch's -c
    # The arguments are checked once before srun; no scancel, no requeue.
    assert [c["cmd"] for c in calls()] == ["scontrol", "python", "srun"]
    assert calls()[1]["argv"] == [*srun[0]["argv"][1:], "--check-args"]  # the same command, checked
    assert srun[0]["argv"][1] == "scripts/torchrun_bounded.py"  # torchrun, with each node's own settings
    launcher, script, args = script_and_args(srun[0]["argv"][2:])
    for option in ("--nnodes=2", "--nproc_per_node=8", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=gpu01:24242", "--rdzv-id=4242", "--max-restarts=3"):
        assert option in launcher, launcher
    assert script == "distributed.py" and args[-3:] == ["--resume", "--epochs", "3"], args
    assert args[args.index("--checkpoint-dir") + 1] == str(tmp_path / "ck")
    assert_flags_accepted(script, args, script_help)


def test_slurm_checkpoint_folder_is_the_job_id_by_default(stubs, tmp_path):
    env, calls = stubs  # no CHECKPOINT_DIR, no --checkpoint-dir: a requeued job finds its own folder again
    proc = launch(str(ROOT / "scripts/slurm.sbatch"), env, cwd=tmp_path, **SLURM_ENV)
    assert proc.returncode == 0, proc.stderr
    _, _, args = script_and_args([c for c in calls() if c["cmd"] == "srun"][0]["argv"][2:])
    assert args[args.index("--checkpoint-dir") + 1] == "checkpoints/4242" and "--resume" in args


def test_slurm_refuses_bad_arguments_once_before_srun(stubs, tmp_path):
    env, calls = stubs
    iface, address = two_nodes_here()  # a head node that the network checks pass, to come to the batch's
    proc = launch("scripts/slurm.sbatch", dict(env, PYTHON=sys.executable, CHECKPOINT_DIR=str(tmp_path),
                                               CUDA_VISIBLE_DEVICES=""),  # the same answer on a GPU machine
                  "--batch-size", "1000", timeout=120, STUB_NODES=f"{address} gpu02", GLOO_SOCKET_IFNAME=iface,
                  **SLURM_ENV)
    assert proc.returncode == 2
    assert_one_line_error(proc, "batch size 1000 is not divisible by 16 processes")
    assert [c["cmd"] for c in calls()] == ["scontrol"]  # the head node's name, and nothing started


def test_slurm_without_a_venv_says_how_to_make_one(stubs, tmp_path):
    env, calls = stubs
    env = {k: v for k, v in env.items() if k != "PYTHON"}
    proc = launch(str(ROOT / "scripts/slurm.sbatch"), env, cwd=tmp_path, **SLURM_ENV)
    assert proc.returncode == 2 and "no .venv" in proc.stderr and "make venv" in proc.stderr
    assert calls() == []


@pytest.mark.parametrize("checkpoints, given, scancel_fails", [
    (True, "env", 0), (True, "flag", 0), (True, "flag=", 0), (False, "env", 0), ("stale", "env", 0),
    ("behind", "env", 0), (True, "SCRIPT_ARGS", 0), (True, "env", 1), (True, "env", 3)])
def test_slurm_time_limit_signal_checkpoints_then_requeues(stubs, tmp_path, checkpoints, given, scancel_fails):
    """The checkpoint folder named by CHECKPOINT_DIR, by a --checkpoint-dir among the extra flags
    (which the training takes, being the last), or by one edited into SCRIPT_ARGS: the batch script
    watches that folder. Run in tmp_path: the default folder is checkpoints/4242 there. A scancel that
    fails (a busy controller) is tried again, 3 times in all; whatever fails in the trap, the batch
    shell still waits for the step and decides. "stale": an earlier checkpoint is there, and the stop
    writes none: not requeued either. "behind": rank 0's node writes the stop checkpoint with a clock 5 s behind
    the batch shell's (its mtime is that node's, on many shared file systems): requeued all the same."""
    env, calls = stubs
    if checkpoints == "behind":
        checkpoints, env = True, dict(env, STUB_CLOCK_BEHIND="5")
    mode = "until-signalled-then-checkpoint" if checkpoints is True else "until-signalled"
    folder = tmp_path / "ck"
    if checkpoints == "stale":
        folder.mkdir()
        (folder / "checkpoint.pt").write_bytes(b"an earlier one")
    extra = {"flag": ["--checkpoint-dir", str(folder)], "flag=": [f"--checkpoint-dir={folder}"]}.get(given, [])
    env = dict(env, STUB_SRUN=mode, STUB_SCANCEL_FAILS=str(scancel_fails), **SLURM_ENV,
               **({"CHECKPOINT_DIR": str(folder)} if given == "env" else {}))
    script = ROOT / "scripts/slurm.sbatch"
    if given == "SCRIPT_ARGS":  # as a user edits the block that the header invites them to
        text = script.read_text()
        assert text.count('--checkpoint-dir "$CHECKPOINT_DIR"') == 1
        script = tmp_path / "slurm.sbatch"
        script.write_text(text.replace('--checkpoint-dir "$CHECKPOINT_DIR"', f"--checkpoint-dir {folder}"))
    batch = subprocess.Popen(["bash", script, *extra], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pid_file = env["STUB_LOG"] + ".srun_pid"
        deadline = time.time() + 30
        while not os.path.exists(pid_file) and time.time() < deadline:
            time.sleep(0.1)
        assert os.path.exists(pid_file), "srun never started"
        batch.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 does
        if scancel_fails == 3:  # the step never told: at the time limit Slurm kills it
            while sum(c["cmd"] == "scancel" for c in calls()) < 3 and time.time() < deadline + 30:
                time.sleep(0.1)
            time.sleep(0.5)
            with open(pid_file) as f:
                os.kill(int(f.read()), signal.SIGKILL)
        output, _ = batch.communicate(timeout=30)
    finally:
        batch.kill()
    assert "time limit near" in output
    # The step gets SIGTERM (not srun, which would SIGKILL it); once it has ended, the requeue,
    # but only when the stop checkpoint was written: a training that crashed fails visibly.
    stop = [*[("scancel", ["--signal=TERM", "4242"])] * min(scancel_fails + 1, 3), ("srun ended", [])]
    if scancel_fails == 3:
        assert "failed 3 times" in output and "did not write its stop checkpoint (exit status 137)" in output, output
        assert batch.returncode == 1 and [(c["cmd"], c["argv"]) for c in calls()][3:] == stop[:3], output
    elif checkpoints is True:
        assert batch.returncode == 0, output
        assert [(c["cmd"], c["argv"]) for c in calls()][3:] == [*stop, ("scontrol", ["requeue", "4242"])]
        assert os.listdir(folder) == ["checkpoint.pt"]  # and nothing of the batch script's
        assert not (tmp_path / "checkpoints").exists()  # nothing looked for (or left) in the default
    else:
        # srun's own status, though it ended while the trap ran (torchrun's: 1), not the interrupted wait's
        assert batch.returncode == 1 and "did not write its stop checkpoint (exit status 1)" in output, output
        assert sorted(os.listdir(folder) if folder.exists() else []) == (["checkpoint.pt"] if checkpoints else [])
        assert [(c["cmd"], c["argv"]) for c in calls()][3:] == stop


@pytest.mark.parametrize("resume", [["--resume", "/elsewhere/checkpoint.pt"], ["--resume=/elsewhere/checkpoint.pt"]])
def test_slurm_refuses_a_resume_path(stubs, tmp_path, resume):
    # Every start passes --resume, so that a requeued job continues its own checkpoint; a PATH
    # would send every requeue back to it.
    env, calls = stubs
    proc = launch("scripts/slurm.sbatch", dict(env, CHECKPOINT_DIR=str(tmp_path)), "--epochs", "3", *resume,
                  **SLURM_ENV)
    assert_one_line_error(proc, "--resume /elsewhere/checkpoint.pt", "--checkpoint-dir FOLDER")
    assert calls() == []  # nothing started


def test_single_node_launcher_counts_cpu_processes_for_device_cpu(stubs, tmp_path):
    env, calls = stubs
    # In SCRIPT_ARGS too: a copy (in tmp_path/scripts) with --device cpu edited into that block, as a user would.
    (tmp_path / "scripts").mkdir()
    text = (ROOT / "scripts/launch_single_node.sh").read_text()
    assert text.count("SCRIPT_ARGS=(") == 1
    (tmp_path / "scripts/launch_single_node.sh").write_text(text.replace("SCRIPT_ARGS=(", "SCRIPT_ARGS=(--device cpu "))
    for root, args, gpus, nproc in ((ROOT, ["--epochs", "3"], "4", "4"), (ROOT, ["--device", "cpu"], "4", "2"),
                                    (ROOT, ["--device=cpu"], "4", "2"), (ROOT, [], "0", "2"), (tmp_path, [], "4", "2")):
        proc = launch(str(root / "scripts/launch_single_node.sh"), dict(env, STUB_GPUS=gpus), *args)
        assert proc.returncode == 0, proc.stderr
        launcher, script, script_args = script_and_args(calls()[-1]["argv"])
        assert f"--nproc_per_node={nproc}" in launcher, (args, launcher)
        # No GPU: the CPU, not whatever --device auto would take (a Mac's GPU, which DDP cannot use).
        assert ("--device" in script_args) == (nproc == "2"), script_args


# --- mp.spawn --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, expected", [
    ("single", []),
    ("multi", ["--nodes", "2", "--node-rank", "1", "--ip", "10.1.2.3", "--port", "29500"]),
    ("file", ["--nodes", "2", "--node-rank", "1", "--init-method", "file:///shared/path/rdzv.cifar100-ddp"]),
])
def test_mp_spawn_launcher_command(stubs, script_help, mode, expected):
    env, calls = stubs
    proc = launch("scripts/launch_mp_spawn.sh", env, "--epochs", "3", MODE=mode, NODE_RANK="1",
                  HEAD="10.1.2.3", NPROC_PER_NODE="4", JOB_ID="cifar100-ddp")
    assert proc.returncode == 0, proc.stderr
    [call] = calls()
    launcher, script, args = script_and_args(call["argv"])
    assert launcher == [] and script == "distributed_mp.py"
    assert args[:2] == ["--nproc-per-node", "4"] and args[2:2 + len(expected)] == expected, args
    assert args[-2:] == ["--epochs", "3"]
    assert_flags_accepted(script, args, script_help)


def test_mp_spawn_launcher_as_it_comes(stubs):
    """No settings at all: the script picks its process count, the processes meet locally."""
    env, calls = stubs
    proc = launch("scripts/launch_mp_spawn.sh", env)
    assert proc.returncode == 0, proc.stderr
    [call] = calls()
    launcher, script, args = script_and_args(call["argv"])
    assert script == "distributed_mp.py" and args[:2] == ["--batch-size", "128"], args
    assert not {"--nproc-per-node", "--nodes", "--ip", "--init-method"} & set(args), args


def test_mp_spawn_launcher_meets_in_a_file_named_for_the_job(stubs):
    """MODE=file: a file left by an earlier job would end or mix the next, so no name is shared by default."""
    env, calls = stubs
    proc = launch("scripts/launch_mp_spawn.sh", env, MODE="file")
    assert proc.returncode == 2 and "MODE=file needs JOB_ID" in proc.stderr and calls() == []
    assert launch("scripts/launch_mp_spawn.sh", env, MODE="file", SLURM_JOB_ID="4242").returncode == 0
    assert "file:///shared/path/rdzv.4242" in calls()[-1]["argv"]


def test_mp_spawn_launcher_rejects_an_unknown_mode(stubs):
    env, calls = stubs
    proc = launch("scripts/launch_mp_spawn.sh", env, MODE="ssh")
    assert proc.returncode == 2 and "MODE must be single, multi or file" in proc.stderr
    assert calls() == []
