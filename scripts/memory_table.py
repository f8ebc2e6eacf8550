"""What each rank holds under DDP and under FSDP2, measured, beside the formula it should follow.

`python scripts/memory_table.py [--device cpu]`: one torchrun launch per world size
(1, 2 and 4 processes by default), each measuring four strategies in turn on a fresh
model: DDP as distributed.py wraps it (under torchrun, one process too), and FSDP2 as
distributed_fsdp.py shards it, with and without --reshard-after-forward, and with
--mp-policy bf16. Each rank trains two steps of SGD with momentum on random images, then
counts, after the second step:

- parameter, gradient and optimizer-state bytes: the bytes of the distinct storages
  behind its parameters (the local shard of a DTensor), their .grad (DDP's buckets when
  the gradients are views into them) and the optimizer's state tensors;
- whole parameters at once: the largest number of parameter bytes registered unsharded
  on the model at any one time, looked at before and after every module's forward and
  when its backward starts (FSDP2 swaps the gathered parameters onto the module while a
  unit runs and its shards back after);
- on a GPU, the peak of torch.cuda.max_memory_allocated during the second step
  (activations included) and what is allocated after it.

The formula for P fp32 parameters at world size W, per rank, 4 bytes each for the
parameters, their gradients and SGD's momentum:
    DDP:   4P + 4P + 4P = 12P, at any W
    FSDP2: the same three, each split in W along dim 0 of every parameter: a tensor of
           d0 rows holds ceil(d0 / W) rows per rank (FSDP2 pads dim 0 to a multiple of W;
           the parameters and gradients live in padded storage, the momentum buffers
           hold the rank's rows only), about 12P / W in all.

    python scripts/memory_table.py --device cpu --out /tmp/mem   # 1, 2 and 4 CPU processes
    python scripts/memory_table.py                               # on GPUs: 1, 2, 4, ... and all of them

memory.md and memory.json go to --out (default results/); each launch's log to --log-dir.
"""
import argparse
import gc
import json
import math
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

STRATEGIES = [
    # name, what it is, FSDP2's reshard_after_forward (None: DDP), distributed_fsdp.py's --mp-policy
    ("ddp", "DDP (distributed.py): every rank holds everything", None, None),
    ("fsdp2", "FSDP2, reshard after forward (ZeRO-3), distributed_fsdp.py", True, "none"),
    ("fsdp2-zero2", "FSDP2, --no-reshard-after-forward (ZeRO-2-like)", False, "none"),
    ("fsdp2-bf16", "FSDP2 (ZeRO-3), --mp-policy bf16: parameters gathered in bf16, batch norm in fp32",
     True, "bf16"),
]
FP32 = 4  # bytes per parameter, gradient and momentum value
MB = 2 ** 20


# --- the formula ------------------------------------------------------------------------

def shard_rows(rows: int, world_size: int, rank: int) -> tuple:
    """(rows held, rows of padded storage) of a dim 0 of `rows` split the way FSDP2 splits it:
    torch.chunk's pieces of ceil(rows / W), the last ranks holding fewer (or none)."""
    per_rank = math.ceil(rows / world_size)
    held = max(0, min(per_rank, rows - rank * per_rank))
    return held, per_rank


def expected_bytes(shapes: list, strategy: str, world_size: int, rank: int) -> dict:
    """What the formula says `rank` holds after a step, for parameters of these shapes."""
    numel = sum(math.prod(s) for s in shapes)
    if strategy == "ddp":
        return {"params": FP32 * numel, "grads": FP32 * numel, "optimizer": FP32 * numel}
    padded = held = 0
    for shape in shapes:
        rest = math.prod(shape[1:])
        rows_held, rows_padded = shard_rows(shape[0], world_size, rank)
        padded += rows_padded * rest
        held += rows_held * rest
    return {"params": FP32 * padded, "grads": FP32 * padded, "optimizer": FP32 * held}


# --- one rank's measurement -----------------------------------------------------------

def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (a view counts its storage once)."""
    from torch.distributed.tensor import DTensor
    seen = {}
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def whole_param_bytes(model) -> int:
    """Bytes of the model's parameters that are whole (not a DTensor shard) right now."""
    from torch.distributed.tensor import DTensor
    return sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))


