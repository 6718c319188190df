"""`podmeter inspect filter|counters`: print the pinned maps of a (running or dead) agent.

Reads the pins directly (``bpf_obj_get``) from this separate process: what it prints is what the
kernel holds, not what an agent believes. Exit status 1 with a one-line reason when the pins cannot be
opened (no agent ever ran there, bpffs not mounted, not root).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from typing import Any

from podmeter.adapters.datapath.ebpf import DEFAULT_BPFFS, DatapathSetupError, EbpfDatapath
from podmeter.adapters.datapath.ebpf.libbpf import BpfCallError
from podmeter.model.datapath import Direction, Traffic


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "inspect",
        help="print the pinned filter or counters map",
        description="Read podmeter's pinned BPF maps from a separate process and print them.",
    )
    parser.add_argument("what", choices=["filter", "counters"], help="which map to print")
    parser.add_argument("--bpffs", default=DEFAULT_BPFFS, help=f"pin directory (default {DEFAULT_BPFFS})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        datapath = EbpfDatapath.open_pinned(args.bpffs)
    except (BpfCallError, DatapathSetupError) as error:
        reason = _reason(error)
        print(f"podmeter inspect: cannot open the maps pinned in {args.bpffs}: {reason}", file=sys.stderr)
        return 1
    with datapath:
        print(_render(datapath, args.what, args.json))
    return 0


def _render(datapath: EbpfDatapath, what: str, as_json: bool) -> str:
    if what == "filter":
        return _filter(datapath, as_json)
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
