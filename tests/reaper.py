"""Ends what a test process started, once that process is gone, however it ended.

    python tests/reaper.py OWNER_PID        (conftest.start_reaper starts it)

Every process the suite starts carries its test process's pid in OWNERS_VAR: conftest puts it
in os.environ, and children inherit it through torchrun, mp.spawn, `ip netns exec`, Slurm's
daemons and the job scripts and tasks they run, in whatever session or network namespace
they end up. When the owner exits, this process sends SIGTERM to every process that still
carries its pid, then SIGKILL to those left after GRACE seconds, and removes the test hosts
(scripts/netns_hosts.py) whose slot the owner held, with every process on them: slurmstepd,
which slurmd starts with an environment of its own, is ended that way (seen: the mark in
munged, slurmctld, slurmd, the batch shell, srun and torchrun's agents, not in slurmstepd;
a one-node cluster, where namespaces are not available, leaves its slurmstepd to end once
its job's processes have). The mark is read from /proc/PID/environ, which exec sets up: a
process the owner forks without exec (the DataLoader workers of a run made inside the test
process) carries the marks of the owner's own parents only; such workers end when their
parent does (torch's ManagerWatchdog, every 5 s).

Why it is needed: a test's own teardown is not always allowed to finish. On Ctrl-C under
pytest-xdist, the controller asks each worker to stop; a worker whose work is still running
5 s later sends itself another SIGINT (execnet 2.1), which can land inside a fixture's
teardown, and the controller kills a worker still there 10 s after asking (pytest-xdist 3.8,
EXIT_TIMEOUT). Measured: a Ctrl-C during the Slurm tests left munged, a slurmstepd with its
job, and the cluster's network namespaces running after `make test` had exited. A worker
killed outright (SIGKILL, the OOM killer) runs no teardown at all.

Standard library only, and no torch: it starts in a few milliseconds and waits without using
the CPU (a pidfd, Linux 5.3 and later; polling once a second otherwise)."""
import os
import select
import signal
import sys
import time

OWNERS_VAR = "TESTS_STARTED_BY"  # ":pid:pid:": every test process above this one
GRACE = 3.0  # seconds between SIGTERM and SIGKILL: a training run saves its checkpoint in this time

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def owned_by(owner: int) -> list:
    """Every live process whose environment, as its last exec set it up, names owner."""
    needle = f"{OWNERS_VAR}=".encode()
    mark = f":{owner}:".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                variables = f.read().split(b"\0")
        except OSError:  # gone, or a kernel thread
            continue
        if any(v.startswith(needle) and mark in v for v in variables):
            found.append(int(entry))
    return found


def wait_until_gone(pid: int):
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (an older kernel), or already gone
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:  # alive, as another user
                pass
            time.sleep(1.0)
    try:
        select.select([fd], [], [])  # readable once the process has exited
    finally:
        os.close(fd)


def signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def take_over_slots(owner: int) -> list:
    """The test hosts' slots the owner held, now held by this process: until they are
    removed, nobody reclaims them as a dead holder's (netns_hosts.slots_locked)."""
    try:
        sys.path.insert(0, SCRIPTS)
        import netns_hosts
    except ImportError:
        return []
    if not os.path.isdir(netns_hosts.STATE_DIR):
        return []
    taken = []
    with netns_hosts.slots_locked():
        for entry in os.listdir(netns_hosts.STATE_DIR):
            folder = os.path.join(netns_hosts.STATE_DIR, entry)
            if entry.startswith("slot") and entry[4:].isdigit() and netns_hosts._holder(folder) == owner:
                netns_hosts.set_holder(folder, os.getpid())
                taken.append(int(entry[4:]))
    return taken


def reap(owner: int):
    slots = take_over_slots(owner)
    # SIGTERM to every marked process, and to any started meanwhile (a stop handler's, a
    # restart's) for GRACE seconds; then SIGKILL until none is left.
    termed = set()
    deadline = time.monotonic() + GRACE
    while True:
        left = owned_by(owner)
        if not left or time.monotonic() >= deadline:
            break
        signal_all([pid for pid in left if pid not in termed], signal.SIGTERM)
        termed.update(left)
        time.sleep(0.1)
    for _ in range(50):
        if not left:
            break
        signal_all(left, signal.SIGKILL)
        time.sleep(0.1)
        left = owned_by(owner)
    if slots:
        import netns_hosts
        with netns_hosts.slots_locked():  # the removal whole before anyone claims the slot again
            for slot in slots:
                netns_hosts.remove_slot(slot)  # with every process on them, marked or not


def main():
    owner = int(sys.argv[1])
    # Detached: not a child of the owner (whose tests may count their children), and in a
    # session of its own, so the terminal's Ctrl-C and SIGHUP reach the owner but not here.
    if os.fork():
        os._exit(0)
    os.setsid()
    wait_until_gone(owner)
    reap(owner)


if __name__ == "__main__":
    main()
