"""Builders of Kubernetes-shaped JSON for tests; every record goes through the real decoder."""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any

from podmeter.model.records import OBSERVE_ANNOTATION, Namespace, Pod, decode_namespace, decode_pod

_rv = itertools.count(1)


def pod_json(
    name: str,
    namespace: str = "default",
    *,
    uid: str | None = None,
    ips: tuple[str, ...] = (),
    node: str = "node-a",
    observe: bool = False,
    host_network: bool = False,
    phase: str = "Running",
    labels: dict[str, str] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid or str(uuid.uuid4()),
        "resourceVersion": str(next(_rv)),
        "labels": labels or {"app": name},
    }
    if observe:
        meta["annotations"] = {OBSERVE_ANNOTATION: "true"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T12:00:00Z"
    status: dict[str, Any] = {"phase": phase}
    if ips:
        status["podIP"] = ips[0]
        status["podIPs"] = [{"ip": ip} for ip in ips]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": meta,
        "spec": {"nodeName": node, "hostNetwork": host_network, "containers": [{"name": "c", "image": "x"}]},
        "status": status,
    }


def make_pod(name: str, namespace: str = "default", **kwargs: Any) -> Pod:
    return decode_pod(json.dumps(pod_json(name, namespace, **kwargs)).encode())


def namespace_json(name: str, *, observe: bool = False, phase: str = "Active") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"ns-{name}", "resourceVersion": str(next(_rv))}
    if observe:
        meta["annotations"] = {OBSERVE_ANNOTATION: "true"}
    return {"kind": "Namespace", "apiVersion": "v1", "metadata": meta, "status": {"phase": phase}}


def make_namespace(name: str, *, observe: bool = False) -> Namespace:
    return decode_namespace(json.dumps(namespace_json(name, observe=observe)).encode())


def with_changes(pod: Pod, **changes: Any) -> Pod:
    """A new state of the same pod (same UID), with a new resourceVersion."""
    import msgspec

    return msgspec.structs.replace(pod, resource_version=str(next(_rv)), **changes)
