"""Services as the real server makes them: defaults, ClusterIP and NodePort allocation, release.

Ported from kube-apiserver 1.36 (``pkg/apis/core/v1`` SetDefaults_Service; ``pkg/registry/core/service``:
``storage.beginCreate``/``beginUpdate``, ``alloc.go``, the IP and port allocators, ``dropTypeDependentFields``):

- ClusterIPs come from the service CIDR(s) (``Settings.service_cidr``, kubeadm's ``10.96.0.0/16`` by
  default; a second CIDR of the other family makes the lab dual-stack). The network address (and, for
  IPv4, the broadcast address) are never handed out. Dynamic allocation starts at a random address of the
  upper band and scans forward, falling back to the lower band (KEP-3070: the first min(max(16, size/16),
  256) addresses are kept for static requests); the first address is the ``kubernetes`` Service's.
- NodePorts come from ``Settings.service_node_port_range`` (30000-32767), the same way (the lower band is
  min(max(16, size/32), 128) ports). Ports of a Service with the same number (DNS on TCP and UDP) share one.
- Requests for a given IP or port are checked against the range and against what other Services hold,
  with the real messages ("failed to allocate IP 10.96.0.10: provided IP is already allocated").

Allocation is computed while the request is prepared and *recorded* only when the write commits
(:meth:`ServiceAllocator.record`), so a rejected request holds nothing; a delete releases everything the
Service held (:meth:`ServiceAllocator.forget`). The allocator's state is, by construction, the union of
what the stored Services hold (:meth:`ServiceAllocator.rebuild` recomputes it from the store).
"""

from __future__ import annotations

import copy
import ipaddress
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from podmeter.lab.apiserver import errors
from podmeter.lab.apiserver.errors import ApiError, Cause
from podmeter.lab.apiserver.netvalidation import (
    CLUSTER_IP_NONE,
    externally_accessible,
    family_of,
    invalid,
    needs_health_check,
    parse_ip,
    validate_cluster_ips,
)

SERVICE_CIDR = "10.96.0.0/16"  # kubeadm's default --service-cluster-ip-range
NODE_PORT_RANGE = "30000-32767"
DEFAULT_AFFINITY_SECONDS = 10800

# ServiceSpec, ServicePort and ServiceStatus fields in the order the real server writes them.
SPEC_ORDER = (
    "ports", "selector", "clusterIP", "clusterIPs", "type", "externalIPs", "sessionAffinity", "loadBalancerIP",
    "loadBalancerSourceRanges", "externalName", "externalTrafficPolicy", "healthCheckNodePort",
    "publishNotReadyAddresses", "sessionAffinityConfig", "ipFamilies", "ipFamilyPolicy",
    "allocateLoadBalancerNodePorts", "loadBalancerClass", "internalTrafficPolicy", "trafficDistribution",
)
PORT_ORDER = ("name", "protocol", "appProtocol", "port", "targetPort", "nodePort")


class AllocationError(Exception):
    """An allocator refused: the message is the real allocator's error text."""


