"""Drops benchmark: what ``pm_kfree_skb`` costs per call, under a real drop flood, by the kernel's own clock.

Run (root): ``.venv/bin/python -m bench.drops [--packets 200000] [--runs 5] [--filter-entries 256]``

The drop program runs on ``skb:kfree_skb`` for every packet the node drops, observed or not, so its cost
per call is the figure. It cannot be timed with BPF_PROG_TEST_RUN (tracing programs of this kind have no
test run), so it is timed where it runs: a pod (a network namespace with a veth to a "node" namespace that
forwards) sends ``--packets`` UDP datagrams to a destination the node routes into a ``blackhole``; each is
dropped on the node (``kfree_skb``, reason NOT_SPECIFIED on this kernel) and runs the program once. The
kernel's BPF run-time statistics (``BPF_ENABLE_STATS``, the same as ``kernel.bpf_stats_enabled=1``, on
only while the benchmark holds its descriptor) add up each program's ``run_time_ns`` and ``run_cnt``;
the figure is their difference over a run divided (time / calls).

* ``drop_ns_per_event_unobserved``: the flooding pod is not in the filter (``--filter-entries`` other IPs
  are): the header read and the two filter lookups, then out. What every drop of an unobserved pod pays.
* ``drop_ns_per_event_observed``: the pod's IP is in the filter: the same, then the ``drops`` and
  ``drop_flows`` entries of its (one) dropped flow updated (their steady state: both entries exist).
* ``drop_ns_per_event_floor`` (information): ``pm_kfree_skb_nop`` (``podmeter_drops_nop.bpf.o``, a
  program that returns at once) on the same tracepoint and flood: the statistics' own cost (two clock reads
  per call) and the call. The figures above include it.

Medians of ``--runs`` interleaved runs. ``run_cnt`` also counts drops elsewhere on the machine during a
run; ``calls_per_packet`` shows they are negligible. Nothing is pinned; every namespace is removed.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ipaddress
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from podmeter.adapters.datapath.ebpf import layout, preflight
from podmeter.adapters.datapath.ebpf.drops import FILTER_MAP, DropTracer, attach_program
from podmeter.adapters.datapath.ebpf.libbpf import libbpf
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.model.drops import HOOK_DROPS

NOP_OBJECT = "podmeter_drops_nop.bpf.o"
BLACKHOLE = "198.51.100.77"
POD_IP, NODE_IP = "10.233.0.2", "10.233.0.1"
BPF_STATS_RUN_TIME = 0
PROG_INFO_BYTES = 256  # struct bpf_prog_info, far enough to hold run_time_ns and run_cnt
RUN_TIME_OFFSET, RUN_COUNT_OFFSET = 192, 200  # offsets of run_time_ns and run_cnt in struct bpf_prog_info


@dataclass(frozen=True)
class Run:
    ns: int
    calls: int

    @property
    def per_call(self) -> float:
        return self.ns / self.calls if self.calls else float("nan")


def program_stats(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a loaded program, from BPF_OBJ_GET_INFO_BY_FD."""
    info = ctypes.create_string_buffer(PROG_INFO_BYTES)
    length = ctypes.c_uint32(PROG_INFO_BYTES)
    libbpf().call("bpf_obj_get_info_by_fd", fd, info, ctypes.byref(length))
    return (int.from_bytes(info.raw[RUN_TIME_OFFSET:RUN_TIME_OFFSET + 8], sys.byteorder),
            int.from_bytes(info.raw[RUN_COUNT_OFFSET:RUN_COUNT_OFFSET + 8], sys.byteorder))


