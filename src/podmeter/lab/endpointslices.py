"""The lab's EndpointSlice controller: Services' selectors and pods become EndpointSlices.

What kube-controller-manager's endpointslice controller does, for the lab's embedded API server (against a
real cluster, ``podmeter lab --kubeconfig``, the cluster's own controller does it: don't start this one
there). Same conventions as the real one, so a consumer sees the same objects either way:

- A Service with a selector (not ExternalName) gets EndpointSlices named ``<service>-<5 random>``
  (``generateName``), labelled ``kubernetes.io/service-name=<service>`` and
  ``endpointslice.kubernetes.io/managed-by=endpointslice-controller.k8s.io`` (plus the Service's own labels
  and ``service.kubernetes.io/headless`` for a headless Service), owned by the Service (``controller``).
- One endpoint per pod the selector matches in the Service's namespace that has an IP of the slice's
  address type and has not finished (Succeeded/Failed): ``conditions.serving`` = the pod's Ready condition,
  ``terminating`` = it has a ``deletionTimestamp``, ``ready`` = serving and not terminating (or the
  Service's ``publishNotReadyAddresses``); ``nodeName``, ``zone`` (the node's
  ``topology.kubernetes.io/zone``), ``hostname`` (a pod whose ``subdomain`` is the Service), ``targetRef``.
- Ports from each Service port's ``targetPort``: a number as it is, a name resolved against the pod's
  container ports of the same protocol (a pod without it gets no such port). Pods with different resolved
  ports go to different slices; at most 100 endpoints per slice; one per IP family of the Service. A
  Service that selects nothing keeps one empty placeholder slice, as the real controller does.
- Slices whose Service is gone, has no selector any more, or is another object with the same name (other
  uid) are deleted (a real cluster's garbage collector does the first through ``ownerReferences``; the lab
  has none). Slices without the managed-by label are never touched.

Level-triggered: informers (list + watch, relist on ``410``/errors) keep trimmed copies of Services, pods,
nodes and the controller's own slices; every change marks its namespace dirty; a worker recomputes the
wanted slices of the dirty namespaces from the current copies (:func:`desired_slices`) and applies only
the differences (:func:`plan`: create, update by merge patch with a resourceVersion precondition, delete),
so a missed or duplicated event costs a pass, never a leaked or stale slice. A write's answer updates the
copy at once (and older watch events for it are ignored), so a second pass never duplicates a slice.

Deliberate differences: a pod on a node the API server does not know is kept (the lab's embedded server
has no Node objects; the real controller skips such pods unless ``skip_pods_on_missing_nodes``); slices
are re-packed deterministically (sorted by pod) rather than patched in place to minimise churn; there is
no ``endpoints.kubernetes.io/last-change-trigger-time`` annotation.

Use::

    controller = EndpointSliceController(KubeClient.from_kubeconfig(path))
    controller.start()          # threads: one informer per resource, one worker
    ...
    controller.stop()           # closes the watches, joins the threads
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from podmeter.lab.kube import KubeClient, KubeError

log = logging.getLogger("podmeter.lab.endpointslices")

CONTROLLER_NAME = "endpointslice-controller.k8s.io"
MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
SERVICE_NAME = "kubernetes.io/service-name"
HEADLESS = "service.kubernetes.io/headless"
ZONE = "topology.kubernetes.io/zone"
MAX_ENDPOINTS_PER_SLICE = 100  # kube-controller-manager's --max-endpoints-per-slice
_RESERVED = (SERVICE_NAME, MANAGED_BY, HEADLESS)
SLICES_PATH = "/apis/discovery.k8s.io/v1/endpointslices"


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    return _dict(obj.get("metadata"))


def _key(obj: dict[str, Any]) -> str:
    meta = _meta(obj)
    namespace = meta.get("namespace")
    return f"{namespace}/{meta.get('name')}" if namespace else str(meta.get("name"))


# --- what the controller wants (pure) ------------------------------------------------------------------


def managed(service: dict[str, Any]) -> bool:
    """Whether the controller keeps slices for ``service``: it has a selector and is not ExternalName."""
    spec = _dict(service.get("spec"))
    return bool(_dict(spec.get("selector"))) and spec.get("type") != "ExternalName"


def selects(service: dict[str, Any], pod: dict[str, Any]) -> bool:
    selector = _dict(_dict(service.get("spec")).get("selector"))
    labels = _dict(_meta(pod).get("labels"))
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def address_types(service: dict[str, Any]) -> list[str]:
    """The slices' address types: the Service's ``ipFamilies`` (else the family of its ClusterIP)."""
    spec = _dict(service.get("spec"))
    families = [f for f in _list(spec.get("ipFamilies")) if f in ("IPv4", "IPv6")]
    if families:
        return families
    ip = str(spec.get("clusterIP") or "")
    return ["IPv6" if ":" in ip else "IPv4"]


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = _list(_dict(pod.get("status")).get("conditions"))
    return any(_dict(c).get("type") == "Ready" and _dict(c).get("status") == "True" for c in conditions)


def _pod_ips(pod: dict[str, Any]) -> list[str]:
    status = _dict(pod.get("status"))
    ips = [str(_dict(p).get("ip")) for p in _list(status.get("podIPs")) if _dict(p).get("ip")]
    if not ips and status.get("podIP"):
        ips = [str(status["podIP"])]
    return ips


def in_endpoints(pod: dict[str, Any]) -> bool:
    """``ShouldPodBeInEndpoints(pod, includeTerminating=true)``: not finished, and it has an IP."""
    return _dict(pod.get("status")).get("phase") not in ("Succeeded", "Failed") and bool(_pod_ips(pod))


def find_port(pod: dict[str, Any], service_port: dict[str, Any]) -> int | None:
    """``FindPort``: the target port as a number, or the pod's container port of that name and protocol
    (sidecars, init containers with ``restartPolicy: Always``, count)."""
    target = service_port.get("targetPort")
    if isinstance(target, int) and not isinstance(target, bool):
        return target
    if not isinstance(target, str):
        return None
    spec = _dict(pod.get("spec"))
    protocol = service_port.get("protocol") or "TCP"
    containers = _list(spec.get("containers")) + [
        c for c in _list(spec.get("initContainers")) if _dict(c).get("restartPolicy") == "Always"
    ]
    for container in containers:
        for port in _list(_dict(container).get("ports")):
            p = _dict(port)
            if p.get("name") == target and (p.get("protocol") or "TCP") == protocol:
                number = p.get("containerPort")
                return number if isinstance(number, int) else None
    return None


def endpoint_ports(service: dict[str, Any], pod: dict[str, Any]) -> list[dict[str, Any]]:
    """``getEndpointPorts``: one per Service port the pod resolves, in the Service's order."""
    out = []
    for raw in _list(_dict(service.get("spec")).get("ports")):
        sp = _dict(raw)
        number = find_port(pod, sp)
        if number is None:
            continue
        port: dict[str, Any] = {"name": sp.get("name") or "", "protocol": sp.get("protocol") or "TCP", "port": number}
        if sp.get("appProtocol") is not None:
            port["appProtocol"] = sp["appProtocol"]
        out.append(port)
    return out


