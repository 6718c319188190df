"""The network interfaces of one netns, read from rtnetlink with a parser that reads only what we need.

The attach manager needs, per interface, its index, name, link kind and where its peer is, from two
sources: a dump (``RTM_GETLINK``, every link that exists now) and notifications
(``RTM_NEWLINK``/``RTM_DELLINK`` as links change). A general netlink library decodes every attribute of
every message into objects; on a node with hundreds of veths and tens of changes per second that cost
~10 ms of interpreter time per dump, taken from the agent's event loop through the GIL (it was the tail
of delete->unmapped latency). Here each message is walked with ``struct`` until what the attach rule
needs is found, and nothing else is built.

To tell which pod a link serves (and, with pod selection, whether a candidate carries a pod at all), two
more questions, asked only for the links the manager attached to or weighs and the pod IPs it could not
place: the addresses of a link's **peer**, read in the peer's own netns without entering it
(``RTM_GETADDR`` with ``IFA_TARGET_NETNSID``), and the link the node **routes** an address through
(``RTM_GETROUTE``). And the links that carry the node's default routes (a dump of the
main table), which are the node's uplinks, never a pod's.

Wire layout (``include/uapi/linux/netlink.h``, ``rtnetlink.h``, ``if_link.h``, ``if_addr.h``): a
message is ``nlmsghdr`` (16 bytes) then a family header (``ifinfomsg`` 16 bytes with the index at
offset 4; ``ifaddrmsg`` 8 bytes with the index at offset 4; ``rtmsg`` 12 bytes) then attributes, each
``rtattr`` (length, type) and its payload padded to 4 bytes. ``IFLA_LINKINFO`` nests ``IFLA_INFO_KIND``
and ``IFLA_INFO_DATA`` (for netkit: ``IFLA_NETKIT_PRIMARY``, ``IFLA_NETKIT_MODE``). A veth or netkit
whose peer lives in another netns carries ``IFLA_LINK_NETNSID`` (the id this netns gives the peer's) and
``IFLA_LINK`` (the peer's ifindex there).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Self

NLMSG_ERROR = 2
NLMSG_DONE = 3
RTM_NEWLINK = 16
RTM_DELLINK = 17
RTM_GETLINK = 18
RTM_NEWADDR = 20
RTM_GETADDR = 22
RTM_NEWROUTE = 24
RTM_GETROUTE = 26
RTM_NEWQDISC = 36
RTM_GETQDISC = 38
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLM_F_DUMP_INTR = 0x10  # the table changed while it was being dumped: the dump may miss or repeat links
DUMP_ATTEMPTS = 5
RTMGRP_LINK = 1
SOL_NETLINK = 270
NETLINK_GET_STRICT_CHK = 12  # the kernel honours filters in dump requests (IFA_TARGET_NETNSID, an ifindex)
IFLA_LINK = 5
IFLA_IFNAME = 3
IFLA_LINKINFO = 18
IFLA_LINK_NETNSID = 37
IFLA_INFO_KIND = 1
IFLA_INFO_DATA = 2
IFLA_NETKIT_PRIMARY = 2
IFLA_NETKIT_MODE = 5
NETKIT_L2 = 0
NETKIT_L3 = 1
IFA_ADDRESS = 1
IFA_LOCAL = 2
IFA_TARGET_NETNSID = 10
RTA_DST = 1
RTA_OIF = 4
RTA_MULTIPATH = 9
RTA_TABLE = 15
RT_TABLE_MAIN = 254
RTN_UNICAST = 1
TCA_KIND = 1
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
PEER_KINDS = frozenset({"veth", "netkit"})  # link kinds with a peer device, the host side of a pod

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_IFINDEX = struct.Struct("=i")  # ifinfomsg.ifi_index, at offset 4 of the ifinfomsg
_ATTR = struct.Struct("=HH")  # rtattr: len, type
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags
_NEXTHOP = struct.Struct("=HBBi")  # rtnexthop: len, flags, hops, ifindex
_TCMSG = struct.Struct("=BxxxiIII")  # tcmsg: family, (pad), ifindex, handle, parent, info
_U32 = struct.Struct("=I")
_S32 = struct.Struct("=i")
_IFINFO_SIZE = 16
_BUFFER_SIZE = 1 << 18  # larger than any dump chunk the kernel sends (it sizes them to the reader)
_EVENT_BUFFER_SIZE = 1 << 16  # a notification is one message of a few KiB

Link = tuple[str, str | None]  # (name, link kind: "veth", ... or None): what dump_links() gives


@dataclass(frozen=True, slots=True)
class LinkInfo:
    """What the attach rule reads of one link.

    ``peer_netnsid`` is set when the link's peer (a veth's other end, a netkit's peer) is in another
    netns: that netns's id as this one numbers it (-1 on kernels that report one not assigned yet), and
    ``peer_index`` the peer's ifindex there. ``netkit_mode`` (``NETKIT_L2``/``NETKIT_L3``) and
    ``netkit_primary`` only for netkit devices."""

    name: str
    kind: str | None = None
    peer_netnsid: int | None = None
    peer_index: int | None = None
    netkit_mode: int | None = None
    netkit_primary: bool | None = None

    @property
    def peer_elsewhere(self) -> bool:
        """A veth or netkit (primary) whose peer is in another netns: the host side of a pod's link."""
        return self.kind in PEER_KINDS and self.peer_netnsid is not None and self.netkit_primary is not False


