"""A runnable tour of collective communication in torch.distributed.

Every primitive runs in a real process group and every result is checked
against a value computed by hand from the rank and the world size, so the
script doubles as a test: it exits 0 only when all checks pass.

Run it
------
On CPU (gloo), starting the processes itself:

    python scripts/collectives.py --nproc 4

On GPUs (nccl, one process per GPU), launched by torchrun:

    torchrun --nproc_per_node=4 scripts/collectives.py

Options: ``--nproc N`` (processes to start when not under torchrun, default 2)
and ``--backend gloo|nccl`` (default: nccl when every process can have its own
GPU, gloo otherwise).

What it shows
-------------
1. all_reduce (sum and average), reduce, broadcast, all_gather, gather,
   scatter, reduce_scatter, all_to_all, send/recv, isend/irecv and barrier,
   each with a before/after table printed by rank 0.
2. A ring all-reduce built only from point-to-point messages, checked against
   dist.all_reduce, with the bytes each rank sent next to the theoretical
   2(N-1)/N x tensor bytes.
3. A hand-rolled data-parallel SGD step (all_reduce of gradients) checked
   against torch.nn.parallel.DistributedDataParallel.

The lesson that goes with it is tutorials/07-collectives.md.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The repository root, for `python scripts/collectives.py`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from utils.cli import Parser, UsageError, positive_int, print_line  # noqa: E402
from utils.distributed import job_from_env, print0  # noqa: E402
from utils.lifecycle import leave, run_main  # noqa: E402
from utils.spawn import free_port  # noqa: E402
import torch.nn as nn

# Give up on a collective after this long: PyTorch's own default is 30 minutes for gloo and
# 10 for nccl, far too long for a tour that takes seconds.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=60)

# The single-tensor all-gather and reduce-scatter were renamed in PyTorch 2.13:
# all_gather_into_tensor became all_gather_single and reduce_scatter_tensor became
# reduce_scatter_single; the old names still work there but warn (FutureWarning), and
# 2.11 has only the old names. Same arguments, same result: picked here, once, by
# what this PyTorch has.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CheckFailed(Exception):
    """A computed value differed from the expected one (on at least one rank)."""


# --- small helpers --------------------------------------------------------


def current_device() -> torch.device:
    """gloo here works on CPU tensors; nccl needs this process's GPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fmt(values) -> str:
    """[1, 10] for a tensor; [1, 10] [2, 20] for a list of tensors; - for None."""
    if values is None:
        return "-"
    if isinstance(values, (list, tuple)):
        return " ".join(fmt(item) for item in values)
    return "[" + ", ".join(f"{v:g}" for v in values.flatten().tolist()) + "]"