def pod_endpoint(
    service: dict[str, Any], pod: dict[str, Any], address_type: str, zones: dict[str, str]
) -> dict[str, Any] | None:
    """``podToEndpoint``, in the server's field order; None if the pod has no IP of ``address_type``."""
    want_v6 = address_type == "IPv6"
    address = next((ip for ip in _pod_ips(pod) if (":" in ip) == want_v6), None)
    if address is None:
        return None
    meta, spec = _meta(pod), _dict(pod.get("spec"))
    svc_meta, svc_spec = _meta(service), _dict(service.get("spec"))
    serving = pod_ready(pod)
    terminating = meta.get("deletionTimestamp") is not None
    ready = bool(svc_spec.get("publishNotReadyAddresses")) or (serving and not terminating)
    endpoint: dict[str, Any] = {
        "addresses": [address],
        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
    }
    hostname = spec.get("hostname")
    if hostname and spec.get("subdomain") == svc_meta.get("name") and meta.get("namespace") == svc_meta.get(
        "namespace"
    ):
        endpoint["hostname"] = hostname
    endpoint["targetRef"] = {
        "kind": "Pod",
        "namespace": meta.get("namespace"),
        "name": meta.get("name"),
        "uid": meta.get("uid"),
    }
    node = spec.get("nodeName")
    if node:
        endpoint["nodeName"] = node
        if zones.get(node):
            endpoint["zone"] = zones[node]
    return endpoint


