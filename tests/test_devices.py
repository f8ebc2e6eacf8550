"""Which device a rank trains on: torch.accelerator picks this machine's accelerator,
whoever made it, and --device can force the CPU. The machines are stood in for
(conftest.fake_accelerator): nothing here runs on an accelerator; the GPU-marked tests
do that on CUDA."""
import pytest
import torch
import torch.distributed as dist

import dataparallel
import distributed
import distributed_apex
import distributed_mp
from conftest import SMALL, assert_refused, fake_accelerator
from utils import cli, distributed as dist_utils, lifecycle, metrics


@pytest.mark.parametrize("kind, count, local_rank, expected", [
    (None, 0, 0, torch.device("cpu")),        # no accelerator: the CPU, any number of processes
    ("cuda", 4, 2, torch.device("cuda", 2)),  # NVIDIA, or AMD under ROCm: one GPU per process
    ("xpu", 2, 1, torch.device("xpu", 1)),    # Intel GPUs
    ("mps", 1, 0, torch.device("mps", 0)),    # Apple silicon, one process
])
def test_auto_picks_the_accelerator_and_this_ranks_device(monkeypatch, kind, count, local_rank, expected):
    fake_accelerator(monkeypatch, kind, count)
    assert dist_utils.pick_device(local_rank, max(count, 1)) == expected


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_device_cpu_trains_on_the_cpu_beside_an_accelerator(monkeypatch, kind):
    fake_accelerator(monkeypatch, kind, 8)
    assert dist_utils.pick_device(0, 16, "cpu", distributed=True) == torch.device("cpu")
    # distributed_mp.py's default --nproc-per-node: 2 CPU processes, or one per device (none on MPS: refused)
    from utils import spawn
    for choice, processes in (("cpu", 2), ("auto", 8))[:1 if kind == "mps" else 2]:
        parser = cli.build_parser("", ["resnet18"])
        spawn.add_flags(parser)
        args = cli.parse_args(parser, ["--device", choice])
        assert spawn.check_launch(args) == processes == args.nproc_per_node


@pytest.mark.parametrize("kind, choice, fragment", [
    (None, "cuda", "--device cuda: PyTorch sees no accelerator on this machine"),
    ("cuda", "xpu", "--device xpu: this machine's accelerator is cuda: use --device cuda, cpu, or auto"),
    ("xpu", "tpu", "this machine's accelerator is xpu"),
])
def test_a_device_this_machine_lacks_is_refused(monkeypatch, kind, choice, fragment):
    fake_accelerator(monkeypatch, kind, 2)
    with pytest.raises(cli.UsageError, match=fragment):
        dist_utils.pick_device(0, 1, choice)


@pytest.mark.parametrize("kind, count, processes, fragment", [
    ("cuda", 2, 4, "only 2 GPUs visible"), ("cuda", 1, 2, "only 1 GPU visible"),
    ("xpu", 1, 2, "only 1 GPU visible"),
])
def test_more_processes_than_devices_is_a_usage_error(monkeypatch, kind, count, processes, fragment):
    fake_accelerator(monkeypatch, kind, count)
    with pytest.raises(cli.UsageError) as excinfo:
        dist_utils.pick_device(0, processes, distributed=True)
    message = str(excinfo.value)
    assert f"{processes} processes per node" in message and fragment in message
    assert f"--nproc_per_node={count}" in message and "--device cpu" in message


def test_mps_trains_one_process_and_refuses_a_process_group(monkeypatch):
    fake_accelerator(monkeypatch, "mps", 1)
    assert dist_utils.pick_device(0, 1) == torch.device("mps", 0)
    with pytest.raises(cli.UsageError, match="DDP does not run on Apple's MPS"):
        dist_utils.pick_device(0, 1, distributed=True)  # even one process under torchrun joins a group


