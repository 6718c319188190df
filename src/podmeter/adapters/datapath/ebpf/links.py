"""The network interfaces of one netns, read from rtnetlink with a parser that reads only what we need.

The attach manager needs, per interface, its index, name and link kind, from two sources: a dump
(``RTM_GETLINK``, every link that exists now) and notifications (``RTM_NEWLINK``/``RTM_DELLINK`` as links
change). A general netlink library decodes every attribute of every message into objects; on a node with
hundreds of veths and tens of changes per second that cost ~10 ms of interpreter time per dump, taken
from the agent's event loop through the GIL (it was the tail of delete->unmapped latency). Here each
message is walked with ``struct`` until the name and kind are found, and nothing else is built.

Wire layout (``include/uapi/linux/netlink.h``, ``rtnetlink.h``): a message is ``nlmsghdr`` (16 bytes)
then ``ifinfomsg`` (16 bytes, the index at offset 4) then attributes, each ``rtattr`` (length, type) and
its payload padded to 4 bytes. ``IFLA_LINKINFO`` nests ``IFLA_INFO_KIND``.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

NLMSG_ERROR = 2
NLMSG_DONE = 3
RTM_NEWLINK = 16
RTM_DELLINK = 17
RTM_GETLINK = 18
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLM_F_DUMP_INTR = 0x10  # the table changed while it was being dumped: the dump may miss or repeat links
DUMP_ATTEMPTS = 5
RTMGRP_LINK = 1
IFLA_IFNAME = 3
IFLA_LINKINFO = 18
IFLA_INFO_KIND = 1
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_IFINDEX = struct.Struct("=i")  # ifinfomsg.ifi_index, at offset 4 of the ifinfomsg
_ATTR = struct.Struct("=HH")  # rtattr: len, type
_IFINFO_SIZE = 16
_BUFFER_SIZE = 1 << 18  # larger than any dump chunk the kernel sends (it sizes them to the reader)
_EVENT_BUFFER_SIZE = 1 << 16  # a notification is one message of a few KiB

Link = tuple[str, str | None]  # (name, link kind: "veth", ... or None)


@dataclass(frozen=True, slots=True)
class LinkChange:
    """One notification: a link exists now as (name, kind), or (``link`` None) it is gone."""

    index: int
    link: Link | None


class NetlinkError(OSError):
    """The kernel answered a request with an error."""


def _string(payload: memoryview) -> str:
    return bytes(payload).split(b"\0", 1)[0].decode("utf-8", "replace")


def _kind(payload: memoryview) -> str | None:
    for kind, value in _attributes(payload):
        if kind == IFLA_INFO_KIND:
            return _string(value)
    return None


def _attributes(data: memoryview) -> Iterator[tuple[int, memoryview]]:
    offset, end = 0, len(data)
    while offset + _ATTR.size <= end:
        length, kind = _ATTR.unpack_from(data, offset)
        if length < _ATTR.size:
            return  # malformed: stop rather than loop
        yield kind & NLA_TYPE_MASK, data[offset + _ATTR.size:offset + length]
        offset += (length + 3) & ~3


def _link(body: memoryview) -> tuple[int, Link]:
    """An ``ifinfomsg`` and its attributes -> (index, (name, kind))."""
    (index,) = _IFINDEX.unpack_from(body, 4)
    name, kind, found = "", None, 0
    for attribute, payload in _attributes(body[_IFINFO_SIZE:]):
        if attribute == IFLA_IFNAME:
            name, found = _string(payload), found + 1
        elif attribute == IFLA_LINKINFO:
            kind, found = _kind(payload), found + 1
        if found == 2:
            break
    return index, (name, kind)


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


def dump_links() -> dict[int, Link]:
    """Every link of the calling thread's netns: ifindex -> (name, kind).

    A dump that the kernel marks interrupted (links changed meanwhile, which churn makes common) is done
    again: an inconsistent one could miss a link that existed all along, and the attach manager would
    detach from it. After ``DUMP_ATTEMPTS`` the last one is used (notifications then correct it)."""
    for _ in range(DUMP_ATTEMPTS - 1):
        found, consistent = _dump_once()
        if consistent:
            return found
    return _dump_once()[0]


def _dump_once() -> tuple[dict[int, Link], bool]:
    request = _HEADER.pack(_HEADER.size + _IFINFO_SIZE, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
    request += bytes(_IFINFO_SIZE)  # ifi_family AF_UNSPEC: every link
    found: dict[int, Link] = {}
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
                    code = -struct.unpack_from("=i", body)[0]
                    raise NetlinkError(code, f"RTM_GETLINK dump: {errno.errorcode.get(code, code)}")
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