@dataclass(frozen=True, slots=True)
class LinkChange:
    """One notification: a link exists now as ``link``, or (``link`` None) it is gone."""

    index: int
    link: LinkInfo | None


class NetlinkError(OSError):
    """The kernel answered a request with an error."""


def _string(payload: memoryview) -> str:
    return bytes(payload).split(b"\0", 1)[0].decode("utf-8", "replace")


def attributes(data: memoryview) -> Iterator[tuple[int, memoryview]]:
    offset, end = 0, len(data)
    while offset + _ATTR.size <= end:
        length, kind = _ATTR.unpack_from(data, offset)
        if length < _ATTR.size:
            return  # malformed: stop rather than loop
        yield kind & NLA_TYPE_MASK, data[offset + _ATTR.size:offset + length]
        offset += (length + 3) & ~3


def _u32(payload: memoryview) -> int | None:
    if len(payload) < 4:
        return None
    value: int = _U32.unpack_from(payload)[0]
    return value


def _s32(payload: memoryview) -> int | None:
    if len(payload) < 4:
        return None
    value: int = _S32.unpack_from(payload)[0]
    return value


def _link_info(payload: memoryview) -> tuple[str | None, int | None, bool | None]:
    """``IFLA_LINKINFO`` -> (kind, netkit mode, netkit primary)."""
    kind: str | None = None
    data: memoryview | None = None
    for attribute, value in attributes(payload):
        if attribute == IFLA_INFO_KIND:
            kind = _string(value)
        elif attribute == IFLA_INFO_DATA:
            data = value
    mode, primary = None, None
    if kind == "netkit" and data is not None:
        for attribute, value in attributes(data):
            if attribute == IFLA_NETKIT_MODE:
                mode = _u32(value)
            elif attribute == IFLA_NETKIT_PRIMARY and len(value) >= 1:
                primary = bool(value[0])
    return kind, mode, primary


def _link(body: memoryview) -> tuple[int, LinkInfo]:
    """An ``ifinfomsg`` and its attributes -> (index, LinkInfo).

    The walk stops as soon as the rule has what it needs: the name and a kind without a peer (a bridge,
    a vxlan...), or the name, the kind, the peer's netns and its index. Only links without a kind (``lo``,
    physical NICs: a few per node) and veths whose peer is in this netns are walked to their end."""
    (index,) = _IFINDEX.unpack_from(body, 4)
    name, kind, mode, primary = "", None, None, None
    netnsid: int | None = None
    peer: int | None = None
    seen_kind = False
    for attribute, payload in attributes(body[_IFINFO_SIZE:]):
        if attribute == IFLA_IFNAME:
            name = _string(payload)
        elif attribute == IFLA_LINKINFO:
            kind, mode, primary = _link_info(payload)
            seen_kind = True
        elif attribute == IFLA_LINK_NETNSID:
            netnsid = _s32(payload)
        elif attribute == IFLA_LINK:
            peer = _s32(payload)
        else:
            continue
        if name and seen_kind and (kind not in PEER_KINDS or (netnsid is not None and peer is not None)):
            break
    if netnsid is None:
        peer = None  # IFLA_LINK of a link whose peer is here is an index of this netns: not a peer elsewhere
    return index, LinkInfo(name, kind, netnsid, peer, mode, primary)


def messages(data: memoryview) -> Iterator[tuple[int, int, memoryview]]:
    """Split a datagram into (message type, flags, body after the nlmsghdr)."""
    offset, end = 0, len(data)
    while offset + _HEADER.size <= end:
        length, kind, flags, _, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size:
            return
        yield kind, flags, data[offset + _HEADER.size:offset + length]
        offset += (length + 3) & ~3


def changes(data: memoryview) -> Iterator[LinkChange]:
    """The link notifications in one datagram of a socket subscribed to ``RTMGRP_LINK``."""
    for kind, _, body in messages(data):
        if kind in (RTM_NEWLINK, RTM_DELLINK) and len(body) >= _IFINFO_SIZE:
            index, link = _link(body)
            yield LinkChange(index, link if kind == RTM_NEWLINK else None)


