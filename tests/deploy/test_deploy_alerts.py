"""Alerts and dashboards as users install them (deploy/components/alerts, deploy/dashboards).

The PrometheusRule is checked by Debian's promtool (``promtool check rules``: syntax, PromQL, templates),
and its alerts are run by ``promtool test rules`` on made-up series (each fires when it should, and not
before, and a healthy cluster fires nothing). The dashboards are ConfigMaps for Grafana's sidecar,
generated from every deploy/dashboards/*.json; their queries are PromQL that promtool accepts (as
recording rules) and name only series docs/metrics.md documents.
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

from deploy_support import DEPLOY, ROOT, Obj, find, needs_kubectl, render

pytestmark = needs_kubectl

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
OVERLAY = "overlays/prometheus-operator"
# What docs/metrics.md documents: podmeter_* names (a family's _total spelled out), process_* (the standard
# process collector) and Prometheus's own up.
DOCUMENTED = set(re.findall(r"\b(podmeter_[a-z0-9_]+)", (ROOT / "docs" / "metrics.md").read_text()))
REQUIRED_ALERTS = {
    "PodmeterFilterOverflow", "PodmeterDriftRepaired", "PodmeterIdentityExhausted", "PodmeterIdentityBackendErrors",
    "PodmeterAgentNotReady", "PodmeterFlowsLost", "PodmeterFlowFollowersCutOff", "PodmeterTaskFailed",
}


def rule_groups() -> list[dict[str, Any]]:
    rule = find(render(OVERLAY), "PrometheusRule", "podmeter")
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for group in rule_groups() for r in group["rules"]}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def series_names(expr: str) -> set[str]:
    """The metric names an expression selects (podmeter_*, process_*, up), not its functions or labels."""
    without_labels = re.sub(r"\{[^}]*\}", "", expr)
    return set(re.findall(r"\b((?:podmeter|process)_[a-z0-9_]+|up)\b(?!\s*\()", without_labels))


def undocumented(names: set[str]) -> set[str]:
    return {n for n in names if not (n in DOCUMENTED or n.startswith("process_") or n == "up")}


# --- the PrometheusRule ---------------------------------------------------------------------------------------


def test_the_alerts_are_installed_by_the_prometheus_operator_overlay() -> None:
    assert set(alerts()) >= REQUIRED_ALERTS
    rule = find(render(OVERLAY), "PrometheusRule", "podmeter")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["namespace"] == "podmeter"
    for name, alert in alerts().items():
        assert alert["labels"]["severity"] in ("info", "warning", "critical"), name
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], name


@needs_promtool
def test_promtool_accepts_every_rule(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}))
    result = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_the_alerts_name_only_documented_series() -> None:
    for name, alert in alerts().items():
        names = series_names(alert["expr"])
        assert names, name
        assert not undocumented(names), f"{name}: {sorted(undocumented(names))} are not in docs/metrics.md"


AGENT = 'component="agent",node="n1",instance="10.0.0.1:9978",job="podmeter-agent"'
OPERATOR = 'component="operator",pod="op-a",instance="10.1.0.5:9979",job="podmeter-operator"'
# promtool test rules: made-up series (one sample a minute), and the alerts expected at a time.
CASES: list[dict[str, Any]] = [
    {"series": {f"podmeter_filter_overflow{{{AGENT}}}": "0 0 0 4x30"},
     "expect": [("PodmeterFilterOverflow", "5m", False), ("PodmeterFilterOverflow", "20m", True)]},
    {"series": {f"podmeter_ready{{{AGENT}}}": "1 1 0x30", f"podmeter_ready{{{OPERATOR}}}": "1x32"},
     "expect": [("PodmeterAgentNotReady", "8m", False), ("PodmeterAgentNotReady", "20m", True),
                ("PodmeterOperatorNotReady", "20m", False)]},
    {"series": {f'up{{{AGENT}}}': "1 1 0x20"},
     "expect": [("PodmeterAgentDown", "3m", False), ("PodmeterAgentDown", "10m", True)]},
    {"series": {f'podmeter_drift_repaired_total{{{AGENT},kind="leaked"}}': "0 0 0 3x10"},
     "expect": [("PodmeterDriftRepaired", "2m", False), ("PodmeterDriftRepaired", "5m", True)]},
    {"series": {f"podmeter_pods_without_link{{{AGENT}}}": "0 2x30"},
     "expect": [("PodmeterPodsWithoutLink", "10m", False), ("PodmeterPodsWithoutLink", "20m", True)]},
    {"series": {f"podmeter_flows_lost_packets_total{{{AGENT}}}": "0 0 100 200x10"},
     "expect": [("PodmeterFlowsLost", "1m", False), ("PodmeterFlowsLost", "4m", True)]},
    {"series": {f"podmeter_flow_followers_cut_off_total{{{AGENT}}}": "0 0 1x10"},
     "expect": [("PodmeterFlowFollowersCutOff", "4m", True)]},
    {"series": {f"podmeter_identity_exhausted{{{OPERATOR}}}": "0 0 1x20"},
     "expect": [("PodmeterIdentityExhausted", "4m", False), ("PodmeterIdentityExhausted", "10m", True)]},
    {"series": {f'podmeter_identity_errors_total{{{OPERATOR},op="acquire",reason="backend"}}': "0+5x30",
                f'podmeter_identity_errors_total{{{OPERATOR},op="acquire",reason="exhausted"}}': "0+5x30"},
     "expect": [("PodmeterIdentityBackendErrors", "8m", False), ("PodmeterIdentityBackendErrors", "20m", True)]},
    {"series": {f"podmeter_leader{{{OPERATOR}}}": "1x20",
                'podmeter_leader{component="operator",pod="op-b",instance="10.1.0.6:9979",job="podmeter-operator"}':
                    "0x20"},
     "expect": [("PodmeterNoLeader", "10m", False)]},
    {"series": {f"podmeter_leader{{{OPERATOR}}}": "0x20"},  # both gone or none leading: 0, not "no data"
     "expect": [("PodmeterNoLeader", "10m", True)]},
    {"series": {f"podmeter_configuration_valid{{{OPERATOR}}}": "1 0x10"},
     "expect": [("PodmeterConfigurationInvalid", "8m", True)]},
    # A task died: the process exited and was restarted (a new start time on the same target); the
    # failure counter itself lived for milliseconds and was never scraped.
    {"series": {f"process_start_time_seconds{{{OPERATOR}}}": "1000x5 1400x25"},
     "expect": [("PodmeterTaskFailed", "4m", False), ("PodmeterTaskFailed", "7m", True),
                ("PodmeterTaskFailed", "25m", False)]},  # 15 minutes without a restart: resolved
    {"series": {f"process_start_time_seconds{{{AGENT}}}": "1000 1100 1200 1300x10"},
     "expect": [("PodmeterTaskFailed", "3m", True)]},
]


def _promtool_case(case: dict[str, Any]) -> dict[str, Any]:
    tests = []
    for alertname, at, fires in case["expect"]:
        expected: list[dict[str, Any]] = []
        if fires:
            expected = [{"exp_labels": {}}]  # filled below from the alert's labels and the series'
        tests.append({"eval_time": at, "alertname": alertname, "exp_alerts": expected})
    return {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in case["series"].items()],
            "alert_rule_test": tests}


@needs_promtool
@pytest.mark.parametrize("case", CASES, ids=lambda c: "+".join(sorted({a for a, _, _ in c["expect"]})))
def test_each_alert_fires_when_it_should_and_not_before(tmp_path: Path, case: dict[str, Any]) -> None:
    groups = rule_groups()
    for group in groups:  # annotations are checked by promtool check rules; here: expressions, for, labels
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    test = _promtool_case(case)
    rules = alerts()
    for expectation in test["alert_rule_test"]:
        for alert in expectation["exp_alerts"]:
            alert["exp_labels"] = expected_labels(rules[expectation["alertname"]], case["series"])
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": [test]}))
    result = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def expected_labels(rule: dict[str, Any], series: dict[str, str]) -> dict[str, str]:
    """The labels the alert carries: the rule's, plus those its expression keeps of the series it fires on
    (all of them, those of a ``sum by (...)``, or none for a sum over everything)."""
    labels = dict(rule["labels"])
    expr = rule["expr"]
    if re.match(r"\(?sum\(", expr):
        return labels
    kept = re.match(r"sum by \(([^)]*)\)", expr)
    (name,) = series_names(expr)
    matchers = dict(re.findall(r'(\w+)="([^"]*)"', expr))
    for text in series:
        found = dict(re.findall(r'(\w+)="([^"]*)"', text))
        if not text.startswith(name + "{") or any(found.get(k) != v for k, v in matchers.items()):
            continue
        if kept:
            found = {k: v for k, v in found.items() if k in {x.strip() for x in kept.group(1).split(",")}}
        labels.update(found)
        return labels
    raise AssertionError(f"no series for {name}")


def test_every_required_alert_has_a_case() -> None:
    tested = {alert for case in CASES for alert, _, fires in case["expect"] if fires}
    assert tested >= REQUIRED_ALERTS


@needs_promtool
def test_a_healthy_cluster_fires_no_alert(tmp_path: Path) -> None:
    healthy = {
        f"up{{{AGENT}}}": "1x30", f"podmeter_ready{{{AGENT}}}": "1x30", f"podmeter_ready{{{OPERATOR}}}": "1x30",
        f"podmeter_filter_overflow{{{AGENT}}}": "0x30", f"podmeter_pods_without_link{{{AGENT}}}": "0x30",
        f'podmeter_drift_repaired_total{{{AGENT},kind="leaked"}}': "0x30",
        f"podmeter_flows_lost_packets_total{{{AGENT}}}": "0x30",
        f"podmeter_flow_followers_cut_off_total{{{AGENT}}}": "0x30",
        f"podmeter_identity_exhausted{{{OPERATOR}}}": "0x30", f"podmeter_leader{{{OPERATOR}}}": "1x30",
        f'podmeter_identity_errors_total{{{OPERATOR},op="acquire",reason="backend"}}': "0x30",
        f"podmeter_configuration_valid{{{OPERATOR}}}": "1x30",
        f"process_start_time_seconds{{{AGENT}}}": "1000x30", f"process_start_time_seconds{{{OPERATOR}}}": "2000x30",
    }
    groups = rule_groups()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    test = {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in healthy.items()],
            "alert_rule_test": [{"eval_time": "30m", "alertname": name, "exp_alerts": []} for name in alerts()]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": [test]}))
    result = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the dashboards -----------------------------------------------------------------------------------------


DASHBOARDS = sorted((DEPLOY / "dashboards").glob("*.json"))


def dashboard_configmaps() -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in render(OVERLAY)
            if o["kind"] == "ConfigMap" and o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"}


def test_every_dashboard_is_a_configmap_for_the_grafana_sidecar() -> None:
    maps = dashboard_configmaps()
    files = {next(iter(m["data"])): m for m in maps.values()}
    assert set(files) == {p.name for p in DASHBOARDS}  # every JSON file here, and only those
    uids = set()
    for path in DASHBOARDS:
        config = files[path.name]
        assert config["metadata"]["namespace"] == "podmeter"
        assert config["metadata"]["name"] == f"podmeter-dashboard-{path.stem}"  # no hash: an update replaces it
        assert config["data"][path.name] == path.read_text()
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"].startswith("podmeter-") and dashboard["title"].startswith("podmeter / ")
        uids.add(dashboard["uid"])
        assert {"name": "datasource", "type": "datasource", "query": "prometheus", "current": {}} in \
            dashboard["templating"]["list"]
    assert len(uids) == len(DASHBOARDS)
    assert {"pod-traffic.json", "operator.json"} <= set(files)


def queries(dashboard: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if t.get("expr")]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        text = query.get("query") if isinstance(query, dict) else None
        if variable.get("type") == "query" and text:
            out.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", text))  # the series it reads
    return out


GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def as_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)  # dashboard variables: a regex that matches all


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_queries_name_only_documented_series(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    found = queries(dashboard)
    assert found
    for expr in found:
        names = series_names(expr)
        assert names, expr
        assert not undocumented(names), f"{path.name}: {sorted(undocumented(names))} are not in docs/metrics.md"


@needs_promtool
@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_promtool_accepts_every_dashboard_query(tmp_path: Path, path: Path) -> None:
    """Each query as the expression of a recording rule, Grafana's variables filled in."""
    rules = [{"record": f"podmeter:dashboard_query_{n}", "expr": as_promql(expr)}
             for n, expr in enumerate(queries(json.loads(path.read_text())))]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": path.stem, "rules": rules}]}))
    result = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_operator_dashboard_shows_leadership_and_identities() -> None:
    dashboard = json.loads((DEPLOY / "dashboards" / "operator.json").read_text())
    names = set().union(*(series_names(e) for e in queries(dashboard)))
    assert {"podmeter_leader", "podmeter_identities", "podmeter_identity_pending", "podmeter_identity_exhausted",
            "podmeter_identity_errors_total", "podmeter_configuration_valid", "podmeter_published_endpoints"} <= names


def test_the_servicemonitor_keeps_the_pods_own_labels() -> None:
    """Without honorLabels the per-pod series' namespace and pod would become exported_namespace and
    exported_pod, and the dashboards' and alerts' selectors would read the agent's own pod instead."""
    monitor = find(render(OVERLAY), "ServiceMonitor", "podmeter")
    assert all(endpoint.get("honorLabels") is True for endpoint in monitor["spec"]["endpoints"])
    relabeled = {r["targetLabel"] for e in monitor["spec"]["endpoints"] for r in e.get("relabelings", [])}
    uses = set().union(*(set(re.findall(r"\$labels\.(\w+)", json.dumps(a))) for a in alerts().values()))
    uses |= set().union(*(set(re.findall(r'(\w+)="', a["expr"])) for a in alerts().values()))
    assert {"node", "component"} <= relabeled
    assert uses <= relabeled | {"instance", "job", "pod", "kind", "task", "map", "op", "reason"}
