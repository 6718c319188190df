"""Validation of Services and EndpointSlices, with the real server's field paths and messages.

Ported from kube-apiserver 1.36 (``pkg/apis/core/validation`` ValidateService, validateServicePort,
ValidateServiceClusterIPsRelatedFields, validateUpgradeDowngradeClusterIPs; ``pkg/apis/discovery/validation``),
with apimachinery 0.36's rendering of bad values: strings quoted, numbers and booleans bare, anything else
as compact JSON (``spec.clusterIPs: Invalid value: ["10.96.0.10"]: ...``). Every function returns
:class:`Cause` entries; the registry turns them into one 422 ``Invalid``.

The decode checks (``*_type_errors``) stand for the real server's typed JSON decoder: a value of the wrong
JSON type is a 400 ``BadRequest`` before any validation.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

from podmeter.lab.apiserver.errors import Cause
from podmeter.lab.apiserver.validation import (
    LABEL_MSG,
    LABEL_VALUE_MSG,
    QUALIFIED_MSG,
    SUBDOMAIN_MSG,
)

CLUSTER_IP_NONE = "None"
SERVICE_TYPES = ("ClusterIP", "ExternalName", "LoadBalancer", "NodePort")
PROTOCOLS = ("SCTP", "TCP", "UDP")
AFFINITIES = ("ClientIP", "None")
TRAFFIC_POLICIES = ("Cluster", "Local")
IP_FAMILIES = ("IPv4", "IPv6")
IP_FAMILY_POLICIES = ("PreferDualStack", "RequireDualStack", "SingleStack")
TRAFFIC_DISTRIBUTIONS = ("PreferClose", "PreferSameNode", "PreferSameZone")
ADDRESS_TYPES = ("FQDN", "IPv4", "IPv6")
MAX_AFFINITY_SECONDS = 86400
MAX_ENDPOINTS = 1000
MAX_ADDRESSES = 100
MAX_PORTS = 20000

DNS1035_MSG = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
    "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
    "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
PORT_RANGE_MSG = "must be between 1 and 65535, inclusive"
IP_MSG = "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)"
CIDR_MSG = "must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)"
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_KEY_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_PORT_NAME_CHARS = re.compile(r"^[-a-z0-9]+$")
_PORT_NAME_LETTER = re.compile(r"[a-z]")


# --- how apimachinery renders a field error ---------------------------------------------------------------


def show(value: Any) -> str:
    """A bad value as ``field.Error.ErrorBody`` prints it (apimachinery 0.36)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def invalid(path: str, value: Any, detail: str) -> Cause:
    return Cause("FieldValueInvalid", f"Invalid value: {show(value)}: {detail}", path)


def required(path: str, detail: str = "") -> Cause:
    return Cause("FieldValueRequired", "Required value" + (f": {detail}" if detail else ""), path)


def forbidden(path: str, detail: str) -> Cause:
    return Cause("FieldValueForbidden", f"Forbidden: {detail}", path)


def duplicate(path: str, value: Any) -> Cause:
    return Cause("FieldValueDuplicate", f"Duplicate value: {show(value)}", path)


def not_supported(path: str, value: Any, supported: tuple[str, ...]) -> Cause:
    listed = ", ".join(json.dumps(s) for s in supported)
    return Cause("FieldValueNotSupported", f"Unsupported value: {show(value)}: supported values: {listed}", path)


def too_many(path: str, actual: int, limit: int) -> Cause:
    return Cause("FieldValueTooMany", f"Too many: {actual}: must have at most {limit} items", path)


# --- the format checks --------------------------------------------------------------------------------------