def read_links() -> dict[int, LinkInfo]:
    """Every link of the calling thread's netns: ifindex -> LinkInfo.

    A dump that the kernel marks interrupted (links changed meanwhile, which churn makes common) is done
    again: an inconsistent one could miss a link that existed all along, and the attach manager would
    detach from it. After ``DUMP_ATTEMPTS`` the last one is used (notifications then correct it)."""
    for _ in range(DUMP_ATTEMPTS - 1):
        found, consistent = _dump_once()
        if consistent:
            return found
    return _dump_once()[0]


def dump_links() -> dict[int, Link]:
    """Every link of the calling thread's netns: ifindex -> (name, kind) (see :func:`read_links`)."""
    return {index: (link.name, link.kind) for index, link in read_links().items()}


def _error(body: memoryview, what: str) -> NetlinkError:
    code = -struct.unpack_from("=i", body)[0]
    return NetlinkError(code, f"{what}: {errno.errorcode.get(code, code)}")


def _dump_once() -> tuple[dict[int, LinkInfo], bool]:
    request = _HEADER.pack(_HEADER.size + _IFINFO_SIZE, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
    request += bytes(_IFINFO_SIZE)  # ifi_family AF_UNSPEC: every link
    found: dict[int, LinkInfo] = {}
    consistent = True
    buffer = bytearray(_BUFFER_SIZE)
    with contextlib.closing(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)) as sock:
        sock.bind((0, 0))
        sock.send(request)
        while True:
            size = sock.recv_into(buffer)
            for kind, flags, body in messages(memoryview(buffer)[:size]):
                consistent = consistent and not flags & NLM_F_DUMP_INTR
                if kind == NLMSG_DONE:
                    return found, consistent
                if kind == NLMSG_ERROR:
                    raise _error(body, "RTM_GETLINK dump")
                if kind == RTM_NEWLINK:
                    index, link = _link(body)
                    found[index] = link


