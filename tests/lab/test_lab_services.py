"""The lab through a real Service: the shipped ``services`` scenario passes with the eBPF datapath. The lab's
API server allocates the ClusterIP, its EndpointSlice controller lists the ready backends, the node's
Service proxy rewrites each connection to one of them, and every measured connection's record names the
Service and the backend that served it (the backends' own account); a replica added between the two steps
serves too; nginx with curl and redis-server with redis-benchmark through Services, every byte they
counted in the agent's records. Without the proxy (a real kube-proxy's job) the step says it is skipped.

Root only (namespaces, veths, nftables, bpffs), like tests/lab/test_lab_run.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from podmeter.cli.lab import failed_checks
from podmeter.lab.run import LabOptions, LabRun
from podmeter.lab.scenario import load_scenario, parse_scenario

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab's eBPF mode needs root")


def test_connections_through_a_service_are_named_by_the_backend_that_served_each(tmp_path: Path) -> None:
    result = LabRun(load_scenario("services"), LabOptions(tmp_path, progress=False)).run()
    assert result.error is None and result.failures == [], result.failures
    assert result.passed, failed_checks(result)
    calls = [t for t in result.traffic if t.get("kind") == "service"]
    assert [t["connections"] for t in calls] == [40, 20] and all(t["ok"] for t in calls), calls
    assert all(sum(t["per_backend"].values()) == t["connections"] for t in calls)
    assert len(calls[0]["backends"]) == 3 and len(calls[1]["backends"]) == 4
    assert set(calls[1]["per_backend"]) - set(calls[0]["backends"]), "the new replica served too"
    assert calls[0]["cluster_ip"].startswith("10.96.")
    apps = {t["kind"]: t for t in result.traffic if t.get("kind", "").startswith("apps-")}
    assert set(apps) == {"apps-nginx", "apps-redis"} and all(t.get("ok") for t in apps.values()), apps
    assert apps["apps-nginx"]["connections"] == 21, "one kept-alive connection, then one per request"
    assert all(read > 0 and written > 0 for read, written in apps["apps-redis"]["per_backend"].values())


def test_without_the_service_proxy_the_step_is_skipped_and_says_why(tmp_path: Path) -> None:
    text = (Path(__file__).parents[2] / "src/podmeter/lab/scenarios/services.yaml").read_text()
    # The Service steps only record that they are skipped: all of them at once, early, in a short run.
    text = re.sub(r"at: (4|14|16|20|24),", "at: 2,", text.replace("duration: 30", "duration: 6"))
    scenario = parse_scenario(text)
    result = LabRun(scenario, LabOptions(tmp_path, progress=False, service_proxy=False)).run()
    assert result.passed, result.failures
    assert [t.get("skipped") for t in result.traffic if t.get("kind") == "service"] == ["--no-service-proxy"] * 2
    assert [t.get("skipped") for t in result.traffic if t.get("kind", "").startswith("apps-")] == [
        "--no-service-proxy"] * 2
