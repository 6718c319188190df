"""The agent tells its links which IPs this node's pods hold, and waits for their links before its first write.

Without a kernel: a stand-in for the attach manager records what the agent's writer task gives it (the
real manager on real links: tests/adapters/test_bpf_cni.py). The IPs are those of every pod of the node
that holds its own, observed or not; the node's own address (host-network pods), finished pods and other
nodes' pods are not pods' links' IPs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest

from factories import make_namespace, make_pod, with_changes
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.metrics.agent_state import AgentStateCollector
from podmeter.model.datapath import Direction, LinkCounts, Traffic
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Delete, Replace, Upsert
from podmeter.runtime.agent import Agent, AgentSettings
from podmeter.runtime.ticks import Tick


class Links:
    """What the agent sees of the attach manager."""

    def __init__(self, settled: bool = True, inherited: frozenset[str] = frozenset()) -> None:
        self.given: list[frozenset[str]] = []
        self.attached = settled
        self.adopted = inherited  # IPs on links a predecessor left attached

    def set_pod_ips(self, ips: Iterable[str]) -> None:
        self.given.append(frozenset(ips))

    def settled(self) -> bool:
        return self.attached

    def link_counts(self) -> LinkCounts:
        return LinkCounts(seen=3, attached=2, skipped={"no_pod": 1})

    def unlinked(self, ips: Iterable[str]) -> frozenset[str]:
        return frozenset()

    def inherited(self, ips: Iterable[str]) -> frozenset[str]:
        return self.adopted.intersection(ips)

    async def watch(self) -> None:
        await asyncio.Event().wait()


def agent_with(links: Links | None) -> Agent:
    return Agent(AgentSettings(node_name="node-a"), connection=None, datapath=MemoryDatapath(),  # type: ignore[arg-type]
                 links=links)


LISTED = [Replace(NAMESPACES, []), Replace(CONFIGURATIONS, [])]


def test_links_are_given_the_ips_of_every_pod_of_the_node_that_holds_its_own() -> None:
    links = Links()
    agent = agent_with(links)
    agent.apply_batch([Replace(PODS, []), *LISTED])
    assert links.given == [frozenset()]
    web = make_pod("web", ips=("10.1.0.5",), observe=True)
    db = make_pod("db", ips=("10.1.0.6", "fd00::6"))  # not observed: its link is a pod's all the same
    pods = [web, db,
            make_pod("proxy", ips=("192.168.0.10",), host_network=True),  # the node's own address
            make_pod("job", ips=("10.1.0.7",), phase="Succeeded"),  # finished: its IP may soon be another's
            make_pod("away", ips=("10.2.0.5",), node="node-b"),
            make_pod("pending", phase="Pending")]  # no IP yet
    agent.apply_batch([Upsert(PODS, pod) for pod in pods])
    assert links.given[-1] == {"10.1.0.5", "10.1.0.6", "fd00::6"}
    told = len(links.given)
    agent.apply_batch([Upsert(NAMESPACES, make_namespace("default", observe=True))])  # no pod changed
    agent.apply_batch([Upsert(PODS, with_changes(web, labels=("app", "web2")))])  # the same IPs
    assert len(links.given) == told  # nothing new to tell
    agent.apply_batch([Delete(PODS, db.uid)])
    assert links.given[-1] == {"10.1.0.5"}


async def test_the_first_write_waits_for_the_links_of_the_pods_listed() -> None:
    links = Links(settled=False)
    agent = agent_with(links)
    agent.apply_batch([Replace(PODS, [make_pod("web", ips=("10.1.0.5",), observe=True)]), *LISTED])
    assert links.given == [frozenset({"10.1.0.5"})]
    assert not agent.ready.is_set() and agent.datapath.contents() == set()  # not counted yet: nothing written
    links.attached = True
    tick = await asyncio.wait_for(agent.queue.get(), 5)  # the agent looks again by itself
    assert tick is Tick.RETRY
    agent.apply_batch([tick])
    assert agent.ready.is_set() and agent.datapath.contents() == {"10.1.0.5"}


def exposition(agent: Agent) -> str:
    registry = CollectorRegistry()
    registry.register(AgentStateCollector(agent.snapshot))
    return generate_latest(registry).decode()


def test_links_seen_attached_and_skipped_are_exported_with_links_only() -> None:
    agent = agent_with(Links())
    agent.apply_batch([Replace(PODS, []), *LISTED])
    text = exposition(agent)
    assert "podmeter_links_seen 3.0" in text
    assert "podmeter_links_attached 2.0" in text
    assert 'podmeter_links_skipped{reason="no_pod"} 1.0' in text
    memory = agent_with(None)  # the memory datapath has no links
    memory.apply_batch([Replace(PODS, []), *LISTED])
    assert "podmeter_links_" not in exposition(memory)


def test_the_first_push_credits_a_predecessors_counters_to_pods_on_adopted_links_only() -> None:
    """web's link was adopted (the same pod's): what the kernel counted before this agent is web's. db's
    link is new: its IP may have been another pod's while no agent ran, so its counters are a base."""
    links = Links(inherited=frozenset({"10.1.0.5"}))
    agent = agent_with(links)
    memory = agent.datapath
    assert isinstance(memory, MemoryDatapath)
    memory.entries |= {"10.1.0.5", "10.1.0.6"}  # pinned by a predecessor, with what its links counted
    memory.count("10.1.0.5", Direction.EGRESS, 7, 700)
    memory.count("10.1.0.6", Direction.EGRESS, 3, 300)
    pods = [make_pod("web", ips=("10.1.0.5",), observe=True), make_pod("db", ips=("10.1.0.6",), observe=True)]
    agent.apply_batch([Replace(PODS, pods), *LISTED])
    assert agent.ready.is_set()
    memory.count("10.1.0.5", Direction.EGRESS, 1, 100)
    memory.count("10.1.0.6", Direction.EGRESS, 1, 100)
    series = {s.name: value for s, direction, value in agent.ledger.series_values(memory.read_counters())
              if direction is Direction.EGRESS}
    assert series == {"web": Traffic(8, 800), "db": Traffic(1, 100)}