class WholeParamsPeak:
    """The largest whole_param_bytes seen before and after every module's forward and when
    each module's backward starts (a hook on its output's gradient)."""

    def __init__(self, model):
        self.model, self.peak, self.handles = model, 0, []
        for module in model.modules():
            self.handles.append(module.register_forward_pre_hook(lambda *_: self.look()))
            self.handles.append(module.register_forward_hook(self.after_forward))

    def look(self, *_):
        self.peak = max(self.peak, whole_param_bytes(self.model))

    def after_forward(self, module, inputs, output):
        self.look()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self.look)  # runs when this module's backward starts

    def remove(self):
        for h in self.handles:
            h.remove()
        self.model = None  # or the model would outlive its measurement through this object


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor still alive in this process (after a
    garbage collection): what one strategy leaves behind shows here at the next one's start."""
    gc.collect()
    tensors = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type != "meta" and obj.layout == torch.strided:
                tensors.append(obj)
        except Exception:  # an object that cannot even be asked (a half-built one): not a tensor of ours
            continue
    return storage_bytes(tensors)


def release_finished_collectives(rounds: int = 3):
    """NCCL's process group keeps the tensors of a collective that no one called wait() on (DDP's
    gradient buckets: its reducer waits on their futures) until its watchdog has seen the collective
    end and a later call of the group's lets them go (ProcessGroupNCCL.hpp, shelvesToUnstash_, 2.11
    and 2.14). The watchdog looks every 100 ms: a few barriers after it has looked free them. Before
    this, the previous strategy's gradients (once or twice over) counted in the next one's figures on
    a GPU. The same number of rounds on every rank: each is a collective."""
    import torch.distributed as dist
    torch.cuda.synchronize()
    for _ in range(rounds):
        time.sleep(0.25)
        dist.barrier(device_ids=[torch.cuda.current_device()])
    torch.cuda.synchronize()


def measure_strategy(name: str, reshard, mp_policy, spec: dict, env) -> dict:
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distributed_fsdp
    from models import build_model
    from utils import compat, data, distributed as dist_utils

    use_cuda = env.device.type == "cuda"
    if use_cuda:
        release_finished_collectives()
    before = live_tensor_bytes()
    allocated_before = torch.cuda.memory_allocated() if use_cuda else None
    dist_utils.seed_everything(spec["seed"])
    torch.backends.cudnn.benchmark = use_cuda  # as the scripts set it
    # The scripts' layout on this device (NHWC on recent NVIDIA GPUs): the activations, and cuDNN's workspaces,
    # are the peak's; distributed_fsdp.py keeps its weights NCHW (fully_shard wants them contiguous).
    layout = data.memory_format(argparse.Namespace(channels_last=None), env.device)
    model = build_model(spec["model"], spec["num_classes"]).to(env.device)
    if reshard is None:
        model = model.to(memory_format=layout)
    shapes = [tuple(p.shape) for p in model.parameters()]
    if reshard is None:
        if env.distributed:  # as distributed.py wraps it: under a launcher, a group of one too
            model = DDP(model, device_ids=env.device_ids, gradient_as_bucket_view=True,
                        **compat.buffers_synced_once(model))
        watched = model.module if env.distributed else model
    else:
        distributed_fsdp.shard(model, env, reshard_after_forward=reshard, mp_policy=mp_policy)
        watched = model
    # As the scripts build it: distributed.py fused on accelerators (one kernel, no foreach
    # temporaries); distributed_fsdp.py the default (foreach on GPUs: DTensor has no fused SGD).
    fused = reshard is None and env.device.type != "cpu"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4,
                                fused=True if fused else None)
    generator = torch.Generator().manual_seed(spec["seed"] + env.rank)
    images = torch.randn(spec["batch"], 3, 32, 32, generator=generator).to(env.device, memory_format=layout)
    targets = torch.randint(0, spec["num_classes"], (spec["batch"],), generator=generator).to(env.device)
    peak = WholeParamsPeak(watched)
    for step in range(2):  # the first step creates the momentum buffers; the second is measured
        if use_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        peak.peak = 0
        loss = F.cross_entropy(model(images).float(), targets)  # bf16 logits under the bf16 policy
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    peak.remove()
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    result = {
        "strategy": name, "rank": env.rank,
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params),
        "optimizer": storage_bytes(state),
        "whole_params_peak": peak.peak,
        "expected": expected_bytes(shapes, name if reshard is None else "fsdp2", env.world_size, env.rank),
        "parameters": sum(math.prod(s) for s in shapes),
        "live_bytes_before": before,
    }
    if use_cuda:
        torch.cuda.synchronize()
        result["peak_allocated"] = torch.cuda.max_memory_allocated()
        result["allocated"] = torch.cuda.memory_allocated()
        result["allocated_before"] = allocated_before
        result["batch_bytes"] = images.nbytes + targets.nbytes
    del model, optimizer, params, state, loss, watched, peak, images, targets
    gc.collect()
    if use_cuda:
        torch.cuda.empty_cache()
    return result


