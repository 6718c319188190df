"""What naming Service flows from the node's conntrack costs the agent: one dump of the translated
connections per flow drain (adapters/conntrack.py), at N translated connections, beside the table's other
connections that the status filter leaves in the kernel.

A private "node" netns with a client pod and a backend pod, a kube-proxy-style nftables DNAT from a
frontend to the backend, and N UDP "connections" (one datagram each from N source ports: each is a
conntrack entry with a rewritten destination), plus N untranslated ones straight to the backend. Then the
dump is timed (median of rounds) beside its reference, Debian's `conntrack -L --dst-nat` listing the same
entries, in the same run.

    sudo .venv/bin/python -m bench.conntrack                  # N = 1,000 and 10,000
    sudo .venv/bin/python -m bench.conntrack --sizes 1000 30000

Root only. Its last line is one JSON object.
"""

from __future__ import annotations

import argparse
import math
import shutil
import socket
import statistics
import subprocess
import time
import uuid

from bench.measure import json_line, table
from podmeter.adapters.conntrack import read_translations
from podmeter.adapters.datapath.ebpf.netns import netns

FRONTEND = "10.96.77.7"


def _run(*argv: str, stdin: str | None = None) -> None:
    subprocess.run(argv, input=stdin, text=True, check=True, capture_output=True)


class Node:
    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.host, self.client, self.backend = f"ctb{tag}h", f"ctb{tag}c", f"ctb{tag}b"

    def __enter__(self) -> Node:
        try:
            self._create()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _create(self) -> None:
        for name in (self.host, self.client, self.backend):
            _run("ip", "netns", "add", name)
        _run("ip", "netns", "exec", self.host, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run("ip", "netns", "exec", self.host, "sysctl", "-qw", "net.netfilter.nf_conntrack_max=1048576")
        for index, pod in enumerate((self.client, self.backend), start=1):
            _run("ip", "-n", self.host, "link", "add", f"v{index}", "type", "veth", "peer", "name", "eth0",
                 "netns", pod)
            _run("ip", "-n", self.host, "addr", "add", f"10.77.{index}.1/24", "dev", f"v{index}")
            _run("ip", "-n", self.host, "link", "set", f"v{index}", "up")
            _run("ip", "-n", pod, "addr", "add", f"10.77.{index}.2/24", "dev", "eth0")
            _run("ip", "-n", pod, "link", "set", "eth0", "up")
            _run("ip", "-n", pod, "route", "add", "default", "via", f"10.77.{index}.1")
        rules = (f"table ip bench {{\n chain pre {{\n  type nat hook prerouting priority dstnat;\n"
                 f"  ip daddr {FRONTEND} udp dport 53 dnat to 10.77.2.2:5353\n }}\n}}\n")
        _run("ip", "netns", "exec", self.host, "nft", "-f", "-", stdin=rules)

    def __exit__(self, *exc: object) -> None:
        for name in (self.client, self.backend, self.host):
            subprocess.run(["ip", "netns", "del", name], check=False)

    def connections(self, count: int, address: str, port: int, first_port: int) -> None:
        with netns(f"/run/netns/{self.client}"):
            for source in range(first_port, first_port + count):
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                    sock.bind(("10.77.1.2", source))
                    sock.sendto(b"q", (address, port))

    def dump_ms(self, rounds: int) -> tuple[float, int]:
        times, found = [], 0
        with netns(f"/run/netns/{self.host}"):
            for _ in range(rounds):
                start = time.perf_counter()
                found = len(read_translations())
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000, found

    def tool_ms(self, rounds: int) -> float:
        """The reference: Debian's `conntrack -L --dst-nat` listing the same entries (a process of its own)."""
        argv = ["ip", "netns", "exec", self.host, "conntrack", "-L", "--dst-nat"]
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            subprocess.run(argv, check=True, capture_output=True)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000


def measure(size: int, rounds: int) -> dict[str, float]:
    with Node() as node:
        node.connections(size, FRONTEND, 53, 10000)
        node.connections(size, "10.77.2.2", 9, 10000)  # untranslated: left in the kernel by the filter
        time.sleep(0.5)
        dump_ms, found = node.dump_ms(rounds)
        tool_ms = node.tool_ms(rounds) if shutil.which("conntrack") else math.nan
    return {"entries": found, "dump_ms": dump_ms, "us_per_translation": dump_ms * 1000 / max(found, 1),
            "tool_ms": tool_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    figures: dict[str, float] = {}
    rows = []
    for size in args.sizes:
        found = measure(size, args.rounds)
        if found["entries"] != size:
            raise SystemExit(f"expected {size} translated connections, the dump gave {found['entries']}")
        figures[f"dump_ms_{size}"] = found["dump_ms"]
        figures[f"us_per_translation_{size}"] = found["us_per_translation"]
        figures[f"conntrack_tool_ms_{size}"] = found["tool_ms"]
        figures[f"ratio_vs_conntrack_tool_{size}"] = found["dump_ms"] / found["tool_ms"]
        rows.append((f"dump_ms at {size:,} translated", found["dump_ms"], found["tool_ms"],
                     f"vs conntrack -L --dst-nat; +{size:,} untranslated; {found['us_per_translation']:.2f} us each"))
    table(rows)
    json_line(figures)


if __name__ == "__main__":
    main()
