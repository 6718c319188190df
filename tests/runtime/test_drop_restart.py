"""Drops across an agent restart, without a kernel: what a predecessor left in pinned drop maps (an
``Inheriting`` source, as ``ebpf.drops.DropTracer`` with pins is) waits for the first drain after the
first push, goes to the pods that held their IPs throughout (the predecessor's owners record says so),
to the node totals otherwise, and is taken once. The kernel side: tests/adapters/test_bpf_drop_restart.py."""

from __future__ import annotations

import time
from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from flow_support import drops_of, pod
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.datapath import Direction
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Delete, Replace, Upsert
from podmeter.model.drops import HOOKS, DropDrain, DropFlowKey, DropKey, TcpEvent
from podmeter.model.flows import TCP, FlowCounts
from podmeter.model.records import Pod
from podmeter.runtime.agent import Agent, AgentSettings
from podmeter.runtime.drop_drain import Inheriting
from podmeter.runtime.ticks import Tick

IN, OUT = Direction.INGRESS, Direction.EGRESS
REASON = "NETFILTER_DROP"


class PinnedDrops:
    """A DropSource whose maps a predecessor left: what the next drain takes, and the owners it recorded
    (IP -> UID), as the pinned owners record keeps them."""

    def __init__(self, recorded: Mapping[str, str] | None) -> None:
        self.pending = DropDrain()
        self.inherited = recorded is not None
        self.recorded = dict(recorded or {})
        self.drains = 0
        self.fail_record = False

    @property
    def hooks(self) -> Mapping[str, bool]:
        return dict.fromkeys(HOOKS, True)

    def drops_lost(self) -> Mapping[str, int]:
        return {}

    def drop(self, ip: str, packets: int, direction: Direction = IN) -> None:
        self.pending.drops.append((DropKey(ip, direction, REASON), packets))
        self.pending.drop_bytes.append((DropKey(ip, direction, REASON), packets * 100))

    def drain_drops(self) -> DropDrain:
        self.drains += 1
        taken, self.pending = self.pending, DropDrain()
        return taken

    def held_throughout(self, owners: Mapping[str, str]) -> frozenset[str]:
        return frozenset(ip for ip, uid in owners.items() if self.recorded.get(ip) == uid)

    def record_owners(self, owners: Mapping[str, str]) -> None:
        if self.fail_record:
            raise OSError("EIO")
        self.recorded = dict(owners)


def successor(drops: PinnedDrops, pods: list[Pod]) -> Agent:
    """An agent that lists ``pods`` and becomes ready (its first push)."""
    agent = Agent(AgentSettings(node_name="node-a"), connection=None, datapath=MemoryDatapath(),  # type: ignore[arg-type]
                  drops=drops)
    agent.apply_batch([Replace(PODS, pods), Replace(NAMESPACES, []), Replace(CONFIGURATIONS, [])])
    assert agent.ready.is_set()
    return agent


def test_the_source_is_inheriting() -> None:
    assert isinstance(PinnedDrops({}), Inheriting)


def test_a_predecessors_drops_go_to_the_pods_that_held_their_ips_throughout() -> None:
    a, b = pod("a", "10.0.0.1"), pod("b", "10.0.0.2")
    c = pod("c", "10.0.0.3")  # given 10.0.0.3 while no agent ran: the predecessor recorded another owner
    d = pod("d", "10.0.0.4")  # its IP has no record (new since the predecessor's last drain)
    drops = PinnedDrops({a.ips[0]: a.uid, b.ips[0]: b.uid, c.ips[0]: "uid-of-a-pod-deleted-meanwhile"})
    for ip, packets in ((a.ips[0], 5), (b.ips[0], 4), (c.ips[0], 3), (d.ips[0], 2)):
        drops.drop(ip, packets)  # left by the predecessor, counted while no agent ran
    drops.drop(a.ips[0], 1, OUT)
    agent = successor(drops, [a, b, c, d])
    assert drops.drains == 0  # before its resync nobody owned the IPs: the entries wait in the maps
    assert drops_of(agent.drop_ledger) == {"a": {}, "b": {}, "c": {}, "d": {}}

    drops.drop(a.ips[0], 2)  # after ready: the same entries in the kernel, the same drain
    agent.apply_batch([Tick.DRAIN])
    assert drops.drains == 1
    assert drops_of(agent.drop_ledger) == {"a": {(IN, REASON): 7, (OUT, REASON): 1}, "b": {(IN, REASON): 4},
                                           "c": {}, "d": {}}
    assert agent.drop_ledger.node_drops == {(IN, REASON): 16, (OUT, REASON): 1}  # each packet once
    assert agent.drop_ledger.unattributed == 5
    assert drops.recorded == {p.ips[0]: p.uid for p in (a, b, c, d)}  # for the next successor

    drops.drop(c.ips[0], 6)  # from now on every owner is known: an ordinary drain
    drops.drop(d.ips[0], 1)
    agent.apply_batch([Tick.DRAIN])
    assert drops_of(agent.drop_ledger)["c"] == {(IN, REASON): 6}
    assert drops_of(agent.drop_ledger)["d"] == {(IN, REASON): 1}


