"""The multi-node lab end to end: three nodes pass (a short variant of the shipped ``cluster``), an agent
whose endpoint cache goes stale fails it with the stale IPs named, and ``podmeter lab --kubeconfig`` runs
against an existing API server (the lab's own, started separately) and removes what it made, also after
Ctrl-C.

The eBPF tests need root (namespaces, veths, bpffs); the stale-cache one runs in memory mode (the I7 check
needs no kernel) and needs nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lab_server import LabServer
from podmeter.cli.lab import failed_checks
from podmeter.lab.cluster import ClusterRun
from podmeter.lab.report import write_report
from podmeter.lab.run import LabOptions
from podmeter.lab.scenario import parse_scenario

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (bpf, netns)")

# The shipped `cluster` scenario, shortened for `make test`: three nodes, UDP across every pair of nodes and
# TCP across one, churn with IPs reused on every node (a /28 each) and identities coming and going, an agent
# SIGKILL and an operator SIGKILL (its successor renumbers every identity), traffic again after both.
SHORT = """
name: cluster-short
seed: 13
datapath: ebpf
duration: 22
settle: 4
nodes:
  - {name: lab-0, pod_cidr: 10.244.20.0/28}
  - {name: lab-1, pod_cidr: 10.244.21.0/28}
  - {name: lab-2, pod_cidr: 10.244.22.0/28}
agent: {resync_interval: 5}
operator: {sweep_period: 5}
namespaces: [{name: web}, {name: jobs}]
steps:
  - {at: 0, do: pods, namespace: web, count: 3, prefix: frontend, deployment: true}
  - {at: 0, do: pods, namespace: web, count: 3, prefix: api, deployment: true}
  - {at: 3, do: traffic, namespace: web, protocol: udp, pairs: 6, packets: 20, size: 300, rate: 400,
     across_nodes: true}
  - {at: 5, do: traffic, namespace: web, protocol: tcp, pairs: 1, packets: 50, size: 1000, across_nodes: true}
  - {at: 6, do: churn, namespace: jobs, rate: 3, duration: 13, lifetime: 1.5, label_sets: 3}
  - {at: 8, do: kill-agent, node: lab-1, down: 1.5, namespace: web, deletes: 1}
  - {at: 12, do: kill-operator, down: 1.5, namespace: web, deletes: 1}
  - {at: 18, do: traffic, namespace: web, protocol: udp, pairs: 3, packets: 20, size: 300, rate: 400,
     across_nodes: true}
"""

STALE = """
name: stale-endpoint-cache
seed: 4
datapath: memory
duration: 8
settle: 2
nodes:
  - {name: lab-0, pod_cidr: 10.247.0.0/28}
  - {name: lab-1, pod_cidr: 10.247.1.0/28}
  - {name: lab-2, pod_cidr: 10.247.2.0/28, agent_fault: stale-endpoints}
operator: {sweep_period: 5}
namespaces: [{name: web}, {name: db}]
steps:
  - {at: 0, do: pods, namespace: web, count: 3, node: lab-0}
  - {at: 0, do: pods, namespace: db, count: 1, node: lab-1}
  - {at: 4, do: delete, namespace: web, all: true}
"""

EXTERNAL = """
name: against-an-existing-server
seed: 3
datapath: ebpf
duration: 10
settle: 3
nodes:
  - {name: ext-a, pod_cidr: 10.246.0.0/28}
  - {name: ext-b, pod_cidr: 10.246.1.0/28}
agent: {resync_interval: 5}
operator: {sweep_period: 5}
namespaces: [{name: shop}]
steps:
  - {at: 0, do: pods, namespace: shop, count: 4, prefix: web, deployment: true}
  - {at: 3, do: traffic, namespace: shop, protocol: udp, pairs: 2, packets: 20, across_nodes: true}
  - {at: 4, do: churn, namespace: shop, rate: 2, duration: 4, lifetime: 1}
  - {at: 5, do: fault, fault: close-watches}
  - {at: 8, do: delete, namespace: shop, count: 1}
