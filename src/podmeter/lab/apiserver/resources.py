"""The resource types the lab API server serves, and what differs between them.

A :class:`ResourceType` carries everything the generic handlers need to treat namespaces, pods, leases and
metricsconfigurations like the real server does: URL coordinates, discovery data, which field selectors
exist, defaulting, validation, whether ``status`` is a subresource, whether ``generation`` is kept, and a
shallow schema of known fields (for ``fieldValidation``: unknown fields are dropped with a warning, or
refused with ``Strict``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podmeter.lab.apiserver import netvalidation, validation
from podmeter.lab.apiserver.defaults import default_endpointslice, default_namespace, default_pod
from podmeter.lab.apiserver.errors import Cause
from podmeter.lab.apiserver.services import default_service

# A schema node: a dict of known keys (value: sub-schema, or None for "anything below").
Schema = dict[str, Any]

# Object metadata fields in the order the real server writes them (also the order of our answers).
META_FIELDS = (
    "name",
    "generateName",
    "namespace",
    "selfLink",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "managedFields",
)
_META: Schema = dict.fromkeys(META_FIELDS)
_CONTAINER: Schema = {
    k: None
    for k in (
        "name",
        "image",
        "command",
        "args",
        "workingDir",
        "ports",
        "envFrom",
        "env",
        "resources",
        "resizePolicy",
        "restartPolicy",
        "restartPolicyRules",
        "volumeMounts",
        "volumeDevices",
        "livenessProbe",
        "readinessProbe",
        "startupProbe",
        "lifecycle",
        "terminationMessagePath",
        "terminationMessagePolicy",
        "imagePullPolicy",
        "securityContext",
        "stdin",
        "stdinOnce",
        "tty",
    )
}
_POD_SPEC: Schema = {
    k: None
    for k in (
        "volumes",
        "ephemeralContainers",
        "restartPolicy",
        "terminationGracePeriodSeconds",
        "activeDeadlineSeconds",
        "dnsPolicy",
        "nodeSelector",
        "serviceAccountName",
        "serviceAccount",
        "automountServiceAccountToken",
        "nodeName",
        "hostNetwork",
        "hostPID",
        "hostIPC",
        "shareProcessNamespace",
        "securityContext",
        "imagePullSecrets",
        "hostname",
        "subdomain",
        "affinity",
        "schedulerName",
        "tolerations",
        "hostAliases",
        "priorityClassName",
        "priority",
        "dnsConfig",
        "readinessGates",
        "runtimeClassName",
        "enableServiceLinks",
        "preemptionPolicy",
        "overhead",
        "topologySpreadConstraints",
        "setHostnameAsFQDN",
        "os",
        "hostUsers",
        "schedulingGates",
        "resourceClaims",
        "resources",
        "hostnameOverride",
    )
}
_POD_SPEC["containers"] = [_CONTAINER]
_POD_SPEC["initContainers"] = [_CONTAINER]
_POD_STATUS: Schema = {
    k: None
    for k in (
        "observedGeneration",
        "phase",
        "conditions",
        "message",
        "reason",
        "nominatedNodeName",
        "hostIP",
        "hostIPs",
        "podIP",
        "podIPs",
        "startTime",
        "initContainerStatuses",
        "containerStatuses",
        "qosClass",
        "ephemeralContainerStatuses",
        "resize",
        "resourceClaimStatuses",
        "extendedResourceClaimStatus",
    )
}


def _top(spec: Schema | None, status: Schema | None) -> Schema:
    out: Schema = {"kind": None, "apiVersion": None, "metadata": _META}
    if spec is not None:
        out["spec"] = spec
    if status is not None:
        out["status"] = status
    return out


def _get(obj: dict[str, Any], *path: str) -> Any:
    cur: Any = obj
    for key in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(key)
    return cur


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _meta_fields(obj: dict[str, Any], namespaced: bool) -> dict[str, str]:
    out = {"metadata.name": _text(_get(obj, "metadata", "name"))}
    if namespaced:
        out["metadata.namespace"] = _text(_get(obj, "metadata", "namespace"))
    return out


def _pod_fields(obj: dict[str, Any]) -> dict[str, str]:
    out = _meta_fields(obj, True)
    for key in ("nodeName", "restartPolicy", "schedulerName", "serviceAccountName"):
        out[f"spec.{key}"] = _text(_get(obj, "spec", key))
    out["spec.hostNetwork"] = "true" if _get(obj, "spec", "hostNetwork") is True else "false"
    out["status.phase"] = _text(_get(obj, "status", "phase"))
    ips = _get(obj, "status", "podIPs")
    first = ips[0].get("ip") if isinstance(ips, list) and ips and isinstance(ips[0], dict) else None
    out["status.podIP"] = _text(first or _get(obj, "status", "podIP"))
    out["status.podIPs"] = out["status.podIP"]
    out["status.nominatedNodeName"] = _text(_get(obj, "status", "nominatedNodeName"))
    return out


def _ns_fields(obj: dict[str, Any]) -> dict[str, str]:
    return {
        "metadata.name": _text(_get(obj, "metadata", "name")),
        "status.phase": _text(_get(obj, "status", "phase")),
    }


def _no_defaults(obj: dict[str, Any]) -> None:
    return None


def _no_checks(obj: dict[str, Any]) -> list[Cause]:
    return []


def _pod_checks(obj: dict[str, Any]) -> list[Cause]:
    causes = validation.validate_pod_spec(obj.get("spec"))
    status = obj.get("status")
    if isinstance(status, dict):
        causes += validation.validate_pod_ips(status)
    return causes


def _mc_checks(obj: dict[str, Any]) -> list[Cause]:
    spec = obj.get("spec")
    if spec is not None and not isinstance(spec, dict):
        return [
            Cause(
                "FieldValueTypeInvalid",
                'Invalid value: "string": spec in body must be of type object',
                "spec",
            )
        ]
    return []


@dataclass(frozen=True)
class ResourceType:
    """One served resource. ``key`` (``group/plural``, ``plural`` for the core group) names it internally."""

    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    verbs: tuple[str, ...]
    field_keys: tuple[str, ...]
    fields: Callable[[dict[str, Any]], dict[str, str]]
    schema: Schema
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    has_status: bool = True
    keeps_generation: bool = False
    # What a change of bumps ``metadata.generation`` (with ``keeps_generation``): ``spec`` for most kinds.
    spec_fields: tuple[str, ...] = ("spec",)
    unconditional_update: bool = True
    dns_label_names: bool = False
    dns1035_names: bool = False  # Services: ``metadata.name`` is a DNS-1035 label
    default: Callable[[dict[str, Any]], None] = _no_defaults
    default_on_update: bool = False  # the decoder's defaults apply to an update's body too
    validate: Callable[[dict[str, Any]], list[Cause]] = _no_checks
    # An update's checks (old, new), instead of ``validate``, when the kind has update rules.
    validate_update: Callable[[dict[str, Any], dict[str, Any]], list[Cause]] | None = None
    # Strategic merge patch: list merge keys that differ from the shared table (None: the list is atomic).
    merge_keys: dict[str, str | None] = field(default_factory=dict)
    bookmark_skeleton: dict[str, Any] = field(default_factory=dict)
    # What the real server's typed decoder refuses with a 400 before validating (a string for an int).
    decode_check: Callable[[dict[str, Any]], str | None] | None = None

    @property
    def key(self) -> str:
        return f"{self.group}/{self.plural}" if self.group else self.plural

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def prefix(self) -> bytes:
        """Bytes that make a stored body (which lacks them) a full object: ``{"kind":..,"apiVersion":..,``."""
        return f'{{"kind":"{self.kind}","apiVersion":"{self.api_version}",'.encode()


_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")

NAMESPACES = ResourceType(
    group="",
    version="v1",
    plural="namespaces",
    singular="namespace",
    kind="Namespace",
    namespaced=False,
    verbs=("create", "delete", "get", "list", "patch", "update", "watch"),
    field_keys=("metadata.name", "status.phase"),
    fields=_ns_fields,
    schema=_top({"finalizers": None}, {"phase": None, "conditions": None}),
    short_names=("ns",),
    dns_label_names=True,
    default=default_namespace,
    bookmark_skeleton={"spec": {}, "status": {}},
)
PODS = ResourceType(
    group="",
    version="v1",
    plural="pods",
    singular="pod",
    kind="Pod",
    namespaced=True,
    verbs=_VERBS,
    field_keys=(
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.podIPs",
        "status.nominatedNodeName",
    ),
    fields=_pod_fields,
    schema=_top(_POD_SPEC, _POD_STATUS),
    short_names=("po",),
    categories=("all",),
    keeps_generation=True,
    unconditional_update=False,
    default=default_pod,
    validate=_pod_checks,
    bookmark_skeleton={"spec": {"containers": None}, "status": {}},
)
LEASES = ResourceType(
    group="coordination.k8s.io",
    version="v1",
    plural="leases",
    singular="lease",
    kind="Lease",
    namespaced=True,
    verbs=_VERBS,
    field_keys=("metadata.name", "metadata.namespace"),
    fields=lambda o: _meta_fields(o, True),
    schema=_top(
        {
            k: None
            for k in (
                "holderIdentity",
                "leaseDurationSeconds",
                "acquireTime",
                "renewTime",
                "leaseTransitions",
                "strategy",
                "preferredHolder",
            )
        },
        None,
    ),
    has_status=False,
    bookmark_skeleton={"spec": {}},
    validate=validation.validate_lease,
    decode_check=validation.lease_type_errors,
)
METRICSCONFIGURATIONS = ResourceType(
    group="podmeter.io",
    version="v1alpha1",
    plural="metricsconfigurations",
    singular="metricsconfiguration",
    kind="MetricsConfiguration",
    namespaced=False,
    verbs=_VERBS,
    field_keys=("metadata.name",),
    fields=lambda o: _meta_fields(o, False),
    schema={**_top(None, None), "spec": None, "status": None},
    short_names=("pmconfig",),  # as in deploy/base/crd-metricsconfigurations.yaml
    keeps_generation=True,
    validate=_mc_checks,
)

PODSLICES = ResourceType(
    group="podmeter.io",
    version="v1alpha1",
    plural="podslices",
    singular="podslice",
    kind="PodSlice",
    namespaced=False,
    verbs=_VERBS,
    field_keys=("metadata.name",),
    fields=lambda o: _meta_fields(o, False),
    schema={**_top(None, None), "spec": None},
    short_names=("pmslice",),  # as in deploy/base/crd-podslices.yaml
    has_status=False,
    keeps_generation=True,
)

# Nodes and CRDs are stored and served like any object, with no behaviour: the lab's nodes are its own
# processes (``podmeter node``), and podmeter's custom resources are always served, CRD or not; ``podmeter
# lab --kubeconfig`` creates both on any API server, this one included (docs/lab.md).
NODES = ResourceType(
    group="",
    version="v1",
    plural="nodes",
    singular="node",
    kind="Node",
    namespaced=False,
    verbs=_VERBS,
    field_keys=("metadata.name", "spec.unschedulable"),
    fields=lambda o: {**_meta_fields(o, False), "spec.unschedulable": _text(_get(o, "spec", "unschedulable") or False)},
    schema={**_top(None, None), "spec": None, "status": None},
    short_names=("no",),
)
CUSTOMRESOURCEDEFINITIONS = ResourceType(
    group="apiextensions.k8s.io",
    version="v1",
    plural="customresourcedefinitions",
    singular="customresourcedefinition",
    kind="CustomResourceDefinition",
    namespaced=False,
    verbs=_VERBS,
    field_keys=("metadata.name",),
    fields=lambda o: _meta_fields(o, False),
    schema={**_top(None, None), "spec": None, "status": None},
    short_names=("crd", "crds"),
    categories=("api-extensions",),
    keeps_generation=True,
)

_SERVICE_PORT: Schema = dict.fromkeys(("name", "protocol", "appProtocol", "port", "targetPort", "nodePort"))
_SERVICE_SPEC: Schema = {
    **dict.fromkeys(
        (
            "selector",
            "clusterIP",
            "clusterIPs",
            "type",
            "externalIPs",
            "sessionAffinity",
            "loadBalancerIP",
            "loadBalancerSourceRanges",
            "externalName",
            "externalTrafficPolicy",
            "healthCheckNodePort",
            "publishNotReadyAddresses",
            "sessionAffinityConfig",
            "ipFamilies",
            "ipFamilyPolicy",
            "allocateLoadBalancerNodePorts",
            "loadBalancerClass",
            "internalTrafficPolicy",
            "trafficDistribution",
        )
    ),
    "ports": [_SERVICE_PORT],
}


def _service_fields(obj: dict[str, Any]) -> dict[str, str]:
    return {
        **_meta_fields(obj, True),
        "spec.clusterIP": _text(_get(obj, "spec", "clusterIP")),
        "spec.type": _text(_get(obj, "spec", "type")),
    }


SERVICES = ResourceType(
    group="",
    version="v1",
    plural="services",
    singular="service",
    kind="Service",
    namespaced=True,
    verbs=_VERBS,
    field_keys=("metadata.name", "metadata.namespace", "spec.clusterIP", "spec.type"),
    fields=_service_fields,
    schema=_top(_SERVICE_SPEC, {"loadBalancer": None, "conditions": None}),
    short_names=("svc",),
    categories=("all",),
    dns1035_names=True,
    default=default_service,
    validate=netvalidation.validate_service,
    validate_update=netvalidation.validate_service_update,
    decode_check=netvalidation.service_type_errors,
    merge_keys={"ports": "port"},
    bookmark_skeleton={"spec": {}, "status": {"loadBalancer": {}}},
)
_ENDPOINT: Schema = dict.fromkeys(
    ("addresses", "conditions", "hostname", "targetRef", "nodeName", "zone", "hints", "deprecatedTopology")
)
ENDPOINTSLICES = ResourceType(
    group="discovery.k8s.io",
    version="v1",
    plural="endpointslices",
    singular="endpointslice",
    kind="EndpointSlice",
    namespaced=True,
    verbs=_VERBS,
    field_keys=("metadata.name", "metadata.namespace"),
    fields=lambda o: _meta_fields(o, True),
    schema={
        **_top(None, None),
        "addressType": None,
        "endpoints": [_ENDPOINT],
        "ports": [dict.fromkeys(("name", "protocol", "port", "appProtocol"))],
    },
    has_status=False,
    keeps_generation=True,
    spec_fields=("addressType", "endpoints", "ports"),
    default=default_endpointslice,
    default_on_update=True,
    validate=netvalidation.validate_endpointslice,
    validate_update=netvalidation.validate_endpointslice_update,
    decode_check=netvalidation.endpointslice_type_errors,
    merge_keys={"endpoints": None, "ports": None},
    bookmark_skeleton={"addressType": "", "endpoints": None, "ports": None},
)

ALL: tuple[ResourceType, ...] = (NAMESPACES, PODS, SERVICES, NODES, LEASES, ENDPOINTSLICES, METRICSCONFIGURATIONS,
                                 PODSLICES, CUSTOMRESOURCEDEFINITIONS)
BY_KEY = {r.key: r for r in ALL}


def lookup(group: str, version: str, plural: str) -> ResourceType | None:
    """The resource served at ``/api(s)/group/version/.../plural``, if any."""
    r = BY_KEY.get(f"{group}/{plural}" if group else plural)
    return r if r is not None and r.version == version else None


def unknown_fields(obj: Any, schema: Any, path: str = "") -> list[str]:
    """Paths of fields the schema does not know (``.spec.bogus``), as the real strict decoder names them."""
    out: list[str] = []
    if schema is None or not isinstance(obj, dict | list):
        return out
    if isinstance(schema, list):
        if isinstance(obj, list):
            for i, item in enumerate(obj):
                out += unknown_fields(item, schema[0], f"{path}[{i}]")
        return out
    if not isinstance(obj, dict):
        return out
    for key, value in obj.items():
        if key not in schema:
            out.append(f"{path}.{key}")
        else:
            out += unknown_fields(value, schema[key], f"{path}.{key}")
    return out


def drop_fields(obj: dict[str, Any], paths: list[str]) -> None:
    """Remove the unknown ``paths`` from ``obj`` (what the real decoder does in Warn/Ignore mode)."""
    import re

    for path in paths:
        parts = [p for p in re.split(r"\.|\[(\d+)\]", path) if p]
        cur: Any = obj
        for part in parts[:-1]:
            cur = cur[int(part)] if isinstance(cur, list) else cur.get(part)
            if cur is None:
                break
        if isinstance(cur, dict):
            cur.pop(parts[-1], None)
