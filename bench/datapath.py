"""Datapath benchmark: per-packet cost of the counting program, and filter write throughput.

Run (root): ``.venv/bin/python -m bench.datapath [--repeat 1000000] [--runs 7] [--filter-entries 256]``

Per packet: BPF_PROG_TEST_RUN runs ``pm_from_pod`` (the real counting program, with a filter of
``--filter-entries`` IPs and a hit on one of them) and, side by side in the same process,
``pm_parse_only`` (the same header parsing, no map access) on the same IPv4/UDP frame, ``--repeat``
times per run; the figures are medians over ``--runs`` interleaved runs. ``overhead_ratio`` is
counting / parse-only (target <= 1.2). The miss path (an unobserved IP) is shown for information.

Map writes: 10,000 IPs (half IPv4, half IPv6) batch-inserted then batch-deleted through the Python
layer (EbpfDatapath) on a fresh map, ``--runs`` times; ``map_ops_per_s`` = 20,000 / median time. The
in-memory datapath doing the same is printed as the reference.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from podmeter.adapters.datapath.ebpf import frames
from podmeter.adapters.datapath.ebpf.datapath import (
    COUNTERS_MAP,
    FILTER_MAP,
    FROM_POD,
    EbpfDatapath,
    counters_size,
)
from podmeter.adapters.datapath.ebpf.loader import Loaded, Program, load
from podmeter.adapters.datapath.ebpf.preflight import BARE_OBJECT_NAME, object_path
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.datapath import Datapath

PARSE_ONLY = "pm_parse_only"
MAP_OPS_IPS = 10_000
PEER = "192.0.2.1"


@dataclass(frozen=True)
class Figures:
    ns_per_packet: float
    ns_per_packet_bare: float
    ns_per_packet_miss: float
    map_ops_per_s: float
    map_ops_per_s_memory: float

    @property
    def overhead_ratio(self) -> float:
        return self.ns_per_packet / self.ns_per_packet_bare


def pod_ips(count: int) -> list[str]:
    """``count`` distinct IPs, alternating IPv4 (10.128/9) and IPv6 (fd00:bench::/64)."""
    return [
        str(ipaddress.IPv4Address(0x0A800000 + n)) if n % 2 == 0 else f"fd00:be::{n:x}" for n in range(count)
    ]


def unpinned(filter_size: int, programs: list[str]) -> Loaded:
    """The counting object with fresh maps that are not pinned anywhere (nothing to clean up)."""
    sizes = {FILTER_MAP: filter_size, COUNTERS_MAP: counters_size(filter_size)}
    return load(object_path(), None, sizes, programs)


def per_packet(repeat: int, runs: int, entries: int) -> tuple[float, float, float]:
    """Median ns per packet of (counting hit, parse-only, counting miss)."""
    counting = unpinned(max(entries, 1), [FROM_POD])
    bare = load(object_path(BARE_OBJECT_NAME), None, {}, [PARSE_ONLY])
    try:
        datapath = EbpfDatapath(counting.maps[FILTER_MAP], counting.maps[COUNTERS_MAP])
        observed = pod_ips(entries)
        assert datapath.insert(observed).error is None
        hit = frames.udp_frame(observed[0], PEER)
        miss = frames.udp_frame("10.255.255.254", PEER)
        program, parse_only = counting.programs[FROM_POD], bare.programs[PARSE_ONLY]
        program.test_run(hit)  # creates the counter entry: the runs below measure the steady state
        samples: dict[str, list[int]] = {"hit": [], "bare": [], "miss": []}
        for _ in range(runs):
            samples["hit"].append(_timed(program, hit, repeat))
            samples["bare"].append(_timed(parse_only, hit, repeat))
            samples["miss"].append(_timed(program, miss, repeat))
        medians = {name: float(statistics.median(values)) for name, values in samples.items()}
        return medians["hit"], medians["bare"], medians["miss"]
    finally:
        counting.close()
        bare.close()


def _timed(program: Program, frame: bytes, repeat: int) -> int:
    result = program.test_run(frame, repeat)
    return result.duration_ns


def map_ops(runs: int, make: Callable[[], tuple[Datapath, Callable[[], None]]]) -> float:
    """Median insert+delete operations per second for MAP_OPS_IPS IPs in one batch each."""
    ips = pod_ips(MAP_OPS_IPS)
    times = []
    for _ in range(runs):
        datapath, close = make()
        try:
            start = time.perf_counter()
            inserted = datapath.insert(ips)
            deleted = datapath.delete(ips)
            times.append(time.perf_counter() - start)
            assert inserted.applied == deleted.applied == MAP_OPS_IPS, (inserted, deleted)
        finally:
            close()
    return 2 * MAP_OPS_IPS / statistics.median(times)


def ebpf_datapath() -> tuple[Datapath, Callable[[], None]]:
    loaded = unpinned(MAP_OPS_IPS, [])
    return EbpfDatapath(loaded.maps[FILTER_MAP], loaded.maps[COUNTERS_MAP]), loaded.close


def memory_datapath() -> tuple[Datapath, Callable[[], None]]:
    return MemoryDatapath(MAP_OPS_IPS), lambda: None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--repeat", type=int, default=1_000_000, help="BPF_PROG_TEST_RUN repetitions per run")
    parser.add_argument("--runs", type=int, default=7, help="runs per figure (the median is reported)")
    parser.add_argument("--filter-entries", type=int, default=256, help="IPs in the filter map")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench.datapath needs root (BPF_PROG_TEST_RUN, map creation)", file=sys.stderr)
        return 2
    hit, bare, miss = per_packet(args.repeat, args.runs, args.filter_entries)
    figures = Figures(hit, bare, miss, map_ops(args.runs, ebpf_datapath), map_ops(args.runs, memory_datapath))
    print_table(figures, args)
    print(json.dumps(summary(figures, args)))
    return 0


def print_table(fig: Figures, args: argparse.Namespace) -> None:
    print(f"datapath benchmark: {args.runs} runs, medians; filter of {args.filter_entries} IPs")
    rows = [
        ("ns/packet, counting, filter hit", f"{fig.ns_per_packet:.0f}", f"repeat {args.repeat:,}"),
        ("ns/packet, parse only (reference)", f"{fig.ns_per_packet_bare:.0f}", "same frame"),
        ("overhead ratio (target <= 1.2)", f"{fig.overhead_ratio:.2f}", "hit / parse only"),
        ("ns/packet, counting, filter miss", f"{fig.ns_per_packet_miss:.0f}", "unobserved IP"),
        ("map ops/s, eBPF (batched)", f"{fig.map_ops_per_s:,.0f}", f"{MAP_OPS_IPS:,} inserts + deletes"),
        ("map ops/s, memory (reference)", f"{fig.map_ops_per_s_memory:,.0f}", "same batches"),
    ]
    for name, value, note in rows:
        print(f"  {name:<36} {value:>14}   {note}")


def summary(fig: Figures, args: argparse.Namespace) -> dict[str, object]:
    return {
        "ns_per_packet": round(fig.ns_per_packet, 1),
        "ns_per_packet_bare": round(fig.ns_per_packet_bare, 1),
        "overhead_ratio": round(fig.overhead_ratio, 3),
        "ns_per_packet_miss": round(fig.ns_per_packet_miss, 1),
        "map_ops_per_s": round(fig.map_ops_per_s),
        "map_ops_per_s_memory": round(fig.map_ops_per_s_memory),
        "repeat": args.repeat,
        "runs": args.runs,
        "filter_entries": args.filter_entries,
    }


if __name__ == "__main__":
    sys.exit(main())
