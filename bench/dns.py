"""DNS benchmark: what reading DNS in the TC programs costs a packet, DNS or not, and what the agent's drain costs.

Run (root): ``.venv/bin/python -m bench.dns [--repeat 1000000] [--runs 7]``

Per packet (BPF_PROG_TEST_RUN, ``--repeat`` repetitions per run, medians of ``--runs`` interleaved runs,
every object loaded with fresh unpinned maps and one observed pod):
* ``ns_per_packet_nodns``: ``pm_from_pod`` of ``podmeter_nodns.bpf.o`` (the same source built with
  ``PM_NO_DNS``: counting and flows, no DNS) on a 106-byte IPv4/UDP frame from the pod to port 7 (the
  counter and flow entries present: the steady-state hit);
* ``ns_per_packet_dns``: ``pm_from_pod`` of ``podmeter.bpf.o`` on the same frame;
  ``dns_overhead_ns`` = the difference (target <= 2: a non-DNS packet pays a port compare);
* ``ns_per_dns_query``: ``pm_from_pod`` of ``podmeter.bpf.o`` on a query for
  ``cart.shop.svc.cluster.local`` A to port 53 (the aggregate exists; the outstanding query is written
  each time), minus nothing: the whole program (target <= 1,000);
* ``ns_per_dns_response``: ``pm_to_pod`` on its NXDOMAIN response (its query is not outstanding after the
  first repetition: the lookup misses and the response is counted unmatched; a matched one adds a
  delete);
* ``ns_per_dns_query_253``: a query for a 253-character name (information: the longest walk).

Drain: ``agent_cpu_ms_per_1000_records``: the agent's CPU time (``time.thread_time``) to drain a ``dns``
map holding 1,000 aggregates (100 pods x 10 names, queries and responses) and turn them into the pods'
series and the DNS records (``DnsMaps.drain``, ``merge``, ``DnsLedger.add``, ``name_dns``), median of
``--runs``.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

from podmeter.adapters.datapath.ebpf import frames, layout
from podmeter.adapters.datapath.ebpf.datapath import FROM_POD, TO_POD, EbpfDatapath, map_sizes
from podmeter.adapters.datapath.ebpf.dns import DNS_MAP_NAMES, DnsMaps
from podmeter.adapters.datapath.ebpf.loader import Loaded, load
from podmeter.adapters.datapath.ebpf.preflight import OBJECT_NAME, object_path
from podmeter.model import dns
from podmeter.model.endpoints import AddressBook, ChainedNames
from podmeter.model.flow_records import EndpointCache, name_dns
from podmeter.model.records import Pod

NODNS_OBJECT_NAME = "podmeter_nodns.bpf.o"
POD, PEER, SERVER = "10.244.1.7", "192.0.2.1", "10.96.0.10"
DRAIN_PODS, DRAIN_NAMES = 100, 10
REPO = Path(__file__).resolve().parent.parent


def _query(name: str) -> bytes:
    return struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + dns.wire_name(name) + struct.pack("!HH", 1, 1)


def _response(name: str) -> bytes:
    raw = bytearray(_query(name))
    raw[2:4] = (0x8183).to_bytes(2, "big")  # QR, RD, RA, NXDOMAIN
    return bytes(raw)


def _load(name: str, dns_size: int = 4096) -> tuple[Loaded, EbpfDatapath]:
    sizes = map_sizes(64, 1024, dns_size)
    if name == NODNS_OBJECT_NAME:
        sizes = {k: v for k, v in sizes.items() if k not in DNS_MAP_NAMES}
    loaded = load(object_path(name), None, sizes, [FROM_POD, TO_POD])
    datapath = EbpfDatapath.from_loaded(loaded)
    assert datapath.insert([POD]).error is None
    return loaded, datapath


def per_packet(repeat: int, runs: int) -> dict[str, float]:
    """Median ns per packet of each case, the runs interleaved."""
    with_dns, with_dns_path = _load(OBJECT_NAME)
    without, _ = _load(NODNS_OBJECT_NAME)
    name = "cart.shop.svc.cluster.local"
    longest = ".".join(["x" * 63] * 3 + ["y" * 61])  # 253 characters
    assert len(longest) == 253
    plain = frames.udp_frame(POD, PEER)
    query = frames.ip_frame(POD, SERVER, frames.IPPROTO_UDP, frames.udp(_query(name), 40000, 53))
    long_query = frames.ip_frame(POD, SERVER, frames.IPPROTO_UDP, frames.udp(_query(longest), 40001, 53))
    answer = frames.ip_frame(SERVER, POD, frames.IPPROTO_UDP, frames.udp(_response(name), 53, 40000))
    cases = {
        "nodns": (without.programs[FROM_POD], plain),
        "dns": (with_dns.programs[FROM_POD], plain),
        "query": (with_dns.programs[FROM_POD], query),
        "response": (with_dns.programs[TO_POD], answer),
        "query_253": (with_dns.programs[FROM_POD], long_query),
    }
    try:
        for program, frame in cases.values():
            program.test_run(frame)  # the entries exist: the runs measure the steady state
        samples: dict[str, list[int]] = {case: [] for case in cases}
        for _ in range(runs):
            for case, (program, frame) in cases.items():
                samples[case].append(program.test_run(frame, repeat).duration_ns)
        assert with_dns_path.dns is not None
        counts = with_dns_path.dns.counts()
        assert counts[dns.Verdict.PARSED] > 0 and counts[dns.Verdict.NAME_LONG] == 0, counts
        return {case: float(statistics.median(values)) for case, values in samples.items()}
    finally:
        with_dns.close()
        without.close()


def _pod(n: int) -> Pod:
    return Pod(f"uid-{n}", "bench", f"pod-{n}", "node-bench", (f"10.244.{n // 200}.{n % 200 + 2}",), False,
               "Running", False, True, (), "1")


def _aggregates(pods: list[Pod]) -> tuple[list[bytes], list[bytes]]:
    """1,000 kernel entries: per pod, DRAIN_NAMES / 2 names, a query and an NXDOMAIN response each."""
    keys, values = [], []
    for pod in pods:
        for n in range(DRAIN_NAMES // 2):
            name = f"svc-{n}.bench.svc.cluster.local."
            for direction, rcode in ((dns.Direction.QUERY, 0), (dns.Direction.RESPONSE, 3)):
                keys.append(layout.dns_key(dns.DnsKey(pod.ips[0], SERVER, direction, name, 1, rcode, 17)))
                latency = 1 if direction is dns.Direction.RESPONSE else 0
                buckets = bytes(8 * 3) + (latency).to_bytes(8, "little") + bytes(8 * 9)
                values.append(layout.DNS_VALUE.pack(3, latency, latency * 4_000_000, buckets))
    return keys, values


def drain_cpu_ms(runs: int) -> float:
    """Median CPU ms of the agent's drain of 1,000 aggregates (see the module's docstring)."""
    loaded, datapath = _load(OBJECT_NAME, dns_size=2048)
    try:
        maps = datapath.dns
        assert isinstance(maps, DnsMaps)
        pods = [_pod(n) for n in range(DRAIN_PODS)]
        keys, values = _aggregates(pods)
        times = []
        for _ in range(runs):
            assert maps.aggregates.update_batch(keys, values).error is None
            ledger = dns.DnsLedger(30)
            for pod in pods:
                ledger.assign(pod.ips[0], pod, 0)
            holders = {pod.ips[0]: pod.uid for pod in pods}
            started = time.thread_time()
            entries = list(dns.merge(maps.drain().entries).items())
            ledger.add(entries, holders)
            records = name_dns(entries, EndpointCache(ChainedNames(AddressBook(pods))), "node-bench", time.time())
            times.append((time.thread_time() - started) * 1000)
            assert len(records) == len(keys) and ledger.unattributed == 0
        return statistics.median(times) * 1000 / len(keys)
    finally:
        loaded.close()


def stale_objects() -> list[str]:
    """Objects older than their sources (``make bpf`` does not know that podmeter_nodns.bpf.c includes
    podmeter.bpf.c)."""
    sources = REPO / "bpf"
    if not sources.is_dir():
        return []
    inputs = [sources / "podmeter.bpf.c", sources / "podmeter_nodns.bpf.c", *sources.glob("*.h")]
    return [name for name in (OBJECT_NAME, NODNS_OBJECT_NAME)
            if any(path.stat().st_mtime > object_path(name).stat().st_mtime for path in inputs)]


def measure(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, float]:
    progress("per packet")
    packet = per_packet(args.repeat, args.runs)
    progress("drain of 1,000 aggregates")
    return {
        "ns_per_packet_nodns": round(packet["nodns"], 1),
        "ns_per_packet_dns": round(packet["dns"], 1),
        "dns_overhead_ns": round(packet["dns"] - packet["nodns"], 1),
        "ns_per_dns_query": round(packet["query"], 1),
        "ns_per_dns_response": round(packet["response"], 1),
        "ns_per_dns_query_253": round(packet["query_253"], 1),
        "agent_cpu_ms_per_1000_records": round(drain_cpu_ms(args.runs), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--repeat", type=int, default=1_000_000, help="BPF_PROG_TEST_RUN repetitions per run")
    parser.add_argument("--runs", type=int, default=7, help="runs per figure (the median is reported)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench.dns needs root (BPF_PROG_TEST_RUN, map creation)", file=sys.stderr)
        return 2
    stale = stale_objects()
    if stale:
        print(f"bench.dns: {', '.join(stale)} older than its sources: `touch bpf/*.bpf.c && make bpf`",
              file=sys.stderr)
        return 2
    figures = measure(args, lambda step: print(f"  ... {step}", file=sys.stderr, flush=True))
    print(f"dns benchmark: {args.runs} runs of {args.repeat:,} repetitions, medians")
    notes = {"dns_overhead_ns": "target <= 2", "ns_per_dns_query": "target <= 1000",
             "ns_per_dns_response": "target <= 1000 (query not outstanding)",
             "agent_cpu_ms_per_1000_records": f"{DRAIN_PODS} pods x {DRAIN_NAMES} aggregates"}
    for name, value in figures.items():
        print(f"  {name:<32} {value:>10}   {notes.get(name, '')}")
    print(json.dumps({**figures, "repeat": args.repeat, "runs": args.runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
