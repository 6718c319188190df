"""Server-side printing: the ``meta.k8s.io/v1`` Table kubectl asks for on ``get`` (``Accept: ...;as=Table``).

Without it kubectl can only show NAME and AGE; with it ``kubectl get pods`` shows READY, STATUS,
RESTARTS and, with ``-o wide``, IP and NODE, computed here the way the real server's printers do. Rows carry
the object as ``includeObject`` asks (``Metadata``, the default: PartialObjectMetadata; ``Object``; ``None``).
On a watch every event's object becomes a one-row Table; only the first carries the column definitions.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from podmeter.lab.apiserver.resources import (
    ENDPOINTSLICES,
    LEASES,
    METRICSCONFIGURATIONS,
    NAMESPACES,
    PODS,
    SERVICES,
    ResourceType,
)
from podmeter.lab.apiserver.store import decode, encode

Row = Callable[[dict[str, Any]], list[Any]]


def wants_table(accept: str) -> str | None:
    """The Table version the client accepts (``v1`` or ``v1beta1``), or None."""
    for part in accept.split(","):
        params = dict(p.strip().split("=", 1) for p in part.split(";")[1:] if "=" in p)
        if params.get("as") == "Table" and params.get("g") == "meta.k8s.io":
            return params.get("v", "v1")
    return None


def _age(meta: dict[str, Any]) -> str:
    created = meta.get("creationTimestamp")
    if not isinstance(created, str):
        return "<unknown>"
    try:
        seconds = int((datetime.now(UTC) - datetime.fromisoformat(created.replace("Z", "+00:00"))).total_seconds())
    except ValueError:
        return "<invalid>"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _column(name: str, kind: str = "string", priority: int = 0, fmt: str = "") -> dict[str, Any]:
    return {"name": name, "type": kind, "format": fmt, "description": name, "priority": priority}


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _pod_row(obj: dict[str, Any]) -> list[Any]:
    meta, spec, status = _dict(obj.get("metadata")), _dict(obj.get("spec")), _dict(obj.get("status"))
    raw_containers = spec.get("containers")
    containers: list[Any] = raw_containers if isinstance(raw_containers, list) else []
    statuses = [s for s in status.get("containerStatuses") or [] if isinstance(s, dict)]
    ready = sum(1 for s in statuses if s.get("ready"))
    restarts = sum(int(s.get("restartCount") or 0) for s in statuses)
    phase = "Terminating" if meta.get("deletionTimestamp") else status.get("reason") or status.get("phase", "")
    return [
        meta.get("name"),
        f"{ready}/{len(containers)}",
        phase,
        restarts,
        _age(meta),
        status.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>",
        status.get("nominatedNodeName") or "<none>",
        "<none>",
    ]


def _ns_row(obj: dict[str, Any]) -> list[Any]:
    meta = _dict(obj.get("metadata"))
    return [meta.get("name"), _dict(obj.get("status")).get("phase", ""), _age(meta)]


def _lease_row(obj: dict[str, Any]) -> list[Any]:
    meta = _dict(obj.get("metadata"))
    return [meta.get("name"), _dict(obj.get("spec")).get("holderIdentity") or "", _age(meta)]


def _config_row(obj: dict[str, Any]) -> list[Any]:
    """The CRD's additionalPrinterColumns: the Accepted condition's status and reason."""
    meta = _dict(obj.get("metadata"))
    conditions = _dict(obj.get("status")).get("conditions")
    accepted = (
        next((c for c in conditions if isinstance(c, dict) and c.get("type") == "Accepted"), {})
        if isinstance(conditions, list)
        else {}
    )
    return [meta.get("name"), accepted.get("status", ""), accepted.get("reason", ""), _age(meta)]


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _external_ip(spec: dict[str, Any], status: dict[str, Any]) -> str:
    """printService's EXTERNAL-IP (the server prints wide: no truncation)."""
    external = [str(ip) for ip in _list(spec.get("externalIPs"))]
    kind = spec.get("type")
    if kind in ("ClusterIP", "NodePort"):
        return ",".join(external) or "<none>"
    if kind == "LoadBalancer":
        ingress = _list(_dict(status.get("loadBalancer")).get("ingress"))
        balancers = [str(i.get("ip") or i.get("hostname")) for i in ingress if isinstance(i, dict)
                     and (i.get("ip") or i.get("hostname"))]
        return ",".join(balancers + external) or "<pending>"
    if kind == "ExternalName":
        return str(spec.get("externalName") or "")
    return "<unknown>"


def _service_row(obj: dict[str, Any]) -> list[Any]:
    meta, spec, status = _dict(obj.get("metadata")), _dict(obj.get("spec")), _dict(obj.get("status"))
    ips = _list(spec.get("clusterIPs"))
    ports = []
    for port in _list(spec.get("ports")):
        p = _dict(port)
        node = f":{p['nodePort']}" if p.get("nodePort") else ""
        ports.append(f"{p.get('port', 0)}{node}/{p.get('protocol', '')}")
    selector = _dict(spec.get("selector"))
    return [
        meta.get("name"),
        spec.get("type", ""),
        ips[0] if ips else "<none>",
        _external_ip(spec, status),
        ",".join(ports) or "<none>",
        _age(meta),
        ",".join(f"{k}={v}" for k, v in sorted(selector.items())) or "<none>",
    ]


