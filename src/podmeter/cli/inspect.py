"""`podmeter inspect filter|counters|flows`: print the pinned maps of a (running or dead) agent.

Reads the pins directly (``bpf_obj_get``) from this separate process: what it prints is what the
kernel holds, not what an agent believes. Exit status 1 with a one-line reason when the pins cannot be
opened (no agent ever ran there, bpffs not mounted, not root).

``flows`` reads the flows map without draining it: the entries the agent will take at its next drain.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
import time
from typing import Any

from podmeter.adapters.datapath.ebpf import DEFAULT_BPFFS, DatapathSetupError, EbpfDatapath
from podmeter.adapters.datapath.ebpf.libbpf import BpfCallError
from podmeter.model.datapath import Direction, Traffic
from podmeter.model.flows import ICMP, ICMPV6, TCP, UDP, FlowEntry, protocol_name, tcp_flag_names
from podmeter.model.hostport import host_port


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "inspect",
        help="print the pinned filter, counters or flows map",
        description="Read podmeter's pinned BPF maps from a separate process and print them "
        "(flows: without draining them).",
    )
    parser.add_argument("what", choices=["filter", "counters", "flows"], help="which map to print")
    parser.add_argument("--bpffs", default=DEFAULT_BPFFS, help=f"pin directory (default {DEFAULT_BPFFS})")
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table", help="output format")
    parser.add_argument("--json", action="store_true", help="same as -o json")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        datapath = EbpfDatapath.open_pinned(args.bpffs)
    except (BpfCallError, DatapathSetupError) as error:
        reason = _reason(error)
        print(f"podmeter inspect: cannot open the maps pinned in {args.bpffs}: {reason}", file=sys.stderr)
        return 1
    with datapath:
        if args.what == "flows" and datapath.flows_map is None:
            print(f"podmeter inspect: no flows map pinned in {args.bpffs} (its agent predates flows)",
                  file=sys.stderr)
            return 1
        print(_render(datapath, args.what, args.json or args.output == "json"))
    return 0


def _render(datapath: EbpfDatapath, what: str, as_json: bool) -> str:
    if what == "filter":
        return _filter(datapath, as_json)
    if what == "flows":
        return _flows(datapath, as_json)
    return _counters(datapath.read_counters(), as_json)


def _filter(datapath: EbpfDatapath, as_json: bool) -> str:
    ips = sorted(datapath.contents(), key=_ip_order)
    if as_json:
        return json.dumps({"capacity": datapath.capacity, "entries": len(ips), "ips": ips})
    lines = [f"filter: {len(ips)} of {datapath.capacity} entries", *ips]
    return "\n".join(lines)


def _counters(counters: dict[tuple[str, Direction], Traffic], as_json: bool) -> str:
    rows = sorted(counters.items(), key=lambda item: (_ip_order(item[0][0]), item[0][1].value))
    if as_json:
        return json.dumps(
            [
                {"ip": ip, "direction": direction.value, "packets": value.packets, "bytes": value.bytes}
                for (ip, direction), value in rows
            ]
        )
    width = max([len("IP"), *(len(ip) for (ip, _), _ in rows)])
    lines = [f"{'IP':<{width}}  {'DIRECTION':<9}  {'PACKETS':>12}  {'BYTES':>16}"]
    for (ip, direction), value in rows:
        lines.append(f"{ip:<{width}}  {direction.value:<9}  {value.packets:>12}  {value.bytes:>16}")
    return "\n".join(lines)


def _flows(datapath: EbpfDatapath, as_json: bool) -> str:
    entries = sorted(datapath.read_flows(), key=_flow_order)
    lost = datapath.flows_lost_traffic()
    if as_json:
        return json.dumps(
            {
                "capacity": datapath.flow_capacity,
                "entries": len(entries),
                "lost_packets": lost.packets,
                "lost_bytes": lost.bytes,
                "flows": [_flow_json(entry) for entry in entries],
            }
        )
    now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # the clock of first_ns / last_ns
    header = (
        f"flows: {len(entries)} of {datapath.flow_capacity} entries; "
        f"lost (map full): {lost.packets} packets, {lost.bytes} bytes"
    )
    rows = [("OBSERVATION", "PROTO", "SOURCE", "DESTINATION", "PACKETS", "BYTES", "FIRST", "LAST", "DETAIL")]
    for key, counts in entries:
        rows.append(
            (
                key.observation.value,
                protocol_name(key.protocol),
                _endpoint(key.source, key.source_port, key.protocol),
                _endpoint(key.destination, key.destination_port, key.protocol),
                str(counts.packets),
                str(counts.bytes),
                _ago(now, counts.first_ns),
                _ago(now, counts.last_ns),
                _detail(key.protocol, key.source_port, key.destination_port, counts.tcp_flags),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    right = {4, 5, 6, 7}  # numbers
    lines = [header]
    for row in rows:
        cells = [cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _flow_json(entry: FlowEntry) -> dict[str, Any]:
    key, counts = entry
    return {
        "observation": key.observation.value,
        "protocol": key.protocol,
        "protocol_name": protocol_name(key.protocol),
        "source": key.source,
        "source_port": key.source_port,
        "destination": key.destination,
        "destination_port": key.destination_port,
        "packets": counts.packets,
        "bytes": counts.bytes,
        "first_ns": counts.first_ns,
        "last_ns": counts.last_ns,
        "tcp_flags": counts.tcp_flags,
        "tcp_flag_names": tcp_flag_names(counts.tcp_flags),
    }


def _flow_order(entry: FlowEntry) -> tuple[Any, ...]:
    key = entry[0]
    return (key.observation.value, _ip_order(key.source), _ip_order(key.destination), key.protocol,
            key.source_port, key.destination_port)


def _endpoint(ip: str, port: int, protocol: int) -> str:
    if protocol not in (TCP, UDP):
        return ip
    return host_port(ip, port)


def _detail(protocol: int, source_port: int, destination_port: int, tcp_flags: int) -> str:
    if protocol == TCP:
        return ",".join(tcp_flag_names(tcp_flags))
    if protocol in (ICMP, ICMPV6):
        return f"type {source_port} code {destination_port}"
    return ""


def _ago(now_ns: int, then_ns: int) -> str:
    return f"{max(0, now_ns - then_ns) / 1e9:.1f}s"


def _ip_order(ip: str) -> tuple[int, int]:
    """IPv4 before IPv6, then numerically."""
    address = ipaddress.ip_address(ip)
    return address.version, int(address)


def _reason(error: Exception) -> str:
    if isinstance(error, BpfCallError) and error.errno_name == "ENOENT":
        return "no pinned maps there (has an agent with --datapath ebpf run with this --bpffs?)"
    if isinstance(error, BpfCallError) and error.errno_name in ("EPERM", "EACCES"):
        return "permission denied (run as root)"
    return str(error)
