"""Drops and TCP health without a kernel, beyond the model (tests/model/test_drop_model.py): attribution
through the agent's writer task, the exposition and the dashboard, the verdict filter of ``/debug/flows``,
``podmeter observe``, reason names and the BTF reader on synthetic BTF."""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from flow_support import drain_of, drops_of, pod
from podmeter.adapters.datapath.ebpf.btf import BtfError, parse_btf
from podmeter.adapters.datapath.ebpf.drops import DropReasons, plan
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.flow_http import BadQuery, parse_query
from podmeter.adapters.metrics.pod_drops import PodDropExposition
from podmeter.adapters.metrics.retina import render_remote
from podmeter.model.datapath import Direction
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Delete, Replace, Upsert
from podmeter.model.drops import HOOKS, DropDrain, DropFlowKey, DropKey, DropLedger, TcpEvent, name_drops
from podmeter.model.endpoints import AddressBook
from podmeter.model.flows import TCP, UDP, FlowCounts
from podmeter.model.retina_flows import WorkloadFlowsAndRetina
from podmeter.runtime.agent import Agent, AgentSettings
from podmeter.runtime.ticks import Tick

IN, OUT = Direction.INGRESS, Direction.EGRESS


# --- through the agent ---------------------------------------------------------------------------------


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
        self.pending.drop_bytes.append((DropKey(ip, direction, reason), packets * 60))

    def flow(self, source: str, destination: str, reason: str, packets: int) -> None:
        key = DropFlowKey(source, destination, 40000, 80, TCP, True, True, reason)
        self.pending.flows.append((key, FlowCounts(packets, packets * 60, time.monotonic_ns(), time.monotonic_ns(), 0)))

    def drain_drops(self) -> DropDrain:
        taken, self.pending = self.pending, DropDrain()
        return taken

    def drops_lost(self) -> Mapping[str, int]:
        return self.lost

def agent_with(drops: FakeDrops, **settings: bool | str) -> Agent:
    datapath = MemoryDatapath()
    agent = Agent(AgentSettings(node_name="node-a", **settings), connection=None,  # type: ignore[arg-type]
                  datapath=datapath, flows=datapath, drops=drops)
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

@pytest.mark.parametrize("include", [False, True], ids=["default", "drops-include-lifecycle"])
def test_queue_purge_is_kept_out_of_the_drop_series_and_the_dropped_flows(include: bool) -> None:
    """Through the agent's drain: a connection closed with unread data (QUEUE_PURGE at both ends) next to a
    real loss (NETFILTER_DROP). By default the purge is in the lifecycle series only: not in the drop
    series, not in Retina's (local and remote), not a dropped flow; --drops-include-lifecycle shows it as
    a drop, as before."""
    drops = FakeDrops()
    agent = agent_with(drops, retina_compat="remote", drops_include_lifecycle=include)
    agent.apply_batch([Upsert(PODS, pod("client", "10.0.0.1")), Upsert(PODS, pod("server", "10.0.0.2"))])
    drops.drop("10.0.0.1", OUT, "QUEUE_PURGE", 3)
    drops.drop("10.0.0.2", IN, "QUEUE_PURGE", 3)
    drops.flow("10.0.0.1", "10.0.0.2", "QUEUE_PURGE", 3)
    drops.drop("10.0.0.1", OUT, "NETFILTER_DROP", 2)
    drops.drop("10.0.0.2", IN, "NETFILTER_DROP", 2)
    drops.flow("10.0.0.1", "10.0.0.2", "NETFILTER_DROP", 2)
    agent.apply_batch([Tick.DRAIN])
    assert agent.drops is not None

    text = PodDropExposition(agent.drop_ledger, lambda: dict.fromkeys(HOOKS, True), retina_compat=True).render()
    samples = [line for line in text.decode().splitlines() if not line.startswith("#")]
    flows = agent.workload_flows
    assert isinstance(flows, WorkloadFlowsAndRetina)
    remote = [line for line in render_remote(flows.retina, flows.retina_drops).decode().splitlines()
              if line.startswith("networkobservability_adv_drop_count")]
    dropped = [record for _, record in agent.flow_feed.ring.after(0) if record.verdict == "dropped"]
    lifecycle = {'podmeter_pod_lifecycle_drops_total{namespace="default",pod="client",direction="egress",'
                 'reason="QUEUE_PURGE"} 3',
                 'podmeter_pod_lifecycle_drops_total{namespace="default",pod="server",direction="ingress",'
                 'reason="QUEUE_PURGE"} 3',
                 'podmeter_node_lifecycle_drops_total{direction="egress",reason="QUEUE_PURGE"} 3',
                 'podmeter_node_lifecycle_drops_total{direction="ingress",reason="QUEUE_PURGE"} 3'}
    as_drops = {'podmeter_pod_drops_total{namespace="default",pod="client",direction="egress",reason="QUEUE_PURGE"} 3',
                'podmeter_pod_drops_total{namespace="default",pod="server",direction="ingress",reason="QUEUE_PURGE"} 3',
                'podmeter_node_drops_total{direction="ingress",reason="QUEUE_PURGE"} 3'}
    # The real loss is shown either way.
    assert 'podmeter_pod_drops_total{namespace="default",pod="server",direction="ingress",reason="NETFILTER_DROP"} 2' \
        in samples
    assert any('reason="IPTABLE_RULE_DROP"' in line and line.startswith("networkobservability_adv_drop_count")
               for line in samples)
    assert any('reason="IPTABLE_RULE_DROP"' in line for line in remote)
    purges = [line for line in samples if "QUEUE_PURGE" in line]
    if not include:
        assert set(purges) == lifecycle
        assert not [line for line in remote if "QUEUE_PURGE" in line]
        assert [(r.drop_reason, r.packets) for r in dropped] == [("NETFILTER_DROP", 2)]
    else:
        assert as_drops <= set(purges) and not lifecycle & set(purges)
        assert not [line for line in purges if "lifecycle" in line]
        assert any(line.startswith("networkobservability_adv_drop_count") for line in purges)  # Retina's local
        assert [line for line in remote if "QUEUE_PURGE" in line]
        assert sorted((r.drop_reason or "", r.packets) for r in dropped) == [("NETFILTER_DROP", 2), ("QUEUE_PURGE", 3)]

def test_the_agent_flag_sets_the_setting_and_defaults_to_apart() -> None:
    from podmeter.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["agent", "--node-name", "n"])
    assert args.drops_include_lifecycle is AgentSettings.drops_include_lifecycle is False
    assert parser.parse_args(["agent", "--node-name", "n", "--drops-include-lifecycle"]).drops_include_lifecycle

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


# --- the verdict filter and observe --------------------------------------------------------------------


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


# --- reasons and BTF -----------------------------------------------------------------------------------


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