@pytest.mark.parametrize("kind, backend", [(None, "gloo"), ("cuda", "nccl"), ("xpu", "xccl")])
def test_setup_binds_the_group_to_the_ranks_device(monkeypatch, tmp_path, kind, backend):
    """The backend PyTorch names for the device, and device_id on accelerators, so that
    NCCL (and XCCL) connect at init_process_group, where a broken setup should fail."""
    fake_accelerator(monkeypatch, kind, 2)
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append((backend, kwargs)))
    monkeypatch.setattr(dist, "rendezvous", lambda *args, **kwargs: iter([(dist.HashStore(), 1, 2)]))
    monkeypatch.setattr(lifecycle, "watch_launcher", lambda: None)
    monkeypatch.setattr(lifecycle, "_joined_a_group", False)  # put back afterwards: nothing joined here
    monkeypatch.setattr(lifecycle, "_job", None)
    monkeypatch.setattr(dist_utils, "_store", None)  # setup keeps the stand-in store for agreements
    # file://: no store to wait for (tcp://, rank 1 would wait until one answers at the address)
    job = dist_utils.DistEnv(1, 1, 2, 2, distributed=True, init_method=f"file://{tmp_path}/rendezvous")
    env = dist_utils.setup(job, dist_utils.pick_device(1, 2, distributed=True))
    (used, kwargs), = calls
    assert used == backend == dist.get_default_backend_for_device(env.device)
    if kind is None:
        assert env.device == torch.device("cpu") and kwargs["device_id"] is None and env.device_ids is None
    else:
        assert env.device == torch.device(kind, 1) == kwargs["device_id"] and env.device_ids == [1]


LAUNCHED = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.mark.parametrize("module", [distributed, distributed_apex, distributed_mp])
def test_ddp_scripts_on_mps_refuse_several_processes_in_one_line(monkeypatch, capsys, module):
    fake_accelerator(monkeypatch, "mps", 1)
    if module is not distributed_mp:
        for key, value in LAUNCHED.items():
            monkeypatch.setenv(key, value)  # as torchrun starts a rank
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("joined a group"))
    monkeypatch.setattr(distributed_mp.mp, "spawn", lambda *a, **k: pytest.fail("started workers"))
    with pytest.raises(SystemExit) as exit_info:
        lifecycle.run_main(module.main, [*map(str, SMALL), "--nproc-per-node", "2"] if module is distributed_mp
                     else list(map(str, SMALL)))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "DDP does not run on Apple's MPS" in lines[0], lines


def test_dataparallel_is_cuda_only(monkeypatch):
    fake_accelerator(monkeypatch, "cuda", 2)
    assert dataparallel.pick_gpus(None) == [0, 1]
    assert dataparallel.pick_gpus(None, "cpu") == []  # --device cpu beside GPUs
    with pytest.raises(cli.UsageError, match="--gpus with --device cpu"):
        dataparallel.pick_gpus([0], "cpu")
    fake_accelerator(monkeypatch, "xpu", 2)
    assert dataparallel.pick_gpus(None) == []  # auto: no CUDA GPU, the CPU
    with pytest.raises(cli.UsageError, match="DataParallel runs on CUDA GPUs only"):
        dataparallel.pick_gpus(None, "xpu")


def test_dataparallel_refuses_a_batch_that_the_gpus_would_share_unevenly(monkeypatch, run_in_process):
    """130 over 4 GPUs would be chunks of 33, 33, 33 and 31: refused, as DDP's 4 processes refuse it."""
    fake_accelerator(monkeypatch, "cuda", 4)
    assert_refused(run_in_process("dataparallel.py", [*SMALL, "--batch-size", "130", "--check-args"]),
                   "batch size 130 is not divisible by 4 GPUs")
    assert run_in_process("dataparallel.py", [*SMALL, "--batch-size", "132", "--check-args"])[0] == 0
    assert run_in_process("dataparallel.py", [*SMALL, "--gpus", "0,1,2", "--batch-size", "132",
                                              "--check-args"])[0] == 0


def test_asking_for_a_gpu_on_a_machine_without_one_is_one_line(run_in_process):
    assert_refused(run_in_process("distributed.py", [*SMALL, "--device", "cuda"]),
                   "--device cuda: PyTorch sees no accelerator", "--device cpu")


