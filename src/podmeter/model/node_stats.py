"""The node's own network figures, from the text of the kernel's files (pure: the adapter reads them).

* :func:`parse_sockets`: a socket table (``/proc/net/tcp``, ``tcp6``, ``udp``, ``udp6``): its sockets by
  state number and by remote address (loopback and unspecified addresses left out: a listening socket has
  no remote end, and a connection to the node itself is not one to another host);
* :func:`parse_netstat`: the ``TcpExt`` counters of ``/proc/net/netstat``, their names lower-cased;
* :func:`parse_net_dev`: the generic counters of every interface but ``lo`` in ``/proc/net/dev``, under the
  names the kernel gives them in ``/sys/class/net/<if>/statistics/``.

Every parser is total: a line it cannot read is counted in ``errors`` and left out, never an exception.
Each is one pass over the text, and a socket table converts each distinct remote address once, so the cost
is linear in the lines. :func:`top` and :func:`top_interfaces` bound what is exported, the rest summed
under :data:`OTHER`.
"""

from __future__ import annotations

import ipaddress
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from podmeter.model.flow_series import OTHER  # what a cap leaves out, as every capped series names it

# The kernel's TCP states (include/net/tcp_states.h), by the number /proc/net/tcp writes in hexadecimal.
TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
              7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING", 12: "NEW_SYN_RECV"}
# /proc/net/dev's columns, named as /sys/class/net/<if>/statistics/ names the one counter each holds. Three
# columns are sums of several counters: `frame` (length, over, CRC and frame errors) and `carrier` (carrier,
# aborted, window and heartbeat errors) have no such name and are left out; `drop` (None here) is the
# kernel's rx_dropped plus rx_missed_errors (packets the device had no room for), both drops: rx_dropped.
NET_DEV_COLUMNS = ("rx_bytes", "rx_packets", "rx_errors", "rx_dropped", "rx_fifo_errors", None, "rx_compressed",
                   "multicast", "tx_bytes", "tx_packets", "tx_errors", "tx_dropped", "tx_fifo_errors",
                   "collisions", None, "tx_compressed")
INTERFACE_STATISTICS = tuple(name for name in NET_DEV_COLUMNS if name is not None)
ByteOrder = Literal["little", "big"]


@dataclass
class SocketTable:
    """One socket table's sockets: how many, by state number, by remote address (text, leaving out loopback
    and unspecified addresses); ``errors``: lines that did not parse."""

    sockets: int = 0
    states: Counter[int] = field(default_factory=Counter)
    remotes: Counter[str] = field(default_factory=Counter)
    errors: int = 0

    def __iadd__(self, other: SocketTable) -> SocketTable:
        self.sockets += other.sockets
        self.states += other.states
        self.remotes += other.remotes
        self.errors += other.errors
        return self


def parse_sockets(text: str, byteorder: ByteOrder = sys.byteorder) -> SocketTable:
    """A socket table of ``/proc/net/{tcp,tcp6,udp,udp6}``: a header line, then one line a socket
    (``sl local_address rem_address st ...``, the addresses as the kernel's words in hexadecimal, in the
    byte order of the machine that wrote them: ``byteorder``)."""
    table, raw_remotes = SocketTable(), Counter[str]()
    for line in text.splitlines()[1:]:
        fields = line.split(maxsplit=4)
        try:
            if len(fields) < 4 or not fields[0].endswith(":"):
                raise ValueError(line)
            state = int(fields[3], 16)
            remote = fields[2].partition(":")[0]
        except ValueError:
            table.errors += 1
            continue
        table.sockets += 1
        table.states[state] += 1
        raw_remotes[remote] += 1
    for raw, count in raw_remotes.items():  # each distinct address converted once
        address = remote_address(raw, byteorder)
        if address is None:
            table.errors += count
        elif address:
            table.remotes[address] += count
    return table