def _range_offset(size: int, lower: int, upper: int, step: int) -> int:
    """KEP-3070's reserved lower band: min(max(lower, size/step), upper), none for tiny ranges."""
    if size <= lower:
        return 0
    return max(lower, min(size // step, upper))


class IpRange:
    """One service CIDR. ``first``..``last`` are the allocatable addresses (as integers)."""

    def __init__(self, cidr: str) -> None:
        net = ipaddress.ip_network(cidr.strip(), strict=True)
        if net.version == 4 and net.prefixlen < 12:
            raise ValueError(f"service CIDR {cidr} is too large; for 32-bit addresses, the mask must be >= 12")
        if net.version == 6 and net.prefixlen < 64:
            raise ValueError(f"service CIDR {cidr}: shortest allowed prefix length for service CIDR is 64")
        self.network = net
        self.family = "IPv4" if net.version == 4 else "IPv6"
        base = int(net.network_address)
        self.first = base + 1
        self.last = int(net.broadcast_address) - (1 if net.version == 4 else 0)
        if self.last < self.first:
            raise ValueError(f"service CIDR {cidr} has no allocatable address")
        self.offset = _range_offset(net.num_addresses, 16, 256, 16)

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def text(self, value: int) -> str:
        return str(ipaddress.ip_address(value))

    def check(self, ip: str) -> str | None:
        """Why ``ip`` cannot be allocated from this range (before looking at who holds what), or None."""
        parsed = parse_ip(ip)
        if parsed is None or parsed not in self.network:
            return "the provided network does not match the current range"
        if not self.first <= int(parsed) <= self.last:
            return f"the provided IP ({ip}) is not in the valid range. The range of valid IPs is {self.network}"
        return None

    def next_free(self, used: set[str], rng: random.Random) -> str:
        """A free address: from a random start in the upper band, then in the lower band."""
        return self.text(_next_free(self.first, self.last, self.offset, lambda n: self.text(n) in used, rng))


class PortRange:
    """The NodePort range (``30000-32767``)."""

    def __init__(self, text: str) -> None:
        low, sep, high = text.partition("-")
        if not sep or not low.strip().isdigit() or not high.strip().isdigit():
            raise ValueError(f"node port range {text!r}: expected LOW-HIGH")
        self.base, self.top = int(low), int(high)
        if not 0 < self.base <= self.top <= 65535:
            raise ValueError(f"node port range {text!r} is not within 1-65535")
        self.offset = _range_offset(self.size, 16, 128, 32)

    @property
    def size(self) -> int:
        return self.top - self.base + 1

    def __str__(self) -> str:
        return f"{self.base}-{self.top}"

    def check(self, port: int) -> str | None:
        if not self.base <= port <= self.top:
            return f"provided port is not in the valid range. The range of valid ports is {self}"
        return None

    def next_free(self, used: set[int], rng: random.Random) -> int:
        return _next_free(self.base, self.top, self.offset, used.__contains__, rng)


def _next_free(first: int, last: int, offset: int, taken: Callable[[int], bool], rng: random.Random) -> int:
    """The real allocators' order: from a random start in the upper band (``first + offset`` on), then in
    the lower band, the first number not ``taken``."""
    for low, high in ((first + offset, last), (first, first + offset - 1)):
        if high < low:
            continue
        span = high - low + 1
        start = rng.randrange(span)
        for step in range(span):
            candidate = low + (start + step) % span
            if not taken(candidate):
                return candidate
    raise AllocationError("range is full")


@dataclass
class _Claims:
    ips: frozenset[str] = frozenset()
    ports: frozenset[int] = frozenset()


@dataclass
class _PortOp:
    """The ports one request allocates (the real PortAllocationOperation): checked against what other
    Services hold and what this request already took; nothing is recorded until the write commits."""

    owner: ServiceAllocator
    dry_run: bool
    taken: list[int] = field(default_factory=list)

    def allocate(self, port: int) -> None:
        if not self.dry_run:
            problem = self.owner.ports.check(port)
            if problem:
                raise AllocationError(problem)
        if port in self.owner.port_owner or port in self.taken:
            raise AllocationError("provided port is already allocated")
        self.taken.append(port)

    def allocate_next(self) -> int:
        if self.dry_run:  # the real dry run hands out dummy ports above the range
            port = max(self.taken, default=32768) + 1
            self.taken.append(port)
            return port
        port = self.owner.ports.next_free(set(self.owner.port_owner) | set(self.taken), self.owner.rng)
        self.taken.append(port)
        return port


class ServiceAllocator:
    """ClusterIPs by family and NodePorts, and which Service (``namespace/name``) holds each."""

    def __init__(self, cidrs: str = SERVICE_CIDR, node_ports: str = NODE_PORT_RANGE, seed: int | None = None) -> None:
        ranges = [IpRange(c) for c in cidrs.split(",") if c.strip()]
        if not ranges or len(ranges) > 2 or (len(ranges) == 2 and ranges[0].family == ranges[1].family):
            raise ValueError(f"service CIDRs {cidrs!r}: one CIDR, or two of different IP families")
        self.ranges = {r.family: r for r in ranges}
        self.primary = ranges[0].family
        self.ports = PortRange(node_ports)
        self.rng = random.Random(seed)
        self.ip_owner: dict[str, str] = {}
        self.port_owner: dict[int, str] = {}
        self.claims: dict[str, _Claims] = {}

    @property
    def dual_stack(self) -> bool:
        return len(self.ranges) == 2

    def kubernetes_ip(self) -> str:
        """The first address of the primary range: the ``kubernetes`` Service's."""
        primary = self.ranges[self.primary]
        return primary.text(primary.first)

    # --- bookkeeping ------------------------------------------------------------------------------------
    def record(self, key: str, service: dict[str, Any]) -> None:
        """``service`` (committed) now holds exactly what its spec names; anything else it held is free."""
        spec = service.get("spec") if isinstance(service.get("spec"), dict) else {}
        assert isinstance(spec, dict)
        ips = {ip for ip in _list(spec.get("clusterIPs")) if isinstance(ip, str) and ip not in ("", CLUSTER_IP_NONE)}
        ports = {p.get("nodePort") for p in _list(spec.get("ports")) if isinstance(p, dict)}
        ports.add(spec.get("healthCheckNodePort"))
        held = {p for p in ports if isinstance(p, int) and not isinstance(p, bool) and p > 0}
        self.forget(key)
        for ip in ips:
            self.ip_owner.setdefault(ip, key)
        for port in held:
            self.port_owner.setdefault(port, key)
        if ips or held:
            self.claims[key] = _Claims(frozenset(ips), frozenset(held))

    def forget(self, key: str) -> None:
        """Release everything ``key`` holds (a delete)."""
        claims = self.claims.pop(key, None)
        if claims is None:
            return
        for ip in claims.ips:
            if self.ip_owner.get(ip) == key:
                del self.ip_owner[ip]
        for port in claims.ports:
            if self.port_owner.get(port) == key:
                del self.port_owner[port]

    def rebuild(self, services: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """Recompute every claim from the stored Services (after an inject)."""
        self.ip_owner.clear()
        self.port_owner.clear()
        self.claims.clear()
        for key, service in services:
            self.record(key, service)

    def stats(self) -> dict[str, Any]:
        return {
            "clusterIPs": {
                family: {"cidr": str(r.network), "size": r.size,
                         "used": sum(1 for ip in self.ip_owner if family_of(ip) == family)}
                for family, r in self.ranges.items()
            },
            "nodePorts": {"range": str(self.ports), "used": len(self.port_owner)},
            "services": len(self.claims),
        }

    # --- create and update (beginCreate / beginUpdate) -------------------------------------------------
    def allocate_create(self, service: dict[str, Any], dry_run: bool) -> None:
        """Fill ``clusterIP(s)``, ``ipFamilies``, ``ipFamilyPolicy`` and the NodePorts of a new Service."""
        spec = service["spec"]
        name = str(service["metadata"].get("name", ""))
        _normalize_cluster_ips(spec, None)
        self._init_families(spec, None, name)
        if spec.get("type") != "ExternalName" and not _is_headless_ips(spec):
            families = _list(spec.get("ipFamilies"))
            ips = list(_list(spec.get("clusterIPs")))
            ips += [""] * (len(families) - len(ips))
            spec["clusterIPs"] = [self._allocate_ip(spec, families[i], ips[i], name, dry_run)
                                  for i in range(len(families))]
            spec["clusterIP"] = spec["clusterIPs"][0]
        op = _PortOp(self, dry_run)
        if spec.get("type") in ("NodePort", "LoadBalancer"):
            self._init_node_ports(spec, op, name)
        if needs_health_check(spec):
            self._health_check_port(spec, op)
        order_spec(service)

    def prepare_update(self, new: dict[str, Any], old: dict[str, Any], dry_run: bool) -> None:
        """An update's allocation work, then PrepareForUpdate's type-dependent cleanup."""
        default_service(new, on_create=False)
        spec, before = new["spec"], old.get("spec") or {}
        name = str(new["metadata"].get("name", ""))
        _patch_allocated(spec, before)
        _normalize_cluster_ips(spec, before)
        self._init_families(spec, before, name)
        self._update_cluster_ips(spec, before, name, dry_run)
        op = _PortOp(self, dry_run)
        if spec.get("type") in ("NodePort", "LoadBalancer"):
            self._update_node_ports(spec, before, op, name)
        if needs_health_check(spec) and not needs_health_check(before):
            self._health_check_port(spec, op)
        _drop_type_dependent(new, old)
        order_spec(new)

    def _invalid(self, name: str, causes: list[Cause]) -> ApiError:
        return errors.invalid("Service", name, causes)

    def _allocate_ip(self, spec: dict[str, Any], family: str, requested: str, name: str, dry_run: bool) -> str:
        ip_range = self.ranges[family]
        if not requested:
            if dry_run:  # the real dry run answers the network address
                return str(ip_range.network.network_address)
            try:
                return ip_range.next_free(set(self.ip_owner), self.rng)
            except AllocationError as exc:
                raise errors.internal(f"failed to allocate a serviceIP: {exc}") from exc
        problem = ip_range.check(requested)
        if problem is None and not dry_run and requested in self.ip_owner:
            problem = "provided IP is already allocated"
        if problem is not None:
            shown = [ip for ip in _list(spec.get("clusterIPs")) if ip]
            raise self._invalid(
                name, [invalid("spec.clusterIPs", shown, f"failed to allocate IP {requested}: {problem}")]
            )
        return requested

    def _init_families(self, spec: dict[str, Any], before: dict[str, Any] | None, name: str) -> None:
        """``initIPFamilyFields``: default ``ipFamilyPolicy`` and ``ipFamilies`` for this cluster, refuse
        families it does not have."""
        if spec.get("type") == "ExternalName":
            return
        if before is not None and _matching_prefer_dual_stack(spec, before):
            return
        if spec.get("ipFamilyPolicy") is None:
            if before is not None and before.get("ipFamilyPolicy") is not None:
                spec["ipFamilyPolicy"] = before["ipFamilyPolicy"]
            elif spec.get("clusterIP") == CLUSTER_IP_NONE and not spec.get("selector"):
                spec["ipFamilyPolicy"] = "RequireDualStack"  # headless without selector: dual if possible
            else:
                spec["ipFamilyPolicy"] = "SingleStack"
        causes = validate_cluster_ips(spec)
        if causes:
            raise self._invalid(name, causes)
        policy = spec["ipFamilyPolicy"]
        ips = _list(spec.get("clusterIPs"))
        families = list(_list(spec.get("ipFamilies")))
        if before is not None:
            if policy == "SingleStack":
                if _list(before.get("clusterIPs")) == ips and len(ips) > 1:
                    spec["clusterIPs"] = ips = ips[:1]
                if _list(before.get("ipFamilies")) == families and len(families) > 1:
                    families = families[:1]
            else:
                if len(ips) < len(_list(before.get("clusterIPs"))):
                    causes.append(invalid("spec.ipFamilyPolicy", policy,
                                          "must be 'SingleStack' to release the secondary cluster IP"))
                if len(families) < len(_list(before.get("ipFamilies"))):
                    causes.append(invalid("spec.ipFamilyPolicy", policy,
                                          "must be 'SingleStack' to release the secondary IP family"))
        if policy == "SingleStack":
            if len(ips) == 2:
                causes.append(invalid("spec.ipFamilyPolicy", policy,
                                      "must be 'RequireDualStack' or 'PreferDualStack' when multiple cluster IPs "
                                      "are specified"))
            if len(families) == 2:
                causes.append(invalid("spec.ipFamilyPolicy", policy,
                                      "must be 'RequireDualStack' or 'PreferDualStack' when multiple IP families "
                                      "are specified"))
        for i, ip in enumerate(ips):
            if ip == CLUSTER_IP_NONE:
                break
            family = family_of(ip)
            if i >= len(families):
                if family not in self.ranges:
                    causes.append(invalid(f"spec.clusterIPs[{i}]", ips, f"{family} is not configured on this cluster"))
                else:
                    families.append(family)
        if causes:
            raise self._invalid(name, causes)
        other = {"IPv4": "IPv6", "IPv6": "IPv4"}
        if spec.get("clusterIP") == CLUSTER_IP_NONE and not spec.get("selector"):
            families = families or [self.primary]
            if len(families) < 2 and policy != "SingleStack" and families[0] in other:
                families.append(other[families[0]])
            spec["ipFamilies"] = families
            return
        if policy == "RequireDualStack" and not self.dual_stack:
            causes.append(invalid("spec.ipFamilyPolicy", policy,
                                  "this cluster is not configured for dual-stack services"))
        for i, family in enumerate(families):
            if family not in self.ranges:
                causes.append(invalid(f"spec.ipFamilies[{i}]", family, "not configured on this cluster"))
        if causes:
            raise self._invalid(name, causes)
        families = families or [self.primary]
        if policy != "SingleStack" and len(families) == 1 and self.dual_stack:
            families.append(other[families[0]])
        spec["ipFamilies"] = families

    def _update_cluster_ips(self, spec: dict[str, Any], before: dict[str, Any], name: str, dry_run: bool) -> None:
        """``updateClusterIPs``: allocate when leaving ExternalName or adding the secondary family; what is
        dropped is released when the write commits (``record``)."""
        if before.get("type") == "ExternalName" and spec.get("type") != "ExternalName":
            if _is_headless_ips(spec):
                return
            families = _list(spec.get("ipFamilies"))
            ips = list(_list(spec.get("clusterIPs")))
            ips += [""] * (len(families) - len(ips))
            spec["clusterIPs"] = [self._allocate_ip(spec, families[i], ips[i], name, dry_run)
                                  for i in range(len(families))]
            spec["clusterIP"] = spec["clusterIPs"][0]
            return
        if spec.get("type") == "ExternalName":
            return
        families, old_families = _list(spec.get("ipFamilies")), _list(before.get("ipFamilies"))
        if len(old_families) == 1 and len(families) == 2 and not _is_headless_ips(spec):
            ips = list(_list(spec.get("clusterIPs")))
            if len(ips) < 2:
                ips.append("")
            ips[1] = self._allocate_ip(spec, families[1], ips[1], name, dry_run)
            spec["clusterIPs"] = ips

    def _init_node_ports(self, spec: dict[str, Any], op: _PortOp, name: str) -> None:
        """``initNodePorts``: a NodePort per port number (shared by ports with the same number)."""
        by_port: dict[Any, int] = {}
        ports = _list(spec.get("ports"))
        allocate_all = _should_allocate_node_ports(spec)
        for i, port in enumerate(ports):
            if not isinstance(port, dict):
                continue
            if not port.get("nodePort") and not allocate_all:
                continue
            number = port.get("port")
            known = by_port.get(number, 0)
            if not known:
                requested = next((p.get("nodePort") for p in ports
                                  if isinstance(p, dict) and p.get("port") == number and p.get("nodePort")), 0)
                if requested:
                    self._allocate_port(op, requested, i, name)
                    port["nodePort"] = by_port[number] = requested
                else:
                    try:
                        port["nodePort"] = by_port[number] = op.allocate_next()
                    except AllocationError as exc:
                        raise errors.internal(f"failed to allocate a nodePort: {exc}") from exc
            elif port.get("nodePort") != known:
                if not port.get("nodePort"):
                    port["nodePort"] = known
                else:
                    self._allocate_port(op, port["nodePort"], i, name)

    def _update_node_ports(self, spec: dict[str, Any], before: dict[str, Any], op: _PortOp, name: str) -> None:
        """``updateNodePorts``: keep what the Service held, allocate what is new or missing."""
        old_numbers = {p.get("nodePort") for p in _list(before.get("ports")) if isinstance(p, dict)}
        seen: list[tuple[Any, int]] = []
        allocate_all = _should_allocate_node_ports(spec)
        for i, port in enumerate(_list(spec.get("ports"))):
            if not isinstance(port, dict):
                continue
            number = port.get("nodePort") or 0
            if not number and not allocate_all:
                continue
            if number:
                if number not in old_numbers and number not in op.taken:
                    self._allocate_port(op, number, i, name)
            else:
                try:
                    number = port["nodePort"] = op.allocate_next()
                except AllocationError as exc:
                    raise errors.internal(f"failed to allocate a nodePort: {exc}") from exc
            key = (port.get("protocol"), number)
            if key in seen:
                raise errors.internal(f"duplicate nodePort: {{{port.get('protocol')} {number}}}")
            seen.append(key)

    def _allocate_port(self, op: _PortOp, port: int, index: int, name: str) -> None:
        try:
            op.allocate(port)
        except AllocationError as exc:
            raise self._invalid(name, [invalid(f"spec.ports[{index}].nodePort", port, str(exc))]) from exc

    def _health_check_port(self, spec: dict[str, Any], op: _PortOp) -> None:
        requested = spec.get("healthCheckNodePort") or 0
        try:
            if requested:
                op.allocate(requested)
            else:
                spec["healthCheckNodePort"] = op.allocate_next()
        except AllocationError as exc:
            what = f"requested HealthCheck NodePort {requested}" if requested else "a HealthCheck NodePort 0"
            raise errors.internal(f"failed to allocate {what}: {exc}") from exc


# --- the pure parts ------------------------------------------------------------------------------------------


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _is_headless_ips(spec: dict[str, Any]) -> bool:
    ips = _list(spec.get("clusterIPs"))
    return bool(ips) and ips[0] == CLUSTER_IP_NONE


def _should_allocate_node_ports(spec: dict[str, Any]) -> bool:
    if spec.get("type") == "NodePort":
        return True
    return spec.get("type") == "LoadBalancer" and spec.get("allocateLoadBalancerNodePorts") is not False


def _normalize_cluster_ips(spec: dict[str, Any], before: dict[str, Any] | None) -> None:
    """``normalizeClusterIPs``: keep ``clusterIP`` and ``clusterIPs`` in step for clients that set one."""
    ip, ips = spec.get("clusterIP") or "", _list(spec.get("clusterIPs"))
    if before is None:
        if ip and not ips:
            spec["clusterIPs"] = [ip]
        return
    old_ip, old_ips = before.get("clusterIP") or "", _list(before.get("clusterIPs"))
    if old_ips and not ips and old_ip == ip:
        spec["clusterIPs"] = ips = list(old_ips)
    if old_ip != ip:
        if old_ip and not ip:
            if ips == old_ips:
                spec.pop("clusterIPs", None)
        elif ips == old_ips:
            spec["clusterIPs"] = [ip]


def _patch_allocated(spec: dict[str, Any], before: dict[str, Any]) -> None:
    """``patchAllocatedValues``: a client that leaves out what the server allocated keeps it."""
    if before.get("type") != "ExternalName" and spec.get("type") != "ExternalName":
        if not spec.get("clusterIP") and before.get("clusterIP"):
            spec["clusterIP"] = before["clusterIP"]
        if not spec.get("clusterIPs") and before.get("clusterIPs"):
            spec["clusterIPs"] = list(before["clusterIPs"])
    node_port_types = ("NodePort", "LoadBalancer")
    if before.get("type") in node_port_types and spec.get("type") in node_port_types:
        old_ports = [p for p in _list(before.get("ports")) if isinstance(p, dict)]
        new_ports = [p for p in _list(spec.get("ports")) if isinstance(p, dict)]
        used = {p.get("nodePort") for p in old_ports} & {p.get("nodePort") for p in new_ports if p.get("nodePort")}
        by_name = {p.get("name") or "": p.get("nodePort") for p in old_ports}
        for port in new_ports:
            if not port.get("nodePort"):
                old = by_name.get(port.get("name") or "")
                if old and old not in used:
                    port["nodePort"] = old
    if needs_health_check(before) and needs_health_check(spec) and not spec.get("healthCheckNodePort"):
        spec["healthCheckNodePort"] = before.get("healthCheckNodePort")


def _matching_prefer_dual_stack(spec: dict[str, Any], before: dict[str, Any]) -> bool:
    return (
        spec.get("ipFamilyPolicy") == "PreferDualStack"
        and before.get("type") == spec.get("type")
        and spec.get("type") in ("ClusterIP", "NodePort", "LoadBalancer")
        and before.get("ipFamilyPolicy") in (None, "PreferDualStack")
        and _list(before.get("clusterIPs")) == _list(spec.get("clusterIPs"))
        and _list(before.get("ipFamilies")) == _list(spec.get("ipFamilies"))
    )


def _drop_type_dependent(new: dict[str, Any], old: dict[str, Any]) -> None:
    """``dropTypeDependentFields``: a type change that needs no NodePorts (or health check port, or
    allocateLoadBalancerNodePorts, or externalTrafficPolicy) clears them when the client left them as they
    were; the load-balancer status goes with the LoadBalancer type."""
    spec, before = new["spec"], old.get("spec") or {}
    node_port_types = ("NodePort", "LoadBalancer")
    ports, old_ports = _list(spec.get("ports")), _list(before.get("ports"))

    def node_ports(items: list[Any]) -> list[Any]:
        return [p.get("nodePort") for p in items if isinstance(p, dict)]

    if before.get("type") in node_port_types and spec.get("type") not in node_port_types \
            and node_ports(ports) == node_ports(old_ports):
        for port in ports:
            if isinstance(port, dict):
                port.pop("nodePort", None)
    if needs_health_check(before) and not needs_health_check(spec) \
            and spec.get("healthCheckNodePort") == before.get("healthCheckNodePort"):
        spec.pop("healthCheckNodePort", None)
    if before.get("type") == "LoadBalancer" and spec.get("type") != "LoadBalancer" \
            and spec.get("allocateLoadBalancerNodePorts") is not None \
            and spec.get("allocateLoadBalancerNodePorts") == before.get("allocateLoadBalancerNodePorts"):
        spec.pop("allocateLoadBalancerNodePorts", None)
    if externally_accessible(before) and not externally_accessible(spec) \
            and spec.get("externalTrafficPolicy") == before.get("externalTrafficPolicy"):
        spec.pop("externalTrafficPolicy", None)
    if spec.get("type") != "LoadBalancer":
        status = new.get("status")
        new["status"] = {**(status if isinstance(status, dict) else {}), "loadBalancer": {}}


def default_service(obj: dict[str, Any], on_create: bool = True) -> None:
    """``SetDefaults_Service`` (what the v1 decoder fills in), plus PrepareForCreate's empty status."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        spec = obj["spec"] = {}
    if not spec.get("sessionAffinity"):
        spec["sessionAffinity"] = "None"
    if spec["sessionAffinity"] == "None":
        spec.pop("sessionAffinityConfig", None)
    if spec["sessionAffinity"] == "ClientIP":
        config = spec.get("sessionAffinityConfig")
        client = config.get("clientIP") if isinstance(config, dict) else None
        if not isinstance(client, dict) or client.get("timeoutSeconds") is None:
            spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": DEFAULT_AFFINITY_SECONDS}}
    if not spec.get("type"):
        spec["type"] = "ClusterIP"
    for port in _list(spec.get("ports")):
        if not isinstance(port, dict):
            continue
        if not port.get("protocol"):
            port["protocol"] = "TCP"
        if port.get("targetPort") in (None, 0, ""):
            port["targetPort"] = port.get("port", 0)
        port.setdefault("port", 0)
    if externally_accessible(spec) and not spec.get("externalTrafficPolicy"):
        spec["externalTrafficPolicy"] = "Cluster"
    if spec.get("internalTrafficPolicy") is None and spec["type"] in ("ClusterIP", "NodePort", "LoadBalancer"):
        spec["internalTrafficPolicy"] = "Cluster"
    if spec["type"] == "LoadBalancer" and spec.get("allocateLoadBalancerNodePorts") is None:
        spec["allocateLoadBalancerNodePorts"] = True
    if on_create:
        obj["status"] = {"loadBalancer": {}}
    order_spec(obj)


def default_service_status(obj: dict[str, Any]) -> None:
    """A status write: a LoadBalancer's ingress IPs get ``ipMode: VIP`` (LoadBalancerIPMode)."""
    status = obj.get("status")
    if not isinstance(status, dict):
        obj["status"] = status = {}
    status.setdefault("loadBalancer", {})
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    if isinstance(spec, dict) and spec.get("type") == "LoadBalancer":
        lb = status["loadBalancer"] if isinstance(status["loadBalancer"], dict) else {}
        for entry in _list(lb.get("ingress")):
            if isinstance(entry, dict) and entry.get("ip") and entry.get("ipMode") is None:
                entry["ipMode"] = "VIP"


def order_spec(obj: dict[str, Any]) -> None:
    """The real server's field order, and no empty optional fields (they are ``omitempty``)."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return
    for port in _list(spec.get("ports")):
        if isinstance(port, dict):
            for key in ("name", "nodePort", "appProtocol"):
                if port.get(key) in (None, "", 0):
                    port.pop(key, None)
            _reorder(port, PORT_ORDER)
    for key in list(spec):
        value = spec[key]
        if value is None or value in ([], {}, "") or (key == "healthCheckNodePort" and value == 0) \
                or (key == "publishNotReadyAddresses" and value is False):
            del spec[key]
    _reorder(spec, SPEC_ORDER)


def _reorder(d: dict[str, Any], order: tuple[str, ...]) -> None:
    items = [(k, d[k]) for k in order if k in d] + [(k, v) for k, v in d.items() if k not in order]
    d.clear()
    d.update(items)


def kubernetes_service(cluster_ip: str) -> dict[str, Any]:
    """The ``default/kubernetes`` Service a real control plane keeps, with the first ClusterIP."""
    return copy.deepcopy({
        "metadata": {"name": "kubernetes", "namespace": "default",
                     "labels": {"component": "apiserver", "provider": "kubernetes"}},
        "spec": {"ports": [{"name": "https", "protocol": "TCP", "port": 443, "targetPort": 6443}],
                 "clusterIP": cluster_ip, "clusterIPs": [cluster_ip], "type": "ClusterIP",
                 "sessionAffinity": "None"},
    })
