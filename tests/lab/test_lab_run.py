"""The lab end to end with eBPF: the short scenario passes with its report; a broken agent fails it.

Root only (namespaces, veths, bpffs). Each run lives in its own node namespace and pin directory and
removes them, with every pod namespace it made, also when it fails.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from podmeter.cli.lab import failed_checks
from podmeter.lab.report import write_report
from podmeter.lab.run import LabOptions, LabRun
from podmeter.lab.scenario import load_scenario, parse_scenario

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (bpf, netns)")

BROKEN = """
name: broken-agent
seed: 9
datapath: ebpf
duration: 8
settle: 2
node: {pod_cidr: 10.244.3.0/28}
agent: {fault: drop-deletes, resync_interval: 1}
operator: {enabled: false}
namespaces: [{name: web}]
steps:
  - {at: 0, do: pods, namespace: web, count: 4}
  - {at: 3, do: delete, namespace: web, all: true}
"""


def _leftovers(tag: str) -> list[str]:
    netns = [p.name for p in Path("/run/netns").glob(f"{tag}*")] if Path("/run/netns").is_dir() else []
    pins = [p.name for p in Path("/sys/fs/bpf").glob(f"{tag}*")]
    return netns + pins


def test_the_short_scenario_passes_and_writes_its_report(tmp_path: Path) -> None:
    lab = LabRun(load_scenario("short"), LabOptions(tmp_path, progress=False))
    result = lab.run()
    files = write_report(result, tmp_path)
    assert result.error is None
    assert result.failures == [], result.failures
    assert result.passed, failed_checks(result)
    names = {f.name for f in files}
    assert {"report.json", "report.html", "filter.png", "memory.png", "identities.png", "events.png",
            "flows.png"} <= names
    assert all(f.stat().st_size > 500 for f in files)
    html = (tmp_path / "report.html").read_text()
    assert "PASSED" in html and "data:image/png;base64," in html and "flows by bytes" in html
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["passed"] and data["datapath"] == "ebpf" and len(data["samples"]) > 20
    traffic = [t for t in result.traffic if "skipped" not in t]
    assert {t["protocol"] for t in traffic} == {"udp", "tcp"} and all(t["ok"] for t in traffic)
    assert all("metrics" in t for t in traffic)  # the agent's per-pod series agreed with the kernel
    # Every check also held against the agent's flow records, at both observation points.
    assert all(t["flow"]["ok"] and t["flow"]["problems"] == [] for t in traffic), [t["flow"] for t in traffic]
    tcp = next(t for t in traffic if t["protocol"] == "tcp")
    assert {"SYN", "FIN"} <= set(tcp["flow"]["found"]["flags"]["forward"])
    [reuse] = [t for t in traffic if t.get("kind") == "reuse-during-flow"]
    assert reuse["reused"], reuse  # a quiet moment: the next pod got the deleted pod's IP
    assert len(reuse["flow"]["found"]["forward"]) == 2  # records named by each holder, each its own packets
    assert result.counts["flow_checks"]["checked"] == len(traffic) == result.counts["flow_checks"]["exact"]
    workloads = {f["source"]["workload"] for f in result.flows}
    assert {"Deployment web/frontend", "Deployment web/api"} & workloads, workloads
    assert not [f for f in result.failures if f["invariant"] == "I8"]
    assert result.counts["lifecycles"] >= 30 and result.counts["agent_kills"] == 1
    assert result.memory["agent"]["returned"] and result.memory["operator"]["returned"]
    assert result.samples[-1].kernel == 0 and result.samples[-1].pods == 0
    assert _leftovers(lab.tag) == []


def test_an_agent_that_drops_deletes_fails_the_lab_with_the_leaked_ips_named(tmp_path: Path) -> None:
    lab = LabRun(parse_scenario(BROKEN), LabOptions(tmp_path, progress=False))
    result = lab.run()
    assert result.error is None
    assert not result.passed
    leaked = {f["subject"]: f["detail"] for f in result.failures if f["invariant"] == "I2"}
    assert set(leaked) == {"10.244.3.1", "10.244.3.2", "10.244.3.3", "10.244.3.4"}
    for ip, detail in leaked.items():
        assert detail.startswith(f"leaked: {ip} is in the kernel filter but no pod holds it (last held by web/app-")
    kept = [f["detail"] for f in result.failures if f["invariant"] == "I1"]  # its store still has the deleted pods
    assert len(kept) == 4 and all(d.startswith("kept: the agent's store holds uid ") for d in kept)
    write_report(result, tmp_path)
    assert "FAILED" in (tmp_path / "report.html").read_text()
    assert _leftovers(lab.tag) == []


REUSE_ONLY = """
name: reuse-between-drains
seed: 5
datapath: ebpf
duration: 10
settle: 2
node: {pod_cidr: 10.244.6.0/28}
agent: {resync_interval: 5, flow_interval: 60}
operator: {enabled: false}
namespaces: [{name: web}]
steps:
  - {at: 0, do: pods, namespace: web, count: 2, prefix: api, deployment: true}
  - {at: 2, do: reuse-during-flow, namespace: web, packets: 25}
"""


def test_an_ip_reused_between_two_periodic_drains_is_never_credited_to_the_next_pod(tmp_path: Path) -> None:
    """No periodic drain in the run (60 s): only the drain the agent makes before it applies a delete or a
    new holder separates A's packets from A''s, which share the whole 5-tuple."""
    lab = LabRun(parse_scenario(REUSE_ONLY), LabOptions(tmp_path, progress=False))
    result = lab.run()
    assert result.error is None
    [reuse] = result.traffic
    assert reuse["reused"] and reuse["ok"], reuse
    first, second = reuse["src"].split(" then ")
    want = {"from-pod": [25, 25 * 342], "to-pod": [25, 25 * 342]}
    assert reuse["flow"]["found"]["forward"] == {first: want, second: want}
    assert result.passed, result.failures
    assert _leftovers(lab.tag) == []


ENDLESS_CHURN = """
name: until-n
seed: 3
datapath: memory
duration: 600
lifecycles: 60
settle: 3
sample_interval: 0.5
node: {pod_cidr: 10.244.4.0/24}
namespaces: [{name: jobs}]
steps:
  - {at: 0, do: churn, namespace: jobs, rate: 30, duration: 599, lifetime: 0.5, complete: true, linger: 0.2,
     unique_labels: true}
"""


def test_a_run_ends_once_its_lifecycles_are_done(tmp_path: Path) -> None:
    result = LabRun(parse_scenario(ENDLESS_CHURN), LabOptions(tmp_path, progress=False)).run()
    assert result.error is None
    assert result.passed, result.failures
    assert result.counts["lifecycles"] >= 60
    assert result.steps_s is not None and result.steps_s < 30  # not the 600 s duration


def test_an_interrupt_unwinds_the_run_at_its_next_pause_and_stops_every_process(tmp_path: Path) -> None:
    """What Ctrl-C and SIGTERM do (podmeter lab's handler calls interrupt()): the run raises
    KeyboardInterrupt from its own pause, after its processes started, and its teardown stops them all."""
    lab = LabRun(load_scenario("short"), LabOptions(tmp_path, datapath="memory", progress=False))
    timer = threading.Timer(4.0, lab.interrupt)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            lab.run()
    finally:
        timer.cancel()
    assert time.monotonic() - started < 30
    started_processes = [p for p in lab.processes.processes.values() if p.popen is not None]
    assert {p.name for p in started_processes} >= {"apiserver", "agent"}
    assert all(p.popen is not None and p.popen.poll() is not None for p in started_processes)
