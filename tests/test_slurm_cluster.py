"""scripts/slurm.sbatch on a real Slurm cluster, brought up on this machine by
scripts/slurm_dev_cluster.sh: two nodes, each a host of scripts/netns_hosts.py with its
own address and a slurmd (one node, this machine, where network namespaces are not
available). A plain job completes, and a time-limit stop (the batch shell's USR1 trap,
`scancel --signal`) checkpoints, requeues, resumes and ends with the same weights as an
uninterrupted run. Skipped where Slurm is not installed (install it with
`bash scripts/slurm_dev_cluster.sh install`) or without root."""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, free_port, subprocess_env, torchrun
from utils import checkpoint

sys.path.insert(0, str(ROOT / "scripts"))
import netns_hosts  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (shutil.which("slurmctld") and shutil.which("sbatch") and shutil.which("munged")) or os.geteuid() != 0,
    reason="Slurm is not installed (bash scripts/slurm_dev_cluster.sh install), or not root")

TINY = ["--dataset", "synthetic", "--model", "resnet_tiny", "--test-samples", "64", "--batch-size", "32",
        "--workers", "2", "--epochs", "1", "--checkpoint-every", "2", "--dist-timeout", "120"]


class Cluster(dict):
    """The cluster's environment (SLURM_CONF...); `slurm(argv)` runs one of Slurm's commands
    where the controller is reached: on the first host, or here for the one-node cluster."""

    def __init__(self, env, hosts=None):
        super().__init__(env)
        self.hosts = hosts
        self.nodes = len(hosts.names) if hosts else 1

    def slurm(self, argv, env=None, timeout=60, check=False):
        env = dict(self, **(env or {}))
        if self.hosts is None:
            return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                                  check=check)
        proc = self.hosts.run(self.hosts.names[0], argv, timeout=timeout, env=env, cwd=ROOT)
        if check and proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, SLURM_DEV_DIR=str(state), SLURM_DEV_PORT=str(free_port()))
    hosts = None
    if netns_hosts.unavailable_reason() is None:  # two nodes at their own addresses
        hosts = netns_hosts.Hosts(("nodea", "nodeb"))
        hosts.up()
        env["SLURM_DEV_HOSTS"] = ",".join(f"{n}:{hosts.address(n)}:{hosts.namespace(n)}" for n in hosts.names)
    try:
        started = subprocess.run(["bash", "scripts/slurm_dev_cluster.sh", "start"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr
        conf = re.search(r"SLURM_CONF=(\S+)", started.stdout).group(1)
        yield Cluster(dict(env, SLURM_CONF=conf), hosts)
    finally:
        subprocess.run(["bash", "scripts/slurm_dev_cluster.sh", "stop"], cwd=ROOT, env=env, timeout=60)
        if hosts is not None:
            hosts.down()


def batch_script(tmp_path, nodes):
    """slurm.sbatch edited as a user would for this cluster: its nodes, no GPUs, 2 processes in all."""
    text = (ROOT / "scripts/slurm.sbatch").read_text()
    text = text.replace("#SBATCH --nodes=2", f"#SBATCH --nodes={nodes}")
    text = re.sub(r"^#SBATCH --gpus-per-node=.*\n", "", text, flags=re.M)
    text = re.sub(r"^#SBATCH --cpus-per-task=.*$", "#SBATCH --cpus-per-task=1", text, flags=re.M)
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    return path


def submit(cluster, tmp_path, args, *sbatch_options, folder_by_flag=False):
    """folder_by_flag: the checkpoint folder named by --checkpoint-dir among the training's
    flags, as a user passes it, rather than by the batch script's CHECKPOINT_DIR."""
    env = subprocess_env(PYTHON=sys.executable, GPUS_PER_NODE=str(2 // cluster.nodes))
    if folder_by_flag:
        env.pop("CHECKPOINT_DIR", None)
    else:
        env["CHECKPOINT_DIR"] = str(tmp_path / "ck")
    env["SLURM_CONF"] = cluster["SLURM_CONF"]
    proc = cluster.slurm(["sbatch", "--parsable", f"--output={tmp_path}/job-%j.out", *sbatch_options,
                          str(batch_script(tmp_path, cluster.nodes)), *args], env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_state(cluster, job):
    out = cluster.slurm(["scontrol", "show", "job", job]).stdout
    match = re.search(r"JobState=(\S+)", out)
    return match.group(1) if match else "GONE"


def wait_for(cluster, job, states, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = job_state(cluster, job)
        if state in states:
            return state
        time.sleep(1)
    cluster.slurm(["scancel", job])
    raise AssertionError(f"job {job} still {job_state(cluster, job)} after {timeout} s")


def test_a_plain_job_completes(cluster, tmp_path):
    job = submit(cluster, tmp_path, [*TINY, "--train-samples", "256"])
    assert wait_for(cluster, job, {"COMPLETED", "FAILED", "CANCELLED"}, 300) == "COMPLETED", \
        (tmp_path / f"job-{job}.out").read_text()
    log = (tmp_path / f"job-{job}.out").read_text()
    assert "done: 8 steps" in log, log
    if cluster.nodes == 2:  # one torchrun on each host, each deciding for itself
        assert "torchrun_bounded.py on nodea: --local_addr=nodea" in log, log  # the head, named as sbatch names it
        assert "torchrun_bounded.py on nodeb: --local_addr=10.231." in log, log  # its address toward the head


def test_a_cancelled_job_saves_its_stop_checkpoint(cluster, tmp_path):
    """scancel JOB, as a preemption ends a job: SIGTERM to every process of its steps, the batch shell and
    srun included, then SIGKILL KillWait (30 s) later. The ranks still agree on a step and save it. No
    periodic checkpoint here: the one there is is the stop's (the job's log ends before its line)."""
    args = [*TINY, "--train-samples", "8192", "--checkpoint-every", "1000"]  # 256 steps, no periodic save
    job = submit(cluster, tmp_path, [*args, "--checkpoint-dir", str(tmp_path / "ck")], folder_by_flag=True)
    ckpt, lock = tmp_path / "ck" / "checkpoint.pt", tmp_path / "ck" / ".lock"
    deadline = time.time() + 240
    while not lock.exists():  # the run has started
        assert time.time() < deadline and job_state(cluster, job) in {"PENDING", "RUNNING"}, \
            (tmp_path / f"job-{job}.out").read_text()
        time.sleep(0.5)
    time.sleep(3)  # past the start, into the steps
    cluster.slurm(["scancel", job], check=True)
    deadline = time.time() + 45
    while not ckpt.exists() and time.time() < deadline:
        time.sleep(0.5)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert ckpt.exists(), log
    step = checkpoint.load(ckpt)["global_step"]
    assert step % 10 == 0 and 0 < step < 256, (step, log)  # an agreed stop step, before the end


def test_time_limit_stop_requeues_resumes_and_ends_with_the_same_weights(cluster, tmp_path):
    args = [*TINY, "--train-samples", "4096"]  # 128 steps: the stop lands well before the end
    # The folder given as users give it, among the training's flags: the batch script must look
    # for the stop checkpoint there (it once looked in checkpoints/JOB_ID, and did not requeue).
    job = submit(cluster, tmp_path, [*args, "--checkpoint-dir", str(tmp_path / "ck")], folder_by_flag=True)
    ckpt = tmp_path / "ck" / "checkpoint.pt"
    deadline = time.time() + 240
    while not ckpt.exists():
        assert time.time() < deadline and job_state(cluster, job) in {"PENDING", "RUNNING"}, \
            (tmp_path / f"job-{job}.out").read_text()
        time.sleep(0.5)
    # What --signal=B:USR1@120 does before the time limit: USR1 to the batch shell alone.
    cluster.slurm(["scancel", "--signal=USR1", "--batch", job], check=True)
    assert wait_for(cluster, job, {"COMPLETED", "FAILED", "CANCELLED"}, 480) == "COMPLETED", \
        (tmp_path / f"job-{job}.out").read_text()
    log = (tmp_path / f"job-{job}.out").read_text()
    assert "time limit near" in log and "stopping at step" in log and "resumed from" in log, log
    assert "done: 128 steps" in log, log
    assert not (ROOT / "checkpoints" / job).exists()  # nothing written where nobody looks

    reference = tmp_path / "reference"
    torchrun(2, "distributed.py", [*args, "--checkpoint-dir", reference], timeout=300)
    got, want = checkpoint.load(ckpt), checkpoint.load(reference / "checkpoint.pt")
    assert got["global_step"] == want["global_step"] == 128
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
