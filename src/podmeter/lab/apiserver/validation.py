"""Validation the real server applies before a write, with its field paths and messages.

Only what a consumer can observe is checked: object names, label keys and values, the annotation size
limit, required pod containers, immutable pod spec fields, and the pod IPs of a status update
(error-422-invalid-pod-ip-status.json). Every check returns :class:`Cause` entries; the caller turns a
non-empty list into one 422 ``Invalid``, so a request is either fully applied or not at all.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from podmeter.lab.apiserver.errors import Cause

_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")

SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
    "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
    "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
    "start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
    "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
    "and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or "
    "'12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
QUALIFIED_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
    "with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for "
    "validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
IP_MSG = "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)"
ANNOTATIONS_LIMIT = 256 * 1024


def _invalid(field: str, value: object, message: str) -> Cause:
    shown = f'"{value}"' if isinstance(value, str) else str(value)
    return Cause("FieldValueInvalid", f"Invalid value: {shown}: {message}", field)


def _required(field: str, message: str = "") -> Cause:
    return Cause("FieldValueRequired", "Required value" + (f": {message}" if message else ""), field)


def validate_name(name: object, dns_label: bool, dns1035: bool = False) -> list[Cause]:
    """``metadata.name``: an RFC 1123 label (namespaces), a DNS-1035 label (services) or an RFC 1123
    subdomain (everything else here)."""
    if not isinstance(name, str) or not name:
        return [_required("metadata.name", "name or generateName is required")]
    if dns1035:
        from podmeter.lab.apiserver.netvalidation import dns1035_label

        return [_invalid("metadata.name", name, m) for m in dns1035_label(name)]
    if dns_label:
        if len(name) > 63 or not _DNS1123_LABEL.match(name):
            return [_invalid("metadata.name", name, LABEL_MSG)]
    elif len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name):
        return [_invalid("metadata.name", name, SUBDOMAIN_MSG)]
    return []


def _qualified_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_QUALIFIED_NAME.match(name))


def validate_metadata(meta: dict[str, Any]) -> list[Cause]:
    """Labels (keys and values) and annotations (keys, total size)."""
    causes: list[Cause] = []
    labels = meta.get("labels")
    if labels is not None and not isinstance(labels, dict):
        causes.append(_invalid("metadata.labels", labels, "must be a map of strings"))
    for key, value in (labels or {}).items() if isinstance(labels, dict) else ():
        if not _qualified_key(key):
            causes.append(_invalid("metadata.labels", key, QUALIFIED_MSG))
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append(_invalid("metadata.labels", value, LABEL_VALUE_MSG))
    annotations = meta.get("annotations")
    if annotations is not None and not isinstance(annotations, dict):
        causes.append(_invalid("metadata.annotations", annotations, "must be a map of strings"))
    elif annotations:
        total = 0
        for key, value in annotations.items():
            if not _qualified_key(key):
                causes.append(_invalid("metadata.annotations", key, QUALIFIED_MSG))
            if not isinstance(value, str):
                causes.append(_invalid(f"metadata.annotations[{key}]", value, "must be a string"))
                continue
            total += len(key) + len(value)
        if total > ANNOTATIONS_LIMIT:
            causes.append(
                Cause(
                    "FieldValueTooLong",
                    f"Too long: may not be more than {ANNOTATIONS_LIMIT} bytes",
                    "metadata.annotations",
                )
            )
    return causes


def _ip_family(text: str) -> int | None:
    """4 or 6 for an address the real server accepts; None otherwise (a zone-scoped IPv6 address such as
    ``fe80::1%eth0`` parses in Python, but Kubernetes refuses it as an invalid IP)."""
    if "%" in text:
        return None
    try:
        return ipaddress.ip_address(text).version
    except ValueError:
        return None


_LEASE_INTS = ("leaseDurationSeconds", "leaseTransitions")
_LEASE_STRINGS = ("holderIdentity", "acquireTime", "renewTime", "strategy", "preferredHolder")


def lease_type_errors(obj: dict[str, Any]) -> str | None:
    """What the real server's decoder says of a Lease field of the wrong JSON type (it answers 400 before
    any validation), or None."""
    spec = obj.get("spec")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        return "json: cannot unmarshal into Go struct field Lease.spec of type v1.LeaseSpec"
    for name in _LEASE_INTS:
        value = spec.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return (f"json: cannot unmarshal {type(value).__name__} into Go struct field "
                    f"LeaseSpec.spec.{name} of type int32")
    for name in _LEASE_STRINGS:
        value = spec.get(name)
        if value is not None and not isinstance(value, str):
            return (f"json: cannot unmarshal {type(value).__name__} into Go struct field "
                    f"LeaseSpec.spec.{name} of type string")
    return None


def validate_lease(obj: dict[str, Any]) -> list[Cause]:
    """Values the real server refuses (422): a lease duration or transition count below zero... (its
    validation of LeaseSpec: durations must be greater than 0, transitions not negative)."""
    spec = obj.get("spec") or {}
    causes: list[Cause] = []
    duration = spec.get("leaseDurationSeconds")
    if isinstance(duration, int) and duration <= 0:
        causes.append(_invalid("spec.leaseDurationSeconds", duration, "must be greater than 0"))
    transitions = spec.get("leaseTransitions")
    if isinstance(transitions, int) and transitions < 0:
        causes.append(_invalid("spec.leaseTransitions", transitions, "must be greater than or equal to 0"))
    return causes


def validate_pod_ips(status: dict[str, Any], base: str = "status") -> list[Cause]:
    """``podIPs``: valid, distinct, at most one per family (``podIP`` was synced into them before)."""
    causes: list[Cause] = []
    pod_ips = status.get("podIPs") or []
    if not isinstance(pod_ips, list):
        return [_invalid(f"{base}.podIPs", pod_ips, "must be a list")]
    seen: set[str] = set()
    families: list[int] = []
    for i, entry in enumerate(pod_ips):
        ip = entry.get("ip") if isinstance(entry, dict) else None
        family = _ip_family(ip) if isinstance(ip, str) else None
        if family is None:
            causes.append(_invalid(f"{base}.podIPs[{i}]", ip, IP_MSG))
            continue
        if ip in seen:
            causes.append(Cause("FieldValueDuplicate", f'Duplicate value: "{ip}"', f"{base}.podIPs[{i}]"))
        seen.add(ip)  # type: ignore[arg-type]
        families.append(family)
    if len(pod_ips) > 2 or len(set(families)) < len(families):
        causes.append(_invalid(f"{base}.podIPs", pod_ips, "may specify no more than one IP for each IP family"))
    host_ip = status.get("hostIP")
    if host_ip and (not isinstance(host_ip, str) or _ip_family(host_ip) is None):
        causes.append(_invalid(f"{base}.hostIP", host_ip, IP_MSG))
    return causes


def validate_pod_spec(spec: object) -> list[Cause]:
    """A pod needs at least one container, each with a name and an image."""
    if not isinstance(spec, dict):
        return [_required("spec")]
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        return [_required("spec.containers")]
    causes = []
    for i, c in enumerate(containers):
        if not isinstance(c, dict):
            causes.append(_invalid(f"spec.containers[{i}]", c, "must be an object"))
            continue
        name = c.get("name")
        if not isinstance(name, str) or not name:
            causes.append(_required(f"spec.containers[{i}].name"))
        elif not _DNS1123_LABEL.match(name):
            causes.append(_invalid(f"spec.containers[{i}].name", name, LABEL_MSG))
        if not c.get("image"):
            causes.append(_required(f"spec.containers[{i}].image"))
    node = spec.get("nodeName")
    if node is not None and (not isinstance(node, str) or (node and not _DNS1123_SUBDOMAIN.match(node))):
        causes.append(_invalid("spec.nodeName", node, SUBDOMAIN_MSG))
    return causes


# Pod spec fields a real server lets an update change (everything else is immutable).
_MUTABLE_POD_SPEC = {
    "containers",
    "initContainers",
    "activeDeadlineSeconds",
    "tolerations",
    "terminationGracePeriodSeconds",
    "schedulingGates",
    "nodeName",
}


def validate_pod_spec_update(old: dict[str, Any], new: dict[str, Any]) -> list[Cause]:
    """Immutable pod spec. ``nodeName`` may be set once (binding, which the lab allows by update/patch)."""
    causes = []
    for key in set(old) | set(new):
        if key in _MUTABLE_POD_SPEC or old.get(key) == new.get(key):
            continue
        causes.append(
            Cause(
                "FieldValueForbidden",
                "Forbidden: pod updates may not change fields other than "
                "`spec.containers[*].image`, `spec.initContainers[*].image`, "
                "`spec.activeDeadlineSeconds`, `spec.tolerations` (only additions to existing "
                "tolerations), `spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it "
                "was previously negative)",
                "spec",
            )
        )
        break
    old_node, new_node = old.get("nodeName"), new.get("nodeName")
    if old_node and old_node != new_node:
        causes.append(Cause("FieldValueForbidden", "Forbidden: pod is already bound to a node", "spec.nodeName"))
    return causes