def warm_up_device(spec: dict, env) -> None:
    """One forward and backward of the model before anything is measured. The first one in a
    process leaves memory allocated for good (the math libraries' workspaces: 65.0 MiB on an
    H200 with PyTorch 2.11); without this the first strategy's figures held it and the others'
    did not."""
    import torch.nn.functional as F

    from models import build_model
    torch.backends.cudnn.benchmark = True  # as measure_strategy sets it on CUDA
    model = build_model(spec["model"], spec["num_classes"]).to(env.device)
    images = torch.randn(spec["batch"], 3, 32, 32, device=env.device)
    targets = torch.zeros(spec["batch"], dtype=torch.long, device=env.device)
    F.cross_entropy(model(images), targets).backward()
    del model, images, targets
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def worker(spec: dict):
    """One rank, under torchrun: every strategy in turn, rank 0 writes all ranks' figures."""
    import torch.distributed as dist

    from utils import distributed as dist_utils, lifecycle
    job = dist_utils.job_from_env()
    env = dist_utils.setup(job, dist_utils.check_job(job, spec["device"]), timeout_s=300)
    if not env.distributed:  # a group of one, as distributed_fsdp.py makes it under plain python
        dist.init_process_group(dist.get_default_backend_for_device(env.device), store=dist.HashStore(),
                                rank=0, world_size=1)
        lifecycle.joined_a_group()
    try:
        if env.device.type == "cuda":
            warm_up_device(spec, env)
        mine = [measure_strategy(name, reshard, mp_policy, spec, env) for name, _, reshard, mp_policy in STRATEGIES]
        everyone = [None] * env.world_size
        dist.all_gather_object(everyone, mine)  # all ranks
        if env.rank == 0:
            with open(spec["out"], "w") as f:
                json.dump({"world_size": env.world_size, "device": str(env.device),
                           "ranks": [r for rank in everyone for r in rank]}, f)
    finally:
        dist_utils.cleanup()


# --- the table ------------------------------------------------------------------------

