"""Every flag of every script, alone and in the pairs users combine: it works, or it is
refused in one line with exit status 2 before anything trains, and --check-args refuses
it with the very same line (the same code: each script's check()).

The flags come from each script's own argparse parser, so a flag added later without an
entry in CASES fails test_flag ("no entry"). An entry is one or more of:

- Works(argv, expect): the script runs in this process with the flag added to its tiny
  BASE command line, and `expect` asserts what the flag did: a value in the metrics record
  or the checkpoint, a file it wrote, a layout or a collective it changed. A flag that
  was parsed and then ignored fails there.
- Refused(argv, fragment): `--check-args` and the run itself both exit with status 2 and
  print the same one line (holding `fragment`), and the run trained nothing.
- Elsewhere(test): what needs several processes or a GPU is shown by that test, which
  must exist; the flag's item here is then skipped, naming it (it checks nothing itself).

The scripts run in this process (about 0.1 s each) with the machine's GPUs hidden
(conftest.keep_on_cpu). distributed_mp.py's processes are started inline, one after the
other, by a stand-in for mp.spawn (its real launches are tests/test_distributed_mp.py's).
--compile runs torch.compile with dynamo's eager backend: inductor needs 40 s on this
2-core CPU to compile the tiny model (tests/test_gpu_scripts.py compiles with inductor on
a GPU). One real torchrun launch (2 processes) covers what needs several processes here:
a sharded bf16 checkpoint resumed at another number of processes, with --channels-last.
"""
import gc
import importlib
import io
import json
import os
import re
import signal
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

import test_gpu_scripts
from cifar_files import dump_as_python2, write_cifar100
from conftest import ROOT, free_port, freeze_the_imports, keep_on_cpu, read_metrics, torchrun
from scripts import compare_models
from utils import checkpoint, data, lifecycle
from utils.run import TrainingRun

SCRIPTS = ["distributed.py", "distributed_mp.py", "dataparallel.py", "distributed_apex.py",
           "distributed_gradient_accumulation.py", "distributed_fsdp.py"]
# Two optimizer steps of 8 images, 8 test images: every run ends in about a tenth of a second.
BASE = ["--dataset", "synthetic", "--model", "resnet_tiny", "--train-samples", "16", "--test-samples", "8",
        "--batch-size", "8", "--workers", "0", "--epochs", "1", "--max-steps", "2"]
