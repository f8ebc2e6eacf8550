"""Tests for scripts/collectives.py on CPU with the gloo backend.

Everything runs in subprocesses with a time limit, in their own process
session, so a hang is killed with all its children and nothing is left
running. Only 127.0.0.1 is used.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, subprocess_env

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "collectives.py"
SUBPROCESS_TIMEOUT_S = 120

PRIMITIVE_SECTIONS = [
    "all_reduce(SUM)",
    "all_reduce(AVG)",
    "reduce(SUM, dst=0)",
    "broadcast(src=0)",
    "all_gather:",
    "gather(dst=0)",
    "scatter(src=0)",
    "reduce_scatter",
    "all_to_all",
    "send/recv:",
    "isend/irecv:",
    "barrier:",
]


# --- helpers -----------------------------------------------------------------


def run_bounded(command: list[str], timeout: float = SUBPROCESS_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run `command`; on timeout kill its whole process group (spawned workers too) and fail."""
    # subprocess_env: no launcher's identity, and no GPU (on a box with several, the tour would pick nccl)
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{command} timed out after {timeout} s\nstdout:\n{stdout}\nstderr:\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


# Runs in spawned processes: loads the script by path, exercises its functions
# inside a real gloo group and writes what it saw to one JSON file per rank.
# The assertions are made by the tests below, on those files.
DRIVER = textwrap.dedent(
    """
    import datetime, importlib.util, json, os, sys

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp


    def load(script_path):
        spec = importlib.util.spec_from_file_location("collectives_under_test", script_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


    def worker(rank, world_size, init_method, script_path, out_dir):
        torch.set_num_threads(1)
        collectives = load(script_path)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=60))
        try:
            report = {"rank": rank, "world_size": world_size, "ring": {}}
            # Uneven chunks (1000 over 3), tiny chunks (7), an empty chunk (2 < 3), a 2-D tensor.
            for shape in [(1000,), (7,), (2,), (10, 11)]:
                generator = torch.Generator().manual_seed(100 + rank)
                tensor = torch.randn(*shape, generator=generator)
                original = tensor.clone()
                ring, bytes_sent = collectives.ring_all_reduce(tensor)
                library = tensor.clone()
                dist.all_reduce(library)
                report["ring"][str(shape)] = {
                    "input": original.flatten().tolist(),
                    "input_untouched": bool(torch.equal(tensor, original)),
                    "shape": list(shape),
                    "ring_shape": list(ring.shape),
                    "ring": ring.flatten().tolist(),
                    "all_reduce": library.flatten().tolist(),
                    "bytes_sent": bytes_sent,
                    "element_size": tensor.element_size(),
                }
            params = collectives.compare_hand_rolled_with_ddp(steps=3, lr=0.1)
            report["params"] = {name: value.tolist() for name, value in params.items()}
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
                json.dump(report, handle)
        finally:
            dist.destroy_process_group()


    if __name__ == "__main__":
        script_path, out_dir, world_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
        collectives = load(script_path)
        init_method = f"tcp://127.0.0.1:{collectives.free_port('127.0.0.1')}"
        mp.spawn(worker, args=(world_size, init_method, script_path, out_dir), nprocs=world_size, join=True)
    """
)

DRIVER_WORLD_SIZE = 3


@pytest.fixture(scope="module")
def driver_reports(tmp_path_factory) -> list[dict]:
    """One run of DRIVER with 3 processes, shared by the function-level tests."""
    workdir = tmp_path_factory.mktemp("collectives_driver")
    driver = workdir / "driver.py"
    driver.write_text(DRIVER)
    result = run_bounded([sys.executable, str(driver), str(SCRIPT), str(workdir), str(DRIVER_WORLD_SIZE)])
    assert result.returncode == 0, f"driver failed\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    reports = [json.loads((workdir / f"rank{rank}.json").read_text()) for rank in range(DRIVER_WORLD_SIZE)]
    assert [report["rank"] for report in reports] == list(range(DRIVER_WORLD_SIZE))
    return reports


# --- the whole tour, as a user runs it ------------------------------------------


# A deprecation is an error in the tour's processes (the -W options reach the spawned ones):
# the names PyTorch renamed in 2.13 are picked by feature in the script, so neither the floor
# version nor the newest may warn.
NO_DEPRECATIONS = ["-W", "error::FutureWarning", "-W", "error::DeprecationWarning"]