def gather_objects(obj) -> list:
    """Every rank gets the list of every rank's `obj` (only used for printing and timing)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def print_table(title: str, before: str, after: str) -> None:
    """Collect one (before, after) pair per rank and print them as a table on rank 0."""
    rows = gather_objects((before, after))
    width_before = max(len("before"), *(len(b) for b, _ in rows))
    print0(f"\n--- {title}")
    print0(f"  rank | {'before':<{width_before}} | after")
    for rank, (b, a) in enumerate(rows):
        print0(f"  {rank:>4} | {b:<{width_before}} | {a}")


def check(ok: bool, what: str, detail: str = "") -> None:
    """Every rank passes its own verdict; every rank learns whether any rank failed.

    Agreeing first (one tiny all_reduce) makes a failure raise on all ranks at
    the same point. Raising on one rank only would leave the others blocked in
    the next collective until the timeout.
    """
    failure_count = torch.tensor([0 if ok else 1], device=current_device())
    dist.all_reduce(failure_count)
    failed_ranks = int(failure_count.item())  # how many ranks reported a failure
    if not ok:
        message = f"{what}: {detail}" if detail else what
        print_line(f"[rank {dist.get_rank()}] CHECK FAILED: {message}")  # one write: ranks share the terminal
    if failed_ranks:
        raise CheckFailed(f"{what} (wrong on {failed_ranks} of {dist.get_world_size()} ranks)")


def check_equal(actual: torch.Tensor | None, expected: list[float] | None, what: str) -> None:
    """Exact comparison; `expected=None` means this rank has nothing to check."""
    if expected is None:
        check(True, what)
        return
    ok = actual is not None and actual.flatten().tolist() == [float(v) for v in expected]
    check(ok, what, f"got {fmt(actual)}, expected {expected}")


def rank_tensor(rank: int) -> torch.Tensor:
    """What rank r contributes: [r+1, 10(r+1)], easy to follow by eye."""
    return torch.tensor([rank + 1.0, 10.0 * (rank + 1)], device=current_device())


# --- the collectives, one by one --------------------------------------------


def demo_all_reduce(rank: int, world_size: int) -> None:
    total = world_size * (world_size + 1) / 2  # 1 + 2 + ... + N

    values = rank_tensor(rank)
    before = fmt(values)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    print_table("all_reduce(SUM): every rank ends with the element-wise sum", before, fmt(values))
    check_equal(values, [total, 10 * total], "all_reduce SUM")

    values = rank_tensor(rank)
    before = fmt(values)
    dist.all_reduce(values, op=dist.ReduceOp.AVG)  # gloo and nccl both have AVG
    print_table("all_reduce(AVG): every rank ends with the mean", before, fmt(values))
    check(
        torch.allclose(values.cpu(), torch.tensor([total / world_size, 10 * total / world_size])),
        "all_reduce average",
        f"got {fmt(values)}",
    )


def demo_reduce(rank: int, world_size: int) -> None:
    total = world_size * (world_size + 1) / 2
    values = rank_tensor(rank)
    before = fmt(values)
    dist.reduce(values, dst=0, op=dist.ReduceOp.SUM)
    # Only the destination's result is defined; the others keep a scratch buffer.
    print_table("reduce(SUM, dst=0): only rank 0 gets the sum", before, fmt(values) if rank == 0 else "-")
    check_equal(values, [total, 10 * total] if rank == 0 else None, "reduce to rank 0")


def demo_broadcast(rank: int, world_size: int) -> None:
    values = rank_tensor(rank)
    before = fmt(values)
    dist.broadcast(values, src=0)
    print_table("broadcast(src=0): every rank ends with rank 0's tensor", before, fmt(values))
    check_equal(values, [1, 10], "broadcast from rank 0")


def demo_all_gather(rank: int, world_size: int) -> None:
    values = rank_tensor(rank)
    gathered = [torch.zeros_like(values) for _ in range(world_size)]
    dist.all_gather(gathered, values)
    print_table("all_gather: every rank ends with every rank's tensor, in rank order", fmt(values), fmt(gathered))
    expected = [v for r in range(world_size) for v in (r + 1, 10 * (r + 1))]
    check_equal(torch.cat(gathered), expected, "all_gather")
    # The same into one tensor N times the input's size, with no list to concatenate.
    flat = torch.zeros(2 * world_size, device=current_device())
    all_gather_single(flat, values)
    print0(f"  into one tensor, dist.{all_gather_single.__name__}: {fmt(flat)} on every rank")
    check_equal(flat, expected, all_gather_single.__name__)


def demo_gather(rank: int, world_size: int) -> None:
    values = rank_tensor(rank)
    # Only the destination provides (and gets) the list; the others pass None.
    gathered = [torch.zeros_like(values) for _ in range(world_size)] if rank == 0 else None
    dist.gather(values, gather_list=gathered, dst=0)
    print_table("gather(dst=0): rank 0 ends with every rank's tensor", fmt(values), fmt(gathered))
    expected = [v for r in range(world_size) for v in (r + 1, 10 * (r + 1))]
    check_equal(torch.cat(gathered) if rank == 0 else None, expected if rank == 0 else None, "gather to rank 0")


def demo_scatter(rank: int, world_size: int) -> None:
    device = current_device()
    received = torch.zeros(2, device=device)
    # Rank 0 holds one chunk per rank: chunk i = [100 + i, 200 + i].
    chunks = (
        [torch.tensor([100.0 + i, 200.0 + i], device=device) for i in range(world_size)] if rank == 0 else None
    )
    before = fmt(chunks) if rank == 0 else fmt(received)
    dist.scatter(received, scatter_list=chunks, src=0)
    print_table("scatter(src=0): rank i ends with rank 0's chunk i", before, fmt(received))
    check_equal(received, [100 + rank, 200 + rank], "scatter from rank 0")


def demo_reduce_scatter(rank: int, world_size: int) -> None:
    total = world_size * (world_size + 1) / 2
    # Rank r holds (r+1) * [1, 2, ..., N]; element j of the sum belongs to rank j.
    values = (rank + 1) * torch.arange(1.0, world_size + 1, device=current_device())
    my_share = torch.zeros(1, device=current_device())
    reduce_scatter_single(my_share, values, op=dist.ReduceOp.SUM)
    print_table(f"reduce_scatter(SUM), dist.{reduce_scatter_single.__name__}: rank i ends with element i of the sum",
                fmt(values), fmt(my_share))
    check_equal(my_share, [total * (rank + 1)], "reduce_scatter")


def demo_all_to_all(rank: int, world_size: int) -> None:
    # Element j of rank r's input is the message from r to j, written 10(r+1) + j:
    # the tens say who sent it, the units who it is for.
    outgoing = 10.0 * (rank + 1) + torch.arange(float(world_size), device=current_device())
    incoming = torch.zeros_like(outgoing)
    dist.all_to_all_single(incoming, outgoing)
    print_table("all_to_all: element j goes to rank j (a transpose across ranks)", fmt(outgoing), fmt(incoming))
    check_equal(incoming, [10 * (sender + 1) + rank for sender in range(world_size)], "all_to_all")


def demo_send_recv(rank: int, world_size: int) -> None:
    if world_size < 2:
        print0("\n--- send/recv and isend/irecv need at least 2 ranks; skipped")
        return
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    expected = rank_tensor(left).tolist()

    # Blocking: if every rank sent first, each could wait for a receiver that
    # is itself stuck sending. Even ranks send first, odd ranks receive first.
    payload, received = rank_tensor(rank), torch.zeros(2, device=current_device())
    if rank % 2 == 0:
        dist.send(payload, dst=right)
        dist.recv(received, src=left)
    else:
        dist.recv(received, src=left)
        dist.send(payload, dst=right)
    print_table("send/recv: each rank sends to rank+1 and receives from rank-1", fmt(payload), fmt(received))
    check_equal(received, expected, "send/recv ring exchange")

    # Non-blocking: isend/irecv return at once; wait() is where we block.
    # Same parity order, because on NCCL a send holds the GPU stream until
    # the matching receive is posted.
    payload, received = rank_tensor(rank), torch.zeros(2, device=current_device())
    if rank % 2 == 0:
        requests = [dist.isend(payload, dst=right), dist.irecv(received, src=left)]
    else:
        requests = [dist.irecv(received, src=left), dist.isend(payload, dst=right)]
    for request in requests:
        request.wait()  # `payload` and `received` must stay alive and untouched until here
    print_table("isend/irecv: the same ring exchange, non-blocking", fmt(payload), fmt(received))
    check_equal(received, expected, "isend/irecv ring exchange")


def demo_barrier(rank: int, world_size: int, late_seconds: float = 0.2) -> None:
    # Rank 0 arrives late on purpose; nobody may leave the barrier before it arrives.
    if rank == 0:
        time.sleep(late_seconds)
    arrived = time.time()
    dist.barrier()
    left = time.time()

    times = gather_objects((socket.gethostname(), arrived, left))
    start = min(t for _, t, _ in times)
    print_table(
        f"barrier: nobody leaves until everybody has arrived (rank 0 is {late_seconds} s late)",
        f"arrived +{arrived - start:.3f} s",
        f"left +{left - start:.3f} s",
    )
    # Wall clocks are only comparable on one machine; allow for clock jitter.
    same_host = len({host for host, _, _ in times}) == 1
    rank0_arrived = times[0][1]
    ok = (not same_host) or left >= rank0_arrived - 0.05
    check(ok, "barrier", f"left at {left:.3f}, rank 0 arrived at {rank0_arrived:.3f}")


# --- the idea DDP relies on: ring all-reduce from point-to-point messages ----


def ring_step(rank: int, world_size: int, phase: str, step: int) -> tuple[int, int]:
    """(the chunk `rank` sends right, the chunk it receives from the left) at `step` of `phase`.

    Scatter-reduce: at step s rank r sends chunk r-s and receives chunk r-s-1, so after N-1
    steps it holds the complete sum of chunk r+1. All-gather: it passes on the finished
    chunk r+1-s and receives chunk r-s. Either way it receives what its left neighbour sends.
    """
    send_index = rank - step if phase == "scatter-reduce" else rank + 1 - step
    return send_index % world_size, (send_index - 1) % world_size


def ring_all_reduce(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum `tensor` over all ranks with messages to ring neighbours only.

    Returns (the sum, shaped like `tensor`; the number of bytes this rank sent).
    The input is not modified. Works for any size, including sizes that do not
    split evenly into N chunks.
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.detach().flatten().clone()  # contiguous working copy
    if world_size == 1:
        return flat.view_as(tensor), 0

    # N chunks whose sizes differ by at most one element; views into `flat`.
    chunks = list(torch.tensor_split(flat, world_size))
    send_to, receive_from = (rank + 1) % world_size, (rank - 1) % world_size
    bytes_sent = 0

    def pass_along(send_index: int, receive_index: int) -> torch.Tensor:
        """Send one chunk right while receiving another from the left."""
        nonlocal bytes_sent
        outgoing = chunks[send_index]
        incoming = torch.empty_like(chunks[receive_index])
        # Posted together as one batch of isend/irecv, so no rank waits on a
        # neighbour that is itself waiting to send (and NCCL runs them jointly).
        requests = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, outgoing, send_to), dist.P2POp(dist.irecv, incoming, receive_from)]
        )
        for request in requests:
            request.wait()  # `outgoing` must not change before this returns
        bytes_sent += outgoing.numel() * outgoing.element_size()
        return incoming

    # Phase 1, scatter-reduce: add each incoming chunk into this rank's copy.
    # After N-1 steps rank r holds the complete sum of chunk r+1.
    for step in range(world_size - 1):
        send_index, receive_index = ring_step(rank, world_size, "scatter-reduce", step)
        chunks[receive_index].add_(pass_along(send_index, receive_index))

    # Phase 2, all-gather: pass the finished chunks around the ring; each
    # incoming chunk is already the full sum, so it overwrites.
    for step in range(world_size - 1):
        send_index, receive_index = ring_step(rank, world_size, "all-gather", step)
        chunks[receive_index].copy_(pass_along(send_index, receive_index))

    return flat.view_as(tensor), bytes_sent


def ring_input(rank: int, numel: int) -> torch.Tensor:
    """Rank r's input: random but reproducible, so any rank can rebuild any other's."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=generator)