EXTRA_BASE = {"distributed_mp.py": ["--nproc-per-node", "1"]}  # processes run inline, one at a time
FLAG = object()  # in an entry's argv: the option string under test (an entry serves all its spellings)
# Works(env=...): one process as a launcher starts it (MASTER_PORT is added, free): torch.distributed.launch
# sets no LOCAL_RANK (it passes --local-rank), torchrun sets it.
LAUNCH_OF_ONE = {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1"}
TORCHRUN_OF_ONE = dict(LAUNCH_OF_ONE, LOCAL_RANK=0)


# --- entries --------------------------------------------------------------------------------

@dataclass
class Works:
    argv: list
    expect: Callable  # expect(result) asserts what the flag did
    first: list = None  # argv of a run made before this one (the same script, the same folder)
    env: dict = None
    tty: bool = False  # stderr a terminal (the progress bar)


@dataclass
class Refused:
    argv: list
    fragment: str


@dataclass
class Elsewhere:
    test: str  # tests/FILE.py::NAME


def loss_differs(result):
    """The training loss is not that of the script's BASE run: the flag changed the arithmetic."""
    assert result.last["train_loss"] != result.baseline["train_loss"]


def optimizer_group(result):
    return result.state()["optimizer"]["param_groups"][0]


# Flags every script has (utils/cli.py), with what shows that each did its work.
COMMON = {
    ("-h", "--help"): [Works([FLAG], lambda r: ("usage:" in r.stdout and "--batch-size" in r.stdout
                                                 and "(default: None)" not in r.stdout and r.records == []))],
    ("--dataset",): [
        # 7 classes in the files' meta: a test loss near log(7) = 1.9, not log(100) = 4.6.
        Works([FLAG, "cifar100", "--data-dir", "{cifar}"], lambda r: r.last["test_loss"] < 3),
        Refused([FLAG, "imagenet"], "invalid choice"),
    ],
    ("--data-dir", "--data_dir"): [
        Works(["--dataset", "cifar100", FLAG, "{cifar}"], lambda r: r.last["test_loss"] < 3),
        Refused([FLAG, "{cifar}"], "with --dataset synthetic, which is made in memory"),
    ],
    ("--train-samples",): [Works([FLAG, "24"], lambda r: r.last["epoch_complete"] is False)],  # 2 of 3 steps
    ("--test-samples",): [Works([FLAG, "5"], lambda r: r.last["test_samples"] == 5)],
    ("--workers",): [Works([FLAG, "1"], lambda r: r.worker_loaders > 0)],
    ("--model",): [Works([FLAG, "resnet_tiny", "--checkpoint-dir", "{tmp}/ck"],
                         lambda r: r.state()["model"]["fc.weight"].shape == (100, 64))],  # resnet18's is 512 wide
    ("--epochs",): [
        Works([FLAG, "2", "--max-steps", "3"], lambda r: r.records[-2]["epoch"] == 2),
        # x0.2 from step 6 of 20 (30%): each epoch's record gives the rate its last step trained at, not the next.
        Works([FLAG, "10", "--warmup-epochs", "0", "--max-steps", "8"],
              lambda r: [e["lr"] for e in r.records if e["event"] == "epoch"]
              == pytest.approx([0.1 * 8 / 128] * 3 + [0.02 * 8 / 128])),
    ],
    ("--batch-size", "--batch_size"): [
        Works([FLAG, "16", "--train-samples", "32"], lambda r: r.last["global_batch"] == 16),
        Refused([FLAG, "0"], "at least 1"),
    ],
    # --lr is per 128 images, scaled with the batch; no warm-up and a long schedule leave it as is.
    ("--lr",): [Works([FLAG, "0.05", "--warmup-epochs", "0", "--epochs", "10"],
                      lambda r: r.last["lr"] == pytest.approx(0.05 * 8 / 128))],
    ("--momentum",): [
        Works([FLAG, "0.5", "--checkpoint-dir", "{tmp}/ck"], lambda r: optimizer_group(r)["momentum"] == 0.5),
        Refused([FLAG, "0"], "--momentum 0 with Nesterov momentum"),
        Works([FLAG, "0", "--no-nesterov", "--checkpoint-dir", "{tmp}/ck"],
              lambda r: optimizer_group(r)["momentum"] == 0),
    ],
    ("--nesterov",): [Works([FLAG, "--checkpoint-dir", "{tmp}/ck"], lambda r: optimizer_group(r)["nesterov"])],
    ("--no-nesterov",): [Works([FLAG, "--checkpoint-dir", "{tmp}/ck"],
                               lambda r: optimizer_group(r)["nesterov"] is False)],
    ("--weight-decay", "--weight_decay"): [Works([FLAG, "0.01", "--checkpoint-dir", "{tmp}/ck"],
                                                 lambda r: optimizer_group(r)["weight_decay"] == 0.01)],
    # 8 warm-up steps: the second step trains at 2/8 of the full rate.
    ("--warmup-epochs",): [Works([FLAG, "4", "--epochs", "10"],
                                 lambda r: r.last["lr"] == pytest.approx(0.1 * 8 / 128 * 2 / 8))],
    ("--seed",): [Works([FLAG, "1"], loss_differs)],
    ("--clip-grad-norm", "--clip-grad"): [Works([FLAG, "1"], lambda r: r.last["grad_norm"] > 0)],
    ("--max-steps",): [Works([FLAG, "1"], lambda r: r.last["step"] == 1)],
    ("--checkpoint-dir",): [
        # config.json: the resolved values, the layout chosen at run time (no --channels-last: NCHW on the CPU) too.
        Works([FLAG, "{tmp}/ck"], lambda r: r.state()["global_step"] == 2
              and json.loads((r.tmp / "ck" / "config.json").read_text()).get("channels_last", False) is False),
        Refused([FLAG, ""], "--checkpoint-dir is empty"),
    ],
    # Two commits of a checkpoint: step 1 (mid-epoch, the flag's) and step 2 (the run's end).
    ("--checkpoint-every",): [
        Works([FLAG, "1", "--checkpoint-dir", "{tmp}/ck"], lambda r: r.saves == 2),
        Refused([FLAG, "1"], "--checkpoint-every needs --checkpoint-dir"),
    ],
    ("--resume",): [
        Works([FLAG, "--checkpoint-dir", "{tmp}/ck"], first=["--checkpoint-dir", "{tmp}/ck", "--max-steps", "1"],
              expect=lambda r: "1 steps in all" in r.stdout and r.last["step"] == 2),
        Refused([FLAG], "--resume without a PATH needs --checkpoint-dir"),
    ],
    ("--metrics",): [Works([FLAG, "{tmp}/own.jsonl"],
                           lambda r: read_metrics(r.tmp / "own.jsonl")[-1]["event"] == "end")],
    # The progress bar (on a terminal only) shows the loss every N steps.
    ("--log-every",): [Works([FLAG, "1"], lambda r: "loss=" in r.stderr, tty=True)],
    ("--check-args",): [Works([FLAG], lambda r: "arguments OK for 1 process" in r.stdout and r.records == [])],
    ("--dist-timeout",): [
        Works([FLAG, "77"], lambda r: r.group_timeouts == [77], env=TORCHRUN_OF_ONE),
        Refused([FLAG, "1e10"], "must be 1 .. 31536000 (a year)"),  # c10d's nanoseconds would overflow
        Elsewhere("tests/test_missed_collective.py::test_the_waiting_rank_names_the_call_it_waited_in"),
    ],
    ("--device",): [
        Works([FLAG, "cpu"], lambda r: r.last["device"] == "cpu"),
        Refused([FLAG, "cuda"], "--device cuda"),  # the GPUs are hidden here
    ],
    ("--profile",): [Works([FLAG, "{tmp}/trace", "--train-samples", "64", "--max-steps", "8"],
                           lambda r: (r.tmp / "trace" / "trace-rank0.json").exists())],
    ("--tensorboard",): [Works([FLAG, "{tmp}/tb"], lambda r: any((r.tmp / "tb").glob("events.out.tfevents.*")))],
    ("--local-rank", "--local_rank"): [
        # Under torch.distributed.launch the flag is how a process learns its local rank.
        Works([FLAG, "0"], lambda r: r.local_rank_variable == "0" and r.last["step"] == 2, env=LAUNCH_OF_ONE),
        Refused([FLAG, "0"], "without RANK and WORLD_SIZE"),  # plain python: no launcher set it
    ],
}

# The DDP scripts' --sync-bn and --verify-sync (utils/replicas.py).
REPLICAS = {
    ("--sync-bn", "--sync_bn"): [Refused([FLAG], "--sync-bn needs GPUs"),
                                 Elsewhere("tests/test_gpu_scripts.py::test_sync_bn_on_cuda")],
    ("--verify-sync",): [Works([FLAG], lambda r: "verify-sync: a single process has nothing to compare" in r.stdout),
                         Elsewhere("tests/test_clip_grad.py::test_torchrun_two_processes_keep_the_replicas_equal_with_clipping")],
}

# The fast path (utils/cli.py's add_fast_path_flags).
FAST_PATH = {
    ("--data-on-gpu",): [Works([FLAG], lambda r: r.loader_iterations == 0 and r.last["test_samples"] == 8),
                         Refused([FLAG, "--workers", "2"], "--workers 2 with --data-on-gpu")],
    ("--channels-last",): [Works([FLAG], lambda r: r.layouts == {torch.channels_last})],
    # NCHW, the CPU's default too; the default on GPUs is test_data's test_the_default_layout_follows_the_gpu.
    ("--no-channels-last",): [Works([FLAG], lambda r: r.layouts == {torch.contiguous_format})],
    ("--compile",): [Works([FLAG], lambda r: r.compiled == ["default"] and r.compiled_calls >= r.steps > 0)],
    ("--compile-mode",): [Refused([FLAG, "max-autotune"], "add --compile"),
                          Works(["--compile", FLAG, "max-autotune-no-cudagraphs"],
                                lambda r: r.compiled == ["max-autotune-no-cudagraphs"])],
    # Epoch 1 is not evaluated (NaN), epoch 2, the last, is.
    ("--eval-every",): [Works([FLAG, "2", "--epochs", "3", "--max-steps", "4"],
                              lambda r: r.records[0]["test_samples"] == 0 and r.last["test_samples"] == 8)],
}

SCRIPT_FLAGS = {
    "dataparallel.py": {
        ("--gpus", "--gpu"): [Refused([FLAG, "0"], "asks for GPUs but none is visible"),
                              Elsewhere("tests/test_dataparallel.py::test_end_to_end_on_every_gpu")],
        ("--amp",): [Works([FLAG, "bf16"], lambda r: r.last["amp"] == "bf16" and loss_differs(r) is None)],
        ("--local-rank", "--local_rank"): [Refused([FLAG, "0"], "one process that no launcher starts")],
        ("--dist-timeout",): [Refused([FLAG, "60"], "joins no process group")],
        ("--device",): [Works([FLAG, "cpu"], lambda r: r.last["device"] == "cpu"),
                        Refused([FLAG, "cuda"], "no CUDA GPU is visible"),
                        Refused([FLAG, "xpu"], "DataParallel runs on CUDA GPUs only")],
    },
    "distributed_apex.py": {
        # The CPU's default is bf16: fp16 and float32 (O0) train other numbers.
        ("--amp",): [Works([FLAG, "fp16"], lambda r: r.last["amp"] == "fp16" and loss_differs(r) is None)],
        ("--amp-impl",): [Works([FLAG, "torch"], lambda r: r.last["amp_impl"] == "torch"),
                          # Without NVIDIA apex, or (with it) on a CPU: refused either way here.
                          Refused([FLAG, "apex"], "NVIDIA apex"),
                          Elsewhere("tests/test_apex.py::test_the_apex_amp_branch_of_the_loop")],
        ("--opt-level",): [Works([FLAG, "O0"], lambda r: r.last["amp"] == "fp32" and loss_differs(r) is None),
                           Refused([FLAG, "O3"], "has no torch.amp equivalent")],
    },
    "distributed_gradient_accumulation.py": {
        # 2 micro-batches of 4: batch norm normalises each alone, so the loss is another.
        ("--accum-steps", "--grad_accu_steps"): [
            Works([FLAG, "2"], lambda r: r.last["accum_steps"] == 2 and loss_differs(r) is None),
            Refused([FLAG, "3"], "not divisible by 1 process x 3 accumulation steps")],
    },
    "distributed_mp.py": {
        # Its processes always form a group, of 1 here.
        ("--verify-sync",): [Works([FLAG], lambda r: "verify-sync: all parameters and buffers agree across 1 ranks"
                                   in r.stdout)],
        ("--nproc-per-node", "--nproc_per_node"): [
            Works([FLAG, "1"], lambda r: "starting 1 process on node 0 of 1" in r.stdout),
            Refused([FLAG, "3"], "batch size 8 is not divisible by 3 processes"),
            Elsewhere("tests/test_distributed_mp.py::test_two_processes_on_one_node_through_a_shared_file")],
        ("--nodes",): [Works([FLAG, "1"], lambda r: "of 1 (world size 1)" in r.stdout),
                       Refused([FLAG, "2"], "needs --ip"),
                       Elsewhere("tests/test_hosts.py::test_mp_spawn_across_hosts_by_tcp_and_by_a_shared_file")],
        ("--node-rank", "--node_rank"): [Works([FLAG, "0"], lambda r: "on node 0 of 1" in r.stdout),
                                         Refused([FLAG, "1"], "node ranks go from 0 to 0"),
                                         Elsewhere("tests/test_hosts.py::test_mp_spawn_across_hosts_by_tcp_and_by_a_shared_file")],
        ("--ip",): [Works([FLAG, "127.0.0.1"], lambda r: "rendezvous at tcp://127.0.0.1:" in r.stdout),
                    Refused([FLAG, "192.0.2.1"], "is not an address of this machine"),
                    Refused([FLAG, "10.0.0..1"], "cannot resolve 10.0.0..1 (--ip)")],  # not idna's traceback
        ("--port",): [Works([FLAG, "{port}"], lambda r: f"rendezvous at tcp://127.0.0.1:{r.port}" in r.stdout),
                      Refused([FLAG, "70000"], "1 .. 65535")],
        ("--init-method", "--init_method"): [
            Works([FLAG, "file://{tmp}/rendezvous"], lambda r: f"rendezvous at file://{r.tmp}/rendezvous" in r.stdout),
            Refused([FLAG, "file://{tmp}/rendezvous", "--port", "{port}"], "leave out --ip and --port"),
            Refused([FLAG, "tcp://192.0.2.1:{port}"], "must run on the host that --init-method names"),
            Refused([FLAG, "tcp://node..a:{port}"], "cannot resolve node..a (--init-method)")],
        ("--local-rank", "--local_rank"): [Refused([FLAG, "0"], "starts and numbers its own processes")],
    },
    "distributed_fsdp.py": {
        # NHWC activations; the weights stay as fully_shard wants them (see distributed_fsdp.py).
        ("--channels-last",): [Works([FLAG], lambda r: r.layouts == {torch.channels_last})],
        ("--no-channels-last",): [Works([FLAG], lambda r: r.layouts == {torch.contiguous_format})],
        # What a residual stage holds once its forward is done (seen as the next stage starts):
        # its shards (ZeRO-3) or its gathered weights (ZeRO-2); the root stays gathered either way.
        ("--reshard-after-forward",): [Works([FLAG], lambda r: r.after_forward == {("layer1", "sharded"),
                                                                                   ("root", "whole")})],
        ("--no-reshard-after-forward",): [Works([FLAG], lambda r: r.after_forward == {("layer1", "whole"),
                                                                                      ("root", "whole")})],
        ("--mp-policy",): [Works([FLAG, "bf16"], lambda r: r.dtypes == {torch.bfloat16} and loss_differs(r) is None),
                           Elsewhere("tests/test_flags.py::test_fsdp_bf16_channels_last_resumed_at_another_world_size")],
    },
}

# The pairs users combine; each runs in every script that has both flags.
PAIRS = [
    (("--channels-last", "--clip-grad-norm"),
     Works(["--channels-last", "--clip-grad-norm", "1"], lambda r: r.layouts == {torch.channels_last}
           and r.last["grad_norm"] > 0)),
    (("--channels-last", "--data-on-gpu"),
     Works(["--channels-last", "--data-on-gpu"], lambda r: r.layouts == {torch.channels_last}
           and r.loader_iterations == 0)),
    (("--compile", "--channels-last"),
     Works(["--compile", "--channels-last"], lambda r: r.compiled == ["default"] and r.layouts == {torch.channels_last})),
    (("--compile", "--clip-grad-norm"),
     Works(["--compile", "--clip-grad-norm", "1"], lambda r: r.compiled == ["default"] and r.last["grad_norm"] > 0)),
    (("--compile", "--data-on-gpu"),
     Works(["--compile", "--data-on-gpu"], lambda r: r.compiled == ["default"] and r.loader_iterations == 0)),
    (("--compile", "--amp"),  # distributed_apex.py: autocast around the compiled model
     Works(["--compile", "--amp", "fp16"], lambda r: r.compiled == ["default"] and r.last["amp"] == "fp16")),
    (("--compile", "--sync-bn"), Refused(["--compile", "--sync-bn"], "--sync-bn needs GPUs")),
    (("--compile", "--eval-every"),
     Works(["--compile", "--eval-every", "2", "--epochs", "2", "--max-steps", "4"],
           lambda r: r.compiled == ["default"] and r.records[0]["test_samples"] == 0)),
    (("--data-on-gpu", "--amp"),  # distributed_apex.py: the batches come in the autocast dtype
     Works(["--data-on-gpu", "--amp", "bf16"], lambda r: r.loader_iterations == 0 and r.last["amp"] == "bf16")),
    (("--data-on-gpu", "--dataset"),
     Works(["--data-on-gpu", "--dataset", "cifar100", "--data-dir", "{cifar}"],
           lambda r: r.loader_iterations == 0 and r.last["test_loss"] < 3)),
    (("--amp", "--clip-grad-norm"),
     Works(["--amp", "fp16", "--clip-grad-norm", "1"], lambda r: r.last["amp"] == "fp16" and r.last["grad_norm"] > 0)),
    (("--accum-steps", "--clip-grad-norm"),
     Works(["--accum-steps", "2", "--clip-grad-norm", "1"], lambda r: r.last["accum_steps"] == 2
           and r.last["grad_norm"] > 0)),
    # Accumulation has no mixed precision of its own (distributed_apex.py is that lesson).
    (("--accum-steps", "--amp"), Refused(["--accum-steps", "2", "--amp", "bf16"], "unrecognized arguments: --amp")),
    (("--opt-level", "--amp"), Refused(["--opt-level", "O0", "--amp", "bf16"], "contradicts --amp bf16")),
    (("--amp-impl", "--amp"), Refused(["--amp-impl", "apex", "--amp", "bf16"], "NVIDIA apex")),
    (("--gpus", "--device"), Refused(["--gpus", "0", "--device", "cpu"], "--gpus with --device cpu")),
    (("--init-method", "--ip"), Refused(["--init-method", "file://{tmp}/rendezvous", "--ip", "127.0.0.1"],
                                        "leave out --ip and --port")),
    (("--mp-policy", "--no-reshard-after-forward"),
     Works(["--mp-policy", "bf16", "--no-reshard-after-forward"],
           lambda r: r.dtypes == {torch.bfloat16} and ("layer1", "whole") in r.after_forward)),
    (("--mp-policy", "--channels-last"),
     Works(["--mp-policy", "bf16", "--channels-last"],
           lambda r: r.dtypes == {torch.bfloat16} and r.layouts == {torch.channels_last})),
    (("--checkpoint-every", "--max-steps"),
     Works(["--checkpoint-every", "2", "--max-steps", "3", "--train-samples", "32", "--checkpoint-dir", "{tmp}/ck"],
           lambda r: r.saves == 2 and r.state()["global_step"] == 3)),
]


def options(script: str) -> list:
    """Every option string of the script's parser, captured as main() parses."""
    import argparse

    class Captured(BaseException):  # not an Exception: passes through the scripts' handlers
        pass

    def capture(self, args=None, namespace=None):
        raise Captured(self)

    module = importlib.import_module(script[:-3])
    saved = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = capture
    try:
        module.main([])
    except Captured as captured:
        parser = captured.args[0]
    finally:
        argparse.ArgumentParser.parse_known_args = saved
    return [option for action in parser._actions for option in action.option_strings]


def entries(script: str, option: str) -> list:
    """The entries of one option string of one script ([] if it has none)."""
    tables = [SCRIPT_FLAGS.get(script, {}), COMMON, REPLICAS, FAST_PATH]
    for table in tables:
        for spellings, cases in table.items():
            if option in spellings:
                return cases
    return []


def flag_cases():
    for script in SCRIPTS:
        for option in options(script):
            cases = entries(script, option)
            if not cases:
                yield pytest.param(script, (option,), None, id=f"{script}-{option}-no-entry")
            for number, case in enumerate(cases):
                yield pytest.param(script, (option,), case, id=f"{script}-{option}-{number}")
        have = set(options(script))
        for pair, case in PAIRS:
            if set(pair) <= have:
                yield pytest.param(script, pair, pair_case(script, pair, case), id=f"{script}-{'+'.join(pair)}")


def pair_case(script, pair, case):
    """A pair with a flag that this script always refuses is refused for that flag."""
    for flag in pair:
        cases = entries(script, flag)
        if isinstance(case, Works) and not any(isinstance(c, Works) for c in cases):
            return Refused(case.argv, next(c.fragment for c in cases if isinstance(c, Refused)))
    return case


# --- running a script in this process -----------------------------------------------------------

@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    """CIFAR-100's files, written small: 16 training and 8 test images of 7 classes."""
    root = tmp_path_factory.mktemp("cifar")
    rng = np.random.default_rng(0)
    write_cifar100(root, rng.integers(0, 256, (16, 3, 32, 32), dtype=np.uint8), rng.integers(0, 7, 16),
                   rng.integers(0, 256, (8, 3, 32, 32), dtype=np.uint8), rng.integers(0, 7, 8))
    dump_as_python2({b"fine_label_names": [b"class_%02d" % i for i in range(7)],
                     b"coarse_label_names": [b"superclass_00"]}, os.path.join(root, "cifar-100-python", "meta"))
    return root


class Result:
    def __init__(self, tmp, port, stdout, stderr, spies, baseline):
        self.tmp, self.port, self.stdout, self.stderr = tmp, port, stdout, stderr
        self.records = read_metrics(tmp / "metrics.jsonl") if (tmp / "metrics.jsonl").exists() else []
        self._baseline = baseline
        self.__dict__.update(spies)

    @property
    def last(self):
        return self.records[-1]

    @property
    def baseline(self):
        return self._baseline()

    def state(self):
        return compare_models.load_full(str(self.tmp / "ck" / "checkpoint.pt"))


class InlineSpawn:
    """mp.spawn's stand-in: each worker runs here, one after the other, and what it exits with
    comes back as mp.spawn's context reports it (its join() raises for the first failure)."""

    def __init__(self, fn, args=(), nprocs=1, join=True, **_):
        self.codes = []
        for index in range(nprocs):
            try:
                fn(index, *args)
                self.codes.append(0)
            except SystemExit as stop:  # worker_exit ends each worker through lifecycle.leave
                self.codes.append(stop.code)

    def join(self, grace_period=None):
        import torch.multiprocessing as mp
        for index, code in enumerate(self.codes):
            if code:
                raise mp.ProcessExitedException(f"process {index} terminated with exit code {code}",
                                                error_index=index, error_pid=0, exit_code=code)
        return True

    def pids(self):
        return []


class TTY(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def run_script_here(monkeypatch, capsys, tmp_path, cifar):
    """run(script, argv) -> (Result, exit status): the script's main behind lifecycle.run_main, as
    `python SCRIPT` runs it, in this process, with spies on what the flags should change."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.utils.data import dataloader
    from utils import distributed as dist_utils, spawn
    import distributed_mp
    freeze_the_imports()
    keep_on_cpu(monkeypatch)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(lifecycle, "_joined_a_group", False)
    monkeypatch.setattr(lifecycle, "_job", None)
    monkeypatch.setattr(lifecycle, "leave", lambda code=0, message=None: sys.exit(code))  # a spawned worker's exit
    monkeypatch.setattr(lifecycle, "watch_launcher", lambda *a, **k: None)  # nobody to watch in here
    monkeypatch.setattr(spawn, "forward_stop_signals", lambda workers: None)
    monkeypatch.setattr(distributed_mp.mp, "spawn", InlineSpawn)
    port = free_port()
    baselines = {}
    spies = {}

    def reset_spies():
        spies.update(steps=0, saves=0, loader_iterations=0, compiled_calls=0, worker_loaders=0, compiled=[], layouts=set(), dtypes=set(),
                     after_forward=set(), group_timeouts=[])

    def counting(name, original):
        def counted(*args, **kwargs):
            spies[name] += 1
            return original(*args, **kwargs)
        return counted
    monkeypatch.setattr(checkpoint, "atomic_save", counting("saves", checkpoint.atomic_save))
    monkeypatch.setattr(TrainingRun, "step_done", counting("steps", TrainingRun.step_done))
    monkeypatch.setattr(data.Loader, "__iter__", counting("loader_iterations", data.Loader.__iter__))
    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "__init__",
                        counting("worker_loaders", dataloader._MultiProcessingDataLoaderIter.__init__))
    compile_ = torch.compile

    def eager_compile(model, mode=None, **kwargs):
        spies["compiled"].append(mode)
        compiled = compile_(model, backend="eager")
        # Calls of the module torch.compile returned: the loop must use it, not the module it was given.
        compiled.register_forward_pre_hook(lambda *_: spies.update(compiled_calls=spies["compiled_calls"] + 1))
        return compiled
    monkeypatch.setattr(torch, "compile", eager_compile)
    init_process_group = dist.init_process_group

    def init(*args, timeout=None, **kwargs):
        spies["group_timeouts"].append(timeout.total_seconds() if timeout is not None else None)
        return init_process_group(*args, timeout=timeout, **kwargs)
    monkeypatch.setattr(dist, "init_process_group", init)

    def sharded(module):
        return "sharded" if isinstance(next(module.parameters()), DTensor) else "whole"

    def watch(build_model, sharding):
        def watched_model(*args, **kwargs):
            model = build_model(*args, **kwargs)

            def layer2_starts(layer2, inputs):  # in training: what the stem and layer1 left behind
                if not (layer2.training and torch.is_grad_enabled()):
                    return
                images = inputs[0]
                nhwc = images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
                spies["layouts"].add(torch.channels_last if nhwc else torch.contiguous_format)
                spies["dtypes"].add(images.dtype)
                if sharding:
                    spies["after_forward"].add(("layer1", sharded(model.layer1)))
            model.layer2.register_forward_pre_hook(layer2_starts)

            def forward_done(model, inputs, output):
                # Registered before fully_shard's own hooks, so this gradient hook runs first in
                # backward: it sees the root as its forward left it, before backward gathers it.
                if sharding and output.requires_grad:
                    output.register_hook(lambda grad: spies["after_forward"].add(("root", sharded(model.conv1))))
            model.register_forward_hook(forward_done)
            return model
        return watched_model
    for script in SCRIPTS:
        module = importlib.import_module(script[:-3])
        monkeypatch.setattr(module, "build_model", watch(module.build_model, sharding=script == "distributed_fsdp.py"))

    def substitute(argv, tmp):
        return [str(token).replace("{tmp}", str(tmp)).replace("{cifar}", str(cifar)).replace("{port}", str(port))
                for token in argv]

    def run(script, argv, env=None, tty=False, first=None, tmp=None):
        tmp = tmp or tmp_path
        module = importlib.import_module(script[:-3])
        monkeypatch.setattr(sys, "argv", [script])
        if env is not None:
            for key, value in dict(env, MASTER_PORT=free_port()).items():
                monkeypatch.setenv(key, str(value))
        base = [*BASE, *EXTRA_BASE.get(script, []), "--metrics", tmp / "metrics.jsonl"]
        if "--workers" in argv:
            # Earlier runs here leave process groups behind as garbage. Collected in a forked
            # loader worker, a gloo group's destructor waits for threads that only the parent
            # has, forever (seen): collect them here first.
            gc.collect()
        if first:
            reset_spies()
            lifecycle.run_main(module.main, substitute([*base, *first], tmp))
            (tmp / "metrics.jsonl").unlink()
        reset_spies()
        capsys.readouterr()
        terminal, captured_stderr = TTY() if tty else None, sys.stderr
        if tty:
            sys.stderr = terminal
        code = 0
        try:
            lifecycle.run_main(module.main, substitute([*base, *argv], tmp))
        except SystemExit as stop:
            code = stop.code
        finally:
            sys.stderr = captured_stderr
        if "--workers" in argv:
            # The run's loader workers end as they do when a script's process exits (lifecycle.leave's
            # exit handler kills them): left to the loaders' own shutdown here, each forked from
            # a process with a live gloo group waits out its 5 s join (measured).
            import multiprocessing
            sigchld = signal.getsignal(signal.SIGCHLD)
            lifecycle.kill_loader_workers()  # SIGCHLD at its default: no loader reports the kill
            for child in multiprocessing.active_children():
                child.join(timeout=10)
            gc.collect()  # the loaders themselves
            signal.signal(signal.SIGCHLD, sigchld)
        captured = capsys.readouterr()
        spied = dict(spies, local_rank_variable=os.environ.get("LOCAL_RANK"))

        def baseline():
            if script not in baselines:
                directory = tmp / "baseline"
                directory.mkdir()
                result, code = run(script, [], tmp=directory)
                assert code in (0, None), result.stderr
                baselines[script] = result.last
            return baselines[script]
        return Result(tmp, port, captured.out, (terminal.getvalue() if tty else "") + captured.err, spied,
                      baseline), code

    return run


# --- the one test over scripts x flags ------------------------------------------------------------

@pytest.mark.parametrize("script, flags, case", list(flag_cases()))
def test_flag(run_script_here, script, flags, case):
    if case is None:
        pytest.fail(f"{script} offers {flags[0]}, which has no entry in tests/test_flags.py: "
                    "add how it works (Works) or how it is refused (Refused)")
    if isinstance(case, Elsewhere):
        path, name = case.test.split("::")
        assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), \
            f"{case.test} does not exist"
        pytest.skip(f"shown by {case.test}")
    argv = [flags[0] if token is FLAG else token for token in case.argv]
    if isinstance(case, Works):
        first = [flags[0] if token is FLAG else token for token in case.first] if case.first else None
        result, code = run_script_here(script, argv, env=case.env, tty=case.tty, first=first)
        assert code in (0, None), f"{script} {' '.join(argv)}: exit {code}\n{result.stdout}\n{result.stderr}"
        outcome = case.expect(result)
        assert outcome is None or outcome is True, f"{script} {' '.join(argv)}: not what the flag should do"
        return
    # Refused: --check-args and the run say the same one line, and nothing is trained.
    lines = []
    for check_args in (["--check-args"], []):
        result, code = run_script_here(script, [*argv, *check_args])
        assert code == 2, f"{script} {' '.join(argv + check_args)}: exit {code}\n{result.stdout}\n{result.stderr}"
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and "Traceback" not in result.stderr + result.stdout, result.stderr
        assert case.fragment in errors[0], errors[0]
        assert result.records == [] and "arguments OK" not in result.stdout
        assert (result.steps, result.saves, result.loader_iterations) == (0, 0, 0)  # refused before any step
        lines.append(errors[0])
    assert lines[0] == lines[1], f"--check-args said {lines[0]!r}, the run {lines[1]!r}"


def test_a_flag_without_an_entry_fails():
    """The guard: an option that no table names yields the failing 'no entry' case."""
    assert entries("distributed.py", "--brand-new-flag") == []
    ids = [param.id for param in flag_cases()]
    assert "distributed.py---batch_size-0" in ids and not any(i.endswith("no-entry") for i in ids), \
        [i for i in ids if i.endswith("no-entry")]


@pytest.mark.parametrize("script, extra, launcher", test_gpu_scripts.CUDA_RUNS)
def test_the_cuda_runs_command_lines_are_accepted(run_script_here, tmp_path, script, extra, launcher):
    """test_gpu_scripts.py's runs wait for a GPU to be run at all: their flags are checked here, so
    that a flag a script no longer offers fails on every machine, not at the next GPU check."""
    argv = [str(tmp_path / "ckpt") if a == "CKPT" else a for a in extra]
    result, code = run_script_here(script, [*argv, "--check-args"])
    assert code in (0, None) and "arguments OK" in result.stdout, f"{script} {' '.join(argv)}: exit {code}\n" \
                                                                   f"{result.stdout}\n{result.stderr}"


# --- what needs several processes: one torchrun launch --------------------------------------------

def test_fsdp_bf16_channels_last_resumed_at_another_world_size(run_script_here, tmp_path):
    """FSDP2 at 2 processes with --mp-policy bf16, --channels-last and --clip-grad-norm (the
    layout fully_shard once refused), stopped at step 3, resumed here as a group of one: the
    shards of 2 ranks load into 1, and the run ends where it should."""
    flags = [*BASE, "--train-samples", "32", "--mp-policy", "bf16", "--channels-last", "--clip-grad-norm", "1",
             "--dist-timeout", "120"]
    torchrun(2, "distributed_fsdp.py", [*flags, "--max-steps", "3", "--checkpoint-dir", tmp_path / "ck"])
    saved = checkpoint.load(str(tmp_path / "ck" / "checkpoint.pt"))
    assert (saved["world_size"], saved["global_step"]) == (2, 3)
    result, _ = run_script_here("distributed_fsdp.py", [*flags, "--max-steps", "4", "--checkpoint-dir",
                                                        tmp_path / "ck", "--resume"])
    assert "resumed from" in result.stdout and "3 steps in all" in result.stdout, result.stdout
    assert result.last["step"] == 4 and result.last["world_size"] == 1 and result.last["grad_norm"] > 0
    assert result.dtypes == {torch.bfloat16} and result.layouts == {torch.channels_last}
    resumed = compare_models.load_full(str(tmp_path / "ck" / "checkpoint.pt"))
    assert resumed["world_size"] == 1 and resumed["model"]["conv1.weight"].dtype == torch.float32
