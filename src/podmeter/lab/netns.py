"""Pod sandboxes: a network namespace per pod, wired to the node by a veth pair (what a CNI plugin does).

Layout, the one Calico uses (no bridge, so every pod has its own host-side device for the agent):

* the pod's namespace ``/run/netns/pmpod-<id>`` has ``lo`` and ``eth0`` with the pod IP as a /32, a link
  route to the gateway 169.254.1.1 and a default route through it;
* the host side ``<prefix><id>`` (``pm<id>`` unless the scenario names links like another CNI:
  ``eni<id>`` as AWS VPC CNI does, ``azv<id>`` as Azure CNI does) stays in the node's namespace (the
  caller's), carries 169.254.1.1/32 (so it answers the pod's ARP for the gateway) and a /32 route to the
  pod IP; the node forwards between pods. The agent finds these links by what they are, not by name.

Everything is netlink through pyroute2 and two syscalls (no shell, no fork); interface indexes come from
``if_nametoindex`` (one ioctl), not a lookup that dumps every link of a node with hundreds. A namespace is
made by a short-lived thread that ``unshare``s its own network namespace and bind-mounts it under /run/netns, and
removed by unmounting it. The kernel then dismantles the namespace in the background, and with it
``eth0``, whose veth peer (the host side) and /32 route go too; the host route is installed with
"replace", so a new pod given the same IP a moment later wins over a host side still being dismantled.
:meth:`Sandbox.destroy` is idempotent and also cleans up a half-built sandbox.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from podmeter.adapters.datapath.ebpf.netns import CLONE_NEWNET, netns

_libc = ctypes.CDLL(None, use_errno=True)
MS_BIND = 4096
MNT_DETACH = 2

GATEWAY = "169.254.1.1"
NETNS_DIR = Path("/run/netns")
SCOPE_LINK = 253
HOST_PREFIX = "pm"
NETNS_PREFIX = "pmpod-"
ID_LENGTH = 11
IFNAMSIZ = 15  # the longest interface name Linux takes (IFNAMSIZ 16, with the terminating NUL)
MAX_LINK_PREFIX = IFNAMSIZ - ID_LENGTH
_LINK_PREFIX = re.compile(rf"^[a-z][a-z0-9]{{0,{MAX_LINK_PREFIX - 1}}}$")


def short_id(uid: str) -> str:
    """11 hex-ish characters of a pod UID: a link prefix of up to 4 characters + this fits an interface
    name (15 characters)."""
    cleaned = "".join(c for c in uid.lower() if c.isalnum())
    return cleaned[-ID_LENGTH:].rjust(ID_LENGTH, "0")


def link_prefix_problem(prefix: str) -> str | None:
    """Why ``prefix`` cannot start the host-side names of pod links, or None: 1 to 4 lowercase letters and
    digits, a letter first, so that ``<prefix><11 characters>`` is a valid interface name of at most 15."""
    if _LINK_PREFIX.match(prefix):
        return None
    return (f"{prefix!r} is not a link name prefix: 1 to {MAX_LINK_PREFIX} lowercase letters or digits, a letter "
            f"first (the prefix and {ID_LENGTH} characters of the pod UID make the name, at most {IFNAMSIZ})")


def host_device_of(netns_name: str, links: Iterable[str]) -> str | None:
    """The host side of the sandbox ``netns_name`` among ``links`` (names), whatever its prefix, or None."""
    sid = netns_name.removeprefix(NETNS_PREFIX)
    return next((name for name in links if name.endswith(sid) and 0 < len(name) - len(sid) <= MAX_LINK_PREFIX
                 and link_prefix_problem(name[:-len(sid)]) is None), None)


def host_side(netns_path: str, ifname: str = "eth0") -> str | None:
    """The name, in the caller's namespace, of the peer of ``ifname`` in the namespace at ``netns_path``: a
    pod's veth's host side, whoever named it (this module's ``<prefix><id>``, a CNI plugin's ``veth<hex>``);
    None if there is no such link."""
    try:
        with netns(netns_path), IPRoute() as ipr:
            links = ipr.get_links(socket.if_nametoindex(ifname))  # the calling thread's netns: the pod's
            peer = links[0].get_attr("IFLA_LINK") if links else None
        return None if peer is None else socket.if_indextoname(peer)
    except (OSError, NetlinkError):
        return None


@dataclass(frozen=True)
class Sandbox:
    """One pod's network: its namespace name, the host-side device and its IPv4 address."""

    netns: str
    host_device: str
    ip: str

    @classmethod
    def for_pod(cls, uid: str, ip: str, link_prefix: str = HOST_PREFIX) -> Sandbox:
        """The pod's sandbox; its host-side link is ``<link_prefix><id>`` (ValueError if the prefix is
        unusable: see :func:`link_prefix_problem`)."""
        problem = link_prefix_problem(link_prefix)
        if problem is not None:
            raise ValueError(problem)
        sid = short_id(uid)
        return cls(f"{NETNS_PREFIX}{sid}", f"{link_prefix}{sid}", ip)

    @property
    def netns_path(self) -> str:
        return str(NETNS_DIR / self.netns)

    def create(self) -> None:
        """Build the namespace, the veth pair, addresses and routes; on failure undo what was built."""
        try:
            create_netns(self.netns_path)
            with IPRoute() as ipr:
                ipr.link("add", ifname=self.host_device, kind="veth",
                         peer={"ifname": "eth0", "net_ns_fd": self.netns_path})
                index = socket.if_nametoindex(self.host_device)  # link_lookup would dump every link
                ipr.addr("add", index=index, address=GATEWAY, prefixlen=32)
                ipr.link("set", index=index, state="up")
                ipr.route("replace", dst=f"{self.ip}/32", oif=index, scope=SCOPE_LINK)
            with netns(self.netns_path), IPRoute() as ipr:
                eth0 = socket.if_nametoindex("eth0")  # the calling thread's netns: the pod's
                ipr.link("set", index=socket.if_nametoindex("lo"), state="up")
                ipr.addr("add", index=eth0, address=self.ip, prefixlen=32)
                ipr.link("set", index=eth0, state="up")
                ipr.route("add", dst=f"{GATEWAY}/32", oif=eth0, scope=SCOPE_LINK)
                ipr.route("add", dst="0.0.0.0/0", gateway=GATEWAY, oif=eth0)
        except BaseException:
            self.destroy(wait=True)
            raise

    def destroy(self, wait: bool = False) -> None:
        """Remove the namespace; the kernel removes its veth pair and route soon after. ``wait``: delete
        the host side now (before reusing this sandbox's device name). Absent parts are fine."""
        if wait:
            with IPRoute() as ipr, contextlib.suppress(NetlinkError):
                ipr.link("del", ifname=self.host_device)
        remove_netns(self.netns_path)

    def exists(self) -> bool:
        return (NETNS_DIR / self.netns).exists()


