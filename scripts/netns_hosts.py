r"""Several hosts on one Linux machine, for trying multi-node training without a cluster.

Each host is a Linux network namespace with its own address, its own hostname and its own
hosts file (what `ip netns exec` mounts over /etc/hosts), joined to the others by a virtual
switch: a bridge in a namespace of its own. Links can be cut and restored, and a host can
drop connections as a firewall does (with nftables' `nft`). Outside the namespaces it writes
only /etc/netns/<namespace>/ and /run/netns-hosts/slot<k>/, which `down` removes with them (the
tests too, however they end); the empty folders /etc/netns and /run/netns and the lock file
/run/netns-hosts/lock stay. Needs root and iproute2 (`ip`).

    sudo python3 scripts/netns_hosts.py up                  # nodea 10.231.0.1, nodeb 10.231.0.2
    sudo python3 scripts/netns_hosts.py shell nodea         # a shell on nodea (another terminal: nodeb)
    sudo python3 scripts/netns_hosts.py run nodeb -- CMD    # one command on nodeb
    sudo python3 scripts/netns_hosts.py cut nodeb           # pull nodeb's cable; `restore nodeb` to plug it in
    sudo python3 scripts/netns_hosts.py firewall nodea 29500  # nodea drops TCP connections but to port 29500
    sudo python3 scripts/netns_hosts.py down                # remove the hosts and every process on them

`up` takes the setups that break multi-node jobs on real machines:

    --own-name loopback   each host's own name resolves to 127.0.1.1, as Debian and Ubuntu
                          installers write /etc/hosts (the other hosts' names resolve to them)
    --own-name localhost  `127.0.0.1 localhost nodea`: the name after localhost, a common hand
                          edit (socket.getfqdn() then answers "localhost")
    --own-name fqdn       `127.0.0.1 nodea.cluster nodea` and `::1 nodea.cluster nodea`, as
                          cloud-init's Red Hat template writes them with manage_etc_hosts (the
                          others know nodea.cluster)
    --two-interfaces      eth0, the interface each host lists first and its own name resolves
                          to, reaches no other host; eth1 is the link between them

In a host's shell the repository is where it is on this machine (the file system is
shared: a folder that every node sees), and `hostname`, `getent hosts nodea`, `ip addr`
show that host's view. The addresses are 10.231.0.x (and 10.231.1.x, the first interfaces of
--two-interfaces) in every --slot: each slot is a set of hosts with a switch of its own, and the
hosts have no route out of it.
"""
import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

PREFIX = "nh"                 # namespaces nh<slot>-<host>, nh<slot>-switch
STATE_DIR = "/run/netns-hosts"  # slot<k>/owner: which process holds slot k (tests may run side by side)
NETNS_ETC = "/etc/netns"
SLOTS = 64                    # sets of hosts, each on a switch of its own
LOOPBACK_NAME_ADDRESS = "127.0.1.1"
OWN_NAMES = ("routable", "loopback", "localhost", "fqdn")  # what each host's own name resolves to


class HostsUnavailable(RuntimeError):
    """This machine cannot hold the hosts (not root, no `ip`, no network namespaces)."""


