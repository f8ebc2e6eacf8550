"""A training process's life: how it ends (`run_main`, `leave`), its loader workers, and the stop signals
(Ctrl-C, `scancel --signal`, preemption), which reach the whole process group, workers included: these leave
them to their rank (`ignore_stop_signals`), which stops at a step all ranks agree on (utils/run.py)."""
import atexit
import contextlib
import datetime
import json
import multiprocessing.util
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from urllib.parse import urlparse

from . import compat
from .cli import UsageError, error_line, print_line, prints_errors

# SIGHUP: a closed terminal or a dropped ssh session; torchrun forwards it to its workers, as it does SIGTERM.
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
SHM_DIR = "/dev/shm"  # where DataLoader workers put the batches they hand over (Linux)

# What a rank's error says when a peer died or left (gloo's sockets; utils.distributed.meeting).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Another rank never came")

_as_program = False  # run_main called as the program (argv None): the process ends with it
_joined_a_group = False
_stopping = False  # a stop signal is being handled (stop_under_way)
_loader_workers = weakref.WeakSet()  # the worker processes our loaders started
_kill_at_exit_registered = False
_deadlines = {}  # what `deadline` watches: {key: (time.monotonic() to end at, line, exit status)}
_watchdog = None


def joined_a_group(store=None):
    """From now on a refusal is told through the group's own `store` (tell_the_job), and an error that a lost
    peer caused is reported a second after the peer's (run_main)."""
    global _joined_a_group, _group_store
    _joined_a_group, _group_store = True, store


def run_main(main, argv=None):
    """Call main(argv); a UsageError becomes one line on stderr (printed as its met_by says) and exit
    status 2. Any other exception is a bug, which torchelastic's @record writes where torchrun reads
    it: torchrun then reports the failing rank's error first, not the timeouts of the ranks that
    waited for it. As the program (argv None), a process that joined a group leaves through `leave`."""
    from torch.distributed.elastic.multiprocessing.errors import record
    failed_at = []  # when main raised: the time torchrun orders the ranks' failures by

    def guarded():
        try:
            main(argv)
        except UsageError as err:
            refuse(str(err), prints_errors(err.met_by))
            sys.exit(2)
        except KeyboardInterrupt:
            sys.exit(130)
        except Exception as err:
            failed_at.append(time.time())
            loader_sigchld_off()  # before @record writes the error file
            if _joined_a_group and isinstance(err, RuntimeError) and any(w in str(err) for w in _PEER_LOST):
                # Only a consequence of a peer's failure: reported a second later, since torchrun names
                # as root cause the error file with the earliest time (whole seconds).
                time.sleep(1.0)
            raise

    if argv is not None:  # a caller's own process: it keeps its handlers and its exit
        return record(guarded)()
    global _as_program
    _as_program = True
    try:
        record(guarded)()
    except SystemExit as stop:
        if not _joined_a_group:
            raise
        leave(*exit_status(stop))
    except Exception as err:
        if (message := bus_error_message(err)) is not None:  # this rank's own line (torchrun: in its error file too)
            # The other loader workers end first: one whose batch was being handed over when the loader
            # raised has a thread (multiprocessing's resource sharer) that would print a traceback after it.
            kill_loader_workers(wait_s=5.0)
            record_for_torchrun(error_line(message), failed_at[0] if failed_at else None)
            if _joined_a_group:
                leave(1, message=error_line(message))
            print_line(error_line(message))
            sys.exit(1)
        if not _joined_a_group:
            raise
        # A failure after joining (a bug, a dead peer): leave, as the teardown of a rank whose peer died can hang.
        traceback.print_exc()
        leave(1)
    finally:  # ending: the interpreter's teardown puts back the default of a signal handled in Python, which kills
        ignore_stop_signals()  # (a second Ctrl-C, the one mp.spawn's parent forwards, a repeated kill)
    if _joined_a_group:
        leave(0)


def exit_status(stop: SystemExit) -> tuple:
    """(status, line to print) by sys.exit's own rule: None is 0, an int is itself, anything else is printed, 1."""
    text = stop.code is not None and not isinstance(stop.code, int)
    return (1, str(stop.code)) if text else (stop.code or 0, None)


