"""tests/reaper.py: what a test process started is ended once it is gone, however it ended.

The owner here is a plain Python process that starts its reaper as conftest does for every
test process, then starts what tests start: a process in a session of its own (as torchrun's
workers and the tests' Proc are), a grandchild behind a shell, one that ignores SIGTERM, and,
where network namespaces are available, test hosts with two processes on one of them, one
without the mark (as slurmstepd is). The owner is then killed with SIGKILL, so that none of
its own cleanup runs."""
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import netns_hosts  # noqa: E402
import reaper  # noqa: E402

OWNER = """
import json, os, signal, subprocess, sys
sys.path.insert(0, {tests!r}); sys.path.insert(0, {scripts!r})
import conftest, reaper
conftest.start_reaper()
pids = {{}}
pids["own_session"] = subprocess.Popen(["sleep", "300"], start_new_session=True).pid
shell = subprocess.run(["bash", "-c", "setsid sleep 301 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
pids["behind_a_shell"] = int(shell.stdout)
stubborn = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"],
    stdout=subprocess.PIPE, text=True, start_new_session=True)
assert stubborn.stdout.readline().strip() == "ready"
pids["ignores_sigterm"] = stubborn.pid
slot = None
if {with_hosts!r}:
    import netns_hosts
    hosts = netns_hosts.Hosts(slot={slot})
    hosts.up()
    slot = hosts.slot
    pids["on_a_host"] = hosts.popen("nodea", ["sleep", "302"]).pid
    unmarked = {{k: v for k, v in os.environ.items() if k != reaper.OWNERS_VAR}}
    pids["on_a_host_unmarked"] = hosts.popen("nodeb", ["sleep", "303"], env=unmarked).pid
print(json.dumps({{"pids": pids, "slot": slot}}), flush=True)
signal.pause()
"""


def started_at(pid: int):
    """The process's start time (clock ticks after boot), None once it is gone or a zombie:
    with the pid, it names one process even after the pid is reused."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def test_everything_a_killed_test_process_started_is_ended(tmp_path):
    with_hosts = netns_hosts.unavailable_reason() is None
    # A slot that no other test claims (they take the lowest free one): freed, it stays free.
    code = OWNER.format(tests=str(ROOT / "tests"), scripts=str(ROOT / "scripts"), with_hosts=with_hosts,
                        slot=netns_hosts.SLOTS - 2)
    # The owner keeps this test process's mark: if this test is cut short, this process's
    # reaper ends the owner and all it started.
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    started = None
    try:
        ready, _, _ = select.select([owner.stdout], [], [], 120)
        assert ready, "the owner did not start its processes within 120 s"
        line = owner.stdout.readline()
        assert line, f"the owner ended first, exit status {owner.wait()}"
        started = json.loads(line)
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait()
    pids, slot = started["pids"], started["slot"]
    when = {}
    try:
        assert len(pids) == (5 if with_hosts else 3), started
        when = {name: started_at(pid) for name, pid in pids.items()}
        assert None not in when.values(), when  # each was running when the owner died
        deadline = time.monotonic() + reaper.GRACE + 20
        while time.monotonic() < deadline and any(started_at(pid) == when[name] for name, pid in pids.items()):
            time.sleep(0.2)
        left = {name: pid for name, pid in pids.items() if started_at(pid) == when[name]}
        assert not left, f"still running {reaper.GRACE + 20} s after their owner died: {left}"
        if with_hosts:
            while netns_hosts.namespaces_of_slot(slot) and time.monotonic() < deadline:
                time.sleep(0.2)
            with netns_hosts.slots_locked():  # the reaper's removal, under it, is whole
                assert netns_hosts.namespaces_of_slot(slot) == [], "the owner's test hosts are still there"
                assert not os.path.exists(os.path.join(netns_hosts.STATE_DIR, f"slot{slot}"))
    except BaseException:
        for name, pid in pids.items():  # ended here instead, then the failure
            if started_at(pid) is not None and started_at(pid) == when.get(name):
                os.kill(pid, signal.SIGKILL)
        if slot is not None:
            with netns_hosts.slots_locked():
                netns_hosts.remove_slot(slot)
        raise


def test_the_mark_reaches_what_the_tests_start():
    # This test process's own pid, last in the list its children inherit.
    out = subprocess.run([sys.executable, "-c", f"import os; print(os.environ[{reaper.OWNERS_VAR!r}])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out.endswith(f":{os.getpid()}:"), out
