"""The one network decision of a job on several nodes, before any process group exists: can this node's ranks join a
job that meets at HOST, and if not, why and what to do. `findings(host, uses_gloo)` answers it for the scripts'
check (so --check-args and slurm.sbatch's pre-check), preflight.py and torchrun_bounded.py.

What the libraries do, as their sources say:
- The store (TCPStore): every rank connects to MASTER_ADDR:MASTER_PORT (distributed_mp.py: --ip, --port);
  its server listens on every address of its host. torchrun's c10d rendezvous sets MASTER_ADDR to node 0's
  socket.getfqdn() (RendezvousStoreInfo.build) unless --local-addr names an address: "localhost" where
  node 0's /etc/hosts has its name after localhost on the 127.0.0.1 line, which every node resolves to itself.
- gloo (the CPU backend): GLOO_SOCKET_IFNAME's interface if set; else the first address of this host's name,
  IPv4 or IPv6 in the resolver's order, that a socket can bind; else 127.0.0.1. It tells the others that
  address: with the name on a loopback line (Debian's `127.0.1.1 nodea`), none of them can reach it.
- NCCL chooses its interfaces by rules of its own (NCCL_SOCKET_IFNAME overrides them, NCCL_DEBUG=INFO
  prints them): nothing here imitates it.
IPv4 only where the job meets (at an IPv6 address, only gloo's address is checked); Linux (ioctl, netlink)."""
import contextlib
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    certain: bool  # True: the job cannot form its groups so (a refusal); False: it may not (a warning)
    what: str
    fix: str

    @property
    def line(self) -> str:
        return f"{self.what}. Fix: {self.fix}"


def interfaces() -> dict:
    """{name: IPv4 address} of this host's interfaces that have one, in the system's order."""
    import fcntl
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in sorted(socket.if_nameindex()):
            with contextlib.suppress(OSError):  # SIOCGIFADDR: the interface's IPv4 address, if it has one
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                found[name] = socket.inet_ntoa(packed[20:24])
    return found


def resolve(host: str, family=socket.AF_INET) -> list:
    """The IPv4 (or `family`'s) addresses `host` resolves to here, in the resolver's order ([] if none)."""
    with contextlib.suppress(OSError, UnicodeError):
        return list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)))
    return []


def is_own_name(host: str) -> bool:
    return host.split(".")[0].lower() == socket.gethostname().split(".")[0].lower()


def is_address(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host) is not None
    return False


def is_loopback(address: str) -> bool:
    """Loopback, or unspecified (0.0.0.0 or ::, an address to listen on: a connection to it stays on this host)."""
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(address).is_loopback or ipaddress.ip_address(address).is_unspecified
    return False


def loopback_for_several_nodes(host: str) -> bool:
    """Whether nodes meeting at `host` would each look for it at their own: it is a loopback address here, and not
    this host's own name (which the other nodes may resolve to its network address)."""
    addresses = resolve(host) or resolve(host, socket.AF_INET6)
    return bool(addresses) and is_loopback(addresses[0]) and not is_own_name(host)


def can_bind(address: str) -> bool:
    """Whether a socket can listen on `address` (IPv4 or IPv6), as gloo asks; any can under ip_nonlocal_bind=1."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return True
    return False


def source_toward(address: str):
    """This host's address that a connection to `address` leaves from (a UDP socket picks it, sending nothing)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return s.getsockname()[0]
    return None


def store_elsewhere(addr: str):  # why rank 0, host of the ranks' store, cannot serve it at MASTER_ADDR; or None
    return None if own_address(addr) else f"MASTER_ADDR={addr} resolves to no address of this host, where rank 0 " \
        "serves the ranks' store: start rank 0 on the host it names, or give MASTER_ADDR this host's address"


def is_own(address: str) -> bool:
    """Whether `address` (IPv4 or IPv6) is this host's own: the kernel routes it here (`ip route get` says local), a
    floating one too. Not a bind, which any address passes under net.ipv4.ip_nonlocal_bind=1 (floating ones need it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with contextlib.suppress(OSError, AttributeError), socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0) as s:
        dst = socket.inet_pton(family, address)
        query = struct.pack("=BB6xI", family, 8 * len(dst), 0) + struct.pack("=HH", 4 + len(dst), 1) + dst  # RTA_DST
        s.send(struct.pack("=IHHII", 16 + len(query), 26, 1, 0, 0) + query)  # RTM_GETROUTE, a request
        reply = s.recv(4096)  # RTM_NEWROUTE (24) whose rtm_type is RTN_LOCAL (2), or an error
        return is_loopback(address) or struct.unpack_from("=H", reply, 4)[0] == 24 and reply[23] == 2
    return is_loopback(address) or source_toward(address) == address  # no netlink (a sandbox): primaries still count


def own_address(host: str):
    """The first address `host` resolves to here (IPv4 or IPv6) that is this host's own; None: not this host."""
    return next((address for address in resolve(host, socket.AF_UNSPEC) if is_own(address)), None)


def route_toward(host: str, known: dict):
    """(interface, address) of this host that reaches `host`: its route's source (`host` itself where it is this
    host's primary address; for a secondary one, a floating one, the primary: it moves); (None, None): unknown."""
    source = (resolve(host) or ["127.0.0.1"])[0]  # none: as unknown as a loopback address
    way = None if is_loopback(source) else source_toward(source)
    return next((name for name, own in known.items() if own == way), None) if way else None, way