def demo_ring_all_reduce(rank: int, world_size: int) -> None:
    # 1000 elements unless that splits evenly, then 1001: chunks are uneven.
    numel = 1000 if 1000 % world_size else 1001
    device = current_device()
    my_input = ring_input(rank, numel).to(device)

    ring_result, bytes_sent = ring_all_reduce(my_input)
    library_result = my_input.clone()
    dist.all_reduce(library_result)
    summed_by_hand = sum(ring_input(r, numel) for r in range(world_size))

    # Float addition is not associative: the ring adds in a different order
    # than the library, so compare with a tolerance, not bit for bit.
    close_to_library = torch.allclose(ring_result, library_result, rtol=1e-5, atol=1e-5)
    close_to_hand = torch.allclose(ring_result.cpu(), summed_by_hand, rtol=1e-5, atol=1e-5)
    max_difference = (ring_result - library_result).abs().max().item()

    tensor_bytes = numel * my_input.element_size()
    theory = 2 * (world_size - 1) / world_size * tensor_bytes  # what each rank sends in a ring all-reduce
    print0(f"\n--- ring all-reduce from isend/irecv: {numel} float32 ({tensor_bytes} bytes) over {world_size} ranks")
    print0(f"  {world_size - 1} scatter-reduce steps + {world_size - 1} all-gather steps "
           f"= {2 * (world_size - 1)} steps")
    for r, (sent, diff) in enumerate(gather_objects((bytes_sent, max_difference))):
        print0(f"  rank {r}: sent {sent} bytes (theory 2(N-1)/N x {tensor_bytes} = {theory:.1f}); "
               f"max |ring - dist.all_reduce| = {diff:.2e}")
    print0(f"  for comparison, reducing to rank 0 and sending the sum back makes rank 0 receive "
           f"{(world_size - 1) * tensor_bytes} bytes and send as many;\n"
           f"  the ring has every rank send (and receive) under 2 x {tensor_bytes} bytes, whatever N")

    check(close_to_library, "ring all-reduce equals dist.all_reduce", f"max diff {max_difference}")
    check(close_to_hand, "ring all-reduce equals the sum computed by hand")
    check(torch.equal(my_input.cpu(), ring_input(rank, numel)), "ring all-reduce leaves its input untouched")
    # Each phase sends every chunk but one, so the count can differ from the
    # formula by less than one element per phase.
    check(abs(bytes_sent - theory) < 2 * my_input.element_size(), "ring bytes match 2(N-1)/N x bytes",
          f"sent {bytes_sent}, theory {theory}")


