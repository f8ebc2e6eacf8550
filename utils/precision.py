"""Which autocast dtypes this machine can run: shared by dataparallel.py and
distributed_apex.py, whose lessons are how autocast and GradScaler are used."""
import warnings

import torch
import torch.nn.functional as F

from .cli import UsageError

AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


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


def autocast_dtype(name: str, device_type: str) -> torch.dtype:
    """The dtype for --amp NAME on this device, or UsageError naming the alternative."""
    dtype = AMP_DTYPES[name]
    other = "bf16" if name == "fp16" else "fp16"
    if device_type == "cpu" and not cpu_autocast_works(dtype):
        raise UsageError(f"--amp {name}: this PyTorch build cannot autocast to {dtype} on the CPU; "
                         f"use --amp {other}")
    if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UsageError("--amp bf16: this GPU has no bfloat16 support (it needs Ampere or newer); "
                         "use --amp fp16")
    return dtype