def create_netns(path: str) -> None:
    """A new network namespace bound at ``path`` (like ``ip netns add``), without forking."""
    NETNS_DIR.mkdir(parents=True, exist_ok=True)
    errors: list[OSError] = []

    def make() -> None:  # runs on its own thread: only that thread's namespace changes, and it ends
        try:
            if _libc.unshare(CLONE_NEWNET) != 0:
                raise _errno_error("unshare(CLONE_NEWNET)")
            os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
            if _libc.mount(b"/proc/thread-self/ns/net", path.encode(), b"none", MS_BIND, None) != 0:
                raise _errno_error(f"bind mount of a namespace on {path}")
        except OSError as exc:
            errors.append(exc)

    maker = threading.Thread(target=make, name="netns-maker")
    maker.start()
    maker.join()
    if errors:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise errors[0]


def remove_netns(path: str) -> None:
    """Unbind a namespace made by :func:`create_netns`; it goes once nothing else holds it. Idempotent."""
    _libc.umount2(path.encode(), MNT_DETACH)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _errno_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def enable_forwarding() -> None:
    """Forward IPv4 in the caller's namespace (the node), so pods reach each other through it."""
    # /proc/sys/net is the namespace of the thread that opens it: the node's, here.
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")


@contextlib.contextmanager
def node_namespace(name: str) -> Iterator[str]:
    """A fresh network namespace standing for the lab node's root namespace, removed afterwards.

    Running the lab node inside it keeps the lab off the machine's own interfaces, routes and sysctls.
    """
    path = str(NETNS_DIR / name)
    create_netns(path)
    try:
        with netns(path), IPRoute() as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        yield path
    finally:
        remove_netns(path)


def in_namespace(path: str) -> contextlib.AbstractContextManager[None]:
    """Run the calling thread inside ``path``'s namespace for a block (sockets made there stay there)."""
    return netns(path)


def is_root() -> bool:
    return os.geteuid() == 0
