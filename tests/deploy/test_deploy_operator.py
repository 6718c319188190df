"""The operator exactly as the rendered Deployment runs it: two replicas, leader election, the status write;
with the etcd overlay, against etcd run from that overlay's StatefulSet.

Each replica is a pod: its own network namespace (so both listen on the manifest's port), the manifest's
``args`` and ``env`` (downward-API namespace and pod name resolved), and its ``securityContext``: user
65532, no capabilities, no privilege escalation (``setpriv``), a read-only root file system. A lab API
server in a "node" namespace is the cluster. Checked: both replicas become ready (the probe's path and
port, from the node, as a kubelet asks), exactly one leads and holds the Lease the RBAC Role names, the
leader marks the MetricsConfiguration ``Accepted``, both hold the identities of the pods' label sets (with
etcd: one numbering, in the store), the RBAC allows every request they made, and SIGTERM hands the Lease
over at once.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent_harness import wait_for
from bpf_support import Pod, Topology, needs_root
from deploy_support import (
    Obj,
    authorized,
    container,
    container_filesystem,
    find,
    grants,
    needs_kubectl,
    render,
    request_attributes,
    service_account_dir,
)
from podmeter.lab.apiserver.client import AdminClient
from waiting import http_get, stop_process

pytestmark = [needs_kubectl, needs_root]

TOKEN = "deploy-test-token"
NAMESPACE = "podmeter"


class Cluster:
    """A lab API server listening on every address of the "node" netns."""

    def __init__(self, topology: Topology, workdir: Path) -> None:
        self.topology, self.workdir = topology, workdir
        kubeconfig = workdir / "server-kubeconfig"
        argv = ["nsenter", f"--net={topology.host_path}", "--", sys.executable, "-m", "podmeter", "apiserver",
                "--listen", "0.0.0.0:0", "--kubeconfig-out", str(kubeconfig), "--token", TOKEN, "--plain-http"]
        with open(workdir / "apiserver.log", "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: kubeconfig.exists() and "server" in kubeconfig.read_text(), timeout=20,
                 what="the lab API server")
        server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        self.port = int(server.rpartition(":")[2])
        self.url = f"http://127.0.0.1:{self.port}"
        wait_for(lambda: self.call("GET", "/api/v1/namespaces")[0] == 200, timeout=20, what="the API answering")

    def call(self, method: str, path: str, body: Any = None,
             content_type: str = "application/json") -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {TOKEN}", "Content-Type": content_type})
        with self.topology.in_host():
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as err:
                return err.code, err.read().decode()
            except OSError:
                return 0, None

    def admin(self) -> AdminClient:
        return AdminClient(self.url, TOKEN)

    def requests(self) -> list[dict[str, Any]]:
        with self.topology.in_host():
            return self.admin().requests()

    def reset_requests(self) -> None:
        with self.topology.in_host():
            self.admin().reset_requests()

    def kubeconfig_for(self, pod: Pod, path: Path) -> Path:
        """What a pod's service account gives it: the server as seen from the pod's network, a token."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": f"http://{pod.host_ip}:{self.port}"}}],
            "users": [{"name": "u", "user": {"token": TOKEN}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        }))
        path.chmod(0o644)
        return path

    def stop(self) -> None:
        stop_process(self.proc)


class Replica:
    """One operator pod of the rendered Deployment."""

    def __init__(self, objects: list[Obj], name: str, pod: Pod, topology: Topology, kubeconfig: Path,
                 log: Path) -> None:
        deployment = find(objects, "Deployment", "podmeter-operator")
        spec = deployment["spec"]["template"]["spec"]
        cont = container(deployment)
        pod_security, security = spec["securityContext"], cont["securityContext"]
        assert security["capabilities"] == {"drop": ["ALL"]} and security["allowPrivilegeEscalation"] is False
        fields = {"metadata.name": name, "metadata.namespace": NAMESPACE}
        maps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "KUBECONFIG": str(kubeconfig),
               "PODMETER_ALLOW_PLAIN_HTTP_CREDENTIALS": "1"}  # the test API server is plain HTTP
        for entry in cont["env"]:
            source = entry.get("valueFrom", {})
            if "value" in entry:
                value = entry["value"]
            elif "fieldRef" in source:
                value = fields[source["fieldRef"]["fieldPath"]]
            else:
                value = maps[source["configMapKeyRef"]["name"]][source["configMapKeyRef"]["key"]]
            env[entry["name"]] = resolve_services(objects, value, pod)
        self.name, self.pod, self.topology, self.env = name, pod, topology, env
        self.ports = {p["name"]: p["containerPort"] for p in cont["ports"]}
        self.readiness = cont["readinessProbe"]["httpGet"]
        self.startup = cont["startupProbe"]
        self.log = log
        argv = [*container_filesystem(deployment), "nsenter", f"--net={pod.netns_path}", "--", "setpriv",
                f"--reuid={pod_security['runAsUser']}", f"--regid={pod_security['runAsGroup']}", "--clear-groups",
                "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--",
                sys.executable, "-m", "podmeter", *cont["args"]]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/")
        self.started = time.monotonic()

    def first_probe(self) -> int:
        """The kubelet's first probe of the new container: the startup probe, once its initial delay is over
        (a failure would be an Unhealthy event)."""
        time.sleep(max(0.0, self.startup["initialDelaySeconds"] - (time.monotonic() - self.started)))
        return self.http(self.startup["httpGet"]["path"], self.startup["httpGet"]["port"])[0]

    def log_lines(self) -> list[str]:
        return [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]

    def http(self, path: str, port: str = "metrics") -> tuple[int, str]:
        """From the node, to the pod's IP (as a kubelet probe or Prometheus would)."""
        with self.topology.in_host():
            return http_get(f"http://{self.pod.ip}:{self.ports[port]}{path}")

    def leads(self) -> bool:
        return metric(self, "podmeter_leader") == 1

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def resolve_services(objects: list[Obj], value: str, pod: Pod) -> str:
    """Cluster DNS: a Service's name (NAME.NAMESPACE.svc) becomes the address its pods answer on, here the
    "node" netns as the pod reaches it."""
    for service in (o for o in objects if o["kind"] == "Service"):
        host = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
        value = re.sub(rf"(?<=//){re.escape(host)}(?=[:/]|$)", pod.host_ip, value)
    return value


