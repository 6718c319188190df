"""``podmeter node``: kubelet + CNI for one lab node.

For every pod bound to the node (``spec.nodeName``):

* Pending, not host-network: take the lowest free IP of the pod CIDR (so freed IPs come back at once,
  which is what makes IP reuse races happen), build its sandbox (:mod:`podmeter.lab.netns`; not in
  memory mode), then write ``status.phase: Running``, ``podIP``/``podIPs`` through the status subresource;
* host-network: Running with the node's IP, no sandbox;
* annotated ``lab.podmeter.io/run-seconds: "N"`` (a Job's pod): after N seconds the phase becomes
  Succeeded; the sandbox goes and its IP is free again while the pod object stays until deleted;
* deleted (``deletionTimestamp`` or gone): the sandbox and the IP go; a pod left Terminating by a server
  with graceful deletion is then deleted with grace 0, as a kubelet does.

Level-triggered like the agent: after every (re)list the sandboxes are made to match the listed pods,
so a missed watch event costs a delay, never a leaked namespace. Invariant: ``sandboxes`` holds exactly
the pods the node runs, each with a distinct IP of the pool.
"""

from __future__ import annotations

import heapq
import ipaddress
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from podmeter.lab.kube import KubeClient, KubeError, pod_path
from podmeter.lab.netns import Sandbox, enable_forwarding

log = logging.getLogger("podmeter.node")

RUN_SECONDS_ANNOTATION = "lab.podmeter.io/run-seconds"
TERMINAL = frozenset({"Succeeded", "Failed"})


class PoolExhausted(RuntimeError):
    """Every IP of the pod CIDR is in use."""


class IpPool:
    """The pod CIDR's host addresses.

    ``reuse="lowest"`` (the default): :meth:`allocate` returns the lowest free IP, so a freed IP goes to
    the very next pod (IP reuse races on purpose). ``reuse="oldest"``: the IP free for the longest time,
    so an IP comes back only after every other one was used (a latency benchmark needs to see each IP
    leave the kernel map before it returns).
    """

    def __init__(self, cidr: str, reuse: str = "lowest") -> None:
        network = ipaddress.ip_network(cidr)
        if network.version != 4 or network.num_addresses < 4:
            raise ValueError(f"--pod-cidr must be an IPv4 network with room for pods, not {cidr}")
        if reuse not in ("lowest", "oldest"):
            raise ValueError(f"IP reuse must be lowest or oldest, not {reuse!r}")
        self.reuse = reuse
        self._free = [int(ip) for ip in network.hosts()]
        self._fifo: deque[int] = deque(self._free)
        heapq.heapify(self._free)
        self._used: set[int] = set()
        self.size = len(self._free)

    def allocate(self) -> str:
        while self._fifo if self.reuse == "oldest" else self._free:
            value = self._fifo.popleft() if self.reuse == "oldest" else heapq.heappop(self._free)
            if value not in self._used:
                self._used.add(value)
                return str(ipaddress.IPv4Address(value))
        raise PoolExhausted(f"all {self.size} pod IPs are in use")

    def claim(self, ip: str) -> bool:
        """Take a specific IP (a pod that already runs with it); False if it is not free."""
        value = int(ipaddress.IPv4Address(ip))
        if value in self._used:
            return False
        self._used.add(value)
        return True

    def release(self, ip: str) -> None:
        value = int(ipaddress.IPv4Address(ip))
        if value in self._used:
            self._used.discard(value)
            if self.reuse == "oldest":
                self._fifo.append(value)
            else:
                heapq.heappush(self._free, value)

    @property
    def used(self) -> int:
        return len(self._used)


@dataclass
class NodeSettings:
    node_name: str
    pod_cidr: str
    datapath: str = "ebpf"  # "memory": IPs only, no sandboxes (no root needed)
    node_ip: str = "192.168.255.1"
    watch_timeout: int = 60
    ip_reuse: str = "lowest"  # see IpPool


@dataclass
class _Running:
    namespace: str
    name: str
    ip: str
    sandbox: Sandbox | None


@dataclass
class NodeStats:
    started: int = 0
    stopped: int = 0
    completed: int = 0
    errors: Counter[str] = field(default_factory=Counter)