def desired_slices(
    service: dict[str, Any],
    pods: Iterable[dict[str, Any]],
    zones: dict[str, str] | None = None,
    max_per_slice: int = MAX_ENDPOINTS_PER_SLICE,
    known_nodes: set[str] | None = None,
) -> list[dict[str, Any]]:
    """The content (``addressType``, ``endpoints``, ``ports``) of the slices ``service`` should have, in a
    deterministic order; [] for a Service the controller does not manage. ``known_nodes``: skip pods on
    other nodes (the real controller's rule; None keeps them)."""
    if not managed(service):
        return []
    zones = zones or {}
    namespace = _meta(service).get("namespace")
    chosen = sorted(
        (p for p in pods if _meta(p).get("namespace") == namespace and selects(service, p) and in_endpoints(p)),
        key=lambda p: str(_meta(p).get("name")),
    )
    if known_nodes is not None and not _dict(service.get("spec")).get("publishNotReadyAddresses"):
        chosen = [p for p in chosen if _dict(p.get("spec")).get("nodeName") in known_nodes]
    out: list[dict[str, Any]] = []
    families = address_types(service)
    for family in families:
        groups: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
        for pod in chosen:
            endpoint = pod_endpoint(service, pod, family, zones)
            if endpoint is None:
                continue
            ports = endpoint_ports(service, pod)
            groups.setdefault(_canon(ports), (ports, []))[1].append(endpoint)
        for group in sorted(groups):
            ports, endpoints = groups[group]
            for start in range(0, len(endpoints), max_per_slice):
                out.append({"addressType": family, "endpoints": endpoints[start : start + max_per_slice],
                            "ports": ports or None})
    if not out:  # the placeholder: one empty slice of the primary family
        out.append({"addressType": families[0], "endpoints": None, "ports": None})
    return out


def slice_labels(service: dict[str, Any]) -> dict[str, str]:
    """``setEndpointSliceLabels``: the Service's labels (but the reserved ones), headless, name, manager."""
    labels = {k: v for k, v in _dict(_meta(service).get("labels")).items() if k not in _RESERVED}
    cluster_ip = _dict(service.get("spec")).get("clusterIP")
    if cluster_ip in (None, "", "None"):
        labels[HEADLESS] = ""
    labels[SERVICE_NAME] = str(_meta(service).get("name"))
    labels[MANAGED_BY] = CONTROLLER_NAME
    return labels


def owner_reference(service: dict[str, Any]) -> dict[str, Any]:
    meta = _meta(service)
    return {"apiVersion": "v1", "kind": "Service", "name": meta.get("name"), "uid": meta.get("uid"),
            "controller": True, "blockOwnerDeletion": True}


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def content_of(slice_: dict[str, Any]) -> str:
    """A slice's content, comparable between what the server stores and :func:`desired_slices`."""
    return _canon({
        "addressType": slice_.get("addressType"),
        "endpoints": slice_.get("endpoints") or [],
        "ports": slice_.get("ports") or [],
    })


@dataclass(frozen=True)
class Action:
    """One write: ``create`` (``body``), ``update`` (``name``, merge patch ``body``) or ``delete``."""

    verb: str
    namespace: str
    name: str = ""
    body: dict[str, Any] = field(default_factory=dict)


def _owned_by(slice_: dict[str, Any], service: dict[str, Any]) -> bool:
    uid = _meta(service).get("uid")
    return any(_dict(o).get("kind") == "Service" and _dict(o).get("uid") == uid and _dict(o).get("controller")
               for o in _list(_meta(slice_).get("ownerReferences")))