def test_peak_memory_is_read_through_torch_accelerator(monkeypatch):
    assert metrics.peak_memory_mb(torch.device("cpu")) == {"peak_memory_mb": None, "peak_reserved_mb": None}
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda device=None: 3 * 2**20)
    monkeypatch.setattr(torch.accelerator, "max_memory_reserved", lambda device=None: 5 * 2**20)
    assert metrics.peak_memory_mb(torch.device("xpu", 0)) == {"peak_memory_mb": 3.0, "peak_reserved_mb": 5.0}

    def unsupported(device=None):
        raise RuntimeError("no memory statistics on this device")
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", unsupported)
    assert metrics.peak_memory_mb(torch.device("mps", 0))["peak_memory_mb"] is None


def test_a_device_index_is_refused_each_rank_takes_its_own(monkeypatch):
    fake_accelerator(monkeypatch, "cuda", 2)
    with pytest.raises(cli.UsageError, match=r"--device cuda:0: name the type alone \(--device cuda\)"):
        dist_utils.pick_device(0, 1, "cuda:0")


def test_a_cpu_run_beside_a_gpu_leaves_the_gpu_alone(monkeypatch):
    """--device cpu on a GPU machine: the checkpoint's random state must not read the GPU's
    generators, which would start CUDA (and take memory) on every GPU in every rank."""
    from utils import checkpoint
    fake_accelerator(monkeypatch, "cuda", 2)

    def touched(*args):
        raise AssertionError("the GPU's generators were read")
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", touched)
    for name in ("get_rng_state_all", "set_rng_state_all", "get_rng_state", "set_rng_state"):
        monkeypatch.setattr(torch.cuda, name, touched)
    state = checkpoint.rng_state(torch.device("cpu"))
    assert "cuda" not in state
    checkpoint.set_rng_state(dict(state, cuda=[torch.zeros(1)], cuda_own=torch.zeros(1)), torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: ["saved"])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: "own")
    state = checkpoint.rng_state(torch.device("cuda", 0))  # a GPU run keeps them
    assert state["cuda"] == ["saved"] and state["cuda_own"] == "own"


def test_a_resume_gives_each_rank_its_own_gpu_generator_as_it_was(monkeypatch):
    """Two DDP ranks on a two-GPU machine, each drawing on its own GPU (dropout) from the same seed.
    Rank 0 alone saves; each process sees both GPUs. Rank 1's GPU must come back as rank 1 left it,
    not as rank 0's never-used copy of GPU 1. The GPUs' generators are stood in for by CPU ones."""
    from utils import checkpoint
    fake_accelerator(monkeypatch, "cuda", 2)

    def rank_process():  # the default generator of each GPU this process sees, seeded alike
        return [torch.Generator().manual_seed(5) for _ in range(2)]
    ranks = [rank_process(), rank_process()]
    in_use = ranks[0]
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [g.get_state() for g in in_use])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: in_use[device.index].get_state())
    monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                        lambda states: [g.set_state(s) for g, s in zip(in_use, states)])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: in_use[device.index].set_state(state))
    for rank, generators in enumerate(ranks):
        torch.rand(7, generator=generators[rank])  # the steps before the stop
    saved = checkpoint.rng_state(torch.device("cuda", 0))  # rank 0's checkpoint
    expected = [torch.rand(3, generator=generators[rank]) for rank, generators in enumerate(ranks)]

    ranks = [rank_process(), rank_process()]  # the resumed job's processes
    for rank in range(2):
        in_use = ranks[rank]
        checkpoint.set_rng_state(saved, torch.device("cuda", rank))
        assert torch.equal(torch.rand(3, generator=ranks[rank][rank]), expected[rank]), f"rank {rank}"


