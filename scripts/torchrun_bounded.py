r"""torchrun, with a bound on how long its agent outlives its training processes.

    python scripts/torchrun_bounded.py [torchrun's arguments]     # as `torchrun ...`

It is torchrun itself (torch.distributed.run, in this process), plus one watch: once this
node's training processes have run, if none has been alive for TORCHRUN_GRACE seconds
(default 90) while torchrun is still here, it says why in one line and ends torchrun
(exit status 1). A finished job (the workers succeeded) is never cut short.

Why: a torchrun agent whose rendezvous store is unreachable (a network partition, the
store's node lost) can wait for it far longer than any timeout it is given. Its store
client, after a wait times out, asks the store to cancel the wait and then reads the answer
with no timeout (TCPStore::doWait, PyTorch 2.11 to 2.14), so the call returns only when
the kernel gives up on the connection: about 15 minutes with Linux's default
tcp_retries2. Measured on two hosts with a cut link: the workers ended --dist-timeout after
the cut, the agent on the far side of the cut was still waiting minutes later. While it
waits, it cannot restart its workers anyway.

The grace must cover a restart (torchrun --max-restarts, or an elastic job's new
rendezvous after a node left: torchrun's last call, 30 s by default, and a lost node's
heartbeats, 15 s). scripts/launch_multi_node.sh and scripts/slurm.sbatch start torchrun
through this file.
"""
import os
import sys
import threading
import time

GRACE_S = float(os.environ.get("TORCHRUN_GRACE", "90"))
POLL_S = 1.0

_last_state = None  # what torchrun's agent last found its workers doing


def _record_states():
    """Note the state of the workers each time the agent checks them (HEALTHY, FAILED,
    SUCCEEDED...): a node whose workers all succeeded is waiting for the others to finish,
    which is not for us to cut short."""
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    except ImportError:
        return
    monitor = getattr(LocalElasticAgent, "_monitor_workers", None)
    if monitor is None:
        return

    def monitored(self, worker_group):
        global _last_state
        result = monitor(self, worker_group)
        _last_state = getattr(getattr(result, "state", None), "name", None)
        return result

    LocalElasticAgent._monitor_workers = monitored


def live_children(pid: int) -> list:
    """This process's children that are running (not zombies: a worker that exited but that
    a blocked agent has not reaped yet is one)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    alive = []
    for child in found:
        try:
            with open(f"/proc/{child}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            alive.append(child)
    return alive


def _watch(pid: int):
    had_workers, since = False, None
    while True:
        time.sleep(POLL_S)
        if live_children(pid):
            had_workers, since = True, None
            continue
        if not had_workers or _last_state == "SUCCEEDED":
            continue
        since = since or time.monotonic()
        if time.monotonic() - since >= GRACE_S:
            print(f"torchrun_bounded.py: error: no training process has run on this node for {GRACE_S:g} s "
                  f"(they ended {_last_state or 'without a word'}) and torchrun is still waiting, most likely "
                  "for a rendezvous store it cannot reach (a network partition, or the store's node lost): "
                  "ending it. Check the link to the rendezvous host, then start the job again with --resume",
                  file=sys.stderr, flush=True)
            os._exit(1)


def main():
    if not sys.platform.startswith("linux"):  # /proc: the watch is Linux's; elsewhere plain torchrun
        from torch.distributed.run import main as torchrun
        return torchrun()
    _record_states()
    threading.Thread(target=_watch, args=(os.getpid(),), name="torchrun-bounded", daemon=True).start()
    from torch.distributed.run import main as torchrun
    sys.argv[0] = "torchrun"
    torchrun()


if __name__ == "__main__":
    main()
