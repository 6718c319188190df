"""The lab node's Service proxy: Services' frontends rewritten to their backends, as kube-proxy's nftables
mode does it, in the node's network namespace.

For every Service with a ClusterIP (and every NodePort), a rule in the node's ``nat`` hooks rewrites the
destination of a new connection to one backend chosen at random among the ready endpoints of the
Service's EndpointSlices (``numgen random`` over a map of backend address . port), and conntrack keeps
the translation for the rest of the connection. Pods' packets meet the rule in ``prerouting``, the
node's own in ``output``. podmeter's programs sit on the pods' links, before the rewrite on the client's
side and after it on the backend's: what ``adapters.conntrack`` and ``model.services`` are for.

Level-triggered: the whole table is computed from the Services and EndpointSlices listed and watched, and
replaced in one ``nft -f`` transaction (fed on stdin; the ruleset holds addresses and numbers only,
each parsed before it is written, never a name). With ``podmeter lab --no-service-proxy`` a real
kube-proxy does this instead.

Limits (docs/services.md): no hairpin masquerade (a pod reaching itself through its Service is not
rewritten back), no session affinity, no ``externalTrafficPolicy: Local``; IPv4 and IPv6 tables apart.
"""

from __future__ import annotations

import ipaddress
import logging
import subprocess
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from podmeter.lab.kube import KubeClient, KubeError

log = logging.getLogger("podmeter.lab.services")

TABLE = "podmeter-lab-services"
SERVICES_PATH = "/api/v1/services"
SLICES_PATH = "/apis/discovery.k8s.io/v1/endpointslices"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_PROTOCOLS = {"TCP": "tcp", "UDP": "udp", "SCTP": "sctp"}


@dataclass(frozen=True, order=True)
class Rule:
    """One frontend (an address, or any local address for a NodePort) and its backends."""

    family: str  # "ip" or "ip6"
    protocol: str  # "tcp", "udp", "sctp"
    frontend: str  # an address, or "" for a NodePort
    port: int
    backends: tuple[tuple[str, int], ...]


def rules(services: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]]) -> list[Rule]:
    """The rules for these Services and EndpointSlices (raw objects as the API server serves them)."""
    backends = _ready_backends(slices)
    out: list[Rule] = []
    for service in services:
        meta, spec = service.get("metadata") or {}, service.get("spec") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        frontends = [ip for ip in (spec.get("clusterIPs") or [spec.get("clusterIP")]) if _address(ip)]
        for port in spec.get("ports") or ():
            protocol = _PROTOCOLS.get(port.get("protocol", "TCP"))
            if protocol is None or not isinstance(port.get("port"), int):
                continue
            served = backends.get((key, port.get("name", ""), port.get("protocol", "TCP")), ())
            for family in ("ip", "ip6"):
                chosen = tuple(b for b in served if _family(b[0]) == family)
                if not chosen:
                    continue  # kube-proxy rejects these; here the connection just fails to connect
                out += [Rule(family, protocol, ip, port["port"], chosen) for ip in frontends if _family(ip) == family]
                if isinstance(port.get("nodePort"), int) and port["nodePort"] > 0:
                    out.append(Rule(family, protocol, "", port["nodePort"], chosen))
    return sorted(out)


_PortKey = tuple[tuple[str, str], str, str]  # ((namespace, Service), port name, protocol)


def _ready_backends(slices: Iterable[Mapping[str, Any]]) -> dict[_PortKey, tuple[tuple[str, int], ...]]:
    """(Service, port name, protocol) -> ready (address, port) pairs, from the slices' endpoints."""
    found: dict[_PortKey, set[tuple[str, int]]] = {}
    for piece in slices:
        meta = piece.get("metadata") or {}
        service = (meta.get("namespace", ""), (meta.get("labels") or {}).get(SERVICE_NAME_LABEL, ""))
        for port in piece.get("ports") or ():
            if not isinstance(port.get("port"), int):
                continue
            key = (service, port.get("name") or "", port.get("protocol", "TCP"))
            for endpoint in piece.get("endpoints") or ():
                if (endpoint.get("conditions") or {}).get("ready") is False:
                    continue
                for address in endpoint.get("addresses") or ():
                    if _address(address):
                        found.setdefault(key, set()).add((str(ipaddress.ip_address(address)), port["port"]))
    return {key: tuple(sorted(pairs)) for key, pairs in found.items()}