@contextlib.contextmanager
def run_time_stats() -> Iterator[None]:
    """BPF run-time statistics on while the block runs (BPF_ENABLE_STATS: off again when the fd closes)."""
    lib = libbpf()
    lib.lib.bpf_enable_stats.restype, lib.lib.bpf_enable_stats.argtypes = ctypes.c_int, [ctypes.c_int]
    fd = lib.call("bpf_enable_stats", BPF_STATS_RUN_TIME)
    try:
        yield
    finally:
        os.close(fd)


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@contextlib.contextmanager
def flood_topology() -> Iterator[str]:
    """A node netns forwarding for one pod netns, with a blackhole route; yields the pod's netns path."""
    tag = f"{os.getpid() % 100000}"
    node, pod, veth = f"pmbn{tag}", f"pmbp{tag}", f"pmb{tag}"
    try:
        sh("ip", "netns", "add", node)
        sh("ip", "netns", "add", pod)
        sh("ip", "-n", node, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", pod)
        sh("ip", "-n", node, "addr", "add", f"{NODE_IP}/24", "dev", veth)
        sh("ip", "-n", node, "link", "set", veth, "up")
        sh("ip", "-n", pod, "addr", "add", f"{POD_IP}/24", "dev", "eth0")
        sh("ip", "-n", pod, "link", "set", "eth0", "up")
        sh("ip", "-n", pod, "route", "add", "default", "via", NODE_IP)
        sh("ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for namespace in (node, pod):
            sh("ip", "netns", "exec", namespace, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        sh("ip", "-n", node, "route", "add", "blackhole", BLACKHOLE)
        yield f"/run/netns/{pod}"
    finally:
        for namespace in (node, pod):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


def flood(pod: str, packets: int) -> None:
    with netns(pod):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        sock.bind((POD_IP, 40000))  # one source port: one dropped flow
        payload, target = b"x" * 64, (BLACKHOLE, 53)
        for _ in range(packets):
            sock.sendto(payload, target)


def measured(fd: int, work: Callable[[], None]) -> Run:
    time_before, calls_before = program_stats(fd)
    work()
    time_after, calls_after = program_stats(fd)
    return Run(time_after - time_before, calls_after - calls_before)


def fill_filter(tracer: DropTracer, entries: int) -> None:
    """``entries`` IPs that are not the pod's (the trie a lookup walks is not empty)."""
    ips = [str(ipaddress.IPv4Address(int(ipaddress.IPv4Address("10.240.0.0")) + i)) for i in range(entries)]
    keys = [layout.filter_key(ip) for ip in ips]
    outcome = tracer.maps[FILTER_MAP].update_batch(keys, [layout.FILTER_VALUE] * len(keys))
    assert outcome.error is None, outcome.error


def measure(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {"unobserved": [], "observed": [], "floor": []}
    with flood_topology() as pod, run_time_stats(), DropTracer.open(None, 1024) as tracer:
        assert tracer.hooks[HOOK_DROPS], tracer.notices
        fill_filter(tracer, args.filter_entries)
        drop_fd = tracer.programs[HOOK_DROPS].fd
        filter_map, pod_key = tracer.maps[FILTER_MAP], layout.filter_key(POD_IP)
        nop, nop_link = attach_program(preflight.object_path(NOP_OBJECT), "pm_kfree_skb_nop", "kfree_skb")
        try:
            flood(pod, 2000)  # warm: neighbours, route cache
            for run in range(args.runs):
                progress(f"run {run + 1} of {args.runs}")
                filter_map.delete(pod_key)
                runs["unobserved"].append(measured(drop_fd, lambda: flood(pod, args.packets)))
                filter_map.update(pod_key, layout.FILTER_VALUE)
                runs["observed"].append(measured(drop_fd, lambda: flood(pod, args.packets)))
                tracer.drain_drops()
                runs["floor"].append(measured(nop.fd, lambda: flood(pod, args.packets)))
            assert sum(tracer.drops_lost().values()) == 0
        finally:
            os.close(nop_link)
            nop.close()
    return runs


def median(runs: list[Run]) -> float:
    return statistics.median(run.per_call for run in runs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--packets", type=int, default=200_000, help="dropped packets per run")
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (the median is reported)")
    parser.add_argument("--filter-entries", type=int, default=256, help="other IPs in the filter")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench.drops needs root (BPF, network namespaces)", file=sys.stderr)
        return 2
    runs = measure(args, lambda step: print(f"  ... {step}", file=sys.stderr, flush=True))
    calls = statistics.median(run.calls for run in runs["unobserved"] + runs["observed"])
    figures = {
        "drop_ns_per_event_unobserved": round(median(runs["unobserved"]), 1),
        "drop_ns_per_event_observed": round(median(runs["observed"]), 1),
        "drop_ns_per_event_floor": round(median(runs["floor"]), 1),
        "calls_per_packet": round(calls / args.packets, 4),
        "packets": args.packets,
        "runs": args.runs,
        "filter_entries": args.filter_entries,
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
    }
    print(f"drops benchmark: {args.runs} runs of {args.packets:,} dropped packets, medians (BPF run-time stats)")
    for name, note in (("drop_ns_per_event_unobserved", "pod not in the filter: 2 trie lookups, out"),
                       ("drop_ns_per_event_observed", "pod in the filter: + drops and drop_flows updates"),
                       ("drop_ns_per_event_floor", "an empty program: the statistics' own cost")):
        spread = ", ".join(f"{r.per_call:.0f}" for r in runs[name.split("_")[-1]])
        print(f"  {name:<32} {figures[name]:>8}   {note} (runs: {spread})")
    print(f"  {'calls per dropped packet':<32} {figures['calls_per_packet']:>8}   other drops of the machine included")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