def unavailable_reason():
    """Why the hosts cannot be made here, or None if they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install iproute2 util-linux)"
    probe = f"{PREFIX}probe"
    for left in _namespaces(probe):  # the probe of a process killed before it removed it
        if left[len(probe):].isdigit() and not _alive(int(left[len(probe):])):
            _ip("netns", "del", left, check=False)
    probe += str(os.getpid())
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        return f"`ip netns add` fails here: {made.stderr.strip()}" if made.returncode else None
    finally:
        _ip("netns", "del", probe, check=False)


def _ip(*args, namespace=None, check=True):
    cmd = ["ip", *(["-n", namespace] if namespace else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user (or user namespace): alive all the same
        pass
    return True


def _namespaces(prefix: str):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def namespaces_of_slot(slot: int):
    return _namespaces(f"{PREFIX}{slot}-")


def processes_in(namespace: str):
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def remove_slot(slot: int):
    """Remove every namespace of a slot, the processes in them, their /etc/netns entries.
    Called under slots_locked()."""
    deadline = time.monotonic() + 10
    for namespace in namespaces_of_slot(slot):  # a namespace ends when its last process has
        # Listed again until none is left: a process may fork between a listing and its kill.
        while (pids := processes_in(namespace)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        _ip("netns", "del", namespace, check=False)
    if os.path.isdir(NETNS_ETC):
        for entry in os.listdir(NETNS_ETC):
            if entry.startswith(f"{PREFIX}{slot}-"):
                shutil.rmtree(os.path.join(NETNS_ETC, entry), ignore_errors=True)
    shutil.rmtree(os.path.join(STATE_DIR, f"slot{slot}"), ignore_errors=True)


def _holder(folder):
    """Who holds a slot: a pid, "up" (made by the `up` command, held until `down`), or None
    when its owner file cannot be read (its claimer died before writing it). Read under
    slots_locked(), under which a claimer makes the folder and writes the file."""
    try:
        with open(os.path.join(folder, "owner")) as f:
            return json.load(f)["holder"]
    except (OSError, ValueError, KeyError):
        return None


def set_holder(folder, holder):
    """Write who holds a slot (a pid, or "up"), whole: a reader never sees half a file."""
    with open(os.path.join(folder, "owner.new"), "w") as f:
        json.dump({"holder": holder}, f)
    os.replace(os.path.join(folder, "owner.new"), os.path.join(folder, "owner"))


@contextlib.contextmanager
def slots_locked():
    """Held while a process decides who holds a slot: claiming one, reclaiming a dead
    holder's, taking one over (tests/reaper.py), removing one. Without it, a process that
    claims a slot while another removes it could lose its new hosts to the removal."""
    os.makedirs(STATE_DIR, exist_ok=True)
    with open(os.path.join(STATE_DIR, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _claim_slot(wanted=None) -> int:
    """A slot that nobody holds (a dead holder's leftovers are removed first). Without
    `wanted`, the lowest free of slots 1 and up: slot 0 is the one `up` makes by default."""
    with slots_locked():
        for slot in ([wanted] if wanted is not None else range(1, SLOTS)):
            folder = os.path.join(STATE_DIR, f"slot{slot}")
            if os.path.exists(folder):
                holder = _holder(folder)
                if holder == "up" or (isinstance(holder, int) and _alive(holder)):
                    continue
                remove_slot(slot)  # its holder died without tearing down
            os.mkdir(folder)
            set_holder(folder, os.getpid())
            return slot
    raise HostsUnavailable(f"no free slot for hosts ({'slot ' + str(wanted) if wanted is not None else 'all'} "
                           f"taken, see {STATE_DIR}): `python3 scripts/netns_hosts.py --slot N down` frees slot N")


class Hosts:
    """Hosts on this machine, each a network namespace with its address, hostname and hosts
    file. A context manager: on exit every process on them is killed and everything made is
    removed, whatever ended the block.

        with Hosts(("nodea", "nodeb")) as hosts:
            hosts.run("nodea", ["hostname"])          # nodea
            hosts.address("nodeb")                    # '10.231.0.2', in every slot
            hosts.cut("nodeb"); hosts.restore("nodeb")
    """

    def __init__(self, names=("nodea", "nodeb"), *, own_name="routable", two_interfaces=False, slot=None):
        # own_name: one form for every host, or {host: form} (the others' "routable")
        if not set(own_name.values() if isinstance(own_name, dict) else [own_name]) <= set(OWN_NAMES):
            raise ValueError(f"own_name: one of {', '.join(OWN_NAMES)} (or a host -> form dict), not {own_name!r}")
        self.names = tuple(names)
        self.own_name = own_name
        self.two_interfaces = two_interfaces
        self.wanted_slot = slot
        self.slot = None
        self._processes = []

    # --- names and addresses ------------------------------------------------------

    def namespace(self, name):
        return f"{PREFIX}{self.slot}-{name}"

    @property
    def switch(self):
        return f"{PREFIX}{self.slot}-switch"

    def address(self, name) -> str:
        """The host's address on the link between the hosts."""
        return f"10.231.0.{self.names.index(name) + 1}"

    def first_address(self, name) -> str:
        """With two_interfaces: the address of eth0, which reaches no other host."""
        return f"10.231.1.{self.names.index(name) + 1}"

    @property
    def link_interface(self) -> str:
        """The interface name, on every host, of the link between the hosts."""
        return "eth1" if self.two_interfaces else "eth0"

    def form(self, name) -> str:
        """How host `name`'s own name resolves there (OWN_NAMES)."""
        return self.own_name.get(name, "routable") if isinstance(self.own_name, dict) else self.own_name

    def hosts_file(self, name) -> str:
        form = self.form(name)
        if form == "localhost":
            lines = [f"127.0.0.1\tlocalhost {name}"]
        elif form == "fqdn":  # cloud-init's hosts.redhat.tmpl: the name on 127.0.0.1 and on ::1 (lo has both)
            lines = [f"127.0.0.1\t{name}.cluster {name}", "127.0.0.1\tlocalhost localhost.localdomain",
                     f"::1\t{name}.cluster {name}"]
        else:
            lines = ["127.0.0.1\tlocalhost"]
        for other in self.names:
            if other != name:
                fqdn = f"{other}.cluster " if self.form(other) == "fqdn" else ""
                lines.append(f"{self.address(other)}\t{fqdn}{other}")
            elif form in ("localhost", "fqdn"):
                continue
            elif form == "loopback":
                lines.append(f"{LOOPBACK_NAME_ADDRESS}\t{name}")
            elif self.two_interfaces:
                lines.append(f"{self.first_address(name)}\t{name}")
            else:
                lines.append(f"{self.address(name)}\t{name}")
        return "\n".join(lines) + "\n"

    # --- up and down -------------------------------------------------------------

    def __enter__(self):
        self.up()
        return self

    def __exit__(self, *exc):
        self.down()

    def up(self):
        """Make the hosts (unavailable_reason() says first whether this machine can)."""
        self.slot = _claim_slot(self.wanted_slot)
        try:
            with open(os.path.join(STATE_DIR, f"slot{self.slot}", "hosts.json"), "w") as f:
                json.dump({"names": self.names, "own_name": self.own_name,
                           "two_interfaces": self.two_interfaces}, f)
            _ip("netns", "add", self.switch)
            _ip("link", "add", "switch", "type", "bridge", namespace=self.switch)
            _ip("link", "set", "switch", "up", namespace=self.switch)
            for index, name in enumerate(self.names):
                ns = self.namespace(name)
                _ip("netns", "add", ns)
                _ip("link", "set", "lo", "up", namespace=ns)
                if self.two_interfaces:  # made first: the host lists it first, as NCCL will
                    _ip("link", "add", "eth0", "netns", ns, "type", "veth",
                        "peer", "name", f"nowhere{index}", "netns", self.switch)
                    _ip("link", "set", f"nowhere{index}", "up", namespace=self.switch)
                    _ip("addr", "add", f"{self.first_address(name)}/24", "dev", "eth0", namespace=ns)
                    _ip("link", "set", "eth0", "up", namespace=ns)
                port = f"port{index}"  # by number: an interface's name has 15 characters at most
                _ip("link", "add", self.link_interface, "netns", ns, "type", "veth",
                    "peer", "name", port, "netns", self.switch)
                _ip("link", "set", "dev", port, "master", "switch", namespace=self.switch)
                _ip("link", "set", port, "up", namespace=self.switch)
                _ip("addr", "add", f"{self.address(name)}/24", "dev", self.link_interface, namespace=ns)
                _ip("link", "set", self.link_interface, "up", namespace=ns)
                etc = os.path.join(NETNS_ETC, ns)
                os.makedirs(etc, exist_ok=True)
                with open(os.path.join(etc, "hosts"), "w") as f:
                    f.write(self.hosts_file(name))
                with open(os.path.join(etc, "resolv.conf"), "w") as f:
                    f.write("# no name server: these hosts know each other from their hosts files\n")
            self._wait_for_links()
        except BaseException:
            self.down()
            raise

    def _wait_for_links(self, timeout=10.0):
        """Until every host answers on the link (a new veth takes a moment to carry)."""
        deadline = time.monotonic() + timeout
        for name in self.names:
            while True:
                state = _ip("-o", "link", "show", self.link_interface, namespace=self.namespace(name))
                if "LOWER_UP" in state:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}'s link did not come up: {state.strip()}")
                time.sleep(0.05)

    def down(self):
        """Kill every process on the hosts (those started here and any other) and remove
        the namespaces, the links and the hosts files."""
        if self.slot is None:
            return
        for proc in self._processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        with slots_locked():
            remove_slot(self.slot)
        self.slot = None

    # --- running things on a host -------------------------------------------------

    def command(self, name, argv):
        """argv as it runs on host `name`: its network, its hosts file, its hostname."""
        return ["ip", "netns", "exec", self.namespace(name), "unshare", "--uts", "--",
                "sh", "-c", f'echo {name} > /proc/sys/kernel/hostname && exec "$@"', "sh", *map(str, argv)]

    def popen(self, name, argv, **kwargs) -> subprocess.Popen:
        """Start argv on host `name` in a session of its own (signal it with os.killpg);
        killed by down() if still running."""
        proc = subprocess.Popen(self.command(name, argv), start_new_session=True, **kwargs)
        self._processes.append(proc)
        return proc

    def run(self, name, argv, timeout=60, **kwargs) -> subprocess.CompletedProcess:
        """Run argv on host `name` to its end, its output captured as text; on a timeout its
        whole session is killed and subprocess.TimeoutExpired raised."""
        proc = self.popen(name, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # it holds the output so far
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()  # not communicate(): a process it started in a session of its own may hold the pipes
            proc.stdout.close()
            proc.stderr.close()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def cut(self, name):
        """Pull host `name`'s cable: its link goes down at the switch, and packets to and from
        it are lost, as at a dead switch port. Connections across it get no reset: they wait
        until their own timeouts. A new one waits too, or, once the host that makes it has
        given up resolving the other's address (seconds), fails with EHOSTUNREACH."""
        _ip("link", "set", f"port{self.names.index(name)}", "down", namespace=self.switch)

    def restore(self, name):
        _ip("link", "set", f"port{self.names.index(name)}", "up", namespace=self.switch)
        self._wait_for_links()

    def firewall(self, name, open_ports=()):
        """Host `name` drops new TCP connections from the other hosts, but to `open_ports`: a
        firewall that lets only those through (dropped, not refused: the other side waits until
        its own timeout). open_ports=None removes it. Needs nftables (`nft`)."""
        if shutil.which("nft") is None:
            raise HostsUnavailable("`nft` is not installed (Debian: apt-get install nftables)")
        table = "add table inet netns_hosts\ndelete table inet netns_hosts\n"  # none left, whether or not one was
        if open_ports is not None:
            accept = "".join(f"tcp dport {int(port)} accept; " for port in open_ports)
            table += ("table inet netns_hosts { chain input { type filter hook input priority 0; policy accept; "
                      f"iif lo accept; ct state established,related accept; {accept}meta l4proto tcp drop; }}; }}\n")
        done = subprocess.run(["ip", "netns", "exec", self.namespace(name), "nft", "-f", "-"], input=table,
                              text=True, capture_output=True)
        if done.returncode:
            raise RuntimeError(f"nft on {name}: {done.stderr.strip()}")


def _attached(slot: int) -> Hosts:
    """The Hosts that `up` made in `slot` (for the commands after `up`)."""
    try:
        with open(os.path.join(STATE_DIR, f"slot{slot}", "hosts.json")) as f:
            saved = json.load(f)
    except OSError:
        raise SystemExit(f"netns_hosts.py: error: no hosts are up in slot {slot}: run `up` first") from None
    hosts = Hosts(saved["names"], own_name=saved["own_name"], two_interfaces=saved["two_interfaces"])
    hosts.slot = slot
    return hosts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--slot", type=int, default=0, choices=range(SLOTS), metavar="N",
                        help=f"which set of hosts, 0 to {SLOTS - 1} (default 0)")
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="make the hosts")
    up.add_argument("names", nargs="*", default=["nodea", "nodeb"])
    up.add_argument("--own-name", choices=OWN_NAMES, default="routable",
                    help="what each host's own name resolves to (below)")
    up.add_argument("--two-interfaces", action="store_true", help="an eth0 that reaches no other host (below)")
    for action in ("shell", "cut", "restore"):
        sub.add_parser(action, help=f"{action} a host").add_argument("name")
    wall = sub.add_parser("firewall", help="a host drops new TCP connections from the others, but to PORTs")
    wall.add_argument("name")
    wall.add_argument("ports", nargs="*", type=int, metavar="PORT")
    wall.add_argument("--off", action="store_true", help="remove the host's firewall")
    run = sub.add_parser("run", help="run a command on a host")
    run.add_argument("name")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("down", help="remove the hosts and every process on them")
    args = parser.parse_args(argv)

    reason = unavailable_reason()
    if reason:
        sys.exit(f"netns_hosts.py: error: {reason}")
    if args.action == "up":
        hosts = Hosts(args.names, own_name=args.own_name, two_interfaces=args.two_interfaces, slot=args.slot)
        hosts.up()
        # The slot outlives this command: `down` frees it.
        set_holder(os.path.join(STATE_DIR, f"slot{hosts.slot}"), "up")
        for name in hosts.names:
            print(f"{name}\t{hosts.address(name)}\t{sys.argv[0]} shell {name}")
        return
    if args.action == "down":
        with slots_locked():
            remove_slot(args.slot)
        return
    hosts = _attached(args.slot)
    if args.name not in hosts.names:
        sys.exit(f"netns_hosts.py: error: no host {args.name}: the hosts are {', '.join(hosts.names)}")
    if args.action == "cut":
        hosts.cut(args.name)
    elif args.action == "restore":
        hosts.restore(args.name)
    elif args.action == "firewall":
        hosts.firewall(args.name, None if args.off else args.ports)
    elif args.action == "shell":
        print(f"a shell on {args.name} ({hosts.address(args.name)}); exit to leave", file=sys.stderr)
        os.execvp("ip", hosts.command(args.name, [os.environ.get("SHELL", "/bin/bash")]))
    else:
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            sys.exit("netns_hosts.py: error: run NAME -- COMMAND...: name the command to run")
        os.execvp("ip", hosts.command(args.name, cmd))


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as err:  # a slot taken, no `nft`, a command of `ip` refused: one line, no traceback
        sys.exit(f"netns_hosts.py: error: {err}")
