"""Drops and TCP health in the model: the per-pod ledger and its lifecycle (a Hypothesis property against a
reference written from the rules), dropped flows as records, retransmits on flow records."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flow_support import FROM, TO, drain_of, drops_of, pod
from podmeter.model.datapath import Direction
from podmeter.model.drops import (
    LIFECYCLE_REASONS,
    ConnectionKey,
    DropDrain,
    DropFlowKey,
    DropKey,
    DropLedger,
    Retransmits,
    TcpEvent,
    name_drops,
)
from podmeter.model.endpoints import AddressBook
from podmeter.model.flow_records import VERDICT_DROPPED, FlowEnd, FlowFilter, FlowRecord
from podmeter.model.flows import TCP, UDP, FlowCounts, Observation

pytestmark = pytest.mark.fast  # the pure tier: make test-fast

IN, OUT = Direction.INGRESS, Direction.EGRESS


# --- the ledger ----------------------------------------------------------------------------------------


def test_drops_go_to_the_pod_that_held_the_ip_and_unowned_ones_to_the_node_only() -> None:
    ledger = DropLedger(grace=10)
    a = pod("a", "10.0.0.1")
    ledger.assign("10.0.0.1", a, now=0)
    ledger.add(drain_of(("10.0.0.1", OUT, "NETFILTER_DROP", 3), ("10.0.0.9", IN, "NO_SOCKET", 2),
                     tcp=(("10.0.0.1", TcpEvent.RETRANSMIT, 4),)))
    assert drops_of(ledger) == {"a": {(OUT, "NETFILTER_DROP"): 3}}
    assert ledger.series[a.uid].tcp == {TcpEvent.RETRANSMIT: 4}
    assert ledger.node_drops == {(OUT, "NETFILTER_DROP"): 3, (IN, "NO_SOCKET"): 2}
    assert ledger.unattributed == 2

def test_the_node_keeps_the_bytes_of_every_drop_it_counts_owned_or_not_lifecycle_apart() -> None:
    ledger = DropLedger(grace=10)
    a = pod("a", "10.0.0.1")
    ledger.assign("10.0.0.1", a, now=0)
    drain = DropDrain(drop_bytes=[(DropKey("10.0.0.1", OUT, "NETFILTER_DROP"), 300),
                                  (DropKey("10.0.0.9", IN, "NO_SOCKET"), 80),
                                  (DropKey("10.0.0.1", IN, "QUEUE_PURGE"), 50)])
    ledger.add(drain)
    ledger.add(drain, credit=False)  # a drain that may span a change of owner: the node's only
    assert ledger.node_drop_bytes == {(OUT, "NETFILTER_DROP"): 600, (IN, "NO_SOCKET"): 160}
    assert ledger.series[a.uid].drop_bytes == {(OUT, "NETFILTER_DROP"): 300}


def test_a_reused_ip_never_hands_drops_to_the_next_owner() -> None:
    ledger = DropLedger(grace=10)
    a, b = pod("a", "10.0.0.1"), pod("b", "10.0.0.1")
    ledger.assign("10.0.0.1", a, now=0)
    ledger.add(drain_of(("10.0.0.1", IN, "NETFILTER_DROP", 5)))
    ledger.assign("10.0.0.1", b, now=1)  # passes on without leaving the filter
    ledger.add(drain_of(("10.0.0.1", IN, "NETFILTER_DROP", 2)))  # the drain at the change: counted before it
    ledger.add(drain_of(("10.0.0.1", IN, "NETFILTER_DROP", 1)))
    assert drops_of(ledger) == {"a": {(IN, "NETFILTER_DROP"): 7}, "b": {(IN, "NETFILTER_DROP"): 1}}

def test_series_live_through_the_grace_then_go_and_a_pod_observed_again_starts_from_zero() -> None:
    ledger = DropLedger(grace=10)
    a = pod("a", "10.0.0.1")
    ledger.assign("10.0.0.1", a, now=0)
    ledger.add(drain_of(("10.0.0.1", OUT, "NOT_SPECIFIED", 2)))
    ledger.release(["10.0.0.1"], now=5)
    assert ledger.expire(now=14) == 0 and drops_of(ledger) == {"a": {(OUT, "NOT_SPECIFIED"): 2}}
    assert ledger.expire(now=15) == 1 and drops_of(ledger) == {}
    assert ledger.node_drops == {(OUT, "NOT_SPECIFIED"): 2}  # the node keeps it
    ledger.assign("10.0.0.1", a, now=20)
    assert drops_of(ledger) == {"a": {}}
    ledger.release(["10.0.0.1"], now=21)
    ledger.add(DropDrain())  # the drain at the change
    ledger.assign("10.0.0.1", a, now=22)  # within grace: still a new series from zero
    ledger.add(drain_of(("10.0.0.1", OUT, "NOT_SPECIFIED", 1)))
    assert drops_of(ledger) == {"a": {(OUT, "NOT_SPECIFIED"): 1}}

def test_a_thousand_pods_leave_nothing() -> None:
    ledger = DropLedger(grace=1)
    for i in range(1000):
        ip = f"10.1.{i // 250}.{i % 250}"
        ledger.assign(ip, pod(f"p{i}", ip), now=0)
        ledger.add(drain_of((ip, IN, "NETFILTER_DROP", 1)))
    ledger.release([s.ips.copy().pop() for s in ledger.values()], now=1)
    ledger.expire(now=2)
    assert ledger.series == {} and ledger.owners == {}
    assert ledger.node_drops == {(IN, "NETFILTER_DROP"): 1000}

def test_lifecycle_reasons_are_counted_apart_from_the_drops_with_the_same_series() -> None:
    """QUEUE_PURGE and the other reasons of a socket's queues freed as it closes are no loss: they go to the
    lifecycle counts of the pod and the node, never to its drops (nor their bytes to Retina's)."""
    ledger = DropLedger(grace=10)
    assert ledger.lifecycle == LIFECYCLE_REASONS  # the default
    a = pod("a", "10.0.0.1")
    ledger.assign("10.0.0.1", a, now=0)
    ledger.add(DropDrain(
        [(DropKey("10.0.0.1", IN, "QUEUE_PURGE"), 4), (DropKey("10.0.0.1", IN, "SOCKET_CLOSE"), 1),
         (DropKey("10.0.0.1", OUT, "NETFILTER_DROP"), 2), (DropKey("10.0.0.9", IN, "QUEUE_PURGE"), 3)],
        drop_bytes=[(DropKey("10.0.0.1", IN, "QUEUE_PURGE"), 400), (DropKey("10.0.0.1", OUT, "NETFILTER_DROP"), 56)]))
    series = ledger.series[a.uid]
    assert series.drops == {(OUT, "NETFILTER_DROP"): 2} and series.drop_bytes == {(OUT, "NETFILTER_DROP"): 56}
    assert series.lifecycle == {(IN, "QUEUE_PURGE"): 4, (IN, "SOCKET_CLOSE"): 1}
    assert ledger.node_drops == {(OUT, "NETFILTER_DROP"): 2}
    assert ledger.node_lifecycle == {(IN, "QUEUE_PURGE"): 7, (IN, "SOCKET_CLOSE"): 1}
    assert ledger.unattributed == 3
    ledger.release(["10.0.0.1"], now=1)
    assert ledger.expire(now=11) == 1 and ledger.series == {}  # the drop series' lifecycle, lifecycle counts too
    assert ledger.node_lifecycle == {(IN, "QUEUE_PURGE"): 7, (IN, "SOCKET_CLOSE"): 1}

    everything = DropLedger(grace=10, lifecycle=frozenset())  # --drops-include-lifecycle: drops as before
    everything.assign("10.0.0.1", a, now=0)
    everything.add(drain_of(("10.0.0.1", IN, "QUEUE_PURGE", 4)))
    assert drops_of(everything) == {"a": {(IN, "QUEUE_PURGE"): 4}} and everything.series[a.uid].lifecycle == {}
    assert everything.node_drops == {(IN, "QUEUE_PURGE"): 4} and everything.node_lifecycle == {}

PODS_ = [pod(f"p{i}", "10.9.9.9") for i in range(2)]

IPS = ["10.0.0.1", "10.0.0.2"]

ops = st.lists(st.one_of(
    st.tuples(st.just("assign"), st.sampled_from(IPS), st.one_of(st.none(), st.integers(0, 1))),
    st.tuples(st.just("release"), st.sampled_from(IPS)),
    st.tuples(st.just("drops"), st.sampled_from(IPS), st.sampled_from(list(Direction)),
              st.sampled_from(["NETFILTER_DROP", "NO_SOCKET"]), st.integers(1, 5)),
    st.tuples(st.just("tcp"), st.sampled_from(IPS), st.sampled_from(list(TcpEvent)), st.integers(1, 3)),
    st.tuples(st.just("drain")),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.5, 1.0, 2.5])),
), max_size=60)

