"""The node's address translations, read from the kernel's conntrack table (ctnetlink).

A client pod's packets to a Service leave its link with the Service's address (a ClusterIP, or a node
address and a NodePort); kube-proxy's rules in the node's netns then rewrite the destination to one
backend pod (DNAT), and conntrack keeps both tuples of the connection: the original (client ->
frontend) and the reply (backend -> client). podmeter's programs sit before the rewrite on the client's
side and after it on the backend's, so a flow's record carries one tuple or the other; a
:class:`Translation` links them, and :mod:`podmeter.model.services` names both ends with it.

Only translated entries are asked for: a dump filtered by status (``IPS_DST_NAT``, ``CTA_STATUS`` with
``CTA_STATUS_MASK``; kernels before 6.1 ignore the filter, and the entries are filtered here too). One
dump per flow drain, in the calling thread's netns (the agent's is the node's).

Wire layout (``include/uapi/linux/netfilter/nfnetlink.h``, ``nfnetlink_conntrack.h``): a message is
``nlmsghdr`` then ``nfgenmsg`` (family, version, res_id: 4 bytes), then attributes; a tuple
(``CTA_TUPLE_ORIG``, ``CTA_TUPLE_REPLY``) nests ``CTA_TUPLE_IP`` (addresses) and ``CTA_TUPLE_PROTO``
(protocol number, ports in network order). ``CTA_STATUS`` is a big-endian u32.

The next stage: :class:`podmeter.model.services.Translations`, which the flow drain builds from the list.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import struct
from dataclasses import dataclass
from typing import NamedTuple

from podmeter.adapters.datapath.ebpf.links import NLM_F_DUMP, NetlinkError, NetlinkSocket, attributes, pack_attribute

log = logging.getLogger("podmeter.conntrack")

NETLINK_NETFILTER = 12
NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_NEW = 0
IPCTNL_MSG_CT_GET = 1
NFNETLINK_V0 = 0
CTA_TUPLE_ORIG = 1
CTA_TUPLE_REPLY = 2
CTA_STATUS = 3
CTA_STATUS_MASK = 26
CTA_TUPLE_IP = 1
CTA_TUPLE_PROTO = 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
IPS_SRC_NAT = 1 << 4
IPS_DST_NAT = 1 << 5
NLA_F_NESTED = 0x8000

_NFGEN = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (network order)
_BE32 = struct.Struct(">I")
_BE16 = struct.Struct(">H")


class Tuple(NamedTuple):
    """One direction of a connection: protocol number, source and destination address and port (the
    shape of ``model.services.FiveTuple``)."""

    protocol: int
    src: str
    sport: int
    dst: str
    dport: int


@dataclass(frozen=True, slots=True)
class Translation:
    """A connection whose destination the node rewrote: ``original`` as the client sent it (to the
    frontend), ``reply`` as the backend answers (from the backend, to the client, or to the node's
    address when the node also rewrote the source: ``source_translated``)."""

    original: Tuple
    reply: Tuple
    source_translated: bool

    @property
    def frontend(self) -> tuple[str, int]:
        return self.original.dst, self.original.dport

    @property
    def backend(self) -> tuple[str, int]:
        return self.reply.src, self.reply.sport


class Conntrack(NetlinkSocket):
    """A ctnetlink socket (needs CAP_NET_ADMIN in the netns)."""

    PROTOCOL = NETLINK_NETFILTER

    def translations(self) -> list[Translation]:
        """Every connection of the table whose destination was rewritten (DNAT), IPv4 and IPv6."""
        payload = _NFGEN.pack(socket.AF_UNSPEC, NFNETLINK_V0, 0)
        payload += pack_attribute(CTA_STATUS, _BE32.pack(IPS_DST_NAT))
        payload += pack_attribute(CTA_STATUS_MASK, _BE32.pack(IPS_DST_NAT))
        kind = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET
        found: list[Translation] = []
        for mtype, body in self.request(kind, NLM_F_DUMP, payload, "conntrack dump"):
            if mtype == (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW and len(body) >= _NFGEN.size:
                entry = _translation(body[_NFGEN.size:])
                if entry is not None:
                    found.append(entry)
        return found


def read_translations() -> list[Translation]:
    """One dump of the calling thread's netns's translated connections."""
    with Conntrack() as table:
        return table.translations()


class TranslationReader:
    """What the agent's flow drain calls: the translations now, or none (with one warning, then quiet
    until it works again) when conntrack cannot be read (no permission, no nf_conntrack_netlink)."""

    def __init__(self) -> None:
        self.failures = 0
        self._failing = False

    def read(self) -> list[Translation]:
        try:
            found = read_translations()
        except (OSError, NetlinkError) as error:
            self.failures += 1
            if not self._failing:
                hint = " (the agent needs CAP_NET_ADMIN)" if error.errno in (errno.EPERM, errno.EACCES) else ""
                log.warning("cannot read the node's conntrack table%s: %s; flows to Services are named "
                            "by the Service only until it can", hint, error)
            self._failing = True
            return []
        if self._failing:
            log.info("the node's conntrack table can be read again")
        self._failing = False
        return found


def _translation(data: memoryview) -> Translation | None:
    original = reply = None
    status = 0
    for kind, value in attributes(data):
        if kind == CTA_TUPLE_ORIG:
            original = _tuple(value)
        elif kind == CTA_TUPLE_REPLY:
            reply = _tuple(value)
        elif kind == CTA_STATUS and len(value) >= 4:
            status = _BE32.unpack_from(value)[0]
            break  # the kernel writes the tuples first, then the status: the rest is not needed
    if original is None or reply is None or not status & IPS_DST_NAT:
        return None
    return Translation(original, reply, source_translated=bool(status & IPS_SRC_NAT))


# The layout the kernel writes for an IPv4 tuple with ports (TCP, UDP, SCTP): read in one unpack, checked
# by its lengths and types; any other (IPv6, ICMP, a kernel that adds an attribute) takes the general walk.
_V4_PORTS = struct.Struct("=HHHH4sHH4sHHHHB3xHHH2xHHH2x")
_V4_PORTS_HEAD = (20, CTA_TUPLE_IP | NLA_F_NESTED, 8, CTA_IP_V4_SRC, 8, CTA_IP_V4_DST, 28,
                  CTA_TUPLE_PROTO | NLA_F_NESTED, 5, CTA_PROTO_NUM, 6, CTA_PROTO_SRC_PORT, 6, CTA_PROTO_DST_PORT)


def _tuple(data: memoryview) -> Tuple | None:
    if len(data) >= _V4_PORTS.size:
        (ip_len, ip_type, src_len, src_type, src, dst_len, dst_type, dst, proto_len, proto_type, num_len, num_type,
         protocol, sport_len, sport_type, sport, dport_len, dport_type, dport) = _V4_PORTS.unpack_from(data)
        head = (ip_len, ip_type, src_len, src_type, dst_len, dst_type, proto_len, proto_type, num_len, num_type,
                sport_len, sport_type, dport_len, dport_type)
        if head == _V4_PORTS_HEAD:
            return Tuple(protocol, socket.inet_ntoa(src), socket.ntohs(sport), socket.inet_ntoa(dst),
                         socket.ntohs(dport))
    return _walked_tuple(data)


def _walked_tuple(data: memoryview) -> Tuple | None:
    src = dst = None
    protocol = sport = dport = 0
    for kind, value in attributes(data):
        if kind == CTA_TUPLE_IP:
            src, dst = _addresses(value)
        elif kind == CTA_TUPLE_PROTO:
            protocol, sport, dport = _ports(value)
    if src is None or dst is None:
        return None
    return Tuple(protocol, src, sport, dst, dport)


def _addresses(data: memoryview) -> tuple[str | None, str | None]:
    src = dst = None
    for kind, value in attributes(data):
        if kind in (CTA_IP_V4_SRC, CTA_IP_V6_SRC):
            src = str(ipaddress.ip_address(bytes(value)))
        elif kind in (CTA_IP_V4_DST, CTA_IP_V6_DST):
            dst = str(ipaddress.ip_address(bytes(value)))
    return src, dst


def _ports(data: memoryview) -> tuple[int, int, int]:
    protocol = sport = dport = 0
    for kind, value in attributes(data):
        if kind == CTA_PROTO_NUM and len(value) >= 1:
            protocol = value[0]
        elif kind == CTA_PROTO_SRC_PORT and len(value) >= 2:
            sport = _BE16.unpack_from(value)[0]
        elif kind == CTA_PROTO_DST_PORT and len(value) >= 2:
            dport = _BE16.unpack_from(value)[0]
    return protocol, sport, dport


