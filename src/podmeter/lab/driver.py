"""Executing a scenario's steps against the lab: pods, churn, interest flips, faults, traffic.

The driver owns the pods it creates. Long-running pods (``pods`` steps) are kept per namespace in
creation order, and every seeded choice (which pods to delete, flip, pair) draws from one
``random.Random(seed)`` in step order, so the same file makes the same choices. Churn runs on its own
thread per step, with its own generator derived from the seed and the step's index.
"""

from __future__ import annotations

import functools
import heapq
import logging
import random
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podmeter.lab import scenario as sc
from podmeter.lab.apiserver.client import AdminClient
from podmeter.lab.kube import KubeClient, KubeError, pod_path
from podmeter.lab.node import RUN_SECONDS_ANNOTATION
from podmeter.model.records import OBSERVE_ANNOTATION

log = logging.getLogger("podmeter.lab")

MCONF = "/apis/podmeter.io/v1alpha1/metricsconfigurations"
PAUSE_IMAGE = "registry.k8s.io/pause:3.9"
LABEL_SET = "lab.podmeter.io/set"  # churn's label_sets: a label the operator's filter keeps


@dataclass
class DriverStats:
    created: int = 0
    deleted: int = 0
    lifecycles: int = 0  # pods created and deleted again
    flips: int = 0
    faults: int = 0
    agent_kills: int = 0
    operator_kills: int = 0
    errors: int = 0
    step: str = "starting"
    delete_times: dict[str, float] = field(default_factory=dict)  # ip -> when its pod's delete returned
    deleted_in_phase: Counter[str] = field(default_factory=Counter)  # Pending: deleted before it ran


class Hooks:
    """What the driver needs from the run besides the API server (processes, checks, traffic)."""

    def step_started(self, step: sc.Step) -> None: ...  # the report marks fault steps on its time plots
    def kill_agent(self, node: str | None = None) -> None: ...  # node: a multi-node scenario's
    def start_agent(self, node: str | None = None) -> None: ...
    def kill_operator(self) -> None: ...
    def start_operator(self) -> None: ...
    def hold(self) -> None: ...
    def release(self) -> None: ...
    def traffic(self, step: sc.Traffic, pods: list[tuple[str, str]], rng: random.Random) -> None: ...
    def reuse_during_flow(self, step: sc.ReuseDuringFlow, pods: list[tuple[str, str]],
                          rng: random.Random) -> None: ...
    def induce_drops(self, step: sc.InduceDrops, pods: list[tuple[str, str]], rng: random.Random) -> None: ...
    def induce_loss(self, step: sc.InduceLoss, pods: list[tuple[str, str]], rng: random.Random) -> None: ...
    def service_calls(self, step: sc.ServiceCalls, pods: list[tuple[str, str]]) -> None: ...
    def dns_lookups(self, step: sc.DnsLookups, pods: list[tuple[str, str]]) -> None: ...
    def service_apps(self, step: sc.ServiceApps, pods: list[tuple[str, str]]) -> None: ...