class Etcd:
    """The etcd overlay's StatefulSet: its container command, its user, its data volume, in the "node" netns."""

    def __init__(self, statefulset: Obj, topology: Topology, data: Path, log: Path) -> None:
        spec = statefulset["spec"]["template"]["spec"]
        cont = container(statefulset)
        (mount,) = cont["volumeMounts"]
        user = spec["securityContext"]["runAsUser"]
        data.mkdir(mode=0o700)
        os.chown(data, user, spec["securityContext"]["runAsGroup"])
        argv = [arg.replace(f"={mount['mountPath']}", f"={data}") for arg in cont["command"]]
        self.topology = topology
        probe = cont["readinessProbe"]["httpGet"]
        self.port = next(p["containerPort"] for p in cont["ports"] if p["name"] == probe["port"])
        self.health = probe["path"]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                ["nsenter", f"--net={topology.host_path}", "--", "setpriv", f"--reuid={user}",
                 f"--regid={spec['securityContext']['runAsGroup']}", "--clear-groups", "--bounding-set=-all",
                 "--no-new-privs", "--", *argv], stdout=out, stderr=subprocess.STDOUT, cwd="/")
        wait_for(lambda: self.proc.poll() is not None or self.call("GET", self.health) is not None, timeout=20,
                 what="etcd healthy", describe=lambda: log.read_text()[-2000:])
        assert self.proc.poll() is None, log.read_text()[-2000:]

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        with self.topology.in_host():
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    return json.loads(response.read())
            except OSError:
                return None

    def count(self, prefix: str) -> int:
        """Keys under ``prefix`` (etcd's JSON gateway)."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        answer = self.call("POST", "/v3/kv/range", {"key": b64(prefix), "range_end": b64(end), "count_only": True})
        return int(answer.get("count", 0)) if answer else -1

    def stop(self) -> None:
        stop_process(self.proc)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def metric(replica: Replica, name: str) -> float | None:
    """The value of an unlabelled series on the replica's /metrics (None if absent or unreachable)."""
    status, text = replica.http("/metrics")
    found = re.search(rf"^{name} (\S+)$", text, re.M) if status == 200 else None
    return float(found.group(1)) if found else None


@pytest.fixture
def mounts() -> Iterator[Path]:
    """Where the pods' "service account" files go: readable by the pods' user (pytest's tmp_path is not)."""
    path = service_account_dir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)