# --- a hand-rolled data-parallel step, compared with DDP ---------------------

IN_FEATURES, HIDDEN, SAMPLES_PER_RANK = 4, 8, 4


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))


def make_global_batch(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same fixed batch on every rank; each rank then trains on its own slice."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SAMPLES_PER_RANK * world_size, IN_FEATURES, generator=generator)
    targets = torch.randn(SAMPLES_PER_RANK * world_size, 1, generator=generator)
    return inputs, targets


def my_shard(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * SAMPLES_PER_RANK:(rank + 1) * SAMPLES_PER_RANK]


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])


def train_hand_rolled(model: nn.Module, inputs, targets, steps: int, lr: float) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Start from identical weights: copy rank 0's everywhere (DDP does this too).
    for parameter in model.parameters():
        dist.broadcast(parameter.data, src=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(my_shard(inputs, rank)), my_shard(targets, rank))
        loss.backward()
        # Average gradients: with equal shards and a mean loss this is exactly
        # the gradient of the whole batch, so every rank takes the same step.
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)
            parameter.grad.div_(world_size)
        optimizer.step()


def train(model: nn.Module, inputs, targets, steps: int, lr: float) -> None:
    """Plain SGD steps on `inputs`."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()


def compare_hand_rolled_with_ddp(steps: int = 3, lr: float = 0.1) -> dict[str, torch.Tensor]:
    """Train the same model three ways; return each one's flattened parameters (CPU).

    Each rank starts from *different* weights (seeded by rank) on purpose: the
    hand-rolled loop and DDP must both copy rank 0's weights before training.
    Keys: initial (rank 0's start), after_ddp_init, hand_rolled, ddp, single_process.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = current_device()
    inputs, targets = (t.to(device) for t in make_global_batch(world_size))

    hand_rolled = make_model(seed=rank).to(device)
    train_hand_rolled(hand_rolled, inputs, targets, steps, lr)

    ddp_model = nn.parallel.DistributedDataParallel(
        make_model(seed=rank).to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    after_ddp_init = flat_parameters(ddp_model.module)  # the constructor broadcast rank 0's weights
    # Each rank on its shard; every backward() all-reduces (averages) the gradients: all ranks must take part.
    train(ddp_model, my_shard(inputs, rank), my_shard(targets, rank), steps, lr)

    reference = make_model(seed=0).to(device)  # rank 0's initial weights
    initial = flat_parameters(reference)
    train(reference, inputs, targets, steps, lr)  # the whole batch in one process: what DDP must reproduce

    return {
        "initial": initial,
        "after_ddp_init": after_ddp_init,
        "hand_rolled": flat_parameters(hand_rolled),
        "ddp": flat_parameters(ddp_model.module),
        "single_process": flat_parameters(reference),
    }


def demo_data_parallel(rank: int, world_size: int, steps: int = 3) -> None:
    params = compare_hand_rolled_with_ddp(steps=steps)
    hand_vs_ddp = (params["hand_rolled"] - params["ddp"]).abs().max().item()
    hand_vs_single = (params["hand_rolled"] - params["single_process"]).abs().max().item()
    moved = (params["hand_rolled"] - params["initial"]).abs().max().item()

    print0(f"\n--- data-parallel SGD, {steps} steps, {SAMPLES_PER_RANK} samples per rank, "
           f"{params['initial'].numel()} parameters")
    for r, (to_ddp, to_single, moved_r) in enumerate(gather_objects((hand_vs_ddp, hand_vs_single, moved))):
        print0(f"  rank {r}: |hand-rolled - DDP| <= {to_ddp:.1e}, "
               f"|hand-rolled - whole batch in one process| <= {to_single:.1e} (weights moved up to {moved_r:.3f})")
    print0("  DDP automates what the hand-rolled loop spells out: it broadcasts rank 0's parameters and\n"
           "  buffers at construction (and by default the buffers again before the first forward and each\n"
           "  one after a forward whose gradients it synchronised), groups gradients into buckets (~25 MiB)\n"
           "  and all-reduces each bucket as soon as backward has filled it, overlapping communication\n"
           "  with the rest of backward.")

    check(torch.equal(params["after_ddp_init"], params["initial"]), "DDP broadcasts rank 0's initial weights")
    check(moved > 1e-4, "training changed the weights", f"moved {moved}")
    check(hand_vs_ddp <= 1e-6, "hand-rolled step equals DDP within 1e-6", f"max diff {hand_vs_ddp}")
    check(hand_vs_single <= 1e-5, "hand-rolled step equals one process on the whole batch",
          f"max diff {hand_vs_single}")


# --- the tour ---------------------------------------------------------------


def run_tour(rank: int, world_size: int) -> None:
    """Run every demo and check; the process group must already be initialised.

    Raises CheckFailed (on every rank) if any value is wrong.
    """
    print0(f"Collective communication tour: {world_size} ranks, backend {dist.get_backend()}, "
           f"device {current_device().type}, torch {torch.__version__}")
    print0("Rank r starts from [r+1, 10(r+1)] unless said otherwise; every result below is checked.")

    for demo in (
        demo_all_reduce,
        demo_reduce,
        demo_broadcast,
        demo_all_gather,
        demo_gather,
        demo_scatter,
        demo_reduce_scatter,
        demo_all_to_all,
        demo_send_recv,
        demo_barrier,
        demo_ring_all_reduce,
        demo_data_parallel,
    ):
        demo(rank, world_size)

    print0(f"\nALL CHECKS PASSED: {world_size} ranks, backend {dist.get_backend()}")


# --- process setup: torchrun or self-spawned ---------------------------------


def choose_backend(requested: str | None, processes_on_this_machine: int) -> str:
    """nccl needs one GPU per process on each machine; otherwise gloo on CPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "nccl" and gpus < processes_on_this_machine:
        raise UsageError(f"--backend nccl needs one GPU per process: {processes_on_this_machine} processes, "
                         f"{gpus} GPU(s)", met_by="node")
    if requested:
        return requested
    return "nccl" if gpus >= processes_on_this_machine else "gloo"


def run_worker(rank: int, world_size: int, backend: str, init_method: str, local_rank: int) -> int:
    """Join the group, run the tour, always leave the group. Returns an exit status."""
    torch.set_num_threads(1)  # N processes share few cores; avoid oversubscription
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT
    )
    try:
        run_tour(rank, world_size)
        return 0
    except CheckFailed as failure:
        print_line(f"[rank {rank}] collectives tour FAILED: {failure}")
        return 1
    finally:
        dist.destroy_process_group()


def _spawned_worker(rank: int, world_size: int, backend: str, init_method: str) -> None:
    status = run_worker(rank, world_size, backend, init_method, local_rank=rank)
    leave(status)  # the group is destroyed: skip the interpreter's teardown (utils/lifecycle.py)


def main(argv: list[str] | None = None) -> None:
    parser = Parser(description=__doc__.strip().splitlines()[0])  # a bad flag: one line, exit status 2
    parser.add_argument("--nproc", type=positive_int, default=2,
                        help="processes to start when not launched by torchrun")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: nccl if every process gets a GPU, else gloo")
    args = parser.parse_args(argv)

    job = job_from_env()  # torchrun's RANK, WORLD_SIZE...; none under plain python: this process spawns
    if job.distributed:
        backend = choose_backend(args.backend, job.local_world_size)
        leave(run_worker(job.rank, job.world_size, backend, "env://", job.local_rank))

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned processes
    backend = choose_backend(args.backend, args.nproc)
    # Outside the kernel's ephemeral range: rank 0 listens on it only once spawned, and a port
    # from bind(port 0) can meanwhile go to an outgoing connection (utils.spawn.free_port).
    init_method = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    try:
        mp.spawn(_spawned_worker, args=(args.nproc, backend, init_method), nprocs=args.nproc, join=True)
    except mp.ProcessExitedException as failure:
        sys.exit(f"collectives tour FAILED: process {failure.error_index} exited with status "
                 f"{failure.exit_code}; see the messages above")
    except mp.ProcessRaisedException as failure:
        sys.exit(f"collectives tour FAILED: a process raised an exception:\n{failure}")


if __name__ == "__main__":
    run_main(main)  # bad input (UsageError): one line on stderr, exit status 2
