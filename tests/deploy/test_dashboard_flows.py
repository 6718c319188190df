"""The flow panels of the pod-traffic dashboard against the series the agent really exports.

The names and labels come from the agent's own exposition code (rendered and parsed, not spelled out
here again): the panels exist, read only series and labels the agent exports, and a namespace picked in
the dashboard selects pairs with either end in it. promtool evaluates the pair panels' queries on
made-up series: traffic out of, into and within the namespace each shows once (a pair within it is
selected by both sides and must not count twice), other namespaces' traffic not at all.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deploy_support import DEPLOY
from podmeter.adapters.metrics.agent_state import AgentSnapshot, AgentStateCollector, FlowSnapshot
from podmeter.adapters.metrics.flow_traffic import render_workload_flows
from podmeter.model.endpoints import AddressBook
from podmeter.model.flow_records import name_flows
from podmeter.model.flow_series import WorkloadFlows
from podmeter.model.flows import TCP, FlowCounts, FlowKey, Observation

DASHBOARD = DEPLOY / "dashboards" / "pod-traffic.json"
PAIR_PANELS = ("Top workload pairs by bytes/s (flows)", "Workload pairs, bytes in the range")
PROMTOOL = shutil.which("promtool")
FLOW_NAME = re.compile(r"_flows?_")  # the flow pipeline's names (not podmeter_filter_overflow)


def workload_series() -> dict[str, set[str]]:
    """The workload-pair samples' names and label names, as the agent's exposition renders one pair."""
    from factories import make_pod

    book = AddressBook([make_pod("web", "shop", ips=("10.0.0.1",))])
    entry = (FlowKey("10.0.0.1", "8.8.8.8", 40000, 443, TCP, Observation.FROM_POD), FlowCounts(1, 60, 0, 0, 0))
    flows = WorkloadFlows("node-a", limit=10, idle=60.0)
    flows.add(name_flows([entry], book, "node-a", 0.0), now=0.0)
    text = render_workload_flows(flows).decode()
    return {s.name: set(s.labels) for f in text_string_to_metric_families(text) for s in f.samples}


def flow_state_series() -> set[str]:
    """The flow pipeline's sample names, as the agent's state collector exposes them."""
    registry = CollectorRegistry()
    registry.register(AgentStateCollector(lambda: AgentSnapshot(flows=FlowSnapshot())))
    text = generate_latest(registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples
            if FLOW_NAME.search(s.name) and not s.name.endswith("_created")}


def panels() -> dict[str, list[str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return {p["title"]: [t["expr"] for t in p.get("targets", []) if t.get("expr")] for p in dashboard["panels"]}


def names_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(podmeter_[a-z0-9_]+)", expr))


def test_the_flow_panels_read_only_series_and_labels_the_agent_exports() -> None:
    pairs, state = workload_series(), flow_state_series()
    assert {"podmeter_workload_flow_bytes_total", "podmeter_workload_flow_packets_total"} == set(pairs)
    exported = set(pairs) | state
    used = {n for exprs in panels().values() for e in exprs for n in names_in(e) if FLOW_NAME.search(n)}
    assert used <= exported, f"the dashboard reads {sorted(used - exported)}, which the agent does not export"
    assert "podmeter_workload_flow_series_folded_total" in used  # the overflow series' counter is shown
    labels = set().union(*pairs.values())
    for title in PAIR_PANELS:
        [expr] = panels()[title]
        assert names_in(expr) <= set(pairs), title
        grouped = re.search(r"sum by \(([^)]*)\)", expr)
        assert grouped is not None, expr
        assert {g.strip() for g in grouped.group(1).split(",")} <= labels, title
        assert set(re.findall(r"(\w+)=~", expr)) <= labels, title


def test_a_picked_namespace_selects_pairs_with_either_end_in_it() -> None:
    for title in PAIR_PANELS:
        [expr] = panels()[title]
        for side in ("source", "destination"):
            assert f'{side}_namespace=~"$namespace"' in expr, (title, side)


# --- evaluated by promtool ------------------------------------------------------------------------------


def series(source: str, destination: str, instance: str) -> str:
    (sns, swl), (dns, dwl) = source.split("/"), destination.split("/")
    return (f'podmeter_workload_flow_bytes_total{{source_namespace="{sns}",source_workload_kind="Deployment",'
            f'source_workload="{swl}",destination_namespace="{dns}",destination_workload_kind="Deployment",'
            f'destination_workload="{dwl}",protocol="TCP",instance="{instance}",job="podmeter"}}')


# (source, destination, node) -> bytes per second; every node counts its own share of a pair
TRAFFIC = {
    ("shop/web", "shop/db", "node-a"): 10, ("shop/web", "shop/db", "node-b"): 10,  # within the namespace
    ("front/api", "shop/db", "node-a"): 3,  # into it
    ("shop/web", "pay/gateway", "node-b"): 5,  # out of it
    ("front/api", "pay/gateway", "node-a"): 7,  # elsewhere
}
SHOWN = {("shop/web", "shop/db"): 20, ("front/api", "shop/db"): 3, ("shop/web", "pay/gateway"): 5}


def as_promql(expr: str, namespace: str) -> str:
    for variable, value in {"$__rate_interval": "5m", "$__range": "1h", "$namespace": namespace}.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, expr
    return expr


def expected(per_second: dict[tuple[str, str], int], seconds: int) -> list[dict[str, Any]]:
    out = []
    for (source, destination), rate in per_second.items():
        (sns, swl), (dns, dwl) = source.split("/"), destination.split("/")
        out.append({"labels": f'{{source_namespace="{sns}",source_workload="{swl}",destination_namespace="{dns}",'
                              f'destination_workload="{dwl}",protocol="TCP"}}', "value": rate * seconds})
    return out


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
def test_the_pair_panels_show_traffic_out_of_into_and_within_the_namespace_once(tmp_path: Path) -> None:
    rate_expr, range_expr = (panels()[title][0] for title in PAIR_PANELS)
    inputs = [{"series": series(s, d, node), "values": f"0+{rate * 60}x70"} for (s, d, node), rate in TRAFFIC.items()]
    checks = [
        {"expr": as_promql(rate_expr, "shop"), "eval_time": "65m", "exp_samples": expected(SHOWN, 1)},
        # over the last hour, from 5m to 65m: 3600 s of each rate
        {"expr": as_promql(range_expr, "shop"), "eval_time": "65m", "exp_samples": expected(SHOWN, 3600)},
        # a namespace with no traffic at all: nothing, not the other namespaces' pairs
        {"expr": as_promql(rate_expr, "quiet"), "eval_time": "65m", "exp_samples": []},
    ]
    (tmp_path / "empty.yaml").write_text("groups: []\n")
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({
        "rule_files": ["empty.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": checks}],
    }))
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "test", "rules", "tests.yaml"], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
