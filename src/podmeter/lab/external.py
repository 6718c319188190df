"""``podmeter lab --kubeconfig FILE``: the lab's nodes, agents and operator against an existing API server.

What the lab touches there (docs/lab.md, "Against an existing API server"), all labelled
``podmeter.io/lab=<run id>`` where Kubernetes lets it, and all removed at the end, also after Ctrl-C:

* the scenario's namespaces, created by the lab (it refuses to start if one exists; one that a previous run
  deleted and a real API server is still finalizing, it waits for), and one namespace of its own,
  ``<run id>``, for the operator's leader-election Lease; at the end it waits until they are gone;
* a Node per simulated node (refused if one exists), with its pod CIDR and address, made Ready; and, if the
  server has the ``kube-node-lease`` namespace (a real cluster), each node's heartbeat Lease there, renewed
  every 10 s like a kubelet's, so a node lifecycle controller does not evict the lab's pods;
* podmeter's CRDs (the copies of ``deploy/base/crd-*.yaml`` shipped in ``podmeter.lab/crds``), only if
  missing (then removed at the end with what they hold);
* the PodSlices its operator publishes (cluster-scoped; the lab refuses to start if some already exist:
  another podmeter operator publishes there, and the two would undo each other's writes);
* the ``default`` MetricsConfiguration, only if a ``configure`` step creates it while none existed; when
  one exists, ``configure`` steps are skipped and it is never changed.

Pods are deleted with a grace period of 0 at the end (their kubelet, ``podmeter node``, is gone by then).
The API server's fault knobs exist on the embedded server only: ``fault`` and ``compaction-gap`` steps
are skipped, with a note.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

import yaml

from podmeter.lab.kube import KubeClient, KubeError, pod_path

log = logging.getLogger("podmeter.lab")

LAB_LABEL = "podmeter.io/lab"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
SLICES = "/apis/podmeter.io/v1alpha1/podslices"
MCONF_DEFAULT = "/apis/podmeter.io/v1alpha1/metricsconfigurations/default"
NODE_LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
HEARTBEAT_S = 10.0
NAMESPACE_GONE_S = 180.0  # how long a deleted namespace may take to go (a real server: seconds, its pods first)
PROGRESS_S = 5.0
POLL_S = 0.5


class ExternalError(RuntimeError):
    """The existing API server cannot host this run (the message says why and what to do)."""


def crd_files() -> list[Traversable]:
    """The CRDs the lab installs: package data, so an installed wheel has them as a source checkout does.
    They are byte-for-byte copies of ``deploy/base/crd-*.yaml`` (tests/lab/test_lab_crds.py holds them
    equal), the manifests a cluster install applies."""
    folder = resources.files("podmeter.lab") / "crds"
    return sorted((p for p in folder.iterdir() if p.name.endswith(".yaml")), key=lambda p: p.name)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ExternalCluster:
    """What the lab created on an existing API server, to remove it at the end (:meth:`cleanup`)."""

    def __init__(self, client: KubeClient, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.labels = {LAB_LABEL: run_id}
        self.nodes: list[str] = []
        self.node_leases: list[str] = []
        self.crds: list[str] = []  # installed by the lab
        # What cleanup may remove beyond what is listed: decided by prepare(), so a refusal removes nothing
        # of anyone else's (the slices another operator published, a configuration the cluster had).
        self.slices_ours = False
        self.had_configuration: bool | None = None
        self.notes: list[str] = []
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def lease_namespace(self) -> str:
        return self.run_id

    # --- before the run ------------------------------------------------------------------------------

    def prepare(self, namespaces: Sequence[str], nodes: Sequence[tuple[str, str, str]]) -> None:
        """Refuse what would touch others' objects, then install the CRDs, create the lab's namespace and
        the Nodes. ``nodes``: (name, pod CIDR, address) each."""
        self._wait_gone(self._terminating_lab_namespaces(namespaces), "a previous lab run's namespaces")
        taken = [ns for ns in [*namespaces, self.run_id] if self.client.get(f"/api/v1/namespaces/{ns}") is not None]
        if taken:
            raise ExternalError(f"namespace {', '.join(taken)} already exists on {self.client.server}: the lab "
                                "creates its own namespaces and removes them at the end, so it never uses one it "
                                "did not create (delete them, or rename the scenario's)")
        existing = [name for name, _, _ in nodes if self.client.get(f"/api/v1/nodes/{name}") is not None]
        if existing:
            raise ExternalError(f"node {', '.join(existing)} already exists on {self.client.server}: the lab's "
                                "simulated nodes must be new (rename them under the scenario's nodes)")
        self._install_crds()
        slices = self.client.list(SLICES).get("items") or []
        if slices:
            raise ExternalError(f"{len(slices)} PodSlices already exist on {self.client.server}: a podmeter "
                                "operator publishes there, and the lab's operator would rewrite its slices; run "
                                "the lab against a cluster without podmeter")
        self.slices_ours = True
        self.had_configuration = self.client.get(MCONF_DEFAULT) is not None
        if self.had_configuration:
            self.notes.append("the API server has a `default` MetricsConfiguration: the lab never changes it, "
                              "and skips the scenario's configure steps")
        self.client.create("/api/v1/namespaces", {"metadata": {"name": self.run_id, "labels": self.labels}})
        for name, cidr, address in nodes:
            self._create_node(name, cidr, address)
        if self.node_leases:
            self._heartbeat = threading.Thread(target=self._beat, name="lab-node-leases", daemon=True)
            self._heartbeat.start()

    def _install_crds(self) -> None:
        for path in crd_files():
            crd = yaml.safe_load(path.read_text())
            name = crd["metadata"]["name"]
            if self.client.get(f"{CRDS}/{name}") is not None:
                continue
            crd.setdefault("metadata", {}).setdefault("labels", {}).update(self.labels)
            self.client.create(CRDS, crd)
            self.crds.append(name)
            self.notes.append(f"installed the CRD {name} (removed at the end)")
        for served in (SLICES, "/apis/podmeter.io/v1alpha1/metricsconfigurations"):
            self._wait(functools.partial(self._served, served), f"{served} served (CRDs installed: "
                       f"{', '.join(self.crds) or 'none'})")

    def _served(self, path: str) -> bool:
        try:
            self.client.list(path, limit="1")
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def _terminating_lab_namespaces(self, namespaces: Sequence[str]) -> list[str]:
        """Those of ``namespaces`` a lab run created and deleted, that a real API server is still finalizing
        (it deletes a namespace's objects before the namespace, asynchronously): the run waits for them
        rather than refusing. One that is not terminating, or not the lab's, is refused as taken."""
        found = []
        for ns in namespaces:
            obj = self.client.get(f"/api/v1/namespaces/{ns}")
            meta = (obj or {}).get("metadata") or {}
            if obj is not None and LAB_LABEL in (meta.get("labels") or {}) and (
                    meta.get("deletionTimestamp") or (obj.get("status") or {}).get("phase") == "Terminating"):
                found.append(ns)
        return found

    def _wait_gone(self, namespaces: Sequence[str], what: str) -> list[str]:
        """Wait until ``namespaces`` are gone, saying every few seconds which are left; those left after
        ``timeout`` (the server never finished: a finalizer nobody removes, a controller manager not running)."""
        left, timeout = list(namespaces), NAMESPACE_GONE_S
        started = last_said = time.monotonic()
        while left:
            left = [ns for ns in left if self.client.get(f"/api/v1/namespaces/{ns}") is not None]
            now = time.monotonic()
            if not left:
                break
            if now - started > timeout:
                log.warning("%s still terminating after %.0f s: %s", what, timeout, ", ".join(left))
                return left
            if now - last_said >= PROGRESS_S:
                last_said = now
                print(f"podmeter lab: waiting for {what} to be gone ({now - started:.0f} s): {', '.join(left)}",
                      flush=True)
            time.sleep(POLL_S)
        return []

    @staticmethod
    def _wait(done: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise ExternalError(f"not {what} within {timeout:g} s")
            time.sleep(0.2)

    def _create_node(self, name: str, cidr: str, address: str) -> None:
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {**self.labels, "kubernetes.io/hostname": name}},
                "spec": {"podCIDR": cidr, "podCIDRs": [cidr]}}
        self.client.create("/api/v1/nodes", body)
        self.nodes.append(name)
        now = _now()
        status = {"addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}],
                  "conditions": [{"type": "Ready", "status": "True", "reason": "PodmeterLab",
                                  "message": f"a simulated node of podmeter lab run {self.run_id}",
                                  "lastHeartbeatTime": now, "lastTransitionTime": now}]}
        with contextlib.suppress(KubeError):
            self.client.patch(f"/api/v1/nodes/{name}/status", {"status": status})
        if self.client.get("/api/v1/namespaces/kube-node-lease") is not None:
            lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                     "metadata": {"name": name, "labels": self.labels},
                     "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now}}
            self.client.create(NODE_LEASES, lease)
            self.node_leases.append(name)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for name in self.node_leases:
                with contextlib.suppress(KubeError):
                    self.client.patch(f"{NODE_LEASES}/{name}", {"spec": {"renewTime": _now()}})

    # --- the steps -------------------------------------------------------------------------------------

    def allows(self, step_kind: str) -> bool:
        """Whether a step can run against this server (fault knobs need the embedded one; the cluster's
        own MetricsConfiguration is never changed)."""
        if step_kind in ("fault", "compaction-gap"):
            return False
        return not (step_kind == "configure" and self.had_configuration)

    # --- the end ----------------------------------------------------------------------------------------

    def cleanup(self, namespaces: Sequence[str]) -> list[str]:
        """Remove everything the lab created (what is already gone is fine); what could not be removed."""
        self._stop.set()
        problems: list[str] = []

        def attempt(what: str, path: str, grace: int | None = None) -> None:
            try:
                self.client.delete(path, grace_seconds=grace)
            except KubeError as exc:
                if exc.status != 404:
                    problems.append(f"{what}: {exc}")

        ours = [ns for ns in [*namespaces, self.run_id] if self._labelled(f"/api/v1/namespaces/{ns}")]
        for ns in ours:
            for pod in self._items(pod_path(ns)):
                attempt(f"pod {ns}/{pod}", pod_path(ns, pod), grace=0)
            attempt(f"namespace {ns}", f"/api/v1/namespaces/{ns}")
        # A real API server finalizes namespaces asynchronously: the next run starts clean only once they are gone.
        for ns in self._wait_gone(ours, "the lab's namespaces"):
            problems.append(f"namespace {ns}: still terminating after {NAMESPACE_GONE_S:.0f} s (the API server "
                            "has not finished deleting it; the next run waits for it)")
        for name in self.node_leases:
            attempt(f"node lease {name}", f"{NODE_LEASES}/{name}")
        for name in self.nodes:
            attempt(f"node {name}", f"/api/v1/nodes/{name}")
        for name in self._items(SLICES) if self.slices_ours else ():  # the lab operator's (prepare refused others)
            attempt(f"PodSlice {name}", f"{SLICES}/{name}")
        if self.had_configuration is False:
            attempt("MetricsConfiguration default", MCONF_DEFAULT)
        for name in self.crds:
            attempt(f"CRD {name}", f"{CRDS}/{name}")
        return problems

    def _labelled(self, path: str) -> bool:
        try:
            obj = self.client.get(path)
        except KubeError:
            return False
        return obj is not None and (obj.get("metadata", {}).get("labels") or {}).get(LAB_LABEL) == self.run_id

    def _items(self, path: str) -> Iterator[str]:
        try:
            items: list[dict[str, Any]] = self.client.list(path).get("items") or []
        except KubeError:
            return
        for item in items:
            yield str(item["metadata"]["name"])