def way_out(host, known: dict = None):
    """(interface, address) by which the other nodes of a job that meets at `host` (None: file://) reach
    this one: the route toward `host`; where that is unknown or loopback (`host` is this host's own name
    on a loopback line), this host's one non-loopback interface, if it has only one; else (None, None)."""
    known = interfaces() if known is None else known
    iface, address = route_toward(host, known) if host else (None, None)
    outside = {name: own for name, own in known.items() if not is_loopback(own)}
    if address is None and len(outside) == 1:  # the one way out: the way to every other node
        iface, address = next(iter(outside.items()))
    return iface, address


def gloo_listens_on(known: dict = None):
    """(address, how gloo came to it); None if a name in GLOO_SOCKET_IFNAME is no interface with one."""
    known = interfaces() if known is None else known
    if chosen := os.environ.get("GLOO_SOCKET_IFNAME"):  # gloo makes one device per name and fails on any it cannot find
        names = [name for name in chosen.split(",") if name]
        return known[names[0]] if names and set(names) <= set(known) else None, f"GLOO_SOCKET_IFNAME={chosen}"
    name = socket.gethostname()
    if address := next((a for a in resolve(name, socket.AF_UNSPEC) if can_bind(a)), None):  # "::1 nodea" first, say
        return address, f"the address of this host's name {name}"
    return "127.0.0.1", f"this host's name {name} resolves to no address of its own"


def findings(meet_at, uses_gloo: bool, flag: str = "MASTER_ADDR") -> list:
    """What keeps this node from a job of several nodes that meets at `meet_at` (None: file://), as
    Findings. uses_gloo: the backend is gloo (the CPU). flag: how the user names `meet_at`."""
    name, known = socket.gethostname(), interfaces()
    iface, address = way_out(meet_at, known)
    iface_fix = f"GLOO_SOCKET_IFNAME={iface or '<the interface the other nodes reach this host by>'}"
    # On no loopback line: cloud-init's Red Hat template lists the name on 127.0.0.1 and on ::1, gloo takes either.
    hosts_fix = f"list {name} with {address or 'its network address'} in /etc/hosts, on no loopback line (127.x, ::1)"
    if meet_at is not None:
        addresses = resolve(meet_at)
        ipv6 = not addresses and resolve(meet_at, socket.AF_INET6)  # torch and gloo take it; the rest reads IPv4
        addresses = addresses or ipv6
        if not addresses:
            return [Finding(True, f"{flag} {meet_at}, where the ranks meet, does not resolve on this host ({name})",
                            "name it by its address, or add it to this host's /etc/hosts")]
        if loopback_for_several_nodes(meet_at):
            # This host's own name is left to the gloo rule below: the other nodes may resolve it to this
            # host's network address. Another host's name is this host's fault (a hosts file cloned from
            # that host's); localhost (node 0's socket.getfqdn() under torchrun) or an address, every node's.
            if mine := not is_address(meet_at) and not meet_at.lower().startswith("localhost"):
                fix = (f"list {meet_at} in {name}'s own /etc/hosts with its network address, as the other nodes "
                       "resolve it, not on a 127.x line")
            elif flag != "MASTER_ADDR":
                fix = f"give {flag} node 0's network address"
            elif is_address(meet_at):  # by hand, or bare torchrun's static rendezvous
                fix = "give MASTER_ADDR node 0's network address (torchrun's --master-addr, 127.0.0.1 if not given)"
            else:
                fix = ("torchrun's c10d rendezvous sets it to node 0's own name as socket.getfqdn() gives it there: "
                       "list that name with node 0's network address in node 0's /etc/hosts, not on a 127.x line; "
                       "or start torchrun with --local-addr=<the node's address> on every node "
                       "(scripts/launch_multi_node.sh does)")
            who = f"this host ({name}) would look for it" if mine else "each node would look for the others"
            what = f"{flag} {meet_at} is " + ("" if is_address(meet_at) else f"{addresses[0]} here, ") + (
                "an address to listen on, not to connect to" if ipaddress.ip_address(addresses[0]).is_unspecified
                else "a loopback address")
            return [Finding(True, f"{what}: {who} at its own, and the job would wait until its timeout", fix)]
        if ipv6:  # gloo's address does not depend on it: checked as for file://, where it has an IPv4 one
            return [Finding(False, f"{flag} {meet_at} is IPv6 here, which this check does not read: it checked "
                                   "only gloo's address", "none if the nodes reach one another over IPv6"),
                    *(findings(None, uses_gloo, flag) if gloo_listens_on(known)[0] else [])]
    if not uses_gloo:
        return []
    gloo, how = gloo_listens_on(known)
    if gloo is None:
        return [Finding(True, f"gloo has no address to listen on ({how}: a name there is no interface with an "
                              "IPv4 address here)", f"export {iface_fix}")]
    if is_loopback(gloo):
        return [Finding(True, f"gloo will listen on {gloo} ({how}), a loopback address, and give it to the other "
                              "nodes, which cannot reach this host there: the job would wait until its timeout",
                        # The variable, when set, is what gloo reads: not the hosts file.
                        f"export {iface_fix}" if how.startswith("GLOO_SOCKET_IFNAME") else
                        f"{hosts_fix}, or export {iface_fix}")]
    gloo_iface = next((i for i, a in known.items() if a == gloo), None)
    # A name of this host resolves here as it may nowhere else: the route to it says nothing of the others'.
    itself = not is_address(meet_at or "") and own_address(meet_at or "")
    if iface and address and gloo_iface != iface and meet_at and not itself:
        return [Finding(False, f"gloo will listen on {gloo} ({how}), but {meet_at} is reached through {iface} "
                               f"({address}): if the other nodes cannot reach {gloo}, the job waits until its "
                               "timeout", f"export {iface_fix}")]
    return []
