"""The attach manager's link reader against a general netlink library, on the same links in one run.

The agent dumps a node's links at every attach pass (adapters/datapath/ebpf/links.py walks each message
with ``struct`` until it has what the attach rule needs); pyroute2 decodes every attribute of every
message into objects. This bench makes N veth pairs (host side here, peer in a private netns, as a CNI
makes them), then times a full dump with each reader, interleaved, and one qdisc question per reader.
The product keeps its own reader (and no longer depends on pyroute2, which only the lab uses).

    sudo .venv/bin/python -m bench.links              # 300 links, 15 rounds
    sudo .venv/bin/python -m bench.links --links 1000

Root only. Its last line is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable

from pyroute2 import IPRoute

from bench.measure import json_line, table
from podmeter.adapters.datapath.ebpf import links
from podmeter.adapters.datapath.ebpf.netns import netns as inside


def _median_ms(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _veths(host: str, pods: str, tag: str, count: int) -> None:
    batch = "".join(f"link add {tag}{i} type veth peer name p{i} netns {pods}\n" for i in range(count))
    subprocess.run(["ip", "-n", host, "-batch", "-"], input=batch, text=True, check=True)


def measure(count: int, rounds: int) -> dict[str, float]:
    tag = "lb" + uuid.uuid4().hex[:6]
    host, pods = tag + "h", tag + "p"  # a private "node" netns, away from the real node's links
    for name in (host, pods):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        _veths(host, pods, tag, count)
        with inside(f"/run/netns/{host}"), IPRoute() as ipr, links.Rtnl() as rtnl:
            theirs, mine, theirs_q, mine_q = [], [], [], []
            for _ in range(rounds):  # interleaved: the machine's noise falls on both
                theirs.append(_median_ms(lambda: list(ipr.get_links()), 1))
                mine.append(_median_ms(links.read_links, 1))
                theirs_q.append(_median_ms(lambda: [q.get_attr("TCA_KIND") for q in ipr.get_qdiscs(index=1)], 1))
                mine_q.append(_median_ms(lambda: rtnl.qdisc_kinds(1), 1))
    finally:
        for name in (pods, host):
            subprocess.run(["ip", "netns", "del", name], check=False)
    return {
        "links": count,
        "dump_ms_podmeter": statistics.median(mine),
        "dump_ms_pyroute2": statistics.median(theirs),
        "dump_ratio_vs_pyroute2": statistics.median(mine) / statistics.median(theirs),
        "qdisc_ms_podmeter": statistics.median(mine_q),
        "qdisc_ms_pyroute2": statistics.median(theirs_q),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    figures = measure(args.links, args.rounds)
    table([
        ("dump_ms (podmeter vs pyroute2)", figures["dump_ms_podmeter"], figures["dump_ms_pyroute2"],
         f"{args.links} veths + lo, median of {args.rounds}"),
        ("qdisc_ms (podmeter vs pyroute2)", figures["qdisc_ms_podmeter"], figures["qdisc_ms_pyroute2"],
         "one interface's qdiscs"),
    ])
    json_line(figures)


if __name__ == "__main__":
    main()
