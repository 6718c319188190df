"""The parsers of the node's kernel files (model.node_stats): tables on text captured from a real kernel
(tests/data/node_stats/: a network namespace with IPv4, IPv6 and IPv4-mapped TCP connections to another,
a loopback connection, listeners, UDP sockets), and a property: any text in, a result and counted errors
out, never an exception."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podmeter.model.node_stats import (
    INTERFACE_STATISTICS,
    OTHER,
    parse_net_dev,
    parse_netstat,
    parse_sockets,
    remote_address,
    tcp_states,
    top,
    top_interfaces,
)

CAPTURED = Path(__file__).resolve().parent.parent / "data" / "node_stats"


def captured(name: str) -> str:
    return (CAPTURED / name).read_text()


def test_a_captured_ipv4_tcp_table_by_state_and_remote_address() -> None:
    table = parse_sockets(captured("tcp"), "little")
    assert (table.sockets, table.errors) == (8, 0)
    assert tcp_states(table) == ({"LISTEN": 2, "ESTABLISHED": 5, "CLOSE_WAIT": 1}, 0)
    assert table.remotes == {"10.77.0.2": 4}  # 127.0.0.1 and the listeners' 0.0.0.0 left out


def test_a_captured_ipv6_tcp_table_names_ipv4_mapped_peers_by_their_ipv4_address() -> None:
    table = parse_sockets(captured("tcp6"), "little")
    assert tcp_states(table) == ({"LISTEN": 1, "ESTABLISHED": 3}, 0)
    assert table.remotes == {"fd00:77::2": 2, "10.77.0.2": 1}


def test_both_tables_add_up() -> None:
    table = parse_sockets(captured("tcp"), "little")
    table += parse_sockets(captured("tcp6"), "little")
    assert (table.sockets, table.remotes) == (12, {"10.77.0.2": 5, "fd00:77::2": 2})


@pytest.mark.parametrize(("name", "sockets"), [("udp", 1), ("udp6", 1)])
def test_captured_udp_tables_count_their_sockets(name: str, sockets: int) -> None:
    assert (parse_sockets(captured(name), "little").sockets, parse_sockets(captured(name)).errors) == (sockets, 0)


@pytest.mark.parametrize(("raw", "byteorder", "text"), [
    ("0100007F", "little", ""), ("00000000", "little", ""), ("7F000001", "big", ""),
    ("02004D0A", "little", "10.77.0.2"), ("0A4D0002", "big", "10.77.0.2"),
    ("770000FD000000000000000002000000", "little", "fd00:77::2"),
    ("0000000000000000FFFF000002004D0A", "little", "10.77.0.2"),
    ("00000000000000000000000001000000", "little", ""),  # ::1
    ("0100007", "little", None), ("0100007G", "little", None), ("01 0007F", "little", None), ("", "little", None),
])
def test_remote_addresses(raw: str, byteorder: str, text: str | None) -> None:
    assert remote_address(raw, byteorder) == text  # type: ignore[arg-type]


def test_lines_that_are_not_sockets_are_counted_not_raised() -> None:
    text = ("  sl  local_address rem_address   st\n"
            "   0: 0100007F:1F90 02004D0A:830C 01 00000000:00000000\n"
            "   1: 0100007F:1F90 nonsense 01\n"
            "garbage\n"
            "   2: 0100007F:1F90 02004D0A:830C ZZ\n"
            "   3: 0100007F:1F90 02004D0A:830C 1F\n")
    table = parse_sockets(text, "little")
    assert (table.sockets, table.errors, table.remotes) == (3, 3, {"10.77.0.2": 2})
    # a remote that is no address is an error, its socket still counted by state; 0x1F is no state of the kernel's
    assert tcp_states(table) == ({"ESTABLISHED": 2}, 1)


def test_the_captured_netstat_gives_the_tcpext_counters_lower_cased() -> None:
    counters = parse_netstat(captured("netstat"))
    assert counters.errors == 0
    assert {"tcptimeouts", "tcptsreorder", "syncookiessent", "tcpabortonclose"} <= set(counters.values)
    assert not any(name.startswith(("inoctets", "mpcapable")) for name in counters.values)  # IpExt, MPTcpExt not


@pytest.mark.parametrize(("text", "values", "errors"), [
    ("TcpExt: A B\nTcpExt: 1 2\n", {"a": 1, "b": 2}, 0),
    ("IpExt: A\nIpExt: 1\nTcpExt: TCPTimeouts\nTcpExt: 7\n", {"tcptimeouts": 7}, 0),
    ("TcpExt: A B\nTcpExt: 1\n", {}, 1),  # a value missing
    ("TcpExt: A B\nIpExt: 1 2\n", {}, 1),  # the pair's values are another section's
    ("TcpExt: A B\nTcpExt: 1 x\n", {"a": 1}, 1),
    ("TcpExt: A B\n", {}, 1),  # a names line without its values
    ("", {}, 0),
])
def test_netstat_pairs(text: str, values: dict[str, int], errors: int) -> None:
    counters = parse_netstat(text)
    assert (counters.values, counters.errors) == (values, errors)


def test_the_captured_net_dev_gives_every_interface_but_lo() -> None:
    interfaces = parse_net_dev(captured("dev"))
    assert (list(interfaces.values), interfaces.errors) == (["eth0"], 0)
    eth0 = interfaces.values["eth0"]
    assert tuple(eth0) == INTERFACE_STATISTICS
    assert (eth0["rx_packets"], eth0["tx_packets"], eth0["rx_bytes"], eth0["tx_dropped"]) == (17, 13, 1254, 0)


def test_net_dev_columns_are_the_kernels_counters() -> None:
    header = "Inter-|   Receive\n face |bytes    packets\n"
    line = "  veth1: " + " ".join(str(n) for n in range(1, 17)) + "\n"
    values = parse_net_dev(header + line + "broken line\n  x: 1 2\n").values["veth1"]
    assert values == {"rx_bytes": 1, "rx_packets": 2, "rx_errors": 3, "rx_dropped": 4, "rx_fifo_errors": 5,
                      "rx_compressed": 7, "multicast": 8, "tx_bytes": 9, "tx_packets": 10, "tx_errors": 11,
                      "tx_dropped": 12, "tx_fifo_errors": 13, "collisions": 14, "tx_compressed": 16}
    assert parse_net_dev(header + line + "broken line\n  x: 1 2\n").errors == 2


def test_top_keeps_the_biggest_and_sums_the_rest() -> None:
    assert top({"a": 1, "b": 5, "c": 3, "d": 3}, 2) == {"b": 5, "c": 3, OTHER: 4}
    assert top({"a": 1}, 2) == {"a": 1}


def test_top_interfaces_keeps_the_busiest_and_sums_the_others_counter_by_counter() -> None:
    interfaces = {"eth0": {"rx_bytes": 100, "tx_bytes": 100, "tx_dropped": 1},
                  "veth1": {"rx_bytes": 5, "tx_bytes": 0, "tx_dropped": 2},
                  "veth2": {"rx_bytes": 1, "tx_bytes": 1, "tx_dropped": 3}}
    assert top_interfaces(interfaces, 1) == {"eth0": interfaces["eth0"],
                                             OTHER: {"rx_bytes": 6, "tx_bytes": 1, "tx_dropped": 5}}
    assert top_interfaces(interfaces, 3) == interfaces


LINES = st.lists(st.one_of(st.text(max_size=80), st.sampled_from([
    "   0: 0100007F:1F90 02004D0A:830C 01 00000000:00000000", "TcpExt: A B", "TcpExt: 1 2",
    "  eth0: " + " 1" * 16, "x: 0100007F:1F90 :: 0A"])), max_size=12)


@settings(max_examples=400, deadline=None)
@given(LINES, st.sampled_from(["little", "big"]))
def test_every_parser_is_total(lines: list[str], byteorder: str) -> None:
    text = "\n".join(lines)
    table = parse_sockets(text, byteorder)  # type: ignore[arg-type]
    states, unknown = tcp_states(table)
    assert table.sockets == sum(states.values()) + unknown
    assert table.errors >= 0 and sum(table.remotes.values()) <= table.sockets
    assert parse_netstat(text).errors >= 0
    interfaces = parse_net_dev(text)
    assert "lo" not in interfaces.values and interfaces.errors >= 0
