"""Flows benchmark: per-packet cost of in-kernel flow aggregation, and the cost of draining the flows map.

Run (root): ``.venv/bin/python -m bench.flows [--repeat 1000000] [--runs 7]``

Per packet (BPF_PROG_TEST_RUN, the same 106-byte IPv4/UDP frame from an observed source, ``--repeat``
repetitions per run, medians of ``--runs`` interleaved runs):
* ``ns_per_packet_flows``: ``pm_from_pod`` of ``podmeter.bpf.o`` (counting + flow aggregation), the
  counter entry and the flow entry present (the steady-state hit);
* ``ns_per_packet``: ``pm_from_pod`` of ``podmeter_noflows.bpf.o`` (the same source without flows);
* ``ns_per_packet_bare``: ``pm_parse_only`` (the same parser, no map access).
``ns_per_packet_flows_unobserved`` (information): the flows program on a frame between two unobserved
IPs (the counter miss, then both ends looked up in the filter, no flow). The filter holds the one observed
IP, so each trie lookup visits one node: the cheapest miss.
``ns_per_packet_flows_unobserved_near`` (information): the same on a frame between two unobserved IPs of
the node's pod range (10.244.11.251 -> 10.244.11.252), in a program of its own whose filter holds the
``LOCAL_PODS`` IPv4 addresses of :func:`node_pods` (10.244.8.0/22): what a packet between two unobserved
pods of a node that observes others costs, each trie lookup walking down next to the observed IPs.

Drain and name: ``flow_drain_ms_100k`` (target <= 250) is :func:`drain_and_name_100k` on a flows map
holding 100,000 entries (written by a batch update; :func:`node_flows` says which: 1,000 local pods, the
far ends a mix of local pods, other nodes' pods, service IPs and outside addresses, one flow in eight
IPv6), median of ``--runs``: what the agent does at each drain, ``EbpfDatapath.drain_flows()`` (the flip
of the double buffer and its RCU grace period, the kernel's batched lookup-and-delete, the decoding, the
one young-generation collection of the decoded entries) and then
``name_flows(entries, AddressBook(pods), node, wall_offset)``. Its parts, from the same runs:
``flow_drain_decode_ms_100k`` (``drain_flows()``) and ``flow_name_ms_100k`` (the address book and
``name_flows``). ``flow_drain_kernel_ms_100k``: the kernel's part alone (``take_flow_batches()``: the flip
and the batched take, no decoding), in runs of its own.
``drain_cost_ratio_10m_vs_100k_packets``: the drain's CPU time (the calling thread's: the grace period
is a wait, not work) after 10,000,000 packets over 1,000 flows divided by the same after 100,000
packets over the same 1,000 flows (target <= 1.1: the cost follows flows, not packets). The
100,000-packet case also runs 9,900,000 packets between unobserved IPs (no flow), so that both drains
follow the same kernel work. ``drain_wall_ms_1k_flows`` (information): the wall-clock time of those
drains, mostly the grace period. ``flows_lost_when_full`` (information): packets counted in
``flows_lost`` when 1,000 flows of 10 packets each of one pod meet a 64-entry map (the fairness rule
gives one pod 3/4 of it and one share, 49 entries: exactly 951 x 10 expected; the per-pod counters stay
exact).

Fairness (issue 25): ``quiet_flows_recorded_fraction`` is the fraction of a quiet pod's new flows that
the flows map records while a noisy pod sprays new tuples, :func:`fairness_probe`: an 8,192-entry map,
each interval (a drain) the noisy pod's 37,500 new flows (60,000 per second for 5 s against 65,536
entries, scaled to the map) with the quiet pod's 50 spread among them, on two pod links; 3 intervals.
``quiet_flows_recorded_fraction_unfair`` is the same probe with the rule off (``Fairness.off()``, the
behaviour before it), in the same run.

Maps are created unpinned: the benchmark leaves nothing behind. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from podmeter.adapters.datapath.ebpf import frames, layout
from podmeter.adapters.datapath.ebpf.datapath import (
    COUNTERS_MAP,
    FILTER_MAP,
    FROM_POD,
    EbpfDatapath,
    Fairness,
    map_sizes,
)
from podmeter.adapters.datapath.ebpf.loader import Loaded, Program, load
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.adapters.datapath.ebpf.preflight import BARE_OBJECT_NAME, NOFLOWS_OBJECT_NAME, OBJECT_NAME, object_path
from podmeter.model.datapath import Direction
from podmeter.model.endpoints import AddressBook
from podmeter.model.flow_records import FlowRecord, name_flows
from podmeter.model.flows import TCP, UDP, FlowCounts, FlowKey, Observation
from podmeter.model.records import Pod

PARSE_ONLY = "pm_parse_only"
POD = "10.244.1.7"
PEER = "192.0.2.1"
DRAIN_ENTRIES = 100_000
LOCAL_PODS = 1_000
NODE = "node-bench"
RATIO_FLOWS = 1_000
FULL_MAP, FULL_FLOWS, FULL_PACKETS = 64, 1_000, 10
FAIR_MAP, FAIR_QUIET, FAIR_INTERVALS = 8_192, 50, 3
FAIR_NOISY = FAIR_MAP * (60_000 * 5) // 65_536  # 60,000 new tuples a second for a 5 s interval, scaled to the map
NOISY_POD, QUIET_POD = "10.244.2.7", "10.244.2.8"
REPO = Path(__file__).resolve().parent.parent
UNOBSERVED_FRAME = frames.udp_frame("10.255.255.254", PEER)
NEAR_FRAME = frames.udp_frame("10.244.11.251", "10.244.11.252")  # in local_v4's /22, never one of its IPs
FIRST_FLOWS = 2_000
PACKET_CASES = ("flows", "flows_unobserved", "flows_unobserved_near")  # each object's per-packet figures
OWN_CASES = (*PACKET_CASES, "counting", "bare")
# The reference objects (bpf/podmeter_ref_<name>.bpf.c: the same source with a define), by what they
# change; docs/flows.md says what each measures and why it is not the program.
REFERENCES = {
    "before": "the program before issue 29 (LPM trie filter, transport header first, lazy counters)",
    "lpm": "the filter an LPM trie",
    "early": "the transport header read before the filter decision",
    "lazy": "counters created by the program at the first packet",
    "percpu": "per-CPU flows maps, plain adds",
    "count_from_flows": "bound: the flow entry the only update",
    "flow_first": "floor: the flow entry looked up first, nothing else",
    "no_clock": "bound: no clock read",
}


@dataclass(frozen=True)
class Figures:
    packet: dict[str, Sampled]  # per_packet()'s figures, by name
    first_packet: Sampled
    first_packet_hit: Sampled
    flow_drain_ms_100k: float
    flow_drain_decode_ms_100k: float
    flow_name_ms_100k: float
    flow_drain_kernel_ms_100k: float
    drain_cpu_ms_100k_packets: float
    drain_cpu_ms_10m_packets: float
    drain_wall_ms_1k_flows: float
    flows_lost_when_full: int
    counters_exact_when_full: bool
    quiet_flows_recorded_fraction: float
    quiet_flows_recorded_fraction_unfair: float

    @property
    def ns_per_packet_flows(self) -> float:
        return self.packet["flows"].median

    @property
    def ns_per_packet(self) -> float:
        return self.packet["counting"].median

    @property
    def ns_per_packet_bare(self) -> float:
        return self.packet["bare"].median

    @property
    def ns_per_packet_flows_unobserved(self) -> float:
        return self.packet["flows_unobserved"].median

    @property
    def ns_per_packet_flows_unobserved_near(self) -> float:
        return self.packet["flows_unobserved_near"].median

    @property
    def flows_overhead_ns(self) -> float:
        return self.ns_per_packet_flows - self.ns_per_packet

    @property
    def first_packet_extra_ns(self) -> float:
        """What a flow's first packet costs more than the next ones (both one run each)."""
        return self.first_packet.median - self.first_packet_hit.median

    @property
    def drain_cost_ratio(self) -> float:
        return self.drain_cpu_ms_10m_packets / self.drain_cpu_ms_100k_packets


