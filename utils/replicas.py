"""Keeping DDP's replicas in agreement: --sync-bn and an end-of-run check, --verify-sync.

DDP keeps parameters identical by averaging gradients; batch-norm running statistics are updated from
each rank's own slice of the batch and drift apart, unless SyncBatchNorm computes them over the global batch."""
import torch
import torch.distributed as dist
import torch.nn as nn

from .cli import UsageError
from .distributed import print0


def add_flags(parser):
    g = parser.add_argument_group("replicas")
    # The GPU-to-CPU sync: SyncBatchNorm's forward drops the statistics of ranks that had no samples with
    # count_all[mask], whose shape depends on the values (torch/nn/modules/_functions.py; skipped only
    # while a CUDA graph is captured): 20 waits per ResNet-18 step.
    g.add_argument("--sync-bn", "--sync_bn", action="store_true",
                   help="SyncBatchNorm: batch statistics over the global batch (CUDA and XPU GPUs only); "
                        "costs an all-gather and a GPU-to-CPU sync per batch-norm layer and step")
    g.add_argument("--verify-sync", action="store_true",
                   help="at the end, check that parameters and buffers agree across ranks")


def check_flags(args, device_type: str):
    """The refusals of these flags that need no process group (the scripts' check)."""
    if args.sync_bn and device_type not in ("cuda", "xpu"):  # PyTorch's also takes HPU and out-of-tree devices
        raise UsageError(f"--sync-bn needs GPUs: these scripts use PyTorch's SyncBatchNorm on CUDA and XPU "
                         f"devices, and this run trains on {device_type} (leave --sync-bn out)")


def verify_sync(module: nn.Module):
    """Report on rank 0 whether the replicas' parameters and buffers agree with rank 0's (a collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        print0("verify-sync: a single process has nothing to compare")
        return
    names = []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        reference = tensor.detach().clone()
        dist.broadcast(reference, src=0)
        same = torch.allclose(reference, tensor.detach(), rtol=0, atol=0, equal_nan=True)  # exact; NaN agrees with NaN
        differs = torch.tensor([0 if same else 1], device=tensor.device)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)
        if differs.item():
            names.append(name)
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    batch_norm = all(n.endswith(("running_mean", "running_var", "num_batches_tracked")) for n in names)
    print0(f"verify-sync: all parameters and buffers agree across {dist.get_world_size()} ranks" if not names else
           f"verify-sync: {len(names)} tensors differ across {dist.get_world_size()} ranks: {shown}"
           + (" (batch-norm running statistics differ unless --sync-bn)" if batch_norm else ""))