def remote_address(raw: str, byteorder: ByteOrder) -> str | None:
    """The text of an address as a socket table writes it; "" for loopback and unspecified addresses
    (an IPv4-mapped IPv6 address is its IPv4 address); None if it is not one."""
    if len(raw) not in {8, 32}:
        return None
    try:
        words = bytes.fromhex(raw)
    except ValueError:
        return None
    if len(words) not in {4, 16}:
        return None
    packed = b"".join(words[i:i + 4][::-1] if byteorder == "little" else words[i:i + 4]
                      for i in range(0, len(words), 4))
    address: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(packed)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return "" if address.is_loopback or address.is_unspecified else str(address)


def tcp_states(table: SocketTable) -> tuple[dict[str, int], int]:
    """The sockets by the name of their state, and how many have a state number the kernel does not define."""
    named = {TCP_STATES[state]: count for state, count in table.states.items() if state in TCP_STATES}
    return named, sum(count for state, count in table.states.items() if state not in TCP_STATES)


@dataclass
class Counters:
    """Named counters read from a file; ``errors``: lines (or values) that did not parse."""

    values: dict[str, int] = field(default_factory=dict)
    errors: int = 0


def parse_netstat(text: str, section: str = "TcpExt") -> Counters:
    """The counters of one ``section`` of ``/proc/net/netstat`` (pairs of lines: ``TcpExt: Name ...`` then
    ``TcpExt: value ...``), their names lower-cased (``TCPTimeouts``: ``tcptimeouts``)."""
    out, prefix = Counters(), section + ":"
    lines = text.splitlines()
    for names_line, values_line in zip(lines[::2], lines[1::2], strict=False):
        names, values = names_line.split(), values_line.split()
        if not names or names[0] != prefix:
            continue
        if len(values) != len(names) or values[0] != prefix:
            out.errors += 1
            continue
        for name, value in zip(names[1:], values[1:], strict=True):
            if _is_number(value):
                out.values[name.lower()] = int(value)
            else:
                out.errors += 1
    if len(lines) % 2 and lines[-1].startswith(prefix):  # a names line without its values
        out.errors += 1
    return out


@dataclass
class Interfaces:
    """Counters by interface, then by :data:`INTERFACE_STATISTICS` name; ``errors``: lines that did not parse."""

    values: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: int = 0


def parse_net_dev(text: str) -> Interfaces:
    """``/proc/net/dev``: two header lines, then ``name: 16 counters`` a line; ``lo`` left out."""
    out = Interfaces()
    for line in text.splitlines()[2:]:
        name, colon, rest = line.partition(":")
        name, numbers = name.strip(), rest.split()
        if not colon or not name or len(numbers) != len(NET_DEV_COLUMNS) or not all(map(_is_number, numbers)):
            out.errors += 1
            continue
        if name != "lo":
            out.values[name] = {column: int(n) for column, n in zip(NET_DEV_COLUMNS, numbers, strict=True)
                                if column is not None}
    return out


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def top(counts: Mapping[str, int], limit: int) -> dict[str, int]:
    """The ``limit`` biggest counts (ties by name), the others summed under :data:`OTHER`."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    kept = dict(ranked[:limit])
    rest = ranked[limit:]
    if rest:
        kept[OTHER] = kept.get(OTHER, 0) + sum(count for _, count in rest)
    return kept


def top_interfaces(interfaces: Mapping[str, Mapping[str, int]], limit: int) -> dict[str, dict[str, int]]:
    """The ``limit`` interfaces that carried the most bytes (ties by name), every counter of the others
    summed under :data:`OTHER`."""
    ranked = sorted(interfaces.items(),
                    key=lambda item: (-(item[1].get("rx_bytes", 0) + item[1].get("tx_bytes", 0)), item[0]))
    kept = {name: dict(values) for name, values in ranked[:limit]}
    if len(ranked) > limit:
        other = kept.setdefault(OTHER, {})
        for _, values in ranked[limit:]:
            for statistic, value in values.items():
                other[statistic] = other.get(statistic, 0) + value
    return kept
