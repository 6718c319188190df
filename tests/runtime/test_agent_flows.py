"""Flows through the agent's writer task, with the in-memory datapath (the kernel's semantics): when the agent
drains at a change of hands and when it does not, a predecessor's flows, a failed drain, the order of the
filter write and the drain, and the feed of ``podmeter observe`` (a slow follower is cut off). The model's
flow tests, and the attribution property, are in tests/model/test_flow_model.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from factories import make_pod
from flow_support import counts, flow_agent, key, sent_by
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.flow_serving import FlowFeed, Gap
from podmeter.model.datapath import BatchResult
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Delete, Replace, Upsert
from podmeter.model.endpoints import AddressBook
from podmeter.model.flow_records import FlowFilter, name_flows
from podmeter.model.flows import FlowEntry
from podmeter.runtime.agent import Agent, AgentSettings
from podmeter.runtime.ticks import Tick


def test_a_reused_ip_between_two_drains_does_not_hand_the_old_pods_flows_to_the_new_one() -> None:
    dp = MemoryDatapath()
    agent = flow_agent(dp)
    old = make_pod("old", ips=("10.0.0.7",), observe=True)
    agent.apply_batch([Upsert(PODS, old)])
    dp.record_flow(key("10.0.0.7", "1.1.1.1"), 5, 500, time.monotonic_ns())
    new = make_pod("new", ips=("10.0.0.7",), observe=True)
    agent.apply_batch([Delete(PODS, old.uid), Upsert(PODS, new)])  # no periodic drain in between
    dp.record_flow(key("10.0.0.7", "1.1.1.1"), 2, 200, time.monotonic_ns())
    agent.apply_batch([Tick.DRAIN])
    assert sent_by(agent) == {old.uid: 5, new.uid: 2}

def test_a_status_update_that_changes_no_address_does_not_drain() -> None:
    dp = MemoryDatapath()
    agent = flow_agent(dp)
    pod = make_pod("p", ips=("10.0.0.7",), observe=True)
    agent.apply_batch([Upsert(PODS, pod)])
    assert agent.flows is not None
    drains = agent.flows.stats.drains
    agent.apply_batch([Upsert(PODS, msgspec.structs.replace(pod, resource_version="999"))])
    assert agent.flows.stats.drains == drains
    agent.apply_batch([Upsert(PODS, msgspec.structs.replace(pod, phase="Succeeded"))])  # stops holding it
    assert agent.flows.stats.drains == drains + 1

def test_a_predecessors_flows_are_never_credited_to_the_pods_of_the_first_list() -> None:
    """Found by the lab: A sent, the agent died, A went and A' got its IP, a new agent started."""
    dp = MemoryDatapath()
    dp.entries.add("10.0.0.7")  # the predecessor's pinned filter
    dp.record_flow(key("10.0.0.7", "1.1.1.1"), 25, 2500, time.monotonic_ns())  # A's packets
    agent = Agent(AgentSettings(node_name="node-a"), connection=None, datapath=dp, flows=dp)  # type: ignore[arg-type]
    successor = make_pod("a-prime", ips=("10.0.0.7",), observe=True)
    agent.apply_batch([Replace(PODS, [successor]), Replace(NAMESPACES, []), Replace(CONFIGURATIONS, [])])
    agent.apply_batch([Tick.DRAIN])
    assert sent_by(agent) == {}  # not A's packets credited to A'
    (record,) = [r for _, r in agent.flow_feed.ring.after(0)]
    assert record.source.endpoint is None and record.packets == 25  # kept, as world
    assert agent.flows is not None and agent.flows.stats.unnamed == 1

def test_a_failed_drain_before_a_change_of_hands_names_the_next_drain_world() -> None:
    dp = MemoryDatapath()
    agent = flow_agent(dp)
    old = make_pod("old", ips=("10.0.0.7",), observe=True)
    agent.apply_batch([Upsert(PODS, old)])
    dp.record_flow(key("10.0.0.7", "1.1.1.1"), 5, 500, time.monotonic_ns())
    real_drain = dp.drain_flows

    def failing() -> list[object]:
        raise OSError("EIO")

    dp.drain_flows = failing  # type: ignore[method-assign,assignment]
    agent.apply_batch([Delete(PODS, old.uid), Upsert(PODS, make_pod("new", ips=("10.0.0.7",), observe=True))])
    dp.drain_flows = real_drain  # type: ignore[method-assign]
    agent.apply_batch([Tick.DRAIN])
    assert sent_by(agent) == {}  # neither old nor new: unknown, so world
    assert agent.flows is not None and agent.flows.stats.errors == 1 and agent.flows.stats.unnamed == 1