def test_tour_passes_and_prints_tables() -> None:
    nproc = 3  # not 2, where the ring's 2(N-1)/N is 1 and would tell nothing apart
    result = run_bounded([sys.executable, *NO_DEPRECATIONS, str(SCRIPT), "--nproc", str(nproc)])
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    out = result.stdout
    assert f"ALL CHECKS PASSED: {nproc} ranks, backend gloo" in out
    assert "FutureWarning" not in result.stderr and "DeprecationWarning" not in result.stderr, result.stderr

    # The single-tensor collectives under this PyTorch's name for them (renamed in 2.13).
    new_names = hasattr(torch.distributed, "all_gather_single")
    gather_name, scatter_name = (("all_gather_single", "reduce_scatter_single") if new_names
                                 else ("all_gather_into_tensor", "reduce_scatter_tensor"))
    flat = ", ".join(f"{r + 1}, {10 * (r + 1)}" for r in range(nproc))
    assert f"into one tensor, dist.{gather_name}: [{flat}] on every rank" in out
    assert f"--- reduce_scatter(SUM), dist.{scatter_name}:" in out

    # Every primitive printed its checked before/after table: gloo and nccl have them all, so a
    # primitive that raised is a bug, never a "not supported here" to skip.
    for section in PRIMITIVE_SECTIONS:
        assert f"--- {section}" in out, f"no section for {section!r}"
    assert out.count("  rank | before") == len(PRIMITIVE_SECTIONS)
    assert "not supported" not in out and "skipped" not in out

    # The all_reduce(SUM) table: every rank ends with [S, 10S], S = 1 + ... + N.
    total = nproc * (nproc + 1) // 2
    table = out.split("--- all_reduce(SUM)")[1].split("\n---")[0]
    rows = re.findall(r"^\s+(\d+) \| \[(\d+), (\d+)\]\s+\| \[(\d+), (\d+)\]$", table, flags=re.MULTILINE)
    assert [int(row[0]) for row in rows] == list(range(nproc))
    for rank, before_a, before_b, after_a, after_b in rows:
        assert (int(before_a), int(before_b)) == (int(rank) + 1, 10 * (int(rank) + 1))
        assert (int(after_a), int(after_b)) == (total, 10 * total)

    # The ring all-reduce line for each rank, with bytes close to 2(N-1)/N x bytes.
    assert "--- ring all-reduce" in out
    sent_lines = re.findall(r"rank (\d+): sent (\d+) bytes \(theory 2\(N-1\)/N x (\d+) = ([\d.]+)\)", out)
    assert len(sent_lines) == nproc
    for _, sent, tensor_bytes, theory in sent_lines:
        assert float(theory) == pytest.approx(2 * (nproc - 1) / nproc * int(tensor_bytes), abs=0.05)  # printed to 0.1
        assert abs(int(sent) - float(theory)) < 8  # under one float32 per phase
    assert "DDP automates" in out


def test_a_bad_nproc_is_one_line_and_exit_2() -> None:
    assert_one_line_error(run_bounded([sys.executable, str(SCRIPT), "--nproc", "0"]), "--nproc", "at least 1")


# --- ring all-reduce, called as a function in real processes ----------------------


def test_ring_all_reduce_equals_dist_all_reduce(driver_reports: list[dict]) -> None:
    world_size = DRIVER_WORLD_SIZE
    for shape in driver_reports[0]["ring"]:
        per_rank = [report["ring"][shape] for report in driver_reports]
        # The true sum, computed here in float64 from every rank's input.
        inputs = torch.tensor([entry["input"] for entry in per_rank], dtype=torch.float64)
        true_sum = inputs.sum(dim=0)
        for rank, entry in enumerate(per_rank):
            ring = torch.tensor(entry["ring"], dtype=torch.float64)
            library = torch.tensor(entry["all_reduce"], dtype=torch.float64)
            assert entry["ring_shape"] == entry["shape"], f"shape {shape}, rank {rank}"
            assert entry["input_untouched"], f"ring_all_reduce modified its input ({shape}, rank {rank})"
            assert torch.allclose(ring, library, rtol=1e-5, atol=1e-5), f"ring != all_reduce ({shape}, rank {rank})"
            assert torch.allclose(ring, true_sum, rtol=1e-5, atol=1e-5), f"ring != true sum ({shape}, rank {rank})"

        # Bytes: per rank within chunk rounding of 2(N-1)/N x tensor bytes, and in
        # total exactly 2(N-1) x tensor bytes (each phase moves N-1 tensors' worth).
        element_size = per_rank[0]["element_size"]
        tensor_bytes = inputs.shape[1] * element_size  # inputs: one flattened row per rank
        theory = 2 * (world_size - 1) / world_size * tensor_bytes
        for entry in per_rank:
            assert entry["bytes_sent"] % element_size == 0
            assert abs(entry["bytes_sent"] - theory) < 2 * element_size, (shape, entry["bytes_sent"], theory)
        assert sum(entry["bytes_sent"] for entry in per_rank) == 2 * (world_size - 1) * tensor_bytes


# --- hand-rolled data parallelism vs DDP -------------------------------------------


def test_hand_rolled_step_equals_ddp(driver_reports: list[dict]) -> None:
    def max_diff(a, b) -> float:
        return (torch.tensor(a) - torch.tensor(b)).abs().max().item()

    reference_rank0 = driver_reports[0]["params"]
    for report in driver_reports:
        params = report["params"]
        # DDP's constructor replaced this rank's own initial weights with rank 0's.
        assert params["after_ddp_init"] == params["initial"]
        # Training actually moved the weights, so the comparisons below mean something.
        assert max_diff(params["hand_rolled"], params["initial"]) > 1e-3
        assert max_diff(params["hand_rolled"], params["ddp"]) <= 1e-6
        # Averaged gradients over equal shards == one process on the whole batch.
        assert max_diff(params["hand_rolled"], params["single_process"]) <= 1e-5
        # And every rank ends with the same model.
        assert max_diff(params["hand_rolled"], reference_rank0["hand_rolled"]) <= 1e-6
        assert max_diff(params["ddp"], reference_rank0["ddp"]) <= 1e-6