def _address(text: Any) -> bool:
    if not isinstance(text, str) or text in ("", "None"):
        return False
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _family(ip: str) -> str:
    return "ip" if ipaddress.ip_address(ip).version == 4 else "ip6"


def ruleset(found: Iterable[Rule]) -> str:
    """The nft script that replaces both tables with these rules, in one transaction."""
    by_family: dict[str, list[Rule]] = {"ip": [], "ip6": []}
    for rule in found:
        by_family[rule.family].append(rule)
    lines: list[str] = []
    for family, chosen in by_family.items():
        lines += [f"table {family} {TABLE} {{}}", f"delete table {family} {TABLE}", f"table {family} {TABLE} {{",
                  "  chain prerouting { type nat hook prerouting priority dstnat; policy accept; jump services; }",
                  "  chain output { type nat hook output priority -100; policy accept; jump services; }",
                  "  chain services {"]
        lines += [f"    {_match(rule)} dnat to {_choice(rule)}" for rule in chosen]
        lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def _match(rule: Rule) -> str:
    where = f"{rule.family} daddr {rule.frontend}" if rule.frontend else "fib daddr type local"
    return f"{where} {rule.protocol} dport {rule.port}"


def _choice(rule: Rule) -> str:
    def target(address: str, port: int) -> str:
        return f"[{address}] . {port}" if rule.family == "ip6" else f"{address} . {port}"

    pairs = ", ".join(f"{i} : {target(a, p)}" for i, (a, p) in enumerate(rule.backends))
    return f"numgen random mod {len(rule.backends)} map {{ {pairs} }}"


def removal() -> str:
    return "".join(f"table {family} {TABLE} {{}}\ndelete table {family} {TABLE}\n" for family in ("ip", "ip6"))


def apply(script: str) -> None:
    subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True, capture_output=True)


class ServiceProxy:
    """Lists and watches Services and EndpointSlices and keeps the node's table equal to :func:`rules` of
    what it last listed and watched. Runs on its own thread in the node's netns (the caller's)."""

    def __init__(self, client: KubeClient, watch_timeout: int = 60) -> None:
        self.client = client
        self.watch_timeout = watch_timeout
        self.applied = 0
        self.failures = 0
        self._objects: dict[str, dict[str, dict[str, Any]]] = {SERVICES_PATH: {}, SLICES_PATH: {}}
        self._last = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for path in self._objects:
            thread = threading.Thread(target=self._follow, args=(path,), name=f"service-proxy{path}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(1.0)  # daemon threads: a watch blocked in a read ends with the process
        try:
            apply(removal())
        except (OSError, subprocess.CalledProcessError) as error:
            log.warning("cannot remove the Service rules: %s", error)

    def _follow(self, path: str) -> None:
        while not self._stop.is_set():
            try:
                self._list_and_watch(path)
            except (KubeError, OSError) as error:
                log.warning("service proxy: %s: %s; listing again", path, error)
                self._stop.wait(1.0)

    def _list_and_watch(self, path: str) -> None:
        listed = self.client.list(path)
        with self._lock:
            self._objects[path] = {o["metadata"]["uid"]: o for o in listed.get("items") or ()}
            self._sync()
        rv = str(listed["metadata"].get("resourceVersion", ""))
        while not self._stop.is_set():
            for event in self.client.watch(path, self.watch_timeout, resourceVersion=rv, allowWatchBookmarks="true"):
                if self._stop.is_set():
                    return
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    return
                rv = str(obj.get("metadata", {}).get("resourceVersion", rv))
                if kind == "BOOKMARK":
                    continue
                with self._lock:
                    uid = obj["metadata"]["uid"]
                    if kind == "DELETED":
                        self._objects[path].pop(uid, None)
                    else:
                        self._objects[path][uid] = obj
                    self._sync()

    def _sync(self) -> None:
        script = ruleset(rules(self._objects[SERVICES_PATH].values(), self._objects[SLICES_PATH].values()))
        if script == self._last:
            return
        try:
            apply(script)
        except (OSError, subprocess.CalledProcessError) as error:
            self.failures += 1
            log.warning("cannot apply the Service rules: %s", getattr(error, "stderr", error))
            return
        self._last = script
        self.applied += 1
