"""Which autocast dtypes this machine can run: shared by dataparallel.py,
distributed_apex.py and the benchmark, whose lessons are how autocast and
GradScaler are used, not how to probe hardware."""
import warnings

import torch
import torch.nn.functional as F

from .cli import UsageError

AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# bfloat16 tensor cores arrived with Ampere (compute capability 8.0).
BF16_MIN_CAPABILITY = (8, 0)


def cpu_autocast_works(dtype: torch.dtype) -> bool:
    """Whether this CPU build runs a convolution in `dtype` under autocast (older builds
    warn and fall back to float32 for float16, or raise)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.amp.autocast("cpu", dtype=dtype):
                out = F.conv2d(torch.ones(1, 1, 4, 4), torch.ones(1, 1, 3, 3))
        except (RuntimeError, TypeError, ValueError):
            return False
    return out.dtype == dtype


def cuda_bf16_native(device=None) -> bool:
    """Whether the GPU computes bfloat16 in hardware (Ampere or newer).

    torch.cuda.is_bf16_supported() also answers True on older GPUs (Volta, Turing),
    where bfloat16 is emulated in float32 arithmetic: it runs, but slower than float16
    and often slower than float32, which is not what --amp bf16 is asked for."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= BF16_MIN_CAPABILITY


def default_amp(device_type: str) -> str:
    """--amp when none is given: bf16 where it is native (no GradScaler, float32's range),
    fp16 on older GPUs, bf16 on the CPU."""
    if device_type == "cuda" and not cuda_bf16_native():
        return "fp16"
    return "bf16"


def autocast_dtype(name: str, device_type: str) -> torch.dtype:
    """The dtype for --amp NAME on this device, or UsageError naming the alternative."""
    dtype = AMP_DTYPES[name]
    other = "bf16" if name == "fp16" else "fp16"
    if device_type == "cpu" and not cpu_autocast_works(dtype):
        raise UsageError(f"--amp {name}: this PyTorch build cannot autocast to {dtype} on the CPU; "
                         f"use --amp {other}")
    if device_type == "cuda" and dtype == torch.bfloat16 and not cuda_bf16_native():
        major, minor = torch.cuda.get_device_capability()
        raise UsageError(f"--amp bf16: this GPU (compute capability {major}.{minor}) has no bfloat16 "
                         "hardware; it needs Ampere or newer (8.0); use --amp fp16")
    return dtype
