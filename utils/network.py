"""This host as the other nodes of a multi-node job see it: the address its name resolves
to, which of its interfaces gloo and NCCL will use, and which one reaches the rendezvous
host. What breaks multi-node jobs is most often here, and it can be read off before any
process group exists (scripts/preflight.py reports it; the training scripts refuse the
setups that cannot work; scripts/torchrun_bounded.py, which the launchers use, chooses
around them).

How the libraries choose, as their sources say:

- gloo (ProcessGroupGloo's default device): GLOO_SOCKET_IFNAME's interface if set; else
  the first address that this host's name resolves to and that a socket can bind; else
  127.0.0.1. Every rank then tells the others, through the store, the address it listens
  on: a name that resolves to loopback (Debian's `127.0.1.1 nodea`) gives the other nodes
  an address that is their own loopback.
- NCCL: NCCL_SOCKET_IFNAME's interfaces if set; else interfaces named ib* first, then any
  other but lo and docker*, in the order the system lists them.
- torchrun's c10d rendezvous: the agent hosts the store when the endpoint is "localhost",
  a loopback address, this host's name, or an address that this host's name resolves to
  (torch.distributed.elastic.rendezvous.utils._matches_machine_hostname); an address of
  this host that its name does not resolve to is not recognised, and then nobody hosts
  the store. `--rdzv-conf is_host=1` (or 0) decides it instead.

IPv4 only: what these checks look at. Linux (interface addresses are read with ioctl).
"""
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interfaces() -> dict:
    """{name: IPv4 address} of this host's interfaces that have one, in the system's order."""
    if not hasattr(socket, "if_nameindex"):
        return {}
    import fcntl
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in sorted(socket.if_nameindex()):
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_of(address: str, known: dict = None):
    """The interface that holds `address`, or None."""
    for name, own in (known if known is not None else interfaces()).items():
        if own == address:
            return name
    return "lo" if is_loopback(address) else None


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> list:
    """The IPv4 addresses `host` resolves to here, in the resolver's order ([] if none)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    seen = []
    for info in infos:
        if info[4][0] not in seen:
            seen.append(info[4][0])
    return seen


def can_bind(address: str) -> bool:
    """Whether `address` is one of this host's own (a socket can listen on it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def source_toward(address: str):
    """This host's address that the kernel sends from toward `address` (no packet is sent:
    a UDP socket only picks its route), or None without a route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _names_from(variable: str, known: dict, prefixes: bool) -> list:
    """The interfaces a *_SOCKET_IFNAME value selects (NCCL's: prefixes, = exact, ^ excludes;
    gloo's: exact names separated by commas)."""
    value = os.environ.get(variable, "")
    exclude = value.startswith("^")
    exact = value.lstrip("^").startswith("=") or not prefixes
    items = [v for v in value.lstrip("^=").split(",") if v]
    hit = [n for n in known if any(n == v or (not exact and n.startswith(v)) for v in items)]
    return [n for n in known if n not in hit] if exclude else hit


@dataclass(frozen=True)
class Choice:
    address: str      # the address the library will listen on and announce
    interface: str    # its interface (None if no interface holds it)
    why: str          # how the library came to it, for messages


def gloo_choice(known: dict = None) -> Choice:
    """The address gloo's default device takes on this host (see the module's docstring)."""
    known = interfaces() if known is None else known
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        names = _names_from("GLOO_SOCKET_IFNAME", known, prefixes=False)
        if names:
            return Choice(known[names[0]], names[0], f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']}")
        return Choice(None, None, f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']}, which names no "
                                  "interface with an IPv4 address here")
    name = socket.gethostname()
    for address in resolve(name):
        if can_bind(address):
            return Choice(address, interface_of(address, known), f"the address of this host's name {name}")
    return Choice("127.0.0.1", "lo", f"this host's name {name} resolves to no address of its own")


def nccl_interface(known: dict = None):
    """(interface, why) that NCCL's socket transport and bootstrap take first on this host."""
    known = interfaces() if known is None else known
    if os.environ.get("NCCL_SOCKET_IFNAME"):
        names = _names_from("NCCL_SOCKET_IFNAME", known, prefixes=True)
        return (names[0] if names else None), f"NCCL_SOCKET_IFNAME={os.environ['NCCL_SOCKET_IFNAME']}"
    for rule, pick in (("an ib* interface, NCCL's first choice", lambda n: n.startswith("ib")),
                       ("the first interface but lo and docker*",
                        lambda n: not n.startswith(("lo", "docker")))):
        for name in known:
            if pick(name):
                return name, rule
    return ("lo" if "lo" in known else None), "no other interface"


def interface_toward(host: str, known: dict = None):
    """(interface, address) of this host that reaches `host` (a name or an address): the
    interface holding it if it is this host's own, else the one its route leaves from."""
    known = interfaces() if known is None else known
    addresses = resolve(host)
    if not addresses:
        return None, None
    target = addresses[0]
    if is_loopback(target):
        # `host` is this host by a name that resolves to loopback (torchrun's MASTER_ADDR is the
        # store host's name): the other nodes reach it through its one network interface, if
        # it has just one.
        outside = [(name, address) for name, address in known.items() if not is_loopback(address)]
        return outside[0] if len(outside) == 1 else (None, None)
    if can_bind(target):
        return interface_of(target, known), target
    source = source_toward(target)
    return (interface_of(source, known), source) if source else (None, None)


def torchrun_hosts_store(endpoint_host: str) -> bool:
    """Whether torchrun's c10d rendezvous, given this endpoint, hosts the store on this host
    (without --rdzv-conf is_host). PyTorch's own test, so that the answer is its answer."""
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    except ImportError:  # not where it was in 2.11-2.14: the same rule, restated
        if endpoint_host == "localhost" or is_loopback(endpoint_host):
            return True
        name = socket.gethostname()
        return endpoint_host in (name, socket.getfqdn()) or bool(set(resolve(endpoint_host)) & set(resolve(name)))
    try:
        return _matches_machine_hostname(endpoint_host)
    except OSError:  # this host's own name does not resolve
        return False


def is_this_host(host: str) -> bool:
    """Whether `host` (a name or an address) is this host: an address of it is bindable here."""
    return any(can_bind(address) for address in resolve(host))


@dataclass(frozen=True)
class Finding:
    certain: bool     # True: the job cannot work so; False: it may not
    what: str
    fix: str


def multi_node_findings(peer_host: str, backends=("gloo",), endpoint: str = None) -> list:
    """What keeps this host from a multi-node job whose other nodes reach it through
    `peer_host` (MASTER_ADDR, or the rendezvous endpoint's host): a list of Findings.
    backends: the ones the job uses here (the scripts use gloo on the CPU, and beside NCCL
    on GPUs for their stop agreement). endpoint: torchrun's --rdzv-endpoint host, checked
    for the c10d trap."""
    known = interfaces()
    name = socket.gethostname()
    own = resolve(name)
    findings = []
    route_interface = route_address = None
    # peer_here: the peer is this host by a name (torchrun's MASTER_ADDR on node 0 is its own
    # name), or on loopback. How the other nodes reach it is then not known here (they may
    # resolve the name otherwise): every node may be on this machine, or the other nodes'
    # own checks will tell. An address of this host given as such is known, and checked.
    peer_here = False
    if peer_host is not None:
        peer_addresses = resolve(peer_host)
        if not peer_addresses:
            return [Finding(True, f"{peer_host}, the address the other nodes meet at, does not resolve on "
                                  f"this host ({name})",
                            "name it by its address, or add it to this host's /etc/hosts")]
        literal = _is_address(peer_host)
        peer_here = is_loopback(peer_addresses[0]) or (not literal and can_bind(peer_addresses[0]))
        if not peer_here:
            route_interface, route_address = interface_toward(peer_host, known)
    peer_host = peer_host or "the other nodes"
    set_it = (f"GLOO_SOCKET_IFNAME={route_interface}" if route_interface else "GLOO_SOCKET_IFNAME=<interface>")
    map_it = (f"map {name} to {route_address} in /etc/hosts" if route_address and not is_loopback(route_address)
              else f"map {name} to this host's network address in /etc/hosts")
    if endpoint is not None:
        here, hosts = is_this_host(endpoint), torchrun_hosts_store(endpoint)
        if here and not hosts:
            findings.append(Finding(True,
                f"this host is the rendezvous endpoint {endpoint}, but torchrun's c10d rendezvous will not "
                f"host its store here: it recognises itself by its name, and {name} resolves to "
                f"{', '.join(own) or 'nothing'}; every node then waits for a store that nobody serves, and "
                "fails 2 to 3 minutes later with RendezvousConnectionError (The client socket has timed out)",
                f"{map_it}; or add --rdzv-conf is_host=1 to torchrun on this node only; or use the static "
                f"rendezvous: --master-addr {endpoint} --master-port PORT --node-rank 0 here (1, 2... elsewhere) "
                "instead of --rdzv-backend/--rdzv-endpoint"))
        elif hosts and not here:
            findings.append(Finding(True,
                f"the rendezvous endpoint {endpoint} means this host to torchrun on every node, so each node "
                "hosts a store of its own and waits alone",
                "give every node the same endpoint: node 0's name or address as the other nodes reach it"))
    if "gloo" in backends:
        gloo = gloo_choice(known)
        if gloo.address is None:
            findings.append(Finding(True, f"gloo has no address to listen on: {gloo.why}",
                                    f"export {set_it} (the interface that reaches {peer_host})"))
        elif is_loopback(gloo.address) and peer_here:
            pass  # all nodes on this machine (or this is the rendezvous host, and the others will say it)
        elif is_loopback(gloo.address):
            findings.append(Finding(route_address is not None,
                f"gloo will listen on {gloo.address} ({gloo.why}, a loopback address) and give it to the "
                f"other nodes, which cannot reach this host there: the job hangs joining the process group",
                f"{map_it}, or export {set_it}"))
        elif route_interface and gloo.interface and gloo.interface != route_interface:
            findings.append(Finding(False,
                f"gloo will listen on {gloo.address} ({gloo.interface}: {gloo.why}), but {peer_host} is "
                f"reached through {route_interface} (this host's {route_address}): if the other nodes cannot reach "
                f"{gloo.address}, the job hangs joining the process group",
                f"export {set_it}"))
    if "nccl" in backends:
        nccl, why = nccl_interface(known)
        if route_interface and nccl != route_interface and not (nccl or "").startswith("ib"):
            findings.append(Finding(False,
                f"NCCL will use {nccl or 'no interface'} ({why}), but {peer_host} is reached through "
                f"{route_interface}", f"export NCCL_SOCKET_IFNAME=={route_interface}"))
    return findings