def worker_command(world_size: int, spec: dict) -> list:
    """The torchrun launch that measures every strategy at `world_size` processes; rank 0
    writes the figures to spec["out"]. main() runs it as the benchmark runs a row (run_process)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
            os.path.abspath(__file__), "--worker", json.dumps(spec)]


def table_rows(results: list) -> list:
    """One row per strategy and world size: the largest rank's figures (rank 0's, under
    torch.chunk's split), whether every rank matched the formula, and the share of DDP's."""
    rows = []
    ddp_total = {}
    for result in results:
        if "error" in result:
            rows.append({"world_size": result["world_size"], "error": result["error"]})
            continue
        for name, about, _, _ in STRATEGIES:
            ranks = [r for r in result["ranks"] if r["strategy"] == name]
            top = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
            total = top["params"] + top["grads"] + top["optimizer"]
            expected = top["expected"]
            row = {
                "strategy": name, "about": about, "world_size": result["world_size"],
                "parameters": top["parameters"], "params": top["params"], "grads": top["grads"],
                "optimizer": top["optimizer"], "total": total,
                "expected_total": sum(expected.values()),
                "matches_formula": all(r[k] == r["expected"][k] for r in ranks for k in ("params", "grads", "optimizer")),
                "whole_params_peak": top["whole_params_peak"],
                "peak_allocated": max((r["peak_allocated"] for r in ranks if "peak_allocated" in r), default=None),
            }
            if name == "ddp":
                ddp_total[result["world_size"]] = total
            row["vs_ddp"] = total / ddp_total[result["world_size"]] if result["world_size"] in ddp_total else None
            rows.append(row)
    return rows


# Measured at one process only, there is no sharding to see.
ONE_PROCESS_NOTE = (
    "One process only: each FSDP2 shard is the whole model, so these rows show what FSDP2 adds (its "
    "gathered copies), not what it saves. `python scripts/memory_table.py --device cpu` measures "
    "1, 2 and 4 processes.")
ONE_GPU_NOTE = "(One GPU allows no more: NCCL takes one process per GPU.)"


def write_markdown(path: str, report: dict):
    s = report["settings"]
    lines = [
        "# Memory per rank: DDP and FSDP2", "",
        f"{report['header']['hardware']}; PyTorch {report['header']['torch']}; {report['header']['date']}.  ",
        f"`{report['header']['command']}`", "",
        f"{s['model']} ({s['parameters']:,} parameters, P), {s['batch']} images per process, two steps of SGD "
        "with momentum; figures of the rank that holds the most (rank 0), after the second step.", "",
        "Formula per rank, fp32: DDP 4P + 4P + 4P (parameters, gradients, momentum) at any world size; "
        "FSDP2 the same split along dim 0 in W shards of ceil(rows / W) rows each, about 12P / W "
        "(see scripts/memory_table.py).", "",
        "| strategy | processes | parameters MiB | gradients MiB | optimizer MiB | total MiB | formula MiB | "
        "x DDP | whole parameters at once MiB | GPU peak MiB (largest rank) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| (all) | {r['world_size']} | failed: {r['error']} | | | | | | | |")
            continue
        formula = f"{r['expected_total'] / MB:.2f}" + ("" if r["matches_formula"] else " (differs)")
        peak = f"{r['peak_allocated'] / MB:.1f}" if r["peak_allocated"] else "GPU only"
        lines.append(f"| {r['strategy']} | {r['world_size']} | {r['params'] / MB:.2f} | {r['grads'] / MB:.2f} | "
                     f"{r['optimizer'] / MB:.2f} | {r['total'] / MB:.2f} | {formula} | {r['vs_ddp']:.2f} | "
                     f"{r['whole_params_peak'] / MB:.2f} | {peak} |")
    if {r["world_size"] for r in report["rows"]} == {1}:
        one_gpu = s.get("device") == "cuda" and s.get("gpus") == 1
        lines += ["", ONE_PROCESS_NOTE + (" " + ONE_GPU_NOTE if one_gpu else "")]
    lines += ["", "Strategies:"] + [f"- `{name}`: {about}" for name, about, _, _ in STRATEGIES] + [
        "", "\"Whole parameters at once\" is the largest number of parameter bytes unsharded on the model at "
        "one time, looked at around every module's forward and at the start of its backward: under FSDP2 "
        "with resharding, one residual stage (plus what the root holds); without it, every stage gathered "
        "in forward stays whole until its backward. For `ddp` it is the parameters themselves, "
        "already in the parameters column; under FSDP2 it is gathered copies on top of the shards (FSDP2 "
        "copies even with one process). Buffers being gathered for the next unit are not in it. The GPU "
        "peak is the most bytes that PyTorch's caching allocator had handed out at one moment of the step: "
        "what was held before it (parameters, gradients, optimizer state, the batch) and what the step "
        "allocates (activations, new gradients, gathered parameters), not NCCL's own buffers.", ""]
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines))
    os.replace(path + ".tmp", path)


# --- the run ---------------------------------------------------------------------------

def build_parser():
    from models import MODEL_NAMES
    from utils import cli
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message} (see --help)\n")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="cpu: CPU processes even where GPUs are visible (default auto: GPUs when there are any)")
    parser.add_argument("--model", choices=MODEL_NAMES, default=None, help="default: the benchmark's, resnet18")
    parser.add_argument("--world-sizes", default=None, metavar="N,N,...",
                        help="processes to measure at (default 1,2,4 on the CPU; on GPUs 1, 2, 4, ... and all "
                             "the GPUs visible)")
    parser.add_argument("--memory-batch", type=cli.positive_int, default=None, metavar="N",
                        help="images per process in the measured steps (default 32 on the CPU; on GPUs the "
                             "benchmark's, 512)")
    parser.add_argument("--row-timeout", type=cli.positive_float, default=None, metavar="SECONDS",
                        help="end a launch that runs longer (default: the benchmark's row timeout, 300)")
    parser.add_argument("--out", default=os.path.join(ROOT, "results"),
                        help="where memory.md and memory.json go (default: results/ in the repository)")
    parser.add_argument("--log-dir", default=None,
                        help="where each launch's output (memory-wN.log) is kept (default: OUT/logs)")
    # One rank's measurement, under torchrun (worker_command): --worker SPEC
    parser.add_argument("--worker", default=None, metavar="JSON", help=argparse.SUPPRESS)
    return parser


def sizes_to_measure(args, use_cuda: bool, gpus: int) -> list:
    from utils import cli
    if not args.world_sizes:
        return sorted({2 ** k for k in range(8) if 2 ** k <= gpus} | {gpus}) if use_cuda else [1, 2, 4]
    try:
        sizes = [int(n) for n in args.world_sizes.split(",") if n.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise cli.UsageError(f"--world-sizes {args.world_sizes!r}: give process counts such as 1,2,4")
    if use_cuda and max(sizes) > gpus:
        raise cli.UsageError(f"--world-sizes {args.world_sizes}: only {gpus} GPU{'s' if gpus != 1 else ''} "
                             "visible (one process per GPU); --device cpu measures CPU processes")
    return sizes


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    # The benchmark's machinery: its launch of a row (run_process: a session of its own, a timeout,
    # every process ended with it), its stop signals, its output folders and its report's header.
    import benchmark
    from models import build_model
    use_cuda, gpus = benchmark.visible_gpus(args)
    sizes = sizes_to_measure(args, use_cuda, gpus)
    model = args.model or benchmark.DEFAULTS["full"].model
    batch = args.memory_batch or (benchmark.DEFAULTS["full"].per_device_batch if use_cuda else 32)
    timeout = args.row_timeout or benchmark.DEFAULTS["full"].row_timeout
    log_dir = benchmark.output_folders(args)
    header = benchmark.describe_run(use_cuda, max(sizes) if use_cuda else 0, gpus, argv)
    print(f"{header['hardware']}; PyTorch {header['torch']}")
    print(f"memory per rank, {model}, {batch} images per process, world sizes {sizes}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    results, cut_short = [], False
    benchmark.install_stop_handlers()  # a stop signal ends the running launch and its workers, as for a row
    try:
        for size in sizes:
            out = os.path.join(log_dir, f"memory-w{size}.json")
            if os.path.exists(out):
                os.remove(out)
            spec = {"model": model, "num_classes": benchmark.NUM_CLASSES, "batch": batch,
                    "device": "cuda" if use_cuda else "cpu", "seed": 0, "out": out}
            print(f"  {size} process{'es' if size > 1 else ''} (log: {log_dir}/memory-w{size}.log)", flush=True)
            status, text = benchmark.run_process(worker_command(size, spec), env, timeout,
                                                 os.path.join(log_dir, f"memory-w{size}.log"))
            if status is None:
                results.append({"world_size": size, "error": f"timed out after {timeout:.0f} s"})
            elif status != 0 or not os.path.exists(out):  # a str: why its processes were ended
                why = status if isinstance(status, str) else f"exit status {status}"
                results.append({"world_size": size, "error": f"{why}: {benchmark.last_message(text)}"})
            else:
                with open(out) as f:
                    results.append(json.load(f))
                os.remove(out)  # folded into memory.json
        benchmark.install_stop_handlers(benchmark._record_stop_signal)
    except benchmark.Interrupted as stop:
        name, cut_short = signal.Signals(stop.signum).name, True
        done = {r["world_size"] for r in results}
        results += [{"world_size": size, "error": f"not measured: {name} ended the benchmark"}
                    for size in sizes if size not in done]
    parameters = sum(p.numel() for p in build_model(model, benchmark.NUM_CLASSES).parameters())
    report = {"header": header,
              "settings": {"model": model, "parameters": parameters, "batch": batch, "world_sizes": sizes,
                           "device": "cuda" if use_cuda else "cpu", "gpus": gpus},
              "rows": table_rows(results), "measurements": results}
    paths = {ext: os.path.join(args.out, f"memory.{ext}") for ext in ("md", "json")}
    write_markdown(paths["md"], report)
    benchmark.write_atomically(paths["json"], json.dumps(report, indent=1) + "\n")
    with open(paths["md"]) as f:
        print(f.read())
    print(f"wrote {paths['md']}, {paths['json']}")
    failed = [r for r in report["rows"] if "error" in r or not r["matches_formula"]]
    benchmark.finish(cut_short, f"the memory table stopped; what it measured is in {paths['md']}",
                     "came after the last launch; the memory table is whole",
                     f"{len(failed)} row(s) failed or differ from the formula" if failed else "")


if __name__ == "__main__":
    from utils import lifecycle
    # Through lifecycle.leave once the group is gone: gloo's threads can abort an interpreter's
    # normal teardown (see lifecycle.leave), which would fail a measurement that completed.
    lifecycle.run_main(main)