"""


def _namespaces(tag: str) -> list[Path]:
    return list(Path("/run/netns").glob(f"{tag}*")) if Path("/run/netns").is_dir() else []


def _pins(tag: str) -> list[Path]:
    return list(Path("/sys/fs/bpf").glob(f"{tag}*"))


def _leftovers(tag: str) -> list[str]:
    return [p.name for p in (*_namespaces(tag), *_pins(tag))]


def _kill_lab(lab: subprocess.Popen[bytes], kubeconfig: str) -> None:
    """The lab and every process it started (each in a session of its own: found by the kubeconfig they
    were given), then what they made in the kernel: none of it may outlive a failed test into the next."""
    os.killpg(lab.pid, signal.SIGKILL)
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if kubeconfig.encode() in cmdline.read_bytes():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue  # gone meanwhile
    lab.wait()
    tag = f"pmlab{lab.pid}"
    for namespace in _namespaces(tag):
        subprocess.run(["ip", "netns", "delete", namespace.name], capture_output=True, check=False)
    for pin in _pins(tag):
        shutil.rmtree(pin, ignore_errors=True)


@needs_root
def test_three_nodes_pass_with_cross_node_flows_named_on_both_ends(tmp_path: Path) -> None:
    started = time.monotonic()
    lab = ClusterRun(parse_scenario(SHORT), LabOptions(tmp_path, progress=False))
    result = lab.run()
    files = write_report(result, tmp_path)
    assert result.error is None
    assert result.failures == [], result.failures
    traffic = [t for t in result.traffic if "skipped" not in t]
    assert len(traffic) == 10 and all(t["ok"] for t in traffic), [t for t in traffic if not t["ok"]]
    assert result.passed, failed_checks(result)
    # Every ordered pair of nodes exchanged traffic, each exchange exact against both agents' records.
    cells = result.cross_node["cells"]
    for source in ("lab-0", "lab-1", "lab-2"):
        for destination in ("lab-0", "lab-1", "lab-2"):
            if source != destination:
                cell = cells[source][destination]
                assert cell["checks"] >= 1 and cell["exact"] == cell["checks"] and cell["bytes"] > 0, cell
    for check in traffic:
        flow = check["flow"]
        assert set(flow["records_by_node"]) == {check["src_node"], check["dst_node"]}
        assert all(n > 0 for n in flow["records_by_node"].values())
        # Both agents name both pods, with one identity each (the operator's)
        for pod in (check["src"], check["dst"]):
            ids = flow["identities"][pod]
            assert set(ids) == {check["src_node"], check["dst_node"]}
            assert len({i for found in ids.values() for i in found}) == 1 and None not in ids[check["src_node"]]
    # The endpoint invariant was checked on every node, through churn with IP reuse and both SIGKILLs.
    assert "I7" in result.checked
    counts = result.counts
    assert counts["agent_kills"] == 1 and counts["operator_kills"] == 1 and counts["ips_reused"] > 0
    assert counts["lifecycles"] >= 30
    assert [n["name"] for n in result.nodes] == ["lab-0", "lab-1", "lab-2"]
    assert all(n["peaks"]["endpoints"] >= 6 and n["failures"] == 0 for n in result.nodes)
    assert [n["agent_starts"] for n in result.nodes] == [1, 2, 1]
    assert all(v["returned"] for v in result.memory.values() if isinstance(v, dict))
    html = (tmp_path / "report.html").read_text()
    assert "<h2>Nodes</h2>" in html and "Cross-node traffic" in html and "from lab-2" in html
    assert {"report.json", "report.html"} <= {f.name for f in files}
    assert _leftovers(lab.tag) == []
    assert time.monotonic() - started < 120


def test_an_agent_whose_endpoint_cache_goes_stale_fails_the_lab_with_the_stale_ips_named(tmp_path: Path) -> None:
    """lab-2's agent keeps every endpoint a slice drops (test-only fault, podmeter.lab.faults): lab-0's
    three pods deleted during the run and lab-1's at its end, it still names their IPs; the two healthy
    agents do not."""
    result = ClusterRun(parse_scenario(STALE), LabOptions(tmp_path, progress=False)).run()
    assert result.error is None
    assert not result.passed
    stale = [f for f in result.failures if f["invariant"] == "I7"]
    assert {f["node"] for f in stale} == {"lab-2"}, stale
    assert {f["subject"] for f in stale} == {"10.247.0.1", "10.247.0.2", "10.247.0.3", "10.247.1.1"}
    for failure in stale:
        ip = failure["subject"]
        owner = "db" if ip == "10.247.1.1" else "web"
        assert failure["detail"].startswith(f"stale: the agent of lab-2 names {ip} {owner}/app-"), failure
        assert failure["detail"].endswith(f"no pod with an identity holds {ip} now"), failure
    assert [f for f in result.failures if f["invariant"] != "I7"] == []
    write_report(result, tmp_path)
    assert "FAILED" in (tmp_path / "report.html").read_text()


# --- against an existing API server ----------------------------------------------------------------------


def _lab_objects(server: LabServer, run_id: str | None = None) -> dict[str, list[str]]:
    """What a lab run may have left on the server."""
    out: dict[str, list[str]] = {}
    for what, path in (("namespaces", "/api/v1/namespaces"), ("nodes", "/api/v1/nodes"),
                       ("crds", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"),
                       ("podslices", "/apis/podmeter.io/v1alpha1/podslices"),
                       ("node leases", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"),
                       ("configurations", "/apis/podmeter.io/v1alpha1/metricsconfigurations")):
        _, _, body = server.request("GET", path)
        items: list[dict[str, Any]] = (body or {}).get("items") or []
        names = [i["metadata"]["name"] for i in items
                 if what != "namespaces" or i["metadata"]["name"] in ("shop", run_id)
                 or "podmeter.io/lab" in (i["metadata"].get("labels") or {})]
        out[what] = names
    return out


NOTHING_LEFT = {"namespaces": [], "nodes": [], "crds": [], "podslices": [], "node leases": [], "configurations": []}


@needs_root
def test_the_lab_runs_against_an_existing_api_server_and_removes_what_it_made(tmp_path: Path) -> None:
    with LabServer(tls=True) as server:  # https with a CA file: the nodes reach it through relays
        lab = ClusterRun(parse_scenario(EXTERNAL), LabOptions(tmp_path, progress=False, kubeconfig=server.kubeconfig))
        result = lab.run()
        assert result.error is None, result.error
        assert result.passed, (result.failures, [t for t in result.traffic if not t.get("ok", True)])
        traffic = [t for t in result.traffic if "skipped" not in t]
        assert len(traffic) == 2 and all(t["ok"] and t["src_node"] != t["dst_node"] for t in traffic)
        assert "I7" in result.checked
        assert any("steps skipped" in n for n in result.notes)  # the fault knob: the embedded server's only
        assert any("installed the CRD podslices.podmeter.io" in n for n in result.notes)
        # It made its Nodes, namespaces, node leases and CRDs there (the server's request log says so) ...
        made = {resource: server.admin.count("create", resource) for resource in (
            "nodes", "namespaces", "apiextensions.k8s.io/customresourcedefinitions", "coordination.k8s.io/leases")}
        # Its namespace and the scenario's; two node leases and the operator's leader election Lease.
        assert list(made.values()) == [2, 2, 2, 3], made
        # ... and removed every one of them.
        assert _lab_objects(server, lab.tag) == NOTHING_LEFT
    assert _leftovers(lab.tag) == []


@needs_root
def test_the_lab_refuses_to_use_a_namespace_it_did_not_create(tmp_path: Path) -> None:
    with LabServer() as server:
        server.request("POST", "/api/v1/namespaces", {"metadata": {"name": "shop"}})
        lab = ClusterRun(parse_scenario(EXTERNAL), LabOptions(tmp_path, progress=False, kubeconfig=server.kubeconfig))
        result = lab.run()
        assert not result.passed
        assert result.error is not None and "namespace shop already exists" in result.error
        assert server.request("GET", "/api/v1/namespaces/shop")[0] == 200  # not the lab's: left alone
        left = _lab_objects(server, lab.tag)
        assert left == {**NOTHING_LEFT, "namespaces": ["shop"]}, left


@needs_root
def test_ctrl_c_removes_everything_the_lab_made_on_the_api_server(tmp_path: Path) -> None:
    scenario = tmp_path / "external.yaml"
    scenario.write_text(EXTERNAL.replace("duration: 10", "duration: 60"))
    with LabServer() as server:
        lab = subprocess.Popen([sys.executable, "-m", "podmeter", "lab", str(scenario), "--kubeconfig",
                                str(server.kubeconfig), "--out", str(tmp_path / "out"), "--no-progress"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until its pods run on its nodes
                _, _, pods = server.request("GET", "/api/v1/namespaces/shop/pods")
                if sum((p.get("status") or {}).get("phase") == "Running" for p in (pods or {}).get("items") or []) >= 4:
                    break
                assert lab.poll() is None, lab.communicate()[0].decode()
                time.sleep(0.3)
            else:
                pytest.fail("the lab's pods never ran")
            assert _lab_objects(server)["nodes"] == ["ext-a", "ext-b"]
            lab.send_signal(signal.SIGINT)
            try:
                output = lab.communicate(timeout=60)[0].decode()
            except subprocess.TimeoutExpired:
                lab.send_signal(signal.SIGUSR1)  # every thread's stack, where the lab is stuck
                time.sleep(3)
                _kill_lab(lab, str(server.kubeconfig))
                pytest.fail("the lab did not end 60 s after SIGINT:\n" + lab.communicate()[0].decode()[-12000:])
        finally:
            if lab.poll() is None:
                _kill_lab(lab, str(server.kubeconfig))
        assert lab.returncode == 130, output
        assert "interrupted" in output
        assert _lab_objects(server, f"pmlab{lab.pid}") == NOTHING_LEFT
    assert _leftovers(f"pmlab{lab.pid}") == []
