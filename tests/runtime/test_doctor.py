"""podmeter doctor: the audit's rules, and the command against a lab API server and a real pinned map."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lab_server import LabServer
from podmeter.model.configuration import DEFAULT_NAME, Interest, MetricsConfiguration
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Replace, Upsert
from podmeter.model.records import decode_namespace, decode_pod
from podmeter.model.view import NodeView
from podmeter.runtime.doctor import audit

NODE = "n1"


def _pod(name: str, ip: str, *, observe: bool = True, phase: str = "Running", host: bool = False,
         ns: str = "web") -> dict[str, Any]:
    return {"metadata": {"uid": f"uid-{name}", "name": name, "namespace": ns,
                         "annotations": {"podmeter.io/observe": "true" if observe else "false"}},
            "spec": {"nodeName": NODE, "hostNetwork": host}, "status": {"phase": phase, "podIP": ip}}


def _view(*pods: dict[str, Any]) -> NodeView:
    view = NodeView(NODE)
    view.apply(Replace(NAMESPACES, [decode_namespace({"metadata": {"uid": "ns", "name": "web"}})]))
    view.apply(Replace(PODS, [decode_pod(p) for p in pods]))
    return view


def test_a_matching_map_is_clean() -> None:
    result = audit(_view(_pod("a", "10.0.0.1"), _pod("b", "10.0.0.2", observe=False)), {"10.0.0.1"}, 16)
    assert result.clean and result.desired == 1 and "clean" in result.render()


def test_leaked_ips_are_named_with_the_pods_that_still_carry_them_and_why_they_do_not_count() -> None:
    view = _view(_pod("done", "10.0.0.3", phase="Succeeded"), _pod("hn", "10.0.0.4", host=True),
                 _pod("quiet", "10.0.0.5", observe=False), _pod("a", "10.0.0.1"))
    result = audit(view, {"10.0.0.1", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.9"}, 16)
    found = {f.ip: (f.kind, f.pods) for f in result.findings}
    assert found == {
        "10.0.0.3": ("leaked", ("web/done (Succeeded)",)),
        "10.0.0.4": ("leaked", ("web/hn (hostNetwork)",)),
        "10.0.0.5": ("leaked", ("web/quiet (not observed)",)),
        "10.0.0.9": ("leaked", ()),
    }
    assert "no pod of this node has it" in result.render() and "drift: 4 IPs differ" in result.render()


def test_missing_ips_are_named_with_their_owners_unless_the_map_is_full_of_desired_ips() -> None:
    view = _view(_pod("a", "10.0.0.1"), _pod("b", "10.0.0.2"), _pod("c", "10.0.0.3"))
    missing = audit(view, {"10.0.0.1"}, 16)
    assert [(f.kind, f.ip, f.pods) for f in missing.findings] == [
        ("missing", "10.0.0.2", ("web/b",)), ("missing", "10.0.0.3", ("web/c",))]
    full = audit(view, {"10.0.0.1", "10.0.0.2"}, 2)
    assert full.clean and full.overflow == 1
    full_with_a_stranger = audit(view, {"10.0.0.1", "10.0.0.7"}, 2)
    assert {f.ip for f in full_with_a_stranger.findings} == {"10.0.0.7", "10.0.0.2", "10.0.0.3"}


def test_interest_comes_from_the_configuration_like_the_agent() -> None:
    view = _view(_pod("quiet", "10.0.0.5", observe=False))
    view.apply(Upsert(CONFIGURATIONS, MetricsConfiguration(DEFAULT_NAME, "1", 1, Interest(include=frozenset({"web"})))))
    assert audit(view, {"10.0.0.5"}, 16).clean


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (bpf)")


def _create(server: LabServer, pod: dict[str, Any]) -> None:
    meta = pod["metadata"]
    body = {"metadata": {k: meta[k] for k in ("name", "annotations")},
            "spec": {**pod["spec"], "containers": [{"name": "c", "image": "i"}]}}
    server.request("POST", f"/api/v1/namespaces/{meta['namespace']}/pods", body)
    server.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                   {"status": pod["status"]}, content_type="application/merge-patch+json")


@needs_root
def test_the_command_reads_the_pinned_map_and_the_api_server(lab_apiserver: LabServer, tmp_path: Path) -> None:
    from podmeter.adapters.datapath.ebpf import EbpfDatapath

    pins = Path("/sys/fs/bpf") / f"pmdoctor{os.getpid()}"
    lab_apiserver.request("POST", "/api/v1/namespaces", {"metadata": {"name": "web"}})
    _create(lab_apiserver, _pod("a", "10.0.0.1"))
    _create(lab_apiserver, _pod("done", "10.0.0.3", phase="Succeeded"))
    datapath = EbpfDatapath.open(pins, filter_size=8)
    try:
        datapath.insert(["10.0.0.1"])
        command = [sys.executable, "-m", "podmeter", "doctor", "--kubeconfig", str(lab_apiserver.kubeconfig),
                   "--node-name", NODE, "--bpffs", str(pins), "--recheck", "0"]
        clean = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert clean.returncode == 0, clean.stderr
        assert "clean" in clean.stdout
        datapath.insert(["10.0.0.3"])
        drift = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=60)
        assert drift.returncode == 1, drift.stderr
        assert json.loads(drift.stdout)["findings"] == [
            {"kind": "leaked", "ip": "10.0.0.3", "pods": ["web/done (Succeeded)"]}]
    finally:
        datapath.close()
        subprocess.run(["rm", "-rf", str(pins)], check=False)


def test_unreadable_truth_or_pins_exit_2(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "podmeter", "doctor", "--kubeconfig", str(tmp_path / "none"),
               "--node-name", NODE]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "does not exist" in result.stderr
