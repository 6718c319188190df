"""Drops and TCP health without a kernel: the per-pod ledger and its lifecycle (a Hypothesis property),
attribution through the agent's writer task, dropped flows as records, retransmits on flow records, the
verdict filter, the exposition, reason names and the BTF reader on synthetic BTF."""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import make_pod
from podmeter.adapters.datapath.ebpf.btf import BtfError, parse_btf
from podmeter.adapters.datapath.ebpf.drops import DropReasons, plan
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.flow_http import BadQuery, parse_query
from podmeter.adapters.metrics.pod_drops import PodDropExposition
from podmeter.model.datapath import Direction
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Delete, Replace, Upsert
from podmeter.model.drops import (
    HOOKS,
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
from podmeter.model.records import Pod
from podmeter.runtime.agent import Agent, AgentSettings
from podmeter.runtime.ticks import Tick

IN, OUT = Direction.INGRESS, Direction.EGRESS
FROM, TO = Observation.FROM_POD, Observation.TO_POD


def pod(name: str, ip: str, **kwargs: object) -> Pod:
    return make_pod(name, ips=(ip,), observe=True, **kwargs)


def drops_of(ledger: DropLedger) -> dict[str, dict[tuple[Direction, str], int]]:
    return {s.name: dict(s.drops) for s in ledger.values()}


def drain_of(*drops: tuple[str, Direction, str, int], tcp: tuple[tuple[str, TcpEvent, int], ...] = ()) -> DropDrain:
    return DropDrain([(DropKey(ip, d, r), n) for ip, d, r, n in drops], [],
                     [((ip, event), n) for ip, event, n in tcp], [])


# --- the ledger ------------------------------------------------------------------------------------------


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


# --- through the agent -----------------------------------------------------------------------------------


class FakeDrops:
    """A DropSource in memory: what the next drain takes."""

    def __init__(self) -> None:
        self.pending = DropDrain()
        self.lost = {"drops": 0}

    @property
    def hooks(self) -> Mapping[str, bool]:
        return dict.fromkeys(HOOKS, True)

    def drop(self, ip: str, direction: Direction, reason: str, packets: int) -> None:
        self.pending.drops.append((DropKey(ip, direction, reason), packets))

    def drain_drops(self) -> DropDrain:
        taken, self.pending = self.pending, DropDrain()
        return taken

    def drops_lost(self) -> Mapping[str, int]:
        return self.lost


def agent_with(drops: FakeDrops) -> Agent:
    datapath = MemoryDatapath()
    agent = Agent(AgentSettings(node_name="node-a"), connection=None, datapath=datapath,  # type: ignore[arg-type]
                  flows=datapath, drops=drops)
    agent.apply_batch([Replace(PODS, []), Replace(NAMESPACES, []), Replace(CONFIGURATIONS, [])])
    return agent


def test_the_agent_drains_drops_before_an_ip_changes_hands() -> None:
    drops = FakeDrops()
    agent = agent_with(drops)
    old, new = pod("old", "10.0.0.7"), pod("new", "10.0.0.7")
    agent.apply_batch([Upsert(PODS, old)])
    drops.drop("10.0.0.7", IN, "NETFILTER_DROP", 5)
    agent.apply_batch([Delete(PODS, old.uid), Upsert(PODS, new)])  # no periodic drain in between
    drops.drop("10.0.0.7", IN, "NETFILTER_DROP", 2)
    agent.apply_batch([Tick.DRAIN])
    assert drops_of(agent.drop_ledger) == {"old": {(IN, "NETFILTER_DROP"): 5}, "new": {(IN, "NETFILTER_DROP"): 2}}
    assert agent.drops is not None and agent.drops.stats.drains == 3  # at ready, the change of hands, the tick


def test_after_a_failed_drain_the_next_one_is_credited_to_nobody() -> None:
    class Failing(FakeDrops):
        fail = False

        def drain_drops(self) -> DropDrain:
            if self.fail:
                raise OSError("EIO")
            return super().drain_drops()

    drops = Failing()
    agent = agent_with(drops)
    old, new = pod("old", "10.0.0.7"), pod("new", "10.0.0.7")
    agent.apply_batch([Upsert(PODS, old)])
    drops.drop("10.0.0.7", IN, "NETFILTER_DROP", 5)
    drops.fail = True
    agent.apply_batch([Delete(PODS, old.uid), Upsert(PODS, new)])  # its drain fails: 5 drops of old's wait
    drops.fail = False
    agent.apply_batch([Tick.DRAIN])  # they cannot be told from new's: the node's only
    drops.drop("10.0.0.7", IN, "NETFILTER_DROP", 1)
    agent.apply_batch([Tick.DRAIN])
    assert drops_of(agent.drop_ledger) == {"old": {}, "new": {(IN, "NETFILTER_DROP"): 1}}
    assert agent.drop_ledger.node_drops == {(IN, "NETFILTER_DROP"): 6} and agent.drop_ledger.unattributed == 5
    assert agent.drops is not None and agent.drops.stats.errors == 1


def test_drops_counted_before_the_agent_was_ready_are_credited_to_nobody() -> None:
    drops = FakeDrops()
    datapath = MemoryDatapath()
    agent = Agent(AgentSettings(node_name="node-a"), connection=None, datapath=datapath, drops=drops)  # type: ignore[arg-type]
    drops.drop("10.0.0.7", OUT, "NOT_SPECIFIED", 3)  # e.g. for a pod the predecessor knew
    agent.apply_batch([Replace(PODS, [pod("p", "10.0.0.7")]), Replace(NAMESPACES, []), Replace(CONFIGURATIONS, [])])
    assert agent.ready.is_set()
    assert drops_of(agent.drop_ledger) == {"p": {}}
    assert agent.drop_ledger.unattributed == 3


def test_an_agent_without_drop_tracing_exports_that_it_is_off() -> None:
    datapath = MemoryDatapath()
    agent = Agent(AgentSettings(node_name="node-a"), connection=None, datapath=datapath, flows=datapath)  # type: ignore[arg-type]
    agent.apply_batch([Replace(PODS, [pod("p", "10.0.0.7")]), Replace(NAMESPACES, []), Replace(CONFIGURATIONS, [])])
    agent.apply_batch([Tick.DRAIN, Tick.EXPIRE])
    text = PodDropExposition(agent.drop_ledger, lambda: dict.fromkeys(HOOKS, False)).render().decode()
    assert 'podmeter_drop_tracing_enabled{hook="kfree_skb"} 0' in text
    assert 'podmeter_pod_tcp_retransmits_total{namespace="default",pod="p"} 0' in text
    assert "podmeter_pod_drops_total{" not in text


def test_the_exposition() -> None:
    ledger = DropLedger(grace=10)
    a = pod("a", "10.0.0.1")
    ledger.assign("10.0.0.1", a, now=0)
    ledger.add(drain_of(("10.0.0.1", OUT, "NETFILTER_DROP", 3), ("10.0.0.1", IN, "IP_NOROUTE", 1),
                     tcp=(("10.0.0.1", TcpEvent.RESET_SENT, 2),)))
    text = PodDropExposition(ledger, lambda: {"kfree_skb": True}, lambda: {"drops": 7}).render().decode()
    lines = set(text.splitlines())
    assert {
        'podmeter_pod_drops_total{namespace="default",pod="a",direction="egress",reason="NETFILTER_DROP"} 3',
        'podmeter_pod_drops_total{namespace="default",pod="a",direction="ingress",reason="IP_NOROUTE"} 1',
        'podmeter_pod_tcp_retransmits_total{namespace="default",pod="a"} 0',
        'podmeter_pod_tcp_resets_total{namespace="default",pod="a",direction="egress"} 2',
        'podmeter_pod_tcp_resets_total{namespace="default",pod="a",direction="ingress"} 0',
        'podmeter_node_drops_total{direction="egress",reason="NETFILTER_DROP"} 3',
        'podmeter_drops_lost_total{map="drops"} 7',
        'podmeter_drop_tracing_enabled{hook="kfree_skb"} 1',
        'podmeter_drop_tracing_enabled{hook="tcp_retransmit_skb"} 0',
        "# TYPE podmeter_pod_drops_total counter",
    } <= lines


def test_the_dashboard_has_the_drop_panels_and_uses_documented_series_only() -> None:
    root = Path(__file__).parents[2]
    dashboard = json.loads((root / "deploy/dashboards/pod-traffic.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for series in ("podmeter_pod_drops_total", "podmeter_pod_tcp_retransmits_total", "podmeter_pod_tcp_resets_total",
                   "podmeter_drop_tracing_enabled", "podmeter_drops_lost_total"):
        assert series in exprs
    documented = (root / "docs/metrics.md").read_text()
    assert not {name for name in re.findall(r"podmeter_\w+", exprs) if name not in documented}
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


# --- records ---------------------------------------------------------------------------------------------


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


def test_the_verdict_filter_of_debug_flows() -> None:
    wanted, last, follow = parse_query({"verdict": "dropped"})
    assert wanted.verdict == "dropped" and last == 20 and not follow
    with pytest.raises(BadQuery, match="verdict"):
        parse_query({"verdict": "maybe"})


def test_observe_prints_the_reason_of_a_drop() -> None:
    from podmeter.cli.observe import compact

    record = name_drops([(DropFlowKey("10.0.0.1", "10.0.0.2", 1, 2, UDP, True, True, "NETFILTER_DROP"),
                          FlowCounts(1, 30, time.monotonic_ns(), time.monotonic_ns(), 0))],
                        AddressBook([]), "node-a", 0.0)[0].to_json()
    assert "DROPPED (NETFILTER_DROP)" in compact(record)


# --- reasons and BTF -------------------------------------------------------------------------------------


def test_reason_names_come_from_the_enumerators() -> None:
    reasons = DropReasons({"SKB_NOT_DROPPED_YET": 0, "SKB_CONSUMED": 1, "SKB_DROP_REASON_NOT_SPECIFIED": 2,
                           "SKB_DROP_REASON_NETFILTER_DROP": 12},
                          {"SKB_DROP_REASON_SUBSYS_CORE": 0, "SKB_DROP_REASON_SUBSYS_OPENVSWITCH": 2})
    assert [reasons.name(n) for n in (0, 1, 2, 12, 99, (2 << 16) | 3)] == [
        "NOT_DROPPED_YET", "CONSUMED", "NOT_SPECIFIED", "NETFILTER_DROP", "UNKNOWN_99", "OPENVSWITCH_3"]


def btf_blob(types: list[bytes], strings: list[str]) -> tuple[bytes, dict[str, int]]:
    table, offsets = b"\x00", {}
    for text in strings:
        offsets[text] = len(table)
        table += text.encode() + b"\x00"
    body = b"".join(types)
    header = struct.pack("=HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(body), len(body), len(table))
    return header + body + table, offsets


def btf_type(name: int, kind: int, vlen: int, size_or_type: int, extra: bytes = b"") -> bytes:
    return struct.pack("=III", name, kind << 24 | vlen, size_or_type) + extra


def test_the_btf_reader_finds_enums_and_tracepoints_with_their_arguments() -> None:
    names = ["skb_drop_reason", "SKB_DROP_REASON_NETFILTER_DROP", "SKB_DROP_REASON_IP_NOROUTE", "btf_trace_kfree_skb",
             "btf_trace_other", "int"]
    _, off = btf_blob([], names)
    types = [
        btf_type(off["int"], 1, 0, 4, struct.pack("=I", 32)),  # 1: int
        btf_type(off["skb_drop_reason"], 6, 2, 4, struct.pack("=IiIi", off["SKB_DROP_REASON_NETFILTER_DROP"], 12,
                                                               off["SKB_DROP_REASON_IP_NOROUTE"], 200)),  # 2
        btf_type(0, 13, 3, 0, struct.pack("=IIIIII", 0, 1, 0, 1, 0, 2)),  # 3: void (int, int, enum)
        btf_type(0, 2, 0, 3),  # 4: pointer to 3
        btf_type(off["btf_trace_kfree_skb"], 8, 0, 4),  # 5: typedef -> 4
        btf_type(0, 19, 1, 4, struct.pack("=III", off["int"], 1, 1)),  # 6: an anonymous enum64 (skipped)
        btf_type(off["btf_trace_other"], 8, 0, 1),  # 7: a typedef of no function: no tracepoint
    ]
    blob, _ = btf_blob(types, names)
    kernel = parse_btf(blob, enums=["skb_drop_reason", "absent"], tracepoints=["kfree_skb", "other", "missing"])
    assert kernel.enum("skb_drop_reason") == {"SKB_DROP_REASON_NETFILTER_DROP": 12, "SKB_DROP_REASON_IP_NOROUTE": 200}
    assert kernel.enum("absent") == {}
    assert kernel.tracepoints == {"kfree_skb": 2}
    chosen = plan(kernel, {})
    assert chosen.programs == {}  # kfree_skb with 2 arguments has no reason to read
    assert any("tcp:tcp_retransmit_skb is not in this kernel" in n for n in chosen.notices)
    assert any("fewer than podmeter reads" in n for n in chosen.notices)


def test_what_is_not_btf_is_refused() -> None:
    with pytest.raises(BtfError, match="magic"):
        parse_btf(b"\x00" * 64)
    with pytest.raises(BtfError):
        parse_btf(b"\x9f\xeb")