@pytest.mark.parametrize("overlay", ["overlays/default", "overlays/etcd"])
def test_two_operator_replicas_elect_one_leader_that_writes_the_status(topology: Topology, tmp_path: Path,
                                                                       mounts: Path, overlay: str) -> None:
    objects = render(overlay)
    deployment = find(objects, "Deployment", "podmeter-operator")
    replicas = deployment["spec"]["replicas"]
    assert replicas == 2
    pods = [topology.add_pod() for _ in range(replicas)]
    cluster = Cluster(topology, tmp_path)
    etcd = None
    running: list[Replica] = []
    try:
        if overlay == "overlays/etcd":
            etcd = Etcd(find(objects, "StatefulSet", "podmeter-etcd"), topology, mounts / "etcd-data",
                        tmp_path / "etcd.log")
        assert cluster.call("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                          "metadata": {"name": "shop"}})[0] == 201
        for name, app in (("web-1", "web"), ("web-2", "web"), ("api-1", "api")):  # two label sets
            body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": app}},
                    "spec": {"nodeName": "node-a", "containers": [{"name": "c", "image": "busybox"}]}}
            assert cluster.call("POST", "/api/v1/namespaces/shop/pods", body)[0] == 201
        assert cluster.call("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                          "metadata": {"name": NAMESPACE}})[0] == 201
        config = yaml.safe_load((Path(__file__).parents[2] / "deploy/examples/metricsconfiguration-include.yaml")
                                .read_text())
        assert cluster.call("POST", "/apis/podmeter.io/v1alpha1/metricsconfigurations", config)[0] == 201
        cluster.reset_requests()  # from here on, only the operators ask

        for index, pod in enumerate(pods):
            name = f"podmeter-operator-5d8c7-{index}"
            kubeconfig = cluster.kubeconfig_for(pod, mounts / f"kubeconfig-{index}")
            running.append(Replica(objects, name, pod, topology, kubeconfig, tmp_path / f"operator-{index}.log"))

        def logs() -> str:
            return "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted(tmp_path.glob("operator-*.log")))

        for replica in running:
            assert replica.first_probe() == 200, f"{replica.name}: the first startup probe failed: {logs()}"
        for replica in running:
            path = replica.readiness["path"]
            wait_for(lambda r=replica, p=path: r.proc.poll() is not None or r.http(p)[0] == 200,
                     timeout=30, what=f"{replica.name} ready", describe=logs)
            assert replica.proc.poll() is None, logs()
        wait_for(lambda: sum(r.leads() for r in running) == 1, timeout=30, what="one leader",
                 describe=logs)
        def accepted_written() -> bool:
            _, stored = cluster.call("GET", "/apis/podmeter.io/v1alpha1/metricsconfigurations/default")
            return any(c.get("type") == "Accepted" for c in (stored.get("status") or {}).get("conditions") or [])

        wait_for(accepted_written, timeout=30, what="the configuration checked", describe=logs)
        assert all(metric(r, "podmeter_configuration_valid") == 1 for r in running)

        # every replica holds an identity per label set; with etcd they are one numbering, in the store
        wait_for(lambda: all(metric(r, "podmeter_identities") == 2 for r in running), timeout=30,
                 what="identities of both label sets on every replica", describe=logs)
        if etcd is not None:
            assert running[0].env["PODMETER_IDENTITY_BACKEND"] == "etcd"
            assert etcd.count("/podmeter/identities/id/") == 2

        (leader,) = [r for r in running if r.leads()]
        role = find(objects, "Role", "podmeter-operator-leader-election")
        lease_name = next(r["resourceNames"][0] for r in role["rules"] if r.get("resourceNames"))
        status, lease = cluster.call("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{lease_name}")
        assert status == 200 and lease["spec"]["holderIdentity"] == leader.name
        status, stored = cluster.call("GET", "/apis/podmeter.io/v1alpha1/metricsconfigurations/default")
        (accepted,) = [c for c in stored["status"]["conditions"] if c["type"] == "Accepted"]
        assert accepted["status"] == "True"

        # a rolling update stops the leader: it empties the Lease, and the other takes over at once
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        leader.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        assert leader.proc.wait(grace) == 0, logs()
        (other,) = [r for r in running if r is not leader]
        wait_for(other.leads, timeout=10, what="the other replica leading", describe=logs)
        assert time.monotonic() - stopped < float(other.env.get("PODMETER_LEASE_DURATION", "15"))
        # one change of holder, counted as client-go counts it (kubectl get lease shows it)
        lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{lease_name}"
        status, lease = cluster.call("GET", lease_path)
        assert status == 200 and lease["spec"]["holderIdentity"] == other.name
        assert lease["spec"]["leaseTransitions"] == 1

        # every line either replica logged is a JSON object, as the manifest's PODMETER_LOG_FORMAT asks
        assert other.env["PODMETER_LOG_FORMAT"] == "json"
        for replica in running:
            lines = replica.log_lines()
            assert lines, replica.name
            for line in lines:
                record = json.loads(line)
                assert {"ts", "level", "logger", "msg"} <= record.keys(), line
            assert any(json.loads(line)["msg"].startswith("leader election:") for line in lines), replica.name

        # the RBAC allows every request the replicas made (and the reads of this test, which it allows too)
        made = {request_attributes(r["method"], r["path"], r["query"]) for r in cluster.requests()}
        made.discard(None)
        allowed = grants(objects, NAMESPACE, deployment["spec"]["template"]["spec"]["serviceAccountName"])
        assert {a for a in made if a is not None and not authorized(allowed, a)} == set()
        assert {("", "podmeter.io", "metricsconfigurations/status", "patch", "default"),
                (NAMESPACE, "coordination.k8s.io", "leases", "create", ""),
                (NAMESPACE, "coordination.k8s.io", "leases", "update", lease_name),
                ("", "", "pods", "watch", "")} <= made
    finally:
        for replica in running:
            replica.stop()
        cluster.stop()
        if etcd is not None:
            etcd.stop()