class Node:
    """The node loop. All state changes happen under ``_lock`` (watch thread and completion timer)."""

    def __init__(self, settings: NodeSettings, client: KubeClient) -> None:
        self.settings = settings
        self.client = client
        self.pool = IpPool(settings.pod_cidr, settings.ip_reuse)
        self.running: dict[str, _Running] = {}  # uid -> what the node runs for it
        self.stats = NodeStats()
        self._completions: list[tuple[float, str, str, str]] = []  # (due, uid, namespace, name)
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # --- lifecycle --------------------------------------------------------------------------------

    def run(self) -> None:
        """List + watch until :meth:`stop`; then tear every sandbox down."""
        if self.settings.datapath == "ebpf":
            enable_forwarding()
        timer = threading.Thread(target=self._completion_loop, name="node-completions", daemon=True)
        timer.start()
        try:
            while not self._stop.is_set():
                try:
                    self._list_and_watch()
                except KubeError as exc:
                    self.stats.errors["api"] += 1
                    log.warning("API server: %s; relisting in 1 s", exc)
                    self._stop.wait(1.0)
        finally:
            self._stop.set()
            timer.join(timeout=5)
            self.teardown_all()

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def teardown_all(self) -> None:
        with self._lock:
            for uid in list(self.running):
                self._stop_pod(uid)

    # --- list and watch ---------------------------------------------------------------------------

    def _list_and_watch(self) -> None:
        selector = f"spec.nodeName={self.settings.node_name}"
        listed = self.client.list("/api/v1/pods", fieldSelector=selector)
        pods = listed.get("items") or []
        with self._lock:
            self._reconcile(pods)
        rv = str(listed["metadata"].get("resourceVersion", ""))
        while not self._stop.is_set():
            for event in self.client.watch("/api/v1/pods", self.settings.watch_timeout,
                                           fieldSelector=selector, resourceVersion=rv):
                if self._stop.is_set():
                    return
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    return  # 410 and friends: relist
                rv = str(obj.get("metadata", {}).get("resourceVersion", rv))
                if kind == "BOOKMARK":
                    continue
                with self._lock:
                    self._handle(obj, deleted=kind == "DELETED")

    def _reconcile(self, pods: list[dict[str, Any]]) -> None:
        listed = {p["metadata"]["uid"] for p in pods}
        for uid in [u for u in self.running if u not in listed]:
            self._stop_pod(uid)
        for pod in pods:
            self._handle(pod, deleted=False)

    # --- one pod ----------------------------------------------------------------------------------

    def _handle(self, pod: dict[str, Any], deleted: bool) -> None:
        meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
        uid = meta.get("uid", "")
        if deleted or meta.get("deletionTimestamp"):
            self._stop_pod(uid)
            if not deleted:
                self._finish_delete(meta)
            return
        phase = status.get("phase", "")
        if phase in TERMINAL:
            self._stop_pod(uid)
            return
        if uid in self.running:
            return
        if spec.get("hostNetwork"):
            if phase != "Running":
                self._write_status(meta, "Running", self.settings.node_ip)
            return
        self._start_pod(meta, status)

    def _start_pod(self, meta: dict[str, Any], status: dict[str, Any]) -> None:
        uid, ns, name = meta["uid"], meta.get("namespace", ""), meta.get("name", "")
        known_ip = status.get("podIP") if status.get("phase") == "Running" else None
        try:
            ip = known_ip if known_ip and self.pool.claim(known_ip) else self.pool.allocate()
        except PoolExhausted as exc:
            self.stats.errors["pool_exhausted"] += 1
            log.warning("pod %s/%s waits: %s", ns, name, exc)
            return
        sandbox = Sandbox.for_pod(uid, ip) if self.settings.datapath == "ebpf" else None
        try:
            if sandbox is not None:
                sandbox.destroy()  # a leftover of a killed node with the same pod
                sandbox.create()
        except OSError as exc:
            self.pool.release(ip)
            self.stats.errors["sandbox"] += 1
            log.error("pod %s/%s: sandbox failed: %s", ns, name, exc)
            return
        self.running[uid] = _Running(ns, name, ip, sandbox)
        self.stats.started += 1
        if ip != known_ip and self._write_status(meta, "Running", ip) is None:
            self._stop_pod(uid)  # deleted while we built it
            return
        run_for = (meta.get("annotations") or {}).get(RUN_SECONDS_ANNOTATION)
        if run_for is not None:
            self._schedule_completion(uid, ns, name, run_for)

    def _stop_pod(self, uid: str) -> None:
        running = self.running.pop(uid, None)
        if running is None:
            return
        if running.sandbox is not None:
            running.sandbox.destroy()
        self.pool.release(running.ip)
        self.stats.stopped += 1

    def _write_status(self, meta: dict[str, Any], phase: str, ip: str) -> dict[str, Any] | None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {"phase": phase, "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": self.settings.node_ip,
                  "startTime": now,
                  "conditions": [{"type": "Ready", "status": "True" if phase == "Running" else "False",
                                  "lastTransitionTime": now}]}
        path = pod_path(meta.get("namespace", ""), meta.get("name", ""), "status")
        try:
            return self.client.patch(path, {"metadata": {"uid": meta.get("uid")}, "status": status})
        except KubeError as exc:
            if exc.status == 409:  # another pod of that name meanwhile (uid precondition)
                return None
            raise

    def _finish_delete(self, meta: dict[str, Any]) -> None:
        """A Terminating pod whose sandbox is gone: delete it for good (grace 0), as a kubelet does."""
        try:
            self.client.delete(pod_path(meta.get("namespace", ""), meta.get("name", "")), grace_seconds=0)
        except KubeError as exc:
            log.debug("final delete of %s: %s", meta.get("name"), exc)

    # --- Job-style pods ---------------------------------------------------------------------------

    def _schedule_completion(self, uid: str, ns: str, name: str, run_for: str) -> None:
        try:
            seconds = max(0.0, float(run_for))
        except ValueError:
            log.warning("pod %s/%s: %s=%r is not a number; it runs until deleted", ns, name,
                        RUN_SECONDS_ANNOTATION, run_for)
            return
        heapq.heappush(self._completions, (time.monotonic() + seconds, uid, ns, name))

    def _completion_loop(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            while True:
                with self._lock:
                    if not self._completions or self._completions[0][0] > now:
                        break
                    _, uid, ns, name = heapq.heappop(self._completions)
                    running = self.running.get(uid)
                    if running is None:
                        continue
                    self._complete(uid, ns, name, running.ip)

    def _complete(self, uid: str, ns: str, name: str, ip: str) -> None:
        """Succeeded: the status keeps its IP (as a real kubelet leaves it), the sandbox and IP are freed."""
        try:
            self._write_status({"uid": uid, "namespace": ns, "name": name}, "Succeeded", ip)
        except KubeError as exc:
            self.stats.errors["api"] += 1
            log.warning("pod %s/%s: completion not written: %s", ns, name, exc)
            return
        self._stop_pod(uid)
        self.stats.completed += 1
