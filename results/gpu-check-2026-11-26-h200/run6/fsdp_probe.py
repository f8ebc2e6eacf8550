"""Why does FSDP2 with the bf16 policy train slower than fp32? Times the training step of
each way of sharding the ResNet-18, one process, at several batch sizes."""
import os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from models import build_model

cuda = torch.cuda.is_available()
dev = torch.device("cuda" if cuda else "cpu")
if cuda: torch.cuda.set_device(0)
fd, path = tempfile.mkstemp()
dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{path}", rank=0, world_size=1)
mesh = init_device_mesh(dev.type, (1,))
BN = torch.nn.modules.batchnorm._BatchNorm
bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

def stages(model, policy):
    for s in (model.layer1, model.layer2, model.layer3, model.layer4):
        fully_shard(s, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)

def v_fp32(m):
    stages(m, MixedPrecisionPolicy()); return None
def v_bn_units(m):  # the script today: one unit per batch norm, fp32, input cast up, output down
    p = MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)
    for mod in m.modules():
        if isinstance(mod, BN): fully_shard(mod, mesh=mesh, mp_policy=p)
    stages(m, bf16); return None
def v_bn_group(m):  # every batch norm in one fp32 unit, no casts: bf16 input, fp32 weight (as autocast runs it)
    p = MixedPrecisionPolicy(param_dtype=torch.float32, cast_forward_inputs=False)
    fully_shard([mod for mod in m.modules() if isinstance(mod, BN)], mesh=mesh, mp_policy=p)
    stages(m, bf16); return None
def v_autocast(m):  # fp32 FSDP, bf16 autocast around forward
    stages(m, MixedPrecisionPolicy()); return torch.bfloat16
def v_none(m):  # no FSDP at all, bf16 autocast: the plain step
    return torch.bfloat16
def v_none32(m):
    return None

VARIANTS = dict(fp32=v_fp32, bn_units=v_bn_units, bn_group=v_bn_group, autocast=v_autocast,
                plain_bf16=v_none, plain_fp32=v_none32)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
batches = [int(b) for b in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["512"])]
size = int(os.environ.get("PROBE_SIZE", "32")); warm = int(os.environ.get("PROBE_WARM", "15")); steps = int(os.environ.get("PROBE_STEPS", "30"))
cl = torch.channels_last if os.environ.get("PROBE_CL") else torch.contiguous_format
torch.backends.cudnn.benchmark = cuda
sync = torch.cuda.synchronize if cuda else (lambda: None)
for batch in batches:
    for name in names:
        torch.manual_seed(0)
        m = build_model("resnet18", 100).to(dev)
        ac = VARIANTS[name](m)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(batch, 3, size, size, device=dev).to(memory_format=cl); y = torch.randint(0, 100, (batch,), device=dev)
        times = []
        if cuda: torch.cuda.reset_peak_memory_stats()
        for i in range(warm + steps):
            sync(); t = time.perf_counter()
            with torch.autocast(dev.type, dtype=ac, enabled=ac is not None):
                out = m(x)
            loss = F.cross_entropy(out.float(), y)
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
            sync(); times.append(time.perf_counter() - t)
        med = statistics.median(times[warm:])
        cpu_t = None
        if os.environ.get("PROBE_CPUTIME"):  # host time of one step without waiting for the GPU
            sync(); t = time.perf_counter()
            for _ in range(5):
                with torch.autocast(dev.type, dtype=ac, enabled=ac is not None):
                    out = m(x)
                loss = F.cross_entropy(out.float(), y); opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
            cpu_t = (time.perf_counter() - t) / 5; sync()
        if os.environ.get("PROBE_PROFILE") == name and batch == batches[0]:
            from torch.profiler import profile, ProfilerActivity
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                for _ in range(3):
                    with torch.autocast(dev.type, dtype=ac, enabled=ac is not None):
                        out = m(x)
                    loss = F.cross_entropy(out.float(), y); opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
                sync()
            key = "self_device_time_total" if cuda else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60), flush=True)
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0
        print(f"batch {batch:5d} {name:11s} step {med*1e3:8.2f} ms  {batch/med:9.0f} img/s  loss {loss.item():.3f}"
              f"  out {out.dtype}  peak {peak:7.0f} MiB" + (f"  host {cpu_t*1e3:.2f} ms" if cpu_t else ""), flush=True)
        del m, opt
dist.destroy_process_group(); os.unlink(path)