def test_a_new_pod_on_a_free_address_does_not_drain_but_one_taking_a_held_address_does() -> None:
    dp = MemoryDatapath()
    agent = flow_agent(dp)
    assert agent.flows is not None
    drains = agent.flows.stats.drains
    first = make_pod("first", ips=("10.0.0.7",), observe=True)
    agent.apply_batch([Upsert(PODS, first)])  # a free address: nobody to name differently
    assert agent.flows.stats.drains == drains
    agent.apply_batch([Upsert(PODS, make_pod("late", ips=("10.0.0.7",), observe=True))])  # first's delete is late
    assert agent.flows.stats.drains == drains + 1

def test_a_deleted_pods_ip_leaves_the_filter_before_its_flows_are_drained() -> None:
    """The drain at a change of hands waits for the kernel (a grace period): the filter write does not."""
    order: list[str] = []

    class Recording(MemoryDatapath):
        def delete(self, ips: Sequence[str]) -> BatchResult:
            order.append("filter delete")
            return super().delete(ips)

        def drain_flows(self) -> list[FlowEntry]:
            order.append("drain")
            return super().drain_flows()

    dp = Recording()
    agent = flow_agent(dp)
    pod = make_pod("p", ips=("10.0.0.7",), observe=True)
    agent.apply_batch([Upsert(PODS, pod)])
    dp.record_flow(key("10.0.0.7", "1.1.1.1"), 3, 300, time.monotonic_ns())
    order.clear()
    agent.apply_batch([Delete(PODS, pod.uid)])
    assert order == ["filter delete", "drain"]
    assert sent_by(agent) == {pod.uid: 3}  # still named by the pod that held it


# --- the feed ------------------------------------------------------------------------------------------


async def test_a_follower_that_stops_reading_holds_nothing_and_is_told_what_it_missed() -> None:
    feed = FlowFeed(16)
    book = AddressBook([make_pod("web-1", "shop", ips=("10.0.0.1",))])
    (record,) = name_flows([(key("10.0.0.1", "10.0.0.2"), counts())], book, "node-a", 0.0)
    async with feed.open(FlowFilter(), follow=True) as follower:
        following = follower.follow()
        feed.publish([record])
        assert await anext(following) == record
        for _ in range(100):  # it reads nothing meanwhile: nothing is queued for it
            feed.publish([record])
        assert len(feed.ring) == 16  # the ring stays bounded whatever the traffic, and is all the feed holds
        assert await anext(following) == Gap(100 - 16)
        assert await anext(following) == record
        await following.aclose()
    assert (feed.followers, feed.lost) == (0, 84)


async def test_a_drain_beyond_the_ring_makes_records_of_its_newest_counts_the_rest_and_the_series_all() -> None:
    """A drain of more entries than ``--flow-buffer``: the ring gets the newest (by last packet), the older
    ones are numbered and counted as fallen out (a follower is told it missed them), and the series count
    every entry's packets."""
    dp = MemoryDatapath()
    agent = flow_agent(dp, flow_buffer=50)
    web = make_pod("web", ips=("10.0.0.7",), observe=True)
    agent.apply_batch([Upsert(PODS, web)])
    start = time.monotonic_ns()
    for i in range(120):  # flow i's last packet at start + i ms, in an order the kernel would not keep
        dp.record_flow(key("10.0.0.7", "1.1.1.1", 10000 + (i * 37) % 120), 2, 200, start + ((i * 37) % 120) * 10**6)
    follower = agent.flow_feed.open(FlowFilter(), follow=True)
    async with follower:
        agent.apply_batch([Tick.DRAIN])
        following = follower.follow()
        assert await anext(following) == Gap(70)
        got = [await anext(following) for _ in range(50)]
        await following.aclose()
    assert [r.source.port for r in got] == list(range(10070, 10120))  # the newest 50, oldest first
    ring = agent.flow_feed.ring
    assert (agent.flow_feed.published, len(ring), ring.dropped) == (120, 50, 70)
    assert sum(t.packets for _, t in agent.workload_flows.values()) == 240
    assert agent.flows is not None and agent.flows.stats.last_entries == 120
