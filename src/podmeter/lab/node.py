"""``podmeter node``: kubelet + CNI for one lab node.

For every pod bound to the node (``spec.nodeName``):

* Pending, not host-network: take the lowest free IP of the pod CIDR (so freed IPs come back at once,
  which is what makes IP reuse races happen), build its sandbox (:mod:`podmeter.lab.netns`; not in
  memory mode), then write ``status.phase: Running``, ``podIP``/``podIPs`` through the status subresource;
  with a CNI plugin configured (:mod:`podmeter.lab.cni`, the lab's ``cni: bridge``) the plugin wires the
  sandbox and its IPAM chooses the IP, which is known, and written, only once its ADD returned;
* host-network: Running with the node's IP, no sandbox;
* annotated ``lab.podmeter.io/run-seconds: "N"`` (a Job's pod): after N seconds the phase becomes
  Succeeded; the sandbox goes and its IP is free again while the pod object stays until deleted;
* deleted (``deletionTimestamp`` or gone): the sandbox and the IP go; a pod left Terminating by a server
  with graceful deletion is then deleted with grace 0, as a kubelet does.

Level-triggered like the agent: after every (re)list the sandboxes are made to match the listed pods,
so a missed watch event costs a delay, never a leaked namespace. Invariant: ``running`` holds exactly
the pods the node runs, each with a distinct IP of the pool (see :class:`Node` for the threads).
"""

from __future__ import annotations

import functools
import heapq
import ipaddress
import logging
import queue
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podmeter.lab.cni import CniPlugin, CniSandbox
from podmeter.lab.kube import KubeClient, KubeError, pod_path
from podmeter.lab.netns import HOST_PREFIX, Sandbox, enable_forwarding, link_prefix_problem
from podmeter.model.records import TERMINAL_PHASES

log = logging.getLogger("podmeter.node")

RUN_SECONDS_ANNOTATION = "lab.podmeter.io/run-seconds"
SYNC_TEARDOWN = False  # True: delete the host veth before freeing the IP (slower, same result)


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
    link_prefix: str = HOST_PREFIX  # host-side link names: <prefix><id> (netns.link_prefix_problem)
    # A CNI plugin wires the sandboxes (lab/cni.py); None: the one the lab configured in the environment
    # (cni.CONF_ENV), if any, in eBPF mode; else the node's own veth and /32 route per pod.
    cni: CniPlugin | None = None


@dataclass
class _Running:
    namespace: str
    name: str
    ip: str  # "" until a CNI plugin's ADD named it
    sandbox: Sandbox | CniSandbox | None


@dataclass
class NodeStats:
    started: int = 0
    stopped: int = 0
    completed: int = 0
    built: int = 0  # sandboxes built and announced (Running written)
    build_seconds: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)