@dataclass
class Unpinned:
    """Object ``name`` loaded with fresh maps pinned nowhere (nothing to clean up): its datapath and
    its ``pm_from_pod``."""

    loaded: Loaded
    datapath: EbpfDatapath

    @classmethod
    def load(cls, flow_size: int, filter_size: int = 256, name: str = OBJECT_NAME) -> Unpinned:
        sizes = map_sizes(filter_size, flow_size)
        if name == NOFLOWS_OBJECT_NAME:
            sizes = {map_name: sizes[map_name] for map_name in (FILTER_MAP, COUNTERS_MAP)}
        loaded = load(object_path(name), None, sizes, [FROM_POD])
        return cls(loaded, EbpfDatapath.from_loaded(loaded))

    @property
    def program(self) -> Program:
        return self.loaded.programs[FROM_POD]

    def close(self) -> None:
        self.loaded.close()


# --- per packet ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampled:
    """A figure's runs: the median is the figure, max - min its spread."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(statistics.median(self.samples))

    @property
    def spread(self) -> float:
        return max(self.samples) - min(self.samples)


def per_packet(repeat: int, runs: int) -> dict[str, Sampled]:
    """ns per packet of every (program, frame) of :func:`packet_cases`, interleaved run by run:
    ``flows`` (hit), ``counting``, ``bare``, ``flows_unobserved``, ``flows_unobserved_near``, and for
    each reference object of ``REFERENCES`` its ``<name>_flows``, ``<name>_flows_unobserved`` and
    ``<name>_flows_unobserved_near``."""
    with contextlib.ExitStack() as stack:
        cases, flows = packet_cases(stack)
        for program, frame in cases.values():
            program.test_run(frame)  # creates the flow entries: the runs measure the steady state
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(runs):
            for name, (program, frame) in cases.items():
                samples[name].append(program.test_run(frame, repeat).duration_ns)
        assert len(flows.read_flows()) == 1 and flows.flows_lost() == 0
        return {name: Sampled(tuple(values)) for name, values in samples.items()}


def packet_cases(stack: contextlib.ExitStack) -> tuple[dict[str, tuple[Program, bytes]], EbpfDatapath]:
    """The (program, frame) of each per-packet figure (closed with ``stack``), and the flows program's
    datapath. For the program and each reference: a hit on an observed source (its counters and flow
    entry present), a frame between two unobserved IPs with one IP in the filter, and one next to
    ``LOCAL_PODS`` observed IPs."""
    hit = frames.udp_frame(POD, PEER)
    cases: dict[str, tuple[Program, bytes]] = {}
    datapaths = []
    for prefix, name in (("", OBJECT_NAME), *((f"{ref}_", f"podmeter_ref_{ref}.bpf.o") for ref in REFERENCES)):
        one = stack.enter_context(contextlib.closing(Unpinned.load(1024, name=name)))
        near = stack.enter_context(contextlib.closing(Unpinned.load(1024, filter_size=2 * LOCAL_PODS, name=name)))
        assert one.datapath.insert([POD]).error is None
        assert near.datapath.insert([local_v4(n) for n in range(LOCAL_PODS)]).error is None
        datapaths.append(one.datapath)
        cases[f"{prefix}flows"] = (one.program, hit)
        cases[f"{prefix}flows_unobserved"] = (one.program, UNOBSERVED_FRAME)
        cases[f"{prefix}flows_unobserved_near"] = (near.program, NEAR_FRAME)
        if not prefix:
            counting = stack.enter_context(contextlib.closing(Unpinned.load(1024, name=NOFLOWS_OBJECT_NAME)))
            assert counting.datapath.insert([POD]).error is None
            cases["counting"] = (counting.program, hit)
            bare = stack.enter_context(contextlib.closing(load(object_path(BARE_OBJECT_NAME), None, {}, [PARSE_ONLY])))
            cases["bare"] = (bare.programs[PARSE_ONLY], hit)
    return cases, datapaths[0]


def first_packet(runs: int, name: str = OBJECT_NAME) -> tuple[Sampled, Sampled]:
    """ns of a flow's first packet and of a packet of an existing flow, one program run each
    (``repeat`` 1: the kernel's own timing of the run, without the syscall, but with its per-call
    overhead, hence the pair). Each run: ``FIRST_FLOWS`` new flows of an observed pod (source ports),
    each run once (a new entry), then once more (a hit); then a drain."""
    maps = Unpinned.load(4 * FIRST_FLOWS, name=name)
    try:
        assert maps.datapath.insert([POD]).error is None
        flow_frames = [frames.ethernet(frames.ETH_P_IP, frames.ipv4(POD, PEER, frames.udp(b"p" * 64, sport=port)))
                       for port in range(20_000, 20_000 + FIRST_FLOWS)]
        first: list[float] = []
        again: list[float] = []
        for _ in range(runs):
            new = [maps.program.test_run(frame).duration_ns for frame in flow_frames]
            hits = [maps.program.test_run(frame).duration_ns for frame in flow_frames]
            assert len(maps.datapath.drain_flows()) == FIRST_FLOWS and maps.datapath.flows_lost() == 0
            first.append(statistics.median(new))
            again.append(statistics.median(hits))
        return Sampled(tuple(first)), Sampled(tuple(again))
    finally:
        maps.close()


# --- drain and name ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeFlows:
    """What ``flow_drain_ms_100k`` drains and names: the node's pods and the flow keys the map holds."""

    pods: list[Pod]
    keys: list[FlowKey]


