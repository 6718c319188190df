"""Benchmark of the per-pod traffic scrape: 5,000 observed pods with traffic.

    python -m bench.metrics [--pods 5000] [--runs 7]

Builds a real agent core (writer, ledger, in-memory datapath with counters for every IP in both
directions) and times ``generate_latest`` over the agent's collectors, the work a Prometheus scrape does.
Reference in the same run: the same number of series exported by prometheus_client's own ``Counter`` with
labels (the library's default way), so the ratio shows what the scrape-time collector costs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, generate_latest

from bench.measure import json_line, median_of, table
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.metrics.agent_state import AgentStateCollector
from podmeter.adapters.metrics.pod_traffic import POD_LABELS, PodTrafficExposition
from podmeter.lab.podgen import realistic_pod
from podmeter.model.datapath import Direction
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Replace, Upsert
from podmeter.model.records import decode_pod
from podmeter.runtime.agent import Agent, AgentSettings


def agent_with_pods(n: int) -> Agent:
    datapath = MemoryDatapath(n * 2)
    agent = Agent(AgentSettings(node_name="node-a"), connection=None, datapath=datapath)  # type: ignore[arg-type]
    pods = []
    for i in range(n):
        raw = realistic_pod(i, ip=f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}")
        raw["metadata"].setdefault("annotations", {})["podmeter.io/observe"] = "true"
        pods.append(decode_pod(raw))
    agent.apply_batch([Replace(NAMESPACES, []), Replace(CONFIGURATIONS, []), Replace(PODS, [])])
    agent.apply_batch([Upsert(PODS, p) for p in pods])
    for pod in pods:
        for direction in Direction:
            datapath.count(pod.ips[0], direction, 1234, 1234 * 800)
    assert len(agent.ledger.series) == n
    return agent


def reference_registry(agent: Agent) -> CollectorRegistry:
    registry = CollectorRegistry()
    counter = Counter("podmeter_pod_bytes", "reference", POD_LABELS, registry=registry)
    packets = Counter("podmeter_pod_packets", "reference", POD_LABELS, registry=registry)
    for series in agent.ledger.series.values():
        for direction in Direction:
            labels = (series.namespace, series.name, direction.value, series.workload_kind, series.workload_name)
            counter.labels(*labels).inc(1234 * 800)
            packets.labels(*labels).inc(1234)
    return registry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pods", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    agent = agent_with_pods(args.pods)
    registry = CollectorRegistry()
    registry.register(AgentStateCollector(agent.snapshot))
    traffic = PodTrafficExposition(agent.ledger, agent.datapath.read_counters)
    reference = reference_registry(agent)

    def scrape() -> bytes:  # what the agent's /metrics handler does
        return generate_latest(registry) + traffic.render()

    def timed(render: Callable[[], bytes]) -> float:
        start = time.perf_counter()
        render()
        return (time.perf_counter() - start) * 1000

    ours = median_of(args.runs, lambda: timed(scrape))
    theirs = median_of(args.runs, lambda: timed(lambda: generate_latest(reference)))
    size = len(scrape())
    table([
        ("scrape_ms_5000_pods", ours, 100.0, "target <= 100 ms (ratio <= 1 meets it)"),
        ("reference: prometheus Counter ms", theirs, None, "same series as labelled Counters"),
        ("podmeter / reference", ours / theirs, None, "scrape-time collector vs kept counters"),
        ("scrape_bytes_5000_pods", float(size), None, "exposition size"),
    ])
    json_line({"scrape_ms_5000_pods": round(ours, 1), "scrape_bytes_5000_pods": size,
               "reference_counter_ms": round(theirs, 1)})


if __name__ == "__main__":
    main()