def plan(
    namespace: str,
    service_name: str,
    service: dict[str, Any] | None,
    desired: list[dict[str, Any]],
    existing: list[dict[str, Any]],
) -> list[Action]:
    """The writes that turn ``existing`` (this Service's managed slices) into ``desired``: a slice with the
    wanted content is kept (its labels and owner fixed if needed), others of the same address type (which is
    immutable) are rewritten, missing ones created, the rest deleted."""
    actions: list[Action] = []
    if service is None or not desired:
        return [Action("delete", namespace, str(_meta(s).get("name"))) for s in existing]
    labels, owner = slice_labels(service), owner_reference(service)
    remaining = []
    for slice_ in sorted(existing, key=lambda s: str(_meta(s).get("name"))):
        if _owned_by(slice_, service):
            remaining.append(slice_)
        else:  # a previous Service of that name (another uid), or a foreign owner
            actions.append(Action("delete", namespace, str(_meta(slice_).get("name"))))
    unmatched: list[dict[str, Any]] = []
    for want in desired:
        wanted = content_of(want)
        match = next((s for s in remaining if content_of(s) == wanted), None)
        if match is None:
            unmatched.append(want)
            continue
        remaining.remove(match)
        meta = _meta(match)
        if _dict(meta.get("labels")) != labels or _list(meta.get("ownerReferences")) != [owner]:
            actions.append(_update(namespace, match, want, labels, owner))
    for want in unmatched:
        reuse = next((s for s in remaining if s.get("addressType") == want["addressType"]), None)
        if reuse is not None:
            remaining.remove(reuse)
            actions.append(_update(namespace, reuse, want, labels, owner))
            continue
        actions.append(Action("create", namespace, body={
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"generateName": f"{service_name}-", "namespace": namespace, "labels": labels,
                         "ownerReferences": [owner]},
            **want,
        }))
    actions += [Action("delete", namespace, str(_meta(s).get("name"))) for s in remaining]
    return actions


def _update(
    namespace: str, current: dict[str, Any], want: dict[str, Any], labels: dict[str, str], owner: dict[str, Any]
) -> Action:
    meta = _meta(current)
    label_patch: dict[str, Any] = {**dict.fromkeys(_dict(meta.get("labels"))), **labels}
    body = {
        "metadata": {"resourceVersion": meta.get("resourceVersion"), "labels": label_patch,
                     "ownerReferences": [owner]},
        "endpoints": want.get("endpoints"),
        "ports": want.get("ports"),
    }
    return Action("update", namespace, str(meta.get("name")), body)


def wanted(
    services: Iterable[dict[str, Any]], pods: Iterable[dict[str, Any]], zones: dict[str, str] | None = None,
    max_per_slice: int = MAX_ENDPOINTS_PER_SLICE,
) -> dict[str, list[str]]:
    """From scratch: ``namespace/service`` -> the sorted contents of the slices it should have."""
    pod_list = list(pods)
    out = {}
    for service in services:
        contents = sorted(content_of(s) for s in desired_slices(service, pod_list, zones, max_per_slice))
        if contents:
            out[_key(service)] = contents
    return out


def actual(slices: Iterable[dict[str, Any]]) -> dict[str, list[str]]:
    """``namespace/service`` -> the sorted contents of its managed slices (what :func:`wanted` predicts)."""
    out: dict[str, list[str]] = {}
    for slice_ in slices:
        meta = _meta(slice_)
        labels = _dict(meta.get("labels"))
        if labels.get(MANAGED_BY) != CONTROLLER_NAME:
            continue
        out.setdefault(f"{meta.get('namespace')}/{labels.get(SERVICE_NAME)}", []).append(content_of(slice_))
    return {k: sorted(v) for k, v in out.items()}


# --- the running controller ------------------------------------------------------------------------------


def trim_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """What the controller reads of a pod (a full pod is ~7 KiB; this is a few hundred bytes)."""
    meta, spec, status = _meta(pod), _dict(pod.get("spec")), _dict(pod.get("status"))

    def ports(containers: Any, sidecars_only: bool) -> list[dict[str, Any]]:
        out = []
        for raw in _list(containers):
            c = _dict(raw)
            if sidecars_only and c.get("restartPolicy") != "Always":
                continue
            out.append({"restartPolicy": c.get("restartPolicy"), "ports": [
                {k: _dict(p).get(k) for k in ("name", "containerPort", "protocol")} for p in _list(c.get("ports"))
            ]})
        return out

    return {
        "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "resourceVersion", "labels",
                                              "deletionTimestamp")},
        "spec": {"nodeName": spec.get("nodeName"), "hostname": spec.get("hostname"),
                 "subdomain": spec.get("subdomain"), "containers": ports(spec.get("containers"), False),
                 "initContainers": ports(spec.get("initContainers"), True)},
        "status": {"phase": status.get("phase"), "podIP": status.get("podIP"), "podIPs": status.get("podIPs"),
                   "conditions": [c for c in _list(status.get("conditions")) if _dict(c).get("type") == "Ready"]},
    }


