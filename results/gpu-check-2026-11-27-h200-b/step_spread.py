"""How much does one FSDP2 training step's time vary, with the bf16 policy and without?
One process, the model sharded by distributed_fsdp.shard() itself, synthetic data already on
the device (no loader). Rounds of the two policies alternate, so that a slow spell of the
machine shows in both. Per round: the step's wall time (the GPU waited for) as median,
10th and 90th percentile and maximum; the host's CPU time per step; and Python's garbage
collections during the round and the time they took, one suspect for slow steps."""
import gc, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import torch, torch.distributed as dist, torch.nn.functional as F
from models import build_model
import distributed_fsdp
from utils.distributed import DistEnv

cuda = torch.cuda.is_available()
dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(0)
fd, path = tempfile.mkstemp()
os.close(fd)
dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{path}", rank=0, world_size=1)
env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=dev, distributed=True)
batch = int(os.environ.get("SPREAD_BATCH", "512"))
steps = int(os.environ.get("SPREAD_STEPS", "100"))
rounds = int(os.environ.get("SPREAD_ROUNDS", "3"))
size = int(os.environ.get("SPREAD_SIZE", "32"))
torch.backends.cudnn.benchmark = cuda
sync = torch.cuda.synchronize if cuda else (lambda: None)

gc_time = [0.0, 0, None]  # seconds in collections, collections, start of the current one
def on_gc(phase, info):
    if phase == "start":
        gc_time[2] = time.perf_counter()
    elif gc_time[2] is not None:
        gc_time[0] += time.perf_counter() - gc_time[2]
        gc_time[1] += 1
gc.callbacks.append(on_gc)

runs = {}
for policy in ("bf16", "none"):
    torch.manual_seed(0)
    model = build_model("resnet18", 100).to(dev)
    distributed_fsdp.shard(model, env, reshard_after_forward=True, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 100, (batch,), device=dev)
    runs[policy] = (model, opt, x, y)

def step(model, opt, x, y):
    loss = F.cross_entropy(model(x).float(), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss

for policy, run in runs.items():  # warm-up: cudnn's algorithm search, FSDP's lazy init
    for _ in range(15):
        step(*run)
sync()
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if cuda else 'cpu'}, batch {batch}, "
      f"{steps} steps a round", flush=True)
for r in range(rounds):
    for policy, run in runs.items():
        times, issued = [], []
        gc_time[:2] = [0.0, 0]
        cpu0 = time.process_time()
        wall0 = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            loss = step(*run)
            issued.append(time.perf_counter() - t)  # the host has queued the step's work
            sync()
            times.append(time.perf_counter() - t)
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0
        q = statistics.quantiles(times, n=10)
        med = statistics.median(times)
        print(f"round {r} {policy:4s}: step ms median {med*1e3:6.2f} p10 {q[0]*1e3:6.2f} p90 {q[-1]*1e3:6.2f} "
              f"max {max(times)*1e3:7.2f}  issued in {statistics.median(issued)*1e3:6.2f}  {batch/med:7.0f} img/s  host CPU {cpu/steps*1e3:6.2f} ms/step "
              f"({cpu/wall:.2f} of a core)  gc {gc_time[1]} x {gc_time[0]*1e3:.1f} ms  loss {loss.item():.3f}",
              flush=True)
if os.environ.get("SPREAD_PROFILE"):  # where the host's time goes (=cuda: the GPU's too), 20 steps of each policy
    from torch.profiler import profile, ProfilerActivity
    from torch.autograd import DeviceType
    for policy, run in runs.items():
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if os.environ.get("SPREAD_PROFILE") == "cuda" else [])
        t = time.perf_counter()
        with profile(activities=acts) as prof:
            for _ in range(20):
                step(*run)
            sync()
        wall = time.perf_counter() - t
        events = prof.key_averages()
        print(f"== host profile, {policy}", flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48), flush=True)
        if ProfilerActivity.CUDA in acts:  # the kernels' own time: the GPU's work per step
            # Only the device's own events, as the table's "Self CUDA time total" sums them
            # (torch/autograd/profiler_util.py): an operator's row carries its kernels' time too.
            busy_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
            print(f"{policy}: GPU kernels {busy_us / 20 / 1e3:.2f} ms per step, in steps of "
                  f"{wall / 20 * 1e3:.2f} ms under the profiler", flush=True)
dist.destroy_process_group()
os.unlink(path)
