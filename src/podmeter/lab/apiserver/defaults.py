"""Server-side defaulting and managedFields, as create-pod-bound.json shows the real server filling them in.

kubectl and client libraries read some defaults back (``restartPolicy``, ``dnsPolicy``, ``status.phase``),
and realistic objects make the lab's memory and speed figures honest, so a created pod gets what a real
one gets: container defaults, the projected service-account token volume, tolerations, qosClass.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# What the real server's admission adds to every pod (DefaultTolerationSeconds).
TOLERATIONS = [
    {
        "key": "node.kubernetes.io/not-ready",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 300,
    },
    {
        "key": "node.kubernetes.io/unreachable",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 300,
    },
]
_SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def _token_volume(seed: str) -> dict[str, Any]:
    suffix = hashlib.sha256(seed.encode()).hexdigest()[:5]
    return {
        "name": f"kube-api-access-{suffix}",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {
                    "downwardAPI": {
                        "items": [
                            {
                                "path": "namespace",
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                            }
                        ]
                    }
                },
            ],
            "defaultMode": 420,
        },
    }


def _default_container(c: dict[str, Any], volume: str | None) -> None:
    c.setdefault("resources", {})
    if volume and not any(m.get("mountPath") == _SA_MOUNT for m in c.get("volumeMounts") or []):
        c.setdefault("volumeMounts", []).append({"name": volume, "readOnly": True, "mountPath": _SA_MOUNT})
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    image = str(c.get("image", ""))
    c.setdefault(
        "imagePullPolicy",
        "Always" if image.endswith(":latest") or ":" not in image.rsplit("/", 1)[-1] else "IfNotPresent",
    )
    for port in c.get("ports") or []:
        if isinstance(port, dict):
            port.setdefault("protocol", "TCP")


def _qos(spec: dict[str, Any]) -> str:
    resources = [c.get("resources") or {} for c in spec.get("containers") or [] if isinstance(c, dict)]
    if not any(r.get("requests") or r.get("limits") for r in resources):
        return "BestEffort"
    guaranteed = all(
        r.get("limits")
        and set(r["limits"]) >= {"cpu", "memory"}
        and all((r.get("requests") or r["limits"]).get(k) == r["limits"].get(k) for k in ("cpu", "memory"))
        for r in resources
    )
    return "Guaranteed" if guaranteed else "Burstable"


def default_pod(pod: dict[str, Any]) -> None:
    """Fill the fields a real API server defaults on pod creation (in place)."""
    spec = pod.setdefault("spec", {})
    if not isinstance(spec, dict):
        return
    meta = pod.get("metadata") or {}
    sa = spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
    volume = None
    if spec.get("automountServiceAccountToken", True) is not False:
        token = _token_volume(f"{meta.get('namespace')}/{meta.get('name')}/{meta.get('uid')}")
        volume = token["name"]
        volumes = spec.get("volumes")
        spec["volumes"] = [*(volumes if isinstance(volumes, list) else []), token]
    # Re-insert containers after volumes so key order matches the real server's output.
    for key in ("containers", "initContainers"):
        if key in spec:
            spec[key] = spec.pop(key)
    for c in spec.get("containers") or []:
        if isinstance(c, dict):
            _default_container(c, volume)
    for c in spec.get("initContainers") or []:
        if isinstance(c, dict):
            _default_container(c, volume)
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.pop("serviceAccountName")
    spec["serviceAccountName"] = sa
    spec["serviceAccount"] = sa
    if "nodeName" in spec:
        spec["nodeName"] = spec.pop("nodeName")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    raw_tolerations = spec.get("tolerations")
    tolerations: list[Any] = raw_tolerations if isinstance(raw_tolerations, list) else []
    spec["tolerations"] = tolerations + [t for t in TOLERATIONS if t not in tolerations]
    spec.setdefault("priority", 0)
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    raw_status = pod.get("status")
    status: dict[str, Any] = raw_status if isinstance(raw_status, dict) else {}
    pod["status"] = {"phase": "Pending", **status}
    pod["status"].setdefault("qosClass", _qos(spec))
    sync_pod_ips(pod["status"])


def sync_pod_ips(status: dict[str, Any]) -> None:
    """Keep ``podIP`` and ``podIPs[0]`` consistent the way the real server's v1 conversion does: when both
    are given and differ, ``podIP`` wins (for older clients) and ``podIPs`` becomes ``[podIP]``."""
    pod_ip = status.get("podIP")
    pod_ips = status.get("podIPs")
    first = pod_ips[0] if isinstance(pod_ips, list) and pod_ips else None
    first_ip = first.get("ip") if isinstance(first, dict) else None
    if pod_ip and first_ip != pod_ip:
        status["podIPs"] = [{"ip": pod_ip}]
    elif first_ip and not pod_ip:
        status["podIP"] = first_ip


def default_namespace(ns: dict[str, Any]) -> None:
    meta = ns["metadata"]
    labels = meta.get("labels") if isinstance(meta.get("labels"), dict) else {}
    meta["labels"] = {**labels, "kubernetes.io/metadata.name": meta["name"]}
    ns["spec"] = {"finalizers": ["kubernetes"]}
    ns["status"] = {"phase": "Active"}


# --- managedFields ---------------------------------------------------------------------------------------

_SKIP_META = {
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "managedFields",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "selfLink",
}
_LIST_KEYS = ("name", "type", "ip", "uid", "key", "mountPath", "containerPort")


def fields_v1(value: Any, top: bool = True) -> dict[str, Any]:
    """A FieldsV1 set for ``value``: maps become ``f:`` keys, keyed lists ``k:{...}`` entries."""
    out: dict[str, Any] = {}
    if isinstance(value, dict):
        for key in sorted(value):
            if top and key in ("kind", "apiVersion"):
                continue
            sub = value[key]
            if top and key == "metadata" and isinstance(sub, dict):
                sub = {k: v for k, v in sub.items() if k not in _SKIP_META}
                if not sub:
                    continue
            child = fields_v1(sub, top=False)
            out[f"f:{key}"] = {".": {}, **child} if child and not top else child
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                key = next((k for k in _LIST_KEYS if k in item), None)
                if key is not None:
                    entry_key = "k:" + json.dumps({key: item[key]}, separators=(",", ":"))
                    out[entry_key] = {".": {}, **fields_v1(item, top=False)}
    return out


def _union(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        out[key] = _union(out[key], value) if isinstance(out.get(key), dict) else value
    return out


def record_manager(
    obj: dict[str, Any],
    *,
    manager: str,
    api_version: str,
    now: str,
    touched: dict[str, Any],
    subresource: str | None = None,
) -> None:
    """Merge ``touched`` (the request's content) into the entry of ``manager`` in ``managedFields``."""
    fields = fields_v1(touched)
    if not fields:
        return
    meta = obj["metadata"]
    entries = meta.get("managedFields") if isinstance(meta.get("managedFields"), list) else []
    for entry in entries:
        if (
            isinstance(entry, dict)
            and entry.get("manager") == manager
            and entry.get("operation") == "Update"
            and entry.get("subresource") == subresource
        ):
            entry["fieldsV1"] = _union(entry.get("fieldsV1") or {}, fields)
            entry["time"] = now
            break
    else:
        entry = {
            "manager": manager,
            "operation": "Update",
            "apiVersion": api_version,
            "time": now,
            "fieldsType": "FieldsV1",
            "fieldsV1": fields,
        }
        if subresource:
            entry["subresource"] = subresource
        entries.append(entry)
    meta["managedFields"] = entries


# --- EndpointSlices -----------------------------------------------------------------------------------------

_ENDPOINT_ORDER = ("addresses", "conditions", "hostname", "targetRef", "nodeName", "zone", "hints",
                   "deprecatedTopology")
_CONDITION_ORDER = ("ready", "serving", "terminating")
_TARGET_REF_ORDER = ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")
_ENDPOINT_PORT_ORDER = ("name", "protocol", "port", "appProtocol")


def _ordered(d: dict[str, Any], order: tuple[str, ...]) -> dict[str, Any]:
    return {**{k: d[k] for k in order if k in d and d[k] is not None},
            **{k: v for k, v in d.items() if k not in order and v is not None}}


def _endpoint(endpoint: dict[str, Any]) -> dict[str, Any]:
    endpoint = dict(endpoint)
    conditions = endpoint.get("conditions")
    endpoint["conditions"] = _ordered(conditions, _CONDITION_ORDER) if isinstance(conditions, dict) else (
        {} if conditions is None else conditions)
    if isinstance(endpoint.get("targetRef"), dict):
        endpoint["targetRef"] = _ordered(endpoint["targetRef"], _TARGET_REF_ORDER)
    rest = _ordered(endpoint, _ENDPOINT_ORDER)
    return {"addresses": endpoint.get("addresses"), **{k: v for k, v in rest.items() if k != "addresses"}}


def default_endpointslice(obj: dict[str, Any]) -> None:
    """discovery/v1 defaulting (a port's ``name`` is ``""`` and its ``protocol`` TCP when absent), the v1
    type's field order (``conditions`` always present) and what a read from etcd gives: empty ``endpoints``
    and ``ports`` come back as ``null`` (the fields have no ``omitempty``)."""
    endpoints = obj.get("endpoints")
    if isinstance(endpoints, list):
        endpoints = [_endpoint(e) if isinstance(e, dict) else e for e in endpoints]
    ports = obj.get("ports")
    if isinstance(ports, list):
        ports = [
            _ordered({"name": "", "protocol": "TCP", **{k: v for k, v in p.items() if v is not None}},
                     _ENDPOINT_PORT_ORDER) if isinstance(p, dict) else p
            for p in ports
        ]
    rest = {k: v for k, v in obj.items() if k not in ("metadata", "addressType", "endpoints", "ports")}
    address_type = obj.get("addressType", "")
    for key in list(obj):
        if key != "metadata":
            del obj[key]
    obj["addressType"] = address_type
    obj["endpoints"] = endpoints or None
    obj["ports"] = ports or None
    obj.update(rest)