@settings(max_examples=500, deadline=None)
@given(ops)
def test_series_are_exact_monotonic_and_follow_the_traffic_lifecycle(steps: list[tuple[object, ...]]) -> None:
    """The agent's protocol: the kernel counts events (``drops``, ``tcp``) for the IP's owner of the
    moment; the agent drains periodically (``drain``) and right after every change of owner (``assign``,
    ``release``). Against a reference written from the rules: a pod's series is every event of the IPs it
    held while it held them, since its series began; it exists while the pod holds an IP and ``grace``
    after; nothing decreases while it exists; the node totals hold every event drained."""
    grace = 2.0
    ledger = DropLedger(grace)
    owner: dict[str, int] = {}
    lost_last_ip_at: dict[int, float] = {}  # pod -> when it last held no IP (absent while it holds one)
    truth: dict[int, dict[object, int]] = {}  # pod -> what its current series must show once drained
    pending: list[tuple[object, ...]] = []  # counted in the kernel, not drained yet
    node: dict[object, int] = {}
    seen: dict[str, tuple[object, dict[object, int]]] = {}
    clock = 0.0

    def drain() -> None:
        drops = [(ip, *what, n) for kind, ip, what, n in pending if kind == "drops"]
        tcp = tuple((ip, what[0], n) for kind, ip, what, n in pending if kind == "tcp")
        ledger.add(drain_of(*drops, tcp=tcp))  # type: ignore[arg-type]
        for _, _, what, n in pending:
            node[tuple(what)] = node.get(tuple(what), 0) + n  # type: ignore[arg-type,operator]
        pending.clear()

    for step in steps:
        clock += 0.5
        kind = step[0]
        if kind in ("assign", "release"):
            ip = step[1]
            index = step[2] if kind == "assign" else None
            previous = owner.get(ip)  # type: ignore[arg-type]
            if previous != index:
                if previous is not None:
                    del owner[ip]  # type: ignore[arg-type]
                    if previous not in owner.values():
                        lost_last_ip_at[previous] = clock
                if index is not None:
                    if index not in owner.values():  # a new series from zero, unless it is live
                        truth[index] = {} if index not in truth or index in lost_last_ip_at else truth[index]
                    lost_last_ip_at.pop(index, None)  # type: ignore[call-overload]
                    owner[ip] = index  # type: ignore[index]
            if kind == "assign":
                ledger.assign(ip, PODS_[index] if index is not None else None, clock)  # type: ignore[arg-type,index]
            else:
                ledger.release([ip], clock)  # type: ignore[list-item]
            drain()  # the agent drains after every change of hands
        elif kind in ("drops", "tcp"):
            ip, what, amount = step[1], tuple(step[2:-1]), step[-1]
            if ip in owner:  # else not in the filter: the kernel counts nothing for it
                t = truth[owner[ip]]  # type: ignore[index]
                t[what] = t.get(what, 0) + amount  # type: ignore[call-overload,operator]
                pending.append((kind, ip, what, amount))
        elif kind == "drain":
            drain()
        else:
            clock += step[1]  # type: ignore[operator]
        ledger.expire(clock)
        for index, at in list(lost_last_ip_at.items()):
            if clock - at >= grace:
                del lost_last_ip_at[index]
                truth.pop(index, None)
        assert set(ledger.series) == {PODS_[i].uid for i in truth}
        current: dict[str, tuple[object, dict[object, int]]] = {}
        undrained = {(ip, what) for _, ip, what, _ in pending}
        for uid, series in ledger.series.items():
            counts: dict[object, int] = {**series.drops, **{(e,): v for e, v in series.tcp.items()}}
            index = next(i for i, p in enumerate(PODS_) if p.uid == uid)
            if not any(owner.get(ip) == index for ip, _ in undrained):  # all it counted is drained: exact
                assert counts == truth[index]
            assert all(counts.get(k, 0) <= v for k, v in truth[index].items()) and set(counts) <= set(truth[index])
            assert (series.ended_at is None) == (index in owner.values())
            before = seen.get(uid)
            if before is not None and before[0] is series:  # the same series: nothing went down
                assert all(counts.get(key, 0) >= value for key, value in before[1].items())
            current[uid] = (series, dict(counts))
        seen = current
        assert {**ledger.node_drops, **{(e,): v for e, v in ledger.node_tcp.items()}} == node