def node_pods() -> list[Pod]:
    """The node's ``LOCAL_PODS`` pods (Deployment replicas, 20 a workload, in 10 namespaces): IPv4 from
    10.244.8.0/22, one in four dual-stack (fd00:10:244:8::/64)."""
    pods = []
    for n in range(LOCAL_PODS):
        workload = f"app-{n // 20}"
        ips = (local_v4(n), local_v6(n)) if n % 4 == 0 else (local_v4(n),)
        pods.append(Pod(
            uid=f"uid-{n}", namespace=f"team-{n % 10}", name=f"{workload}-5d9f7-{n:04x}", node_name=NODE, ips=ips,
            host_network=False, phase="Running", deleting=False, observe=True,
            labels=("app", workload, "pod-template-hash", "5d9f7"), resource_version=str(n),
            owner_kind="ReplicaSet", owner_name=f"{workload}-5d9f7"))
    return pods


def local_v4(n: int) -> str:
    return f"10.244.{8 + n // 250}.{n % 250 + 1}"


def local_v6(n: int) -> str:
    return f"fd00:10:244:8::{n + 1:x}"


def peer(rng: random.Random, family: int) -> str:
    """The far end of a flow, by the mix of a busy node: 20 % a pod of this node, 50 % a pod of another
    node (10,000 of them, 10.244.0.0/16 outside this node's /22), 20 % a service ClusterIP (200,
    10.96.0.0/16, as the pod-side hook sees it: before kube-proxy's NAT), 10 % outside the cluster
    (1,000 addresses). ``family`` 6: the IPv6 counterparts."""
    kind, n = rng.random(), rng.randrange(1 << 30)
    if kind < 0.2:
        pod = (n % (LOCAL_PODS // 4)) * 4 if family == 6 else n % LOCAL_PODS
        return local_v6(pod) if family == 6 else local_v4(pod)
    if kind < 0.7:
        n %= 10_000
        if family == 6:
            return f"fd00:10:244:{n // 250 + 16:x}::{n % 250 + 1:x}"
        return f"10.244.{n // 250 + 16}.{n % 250 + 1}"
    if kind < 0.9:
        n %= 200
        return f"fd00:10:96::{n + 1:x}" if family == 6 else f"10.96.{n // 100}.{n % 100 + 1}"
    n %= 1_000
    return f"2001:db8:{n // 250:x}::{n % 250 + 1:x}" if family == 6 else f"198.51.{100 + n // 250}.{n % 250 + 1}"


def node_flows(count: int = DRAIN_ENTRIES, seed: int = 7) -> NodeFlows:
    """``count`` distinct flow keys of ``node_pods()``: one end a local pod (the observed end: the source
    at from-pod, the destination at to-pod, half each), the other :func:`peer`; one in eight IPv6
    (between a dual-stack pod's IPv6 and an IPv6 peer); TCP 80 %, UDP 20 %; an ephemeral port on the
    client side, a service port (80, 443, 5432, 6379, 8080, 53) on the other."""
    rng = random.Random(seed)
    keys: dict[FlowKey, None] = {}
    service_ports = (80, 443, 5432, 6379, 8080, 53)
    while len(keys) < count:
        pod = rng.randrange(LOCAL_PODS)
        ipv6 = pod % 4 == 0 and rng.random() < 0.5
        local, far = (local_v6(pod), peer(rng, 6)) if ipv6 else (local_v4(pod), peer(rng, 4))
        protocol = TCP if rng.random() < 0.8 else UDP
        ephemeral, service = rng.randrange(32768, 61000), service_ports[rng.randrange(len(service_ports))]
        if rng.random() < 0.5:  # from-pod: the pod sends; as client or as server
            sport, dport = (ephemeral, service) if rng.random() < 0.7 else (service, ephemeral)
            keys[FlowKey(local, far, sport, dport, protocol, Observation.FROM_POD)] = None
        else:
            sport, dport = (service, ephemeral) if rng.random() < 0.7 else (ephemeral, service)
            keys[FlowKey(far, local, sport, dport, protocol, Observation.TO_POD)] = None
    return NodeFlows(node_pods(), list(keys))


def drain_and_name_100k(datapath: EbpfDatapath, pods: list[Pod]) -> tuple[list[FlowRecord], float]:
    """The step ``flow_drain_ms_100k`` times, as the agent does it at each drain: drain the flows map,
    then name both ends of every entry with an address book of the node's pods. Returns the records and
    the seconds the drain alone took (the rest is naming)."""
    start = time.perf_counter()
    entries = datapath.drain_flows()
    drained = time.perf_counter()
    records = name_flows(entries, AddressBook(pods), NODE, time.time() - time.monotonic())
    return records, drained - start


def fill(datapath: EbpfDatapath, keys: list[bytes], values: list[bytes]) -> None:
    assert datapath.flows_map is not None
    outcome = datapath.flows_map.update_batch(keys, values)
    assert outcome.error is None and outcome.applied == len(keys), outcome


def drain_figures(runs: int) -> dict[str, float]:
    """Median ms of drain + naming (and its two parts), and of the kernel's part alone."""
    flows = node_flows()
    keys = [layout.flow_key(key) for key in flows.keys]
    now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    values = [layout.flow_value(FlowCounts(1 + n % 7, 100 * (1 + n % 7), now, now + n, 0)) for n in range(len(keys))]
    maps = Unpinned.load(DRAIN_ENTRIES)
    datapath = maps.datapath
    samples: dict[str, list[float]] = {"total": [], "drain": [], "name": [], "kernel": []}
    try:
        for _ in range(runs):
            fill(datapath, keys, values)
            gc.collect()
            start = time.perf_counter()
            records, drain_seconds = drain_and_name_100k(datapath, flows.pods)
            total = time.perf_counter() - start
            samples["total"].append(total)
            samples["drain"].append(drain_seconds)
            samples["name"].append(total - drain_seconds)
            assert len(records) == DRAIN_ENTRIES, len(records)
            check_names(records)
            del records
            fill(datapath, keys, values)
            start = time.perf_counter()
            taken = sum(count for _, _, count in datapath.take_flow_batches())
            samples["kernel"].append(time.perf_counter() - start)
            assert taken == DRAIN_ENTRIES, taken
    finally:
        maps.close()
    return {name: 1000 * statistics.median(values) for name, values in samples.items()}


def check_names(records: list[FlowRecord]) -> None:
    """Every record has its local end named, and about 20 % of far ends are local pods (the mix)."""
    local = 0
    for record in records:
        pod_end = record.source if record.observation is Observation.FROM_POD else record.destination
        far_end = record.destination if record.observation is Observation.FROM_POD else record.source
        assert pod_end.endpoint is not None and pod_end.endpoint.node == NODE, record
        local += far_end.endpoint is not None
    assert 0.15 < local / len(records) < 0.25, local


def drain_after(maps: Unpinned, flows: list[bytes], packets_per_flow: int, work_per_flow: int) -> tuple[float, float]:
    """(CPU seconds of the calling thread, wall seconds) to drain after ``packets_per_flow`` packets on
    each of ``flows``. Each flow's packets are followed by ``work_per_flow - packets_per_flow`` packets
    between two unobserved IPs (no flow, no counter), so that both cases run the same kernel work before
    the drain (a drain right after 0.5 s of BPF_PROG_TEST_RUN finds colder caches than one after 5 ms)
    and differ only in what was counted."""
    for frame in flows:
        maps.program.test_run(frame, packets_per_flow)
        if work_per_flow > packets_per_flow:
            maps.program.test_run(UNOBSERVED_FRAME, work_per_flow - packets_per_flow)
    gc.collect()
    start, cpu = time.perf_counter(), time.thread_time()
    entries = maps.datapath.drain_flows()
    cpu, elapsed = time.thread_time() - cpu, time.perf_counter() - start
    assert len(entries) == len(flows) and all(c.packets == packets_per_flow for _, c in entries)
    return cpu, elapsed


def drain_ratio(runs: int) -> tuple[float, float, float]:
    """Median CPU ms of the drain after 100,000 and after 10,000,000 packets over the same 1,000 flows,
    and the median wall-clock ms of all those drains."""
    maps = Unpinned.load(4 * RATIO_FLOWS)
    flows = [frames.ethernet(frames.ETH_P_IP, frames.ipv4(POD, PEER, frames.udp(b"r" * 64, 20000 + n, 53)))
             for n in range(RATIO_FLOWS)]
    few, many = [], []
    try:
        assert maps.datapath.insert([POD]).error is None
        for _ in range(runs):
            few.append(drain_after(maps, flows, 100_000 // RATIO_FLOWS, 10_000_000 // RATIO_FLOWS))
            many.append(drain_after(maps, flows, 10_000_000 // RATIO_FLOWS, 10_000_000 // RATIO_FLOWS))
        assert maps.datapath.read_counters()[(POD, Direction.EGRESS)].packets == runs * 10_100_000
    finally:
        maps.close()
    wall = [elapsed for _, elapsed in few + many]
    return (1000 * statistics.median(cpu for cpu, _ in few), 1000 * statistics.median(cpu for cpu, _ in many),
            1000 * statistics.median(wall))


def lost_when_full() -> tuple[int, bool]:
    """(packets counted in flows_lost, were the counters exact) for 1,000 flows of one pod meeting a
    64-entry map (of which the fairness rule gives one pod 3/4 and a share)."""
    maps = Unpinned.load(FULL_MAP)
    datapath, program = maps.datapath, maps.program
    try:
        assert datapath.insert([POD]).error is None
        frame_bytes = 0
        for n in range(FULL_FLOWS):
            frame = frames.ethernet(frames.ETH_P_IP, frames.ipv4(POD, PEER, frames.udp(b"f", 10000 + n, 53)))
            program.test_run(frame, FULL_PACKETS)
            frame_bytes += FULL_PACKETS * len(frame)
        lost = datapath.flows_lost()
        counters = datapath.read_counters()
        exact = sum(t.packets for t in counters.values()) == FULL_FLOWS * FULL_PACKETS and sum(
            t.bytes for t in counters.values()) == frame_bytes
        fairness = Fairness.for_capacity(FULL_MAP)
        assert lost == (FULL_FLOWS - fairness.threshold - fairness.share) * FULL_PACKETS, lost
        return lost, exact
    finally:
        maps.close()


# --- fairness --------------------------------------------------------------------------------------------------


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@contextmanager
def two_links() -> Iterator[tuple[str, int, int]]:
    """A network namespace with two links standing for two pods' veths (the two ends of one veth pair:
    BPF_PROG_TEST_RUN runs a packet on an interface of the caller's netns): (its path, the noisy link's
    ifindex, the quiet one's). Removed afterwards."""
    name = f"pmbenchfair{os.getpid()}"
    sh("ip", "netns", "add", name)
    try:
        sh("ip", "-n", name, "link", "add", "noisy", "type", "veth", "peer", "name", "quiet")
        path = f"/run/netns/{name}"
        with netns(path):
            yield path, socket.if_nametoindex("noisy"), socket.if_nametoindex("quiet")
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@functools.cache
def probe_frames(noisy_link: int, quiet_link: int) -> list[tuple[bytes, int]]:
    """One interval of the probe: (frame, link) in order, the quiet pod's flows spread evenly."""
    every = FAIR_NOISY // FAIR_QUIET
    out = []
    for n in range(FAIR_NOISY):
        out.append((frames.ethernet(frames.ETH_P_IP, frames.ipv4(NOISY_POD, PEER, frames.udp(
            b"n", 1024 + n % 60_000, 1 + n // 60_000))), noisy_link))
        if n % every == every // 2:
            out.append((frames.ethernet(frames.ETH_P_IP, frames.ipv4(QUIET_POD, PEER, frames.udp(
                b"q", 30_000 + n // every, 53))), quiet_link))
    assert sum(1 for _, link in out if link == quiet_link) == FAIR_QUIET
    return out


def fairness_probe(fairness: Fairness | None, noisy_link: int, quiet_link: int) -> float:
    """The fraction of the quiet pod's new flows recorded over ``FAIR_INTERVALS`` intervals, each
    ``FAIR_NOISY`` new flows of the noisy pod with ``FAIR_QUIET`` of the quiet pod spread evenly among
    them, then a drain. ``fairness`` None: the rule the datapath configures for the map (the agent's);
    else that one. The per-pod counters are checked to the packet."""
    maps = Unpinned.load(FAIR_MAP)
    datapath, program = maps.datapath, maps.program
    try:
        assert datapath.flows is not None
        if fairness is not None:
            datapath.flows.configure(fairness)
        assert datapath.insert([NOISY_POD, QUIET_POD]).error is None
        recorded = 0
        for _ in range(FAIR_INTERVALS):
            for frame, link in probe_frames(noisy_link, quiet_link):
                program.test_run(frame, ifindex=link)
            recorded += sum(1 for key, _ in datapath.drain_flows() if key.source == QUIET_POD)
        counters = datapath.read_counters()
        assert counters[(NOISY_POD, Direction.EGRESS)].packets == FAIR_INTERVALS * FAIR_NOISY
        assert counters[(QUIET_POD, Direction.EGRESS)].packets == FAIR_INTERVALS * FAIR_QUIET
        return recorded / (FAIR_INTERVALS * FAIR_QUIET)
    finally:
        maps.close()


def fairness_figures() -> tuple[float, float]:
    """(quiet flows recorded with the rule, without it) in one run."""
    with two_links() as (_, noisy_link, quiet_link):
        unfair = fairness_probe(Fairness.off(), noisy_link, quiet_link)
        fair = fairness_probe(None, noisy_link, quiet_link)
    return fair, unfair


# --- running ---------------------------------------------------------------------------------------------------


def stale_objects() -> list[str]:
    """Objects older than their sources, in a source checkout. `make bpf` does not know that
    podmeter_noflows.bpf.c includes podmeter.bpf.c, so that one is checked here."""
    sources = REPO / "bpf"
    if not sources.is_dir():
        return []
    headers = list(sources.glob("*.h"))
    needs = {
        OBJECT_NAME: [sources / "podmeter.bpf.c", *headers],
        NOFLOWS_OBJECT_NAME: [sources / "podmeter_noflows.bpf.c", sources / "podmeter.bpf.c", *headers],
        BARE_OBJECT_NAME: [sources / "podmeter_bare.bpf.c", *headers],
    }
    for ref in REFERENCES:
        needs[f"podmeter_ref_{ref}.bpf.o"] = [sources / f"podmeter_ref_{ref}.bpf.c", sources / "podmeter.bpf.c",
                                              *headers]
    stale = []
    for name, inputs in needs.items():
        built = object_path(name).stat().st_mtime
        if any(path.exists() and path.stat().st_mtime > built for path in inputs):
            stale.append(name)
    return stale


def measure_packets(args: argparse.Namespace, progress: Callable[[str], None]) -> tuple[dict[str, Sampled], Sampled,
                                                                                      Sampled]:
    progress("per packet")
    packet = per_packet(args.repeat, args.runs)
    progress("a flow's first packet")
    first, again = first_packet(args.runs)
    return packet, first, again


def measure(args: argparse.Namespace, progress: Callable[[str], None]) -> Figures:
    packet, first, again = measure_packets(args, progress)
    progress("drain and name 100,000 entries")
    drain = drain_figures(args.runs)
    progress("drain after 100,000 and 10,000,000 packets")
    few_ms, many_ms, wall_ms = drain_ratio(args.runs)
    lost, exact = lost_when_full()
    progress("fairness: a noisy pod and a quiet one")
    fair, unfair = fairness_figures()
    return Figures(packet, first, again, drain["total"], drain["drain"], drain["name"], drain["kernel"],
                   few_ms, many_ms, wall_ms, lost, exact, fair, unfair)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--repeat", type=int, default=1_000_000, help="BPF_PROG_TEST_RUN repetitions per run")
    parser.add_argument("--runs", type=int, default=7, help="runs per figure (the median is reported)")
    parser.add_argument("--packets-only", action="store_true", help="the per-packet figures only")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench.flows needs root (BPF_PROG_TEST_RUN, map creation)", file=sys.stderr)
        return 2
    stale = stale_objects()
    if stale:
        print(f"bench.flows: {', '.join(stale)} older than its sources: `touch bpf/*.bpf.c && make bpf`",
              file=sys.stderr)
        return 2
    def progress(step: str) -> None:
        print(f"  ... {step}", file=sys.stderr, flush=True)

    if args.packets_only:
        packet, first, again = measure_packets(args, progress)
        print_packet_table(packet, first, again, args)
        print(json.dumps(packet_summary(packet, first, again, args)))
        return 0
    figures = measure(args, progress)
    print_packet_table(figures.packet, figures.first_packet, figures.first_packet_hit, args)
    print_table(figures, args)
    print(json.dumps(summary(figures, args)))
    return 0


def print_packet_table(packet: dict[str, Sampled], first: Sampled, again: Sampled, args: argparse.Namespace) -> None:
    bare, counting = packet["bare"].median, packet["counting"].median
    print(f"per packet: {args.runs} interleaved runs of {args.repeat:,}, medians (spread = max - min)")
    print(f"  {'program':<44} {'hit':>14} {'unobserved':>14} {'... near':>14}   vs parse-only, vs counting")
    for prefix, what in (("", "podmeter.bpf.o (the program)"), *((f"{ref}_", f"{ref}: {REFERENCES[ref]}")
                                                                  for ref in REFERENCES)):
        cells = [packet[f"{prefix}{case}"] for case in PACKET_CASES]
        text = [f"{cell.median:7.1f} ±{cell.spread:<5.0f}" for cell in cells]
        hit = cells[0].median
        print(f"  {what[:44]:<44} {text[0]:>14} {text[1]:>14} {text[2]:>14}   {hit / bare:.2f}x, {hit / counting:.2f}x")
    for name, what in (("counting", "counting alone (podmeter_noflows.bpf.o)"), ("bare", "parse only")):
        print(f"  {what:<44} {packet[name].median:7.1f} ±{packet[name].spread:<5.0f}")
    print(f"  a flow's first packet, one run each: {first.median:.0f} ns against {again.median:.0f} for the next: "
          f"+{first.median - again.median:.0f} ns ({FIRST_FLOWS:,} flows a run)")


def packet_summary(packet: dict[str, Sampled], first: Sampled, again: Sampled,
                   args: argparse.Namespace) -> dict[str, object]:
    bare, counting = packet["bare"].median, packet["counting"].median
    return {
        "ns_per_packet_flows": round(packet["flows"].median, 1),
        "ns_per_packet": round(counting, 1),
        "ns_per_packet_bare": round(bare, 1),
        "flows_overhead_ns": round(packet["flows"].median - counting, 1),
        "ns_per_packet_flows_unobserved": round(packet["flows_unobserved"].median, 1),
        "ns_per_packet_flows_unobserved_near": round(packet["flows_unobserved_near"].median, 1),
        "flows_vs_parse_only": round(packet["flows"].median / bare, 3),
        "flows_vs_counting": round(packet["flows"].median / counting, 3),
        "unobserved_vs_parse_only": round(packet["flows_unobserved"].median / bare, 3),
        "ns_first_packet": round(first.median, 1),
        "ns_first_packet_next": round(again.median, 1),
        "ns_first_packet_extra": round(first.median - again.median, 1),
        "spread_ns": {name: round(packet[name].spread, 1) for name in OWN_CASES},
        "references": {ref: {case: round(packet[f"{ref}_{case}"].median, 1) for case in PACKET_CASES}
                       for ref in REFERENCES},
        "repeat": args.repeat,
        "runs": args.runs,
    }


def print_table(fig: Figures, args: argparse.Namespace) -> None:
    print(f"flows benchmark: {args.runs} runs, medians")
    rows = [
        ("ns/packet, flows added", f"{fig.flows_overhead_ns:.0f}", "flows - counting"),
        ("drain + name 100,000 flows, ms", f"{fig.flow_drain_ms_100k:.1f}", "target <= 250"),
        ("  drain_flows(), ms", f"{fig.flow_drain_decode_ms_100k:.1f}", "flip + take + decode"),
        ("  address book + name_flows(), ms", f"{fig.flow_name_ms_100k:.1f}", f"{LOCAL_PODS:,} local pods"),
        ("kernel part of the drain, ms", f"{fig.flow_drain_kernel_ms_100k:.1f}", "flip + batched take, no decoding"),
        ("drain CPU after 100,000 packets, ms", f"{fig.drain_cpu_ms_100k_packets:.2f}", f"{RATIO_FLOWS:,} flows"),
        ("drain CPU after 10,000,000 packets, ms", f"{fig.drain_cpu_ms_10m_packets:.2f}", f"{RATIO_FLOWS:,} flows"),
        ("drain cost ratio (target <= 1.1)", f"{fig.drain_cost_ratio:.2f}", "10M / 100k packets, CPU"),
        ("drain of 1,000 flows, wall ms", f"{fig.drain_wall_ms_1k_flows:.2f}", "mostly the grace period"),
        ("packets lost, map full", f"{fig.flows_lost_when_full:,}",
         f"{FULL_FLOWS:,} flows x {FULL_PACKETS}, {FULL_MAP} entries; counters exact: {fig.counters_exact_when_full}"),
        ("quiet pod's flows recorded", f"{fig.quiet_flows_recorded_fraction:.3f}",
         f"{FAIR_QUIET} among {FAIR_NOISY:,} noisy ones, {FAIR_MAP:,} entries"),
        ("  ... without the fairness rule", f"{fig.quiet_flows_recorded_fraction_unfair:.3f}", "the reference"),
    ]
    for name, value, note in rows:
        print(f"  {name:<40} {value:>10}   {note}")


def summary(fig: Figures, args: argparse.Namespace) -> dict[str, object]:
    out = packet_summary(fig.packet, fig.first_packet, fig.first_packet_hit, args)
    return out | {
        "flow_drain_ms_100k": round(fig.flow_drain_ms_100k, 1),
        "flow_drain_decode_ms_100k": round(fig.flow_drain_decode_ms_100k, 1),
        "flow_name_ms_100k": round(fig.flow_name_ms_100k, 1),
        "flow_drain_kernel_ms_100k": round(fig.flow_drain_kernel_ms_100k, 1),
        "drain_cpu_ms_100k_packets": round(fig.drain_cpu_ms_100k_packets, 3),
        "drain_cpu_ms_10m_packets": round(fig.drain_cpu_ms_10m_packets, 3),
        "drain_wall_ms_1k_flows": round(fig.drain_wall_ms_1k_flows, 3),
        "drain_cost_ratio_10m_vs_100k_packets": round(fig.drain_cost_ratio, 3),
        "flows_lost_when_full": fig.flows_lost_when_full,
        "counters_exact_when_full": fig.counters_exact_when_full,
        "quiet_flows_recorded_fraction": round(fig.quiet_flows_recorded_fraction, 3),
        "quiet_flows_recorded_fraction_unfair": round(fig.quiet_flows_recorded_fraction_unfair, 3),
        "repeat": args.repeat,
        "runs": args.runs,
    }


if __name__ == "__main__":
    sys.exit(main())