def _more(items: list[str], count: int, limit: int = 3) -> str:
    """listWithMoreString: the first three, then "+ N more..."."""
    text = ",".join(items[:limit])
    if count > limit:
        return f"{text} + {count - limit} more..."
    return text or "<unset>"


def _endpointslice_row(obj: dict[str, Any]) -> list[Any]:
    meta = _dict(obj.get("metadata"))
    ports = []
    for port in _list(obj.get("ports")):
        p = _dict(port)
        ports.append(str(p["port"]) if p.get("port") is not None else str(p.get("name") or "*"))
    addresses = [str(a) for e in _list(obj.get("endpoints")) for a in _list(_dict(e).get("addresses"))]
    return [
        meta.get("name"),
        obj.get("addressType", ""),
        _more(ports, len(ports)),
        _more(addresses, len(addresses)),
        _age(meta),
    ]


def _plain_row(obj: dict[str, Any]) -> list[Any]:
    meta = _dict(obj.get("metadata"))
    return [meta.get("name"), _age(meta)]


_NAME = _column("Name", fmt="name")
PRINTERS: dict[str, tuple[list[dict[str, Any]], Row]] = {
    PODS.key: (
        [
            _NAME,
            _column("Ready"),
            _column("Status"),
            _column("Restarts", "string"),
            _column("Age"),
            _column("IP", priority=1),
            _column("Node", priority=1),
            _column("Nominated Node", priority=1),
            _column("Readiness Gates", priority=1),
        ],
        _pod_row,
    ),
    NAMESPACES.key: ([_NAME, _column("Status"), _column("Age")], _ns_row),
    SERVICES.key: (
        [
            _NAME,
            _column("Type"),
            _column("Cluster-IP"),
            _column("External-IP"),
            _column("Port(s)"),
            _column("Age"),
            _column("Selector", priority=1),
        ],
        _service_row,
    ),
    ENDPOINTSLICES.key: (
        [_NAME, _column("AddressType"), _column("Ports"), _column("Endpoints"), _column("Age")],
        _endpointslice_row,
    ),
    LEASES.key: ([_NAME, _column("Holder"), _column("Age")], _lease_row),
    METRICSCONFIGURATIONS.key: ([_NAME, _column("Accepted"), _column("Reason"), _column("Age", "date")], _config_row),
}


def _row(resource: ResourceType, obj: dict[str, Any], include: str, version: str) -> dict[str, Any]:
    _, printer = PRINTERS.get(resource.key, ([], _plain_row))
    row: dict[str, Any] = {"cells": printer(obj)}
    if include == "Object":
        row["object"] = {"kind": resource.kind, "apiVersion": resource.api_version, **obj}
    elif include != "None":
        row["object"] = {
            "kind": "PartialObjectMetadata",
            "apiVersion": f"meta.k8s.io/{version}",
            "metadata": obj.get("metadata", {}),
        }
    return row


def _columns(resource: ResourceType) -> list[dict[str, Any]]:
    return PRINTERS.get(resource.key, ([_NAME, _column("Age")], _plain_row))[0]


def list_table(resource: ResourceType, list_body: bytes, include: str, version: str) -> bytes:
    """A list response turned into a Table (same list metadata: resourceVersion, continue)."""
    doc = decode(list_body)
    rows = [_row(resource, item, include, version) for item in doc.get("items", [])]
    return encode(
        {
            "kind": "Table",
            "apiVersion": f"meta.k8s.io/{version}",
            "metadata": doc.get("metadata", {}),
            "columnDefinitions": _columns(resource),
            "rows": rows,
        }
    )


def object_table(resource: ResourceType, obj_bytes: bytes, include: str, version: str) -> bytes:
    """A single object (``kubectl get pod NAME``) as a one-row Table."""
    obj = decode(obj_bytes)
    body = {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
    rv = _dict(body.get("metadata")).get("resourceVersion", "")
    return encode(
        {
            "kind": "Table",
            "apiVersion": f"meta.k8s.io/{version}",
            "metadata": {"resourceVersion": rv},
            "columnDefinitions": _columns(resource),
            "rows": [_row(resource, body, include, version)],
        }
    )


def watch_transform(resource: ResourceType, include: str, version: str) -> Callable[[bytes], bytes]:
    """A per-watcher rewrite of event lines into one-row Tables (ERROR and BOOKMARK lines pass through)."""
    first = [True]

    def transform(line: bytes) -> bytes:
        try:
            event = decode(line)
        except Exception:  # an injected garbage line goes out as it came in
            return line
        obj = event.get("object") if isinstance(event, dict) else None
        if event.get("type") not in ("ADDED", "MODIFIED", "DELETED") or not isinstance(obj, dict):
            return line
        body = {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
        table: dict[str, Any] = {
            "kind": "Table",
            "apiVersion": f"meta.k8s.io/{version}",
            "metadata": {"resourceVersion": _dict(body.get("metadata")).get("resourceVersion", "")},
        }
        table["columnDefinitions"] = _columns(resource) if first[0] else None
        first[0] = False
        table["rows"] = [_row(resource, body, include, version)]
        return encode({"type": event["type"], "object": table}) + b"\n"

    return transform