def test_a_change_of_hands_before_the_first_drain_credits_the_owner_at_the_first_push() -> None:
    a, e = pod("a", "10.0.0.1"), pod("e", "10.0.0.1")
    drops = PinnedDrops({a.ips[0]: a.uid})
    drops.drop(a.ips[0], 5)
    agent = successor(drops, [a])
    drops.drop(a.ips[0], 2)
    agent.apply_batch([Delete(PODS, a.uid), Upsert(PODS, e)])  # drained at the change of hands: a's 7
    drops.drop(a.ips[0], 1)
    agent.apply_batch([Tick.DRAIN])
    assert drops_of(agent.drop_ledger) == {"a": {(IN, REASON): 7}, "e": {(IN, REASON): 1}}
    assert drops.recorded == {e.ips[0]: e.uid}


def test_the_dropped_flows_of_the_first_drain_name_only_the_pods_that_kept_their_ips() -> None:
    a, c = pod("a", "10.0.0.1"), pod("c", "10.0.0.3")
    drops = PinnedDrops({a.ips[0]: a.uid, c.ips[0]: "another-uid"})
    now = time.monotonic_ns()
    for source in (a.ips[0], c.ips[0]):
        key = DropFlowKey(source, "10.9.0.1", 40000, 80, TCP, True, False, REASON)
        drops.pending.flows.append((key, FlowCounts(1, 60, now, now, 0)))
    agent = successor(drops, [a, c])
    agent.apply_batch([Tick.DRAIN])
    named = {r.source.ip: r.source.endpoint.pod if r.source.endpoint else None
             for _, r in agent.flow_feed.ring.after(0)}
    assert named == {a.ips[0]: "a", c.ips[0]: None}


def test_tcp_events_a_predecessor_left_follow_the_same_rule() -> None:
    a, c = pod("a", "10.0.0.1"), pod("c", "10.0.0.3")
    drops = PinnedDrops({a.ips[0]: a.uid})
    drops.pending.tcp.extend([((a.ips[0], TcpEvent.RETRANSMIT), 3), ((c.ips[0], TcpEvent.RETRANSMIT), 2)])
    agent = successor(drops, [a, c])
    agent.apply_batch([Tick.DRAIN])
    assert {s.name: dict(s.tcp) for s in agent.drop_ledger.values()} == {"a": {TcpEvent.RETRANSMIT: 3}, "c": {}}
    assert agent.drop_ledger.node_tcp == {TcpEvent.RETRANSMIT: 5}


def test_without_a_predecessor_the_first_drain_is_at_ready_as_before() -> None:
    p = pod("p", "10.0.0.7")
    drops = PinnedDrops(None)  # new maps: what they hold was counted before the owners were known
    drops.drop(p.ips[0], 3)
    agent = successor(drops, [p])
    assert drops.drains == 1
    assert drops_of(agent.drop_ledger) == {"p": {}} and agent.drop_ledger.unattributed == 3
    assert drops.recorded == {}  # that drain came before the owners: the next one records them
    drops.drop(p.ips[0], 1)
    agent.apply_batch([Tick.DRAIN])
    assert drops_of(agent.drop_ledger) == {"p": {(IN, REASON): 1}}
    assert drops.recorded == {p.ips[0]: p.uid}


def test_a_failed_record_write_does_not_stop_the_drains() -> None:
    p = pod("p", "10.0.0.7")
    drops = PinnedDrops({})
    agent = successor(drops, [p])
    drops.fail_record = True
    drops.drop(p.ips[0], 2)
    agent.apply_batch([Tick.DRAIN])
    drops.drop(p.ips[0], 1)
    agent.apply_batch([Tick.DRAIN])
    assert drops_of(agent.drop_ledger) == {"p": {(IN, REASON): 1}}  # the first: inherited, no record of p
    assert agent.drops is not None and agent.drops.stats.errors == 0


# --- the rule against a recompute (Hypothesis) -------------------------------------------------------------

IPS = [f"10.0.1.{n}" for n in range(1, 7)]
# For each IP: who holds it now (a pod, or nobody), what the predecessor recorded (that pod, another one,
# nothing), the drops it left.
ip_cases = st.tuples(st.booleans(), st.sampled_from(["same", "other", None]), st.integers(0, 5))


@settings(max_examples=60, deadline=None)
@given(st.lists(ip_cases, min_size=len(IPS), max_size=len(IPS)))
def test_what_a_predecessor_left_is_credited_exactly_by_the_rule(cases: list[tuple[bool, str | None, int]]) -> None:
    pods = {ip: pod(f"p{n}", ip) for n, (ip, (held, _, _)) in enumerate(zip(IPS, cases, strict=True)) if held}
    recorded = {ip: pods[ip].uid if record == "same" and ip in pods else f"other-{ip}"
                for ip, (_, record, _) in zip(IPS, cases, strict=True) if record is not None}
    drops = PinnedDrops(recorded)
    for ip, (_, _, packets) in zip(IPS, cases, strict=True):
        if packets:
            drops.drop(ip, packets)
    agent = successor(drops, list(pods.values()))
    agent.apply_batch([Tick.DRAIN])
    expected: dict[str, dict[tuple[Direction, str], int]] = {}
    for ip, holder in pods.items():
        packets = cases[IPS.index(ip)][2]
        expected[holder.name] = {(IN, REASON): packets} if packets and recorded.get(ip) == holder.uid else {}
    assert drops_of(agent.drop_ledger) == expected
    total = sum(packets for _, _, packets in cases)
    assert agent.drop_ledger.node_drops == ({(IN, REASON): total} if total else {})
    credited = sum(sum(counts.values()) for counts in expected.values())
    assert agent.drop_ledger.unattributed == total - credited
    assert drops.drains == 1 and drops.recorded == {ip: p.uid for ip, p in pods.items()}