def test_a_resume_on_mps_gives_its_generator_back(monkeypatch):
    """torch.mps has get_rng_state and set_rng_state, not their _all forms: its generator is saved
    all the same (a model that draws on the device, dropout, resumes bitwise). Stood in for by a CPU one."""
    from utils import checkpoint
    fake_accelerator(monkeypatch, "mps", 1)
    generator = torch.Generator().manual_seed(5)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda device: generator.get_state())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state, device: generator.set_state(state))
    assert not hasattr(torch.mps, "get_rng_state_all")  # as in PyTorch 2.11 and 2.14
    torch.rand(7, generator=generator)
    saved = checkpoint.rng_state(torch.device("mps", 0))
    expected = torch.rand(3, generator=generator)
    generator.manual_seed(5)  # the resumed process
    checkpoint.set_rng_state(saved, torch.device("mps", 0))
    assert torch.equal(torch.rand(3, generator=generator), expected)


def test_running_sums_are_float32_on_mps_which_has_no_float64():
    assert metrics.sum_dtype(torch.device("mps", 0)) == torch.float32
    assert metrics.sum_dtype(torch.device("cuda", 0)) == metrics.sum_dtype("cpu") == torch.float64


def test_torchrun_virtual_local_rank_gives_each_worker_its_own_gpu(monkeypatch):
    """torchrun --virtual-local-rank: each worker sees one GPU (CUDA_VISIBLE_DEVICES narrowed
    to it) with LOCAL_RANK=0, while LOCAL_WORLD_SIZE stays the node's process count."""
    fake_accelerator(monkeypatch, "cuda", 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert dist_utils.pick_device(0, 4, distributed=True) == torch.device("cuda", 0)


def test_check_args_refuses_two_processes_on_one_visible_gpu_as_the_run_does(monkeypatch):
    """--check-args runs as the node's local rank 0 in the node's settings, before the launcher narrows
    CUDA_VISIBLE_DEVICES: one GPU visible there is one for the whole node, and its local rank 1 refuses."""
    fake_accelerator(monkeypatch, "cuda", 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    for key, value in dict(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2).items():
        monkeypatch.setenv(key, str(value))
    with pytest.raises(cli.UsageError, match="2 processes per node but only 1 GPU visible"):
        dist_utils.check_job(dist_utils.job_from_env(check_only=True), check_only=True)
    with pytest.raises(cli.UsageError, match="local rank 1 of 2 processes per node has no device"):
        dist_utils.pick_device(1, 2, distributed=True)  # what the run's rank 1 says


def test_a_launch_by_hand_without_local_world_size_is_told_to_set_it(monkeypatch):
    """RANK, WORLD_SIZE and LOCAL_RANK set by hand (from srun's variables, say), on 2 nodes of one GPU: without
    LOCAL_WORLD_SIZE every process is taken to be on this node, and the fix is that variable, not torchrun's flag."""
    fake_accelerator(monkeypatch, "cuda", 1)
    for key, value in dict(RANK=1, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="10.0.0.1", MASTER_PORT=29500).items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(cli.UsageError, match="2 processes per node but only 1 GPU visible: set LOCAL_WORLD_SIZE"):
        dist_utils.check_job(dist_utils.job_from_env(), check_only=True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert dist_utils.check_job(dist_utils.job_from_env(), check_only=True) == torch.device("cuda", 0)
    # mp.spawn under an exported WORLD_SIZE (a Kubeflow job's): its own count, its own fix.
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(cli.UsageError, match="visible: use --nproc_per_node=1 or fewer"):
        dist_utils.pick_device(0, 2, distributed=True)


def test_without_virtual_local_rank_a_second_process_on_one_gpu_refuses_and_says_so(monkeypatch, capsys):
    """2 processes with one GPU visible: local rank 1 has no device. Its line is printed by
    that rank (not only rank 0 prints), with exit status 2."""
    fake_accelerator(monkeypatch, "cuda", 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(cli.UsageError) as excinfo:
        dist_utils.pick_device(1, 2, distributed=True)
    assert excinfo.value.met_by == "rank" and "only 1 GPU visible" in str(excinfo.value)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def main(argv):
        dist_utils.pick_device(1, 2, distributed=True)
    with pytest.raises(SystemExit) as exited:
        lifecycle.run_main(main, argv=[])
    assert exited.value.code == 2
    assert "local rank 1 of 2 processes per node has no device" in capsys.readouterr().err