def test_an_address_freed_and_reused_with_no_drain_between_is_credited_to_nobody() -> None:
    ledger = DropLedger(grace=10)
    a, c = pod("a", "10.0.0.1"), pod("c", "10.0.0.1")
    ledger.assign("10.0.0.1", a, now=0)
    ledger.release(["10.0.0.1"], now=1)  # its interest removed: the agent does not drain for that
    ledger.assign("10.0.0.1", c, now=2)  # a free address given to another pod: no drain either
    ledger.add(drain_of(("10.0.0.1", IN, "NETFILTER_DROP", 4)))  # a's and c's, inseparable
    assert drops_of(ledger) == {"a": {}, "c": {}} and ledger.unattributed == 4
    ledger.add(drain_of(("10.0.0.1", IN, "NETFILTER_DROP", 1)))
    assert drops_of(ledger)["c"] == {(IN, "NETFILTER_DROP"): 1}


# --- records -------------------------------------------------------------------------------------------


def test_dropped_flows_become_records_with_verdict_and_reason() -> None:
    web = pod("web", "10.0.0.1")
    book = AddressBook([web])
    entries = [
        (DropFlowKey("10.0.0.1", "198.51.100.7", 40000, 53, UDP, True, False, "NOT_SPECIFIED"),
         FlowCounts(3, 114, 1_000_000_000, 2_000_000_000, 0)),
        (DropFlowKey("192.0.2.1", "10.0.0.1", 5555, 9998, UDP, False, True, "NETFILTER_DROP"),
         FlowCounts(1, 30, 3_000_000_000, 3_000_000_000, 0)),
    ]
    out, into = name_drops(entries, book, "node-a", wall_offset=100.0)
    assert (out.verdict, out.drop_reason, out.observation, out.packets) == (VERDICT_DROPPED, "NOT_SPECIFIED", FROM, 3)
    assert out.time == 102.0 and out.first == 101.0
    assert out.source.endpoint is not None and out.source.endpoint.pod == "web" and out.destination.endpoint is None
    assert (into.observation, into.drop_reason) == (TO, "NETFILTER_DROP")
    js = into.to_json()
    assert js["verdict"] == "dropped" and js["drop_reason"] == "NETFILTER_DROP" and "tcp_retransmits" not in js
    assert FlowFilter(verdict="dropped").matches(into) and not FlowFilter(verdict="forwarded").matches(into)

