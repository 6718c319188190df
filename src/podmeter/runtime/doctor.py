"""``podmeter doctor``: audit one node's pinned filter map against the API server's truth.

The audit shares nothing with a running agent but the model's rules: it lists the node's pods, the
namespaces and the ``default`` MetricsConfiguration itself, decodes them with the model's records,
computes the desired filter from scratch (:meth:`NodeView.recompute`, the same interest functions the
agent uses) and compares it with the kernel map read directly through its pin. Each difference is named:

* **leaked**: in the kernel, desired by nobody; the pods of the node whose status still carries the IP
  are named with the reason they do not count (finished, host network, not observed);
* **missing**: desired for observed pods (named) but not in the kernel, unless the map is full of desired
  IPs only, which is the documented overflow (reported, not drift).

An agent that is busy writing may show a difference for an instant; doctor is a point-in-time audit, so
``--recheck S`` repeats it after S seconds and reports only what persisted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from podmeter.adapters.kube.connection import Connection
from podmeter.model.configuration import DEFAULT_NAME, decode_configuration
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Replace, Upsert
from podmeter.model.records import TERMINAL_PHASES, DecodeError, Pod, decode_namespace, decode_pod
from podmeter.model.view import NodeView

CONFIG_PATH = f"/apis/podmeter.io/v1alpha1/metricsconfigurations/{DEFAULT_NAME}"
NOT_OBSERVED = "not observed"  # what why_not_counted says of an eligible pod nobody asked for


class DoctorError(RuntimeError):
    """The truth could not be read (API server unreachable, refused, or answered garbage)."""


@dataclass(frozen=True)
class Finding:
    kind: str  # "leaked" | "missing"
    ip: str
    pods: tuple[str, ...]  # "namespace/name (why)" for leaked; owners for missing

    def line(self) -> str:
        who = ", ".join(self.pods) if self.pods else "no pod of this node has it"
        return f"{self.kind:7} {self.ip:<39} {who}"


@dataclass
class Audit:
    node: str
    desired: int
    kernel: int
    capacity: int
    findings: list[Finding] = field(default_factory=list)
    overflow: int = 0  # desired IPs waiting for room (the map is full of desired IPs)
    skipped: list[str] = field(default_factory=list)  # objects that could not be decoded

    @property
    def clean(self) -> bool:
        return not self.findings

    def as_json(self) -> dict[str, Any]:
        return {"node": self.node, "desired": self.desired, "kernel": self.kernel, "capacity": self.capacity,
                "overflow": self.overflow, "clean": self.clean, "skipped": self.skipped,
                "findings": [{"kind": f.kind, "ip": f.ip, "pods": list(f.pods)} for f in self.findings]}

    def render(self) -> str:
        lines = [f"node {self.node}: {self.desired} desired IPs, {self.kernel} kernel entries "
                 f"(capacity {self.capacity})"]
        lines += [f.line() for f in self.findings]
        if self.overflow:
            lines.append(f"overflow: the map is full of desired IPs; {self.overflow} desired IPs wait for room")
        lines += [f"skipped (cannot decode): {s}" for s in self.skipped]
        lines.append("clean: the kernel map matches the API server" if self.clean
                     else f"drift: {len(self.findings)} IPs differ")
        return "\n".join(lines)


async def read_view(connection: Connection, node_name: str) -> tuple[NodeView, list[str]]:
    """The node's desired state computed from the API server, and the objects that could not be decoded."""
    client = connection.transport()
    skipped: list[str] = []
    try:
        view = NodeView(node_name)
        namespaces = await _list(client, "/api/v1/namespaces", {})
        view.apply(Replace(NAMESPACES, _decoded(namespaces, decode_namespace, skipped)))
        config = await _get(client, CONFIG_PATH)
        if config is not None:
            try:
                view.apply(Upsert(CONFIGURATIONS, decode_configuration(config)))
            except DecodeError as exc:
                skipped.append(f"{exc} (an invalid configuration: annotations only, as without one)")
        pods = await _list(client, "/api/v1/pods", {"fieldSelector": f"spec.nodeName={node_name}"})
        view.apply(Replace(PODS, _decoded(pods, decode_pod, skipped)))
        return view, skipped
    finally:
        await client.close()


def audit(view: NodeView, kernel: set[str], capacity: int, skipped: list[str] | None = None) -> Audit:
    """Compare the kernel map with the view's from-scratch desired filter."""
    desired = view.recompute()
    result = Audit(view.node_name or "", len(desired), len(kernel), capacity, skipped=skipped or [])
    for ip in sorted(kernel - desired.keys()):
        holders = tuple(f"{p.key} ({why_not_counted(p)})" for p in view.pods.values() if ip in p.ips)
        result.findings.append(Finding("leaked", ip, holders))
    missing = sorted(desired.keys() - kernel)
    if missing and len(kernel) >= capacity and kernel <= desired.keys():
        result.overflow = len(missing)
        return result
    for ip in missing:
        owners = tuple(sorted(view.pods[uid].key for uid in desired[ip]))
        result.findings.append(Finding("missing", ip, owners))
    return result


def why_not_counted(pod: Pod) -> str:
    """Why a pod that lists an IP does not hold it in the filter (invariant I3): ``hostNetwork`` or its
    terminal phase when it is not eligible, else ``not observed`` (eligible, but nobody asked for it).
    The doctor and the lab's checker name the holders of a leaked IP with it."""
    if pod.host_network:
        return "hostNetwork"
    if pod.phase in TERMINAL_PHASES:
        return pod.phase
    return NOT_OBSERVED


def _decoded(items: list[Any], decode: Any, skipped: list[str]) -> list[Any]:
    result = []
    for item in items:
        try:
            result.append(decode(item))
        except DecodeError as exc:
            skipped.append(str(exc))
    return result


async def _list(client: Any, path: str, params: dict[str, str]) -> list[Any]:
    items: list[Any] = []
    query = dict(params, limit="500")
    while True:
        data = await _get(client, path, query)
        if data is None:
            raise DoctorError(f"{path}: not found on the API server")
        items += data.get("items") or []
        token = (data.get("metadata") or {}).get("continue")
        if not token:
            return items
        query = dict(params, limit="500", **{"continue": token})


async def _get(client: Any, path: str, params: dict[str, str] | None = None) -> dict[str, Any] | None:
    try:
        answer = await client.get(path, params or {}, 30.0)
    except Exception as exc:  # the transport's errors and timeouts: the audit cannot proceed
        raise DoctorError(f"GET {path}: {exc}") from exc
    if answer.status == 404:
        return None
    if answer.status != 200:
        raise DoctorError(f"GET {path}: {answer.status} {answer.reason}: {answer.body[:200]!r}")
    try:
        data: dict[str, Any] = json.loads(answer.body)
    except ValueError as exc:
        raise DoctorError(f"GET {path}: not JSON: {exc}") from exc
    return data