class Driver:
    def __init__(self, scenario: sc.Scenario, client: KubeClient, admin: AdminClient, node_name: str,
                 hooks: Hooks) -> None:
        self.scenario = scenario
        self.client = client
        self.admin = admin
        self.node_name = node_name
        self.nodes = [node_name]  # a multi-node scenario's nodes: pods without a node go to each in turn
        self.namespace_labels: dict[str, str] = {}  # on every namespace the lab creates
        self.hooks = hooks
        self.rng = random.Random(scenario.seed)
        self.stats = DriverStats()
        self.pods: dict[str, list[str]] = {ns.name: [] for ns in scenario.namespaces}  # long-running
        self.workloads: dict[str, str] = {}  # "ns/name" -> "Kind ns/workload" of pods not their own workload
        self.include: list[str] = []
        self.threads: list[threading.Thread] = []
        self._serial = 0
        self.holding = 0  # > 0 while a fault holds the checks
        self._lock = threading.Lock()
        self.stop = threading.Event()

    # --- setup and the timeline -------------------------------------------------------------------

    def create_namespaces(self) -> None:
        for ns in self.scenario.namespaces:
            annotations = {OBSERVE_ANNOTATION: "true"} if ns.observe else {}
            self.client.create("/api/v1/namespaces", {"metadata": {"name": ns.name, "annotations": annotations,
                                                                   "labels": dict(self.namespace_labels)}})

    def run_steps(self, started: float) -> None:
        """Run every step at its time (relative to ``started``, a monotonic time)."""
        for index, step in enumerate(sorted(self.scenario.steps, key=lambda s: s.at)):
            if self.stop.wait(max(0.0, started + step.at - time.monotonic())):
                return
            self.stats.step = f"{step.at:g}s {step.__struct_config__.tag}"
            self.hooks.step_started(step)
            try:
                self._run_step(index, step)
            except KubeError as exc:
                self.stats.errors += 1
                log.warning("step %s failed: %s", self.stats.step, exc)

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    def _run_step(self, index: int, step: sc.Step) -> None:
        handlers: dict[type, Callable[[Any], None]] = {
            sc.CreatePods: self._create_pods, sc.DeletePods: self._delete_pods, sc.Annotate: self._annotate,
            sc.Configure: self._configure, sc.Fault: self._fault, sc.CompactionGap: self._compaction_gap,
            sc.KillAgent: self._kill_agent, sc.KillOperator: self._kill_operator,
        }
        if isinstance(step, sc.Churn | sc.UnobserveThenDelete):
            target = self._churn if isinstance(step, sc.Churn) else self._unobserve_delete
            rng = random.Random(self.scenario.seed * 1000 + index)
            thread = threading.Thread(target=target, args=(step, rng), name=f"lab-step-{index}", daemon=True)
            self.threads.append(thread)
            thread.start()
        elif isinstance(step, sc.Traffic):
            self.hooks.traffic(step, self._live(step.namespace), self.rng)
        elif isinstance(step, sc.ReuseDuringFlow):
            self.hooks.reuse_during_flow(step, self._live(step.namespace), self.rng)
        elif isinstance(step, sc.InduceDrops):
            self.hooks.induce_drops(step, self._live(step.namespace), self.rng)
        elif isinstance(step, sc.InduceLoss):
            self.hooks.induce_loss(step, self._live(step.namespace), self.rng)
        elif isinstance(step, sc.ServiceCalls):
            self.hooks.service_calls(step, self._live(step.namespace))
        elif isinstance(step, sc.DnsLookups):
            pods = list(dict.fromkeys(self._live(step.namespace) + self._live(step.server_namespace)))
            self.hooks.dns_lookups(step, pods)
        elif isinstance(step, sc.ServiceApps):
            self.hooks.service_apps(step, self._live(step.namespace))
        else:
            handlers[type(step)](step)

    # --- pods -------------------------------------------------------------------------------------

    def new_pod(self, namespace: str, prefix: str, observe: bool, *, labels: dict[str, str] | None = None,
                run_seconds: float | None = None, host_network: bool = False, deployment: bool = False,
                node: str | None = None) -> str:
        with self._lock:
            self._serial += 1
            name = f"{prefix}-{self._serial}"
            node = node or self.nodes[self._serial % len(self.nodes)]
        annotations = {OBSERVE_ANNOTATION: "true" if observe else "false"}
        if run_seconds is not None:
            annotations[RUN_SECONDS_ANNOTATION] = f"{run_seconds:g}"
        metadata: dict[str, Any] = {"name": name, "labels": {"app": prefix, **(labels or {})},
                                    "annotations": annotations}
        if deployment:
            # What the Deployment controller makes: a ReplicaSet <deployment>-<hash> as the controller, and
            # the hash as a label (the operator's label filter drops it: the identity stays app=<prefix>).
            template_hash = f"{zlib.crc32(f'{namespace}/{prefix}'.encode()):08x}"
            metadata["labels"]["pod-template-hash"] = template_hash
            metadata["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                            "name": f"{prefix}-{template_hash}", "uid": f"rs-{template_hash}",
                                            "controller": True, "blockOwnerDeletion": True}]
            self.workloads[f"{namespace}/{name}"] = f"Deployment {namespace}/{prefix}"
        body = {"metadata": metadata,
                "spec": {"nodeName": node, "hostNetwork": host_network,
                         "containers": [{"name": "main", "image": PAUSE_IMAGE}]}}
        self.client.create(pod_path(namespace), body)
        self.stats.created += 1
        return name

    def delete_pod(self, namespace: str, name: str) -> None:
        answer = self.client.delete(pod_path(namespace, name))
        if answer is None:
            return
        self.stats.deleted += 1
        self.stats.lifecycles += 1
        self.stats.deleted_in_phase[(answer.get("status") or {}).get("phase") or "none"] += 1
        ip = (answer.get("status") or {}).get("podIP")
        # Latency samples only outside faults (an agent that is down unmaps nothing, by design).
        if ip and (answer.get("status") or {}).get("phase") == "Running" and not self.holding:
            self.stats.delete_times[ip] = time.monotonic()

    def workload_of(self, pod: str) -> str:
        """What the agent must call the workload of ``pod`` (``ns/name``): ``Kind ns/name``."""
        namespace, _, name = pod.partition("/")
        return self.workloads.get(pod, f"Pod {namespace}/{name}")

    def _live(self, namespace: str) -> list[tuple[str, str]]:
        return [(namespace, name) for name in self.pods[namespace]]

    def _take(self, namespace: str, count: int, rng: random.Random) -> list[str]:
        with self._lock:
            names = self.pods[namespace]
            chosen = rng.sample(names, min(count, len(names)))
            for name in chosen:
                names.remove(name)
        return chosen

    def _create_pods(self, step: sc.CreatePods) -> None:
        for _ in range(step.count):
            name = self.new_pod(step.namespace, step.prefix, step.observe, host_network=step.host_network,
                                deployment=step.deployment, node=step.node)
            with self._lock:
                self.pods[step.namespace].append(name)

    def _delete_pods(self, step: sc.DeletePods) -> None:
        count = len(self.pods[step.namespace]) if step.all else step.count
        for name in self._take(step.namespace, count, self.rng):
            self.delete_pod(step.namespace, name)

    def delete_everything(self) -> None:
        """The end of every run: every pod of every scenario namespace goes."""
        for ns in self.scenario.namespaces:
            for pod in self.client.list(pod_path(ns.name)).get("items") or []:
                self.delete_pod(ns.name, pod["metadata"]["name"])
            self.pods[ns.name] = []

    # --- churn --------------------------------------------------------------------------------------

    def _churn(self, step: sc.Churn, rng: random.Random) -> None:
        """Start ``rate`` pods/s for ``duration`` s; delete each when its time is up (a heap of deadlines)."""
        due: list[tuple[float, str]] = []
        start = time.monotonic()
        next_start, lifetime = start, step.lifetime
        delete_after = lifetime + step.linger if step.complete else lifetime
        started = 0
        while not self.stop.is_set():
            now = time.monotonic()
            while due and due[0][0] <= now:
                self._safe(self.delete_pod, step.namespace, heapq.heappop(due)[1])
            if now >= start + step.duration and not due:
                return
            if now >= next_start and now < start + step.duration:
                labels = self._job_labels(rng) if step.unique_labels else {}
                if step.label_sets:
                    labels[LABEL_SET] = f"s{started % step.label_sets}"
                started += 1
                name = self._safe(functools.partial(
                    self.new_pod, step.namespace, "job" if step.unique_labels else "churn", step.observe,
                    labels=labels, run_seconds=lifetime if step.complete else None, node=step.node))
                if name:
                    heapq.heappush(due, (now + delete_after, name))
                next_start += 1.0 / step.rate
            wake = min([next_start] + [d for d, _ in due[:1]]) - time.monotonic()
            self.stop.wait(max(0.0, min(wake, 0.2)))

    @staticmethod
    def _job_labels(rng: random.Random) -> dict[str, str]:
        uid = f"{rng.getrandbits(64):016x}"
        return {"job-name": f"cron-{uid[:8]}", "controller-uid": uid, "batch.kubernetes.io/job-name": f"cron-{uid[:8]}"}

    def _safe(self, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except KubeError as exc:
            self.stats.errors += 1
            log.warning("%s: %s", getattr(call, "__name__", "call"), exc)
            return None

    # --- interest -------------------------------------------------------------------------------------

    def _annotate(self, step: sc.Annotate) -> None:
        value = "true" if step.observe else "false"
        body = {"metadata": {"annotations": {OBSERVE_ANNOTATION: value}}}
        if step.on_namespace:
            self.client.patch(f"/api/v1/namespaces/{step.namespace}", body)
            self.stats.flips += 1
            return
        with self._lock:
            chosen = self.rng.sample(self.pods[step.namespace], min(step.count, len(self.pods[step.namespace])))
        for name in chosen:
            self.client.patch(pod_path(step.namespace, name), body)
            self.stats.flips += 1

    def _configure(self, step: sc.Configure) -> None:
        if step.remove:
            self.client.delete(f"{MCONF}/default")
            self.include = []
        else:
            self.set_configuration(step.include, step.exclude, step.annotations)
        self.stats.flips += 1

    def set_configuration(self, include: list[str], exclude: list[str], annotations: bool = True) -> None:
        spec = {"namespaces": {"include": include, "exclude": exclude}, "annotations": annotations}
        body = {"apiVersion": "podmeter.io/v1alpha1", "kind": "MetricsConfiguration",
                "metadata": {"name": "default"}, "spec": spec}
        if self.client.get(f"{MCONF}/default") is None:
            self.client.create(MCONF, body)
        else:
            self.client.patch(f"{MCONF}/default", {"spec": spec})
        self.include = list(include)

    def _unobserve_delete(self, step: sc.UnobserveThenDelete, rng: random.Random) -> None:
        """Failure modes F1-F4 (docs/design.md), repeated: fresh observed pods lose the interest, then are deleted."""
        for _ in range(step.repeat):
            if self.stop.is_set():
                return
            names = [self._safe(self.new_pod, step.namespace, "flip", step.via == "annotation")
                     for _ in range(step.count)]
            if step.via == "configuration":
                self._safe(self.set_configuration, [*self.include, step.namespace], [])
            self.stop.wait(step.every)
            for name in names:
                if name and step.via == "annotation":
                    body = {"metadata": {"annotations": {OBSERVE_ANNOTATION: "false"}}}
                    self._safe(self.client.patch, pod_path(step.namespace, name), body)
            if step.via == "configuration":
                self._safe(self.set_configuration, [n for n in self.include if n != step.namespace], [])
            self.stats.flips += 1
            self.stop.wait(step.gap)
            for name in names:
                if name:
                    self._safe(self.delete_pod, step.namespace, name)

    # --- faults ---------------------------------------------------------------------------------------

    def _fault(self, step: sc.Fault) -> None:
        for i in range(step.repeat):
            if i and self.stop.wait(step.every):
                return
            self.stats.faults += 1
            if step.fault == "close-watches":
                self.admin.close_watches()
            elif step.fault == "compact":
                self.admin.compact()
            elif step.fault == "fail":
                self.admin.fail(step.count, code=step.code, verb=step.verb)
            elif step.fault == "stall":
                self._held(lambda: self._for(step.seconds, lambda: self.admin.stall(step.seconds)))
            else:
                self._held(lambda: self._for(step.seconds + 0.5, lambda: self.admin.restart(step.seconds)))

    def _for(self, seconds: float, action: Callable[[], None]) -> None:
        action()
        self.stop.wait(seconds)

    def _held(self, action: Callable[[], object]) -> None:
        self.hooks.hold()
        self.holding += 1
        try:
            action()
        finally:
            self.holding -= 1
            self.hooks.release()

    def _compaction_gap(self, step: sc.CompactionGap) -> None:
        def gap() -> None:
            self.admin.stall(None, include_new=True)
            try:
                for name in self._take(step.namespace, step.deletes, self.rng):
                    self.delete_pod(step.namespace, name)
                self.stop.wait(step.seconds)
                self.admin.compact()
                self.admin.close_watches()
            finally:
                self.admin.unstall()

        self.stats.faults += 1
        self._held(gap)

    def _kill_agent(self, step: sc.KillAgent) -> None:
        def outage() -> None:
            self.hooks.kill_agent(step.node)
            self.stats.agent_kills += 1
            if step.namespace is not None:
                for name in self._take(step.namespace, step.deletes, self.rng):
                    self.delete_pod(step.namespace, name)
            self.stop.wait(step.down)
            self.hooks.start_agent(step.node)

        self._held(outage)

    def _kill_operator(self, step: sc.KillOperator) -> None:
        def outage() -> None:
            self.hooks.kill_operator()
            self.stats.operator_kills += 1
            if step.namespace is not None:
                for name in self._take(step.namespace, step.deletes, self.rng):
                    self.delete_pod(step.namespace, name)
            self.stop.wait(step.down)
            self.hooks.start_operator()

        self._held(outage)