def leave(code: int = 0, message: str = None):
    """End this process now, skipping the interpreter's teardown on purpose: gloo's threads outlive
    destroy_process_group() once DDP has used the group, and one still running while the interpreter finalizes
    can abort it (SIGABRT, a failure reported for a job that completed: tutorials/09-debugging.md). Only the atexit
    handlers run (they end the loader workers still alive and flush logging), and stdout and stderr are flushed."""
    if threading.current_thread() is threading.main_thread():  # ending now: a stop signal that comes late (mp.spawn
        ignore_stop_signals()  # forwards one) would only interrupt the exit handlers, with a traceback
    if message:
        print_line(message)
    try:
        with deadline(30, code=code):  # which no signal can interrupt now
            atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed, or a broken pipe
                stream.flush()
        os._exit(code)


# --- the launcher and the stop signals -------------------------------------------------------

def stop_signals() -> list:
    """SIGNALS, less SIGHUP where this process ignores it: `nohup python` outlives its terminal (torchrun does not)."""
    return [sig for sig in SIGNALS if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN]


def stop_under_way():
    """This process has a stop signal, its own or another rank's: watch_launcher sends none."""
    global _stopping
    _stopping = True


def watch_launcher(grace_s: float = 30.0, poll_s: float = 1.0):
    """End this process when its launcher (torchrun's agent, the mp.spawn parent) dies: a SIGTERM to itself, which
    checkpoints at the next agreed step, then SIGKILL `grace_s` later (a peer that died with the launcher never agrees).
    Polls the parent's pid (PR_SET_PDEATHSIG follows the forking thread); an mp.spawn worker's is multiprocessing's,
    dead already if it died while the worker started. Not a rank's shell (`nohup python distributed.py &` outlives it),
    nor pid 1 (torchrun may be a container's: an agent dead before this looks the same). Returns the pid or None."""
    parent, started_by = os.getppid(), multiprocessing.parent_process()
    if started_by is not None and not started_by.is_alive():  # adopted already (forkserver's: its fork server)
        parent = started_by.pid
    if parent <= 1 or started_by is None and "TORCHELASTIC_RUN_ID" not in os.environ:
        return

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        # Not during a stop: mp.spawn's workers get SIGINT when their parent dies (PR_SET_PDEATHSIG),
        # and after the stop's checkpoint a SIGTERM would end the process in the middle of its exit.
        if not _stopping:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        print_line(error_line(f"its launcher (pid {parent}) died {grace_s:.0f} s ago, and this process has not "
                              "ended since (it stops at a step all ranks agree on, every 10 steps): killing it"))
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="watch-launcher", daemon=True).start()
    return parent


@contextlib.contextmanager
def deadline(seconds: float, line=None, code: int = 1):
    """Inside, this process ends (with `line` on stderr and in torchrun's error file, and exit status `code`)
    once `seconds` have passed (`line` may be a function, called then: what was learnt meanwhile): for waits
    that overrun their own timeout, as a TCPStore call or gloo's connect across a network partition does (until
    the kernel drops the connection). One watchdog thread checks every deadline."""
    global _watchdog
    key = object()
    _deadlines[key] = (time.monotonic() + seconds, line, code)
    if _watchdog is None:
        _watchdog = threading.Thread(target=_watch_deadlines, name="deadlines", daemon=True)
        _watchdog.start()
    try:
        yield
    finally:
        _deadlines.pop(key, None)


def _watch_deadlines():
    while True:
        time.sleep(0.5)
        for when, line, code in list(_deadlines.values()):
            if time.monotonic() >= when:
                line = line() if callable(line) else line
                if line:
                    print_line(line)
                    record_for_torchrun(line)
                os._exit(code)


# --- bad input ------------------------------------------------------------------------------

def refuse(message: str, prints: bool):
    """Before exit status 2 for bad input: the line on stderr (where `prints`), in torchrun's error file, and told
    to the ranks that wait (`tell_the_job`). SIGTERM is ignored from here on: the first rank out makes torchrun's
    agent stop the others, on their way to status 2 too. Under torchrun a silent rank waits 2 s: rank 0's line first."""
    if _as_program and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    line = error_line(message)
    if prints:
        print_line(line)
    record_for_torchrun(line)
    tell_the_job(message)
    if not prints and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        time.sleep(2.0)


def record_for_torchrun(line: str, when: float = None):
    """Under torchrun, `line` where it reads a failed rank's error (TORCHELASTIC_ERROR_FILE, ErrorHandler's
    format): its summary shows as root cause the failure with the earliest `when` (whole seconds)."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):  # whole or none: torchrun's agent fails on a file cut short
        _write_whole(path, json.dumps({"message": {"message": line, "extraInfo": {
            "py_callstack": line, "timestamp": str(int(time.time() if when is None else when))}}}))


def _write_whole(path: str, text: str):
    """`text` in `path` whole or not at all (this process may be killed meanwhile); best effort."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w") as f:
            f.write(text)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