class Node:
    """The node. The watch thread decides under ``_lock`` (which pods run, which IP each holds); the slow
    work (netlink, status writes) runs on ``workers`` threads, each pod's on the same one, so a pod's
    build, completion and teardown keep their order while different pods proceed in parallel.

    Invariants: an IP goes back to the pool only after its sandbox is gone (a new pod never meets the
    old pod's route); a pod UID this node finished or stopped never starts again (a stale event queued
    before its end cannot revive it; Kubernetes never reruns a pod UID).
    """

    FINISHED_MEMORY = 50_000  # UIDs remembered as finished (oldest forgotten first)

    def __init__(self, settings: NodeSettings, client: KubeClient, workers: int = 4) -> None:
        self.settings = settings
        self.client = client
        self.pool = IpPool(settings.pod_cidr, settings.ip_reuse)  # unused when a CNI plugin's IPAM allocates
        self.cni = settings.cni or (CniPlugin.from_environment() if settings.datapath == "ebpf" else None)
        if self.cni is not None:
            log.info("pods wired by the %s CNI plugin of %s (bridge %s)", self.cni.plugin, self.cni.bin_dir,
                     self.cni.bridge or "-")
        problem = link_prefix_problem(settings.link_prefix)
        if problem is not None:  # refused here, not by every pod's build on the watch thread
            raise ValueError(f"--link-prefix {problem}")
        self.running: dict[str, _Running] = {}  # uid -> what the node runs for it
        self.stats = NodeStats()
        self._finished: dict[str, None] = {}
        self._completions: list[tuple[float, str]] = []  # (due, uid)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closing = False
        self._queues: list[queue.SimpleQueue[Callable[[], None] | None]] = [
            queue.SimpleQueue() for _ in range(max(1, workers))]
        self._workers = [threading.Thread(target=self._work, args=(q,), name=f"node-worker-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]

    # --- lifecycle --------------------------------------------------------------------------------

    def run(self) -> None:
        """List + watch until :meth:`stop`; then tear every sandbox down."""
        if self.settings.datapath == "ebpf":
            enable_forwarding()
        for worker in self._workers:
            worker.start()
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
        """Let the workers finish what is queued, then remove every sandbox left. Idempotent."""
        with self._lock:
            already, self._closing = self._closing, True
        if not already:
            for q in self._queues:
                q.put(None)
            for worker in self._workers:
                if worker.is_alive():
                    worker.join(timeout=60)
        with self._lock:
            leftovers = list(self.running.values())
            self.running.clear()
        for running in leftovers:
            self._teardown(running)
        if self.cni is not None and not already:
            log.info("cni: the %s plugin was called %s", self.cni.plugin,
                     ", ".join(f"{command} {n} times" for command, n in self.cni.calls.items()))

    def _work(self, jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while (job := jobs.get()) is not None:
            try:
                job()
            except Exception:  # one pod's failure must not stop the node; it is logged and counted
                self.stats.errors["worker"] += 1
                log.exception("node worker")

    def _dispatch(self, uid: str, job: Callable[[], None]) -> None:
        self._queues[zlib.crc32(uid.encode()) % len(self._queues)].put(job)

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

    # --- decisions (under the lock) ---------------------------------------------------------------

    def _handle(self, pod: dict[str, Any], deleted: bool) -> None:
        if self._closing:
            return
        meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
        uid = meta.get("uid", "")
        if deleted or meta.get("deletionTimestamp"):
            self._stop_pod(uid)
            if not deleted:
                self._dispatch(uid, lambda: self._finish_delete(meta))
            return
        phase = status.get("phase", "")
        if phase in TERMINAL_PHASES:
            self._stop_pod(uid)
            return
        if uid in self.running or uid in self._finished:
            return
        if spec.get("hostNetwork"):
            if phase != "Running":
                self._dispatch(uid, functools.partial(self._run_host_network, meta))
            return
        self._start_pod(meta, status)

    def _start_pod(self, meta: dict[str, Any], status: dict[str, Any]) -> None:
        uid, ns, name = meta["uid"], meta.get("namespace", ""), meta.get("name", "")
        known_ip = status.get("podIP") if status.get("phase") == "Running" else None
        if self.cni is not None:  # its IPAM chooses the IP: known once ADD returns, as a kubelet learns it
            running = self.running[uid] = _Running(ns, name, "", CniSandbox(uid, self.cni))
            self.stats.started += 1
            self._dispatch(uid, lambda: self._build(uid, meta, running, known_ip))
            return
        try:
            ip = known_ip if known_ip and self.pool.claim(known_ip) else self.pool.allocate()
        except PoolExhausted as exc:
            self.stats.errors["pool_exhausted"] += 1
            log.warning("pod %s/%s waits: %s", ns, name, exc)
            return
        sandbox = Sandbox.for_pod(uid, ip, self.settings.link_prefix) if self.settings.datapath == "ebpf" else None
        running = self.running[uid] = _Running(ns, name, ip, sandbox)
        self.stats.started += 1
        self._dispatch(uid, lambda: self._build(uid, meta, running, known_ip))

    def _stop_pod(self, uid: str) -> None:
        self._forget_later(uid)
        running = self.running.pop(uid, None)
        if running is not None:
            self._dispatch(uid, lambda: self._teardown(running))

    def _forget_later(self, uid: str) -> None:
        self._finished[uid] = None
        if len(self._finished) > self.FINISHED_MEMORY:
            del self._finished[next(iter(self._finished))]

    # --- work (on the pod's worker, outside the lock) ---------------------------------------------

    def _build(self, uid: str, meta: dict[str, Any], running: _Running, known_ip: str | None) -> None:
        """Build the sandbox, then write Running with its IP (unless the status already says that one)."""
        with self._lock:
            if self.running.get(uid) is not running:
                return  # deleted while queued: its teardown job follows and frees the IP
        started = time.monotonic()
        try:
            if running.sandbox is not None:
                running.sandbox.destroy(wait=True)  # a leftover of a killed node with the same pod
                running.sandbox.create()
                if isinstance(running.sandbox, CniSandbox):
                    with self._lock:
                        running.ip = running.sandbox.ip
                    log.info("pod %s/%s: %s ADD gave %s, host side %s, netns %s", running.namespace, running.name,
                             running.sandbox.plugin.plugin, running.ip, running.sandbox.host_device,
                             running.sandbox.netns)
        except OSError as exc:
            self.stats.errors["sandbox"] += 1
            log.error("pod %s/%s: sandbox failed: %s", running.namespace, running.name, exc)
            with self._lock:
                if self.running.get(uid) is running:
                    del self.running[uid]
            self._release(running)
            return
        if running.ip != known_ip and self._write_status(meta, "Running", running.ip) is None:
            with self._lock:
                self._stop_pod(uid)  # deleted while we built it
            return
        self.stats.build_seconds += time.monotonic() - started
        self.stats.built += 1
        run_for = (meta.get("annotations") or {}).get(RUN_SECONDS_ANNOTATION)
        if run_for is not None:
            self._schedule_completion(uid, running, run_for)

    def _run_host_network(self, meta: dict[str, Any]) -> None:
        self._write_status(meta, "Running", self.settings.node_ip)

    def _teardown(self, running: _Running) -> None:
        if running.sandbox is not None:
            try:
                running.sandbox.destroy(wait=SYNC_TEARDOWN)
            except OSError as exc:  # a CNI DEL that failed: counted; the lab's end check names what it left
                self.stats.errors["sandbox"] += 1
                log.error("pod %s/%s: sandbox teardown failed: %s", running.namespace, running.name, exc)
        self._release(running)

    def _release(self, running: _Running) -> None:
        with self._lock:
            if self.cni is None:  # a CNI plugin's IPAM freed the IP with its DEL
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
            return self.client.patch(path, {"status": status})
        except KubeError as exc:
            self.stats.errors["api"] += 1
            log.warning("pod %s: status %s not written: %s", meta.get("name"), phase, exc)
            return None

    def _finish_delete(self, meta: dict[str, Any]) -> None:
        """A Terminating pod whose sandbox is gone: delete it for good (grace 0), as a kubelet does."""
        try:
            self.client.delete(pod_path(meta.get("namespace", ""), meta.get("name", "")), grace_seconds=0)
        except KubeError as exc:
            log.debug("final delete of %s: %s", meta.get("name"), exc)

    # --- Job-style pods ---------------------------------------------------------------------------

    def _schedule_completion(self, uid: str, running: _Running, run_for: str) -> None:
        try:
            seconds = max(0.0, float(run_for))
        except ValueError:
            log.warning("pod %s/%s: %s=%r is not a number; it runs until deleted", running.namespace,
                        running.name, RUN_SECONDS_ANNOTATION, run_for)
            return
        with self._lock:
            heapq.heappush(self._completions, (time.monotonic() + seconds, uid))

    def _completion_loop(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self._lock:
                while self._completions and self._completions[0][0] <= now:
                    _, uid = heapq.heappop(self._completions)
                    running = self.running.get(uid)
                    if running is not None and not self._closing:
                        self._dispatch(uid, functools.partial(self._complete, uid, running))

    def _complete(self, uid: str, running: _Running) -> None:
        """Succeeded: the status keeps its IP (as a real kubelet leaves it), the sandbox and IP are freed."""
        with self._lock:
            if self.running.get(uid) is not running:
                return  # deleted meanwhile
        meta = {"namespace": running.namespace, "name": running.name}
        if self._write_status(meta, "Succeeded", running.ip) is None:
            return
        with self._lock:
            self._stop_pod(uid)
            self.stats.completed += 1
