"""Two measurements beside `make gpu-check`, on one GPU (run from the repository's root):

  1. loader: the template's training loader alone, as distributed.py builds it (CIFAR-format
     files of synthetic images, 15 workers, uint8 batches normalised on the GPU), with no model:
     how many images per second it can hand to the step, per epoch, whole epochs timed.
  2. profile: the bf16 training step alone (ResNet-18, batch 512, fused SGD) in NCHW eager,
     channels_last eager and channels_last torch.compile (default mode): ms per step timed with
     CUDA events, then 10 steps under torch.profiler: each kernel family's GPU time per step,
     and the GPU's busy share of the step.

    python results/gpu-check-2026-11-29-h200/probe.py [loader] [profile] [--out DIR]
"""
import argparse
import os
import pickle
import re
import shutil
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)
from models import MODEL_NAMES, build_model  # noqa: E402
from utils import cli, data, device_data  # noqa: E402
from utils.distributed import DistEnv  # noqa: E402

BATCH = 512
STEPS = 97  # the benchmark's epoch: 97 steps of 512


def loader(device, workers: int, epochs: int = 4):
    folder = tempfile.mkdtemp(prefix="probe-cifar-")
    try:
        os.mkdir(os.path.join(folder, "cifar-100-python"))
        for split, count in (("train", BATCH * STEPS), ("test", 1)):
            synthetic = data.SyntheticCIFAR(split == "train", count)
            pixels, labels = device_data.uint8_images(synthetic)
            with open(os.path.join(folder, "cifar-100-python", split), "wb") as f:
                pickle.dump({"data": pixels.transpose(0, 3, 1, 2).reshape(count, -1), "fine_labels": labels}, f,
                            protocol=2)
        with open(os.path.join(folder, "cifar-100-python", "meta"), "wb") as f:
            pickle.dump({"fine_label_names": synthetic.classes}, f, protocol=2)
        parser = cli.build_parser(__doc__, MODEL_NAMES)
        args = cli.parse_args(parser, ["--dataset", "cifar100", "--data-dir", folder, "--batch-size", str(BATCH),
                                       "--workers", str(workers), "--train-samples", str(BATCH * STEPS)])
        env = DistEnv(0, 0, 1, 1, device=device)
        train_set, _ = data.build_datasets(args, env)
        train_loader = data.train_loader(train_set, BATCH, BATCH, env, args)
        for layout in (torch.contiguous_format, torch.channels_last):
            to_model = data.model_inputs(train_set, device, layout)
            for epoch in range(epochs):
                train_loader.sampler.set_epoch(epoch, start_step=0)
                began = time.perf_counter()
                n = 0
                for images, targets in train_loader:
                    images = to_model(images)
                    targets = targets.to(device, non_blocking=True)
                    n += images.shape[0]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds = time.perf_counter() - began
                print(f"loader {workers} workers, {str(layout).split('.')[-1]}, epoch {epoch + 1}: {n} images in "
                      f"{seconds:.3f} s, {n / seconds:,.0f} img/s (whole epoch)", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


FAMILIES = [  # first match names the kernel's family
    ("triton (Inductor)", r"triton"),
    ("batch norm", r"batch_norm|batchnorm|bn_fw|bn_bw|bn_|welford"),
    ("optimizer", r"fused_sgd|multi_tensor|_fused_"),
    ("layout transposes", r"nchwtonhwc|nhwctonchw|transpose"),
    ("convolution", r"conv|xmma|implicit_gemm|cudnn|dgrad|wgrad|fprop|sm90_|cutlass|gemm"),
    ("elementwise, copies", r"elementwise|vectorized|copy|memcpy|memset|fill|cat|reduce"),
]


def family(name: str) -> str:
    lowered = name.lower()
    for label, pattern in FAMILIES:
        if re.search(pattern, lowered):
            return label
    return "other"


def profile(device, out_dir):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    for name, layout, mode in (("bf16 NCHW eager", torch.contiguous_format, ""),
                               ("bf16 channels_last eager", torch.channels_last, ""),
                               ("bf16 channels_last compile", torch.channels_last, "default")):
        torch.manual_seed(0)
        model = build_model("resnet18", 100).to(device, memory_format=layout)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4,
                                    fused=True)
        images = torch.randn(BATCH, 3, 32, 32, device=device).contiguous(memory_format=layout)
        targets = torch.randint(0, 100, (BATCH,), device=device)
        forward = torch.compile(model, mode=mode) if mode else model

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(forward(images), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        began = time.perf_counter()
        for _ in range(25):
            step()
        torch.cuda.synchronize(device)
        warm = time.perf_counter() - began
        windows = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(40):
                step()
            end.record()
            end.synchronize()
            windows.append(start.elapsed_time(end) / 40)
        windows.sort()
        ms = windows[2]
        steps = 10
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize(device)
        kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
        total = sum(e.self_device_time_total for e in kernels) / 1000 / steps  # ms per step
        by_family = {}
        for e in kernels:
            by_family.setdefault(family(e.key), [0.0, 0])
            by_family[family(e.key)][0] += e.self_device_time_total / 1000 / steps
            by_family[family(e.key)][1] += e.count / steps
        print(f"\n== {name}: warm-up (25 steps, compile included) {warm:.1f} s; step {ms:.2f} ms (median of 5 windows "
              f"of 40, {min(windows):.2f}-{max(windows):.2f}), {BATCH / ms * 1000:,.0f} img/s", flush=True)
        print(f"kernels: {total:.2f} ms of GPU time per step under the profiler, {total / ms:.0%} of the timed step")
        for label, (t, count) in sorted(by_family.items(), key=lambda kv: -kv[1][0]):
            print(f"  {label:22s} {t:7.2f} ms/step {t / total:6.1%}  {count:6.0f} launches/step")
        print("top kernels (GPU time per step):")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]:
            print(f"  {e.self_device_time_total / 1000 / steps:7.3f} ms {e.count / steps:5.0f}x  {family(e.key):20s} "
                  f"{e.key[:110]}")
        if out_dir and mode:
            prof.export_chrome_trace(os.path.join(out_dir, "step_trace_compile.json"))
        del model, optimizer, forward
        torch.cuda.empty_cache()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("parts", nargs="*", default=["loader", "profile"])
    parser.add_argument("--out", default="")
    parser.add_argument("--workers", type=int, default=15)
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")  # cpu: loader only
    print(torch.__version__, torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", flush=True)
    if "loader" in args.parts:
        loader(device, args.workers)
    if "profile" in args.parts:
        profile(device, args.out)