def test_a_predecessors_flows_are_named_by_the_pods_whose_links_were_adopted_only() -> None:
    """web's link was adopted: the flows the kernel aggregated while no agent ran are web's. db's link is
    new (its IP may have been another pod's meanwhile): its flows stay world, and so do far ends."""
    import time

    from flow_support import key

    memory = MemoryDatapath()
    memory.entries |= {"10.1.0.5", "10.1.0.6"}
    now = time.monotonic_ns()
    memory.record_flow(key("10.1.0.5", "1.1.1.1"), 4, 400, now)
    memory.record_flow(key("10.1.0.6", "1.1.1.1"), 3, 300, now)
    links = Links(inherited=frozenset({"10.1.0.5"}))
    agent = Agent(AgentSettings(node_name="node-a"), connection=None, datapath=memory, flows=memory,  # type: ignore[arg-type]
                  links=links)
    pods = [make_pod("web", ips=("10.1.0.5",), observe=True), make_pod("db", ips=("10.1.0.6",), observe=True)]
    agent.apply_batch([Replace(PODS, pods), *LISTED])
    assert agent.ready.is_set()
    named = {r.source.ip: r.source.endpoint for _, r in agent.flow_feed.ring.after(0)}
    web = named["10.1.0.5"]
    assert web is not None and web.pod == "web"
    assert named["10.1.0.6"] is None


def test_a_healthy_agent_exports_its_error_counters_at_zero() -> None:
    """A dashboard's panel of decode errors or repaired drift shows 0 for a healthy agent, not "No data"."""
    agent = agent_with(None)
    agent.apply_batch([Replace(PODS, []), *LISTED])
    text = exposition(agent)
    for kind in ("leaked", "missing"):
        assert f'podmeter_drift_repaired_total{{kind="{kind}"}} 0.0' in text
    for resource in ("pods", "namespaces", "metricsconfigurations"):
        assert f'podmeter_decode_errors_total{{resource="{resource}"}} 0.0' in text
