"""What differs between PyTorch releases the scripts run on (2.11, the oldest, to the newest), chosen here by feature,
each with the same behaviour on both sides. When the oldest supported release moves past one, its branch goes."""
import atexit
import inspect

import torch
import torch.distributed as dist

# DDP's switch for broadcasting rank 0's buffers (batch-norm statistics) before every forward is `broadcast_buffers`
# up to PyTorch 2.12 and `forward_sync_buffers` from 2.13, where the old name warns (FutureWarning) on every wrap.
# Not a plain rename: broadcast_buffers=False also leaves the buffers out of the constructor's broadcast of rank 0's
# state, while forward_sync_buffers=False keeps them in it (torch/nn/parallel/distributed.py, __init__).
_DDP_HAS_FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in inspect.signature(
    torch.nn.parallel.DistributedDataParallel.__init__).parameters


def buffers_synced_once(model: torch.nn.Module) -> dict:
    """DDP keyword arguments that broadcast rank 0's buffers to every rank once, when DDP wraps the
    model, and never again before a forward; before 2.13 that broadcast is made here instead. Call
    it on every rank, just before DDP(...): before 2.13 it is a collective."""
    if _DDP_HAS_FORWARD_SYNC_BUFFERS:
        return {"forward_sync_buffers": False}
    for buffer in model.buffers():
        dist.broadcast(buffer.data, src=0)  # all ranks meet here, as in DDP's constructor
    return {"broadcast_buffers": False}


# torch.profiler.profile's keywords for a schedule of one window (repeat=1): acc_events=True changes nothing there
# but 2.11's warning, from the first window, that events are not kept between windows (2.14 warns from the second).
ONE_WINDOW = {"acc_events": True}


def kill_loader_workers_first_at_exit(kill):
    """2.11's exit handler for each worker of a persistent, pinned-memory loader joins it (never told to stop) for
    5 s, then sends SIGTERM, which ours ignore: `kill`, registered again, runs first and leaves none to wait for.
    2.14's one handler stops the loaders' iterators, and runs before `kill`."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    if not hasattr(_MultiProcessingDataLoaderIter, "_clean_up_persistent_workers_atexit"):
        atexit.unregister(kill)
        atexit.register(kill)