def _trim_node(node: dict[str, Any]) -> dict[str, Any]:
    meta = _meta(node)
    zone = _dict(meta.get("labels")).get(ZONE)
    return {"metadata": {"name": meta.get("name"), "resourceVersion": meta.get("resourceVersion"),
                         "labels": {ZONE: zone} if zone else {}}}


def _same(obj: dict[str, Any]) -> dict[str, Any]:
    return obj


def _rv(value: Any) -> int | None:
    text = str(value or "")
    return int(text) if text.isdigit() else None


@dataclass
class ControllerStats:
    passes: int = 0
    created: int = 0
    updated: int = 0
    deleted: int = 0
    conflicts: int = 0  # writes refused as stale (409) or gone (404): the next pass redoes them
    errors: int = 0
    relists: int = 0


class _Stream:
    """One watch response that another thread can close (a socket shutdown wakes the reader at once)."""

    def __init__(self, client: KubeClient, path: str, query: dict[str, str], timeout: float) -> None:
        address = urllib.parse.urlsplit(client.server)
        host, port = address.hostname or "localhost", address.port
        if address.scheme == "https":
            self.conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=timeout, context=client._context)  # the client's verified TLS settings
        else:
            self.conn = http.client.HTTPConnection(host, port, timeout=timeout)
        headers = {"Accept": "application/json"}
        if client.token:
            headers["Authorization"] = f"Bearer {client.token}"
        self.conn.request("GET", f"{path}?{urllib.parse.urlencode(query)}", headers=headers)
        self.response = self.conn.getresponse()
        if self.response.status != 200:
            body = self.response.read()[:500].decode(errors="replace")
            self.conn.close()
            raise KubeError(self.response.status, f"watch {path}: {body}")

    def events(self) -> Iterator[dict[str, Any]]:
        while True:
            line = self.response.readline()
            if not line:
                return
            if line.strip():
                event: dict[str, Any] = json.loads(line)
                yield event

    def interrupt(self) -> None:
        """From another thread: wake the reader (it sees the stream end and closes it itself)."""
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """From the reading thread."""
        self.interrupt()
        self.conn.close()


class _Informer:
    """List + watch of one resource into ``items`` (key -> trimmed object), under the controller's lock."""

    def __init__(self, controller: EndpointSliceController, name: str, path: str, *, query: dict[str, str],
                 trim: Callable[[dict[str, Any]], dict[str, Any]], namespaced: bool) -> None:
        self.controller = controller
        self.name = name
        self.path = path
        self.query = query
        self.trim = trim
        self.namespaced = namespaced
        self.items: dict[str, dict[str, Any]] = {}
        self.tombstones: dict[str, int] = {}  # deleted by us at RV: older events for them are stale
        self.synced = threading.Event()
        self.stream: _Stream | None = None
        self.thread = threading.Thread(target=self._run, name=f"endpointslices-{name}", daemon=True)

    def _touch(self, obj: dict[str, Any]) -> None:
        self.controller._mark(_meta(obj).get("namespace") if self.namespaced else None)

    def _run(self) -> None:
        backoff = 0.2
        ctl = self.controller
        while not ctl._stopping.is_set():
            try:
                self._list_and_watch()
                backoff = 0.2
            except (KubeError, OSError, ValueError, http.client.HTTPException) as exc:
                if ctl._stopping.is_set():
                    return
                log.debug("endpointslices: %s informer: %s (relisting)", self.name, exc)
                ctl._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _list_and_watch(self) -> None:
        ctl = self.controller
        listed = ctl.client.list(self.path, **self.query)
        fresh = {_key(o): self.trim(o) for o in _list(listed.get("items")) if isinstance(o, dict)}
        with ctl._cond:
            touched = {_meta(o).get("namespace") for o in [*self.items.values(), *fresh.values()]}
            self.items = fresh
            self.tombstones.clear()
            ctl.stats.relists += 1
            for namespace in touched if self.namespaced else (None,):
                ctl._mark(namespace)
            self.synced.set()
            ctl._cond.notify_all()
        rv = str(_meta(listed).get("resourceVersion") or "")
        while not ctl._stopping.is_set():
            query = {**self.query, "watch": "1", "resourceVersion": rv, "allowWatchBookmarks": "true",
                     "timeoutSeconds": str(ctl.watch_timeout)}
            self.stream = _Stream(ctl.client, self.path, query, ctl.watch_timeout + 15)
            try:
                if ctl._stopping.is_set():
                    return
                for event in self.stream.events():
                    kind, obj = event.get("type"), _dict(event.get("object"))
                    if kind == "ERROR":
                        return  # 410 Expired and friends: relist
                    rv = str(_meta(obj).get("resourceVersion") or rv)
                    if kind == "BOOKMARK":
                        continue
                    with ctl._cond:
                        self.apply(kind == "DELETED", obj)
            finally:
                self.stream.close()
                self.stream = None

    def apply(self, deleted: bool, obj: dict[str, Any], own: bool = False) -> None:
        """An event (or, ``own``, the answer to one of our writes); older news about an object is ignored."""
        key = _key(obj)
        rv = _rv(_meta(obj).get("resourceVersion"))
        known = self.items.get(key)
        known_rv = _rv(_meta(known).get("resourceVersion")) if known is not None else None
        tomb = self.tombstones.get(key)
        if rv is not None:
            if known_rv is not None and rv < known_rv:
                return
            if tomb is not None:
                if rv <= tomb:
                    return
                del self.tombstones[key]
        if deleted:
            self.items.pop(key, None)
            if own and rv is not None:
                self.tombstones[key] = rv
        else:
            self.items[key] = self.trim(obj)
        self._touch(obj)