# --- telling the other ranks ------------------------------------------------------------------

# How long a refusing rank waits for the others to read its line (bounds its exit): for a node started later by
# hand, or slow to import torch from a shared file system. One that comes later waits its --dist-timeout.
DELIVERY_S = 30.0
_job = None  # where this process's job meets: set by utils.distributed, see meets_at
_group_store = None  # the formed group's store (joined_a_group)


def meets_at(rendezvous: str, rank: int, world_size: int, hosts_store: bool = False):
    """Where this process's job meets, for `tell_the_job`: "tcp://HOST:PORT", "file:///PATH", or None."""
    global _job
    _job = (rendezvous, rank, world_size, hosts_store)


def attempt_prefix() -> str:
    """This run's (SPAWNED_RUN_ID: utils/spawn.py) and attempt's keys in the job's store. Attempts are numbered only
    in torchrun's shared store, the agent's, which outlives them (the nodes' restart counts may differ)."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if shared else 0
    return f"utils/{os.environ.get('SPAWNED_RUN_ID', '')}/{count}"


def refusal_file(path: str) -> str:
    return f"{path}.refused"


def store_client(rendezvous: str, timeout_s: float, host_it: bool = False, quiet: bool = False):
    """quiet: a socket first (OSError where no one listens): a store client that finds no one logs a C++ trace."""
    from torch.distributed import TCPStore
    url = urlparse(rendezvous)
    if quiet:
        socket.create_connection((url.hostname, url.port), timeout=timeout_s).close()
    return TCPStore(url.hostname, url.port, None, host_it, timeout=datetime.timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def tell_the_job(refusal: str):
    """This process's refusal, before the group forms, where the ranks waiting to form it look (utils.distributed.
    joining): the rendezvous store, or a file beside a file:// rendezvous. The store's host (rank 0; under torchrun
    any rank, as one agent serves every node's store and the others end with it) holds on until every rank has read
    the line or refused too, DELIVERY_S at most; as long with no one to tell (None)."""
    if _job is None or _job[2] <= 1:
        return
    rendezvous, rank, world_size, hosts_store = _job
    keep_up = hosts_store or bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))  # torchrun sets it for its ranks
    if _group_store is None and rendezvous is None:
        return time.sleep(DELIVERY_S if keep_up else 0)
    if _group_store is None and rendezvous.startswith("file://"):
        return _write_whole(refusal_file(rendezvous[len("file://"):]), f"{rank}\n{refusal}")
    until, key = time.monotonic() + DELIVERY_S, f"{attempt_prefix()}/refused"
    # Exit status 2 all the same if the store stops answering (its line is on this node's stderr).
    with deadline(DELIVERY_S + 5, code=2), contextlib.suppress(Exception):  # not reachable in time
        # Once the group has formed, through its store: the host's is already listening on the port (a second
        # one fails, EADDRINUSE), and it must stay until every rank, refusing with it, is done with the store.
        store = _group_store or store_client(rendezvous, DELIVERY_S, host_it=hosts_store)
        store.set(key, f"{rank}\n{refusal}")
        store.add(key + "/read", 1)
        while keep_up and store.add(key + "/read", 0) < world_size and time.monotonic() < until:
            time.sleep(0.2)


def refusal_of_a_peer(rendezvous: str, store: list):
    """Another rank's refusal (tell_the_job) as "RANK\\nLINE", or None. store: [a client of the
    rendezvous store, or None], kept between calls (its host may not be up yet)."""
    key = f"{attempt_prefix()}/refused"
    try:
        if rendezvous.startswith("file://"):
            with open(refusal_file(rendezvous[len("file://"):])) as f:
                return f.read()
        if store[0] is None:
            store[0] = store_client(rendezvous, 5.0, quiet=True)
        if store[0].check([key]):
            return store[0].get(key).decode(errors="replace")
    except Exception:  # noqa: BLE001 - no file yet; the store not up yet, or gone: look again later
        store[0] = None
    return None


def refusal_said(store: list):
    """Count a peer's refusal as read (refusal_of_a_peer's store) once this rank has said it: the refusing rank
    may end then, its store with it. The store's host holds on, as a refusing one does, until every rank has read
    it, DELIVERY_S at most: a rank yet to read would fail to join as the store ends, blaming the network."""
    until, key = time.monotonic() + DELIVERY_S, f"{attempt_prefix()}/refused/read"
    with contextlib.suppress(Exception):  # no store (file://), or gone already
        store[0].add(key, 1)
        while _job[3] and store[0].add(key, 0) < _job[2] and time.monotonic() < until:
            time.sleep(0.2)


# --- loader workers -------------------------------------------------------------------------

def ignore_stop_signals(_worker_id=None):
    """In a DataLoader worker: the stop signals are its rank's. (A forked worker would run its copy
    of the rank's handler, or die of them, and the rank fail at its next batch, unsaved.) In a process
    that ends (run_main, leave): the work is done."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def start_loader_workers(start):
    """`start()`, a DataLoader iterator whose worker processes start now, with the stop signals blocked: a child
    inherits the mask, so a signal to the group waits in the worker until `ignore_stop_signals` ran there, and comes
    here after. At exit the workers still alive are killed: they ignore the SIGTERM of multiprocessing's exit
    handler, which would wait for them forever (registered before the first workers start, this runs after PyTorch's
    own: utils/compat.py). The workers share this process's multiprocessing folder ("pymp-" in /tmp: the sockets
    that hand batches over), made here first, not one each, which a killed worker would leave behind."""
    global _kill_at_exit_registered
    if not _kill_at_exit_registered:
        atexit.register(kill_loader_workers)
        _kill_at_exit_registered = True
    multiprocessing.util.get_temp_dir()
    main = threading.current_thread() is threading.main_thread()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS) if main else None
    try:
        iterator = start()
    finally:  # also when starting them failed part-way
        if main:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        compat.kill_loader_workers_first_at_exit(kill_loader_workers)
    _loader_workers.update(getattr(iterator, "_workers", ()))  # none for --workers 0
    return iterator


