"""The real kubectl drives every verb against the lab API server (``podmeter apiserver`` subprocess, TLS)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lab_server import KUBECTL, LabServer

pytestmark = pytest.mark.skipif(not os.path.exists(KUBECTL), reason="kubectl is not installed")

POD = """
apiVersion: v1
kind: Pod
metadata:
  name: web-1
  namespace: kc
  labels: {app: web}
spec:
  containers:
  - name: c
    image: busybox:1.36
"""

CONFIG = """
apiVersion: podmeter.io/v1alpha1
kind: MetricsConfiguration
metadata:
  name: default
spec:
  namespaces: {include: [kc]}
  annotations: %s
"""


@pytest.fixture(scope="module")
def srv() -> Iterator[LabServer]:
    with LabServer(process=True, tls=True, console=True) as server:  # the real console entry point
        server.kubectl("create", "namespace", "kc")
        yield server


def get(srv: LabServer, *args: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(srv.kubectl("get", *args, "-o", "json", "--show-managed-fields").stdout)
    return out


def test_create_get_delete(srv: LabServer) -> None:
    assert "pod/web-1 created" in srv.kubectl("create", "-f", "-", input=POD).stdout
    pod = get(srv, "-n", "kc", "pod", "web-1")
    assert pod["spec"]["restartPolicy"] == "Always" and pod["status"]["phase"] == "Pending"
    names = get(srv, "pods", "-A")["items"]
    assert [p["metadata"]["name"] for p in names] == ["web-1"]
    again = srv.kubectl("create", "-f", "-", input=POD, check=False)
    assert again.returncode != 0 and "AlreadyExists" in again.stderr
    assert 'pod "web-1" deleted' in srv.kubectl("-n", "kc", "delete", "pod", "web-1").stdout
    missing = srv.kubectl("-n", "kc", "get", "pod", "web-1", check=False)
    assert missing.returncode != 0 and 'pods "web-1" not found' in missing.stderr


def test_annotate_label_patch(srv: LabServer) -> None:
    srv.kubectl("create", "-f", "-", input=POD.replace("web-1", "web-2"))
    srv.kubectl("-n", "kc", "annotate", "pod", "web-2", "podmeter.io/observe=true")
    srv.kubectl("-n", "kc", "label", "pod", "web-2", "tier=fe")
    srv.kubectl("-n", "kc", "label", "pod", "web-2", "tier=be", "--overwrite")
    srv.kubectl("-n", "kc", "patch", "pod", "web-2", "-p", '{"metadata":{"labels":{"s":"1"}}}')
    srv.kubectl("-n", "kc", "patch", "pod", "web-2", "--type=merge", "-p", '{"metadata":{"labels":{"m":"2"}}}')
    srv.kubectl(
        "-n",
        "kc",
        "patch",
        "pod",
        "web-2",
        "--type=json",
        "-p",
        '[{"op":"remove","path":"/metadata/labels/s"}]',
    )
    srv.kubectl(
        "-n",
        "kc",
        "patch",
        "pod",
        "web-2",
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status":{"phase":"Running","podIP":"10.244.0.9"}}',
    )
    srv.kubectl("-n", "kc", "label", "pod", "web-2", "m-")
    pod = get(srv, "-n", "kc", "pod", "web-2")
    assert pod["metadata"]["annotations"] == {"podmeter.io/observe": "true"}
    assert pod["metadata"]["labels"] == {"app": "web", "tier": "be"}
    assert pod["status"]["podIP"] == "10.244.0.9" and pod["status"]["podIPs"] == [{"ip": "10.244.0.9"}]
    assert pod["status"]["phase"] == "Running"
    managers = {m["manager"] for m in pod["metadata"]["managedFields"]}
    assert {"kubectl-create", "kubectl-annotate", "kubectl-label", "kubectl-patch"} <= managers
    bad = srv.kubectl(
        "-n",
        "kc",
        "patch",
        "pod",
        "web-2",
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status":{"podIP":"999.1.2.3"}}',
        check=False,
    )
    assert bad.returncode != 0 and "must be a valid IP address" in bad.stderr


def test_apply_twice_and_change(srv: LabServer) -> None:
    first = srv.kubectl("apply", "-f", "-", input=CONFIG % "true").stdout
    assert "metricsconfiguration.podmeter.io/default created" in first
    assert "unchanged" in srv.kubectl("apply", "-f", "-", input=CONFIG % "true").stdout
    rv = get(srv, "metricsconfigurations", "default")["metadata"]["resourceVersion"]
    assert "configured" in srv.kubectl("apply", "-f", "-", input=CONFIG % "false").stdout
    config = get(srv, "pmconfig", "default")
    assert config["spec"] == {"namespaces": {"include": ["kc"]}, "annotations": False}
    assert config["metadata"]["generation"] == 2 and config["metadata"]["resourceVersion"] != rv
    srv.kubectl(
        "patch",
        "pmconfig",
        "default",
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status":{"conditions":[{"type":"Accepted","status":"True","reason":"Valid"}]}}',
    )
    printed = srv.kubectl("get", "pmconfig").stdout.splitlines()
    assert printed[0].split() == ["NAME", "ACCEPTED", "REASON", "AGE"]
    assert printed[1].split()[:3] == ["default", "True", "Valid"]
    srv.kubectl("apply", "-f", "-", input=POD.replace("web-1", "web-3"))
    srv.kubectl("apply", "-f", "-", input=POD.replace("web-1", "web-3").replace("app: web", "app: web3"))
    assert get(srv, "-n", "kc", "pod", "web-3")["metadata"]["labels"] == {"app": "web3"}


def test_strict_validation_reports_unknown_fields(srv: LabServer) -> None:
    bad = POD.replace("web-1", "web-x").replace("  containers:", "  bogusField: 1\n  containers:")
    result = srv.kubectl("create", "-f", "-", input=bad, check=False)
    assert result.returncode != 0 and 'unknown field "spec.bogusField"' in result.stderr
    assert srv.kubectl("-n", "kc", "get", "pod", "web-x", check=False).returncode != 0  # nothing written


def test_get_watch_sees_changes(srv: LabServer) -> None:
    env = {**os.environ, "KUBECONFIG": str(srv.kubeconfig), "HOME": str(srv.dir)}
    watcher = subprocess.Popen(
        [KUBECTL, "-n", "kc", "get", "pods", "-w", "-o", "json", "--request-timeout=5s"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    time.sleep(1.0)
    srv.kubectl("create", "-f", "-", input=POD.replace("web-1", "watched"))
    srv.kubectl("-n", "kc", "label", "pod", "watched", "seen=yes")
    srv.kubectl("-n", "kc", "delete", "pod", "watched")
    out, _ = watcher.communicate(timeout=20)
    decoder, objects, pos = json.JSONDecoder(), [], 0
    while pos < len(out.strip()):
        obj, end = decoder.raw_decode(out, pos)
        objects.append(obj)
        pos = end + (len(out[end:]) - len(out[end:].lstrip()))
    watched = [o for o in objects if o["metadata"]["name"] == "watched"]
    assert watched and watched[-1]["metadata"]["labels"].get("seen") == "yes"


def test_server_side_dry_run_writes_nothing(srv: LabServer) -> None:
    dry = POD.replace("web-1", "dry")
    assert "(server dry run)" in srv.kubectl("create", "-f", "-", "--dry-run=server", input=dry).stdout
    assert srv.kubectl("-n", "kc", "get", "pod", "dry", check=False).returncode != 0
    srv.kubectl("create", "-f", "-", input=dry)
    srv.kubectl("-n", "kc", "label", "pod", "dry", "x=y", "--dry-run=server")
    srv.kubectl("-n", "kc", "delete", "pod", "dry", "--dry-run=server")
    assert "x" not in get(srv, "-n", "kc", "pod", "dry")["metadata"]["labels"]  # still there, unlabelled
    srv.kubectl("-n", "kc", "delete", "pod", "dry")


def test_get_prints_server_side_table(srv: LabServer) -> None:
    srv.kubectl("create", "-f", "-", input=POD.replace("web-1", "tabled"))
    srv.kubectl(
        "-n",
        "kc",
        "patch",
        "pod",
        "tabled",
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status":{"phase":"Running","podIP":"10.244.1.7"}}',
    )
    lines = srv.kubectl("-n", "kc", "get", "pod", "tabled", "-o", "wide").stdout.splitlines()
    assert lines[0].split()[:6] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP"]
    assert lines[1].split()[:3] == ["tabled", "0/1", "Running"] and "10.244.1.7" in lines[1]
    namespaces = srv.kubectl("get", "namespaces").stdout.splitlines()
    assert namespaces[0].split() == ["NAME", "STATUS", "AGE"]
    assert any(line.split()[:2] == ["kc", "Active"] for line in namespaces)


def test_leases_and_namespace_deletion(srv: LabServer) -> None:
    srv.kubectl("create", "namespace", "gone")
    lease = (
        "apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata: {name: op, namespace: gone}\n"
        "spec: {holderIdentity: op-1, leaseDurationSeconds: 15}\n"
    )
    srv.kubectl("create", "-f", "-", input=lease)
    srv.kubectl("create", "-f", "-", input=POD.replace("namespace: kc", "namespace: gone"))
    assert get(srv, "-n", "gone", "lease", "op")["spec"]["holderIdentity"] == "op-1"
    srv.kubectl("delete", "namespace", "gone")
    assert get(srv, "pods", "-A", "--field-selector", "metadata.namespace=gone")["items"] == []
    assert srv.kubectl("get", "namespace", "gone", check=False).returncode != 0
