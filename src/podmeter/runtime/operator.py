"""The operator process: label-set identities for every pod of the cluster, leader-elected housekeeping.

Pieces, each testable alone:

* :class:`IdentityReconciler` keeps the backend's held identities equal to the label sets of the live
  pods. Events only mark keys dirty; :meth:`IdentityReconciler.flush` compares desired (a pod refers to
  the key) with actual (the backend holds it) for each dirty key, so a failed call is simply retried and a
  duplicate or missed event cannot leave anything behind. :meth:`IdentityReconciler.sweep` recomputes
  everything from the pod store and counts what it had to release (``podmeter_identity_gc_released_total``,
  which stays 0 unless an event was lost).
* :class:`ConfigurationStatus` validates the ``default`` MetricsConfiguration and writes its
  ``status.conditions`` (leader only).
* :class:`Operator` composes them with a pod source, leader election and the HTTP endpoints.

The pod source is a small interface (:class:`PodSource`): an async iterator of ``(event type, Pod)`` plus
the store those events were applied to. Whatever feeds it must apply an event to the store before it
yields it, and synthesise deletes for objects that vanished across a relist; :class:`ReflectorPodSource`
does that over the kube reflector.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from podmeter.adapters.identity.base import IdentityBackend, IdentityBackendError
from podmeter.adapters.kube.connection import Connection
from podmeter.adapters.kube.deltas import Delete, Delta, Replace, Upsert
from podmeter.adapters.kube.reflector import Reflector, ReflectorSettings
from podmeter.adapters.kube.resources import PODS
from podmeter.model.configuration import DEFAULT_NAME, decode_configuration
from podmeter.model.identity import (
    BadIdentityKey,
    IdentityExhausted,
    IdentityKey,
    LabelFilter,
    PodRefs,
    key_of_flat,
    shrunk_far,
)
from podmeter.model.records import DecodeError, Pod
from podmeter.runtime.leadership import LeaderElector

log = logging.getLogger("podmeter.operator")

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


def holds_identity(pod: Pod) -> bool:
    """Pods with an endpoint of their own: not host-network, not finished."""
    return not pod.host_network and pod.phase not in TERMINAL_PHASES


class PodSource(Protocol):
    """Pod events and the store they were applied to (see the module docstring). ``events`` may also
    yield ``None``: "a (re)list was applied", which marks the operator ready even when it changed nothing
    (an empty cluster)."""

    def events(self) -> AsyncIterator[tuple[str, Pod] | None]: ...

    def pods(self) -> Iterable[Pod]: ...


class PodStore:
    """The cluster's pods keyed by UID, fed with reflector deltas; each delta returns the events it implies.

    Invariant: ``pods`` is exactly the state after the deltas applied so far. A relist (:class:`Replace`)
    is diffed: DELETED for what vanished, ADDED/MODIFIED for what is new or changed, nothing for the
    unchanged; objects it could not decode (``keep``) keep their last good state. The dict is rebuilt by a
    relist and when deletes leave it far below its peak, so a past burst of pods does not pin memory.
    """

    def __init__(self) -> None:
        self.pods: dict[str, Pod] = {}
        self._peak = 0

    def apply(self, delta: Delta) -> list[tuple[str, Pod]]:
        if isinstance(delta, Upsert):
            old = self.pods.get(delta.item.uid)
            self.pods[delta.item.uid] = delta.item
            self._peak = max(self._peak, len(self.pods))
            return [("ADDED" if old is None else "MODIFIED", delta.item)]
        if isinstance(delta, Delete):
            gone = self.pods.pop(delta.key, None) or delta.item
            if shrunk_far(len(self.pods), self._peak):
                self.pods, self._peak = dict(self.pods), len(self.pods)
            return [("DELETED", gone)] if gone is not None else []
        return self._replace(delta)

    def _replace(self, delta: Replace) -> list[tuple[str, Pod]]:
        new: dict[str, Pod] = {p.uid: p for p in delta.items}
        new.update((k, self.pods[k]) for k in delta.keep if k in self.pods and k not in new)
        out = [("DELETED", p) for uid, p in self.pods.items() if uid not in new]
        out += [("ADDED" if uid not in self.pods else "MODIFIED", p)
                for uid, p in new.items() if self.pods.get(uid) != p]
        self.pods, self._peak = new, len(new)
        return out


class ReflectorPodSource:
    """:class:`PodSource` over the kube reflector, watching every pod of the cluster.

    The reflector queues deltas; :meth:`events` applies each one to a :class:`PodStore` as it yields the
    events it implies, so ``pods()`` is exactly the state after the last yielded event and a sweep
    between events never races the event stream.
    """

    def __init__(self, connection: Connection, settings: ReflectorSettings | None = None) -> None:
        self.connection = connection
        self.settings = settings or ReflectorSettings()
        self.store = PodStore()
        self.reflector: Reflector | None = None
        self._deltas: asyncio.Queue[Delta] = asyncio.Queue(maxsize=10_000)

    def pods(self) -> Iterable[Pod]:
        return self.store.pods.values()

    async def events(self) -> AsyncIterator[tuple[str, Pod] | None]:
        transport = self.connection.transport(self.settings.request_timeout)
        self.reflector = Reflector(PODS, transport, self._deltas.put, self.settings)
        task = asyncio.create_task(self.reflector.run(), name="reflector-pods")
        try:
            while True:
                delta = await self._deltas.get()
                for item in self.store.apply(delta):
                    yield item
                if isinstance(delta, Replace):
                    yield None
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await transport.close()


class OperatorMetrics:
    """The operator's Prometheus series, in a registry of its own (names documented in docs/operator.md)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.identities = Gauge("podmeter_identities", "Identities this operator holds", registry=r)
        self.gc_released = Counter(
            "podmeter_identity_gc_released", "Identities released by the sweep: no live pod", registry=r
        )
        self.repaired = Counter(
            "podmeter_drift_repaired", "Differences a periodic resync repaired", ["kind"], registry=r
        )
        self.allocations = Counter("podmeter_identity_acquired", "Identities acquired (0->1)", registry=r)
        self.releases = Counter("podmeter_identity_released", "Identities released (1->0)", registry=r)
        self.errors = Counter(
            "podmeter_identity_errors", "Identity operations that failed", ["op", "reason"], registry=r
        )
        self.pending = Gauge("podmeter_identity_pending", "Keys whose identity awaits a retry", registry=r)
        self.exhausted = Gauge("podmeter_identity_exhausted", "1 while the ID range is exhausted", registry=r)
        self.store_removed = Counter(
            "podmeter_identity_store_gc_removed", "Unreferenced IDs removed from the store", registry=r
        )
        self.pods = Gauge("podmeter_store_objects", "Objects in the store", ["resource"], registry=r)
        self.events = Counter(
            "podmeter_watch_events", "Watch events applied", ["resource", "type"], registry=r
        )
        self.leader = Gauge("podmeter_leader", "1 while this operator leads", registry=r)
        self.config_valid = Gauge(
            "podmeter_configuration_valid", "1 if the default MetricsConfiguration is valid", registry=r
        )