@contextlib.contextmanager
def link_events() -> Iterator[socket.socket]:
    """A non-blocking netlink socket subscribed to link changes in the calling thread's netns."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK, socket.NETLINK_ROUTE)
    try:
        sock.bind((0, RTMGRP_LINK))
        yield sock
    finally:
        sock.close()


def read_changes(sock: socket.socket) -> list[LinkChange] | None:
    """Every notification queued on ``sock`` now, in order; None when the kernel dropped some (ENOBUFS):
    the caller must then dump the links again."""
    found: list[LinkChange] = []
    lost = False
    buffer = bytearray(_EVENT_BUFFER_SIZE)
    while True:
        try:
            size = sock.recv_into(buffer)
        except (BlockingIOError, InterruptedError):
            return None if lost else found
        except OSError as error:
            if error.errno != errno.ENOBUFS:
                raise
            lost = True  # keep draining: what follows the loss is read too, then a dump rereads all
            continue
        found.extend(changes(memoryview(buffer)[:size]))


# --- which pod a link serves, which link an address takes -------------------------------------------------


class NetlinkSocket:
    """One netlink socket of the calling thread's netns for a series of requests (strict checking on,
    so the kernel applies the filters of dump requests). Use as a context manager."""

    PROTOCOL = socket.NETLINK_ROUTE

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, self.PROTOCOL)
        try:
            self.sock.bind((0, 0))
            self.sock.setsockopt(SOL_NETLINK, NETLINK_GET_STRICT_CHK, 1)
        except BaseException:
            self.sock.close()
            raise
        self._seq = 0
        self._buffer = bytearray(_BUFFER_SIZE)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def request(self, kind: int, flags: int, payload: bytes, what: str) -> Iterator[tuple[int, memoryview]]:
        """Send one request; yield (type, body) of every answer until the last (the dump's end, or the one
        answer of a plain request). An error answer raises :class:`NetlinkError`."""
        self._seq += 1
        seq = self._seq
        self.sock.send(_HEADER.pack(_HEADER.size + len(payload), kind, NLM_F_REQUEST | flags, seq, 0) + payload)
        dump = flags & NLM_F_DUMP == NLM_F_DUMP
        while True:
            size = self.sock.recv_into(self._buffer)
            view = memoryview(self._buffer)[:size]
            offset = 0
            while offset + _HEADER.size <= size:
                length, mtype, _, mseq, _ = _HEADER.unpack_from(view, offset)
                if length < _HEADER.size:
                    break
                body = view[offset + _HEADER.size:offset + length]
                offset += (length + 3) & ~3
                if mseq != seq:
                    continue  # the answer to an earlier request abandoned half-way
                if mtype == NLMSG_DONE:
                    return
                if mtype == NLMSG_ERROR:
                    if _S32.unpack_from(body)[0] == 0:
                        return  # an acknowledgement
                    raise _error(body, what)
                yield mtype, body
                if not dump:
                    return


class Rtnl(NetlinkSocket):
    """An rtnetlink socket: which pod a link serves, which link an address takes, a link's qdiscs."""

    def peer_addresses(self, netnsid: int, index: int) -> frozenset[str]:
        """The addresses (IPv4 and IPv6) of interface ``index`` of the netns this one numbers ``netnsid``:
        a pod's own addresses, read from the host side's peer without entering the pod's netns."""
        payload = _IFADDR.pack(socket.AF_UNSPEC, 0, 0, 0, index)
        payload += pack_attribute(IFA_TARGET_NETNSID, _S32.pack(netnsid))
        found: set[str] = set()
        for mtype, body in self.request(RTM_GETADDR, NLM_F_DUMP, payload, "RTM_GETADDR dump"):
            if mtype != RTM_NEWADDR or len(body) < _IFADDR.size:
                continue
            family, _, _, _, where = _IFADDR.unpack_from(body)
            if where != index:
                continue  # a kernel that ignores the index filter
            local = address = None
            for attribute, value in attributes(body[_IFADDR.size:]):
                if attribute == IFA_LOCAL:
                    local = bytes(value)
                elif attribute == IFA_ADDRESS:
                    address = bytes(value)
            raw = local or address
            if raw is not None and family in (socket.AF_INET, socket.AF_INET6):
                found.add(str(ipaddress.ip_address(raw)))
        return frozenset(found)

    def route_link(self, ip: str) -> int | None:
        """The ifindex of the link the node sends packets for ``ip`` out of (a route lookup, as
        ``ip route get``), or None when there is no route."""
        address = ipaddress.ip_address(ip)
        family = socket.AF_INET if address.version == 4 else socket.AF_INET6
        payload = _RTMSG.pack(family, address.max_prefixlen, 0, 0, 0, 0, 0, 0, 0)
        payload += pack_attribute(RTA_DST, address.packed)
        try:
            for mtype, body in self.request(RTM_GETROUTE, 0, payload, f"route lookup of {ip}"):
                if mtype == RTM_NEWROUTE:
                    for attribute, value in attributes(body[_RTMSG.size:]):
                        if attribute == RTA_OIF:
                            return _s32(value)
        except NetlinkError as error:
            if error.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ESRCH, errno.EINVAL):
                return None
            raise
        return None

    def default_route_links(self) -> frozenset[int]:
        """The links that carry a default route of the main table, IPv4 or IPv6: the node's uplinks."""
        found: set[int] = set()
        for family in (socket.AF_INET, socket.AF_INET6):
            payload = _RTMSG.pack(family, 0, 0, 0, RT_TABLE_MAIN, 0, 0, 0, 0)
            for mtype, body in self.request(RTM_GETROUTE, NLM_F_DUMP, payload, "RTM_GETROUTE dump"):
                if mtype != RTM_NEWROUTE or len(body) < _RTMSG.size:
                    continue
                _, dst_len, _, _, table, _, _, rtype, _ = _RTMSG.unpack_from(body)
                if dst_len != 0 or rtype != RTN_UNICAST:
                    continue
                oifs: list[int] = []
                for attribute, value in attributes(body[_RTMSG.size:]):
                    if attribute == RTA_TABLE:
                        table = _u32(value) or table
                    elif attribute == RTA_OIF and (oif := _s32(value)) is not None:
                        oifs.append(oif)
                    elif attribute == RTA_MULTIPATH:
                        oifs.extend(_nexthops(value))
                if table == RT_TABLE_MAIN:
                    found.update(oifs)
        return frozenset(found)

    def qdisc_kinds(self, index: int) -> frozenset[str]:
        """The kinds of the qdiscs on interface ``index`` (``clsact``, ``ingress``, ``noqueue``, ...), as
        ``tc qdisc show dev``: a dump the kernel filters by index (strict checking), filtered again here
        for kernels that do not."""
        payload = _TCMSG.pack(socket.AF_UNSPEC, index, 0, 0, 0)
        kinds: set[str] = set()
        for mtype, body in self.request(RTM_GETQDISC, NLM_F_DUMP, payload, "RTM_GETQDISC dump"):
            if mtype != RTM_NEWQDISC or len(body) < _TCMSG.size or _TCMSG.unpack_from(body)[1] != index:
                continue
            for attribute, value in attributes(body[_TCMSG.size:]):
                if attribute == TCA_KIND:
                    kinds.add(_string(value))
        return frozenset(kinds)


def _nexthops(data: memoryview) -> Iterator[int]:
    offset = 0
    while offset + _NEXTHOP.size <= len(data):
        length, _, _, index = _NEXTHOP.unpack_from(data, offset)
        if length < _NEXTHOP.size:
            return
        yield index
        offset += (length + 3) & ~3


def pack_attribute(kind: int, payload: bytes) -> bytes:
    length = _ATTR.size + len(payload)
    return _ATTR.pack(length, kind) + payload + bytes(-length % 4)
