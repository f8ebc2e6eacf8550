"""Which autocast dtypes this machine can run, and the precision that distributed_apex.py's --amp,
--amp-impl and --opt-level choose (NVIDIA apex recognised by its features): shared by dataparallel.py,
distributed_apex.py and the benchmark, whose lessons are how autocast and GradScaler are used, not how
to probe hardware or map flags."""
import importlib
import warnings
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .cli import UsageError
from .distributed import print0

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
    """Whether the GPU computes bfloat16 in hardware: NVIDIA's from Ampere on. Under ROCm the capability
    is the gfx architecture (9.4: gfx942), so every AMD GPU passes, as torch.cuda.is_bf16_supported() has it.

    torch.cuda.is_bf16_supported() also answers True on older GPUs (Volta, Turing),
    where bfloat16 is emulated in float32 arithmetic: it runs, but slower than float16
    and often slower than float32, which is not what --amp bf16 is asked for."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= BF16_MIN_CAPABILITY


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


# --- choosing the precision ------------------------------------------------------------
# apex.amp opt levels when distributed_apex.py has no apex.amp to hand them to:
#   O0  float32 throughout                 -> no autocast, scaler disabled ("fp32")
#   O1  per-op casts + dynamic loss scale  -> autocast + GradScaler: its direct successor
#   O2  fp16 model + fp32 master weights   -> the same as O1: autocast keeps the weights in
#                                             float32, which is what master weights were for
#   O3  pure fp16, no master weights       -> refused: torch.amp has no such mode


class Precision(NamedTuple):
    name: str          # "fp16", "bf16" or "fp32", for the metrics
    dtype: Any         # autocast dtype; None: no torch autocast (float32, or apex.amp does the casting)
    opt_level: Any     # apex.amp's opt level, or the one mapped onto torch.amp; None if not given
    fused_sgd: Any     # apex.optimizers.FusedSGD, or None for torch.optim.SGD
    apex_amp: Any      # the apex.amp module, or None for torch.amp


def choose_precision(args, device_type: str) -> Precision:
    """Resolve --amp, --amp-impl and --opt-level for this device, or raise UsageError."""
    fused_sgd = apex_amp = None
    if args.amp_impl == "apex":
        fused_sgd, apex_amp = find_nvidia_apex()
        if device_type != "cuda":
            raise UsageError("NVIDIA apex runs on CUDA GPUs only; elsewhere use --amp-impl torch (the default)")
        if apex_amp is None:
            print0("apex: FusedSGD from NVIDIA apex; this apex has no apex.amp (removed in 2025), so mixed "
                   "precision comes from torch.amp")
    name = args.amp
    if args.opt_level == "O0" and name is not None:
        raise UsageError(f"--opt-level O0 means float32 throughout, which contradicts --amp {name}")
    if apex_amp is not None:
        if name == "bf16":
            raise UsageError("apex.amp is float16 only: for --amp bf16 use --amp-impl torch")
        opt_level = args.opt_level or "O1"
        return Precision("fp32" if opt_level == "O0" else "fp16", None, opt_level, fused_sgd, apex_amp)

    if args.opt_level == "O3":
        raise UsageError("--opt-level O3 (pure float16, no float32 master weights) has no torch.amp "
                         "equivalent: use O1 or O2 (autocast + GradScaler), or an apex with apex.amp")
    if name is None and args.opt_level != "O0":  # O0: float32 throughout, no autocast
        # apex's O1/O2 are float16 levels; with neither flag, bf16 (no loss scaling needed) on
        # the CPU and where the GPU has it in hardware, fp16 on older GPUs.
        name = "fp16" if args.opt_level or device_type == "cuda" and not cuda_bf16_native() else "bf16"
        if not args.opt_level:
            print0(f"no --amp given: using {name} on the {'CPU' if device_type == 'cpu' else 'GPU'}")
    dtype = autocast_dtype(name, device_type) if name else None
    if fused_sgd is not None and dtype == torch.float16:
        # GradScaler.step gives an optimizer without built-in scaling support (apex's FusedSGD)
        # its step only after reading the inf check back with .item(): the CPU would wait for
        # the GPU at every step. torch's fused SGD unscales and skips inside its own kernel.
        print0("apex: with fp16 and torch's GradScaler, torch's fused SGD replaces apex's FusedSGD "
               "(which would make every step wait for the GPU)")
        fused_sgd = None
    return Precision(name or "fp32", dtype, args.opt_level, fused_sgd, None)


def find_nvidia_apex():
    """(FusedSGD or None, apex.amp or None) from an installed NVIDIA apex.

    Recognised by what it provides, not by its name: the PyPI package called
    `apex` is an unrelated web toolkit, and current NVIDIA apex no longer has
    apex.amp. Neither feature present is a UsageError.
    """
    fused_sgd = apex_amp = None
    try:  # a broken build can fail in many ways on import; one without its CUDA extensions (built
        # without --cuda_ext) imports FusedSGD, whose constructor then raises
        if importlib.import_module("apex.multi_tensor_apply").multi_tensor_applier.available:
            fused_sgd = getattr(importlib.import_module("apex.optimizers"), "FusedSGD", None)
    except Exception:
        pass
    try:
        apex_amp = importlib.import_module("apex.amp")
        if not all(callable(getattr(apex_amp, name, None)) for name in ("initialize", "scale_loss")):
            apex_amp = None
    except Exception:
        pass
    if fused_sgd is None and apex_amp is None:
        raise UsageError(
            "--amp-impl apex needs NVIDIA apex, built from source with its CUDA extensions "
            "(github.com/NVIDIA/apex); the PyPI package called `apex` is unrelated; --amp-impl torch (the default) "
            "is the upstream successor of apex.amp")
    return fused_sgd, apex_amp