def forwarded(src: str, dst: str, sport: int, dport: int, observation: Observation) -> FlowRecord:
    return FlowRecord(time=1.0, first=1.0, node="n", source=FlowEnd(src, sport), destination=FlowEnd(dst, dport),
                      protocol=TCP, observation=observation, packets=1, bytes=100, tcp_flags=0)

def test_forwarded_records_say_so() -> None:
    js = forwarded("10.0.0.1", "10.0.0.2", 1, 2, FROM).to_json()
    assert js["verdict"] == "forwarded" and js["drop_reason"] is None and js["tcp_retransmits"] == 0

def test_retransmits_go_on_the_from_pod_record_of_their_connection_and_wait_one_drain_at_most() -> None:
    waiting = Retransmits()
    conn = ConnectionKey("10.0.0.1", "10.0.0.2", 40000, 80)
    waiting.add([(conn, 3)])
    records = [forwarded("10.0.0.1", "10.0.0.2", 40000, 80, TO), forwarded("10.0.0.1", "10.0.0.2", 40000, 80, FROM),
               forwarded("10.0.0.2", "10.0.0.1", 80, 40000, FROM)]
    out = waiting.annotate(records)
    assert [r.tcp_retransmits for r in out] == [0, 3, 0]
    assert waiting.annotate(records) == records  # taken once
    waiting.add([(conn, 1)])
    assert waiting.annotate([]) == []  # no record yet: it waits
    waiting.add([])
    assert [r.tcp_retransmits for r in waiting.annotate(records)] == [0, 1, 0]  # the drain after
    waiting.add([(conn, 1)])
    waiting.add([])
    waiting.add([])
    assert len(waiting) == 0  # forgotten after the drain after next