class IdentityReconciler:
    """Keeps ``backend.held()`` equal to the keys of live pods.

    Invariants: ``refs`` holds one reference per pod UID that holds an identity; a key whose desired
    state (``refs.count(key) > 0``) may differ from its actual state (``key in held``) is in ``_dirty``
    (to be applied by the next flush) or in ``_waiting`` (its last attempt failed); after :meth:`flush`
    with a healthy backend and IDs to spare, ``set(held) == set(refs.keys())``. Only 0→1 and 1→0
    crossings mark keys dirty, so the backend sees one call per crossing. A failed key is not retried on
    every event (an attempt that cannot succeed is not repeated in a loop): keys that wait for an ID are
    retried as soon as a release frees one, and every waiting key by :meth:`retry` (a timer) and sweeps.
    """

    def __init__(self, backend: IdentityBackend, label_filter: LabelFilter, metrics: OperatorMetrics) -> None:
        self.backend = backend
        self.label_filter = label_filter
        self.metrics = metrics
        self.refs = PodRefs()
        self._dirty: set[IdentityKey] = set()
        self._waiting: set[IdentityKey] = set()
        self._exhausted: set[IdentityKey] = set()  # the waiting keys that failed for want of an ID
        self._lock = asyncio.Lock()

    @property
    def dirty(self) -> frozenset[IdentityKey]:
        return frozenset(self._dirty)

    @property
    def waiting(self) -> frozenset[IdentityKey]:
        return frozenset(self._waiting)

    @property
    def idle(self) -> bool:
        """No flush under way and nothing dirty: held() is as desired, except for waiting keys."""
        return not self._dirty and not self._lock.locked()

    def observe(self, event_type: str, pod: Pod) -> None:
        """Apply one pod event to the references (no I/O)."""
        self.metrics.events.labels("pods", event_type).inc()
        key = self._key(pod) if event_type != "DELETED" and holds_identity(pod) else None
        crossing = self.refs.delete(pod.uid) if key is None else self.refs.upsert(pod.uid, key)
        for k in (crossing.acquired, crossing.released):
            if k is not None:
                self._dirty.add(k)

    def _key(self, pod: Pod) -> IdentityKey | None:
        try:
            return key_of_flat(pod.namespace, pod.labels, self.label_filter)
        except (BadIdentityKey, ValueError) as exc:
            self.metrics.errors.labels("key", "bad_labels").inc()
            log.error("pod %s/%s: no identity: %s", pod.namespace, pod.name, exc)
            return None

    async def flush(self) -> None:
        """Apply every dirty key, releases first; if a release freed an ID, retry the keys waiting for one."""
        async with self._lock:
            dirty, self._dirty = self._dirty, set()
            released = 0
            for key in sorted(dirty, key=lambda k: self.refs.count(k) > 0):
                released += await self._apply(key)
            if released and self._exhausted:
                for key in self._exhausted & self._waiting:
                    await self._apply(key)
            self._update_gauges()

    async def retry(self) -> None:
        """Try every waiting key again (called by a timer and by sweeps)."""
        self._dirty |= self._waiting
        self._waiting = set()
        await self.flush()

    async def _apply(self, key: IdentityKey) -> int:
        """Make ``key``'s actual state its desired state; 1 if that released an ID."""
        want, have = self.refs.count(key) > 0, key in self.backend.held()
        try:
            if want and not have:
                await self.backend.acquire(key)
                self.metrics.allocations.inc()
            elif have and not want:
                await self.backend.release(key)
                self.metrics.releases.inc()
        except IdentityExhausted as exc:
            self._failed(key, "acquire", "exhausted", exc)
            self._exhausted.add(key)
            return 0
        except IdentityBackendError as exc:
            self._failed(key, "acquire" if want else "release", "backend", exc)
            return 0
        self._waiting.discard(key)
        self._exhausted.discard(key)
        return 1 if have and not want else 0

    def _failed(self, key: IdentityKey, op: str, reason: str, exc: Exception) -> None:
        self.metrics.errors.labels(op, reason).inc()
        if key not in self._waiting:
            log.error("identity %s of %s failed (will retry): %s", op, key, exc)
        self._waiting.add(key)

    def _update_gauges(self) -> None:
        held = self.backend.held()
        self._exhausted &= self._waiting
        self.metrics.identities.set(len(held))
        self.metrics.pending.set(len(self._dirty | self._waiting))
        self.metrics.exhausted.set(1 if self._exhausted else 0)
        self.metrics.pods.labels("pods").set(len(self.refs))

    async def sweep(self, pods: Iterable[Pod]) -> int:
        """Recompute the references from the store; release and count what no live pod wants."""
        desired: dict[str, IdentityKey] = {}
        for pod in pods:
            key = self._key(pod) if holds_identity(pod) else None
            if key is not None:
                desired[pod.uid] = key
        # Under the flush lock: keys a flush has taken out of _dirty but not yet applied (it awaits the
        # backend) are in neither set, and would otherwise be counted as stale.
        async with self._lock:
            already_pending = self._dirty | self._waiting  # releases events asked for: not the sweep's finds
            for crossing in self.refs.replace_all(desired):
                if crossing.acquired is not None and crossing.acquired not in self.backend.held():
                    self.metrics.repaired.labels("identity_missing").inc()
                self._dirty.update(k for k in (crossing.acquired, crossing.released) if k is not None)
            stale = [k for k in self.backend.held() if self.refs.count(k) == 0 and k not in already_pending]
            self._dirty.update(stale)
        self.metrics.gc_released.inc(len(stale))
        if stale:
            log.warning("sweep: %d identities had no live pod (missed deletes); releasing", len(stale))
        await self.retry()
        return len(stale)

    def debug(self) -> dict[str, Any]:
        held = self.backend.held()
        return {
            "backend": self.backend.name,
            "pods": len(self.refs),
            "identities": [
                {"id": held.get(k), "namespace": k.namespace, "labels": k.label_dict(), "pods": n}
                for k, n in sorted(self.refs.counts().items(), key=lambda kv: held.get(kv[0], 0))
            ],
            "pending": [str(k) for k in self._dirty | self._waiting],
            "held": sorted(k.encode() for k in held),  # allocated now, referenced or not (the lab's I4 check)
        }


