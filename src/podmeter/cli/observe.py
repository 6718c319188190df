"""``podmeter observe``: the flows an agent saw, as ``hubble observe`` shows them.

Reads the agent's ``/debug/flows`` stream (NDJSON) and prints one line per flow (``-o compact``) or the
records themselves (``-o json``, one JSON object per line; the fields are a contract, docs/flows.md).
Without ``--follow`` it prints the last ``--last`` matching flows (default 20) and exits; with it, it keeps
printing new flows until interrupted. The agent answers on loopback only unless it runs with
``--debug-remote`` (flows name pods and IPs).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import re
import sys
import time
import urllib.parse
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from podmeter.adapters.http import parse_listen

DEFAULT_SERVER = "127.0.0.1:9978"  # the agent's default --listen
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "observe", help="show the flows an agent saw (who talks to whom)", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--server", default=DEFAULT_SERVER, help="the agent's HTTP address, HOST:PORT")
    p.add_argument("-o", "--output", choices=("compact", "json"), default="compact", help="output format")
    p.add_argument("--last", type=_count, default=None,
                   help="print the last N matching flows first (default: 20, or 0 with --follow)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new flows until interrupted")
    p.add_argument("--namespace", help="flows with either end in this namespace")
    p.add_argument("--pod", help="flows with either end this pod: NAME or NAMESPACE/NAME")
    p.add_argument("--from-pod", help="flows whose source is this pod: NAME or NAMESPACE/NAME")
    p.add_argument("--to-pod", help="flows whose destination is this pod: NAME or NAMESPACE/NAME")
    p.add_argument("--workload", help="flows with either end this workload: NAME or NAMESPACE/NAME, or world")
    p.add_argument("--protocol", help="tcp, udp, icmp (either), icmpv4, icmpv6")
    p.add_argument("--port", type=_port, help="flows with either end on this port")
    p.add_argument("--verdict", choices=("forwarded", "dropped"),
                   help="forwarded flows only, or the packets the kernel dropped (with their reason)")
    p.add_argument("--since", type=parse_since,
                   help="flows seen since this long ago (30s, 5m, 2h) or this time (RFC 3339 or epoch seconds)")
    p.add_argument("--labels", action="store_true",
                   help="show each end's labels (a pod of the agent's node: its own; another node's: its identity's)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the agent to answer")
    p.set_defaults(func=run)


def _count(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"must be a number of flows, not {value!r}")
    return int(value)


def _port(value: str) -> int:
    if not value.isdigit() or not 0 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535, not {value!r}")
    return int(value)


def parse_since(value: str, now: float | None = None) -> float:
    """``30s``/``5m``/``2h``/``1d`` ago, an RFC 3339 time or epoch seconds -> epoch seconds."""
    match = _DURATION.match(value.strip())
    if match:
        return (time.time() if now is None else now) - float(match.group(1)) * _UNITS[match.group(2)]
    with contextlib.suppress(ValueError):
        return float(value)
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--since {value!r}: expected a duration (30s, 5m, 2h) or a time (RFC 3339, epoch seconds)") from None


def query(args: argparse.Namespace) -> dict[str, str]:
    params: dict[str, str] = {}
    if args.follow:
        params["follow"] = "1"
    if args.last is not None:
        params["last"] = str(args.last)
    if args.labels:
        params["labels"] = "1"
    for name in ("namespace", "pod", "from_pod", "to_pod", "workload", "protocol", "port", "since", "verdict"):
        value = getattr(args, name)
        if value is not None:
            params[name] = str(value)
    return params


class AgentRefused(Exception):
    """The agent answered with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status


def run(args: argparse.Namespace) -> int:
    try:
        host, port = parse_listen(args.server)
    except ValueError:
        print(f"podmeter observe: --server {args.server!r}: expected HOST:PORT", file=sys.stderr)
        return 2
    path = f"/debug/flows?{urllib.parse.urlencode(query(args))}"
    out = sys.stdout
    try:
        for record in _stream(host, port, path, args.timeout):
            out.write(json.dumps(record, separators=(",", ":")) + "\n" if args.output == "json" else compact(record))
            out.flush()
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # the reader of our output went (| head)
        return 0
    except AgentRefused as exc:
        print(f"podmeter observe: the agent at {args.server} answered {exc}", file=sys.stderr)
        return 2 if exc.status == 400 else 1
    except OSError as exc:
        print(f"podmeter observe: cannot reach the agent at {args.server}: {exc} "
              "(is `podmeter agent` running there? --server HOST:PORT)", file=sys.stderr)
        return 1
    return 0


def _stream(host: str, port: int, path: str, timeout: float) -> Iterator[dict[str, Any]]:
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        if response.status != 200:
            raise AgentRefused(response.status, response.read().decode(errors="replace").strip())
        if connection.sock is not None:
            connection.sock.settimeout(None)  # it answered: a follow may now wait for flows as long as it takes
        for line in response:
            if line.strip():
                yield json.loads(line)
    finally:
        connection.close()


# --- the compact line ---------------------------------------------------------------------------------


def _end(end: dict[str, Any]) -> str:
    where = end["ip"] if end.get("port") is None else _host_port(end["ip"], end["port"])
    if end.get("world"):
        return f"world {where}"
    labels = end.get("labels")
    shown = "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "} " if labels else ""
    return f"{end['namespace']}/{end['pod']} {shown}{where}"


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def compact(record: dict[str, Any]) -> str:
    """One readable line: time, source -> destination with ports, protocol and flags, packets, bytes."""
    stamp = datetime.fromtimestamp(record["time"]).strftime("%b %d %H:%M:%S.%f")[:-3]
    protocol = record["protocol"]
    if "icmp" in record:
        protocol += f" type {record['icmp']['type']} code {record['icmp']['code']}"
    flags = f" [{' '.join(record['tcp_flags'])}]" if record.get("tcp_flags") else ""
    verdict = "" if record.get("verdict", "forwarded") == "forwarded" else f" {record['verdict'].upper()}"
    if record.get("drop_reason"):
        verdict += f" ({record['drop_reason']})"
    if record.get("tcp_retransmits"):
        flags += f" {record['tcp_retransmits']} retransmits"
    return (f"{stamp} {record['node']}: {_end(record['source'])} -> {_end(record['destination'])} "
            f"{protocol}{flags} {record['observation']}{verdict} {record['packets']} pkts {record['bytes']} B\n")