def kill_loader_workers(wait_s: float = 0.0):
    """SIGKILL the workers of our loaders still alive (they ignore SIGTERM); wait_s: then wait for each."""
    if alive := [worker for worker in list(_loader_workers) if worker.exitcode is None]:
        loader_sigchld_off()  # torch's loader would report each kill as a failed worker
    for worker in alive:
        with contextlib.suppress(OSError, ValueError, AssertionError):
            worker.kill()
    for worker in alive if wait_s else ():
        with contextlib.suppress(OSError, ValueError, AssertionError):
            worker.join(wait_s)


def loader_sigchld_off():
    """SIGCHLD back to its default in a failing rank: once a worker died, the loader's handler raises at
    each child's end, in @record's write of the error file too (retried: signal.signal runs it first)."""
    for _ in range(5):
        with contextlib.suppress(RuntimeError):  # the loader's error, raised again: being handled already
            with contextlib.suppress(AttributeError, ValueError):  # no SIGCHLD here; not the main thread
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            return


def shm_free_bytes(path: str = None):
    """Free bytes in the shared-memory folder (other jobs may use it), or None without one."""
    with contextlib.suppress(OSError):
        st = os.statvfs(path or SHM_DIR)
        return st.f_bavail * st.f_frsize
    return None


def bus_error_message(err: BaseException):
    """One line for a loader worker killed by SIGBUS (its shared memory, /dev/shm, full: Docker gives
    64 MB), or None for any other error. A worker that dies while handing a batch over shows first
    as a closed socket: our loaders' workers' exit status is then looked at (given a second)."""
    chain = []
    while err is not None and not ("DataLoader worker" in str(err) and "Bus error" in str(err)):
        chain.append(err)
        err = err.__cause__ or err.__context__
    if err is None:
        lost_a_socket = any(isinstance(e, (ConnectionError, EOFError)) for e in chain)
        if not _a_loader_worker_died_of_sigbus(wait_s=1.0 if lost_a_socket else 0.0):
            return None
    free = shm_free_bytes()
    where = f"{SHM_DIR}: {free / 2**20:.0f} MB free now" if free is not None else f"no {SHM_DIR} here"
    return (f"a DataLoader worker died of a bus error, which in a loader worker almost always means that the "
            f"shared-memory folder ran out ({where}). In Docker run with --ipc=host or --shm-size=2g; elsewhere "
            "make the folder larger (mount -o remount,size=2G /dev/shm) or lower --workers or --batch-size; "
            "scripts/preflight.py shows what the workers need")


def _a_loader_worker_died_of_sigbus(wait_s: float = 0.0) -> bool:
    deadline = time.monotonic() + wait_s
    try:
        while True:
            for worker in list(_loader_workers):
                with contextlib.suppress(AssertionError, OSError, ValueError):  # not ours to poll
                    if worker.exitcode == -signal.SIGBUS:
                        return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
    except RuntimeError as err:  # the loader's SIGCHLD handler, raising while we wait
        if "DataLoader worker" in str(err) and "Bus error" in str(err):
            return True
        raise