# -- MetricsConfiguration status ------------------------------------------------------------------------


class ConfigApi(Protocol):
    """Reading the ``default`` MetricsConfiguration and writing its status."""

    async def get(self, name: str) -> dict[str, Any] | None: ...

    async def write_status(self, name: str, status: dict[str, Any]) -> None: ...


def accepted_condition(obj: dict[str, Any]) -> dict[str, Any]:
    """The ``Accepted`` condition for a MetricsConfiguration object (True, or False with the reason)."""
    generation = int((obj.get("metadata") or {}).get("generation") or 0)
    try:
        decode_configuration(obj)
    except DecodeError as exc:
        return {"type": "Accepted", "status": "False", "reason": "Invalid", "message": str(exc),
                "observedGeneration": generation}
    return {"type": "Accepted", "status": "True", "reason": "Valid",
            "message": "configuration accepted", "observedGeneration": generation}


class ConfigurationStatus:
    """Keeps ``status.conditions`` of the ``default`` MetricsConfiguration in line with its spec.

    Invariant: a status is written only when the condition (ignoring its transition time) differs from
    the one the object carries, so a steady object is never rewritten.
    """

    def __init__(self, api: ConfigApi, metrics: OperatorMetrics, name: str = DEFAULT_NAME) -> None:
        self.api, self.metrics, self.name = api, metrics, name
        self.writes = 0

    async def reconcile(self) -> dict[str, Any] | None:
        obj = await self.api.get(self.name)
        if obj is None:
            return None
        condition = accepted_condition(obj)
        self.metrics.config_valid.set(1 if condition["status"] == "True" else 0)
        current = [c for c in ((obj.get("status") or {}).get("conditions") or []) if isinstance(c, dict)]
        old = next((c for c in current if c.get("type") == "Accepted"), None)
        if old is not None and {k: old.get(k) for k in condition} == condition:
            return old
        if condition["status"] == "False":
            log.error("MetricsConfiguration %s rejected: %s", self.name, condition["message"])
        same_status = old is not None and old.get("status") == condition["status"]
        kept = old.get("lastTransitionTime") if old is not None and same_status else None
        condition["lastTransitionTime"] = kept or datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        others = [c for c in current if c.get("type") != "Accepted"]
        await self.api.write_status(self.name, {"conditions": [*others, condition]})
        self.writes += 1
        return condition


