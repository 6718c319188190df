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
* :class:`Operator` composes them with a pod source and leader election; its state is read at scrape time
  (:meth:`Operator.snapshot`, ``adapters.metrics.operator_state``). The process around it (the kube client,
  the Lease, the backend, the publisher, the registry and the HTTP endpoints) is ``runtime.operator_process``.

The pod source is a small interface (:class:`PodSource`): an async iterator of store changes
``(old, new)`` plus the store those changes were made to. :class:`ReflectorPodSource` feeds the kube
reflector's deltas to a :class:`~podmeter.model.store.Store` (the same store, and the same relist diff, as
the agent's view) and yields what each delta changed, after applying it.

Every long-running task of the operator (the pod events, the sweep timer, the events consumer,
housekeeping, the election, the publisher's slice watch, the etcd lease keepalive) is supervised
(:mod:`podmeter.runtime.supervision`): one that dies is logged with its traceback, counted
(``podmeter_task_failures_total{task}``), turns ``/healthz`` to 503 and ends :meth:`Operator.run` with its
error, so the command exits non-zero and Kubernetes restarts it, instead of an operator that looks ready
while applying nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NoReturn, Protocol

from podmeter.adapters.identity.base import IdentityBackend, IdentityBackendError
from podmeter.adapters.kube.connection import Connection
from podmeter.adapters.kube.reflector import Reflector, ReflectorSettings
from podmeter.adapters.kube.resources import PODS
from podmeter.adapters.metrics.operator_state import OperatorSnapshot
from podmeter.model.configuration import DEFAULT_NAME, accepted_condition
from podmeter.model.deltas import Delta, Replace
from podmeter.model.identity import BadIdentityKey, IdentityExhausted, IdentityKey, LabelFilter, PodRefs, key_of_flat
from podmeter.model.interest import holds_identity
from podmeter.model.records import Pod
from podmeter.model.store import Change, Store
from podmeter.runtime.endpoint_publisher import EndpointPublisher
from podmeter.runtime.leadership import LeaderElector
from podmeter.runtime.settings import OperatorSettings
from podmeter.runtime.supervision import Supervisor
from podmeter.runtime.ticks import Tick, every

log = logging.getLogger("podmeter.operator")


class PodSource(Protocol):
    """Pod changes and the store they were made to (see the module docstring). ``events`` may also
    yield ``None``: "a (re)list was applied", which marks the operator ready even when it changed nothing
    (an empty cluster). ``reflector`` is the reflector behind it, if any (its counters are exported)."""

    reflector: Reflector[Pod] | None

    def events(self) -> AsyncIterator[Change[Pod] | None]: ...

    def pods(self) -> Iterable[Pod]: ...


class ReflectorPodSource:
    """:class:`PodSource` over the kube reflector, watching every pod of the cluster.

    The reflector queues deltas; :meth:`events` applies each one to the store and yields the changes it
    made, so ``pods()`` is exactly the state after the last yielded change and a sweep between changes
    never races the event stream. If the reflector's task ends (it never should), :meth:`events` raises
    once the deltas it queued are applied, so its consumer's supervisor sees the failure.
    """

    def __init__(self, connection: Connection, settings: ReflectorSettings | None = None) -> None:
        self.connection = connection
        self.settings = settings or ReflectorSettings()
        self.store: Store[Pod] = Store(PODS.collection)
        self.reflector: Reflector[Pod] | None = None
        self._deltas: asyncio.Queue[Delta[Pod] | None] = asyncio.Queue(maxsize=10_000)  # None: wake up

    def pods(self) -> Iterable[Pod]:
        return self.store.objects.values()

    async def events(self) -> AsyncIterator[Change[Pod] | None]:
        transport = self.connection.transport(self.settings.request_timeout)
        self.reflector = Reflector(PODS, transport, self._deltas.put, self.settings)
        task = asyncio.create_task(self.reflector.run(), name="reflector-pods")
        task.add_done_callback(self._wake)
        try:
            while True:
                if self._deltas.empty() and task.done():
                    _reflector_ended(task)
                delta = await self._deltas.get()
                if delta is None:
                    continue
                for change in self.store.changes(delta):
                    yield change
                if isinstance(delta, Replace):
                    yield None
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await transport.close()

    def _wake(self, task: asyncio.Task[None]) -> None:
        """The reflector ended: wake :meth:`events` if it waits on an empty queue. A full queue needs no
        wake-up (it is drained first, then found empty with the task done)."""
        with contextlib.suppress(asyncio.QueueFull):
            self._deltas.put_nowait(None)


def _reflector_ended(task: asyncio.Task[None]) -> NoReturn:
    """Raise why the pod reflector's task ended: its error, or that it stopped (it never should)."""
    error = None if task.cancelled() else task.exception()
    if error is not None:
        raise error
    raise RuntimeError("the pod reflector stopped")


@dataclass
class ReconcilerStats:
    """Counters exported as metrics (at scrape time); they only ever grow."""

    acquired: int = 0
    released: int = 0
    gc_released: int = 0  # released by a sweep: no live pod referred to them (an event was lost)
    errors: Counter[tuple[str, str]] = field(default_factory=Counter)  # (op, reason)
    repaired: Counter[str] = field(default_factory=Counter)  # kind


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

    def __init__(self, backend: IdentityBackend, label_filter: LabelFilter) -> None:
        self.backend = backend
        self.label_filter = label_filter
        self.stats = ReconcilerStats()
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

    @property
    def pending(self) -> int:
        """Keys whose actual state may differ from the desired one."""
        return len(self._dirty | self._waiting)

    @property
    def exhausted(self) -> bool:
        """Some key waits for an ID because the range is used up."""
        return bool(self._exhausted & self._waiting)

    def observe(self, old: Pod | None, new: Pod | None) -> None:
        """Apply one pod change from the store (``new`` None: deleted) to the references (no I/O)."""
        pod = new if new is not None else old
        if pod is None:
            return
        key = self._key(new) if new is not None and holds_identity(new) else None
        crossing = self.refs.delete(pod.uid) if key is None else self.refs.upsert(pod.uid, key)
        for k in (crossing.acquired, crossing.released):
            if k is not None:
                self._dirty.add(k)

    def _key(self, pod: Pod) -> IdentityKey | None:
        try:
            return key_of_flat(pod.namespace, pod.labels, self.label_filter)
        except (BadIdentityKey, ValueError) as exc:
            self.stats.errors["key", "bad_labels"] += 1
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
            self._exhausted &= self._waiting

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
                self.stats.acquired += 1
            elif have and not want:
                await self.backend.release(key)
                self.stats.released += 1
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
        self.stats.errors[op, reason] += 1
        if key not in self._waiting:
            log.error("identity %s of %s failed (will retry): %s", op, key, exc)
        self._waiting.add(key)

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
                    self.stats.repaired["identity_missing"] += 1
                self._dirty.update(k for k in (crossing.acquired, crossing.released) if k is not None)
            stale = [k for k in self.backend.held() if self.refs.count(k) == 0 and k not in already_pending]
            self._dirty.update(stale)
        self.stats.gc_released += len(stale)
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


class ConfigurationStatus:
    """Keeps ``status.conditions`` of the ``default`` MetricsConfiguration in line with its spec.

    Invariant: a status is written only when the condition (ignoring its transition time) differs from
    the one the object carries, so a steady object is never rewritten.
    """

    def __init__(self, api: ConfigApi, name: str = DEFAULT_NAME) -> None:
        self.api, self.name = api, name
        self.writes = 0
        self.valid: bool | None = None  # None: no such object (annotations only: a valid setup)

    async def reconcile(self) -> dict[str, Any] | None:
        obj = await self.api.get(self.name)
        if obj is None:
            self.valid = None
            return None
        condition = accepted_condition(obj)
        self.valid = condition["status"] == "True"
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


# -- the process ---------------------------------------------------------------------------------------


class Operator:
    """Composes pod source, reconciler, backend, leader election and config status.

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
        publisher: EndpointPublisher | None = None,
        connection: Connection | None = None,
    ) -> None:
        """``publisher`` (with the ``connection`` its reflector reads slices through): publish the
        cluster's endpoints (leader only)."""
        self.source, self.backend = source, backend
        self.reconciler = IdentityReconciler(backend, label_filter or LabelFilter())
        self.elector = elector
        self.config = ConfigurationStatus(config) if config is not None else None
        self.settings = settings or OperatorSettings()
        self.ready = asyncio.Event()
        self.last_sweep: float | None = None
        self.store_gc_removed = 0
        self.publisher, self.connection = publisher, connection
        self.supervisor = Supervisor()

    @property
    def is_leader(self) -> bool:
        return self.elector is None or self.elector.is_leader

    async def run(self) -> None:
        """Run until cancelled; if a task dies, stop every other and raise its error (see the module)."""
        await self._start_backend()
        queue: asyncio.Queue[Change[Pod] | Tick] = asyncio.Queue()
        spawn = self.supervisor.spawn
        spawn(self._pump(queue), "reflector-pods")
        spawn(every(self.settings.sweep_period, queue, Tick.SWEEP), "sweep-timer")
        spawn(self._consume(queue), "operator-events")
        spawn(self._housekeeping(), "housekeeping")
        if self.elector is not None:
            spawn(self.elector.run(), "leader-election")
        if self.publisher is not None and self.connection is not None:
            spawn(self.publisher.watch(self.connection), "publisher")
        keepalive = getattr(self.backend, "keepalive_task", None)  # the etcd backend's lease keepalive
        if isinstance(keepalive, asyncio.Task):
            self.supervisor.watch(keepalive)
        try:
            await self.supervisor.wait_failure()
        finally:
            await self.supervisor.cancel_all()
            await self.backend.close()

    async def _start_backend(self) -> None:
        delay = 0.2
        while True:
            try:
                await self.backend.start()
                return
            except IdentityBackendError as exc:
                self.reconciler.stats.errors["start", "backend"] += 1
                log.warning("identity backend %s not available (retrying in %.1fs): %s",
                            self.backend.name, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _pump(self, queue: asyncio.Queue[Change[Pod] | Tick]) -> None:
        """The pod source's changes into the events queue. If the source ends or fails, so does this task:
        its supervisor stops the operator (the consumer is cancelled, not told, so that one failure is
        counted once)."""
        async for item in self.source.events():
            queue.put_nowait(Tick.SYNCED if item is None else item)

    async def _consume(self, queue: asyncio.Queue[Change[Pod] | Tick]) -> None:
        """Apply changes in order; flush when the queue is drained. Ready, and sweeps, only once a list was
        applied: before it the store is not the cluster, and a sweep would release every identity (and the
        leader's publication, which waits for ready, delete every slice)."""
        sweep_due = listed = False
        while True:
            item = await queue.get()
            if item is Tick.SWEEP:
                sweep_due = True
            elif item is Tick.SYNCED:
                listed = True
            elif not isinstance(item, Tick):
                self.reconciler.observe(*item)
            if not queue.empty():
                continue
            await self.reconciler.flush()
            if not listed:
                continue
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
        due = {"retry": 0.0, "gc": 0.0, "config": 0.0, "publish": 0.0}
        jobs = {"retry": (s.identity_retry_period, False, self.reconciler.retry),
                "gc": (s.gc_period, True, self._gc),
                "config": (s.config_period, True, self._config),
                "publish": (s.publish_period, True, self._publish)}
        while True:
            for name, (period, leader_only, job) in jobs.items():
                now = time.monotonic()
                if now >= due[name] and (self.is_leader or not leader_only):
                    await job()
                    due[name] = now + period
            await asyncio.sleep(min(s.identity_retry_period, s.gc_period, s.config_period, s.publish_period, 1.0))

    async def _publish(self) -> None:
        """Publish the endpoints, once the store and the identities are complete (an operator that
        published before its first list would delete every slice)."""
        if self.publisher is not None and self.ready.is_set() and self.reconciler.idle:
            await self.publisher.sync(self.source.pods(), self.identity_of)

    def identity_of(self, pod: Pod) -> tuple[int, IdentityKey] | None:
        key = self.reconciler.refs.key_of(pod.uid)
        ident = self.backend.held().get(key) if key is not None else None
        return None if ident is None or key is None else (ident, key)

    async def _gc(self) -> None:
        try:
            self.store_gc_removed += await self.backend.gc()
        except IdentityBackendError as exc:
            self.reconciler.stats.errors["gc", "backend"] += 1
            log.warning("identity store GC failed (will retry): %s", exc)

    async def _config(self) -> None:
        if self.config is None:
            return
        try:
            await self.config.reconcile()
        except Exception as exc:  # the API server may be unreachable; retried next period
            self.reconciler.stats.errors["config_status", type(exc).__name__] += 1
            log.warning("MetricsConfiguration status: %s: %s", type(exc).__name__, exc)

    # -- what the metrics and the debug endpoint read -----------------------------------------------

    def snapshot(self) -> OperatorSnapshot:
        """The operator's state as the metrics export it, read now."""
        rec = self.reconciler
        stats = rec.stats
        reflector = self.source.reflector
        events: dict[tuple[str, str], int] = {}
        relists: dict[tuple[str, str], int] = {}
        decode_errors: dict[str, int] = {}
        if reflector is not None:
            events = {("pods", t): n for t, n in reflector.stats.events.items()}
            relists = {("pods", why): n for why, n in reflector.stats.relists.items()}
            decode_errors = {"pods": reflector.stats.decode_errors}
        return OperatorSnapshot(
            identities=len(self.backend.held()), pending=rec.pending, exhausted=rec.exhausted,
            leader=self.is_leader, configuration_valid=self.config is None or self.config.valid is not False,
            ready=self.ready.is_set(), acquired=stats.acquired, released=stats.released,
            gc_released=stats.gc_released, store_gc_removed=self.store_gc_removed,
            store_corrupt=dict(self.backend.store_corrupt()), errors=dict(stats.errors),
            drift_repaired=dict(stats.repaired), watch_events=events, relists=relists,
            decode_errors=decode_errors, store_objects={"pods": len(rec.refs)},
            task_failures=dict(self.supervisor.failures),
            **self._publish_figures(),
        )

    def _publish_figures(self) -> dict[str, Any]:
        if self.publisher is None:
            return {}
        p, last = self.publisher.stats, self.publisher.last
        return {"published_endpoints": last.endpoints, "published_slices": last.slices,
                "slice_writes": dict(p.writes), "slice_conflicts": p.conflicts, "slice_errors": p.errors,
                "slice_writes_pending": last.pending}

    async def debug_identities(self) -> dict[str, Any]:
        body = self.reconciler.debug() | {"leader": self.is_leader, "last_sweep": self.last_sweep}
        reflector = self.source.reflector
        if reflector is not None:
            stats = reflector.stats
            body["reflector"] = {"events": dict(stats.events), "relists": dict(stats.relists),
                                 "failures": dict(stats.failures), "resource_version": reflector.resource_version}
        if self.is_leader:
            body["store"] = {str(i): str(k) for i, k in sorted((await self._store_ids()).items())}
        return body

    async def _store_ids(self) -> dict[int, IdentityKey]:
        try:
            return await self.backend.identities()
        except IdentityBackendError:
            return {}