class EndpointSliceController:
    """Keeps EndpointSlices for the Services of the API server ``client`` talks to (see the module doc).

    ``start()`` lists and watches Services, pods, nodes and the controller's slices on threads and
    reconciles on a worker thread; ``stop()`` ends them (watches closed at once). ``wait_idle()`` returns
    once every informer has listed, nothing is dirty and the last pass wrote nothing.
    """

    def __init__(
        self,
        client: KubeClient,
        *,
        max_endpoints_per_slice: int = MAX_ENDPOINTS_PER_SLICE,
        watch_timeout: int = 300,
        resync_period: float = 30.0,
        debounce: float = 0.02,
        skip_pods_on_missing_nodes: bool = False,
    ) -> None:
        self.client = client
        self.max_per_slice = max_endpoints_per_slice
        self.watch_timeout = watch_timeout
        self.resync_period = resync_period
        self.debounce = debounce
        self.skip_missing_nodes = skip_pods_on_missing_nodes
        self.stats = ControllerStats()
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._dirty: set[str | None] = set()  # namespaces to recompute; None: all of them
        self._busy = False
        self._last_writes = 0
        self._retry_delay = 0.0
        selector = f"{MANAGED_BY}={CONTROLLER_NAME}"
        self.services = _Informer(self, "services", "/api/v1/services", query={}, trim=_same, namespaced=True)
        self.pods = _Informer(self, "pods", "/api/v1/pods", query={}, trim=trim_pod, namespaced=True)
        self.nodes = _Informer(self, "nodes", "/api/v1/nodes", query={}, trim=_trim_node, namespaced=False)
        self.slices = _Informer(self, "endpointslices", SLICES_PATH, query={"labelSelector": selector}, trim=_same,
                                namespaced=True)
        self._informers = (self.services, self.pods, self.nodes, self.slices)
        self._worker = threading.Thread(target=self._work, name="endpointslices-worker", daemon=True)
        self._started = False

    # --- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            raise RuntimeError("the EndpointSlice controller is already started")
        self._started = True
        for informer in self._informers:
            informer.thread.start()
        self._worker.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the threads: watches are closed, a pass in progress finishes its current write."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        for informer in self._informers:
            stream = informer.stream
            if stream is not None:
                stream.interrupt()
        if not self._started:
            return
        deadline = time.monotonic() + timeout
        for thread in (*[i.thread for i in self._informers], self._worker):
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> EndpointSliceController:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self._informers)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once all informers have listed, no namespace is dirty, no pass runs and the last pass wrote
        nothing (a steady state for what the informers have seen so far)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self.synced and not self._dirty and not self._busy and self._last_writes == 0):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    # --- the worker --------------------------------------------------------------------------------------
    def _mark(self, namespace: Any) -> None:
        """(Under the lock.) ``namespace`` (None: all) needs a pass."""
        self._dirty.add(namespace if isinstance(namespace, str) else None)
        self._cond.notify_all()

    def _work(self) -> None:
        next_resync = time.monotonic() + self.resync_period
        while not self._stopping.is_set():
            with self._cond:
                while not self._stopping.is_set() and not (self._dirty and self.synced):
                    left = next_resync - time.monotonic()
                    if left <= 0 and self.synced:
                        self._dirty.add(None)
                        break
                    self._cond.wait(max(0.01, min(left, 1.0)))
                if self._stopping.is_set():
                    return
            self._stopping.wait(max(self.debounce, self._retry_delay))  # let a burst of events coalesce
            if time.monotonic() >= next_resync:
                next_resync = time.monotonic() + self.resync_period
            try:
                self.reconcile()
            except Exception:  # a bug must not stop the controller: log, retry later
                log.exception("endpointslices: reconcile failed")
                self.stats.errors += 1
                with self._cond:
                    self._mark(None)
                    self._busy = False
                self._retry_delay = min(max(self._retry_delay * 2, 0.1), 5.0)

    def reconcile(self) -> int:
        """One pass over the dirty namespaces: compute, then write the differences. Returns the writes."""
        with self._cond:
            dirty, self._dirty = self._dirty, set()
            self._busy = True
            actions = self._plan(None if None in dirty else {d for d in dirty if d is not None})
            self.stats.passes += 1
        writes = failures = 0
        for action in actions:
            if self._stopping.is_set():
                break
            ok = self._apply(action)
            writes += 1
            failures += 0 if ok else 1
        self._retry_delay = 0.0 if not failures else min(max(self._retry_delay * 2, 0.1), 5.0)
        with self._cond:
            self._busy = False
            self._last_writes = writes
            if writes:  # our own writes come back as events; until then, look again
                for action in actions:
                    self._mark(action.namespace)
            self._cond.notify_all()
        return writes

    def _plan(self, namespaces: set[str] | None) -> list[Action]:
        """(Under the lock.) The writes for ``namespaces`` (None: every namespace)."""
        def wanted_ns(namespace: Any) -> bool:
            return namespaces is None or namespace in namespaces

        services = [s for s in self.services.items.values() if wanted_ns(_meta(s).get("namespace"))]
        pods_by_ns: dict[str, list[dict[str, Any]]] = {}
        for pod in self.pods.items.values():
            namespace = str(_meta(pod).get("namespace"))
            if wanted_ns(namespace):
                pods_by_ns.setdefault(namespace, []).append(pod)
        slices_by_service: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for slice_ in self.slices.items.values():
            meta = _meta(slice_)
            name = _dict(meta.get("labels")).get(SERVICE_NAME)
            if wanted_ns(meta.get("namespace")) and name:
                slices_by_service.setdefault((str(meta.get("namespace")), str(name)), []).append(slice_)
        zones = {str(_meta(n).get("name")): str(_dict(_meta(n).get("labels")).get(ZONE))
                 for n in self.nodes.items.values() if _dict(_meta(n).get("labels")).get(ZONE)}
        known = {str(_meta(n).get("name")) for n in self.nodes.items.values()} if self.skip_missing_nodes else None
        actions: list[Action] = []
        by_key = {(str(_meta(s).get("namespace")), str(_meta(s).get("name"))): s for s in services}
        for key in sorted(set(by_key) | set(slices_by_service)):
            service = by_key.get(key)
            desired = (desired_slices(service, pods_by_ns.get(key[0], []), zones, self.max_per_slice, known)
                       if service is not None else [])
            actions += plan(key[0], key[1], service, desired, slices_by_service.get(key, []))
        return actions

    def _apply(self, action: Action) -> bool:
        base = f"/apis/discovery.k8s.io/v1/namespaces/{action.namespace}/endpointslices"
        try:
            if action.verb == "create":
                answer: dict[str, Any] | None = self.client.create(base, action.body)
                self.stats.created += 1
            elif action.verb == "update":
                answer = self.client.patch(f"{base}/{action.name}", action.body)
                self.stats.updated += 1
                if answer is None:
                    self.stats.conflicts += 1
                    return False
            else:
                answer = self.client.delete(f"{base}/{action.name}")
                self.stats.deleted += 1
            if answer is None:  # a delete of what is already gone
                answer = {"metadata": {"namespace": action.namespace, "name": action.name}}
        except KubeError as exc:
            if exc.status in (404, 409):
                self.stats.conflicts += 1
            else:
                self.stats.errors += 1
                log.warning("endpointslices: %s %s/%s: %s", action.verb, action.namespace, action.name, exc)
            return False
        with self._cond:
            self.slices.apply(action.verb == "delete", answer, own=True)
        return True