class KubeConfigApi:
    """:class:`ConfigApi` over a lightkube ``AsyncClient`` (cluster-scoped ``metricsconfigurations``)."""

    def __init__(self, client: Any) -> None:
        from lightkube.generic_resource import create_global_resource

        self._client = client
        self._res: Any = create_global_resource(
            "podmeter.io", "v1alpha1", "MetricsConfiguration", "metricsconfigurations"
        )

    async def get(self, name: str) -> dict[str, Any] | None:
        from lightkube import ApiError

        try:
            obj = await self._client.get(self._res, name)
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise
        return dict(obj.to_dict())

    async def write_status(self, name: str, status: dict[str, Any]) -> None:
        from lightkube.types import PatchType

        await self._client.patch(self._res.Status, name, {"status": status}, patch_type=PatchType.MERGE)


# -- the process ---------------------------------------------------------------------------------------


class _Marker:
    """A non-event item of the operator's event queue."""


_SWEEP, _END, _SYNCED = _Marker(), _Marker(), _Marker()


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    sweep_period: float = 30.0  # full recompute against the store
    gc_period: float = 30.0  # backend GC (leader only); etcd removes after two rounds
    config_period: float = 5.0  # MetricsConfiguration status (leader only)
    retry_period: float = 2.0  # identity operations that failed are tried again
    debug_anywhere: bool = False  # answer /debug/* on non-loopback addresses too