def dns1123_label(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append("must be no more than 63 characters")
    if not _DNS1123_LABEL.match(value):
        errs.append("must not contain dots" if _DNS1123_SUBDOMAIN.match(value) else LABEL_MSG)
    return errs


def dns1123_subdomain(value: str) -> list[str]:
    errs = []
    if len(value) > 253:
        errs.append("must be no more than 253 characters")
    if not _DNS1123_SUBDOMAIN.match(value):
        errs.append(SUBDOMAIN_MSG)
    return errs


def dns1035_label(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append("must be no more than 63 characters")
    if not _DNS1035.match(value):
        errs.append(DNS1035_MSG)
    return errs


def qualified_name(value: str) -> list[str]:
    """``IsQualifiedName`` (a label key): an optional DNS subdomain prefix and ``/``, then a name part."""
    errs: list[str] = []
    parts = value.split("/")
    if len(parts) > 2:
        return [
            "a valid label key " + QUALIFIED_MSG.removeprefix("name part ")
            + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
        ]
    name = parts[-1]
    if len(parts) == 2:
        if not parts[0]:
            errs.append("prefix part must be non-empty")
        else:
            errs += ["prefix part " + m for m in dns1123_subdomain(parts[0])]
    if not name:
        errs.append("name part must be non-empty")
    elif len(name) > 63:
        errs.append("name part must be no more than 63 bytes")
    if not _LABEL_KEY_NAME.match(name):
        errs.append(QUALIFIED_MSG)
    return errs


def label_value(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append("must be no more than 63 bytes")
    if not _LABEL_VALUE.match(value):
        errs.append(LABEL_VALUE_MSG)
    return errs


def port_name(value: str) -> list[str]:
    """``IsValidPortName`` (an IANA service name)."""
    errs = []
    if len(value) > 15:
        errs.append("must be no more than 15 characters")
    if not _PORT_NAME_CHARS.match(value):
        errs.append("must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)")
    if not _PORT_NAME_LETTER.search(value):
        errs.append("must contain at least one letter (a-z)")
    if "--" in value:
        errs.append("must not contain consecutive hyphens")
    if value and (value[0] == "-" or value[-1] == "-"):
        errs.append("must not begin or end with a hyphen")
    return errs


def parse_ip(value: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An IP as Kubernetes' strict parser takes it: no zone, no leading zeros, no IPv4-mapped IPv6."""
    if not isinstance(value, str) or "%" in value:
        return None
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return None
    return ip


def family_of(value: str) -> str:
    ip = parse_ip(value)
    return "IPv6" if ip is not None and ip.version == 6 else "IPv4"


def valid_ip(path: str, value: Any) -> list[Cause]:
    """``IsValidIP``: a strictly valid IP in canonical form."""
    ip = parse_ip(value)
    if ip is None:
        return [invalid(path, value, IP_MSG)]
    if str(ip) != value:
        return [invalid(path, value, f'must be in canonical form ("{ip}")')]
    return []


def non_special_ip(path: str, value: str) -> list[Cause]:
    """``ValidateNonSpecialIP`` / ``ValidateEndpointIP``: no unspecified, loopback or link-local address."""
    ip = parse_ip(value)
    if ip is None:
        return [invalid(path, value, "must be a valid IP address")]
    causes = []
    if ip.is_unspecified:
        causes.append(invalid(path, value, f"may not be unspecified ({value})"))
    if ip.is_loopback:
        causes.append(invalid(path, value, "may not be in the loopback range (127.0.0.0/8, ::1/128)"))
    if ip.is_link_local and not ip.is_multicast:
        causes.append(invalid(path, value, "may not be in the link-local range (169.254.0.0/16, fe80::/10)"))
    link_local_multicast = (ip.version == 4 and ip in ipaddress.ip_network("224.0.0.0/24")) or (
        ip.version == 6 and ip in ipaddress.ip_network("ff02::/16")
    )
    if link_local_multicast:
        causes.append(
            invalid(path, value, "may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)")
        )
    return causes


def labels_map(path: str, labels: Any) -> list[Cause]:
    """``ValidateLabels`` (a selector, a label map): keys as qualified names, values as label values."""
    causes: list[Cause] = []
    if not isinstance(labels, dict):
        return causes
    for key, value in labels.items():
        causes += [invalid(path, key, m) for m in qualified_name(str(key))]
        causes += [invalid(path, value, m) for m in label_value(str(value))]
    return causes


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


# --- Services -----------------------------------------------------------------------------------------------


def is_headless(spec: dict[str, Any]) -> bool:
    ips = _list(spec.get("clusterIPs"))
    return len(ips) == 1 and ips[0] == CLUSTER_IP_NONE


def externally_accessible(spec: dict[str, Any]) -> bool:
    kind = spec.get("type")
    return kind in ("LoadBalancer", "NodePort") or (kind == "ClusterIP" and bool(_list(spec.get("externalIPs"))))


def needs_health_check(spec: dict[str, Any]) -> bool:
    return spec.get("type") == "LoadBalancer" and spec.get("externalTrafficPolicy") == "Local"


def validate_service(obj: dict[str, Any]) -> list[Cause]:
    """``ValidateService`` (the name is checked with the metadata, as a DNS-1035 label)."""
    spec = _dict(obj.get("spec"))
    causes: list[Cause] = []
    kind = spec.get("type")
    ports = _list(spec.get("ports"))
    headless = is_headless(spec)
    if not ports and not headless and kind != "ExternalName":
        causes.append(required("spec.ports"))
    if kind in ("LoadBalancer", "NodePort") and headless:
        causes.append(invalid("spec.clusterIPs[0]", CLUSTER_IP_NONE, f"may not be set to 'None' for {kind} services"))
    if kind == "ExternalName":
        for key in ("clusterIPs", "ipFamilies", "ipFamilyPolicy"):
            if spec.get(key):
                causes.append(forbidden(f"spec.{key}", "may not be set for ExternalName services"))
        cname = str(spec.get("externalName") or "").removesuffix(".")
        if cname:
            causes += [invalid("spec.externalName", cname, m) for m in dns1123_subdomain(cname)]
        else:
            causes.append(required("spec.externalName"))
    names: set[str] = set()
    for i, port in enumerate(ports):
        causes += _service_port(_dict(port), len(ports) > 1, names, f"spec.ports[{i}]")
    if spec.get("selector") is not None:
        causes += labels_map("spec.selector", spec.get("selector"))
    affinity = spec.get("sessionAffinity")
    if not affinity:
        causes.append(required("spec.sessionAffinity"))
    elif affinity not in AFFINITIES:
        causes.append(not_supported("spec.sessionAffinity", affinity, AFFINITIES))
    config = spec.get("sessionAffinityConfig")
    if affinity == "ClientIP":
        causes += _affinity_config(config)
    elif affinity == "None" and config is not None:
        causes.append(forbidden("spec.sessionAffinityConfig", "must not be set when session affinity is None"))
    causes += validate_cluster_ips(spec)
    for i, ip in enumerate(_list(spec.get("externalIPs"))):
        bad = valid_ip(f"spec.externalIPs[{i}]", ip)
        causes += bad or non_special_ip(f"spec.externalIPs[{i}]", ip)
    if not kind:
        causes.append(required("spec.type"))
    elif kind not in SERVICE_TYPES:
        causes.append(not_supported("spec.type", kind, SERVICE_TYPES))
    if kind == "ClusterIP":
        for i, port in enumerate(ports):
            if _dict(port).get("nodePort"):
                causes.append(forbidden(f"spec.ports[{i}].nodePort", "may not be used when `type` is 'ClusterIP'"))
    node_ports: set[tuple[Any, Any]] = set()
    for i, port in enumerate(ports):
        p = _dict(port)
        if not p.get("nodePort"):
            continue
        node_key = (p.get("protocol"), p.get("nodePort"))
        if node_key in node_ports:
            causes.append(duplicate(f"spec.ports[{i}].nodePort", p.get("nodePort")))
        node_ports.add(node_key)
    seen_ports: set[tuple[Any, Any]] = set()
    for i, port in enumerate(ports):
        p = _dict(port)
        port_key = (p.get("protocol"), p.get("port"))
        if port_key in seen_ports:
            causes.append(duplicate(f"spec.ports[{i}]", _go_service_port(p)))
        seen_ports.add(port_key)
    ranges = _list(spec.get("loadBalancerSourceRanges"))
    if ranges:
        if kind != "LoadBalancer":
            causes.append(forbidden("spec.LoadBalancerSourceRanges", "may only be used when `type` is 'LoadBalancer'"))
        for i, value in enumerate(ranges):
            causes += _cidr(f"spec.LoadBalancerSourceRanges[{i}]", str(value).strip())
    if spec.get("allocateLoadBalancerNodePorts") is not None and kind != "LoadBalancer":
        causes.append(
            forbidden("spec.allocateLoadBalancerNodePorts", "may only be used when `type` is 'LoadBalancer'")
        )
    if kind == "LoadBalancer" and spec.get("allocateLoadBalancerNodePorts") is None:
        causes.append(required("allocateLoadBalancerNodePorts"))  # sic: the real path has no "spec."
    causes += _traffic_policies(spec)
    distribution = spec.get("trafficDistribution")
    if distribution is not None and distribution not in TRAFFIC_DISTRIBUTIONS:
        causes.append(not_supported("spec.trafficDistribution", distribution, TRAFFIC_DISTRIBUTIONS))
    causes += _load_balancer_status(spec, _dict(_dict(obj.get("status")).get("loadBalancer")))
    return causes


def _go_service_port(port: dict[str, Any]) -> dict[str, Any]:
    """The key of a duplicate port as the real server prints it: the internal ServicePort, JSON-encoded."""
    return {
        "Name": "",
        "Protocol": port.get("protocol"),
        "AppProtocol": None,
        "Port": port.get("port"),
        "TargetPort": 0,
        "NodePort": 0,
    }


def _service_port(port: dict[str, Any], require_name: bool, names: set[str], path: str) -> list[Cause]:
    causes: list[Cause] = []
    name = port.get("name") or ""
    if require_name and not name:
        causes.append(required(f"{path}.name"))
    elif name:
        causes += [invalid(f"{path}.name", name, m) for m in dns1123_label(name)]
        if name in names:
            causes.append(duplicate(f"{path}.name", name))
        names.add(name)
    number = port.get("port", 0)
    if not isinstance(number, int) or not 1 <= number <= 65535:
        causes.append(invalid(f"{path}.port", number, PORT_RANGE_MSG))
    protocol = port.get("protocol")
    if not protocol:
        causes.append(required(f"{path}.protocol"))
    elif protocol not in PROTOCOLS:
        causes.append(not_supported(f"{path}.protocol", protocol, PROTOCOLS))
    causes += port_number_or_name(f"{path}.targetPort", port.get("targetPort"))
    app = port.get("appProtocol")
    if app is not None:
        causes += [invalid(f"{path}.appProtocol", app, m) for m in qualified_name(str(app))]
    return causes


def port_number_or_name(path: str, value: Any) -> list[Cause]:
    """``ValidatePortNumOrName``: a port number, or a port name (IANA_SVC_NAME)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [] if 1 <= value <= 65535 else [invalid(path, value, PORT_RANGE_MSG)]
    if isinstance(value, str):
        return [invalid(path, value, m) for m in port_name(value)]
    return [invalid(path, value, PORT_RANGE_MSG)]


def _affinity_config(config: Any) -> list[Cause]:
    path = "spec.sessionAffinityConfig"
    why = "when session affinity type is ClientIP"
    if not isinstance(config, dict):
        return [required(path, why)]
    client = config.get("clientIP")
    if not isinstance(client, dict):
        return [required(f"{path}.clientIP", why)]
    timeout = client.get("timeoutSeconds")
    if timeout is None:
        return [required(f"{path}.clientIP.timeoutSeconds", why)]
    if not isinstance(timeout, int) or not 0 < timeout <= MAX_AFFINITY_SECONDS:
        return [
            invalid(
                f"{path}.clientIP.timeoutSeconds",
                timeout,
                f"must be greater than 0 and less than {MAX_AFFINITY_SECONDS}",
            )
        ]
    return []


def _cidr(path: str, value: str) -> list[Cause]:
    try:
        net = ipaddress.ip_network(value, strict=False)
    except ValueError:
        return [invalid(path, value, CIDR_MSG)]
    if net.network_address != ipaddress.ip_interface(value).ip:
        return [invalid(path, value, "must not have bits set beyond the prefix length")]
    if str(net) != value:
        return [invalid(path, value, f'must be in canonical form ("{net}")')]
    return []


def _traffic_policies(spec: dict[str, Any]) -> list[Cause]:
    causes: list[Cause] = []
    external = spec.get("externalTrafficPolicy")
    if not externally_accessible(spec):
        if external:
            causes.append(
                invalid("spec.externalTrafficPolicy", external, "may only be set for externally-accessible services")
            )
    elif not external:
        causes.append(required("spec.externalTrafficPolicy"))
    elif external not in TRAFFIC_POLICIES:
        causes.append(not_supported("spec.externalTrafficPolicy", external, TRAFFIC_POLICIES))
    health = spec.get("healthCheckNodePort") or 0
    if not needs_health_check(spec):
        if health:
            causes.append(
                invalid(
                    "spec.healthCheckNodePort",
                    health,
                    "may only be set when `type` is 'LoadBalancer' and `externalTrafficPolicy` is 'Local'",
                )
            )
    elif not health:
        causes.append(required("spec.healthCheckNodePort"))
    elif not isinstance(health, int) or not 1 <= health <= 65535:
        causes.append(invalid("spec.healthCheckNodePort", health, PORT_RANGE_MSG))
    internal = spec.get("internalTrafficPolicy")
    if internal is None:
        if spec.get("type") in ("ClusterIP", "NodePort", "LoadBalancer"):
            causes.append(required("spec.internalTrafficPolicy"))
    elif internal not in TRAFFIC_POLICIES:
        causes.append(not_supported("spec.internalTrafficPolicy", internal, TRAFFIC_POLICIES))
    return causes


def _load_balancer_status(spec: dict[str, Any], status: dict[str, Any]) -> list[Cause]:
    """``ValidateLoadBalancerStatus``: ingress entries (only on LoadBalancer services)."""
    ingress = _list(status.get("ingress"))
    if not ingress:
        return []
    if spec.get("type") != "LoadBalancer":
        return [forbidden("status.loadBalancer.ingress", "may only be used when `spec.type` is 'LoadBalancer'")]
    causes: list[Cause] = []
    for i, entry in enumerate(ingress):
        e, path = _dict(entry), f"status.loadBalancer.ingress[{i}]"
        if e.get("ip"):
            causes += valid_ip(f"{path}.ip", e["ip"])
        elif e.get("ipMode"):
            causes.append(forbidden(f"{path}.ipMode", "may not be specified when `ip` is not set"))
        host = e.get("hostname")
        if host:
            causes += [invalid(f"{path}.hostname", host, m) for m in dns1123_subdomain(str(host))]
            if parse_ip(host) is not None:
                causes.append(invalid(f"{path}.hostname", host, "must be a DNS name, not an IP address"))
    return causes


def validate_cluster_ips(spec: dict[str, Any]) -> list[Cause]:
    """``ValidateServiceClusterIPsRelatedFields``."""
    if spec.get("type") == "ExternalName":
        return []
    causes: list[Cause] = []
    cluster_ip = spec.get("clusterIP") or ""
    ips = _list(spec.get("clusterIPs"))
    if cluster_ip:
        if not ips:
            causes.append(required("spec.clusterIPs"))
        elif ips[0] != cluster_ip:
            causes.append(invalid("spec.clusterIPs", ips, "first value must match `clusterIP`"))
    elif ips:
        causes.append(invalid("spec.clusterIPs", ips, "must be empty when `clusterIP` is not specified"))
    families = _list(spec.get("ipFamilies"))
    seen: set[Any] = set()
    for i, family in enumerate(families):
        if family not in IP_FAMILIES:
            causes.append(not_supported(f"spec.ipFamilies[{i}]", family, IP_FAMILIES))
        if family in seen:
            causes.append(duplicate(f"spec.ipFamilies[{i}]", family))
        seen.add(family)
    policy = spec.get("ipFamilyPolicy")
    if policy is not None and policy not in IP_FAMILY_POLICIES:
        causes.append(not_supported("spec.ipFamilyPolicy", policy, IP_FAMILY_POLICIES))
    bad_ips = False
    for i, ip in enumerate(ips):
        if i == 0 and ip == CLUSTER_IP_NONE:
            if len(ips) > 1:
                bad_ips = True
                causes.append(invalid("spec.clusterIPs", ips, "'None' must be the first and only value"))
            continue
        problems = valid_ip(f"spec.clusterIPs[{i}]", ip)
        bad_ips = bad_ips or bool(problems)
        causes += problems
    if len(ips) > 2:
        causes.append(invalid("spec.clusterIPs", ips, "may only hold up to 2 values"))
    if bad_ips:
        return causes
    if len(ips) > 1 and len({family_of(ip) for ip in ips}) != len(ips):
        causes.append(invalid("spec.clusterIPs", ips, "may specify no more than one IP for each IP family"))
    if not is_headless(spec) and ips and families:
        for i, ip in enumerate(ips[: len(families)]):
            if families[i] in ("IPv4", "IPv6") and family_of(ip) != families[i]:
                causes.append(invalid(f"spec.clusterIPs[{i}]", ip,
                                      f"expected an {families[i]} value as indicated by `ipFamilies[{i}]`"))
    return causes


def validate_service_update(old: dict[str, Any], new: dict[str, Any]) -> list[Cause]:
    """``ValidateServiceUpdate``: clusterIPs and ipFamilies may not change (up/downgrades aside), then
    everything ``ValidateService`` checks."""
    return _upgrade_downgrade_ips(_dict(old.get("spec")), _dict(new.get("spec"))) + _upgrade_downgrade_families(
        _dict(old.get("spec")), _dict(new.get("spec"))
    ) + validate_service(new)


def _upgrade_downgrade_ips(old: dict[str, Any], new: dict[str, Any]) -> list[Cause]:
    if "ExternalName" in (old.get("type"), new.get("type")):
        return []
    if is_headless(old) and is_headless(new):
        return []
    before, after = _list(old.get("clusterIPs")), _list(new.get("clusterIPs"))
    causes: list[Cause] = []
    if len(before) == len(after):
        for i, ip in enumerate(before):
            if ip != after[i]:
                causes.append(invalid(f"spec.clusterIPs[{i}]", after, "may not change once set"))
    elif len(before) > len(after):
        if not after:
            causes.append(invalid("spec.clusterIPs[0]", after, "primary clusterIP can not be unset"))
        if before and after and after[0] != before[0]:
            causes.append(invalid("spec.clusterIPs[0]", after, "may not change once set"))
        if len(after) == 1 and new.get("ipFamilyPolicy") != "SingleStack":
            causes.append(
                invalid(
                    "spec.ipFamilyPolicy",
                    new.get("ipFamilyPolicy"),
                    "must be set to 'SingleStack' when releasing the secondary clusterIP",
                )
            )
    elif before and after[0] != before[0]:
        causes.append(invalid("spec.clusterIPs[0]", after, "may not change once set"))
    return causes


def _upgrade_downgrade_families(old: dict[str, Any], new: dict[str, Any]) -> list[Cause]:
    if "ExternalName" in (old.get("type"), new.get("type")):
        return []
    if is_headless(old) or is_headless(new):
        return []
    before, after = _list(old.get("ipFamilies")), _list(new.get("ipFamilies"))
    causes: list[Cause] = []
    if len(before) == len(after):
        for i, family in enumerate(before):
            if family != after[i]:
                causes.append(invalid("spec.ipFamilies[0]", after, "may not change once set"))
    elif len(before) > len(after):
        if not _list(new.get("clusterIPs")):
            causes.append(invalid("spec.ipFamilies[0]", after, "primary ipFamily can not be unset"))
        if after and after[0] != before[0]:
            causes.append(invalid("spec.ipFamilies[0]", _list(new.get("clusterIPs")), "may not change once set"))
        if len(after) == 1 and new.get("ipFamilyPolicy") != "SingleStack":
            causes.append(
                invalid(
                    "spec.ipFamilyPolicy",
                    new.get("ipFamilyPolicy"),
                    "must be set to 'SingleStack' when releasing the secondary ipFamily",
                )
            )
    elif before and after and after[0] != before[0]:
        causes.append(invalid("spec.ipFamilies[0]", _list(new.get("clusterIPs")), "may not change once set"))
    return causes


# --- EndpointSlices ---------------------------------------------------------------------------------------


def validate_endpointslice(obj: dict[str, Any]) -> list[Cause]:
    """``ValidateEndpointSlice`` (discovery.k8s.io/v1)."""
    causes: list[Cause] = []
    address_type = obj.get("addressType") or ""
    if not address_type:
        causes.append(required("addressType"))
    elif address_type not in ADDRESS_TYPES:
        causes.append(not_supported("addressType", address_type, ADDRESS_TYPES))
    causes += _endpoints(_list(obj.get("endpoints")), address_type)
    causes += _endpoint_ports(_list(obj.get("ports")))
    return causes


def validate_endpointslice_update(old: dict[str, Any], new: dict[str, Any]) -> list[Cause]:
    causes = validate_endpointslice(new)
    if new.get("addressType") != old.get("addressType"):
        causes.append(invalid("addressType", new.get("addressType") or "", "field is immutable"))
    return causes


def _endpoints(endpoints: list[Any], address_type: str) -> list[Cause]:
    if len(endpoints) > MAX_ENDPOINTS:
        return [too_many("endpoints", len(endpoints), MAX_ENDPOINTS)]
    causes: list[Cause] = []
    for i, raw in enumerate(endpoints):
        endpoint, path = _dict(raw), f"endpoints[{i}]"
        addresses = _list(endpoint.get("addresses"))
        if not addresses:
            causes.append(required(f"{path}.addresses", "must contain at least 1 address"))
        elif len(addresses) > MAX_ADDRESSES:
            causes.append(too_many(f"{path}.addresses", len(addresses), MAX_ADDRESSES))
        for j, address in enumerate(addresses):
            causes += _address(f"{path}.addresses[{j}]", address, address_type)
        node = endpoint.get("nodeName")
        if node is not None:
            causes += [invalid(f"{path}.nodeName", node, m) for m in dns1123_subdomain(str(node))]
        host = endpoint.get("hostname")
        if host is not None:
            causes += [invalid(f"{path}.hostname", host, m) for m in dns1123_label(str(host))]
        topology = endpoint.get("deprecatedTopology")
        if isinstance(topology, dict):
            if len(topology) > 16:
                causes.append(too_many(f"{path}.deprecatedTopology", len(topology), 16))
            causes += labels_map(f"{path}.deprecatedTopology", topology)
    return causes


def _address(path: str, address: Any, address_type: str) -> list[Cause]:
    if address_type in ("IPv4", "IPv6"):
        ip = parse_ip(address)
        if ip is None:
            return [invalid(path, address, IP_MSG)]
        if ip.version != (4 if address_type == "IPv4" else 6):
            return [invalid(path, address, f"must be an {address_type} address")]
        return non_special_ip(path, str(address))
    if address_type == "FQDN":
        return _fqdn(path, str(address))
    return []


def _fqdn(path: str, name: str) -> list[Cause]:
    """``IsFullyQualifiedDomainName``."""
    if not name:
        return [required(path)]
    name = name.removesuffix(".")
    problems = dns1123_subdomain(name)
    if problems:
        return [invalid(path, name, ",".join(problems))]
    if len(name.split(".")) < 2:
        return [invalid(path, name, "should be a domain with at least two segments separated by dots")]
    for label in name.split("."):
        problems = dns1123_label(label)
        if problems:
            return [invalid(path, label, ",".join(problems))]
    return []


def _endpoint_ports(ports: list[Any]) -> list[Cause]:
    if len(ports) > MAX_PORTS:
        return [too_many("ports", len(ports), MAX_PORTS)]
    causes: list[Cause] = []
    names: set[str] = set()
    for i, raw in enumerate(ports):
        port, path = _dict(raw), f"ports[{i}]"
        name = str(port.get("name") or "")
        if name:
            causes += [invalid(f"{path}.name", name, m) for m in dns1123_label(name)]
        if name in names:
            causes.append(duplicate(f"{path}.name", name))
        names.add(name)
        protocol = port.get("protocol")
        if protocol is None:
            causes.append(required(f"{path}.protocol"))
        elif protocol not in PROTOCOLS:
            causes.append(not_supported(f"{path}.protocol", protocol, PROTOCOLS))
        app = port.get("appProtocol")
        if app is not None:
            causes += [invalid(f"{path}.appProtocol", app, m) for m in qualified_name(str(app))]
    return causes


# --- the decoder's type errors (400) ---------------------------------------------------------------------


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, float):
        return f"number {value}"
    if isinstance(value, int):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else "value"


def _wrong(kind: str, value: Any, where: str, go_type: str) -> str:
    return (
        f'{kind} in version "v1" cannot be handled as a {kind}: json: cannot unmarshal {_json_type(value)} '
        f"into Go struct field {where} of type {go_type}"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(
    kind: str, obj: dict[str, Any], struct: str, prefix: str, *, ints: tuple[str, ...] = (),
    strings: tuple[str, ...] = (), bools: tuple[str, ...] = (),
) -> str | None:
    for name in ints:
        value = obj.get(name)
        if value is not None and not _is_int(value):
            return _wrong(kind, value, f"{struct}.{prefix}{name}", "int32")
    for name in strings:
        value = obj.get(name)
        if value is not None and not isinstance(value, str):
            return _wrong(kind, value, f"{struct}.{prefix}{name}", "string")
    for name in bools:
        value = obj.get(name)
        if value is not None and not isinstance(value, bool):
            return _wrong(kind, value, f"{struct}.{prefix}{name}", "bool")
    return None


def _string_list(kind: str, value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list):
        return _wrong(kind, value, where, "[]string")
    bad = next((v for v in value if not isinstance(v, str)), None)
    return _wrong(kind, bad, where, "string") if bad is not None else None


def _string_map(kind: str, value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return _wrong(kind, value, where, "map[string]string")
    bad = next((v for v in value.values() if not isinstance(v, str)), None)
    return _wrong(kind, bad, where, "string") if bad is not None else None


def service_type_errors(obj: dict[str, Any]) -> str | None:
    """What the typed decoder refuses in a Service (a string port, a selector of numbers...)."""
    spec = obj.get("spec")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        return _wrong("Service", spec, "Service.spec", "v1.ServiceSpec")
    problem = _check_fields(
        "Service", spec, "ServiceSpec", "spec.", ints=("healthCheckNodePort",),
        strings=("clusterIP", "type", "sessionAffinity", "loadBalancerIP", "externalName", "externalTrafficPolicy",
                 "ipFamilyPolicy", "loadBalancerClass", "internalTrafficPolicy", "trafficDistribution"),
        bools=("publishNotReadyAddresses", "allocateLoadBalancerNodePorts"),
    )
    for name in ("clusterIPs", "externalIPs", "ipFamilies", "loadBalancerSourceRanges"):
        problem = problem or _string_list("Service", spec.get(name), f"ServiceSpec.spec.{name}")
    problem = problem or _string_map("Service", spec.get("selector"), "ServiceSpec.spec.selector")
    ports = spec.get("ports")
    if problem is None and ports is not None:
        if not isinstance(ports, list):
            return _wrong("Service", ports, "ServiceSpec.spec.ports", "[]v1.ServicePort")
        for port in ports:
            if not isinstance(port, dict):
                return _wrong("Service", port, "ServiceSpec.spec.ports", "v1.ServicePort")
            problem = problem or _check_fields(
                "Service", port, "ServicePort", "spec.ports.", ints=("port", "nodePort"),
                strings=("name", "protocol", "appProtocol"),
            )
            target = port.get("targetPort")
            if problem is None and target is not None and not (_is_int(target) or isinstance(target, str)):
                problem = _wrong("Service", target, "ServicePort.spec.ports.targetPort", "intstr.IntOrString")
    config = spec.get("sessionAffinityConfig")
    if problem is None and config is not None:
        client = config.get("clientIP") if isinstance(config, dict) else None
        if not isinstance(config, dict) or (client is not None and not isinstance(client, dict)):
            return _wrong("Service", config, "ServiceSpec.spec.sessionAffinityConfig", "v1.SessionAffinityConfig")
        if client is not None:
            problem = _check_fields("Service", client, "ClientIPConfig", "spec.sessionAffinityConfig.clientIP.",
                                    ints=("timeoutSeconds",))
    return problem


def endpointslice_type_errors(obj: dict[str, Any]) -> str | None:
    """What the typed decoder refuses in an EndpointSlice."""
    kind = "EndpointSlice"
    if obj.get("addressType") is not None and not isinstance(obj.get("addressType"), str):
        return _wrong(kind, obj["addressType"], "EndpointSlice.addressType", "v1.AddressType")
    endpoints = obj.get("endpoints")
    if endpoints is not None:
        if not isinstance(endpoints, list):
            return _wrong(kind, endpoints, "EndpointSlice.endpoints", "[]v1.Endpoint")
        for endpoint in endpoints:
            if not isinstance(endpoint, dict):
                return _wrong(kind, endpoint, "EndpointSlice.endpoints", "v1.Endpoint")
            problem = _string_list(kind, endpoint.get("addresses"), "Endpoint.endpoints.addresses")
            problem = problem or _check_fields(kind, endpoint, "Endpoint", "endpoints.",
                                               strings=("hostname", "nodeName", "zone"))
            conditions = endpoint.get("conditions")
            if problem is None and conditions is not None:
                if not isinstance(conditions, dict):
                    return _wrong(kind, conditions, "Endpoint.endpoints.conditions", "v1.EndpointConditions")
                problem = _check_fields(kind, conditions, "EndpointConditions", "endpoints.conditions.",
                                        bools=("ready", "serving", "terminating"))
            target = endpoint.get("targetRef")
            if problem is None and target is not None and not isinstance(target, dict):
                return _wrong(kind, target, "Endpoint.endpoints.targetRef", "v1.ObjectReference")
            if problem is not None:
                return problem
    ports = obj.get("ports")
    if ports is not None:
        if not isinstance(ports, list):
            return _wrong(kind, ports, "EndpointSlice.ports", "[]v1.EndpointPort")
        for port in ports:
            if not isinstance(port, dict):
                return _wrong(kind, port, "EndpointSlice.ports", "v1.EndpointPort")
            problem = _check_fields(kind, port, "EndpointPort", "ports.", ints=("port",),
                                    strings=("name", "protocol", "appProtocol"))
            if problem is not None:
                return problem
    return None
