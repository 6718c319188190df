"""Retina's remote-context series (``--retina-compat=remote``): keys, Retina's label values, the bounds, the
rendering; and Retina's drop series in both contexts (remote from dropped flow records, local from the
per-pod drop ledger, with its lifecycle). The whole agent with promtool is in
tests/runtime/test_metrics_retina_promtool.py."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from factories import make_pod
from podmeter.adapters.metrics.pod_drops import PodDropExposition
from podmeter.adapters.metrics.retina import render_remote, retina_context
from podmeter.model.datapath import Direction
from podmeter.model.drops import DropDrain, DropKey, DropLedger
from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_records import VERDICT_DROPPED, FlowEnd, FlowRecord
from podmeter.model.flows import TCP, Observation
from podmeter.model.retina_flows import RetinaFlows, WorkloadFlowsAndRetina, key_of, overflow_key

WEB = Endpoint("shop", "web-7d4f-abcde", "Deployment", "web", "node-a", "uid-web")
BARE = Endpoint("shop", "debug", "Pod", "debug", "node-a", "uid-debug")


def record(source: FlowEnd, destination: FlowEnd, observation: Observation = Observation.FROM_POD,
           packets: int = 1, size: int = 100, verdict: str = "forwarded", reason: str | None = None) -> FlowRecord:
    return FlowRecord(time=1.0, first=1.0, node="node-a", source=source, destination=destination, protocol=TCP,
                      observation=observation, packets=packets, bytes=size, tcp_flags=0, verdict=verdict,
                      drop_reason=reason)


def dropped(source: FlowEnd, destination: FlowEnd, reason: str, observation: Observation = Observation.FROM_POD,
            packets: int = 1, size: int = 100) -> FlowRecord:
    return record(source, destination, observation, packets, size, VERDICT_DROPPED, reason)


def test_label_values_are_retinas_with_unknown_where_it_writes_it() -> None:
    key = key_of(record(FlowEnd("10.0.0.1", 4000, WEB), FlowEnd("203.0.113.9", 443)))
    assert key.direction == "EGRESS"
    assert key.source == ("10.0.0.1", "shop", "web-7d4f-abcde", "Deployment", "web")
    assert key.destination == ("203.0.113.9", "unknown", "unknown", "unknown", "unknown")
    bare = key_of(record(FlowEnd("10.0.0.1", 4000, WEB), FlowEnd("10.0.0.2", 80, BARE), Observation.TO_POD))
    assert bare.direction == "INGRESS"
    assert bare.destination == ("10.0.0.2", "shop", "debug", "unknown", "unknown")  # no controller


def test_every_forwarded_record_counts_and_dropped_ones_do_not() -> None:
    flows = RetinaFlows(limit=10, idle=60)
    web, world = FlowEnd("10.0.0.1", 4000, WEB), FlowEnd("203.0.113.9", 443)
    flows.add([record(web, world, packets=2, size=200), record(web, world, packets=3, size=300),
               record(web, world, packets=9, verdict=VERDICT_DROPPED)], now=1.0)
    ((_, traffic),) = flows.values()
    assert (traffic.packets, traffic.bytes) == (5, 500)


def test_the_series_limit_folds_new_keys_into_one_overflow_key_per_direction_and_counts_them() -> None:
    flows = RetinaFlows(limit=2, idle=60)
    web = FlowEnd("10.0.0.1", 4000, WEB)
    flows.add([record(web, FlowEnd(f"203.0.113.{i}", 443)) for i in range(5)], now=1.0)
    flows.add([record(web, FlowEnd("203.0.113.7", 443), Observation.TO_POD)], now=1.0)
    assert len(flows.keys) == 4  # two of their own, one overflow key per direction
    assert flows.keys[overflow_key("EGRESS")].packets == 3
    assert flows.keys[overflow_key("INGRESS")].packets == 1
    assert flows.folded == 4


def test_an_idle_key_goes_and_its_slot_is_free_again() -> None:
    flows = RetinaFlows(limit=1, idle=10)
    web = FlowEnd("10.0.0.1", 4000, WEB)
    flows.add([record(web, FlowEnd("203.0.113.1", 443))], now=0.0)
    flows.add([record(web, FlowEnd("203.0.113.2", 443))], now=5.0)  # over the limit: folded
    assert flows.expire(now=10.0) == 1  # the first key was idle 10 s; the overflow key 5 s
    flows.add([record(web, FlowEnd("203.0.113.3", 443))], now=11.0)
    assert key_of(record(web, FlowEnd("203.0.113.3", 443))) in flows.keys  # its own series, not folded
    assert flows.expire(now=100.0) == 2
    assert flows.keys == {}


def test_the_workload_pairs_and_retinas_keys_see_the_same_records_and_expire_together() -> None:
    both = WorkloadFlowsAndRetina("node-a", limit=10, idle=10)
    both.add(iter([record(FlowEnd("10.0.0.1", 4000, WEB), FlowEnd("203.0.113.9", 443))]), now=0.0)
    assert len(both.pairs) == 1 and len(both.retina.keys) == 1
    both.expire(now=20.0)
    assert both.pairs == {} and both.retina.keys == {}


def test_rendering_writes_retinas_names_as_counters_and_escapes_values() -> None:
    flows = RetinaFlows(limit=10, idle=60)
    odd = Endpoint("shop", "web", "Deployment", 'we"b', "node-a")
    flows.add([record(FlowEnd("10.0.0.1", 4000, odd), FlowEnd("203.0.113.9", 443), packets=2, size=80)], now=1.0)
    text = render_remote(flows).decode()
    assert "# TYPE networkobservability_adv_forward_count counter" in text
    assert "# TYPE networkobservability_adv_forward_bytes counter" in text
    labels = ('{destination_ip="203.0.113.9",destination_namespace="unknown",destination_podname="unknown",'
              'destination_workload_kind="unknown",destination_workload_name="unknown",direction="EGRESS",'
              'source_ip="10.0.0.1",source_namespace="shop",source_podname="web",source_workload_kind="Deployment",'
              'source_workload_name="we\\"b"}')
    assert f"networkobservability_adv_forward_count{labels} 2\n" in text
    assert f"networkobservability_adv_forward_bytes{labels} 80\n" in text
    assert "podmeter_retina_flow_series 1\n" in text


# --- Retina's drop series -------------------------------------------------------------------------------


def test_dropped_records_make_drop_keys_with_retinas_reason_where_it_is_exact_else_the_kernels() -> None:
    drops = RetinaFlows(limit=10, idle=60, verdict=VERDICT_DROPPED)
    web, db, world = FlowEnd("10.0.0.1", 4000, WEB), FlowEnd("10.0.0.2", 5432, BARE), FlowEnd("203.0.113.9", 443)
    drops.add([dropped(web, db, "NETFILTER_DROP", packets=2, size=120),
               dropped(world, web, "NO_SOCKET", Observation.TO_POD, size=60),
               record(web, db, packets=7)], now=1.0)  # forwarded: not a drop
    assert {(key.direction, key.reason, key.source[2], key.destination[2]): (t.packets, t.bytes)
            for key, t in drops.values()} == {("EGRESS", "IPTABLE_RULE_DROP", "web-7d4f-abcde", "debug"): (2, 120),
                                             ("INGRESS", "NO_SOCKET", "unknown", "web-7d4f-abcde"): (1, 60)}
    forward = RetinaFlows(limit=10, idle=60)
    forward.add([dropped(web, db, "NETFILTER_DROP")], now=1.0)
    assert forward.keys == {}  # and a drop is no forwarded traffic


def test_drop_keys_beyond_the_limit_fold_into_an_overflow_key_whose_reason_is_other_too() -> None:
    drops = RetinaFlows(limit=1, idle=60, verdict=VERDICT_DROPPED)
    web = FlowEnd("10.0.0.1", 4000, WEB)
    drops.add([dropped(web, FlowEnd(f"203.0.113.{i}", 443), f"REASON_{i}") for i in range(4)], now=1.0)
    assert len(drops.keys) == 2 and drops.folded == 3
    assert drops.keys[overflow_key("EGRESS", dropped=True)].packets == 3
    assert overflow_key("EGRESS", dropped=True).reason == "_other_"


def test_remote_drop_series_are_gauges_with_reason_between_direction_and_the_source() -> None:
    flows, drops = RetinaFlows(limit=10, idle=60), RetinaFlows(limit=10, idle=60, verdict=VERDICT_DROPPED)
    drops.add([dropped(FlowEnd("10.0.0.1", 4000, WEB), FlowEnd("203.0.113.9", 443), "NETFILTER_DROP", size=80)],
              now=1.0)
    text = render_remote(flows, drops).decode()
    assert "# TYPE networkobservability_adv_drop_count gauge" in text
    assert "# TYPE networkobservability_adv_drop_bytes gauge" in text
    labels = ('{destination_ip="203.0.113.9",destination_namespace="unknown",destination_podname="unknown",'
              'destination_workload_kind="unknown",destination_workload_name="unknown",direction="EGRESS",'
              'reason="IPTABLE_RULE_DROP",source_ip="10.0.0.1",source_namespace="shop",'
              'source_podname="web-7d4f-abcde",source_workload_kind="Deployment",source_workload_name="web"}')
    assert f"networkobservability_adv_drop_count{labels} 1\n" in text
    assert f"networkobservability_adv_drop_bytes{labels} 80\n" in text
    assert "podmeter_retina_drop_series 1\n" in text and "podmeter_retina_drop_series_folded_total 0\n" in text
    both = WorkloadFlowsAndRetina("node-a", limit=10, idle=10)
    both.retina_drops.add([dropped(FlowEnd("10.0.0.1", 4000, WEB), FlowEnd("203.0.113.9", 443), "X")], now=0.0)
    both.expire(now=20.0)
    assert both.retina_drops.keys == {}  # idle, gone at the same tick as the forward series


def drain(*drops: tuple[str, Direction, str, int, int]) -> DropDrain:
    return DropDrain([(DropKey(ip, d, r), n) for ip, d, r, n, _ in drops], [], [], [],
                     [(DropKey(ip, d, r), size) for ip, d, r, _, size in drops])


def test_local_drop_series_are_the_ledgers_per_pod_drops_in_retinas_labels_through_grace_then_gone() -> None:
    ledger = DropLedger(grace=10)
    web = msgspec.structs.replace(make_pod("web-7d4f-abcde", "shop", ips=("10.0.0.1",), observe=True),
                                  owner_kind="StatefulSet", owner_name="web")
    reuser = make_pod("next", "shop", ips=("10.0.0.1",), observe=True)
    ledger.assign("10.0.0.1", web, now=0)
    ledger.add(drain(("10.0.0.1", Direction.EGRESS, "NETFILTER_DROP", 2, 120),
                     ("10.0.0.1", Direction.INGRESS, "NO_SOCKET", 1, 60)))
    exposition = PodDropExposition(ledger, lambda: {}, retina_compat=True)
    exposition.render()  # a scrape while web holds the IP: its series' labels, kept through its grace
    ledger.assign("10.0.0.1", reuser, now=5)  # the IP passes on: what the drain at the change takes is web's
    ledger.add(drain(("10.0.0.1", Direction.EGRESS, "NETFILTER_DROP", 1, 40)))
    ledger.add(drain(("10.0.0.1", Direction.EGRESS, "NETFILTER_DROP", 1, 30)))  # counted since: the reuser's
    text = exposition.render().decode()
    assert "# TYPE networkobservability_adv_drop_count gauge" in text
    web_egress = ('{direction="egress",ip="10.0.0.1",namespace="shop",podname="web-7d4f-abcde",'
                  'reason="IPTABLE_RULE_DROP",workload_kind="StatefulSet",workload_name="web"}')
    assert f"networkobservability_adv_drop_count{web_egress} 3\n" in text
    assert f"networkobservability_adv_drop_bytes{web_egress} 160\n" in text
    web_ingress = web_egress.replace("egress", "ingress").replace("IPTABLE_RULE_DROP", "NO_SOCKET")
    assert f"networkobservability_adv_drop_bytes{web_ingress} 60\n" in text
    assert ('networkobservability_adv_drop_bytes{direction="egress",ip="10.0.0.1",namespace="shop",podname="next",'
            'reason="IPTABLE_RULE_DROP",workload_kind="unknown",workload_name="unknown"} 30\n' in text)
    assert ledger.expire(now=14) == 0 and 'podname="web-7d4f-abcde"' in exposition.render().decode()  # in grace
    assert ledger.expire(now=15) == 1
    assert 'podname="web-7d4f-abcde"' not in exposition.render().decode()
    plain = PodDropExposition(ledger, lambda: {}).render().decode()
    assert "networkobservability_" not in plain and "podmeter_pod_drops_total{" in plain


@pytest.mark.parametrize(("value", "mode"), [("local", "local"), ("REMOTE", "remote"), ("true", "local"),
                                             ("1", "local"), ("off", None), ("false", None)])
def test_the_option_takes_retinas_context_names_and_the_old_boolean(value: str, mode: str | None) -> None:
    assert retina_context(value) == mode


def test_any_other_value_is_a_clear_error() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="must be local or remote"):
        retina_context("both")