class Operator:
    """Composes pod source, reconciler, backend, leader election, config status and HTTP.

    Events and sweeps run in one task, so a sweep always sees the store as of the last applied event.
    Only the leader runs the backend GC and writes the configuration status; every instance keeps its own
    references (so a standby is ready to lead and its IDs are the cluster's IDs).
    """

    def __init__(
        self,
        source: PodSource,
        backend: IdentityBackend,
        *,
        label_filter: LabelFilter | None = None,
        elector: LeaderElector | None = None,
        config: ConfigApi | None = None,
        settings: OperatorSettings | None = None,
    ) -> None:
        self.metrics = OperatorMetrics()
        self.source, self.backend = source, backend
        self.reconciler = IdentityReconciler(backend, label_filter or LabelFilter(), self.metrics)
        self.elector = elector
        self.config = ConfigurationStatus(config, self.metrics) if config is not None else None
        self.settings = settings or OperatorSettings()
        self.ready = asyncio.Event()
        self.last_sweep: float | None = None

    @property
    def is_leader(self) -> bool:
        return self.elector is None or self.elector.is_leader

    async def run(self) -> None:
        await self._start_backend()
        tasks = [asyncio.create_task(self._events(), name="operator-events")]
        tasks.append(asyncio.create_task(self._housekeeping(), name="operator-housekeeping"))
        if self.elector is not None:
            tasks.append(asyncio.create_task(self.elector.run(), name="operator-election"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.backend.close()

    async def _start_backend(self) -> None:
        delay = 0.2
        while True:
            try:
                await self.backend.start()
                return
            except IdentityBackendError as exc:
                self.metrics.errors.labels("start", "backend").inc()
                log.warning("identity backend %s not available (retrying in %.1fs): %s",
                            self.backend.name, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _events(self) -> None:
        queue: asyncio.Queue[tuple[str, Pod] | _Marker] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for item in self.source.events():
                    queue.put_nowait(_SYNCED if item is None else item)
            finally:
                queue.put_nowait(_END)

        async def ticker() -> None:
            while True:
                await asyncio.sleep(self.settings.sweep_period)
                queue.put_nowait(_SWEEP)

        helpers = [asyncio.create_task(pump(), name="operator-pod-events"),
                   asyncio.create_task(ticker(), name="operator-sweep-timer")]
        try:
            await self._consume(queue)
            await helpers[0]  # the source ended: re-raise its failure, if any
        finally:
            for task in helpers:
                task.cancel()
            for task in helpers:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _consume(self, queue: asyncio.Queue[tuple[str, Pod] | _Marker]) -> None:
        """Apply events in order; flush when the queue is drained; sweep only then (store == events)."""
        sweep_due = False
        while True:
            item = await queue.get()
            if item is _END:
                return
            if item is _SWEEP:
                sweep_due = True
            elif isinstance(item, tuple):
                self.reconciler.observe(*item)
            if queue.empty():
                await self.reconciler.flush()
                self.ready.set()
            if sweep_due and queue.empty():  # checked again: the flush may have let events in
                await self.sweep()
                sweep_due = False

    async def sweep(self) -> int:
        released = await self.reconciler.sweep(self.source.pods())
        self.last_sweep = time.time()
        return released

    async def _housekeeping(self) -> None:
        """Periodic work: retries (every operator); store GC and configuration status (the leader)."""
        s = self.settings
        due = {"retry": 0.0, "gc": 0.0, "config": 0.0}
        jobs = {"retry": (s.retry_period, False, self.reconciler.retry),
                "gc": (s.gc_period, True, self._gc),
                "config": (s.config_period, True, self._config)}
        while True:
            self.metrics.leader.set(1 if self.is_leader else 0)
            for name, (period, leader_only, job) in jobs.items():
                now = time.monotonic()
                if now >= due[name] and (self.is_leader or not leader_only):
                    await job()
                    due[name] = now + period
            await asyncio.sleep(min(s.retry_period, s.gc_period, s.config_period, 1.0))

    async def _gc(self) -> None:
        try:
            self.metrics.store_removed.inc(await self.backend.gc())
        except IdentityBackendError as exc:
            self.metrics.errors.labels("gc", "backend").inc()
            log.warning("identity store GC failed (will retry): %s", exc)

    async def _config(self) -> None:
        if self.config is None:
            return
        try:
            await self.config.reconcile()
        except Exception as exc:  # the API server may be unreachable; retried next period
            self.metrics.errors.labels("config_status", type(exc).__name__).inc()
            log.warning("MetricsConfiguration status: %s: %s", type(exc).__name__, exc)

    # -- HTTP --------------------------------------------------------------------------------------

    def http_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/debug/identities", self._debug)
        return app

    async def _metrics(self, _: web.Request) -> web.Response:
        self.metrics.leader.set(1 if self.is_leader else 0)
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, _: web.Request) -> web.Response:
        ok = self.ready.is_set()
        return web.Response(text="ready\n" if ok else "not ready\n", status=200 if ok else 503)

    async def _debug(self, request: web.Request) -> web.Response:
        if not self.settings.debug_anywhere and request.remote not in ("127.0.0.1", "::1"):
            return web.Response(status=403, text="debug endpoints answer on loopback only\n")
        body = self.reconciler.debug() | {"leader": self.is_leader, "last_sweep": self.last_sweep}
        reflector = getattr(self.source, "reflector", None)
        if isinstance(reflector, Reflector):
            stats = reflector.stats
            body["reflector"] = {"events": dict(stats.events), "relists": dict(stats.relists),
                                 "failures": dict(stats.failures), "resource_version": reflector.resource_version}
        if self.is_leader:
            body["store"] = {str(i): str(k) for i, k in sorted((await self._store_ids()).items())}
        return web.json_response(body)

    async def _store_ids(self) -> dict[int, IdentityKey]:
        try:
            return await self.backend.identities()
        except IdentityBackendError:
            return {}
