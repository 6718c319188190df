"""The operator's identity reconciliation: F12-F14 of docs/design.md as tests, on memory and on a real etcd."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from etcd_server import EtcdServer, etcd
from podmeter.adapters.identity.base import IdentityBackend
from podmeter.adapters.identity.etcd import EtcdIdentityBackend
from podmeter.adapters.identity.memory import MemoryIdentityBackend
from podmeter.model.deltas import PODS, Delete, Replace, Upsert
from podmeter.model.identity import IdentityKey
from podmeter.model.records import Pod
from podmeter.model.store import Change, Store
from podmeter.runtime.operator import Operator
from podmeter.runtime.operator_process import http_app, metrics_registry
from podmeter.runtime.settings import OperatorSettings

__all__ = ["etcd"]

APPS = ("report", "backup", "etl")


def pod(uid: str, ns: str = "batch", labels: dict[str, str] | None = None, **kw: Any) -> Pod:
    flat = tuple(x for k in sorted(labels or {}) for x in (k, (labels or {})[k]))
    fields: dict[str, Any] = {
        "uid": uid, "namespace": ns, "name": f"p-{uid}", "node_name": "n1", "ips": ("10.0.0.1",),
        "host_network": False, "phase": "Running", "deleting": False, "observe": False, "labels": flat,
        "resource_version": "1",
    }
    return Pod(**(fields | kw))


def job_pod(i: int) -> Pod:
    """A CronJob run's pod: a stable app label plus labels unique to the run."""
    app = APPS[i % len(APPS)]
    return pod(f"u{i}", labels={
        "app": app, "job-name": f"{app}-{i}", "controller-uid": f"cu-{i}",
        "batch.kubernetes.io/job-name": f"{app}-{i}", "batch.kubernetes.io/controller-uid": f"cu-{i}",
    })


class StoreSource:
    """The pod-source interface over an in-process store: ``apply`` updates the store, then yields the
    change (unless the event is lost: ``deliver=False``). The store starts listed (empty), unless
    ``listed=False``: then nothing says the list was applied until ``list_applied()``."""

    reflector = None

    def __init__(self, listed: bool = True) -> None:
        self.store: dict[str, Pod] = {}
        self.queue: asyncio.Queue[Change[Pod] | None] = asyncio.Queue()  # None: "the list was applied"
        if listed:
            self.list_applied()

    def list_applied(self) -> None:
        self.queue.put_nowait(None)

    def apply(self, event: str, p: Pod, *, deliver: bool = True) -> None:
        old = self.store.pop(p.uid, None) if event == "DELETED" else self.store.get(p.uid)
        new = None if event == "DELETED" else p
        if new is not None:
            self.store[p.uid] = new
        if deliver and (old, new) != (None, None):
            self.queue.put_nowait((old, new))

    async def events(self) -> AsyncIterator[Change[Pod] | None]:
        while True:
            yield await self.queue.get()

    def pods(self) -> Iterable[Pod]:
        return list(self.store.values())


async def settle(op: Operator, source: StoreSource) -> None:
    for _ in range(500):
        if source.queue.empty() and op.reconciler.idle:
            await asyncio.sleep(0.01)
            if source.queue.empty() and op.reconciler.idle:
                return
        await asyncio.sleep(0.01)
    raise AssertionError("operator did not settle")


def metric(op: Operator, name: str, labels: dict[str, str] | None = None) -> float:
    value = metrics_registry(op).get_sample_value(name, labels or {})
    return 0.0 if value is None else value


@pytest.fixture(params=["memory", "etcd"])
def make_backend(request: pytest.FixtureRequest) -> Callable[[], IdentityBackend]:
    if request.param == "memory":
        return MemoryIdentityBackend
    server: EtcdServer = request.getfixturevalue("etcd")
    return lambda: EtcdIdentityBackend([server.endpoint], lease_ttl=3)


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_450_job_pods_leave_no_identities(make_backend: Callable[[], IdentityBackend]) -> None:
    """The reported reproduction: 450 short Job pods with unique labels, created and deleted."""
    source, backend = StoreSource(), make_backend()
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=0.3, gc_period=0.3))
    task = asyncio.create_task(op.run())
    peak = 0
    for i in range(450):
        source.apply("ADDED", job_pod(i))
        source.apply("MODIFIED", job_pod(i))  # a status update: no key change
        if i >= 30:
            source.apply("DELETED", job_pod(i - 30))
        if i % 50 == 0:
            await settle(op, source)
            peak = max(peak, len(backend.held()))
    await settle(op, source)
    assert set(backend.held()) == {IdentityKey("batch", ("app", a)) for a in APPS}
    for i in range(420, 450):
        source.apply("DELETED", job_pod(i))
    await settle(op, source)
    await asyncio.sleep(1.0)  # sweeps and two GC rounds run meanwhile
    assert peak <= len(APPS)
    assert metric(op, "podmeter_identity_acquired_total") == len(APPS)
    assert dict(backend.held()) == {}
    assert metric(op, "podmeter_identities") == 0
    assert metric(op, "podmeter_identity_gc_released_total") == 0  # no event was lost
    assert await backend.identities() == {}
    assert len(op.reconciler.refs) == 0
    await stop(task)


async def test_missed_deletes_are_released_by_the_sweep(make_backend: Callable[[], IdentityBackend]) -> None:
    source, backend = StoreSource(), make_backend()
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=0.3))
    task = asyncio.create_task(op.run())
    for i in range(6):
        source.apply("ADDED", pod(f"u{i}", labels={"app": f"a{i}"}))
    await settle(op, source)
    assert len(backend.held()) == 6
    for i in range(4):  # a watch gap: deletes that never arrive as events
        source.apply("DELETED", pod(f"u{i}"), deliver=False)
    for _ in range(100):
        if len(backend.held()) == 2:
            break
        await asyncio.sleep(0.05)
    assert set(backend.held()) == {IdentityKey("batch", ("app", "a4")), IdentityKey("batch", ("app", "a5"))}
    assert metric(op, "podmeter_identity_gc_released_total") == 4
    await stop(task)


async def test_relist_synthetic_deletes_release_without_gc() -> None:
    source, backend = StoreSource(), MemoryIdentityBackend()
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=0.2))
    task = asyncio.create_task(op.run())
    for i in range(3):
        source.apply("ADDED", pod(f"u{i}", labels={"app": f"a{i}"}))
    source.apply("ADDED", pod("u0", labels={"app": "a0"}))  # a replayed ADDED: a no-op
    await settle(op, source)
    for i in range(3):  # what a relist yields for objects that vanished during the gap
        source.apply("DELETED", pod(f"u{i}"))
    await settle(op, source)
    await asyncio.sleep(0.5)
    assert dict(backend.held()) == {}
    assert metric(op, "podmeter_identity_acquired_total") == 3
    assert metric(op, "podmeter_identity_gc_released_total") == 0
    await stop(task)


async def test_missed_add_is_repaired_and_counted() -> None:
    source, backend = StoreSource(), MemoryIdentityBackend()
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=0.2))
    task = asyncio.create_task(op.run())
    source.apply("ADDED", pod("u1", labels={"app": "x"}), deliver=False)
    for _ in range(100):
        if backend.held():
            break
        await asyncio.sleep(0.05)
    assert set(backend.held()) == {IdentityKey("batch", ("app", "x"))}
    assert metric(op, "podmeter_drift_repaired_total", {"kind": "identity_missing"}) == 1
    await stop(task)


async def test_before_its_first_list_the_operator_is_not_ready_and_sweeps_nothing() -> None:
    """A slow first list (a big cluster, 429s) outlasting the sweep period: the store is not the cluster
    yet, so a sweep would release the identities other operators' pods hold, and a leader's publication
    (which waits for ready) would delete every PodSlice."""
    source, backend = StoreSource(listed=False), MemoryIdentityBackend()
    held = IdentityKey("batch", ("app", "x"))
    await backend.acquire(held)  # what the cluster's pods hold, from before this operator started
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=0.05))
    task = asyncio.create_task(op.run())
    source.apply("ADDED", pod("u1", labels={"app": "y"}))  # a pod of the list, the rest still coming
    await asyncio.sleep(0.5)  # ten sweep periods
    assert not op.ready.is_set() and op.last_sweep is None
    assert held in backend.held()
    source.apply("ADDED", pod("u2", labels={"app": "x"}))
    source.list_applied()
    await settle(op, source)
    assert op.ready.is_set()
    await asyncio.sleep(0.2)  # sweeps run now
    assert op.last_sweep is not None and set(backend.held()) == {held, IdentityKey("batch", ("app", "y"))}
    await stop(task)


async def test_terminal_and_host_network_pods_hold_no_identity() -> None:
    source, backend = StoreSource(), MemoryIdentityBackend()
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=60))
    task = asyncio.create_task(op.run())
    source.apply("ADDED", pod("u1", labels={"app": "x"}))
    source.apply("ADDED", pod("u2", labels={"app": "h"}, host_network=True))
    await settle(op, source)
    assert set(backend.held()) == {IdentityKey("batch", ("app", "x"))}
    source.apply("MODIFIED", pod("u1", labels={"app": "x"}, phase="Succeeded"))
    await settle(op, source)
    assert dict(backend.held()) == {}
    await stop(task)


async def test_exhaustion_is_counted_and_recovers() -> None:
    source, backend = StoreSource(), MemoryIdentityBackend(first=256, last=257)
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=60))
    task = asyncio.create_task(op.run())
    for i in range(3):
        source.apply("ADDED", pod(f"u{i}", labels={"app": f"a{i}"}))
    await asyncio.sleep(0.2)
    assert len(backend.held()) == 2
    assert metric(op, "podmeter_identity_errors_total", {"op": "acquire", "reason": "exhausted"}) >= 1
    assert metric(op, "podmeter_identity_exhausted") == 1
    waiting = next(f"u{i}" for i in range(3) if IdentityKey("batch", ("app", f"a{i}")) not in backend.held())
    gone = next(f"u{i}" for i in range(3) if f"u{i}" != waiting)
    source.apply("DELETED", pod(gone))
    await settle(op, source)
    assert set(backend.held()) == {op.reconciler.refs.key_of(u) for u in source.store}
    assert metric(op, "podmeter_identity_exhausted") == 0
    assert not task.done()
    await stop(task)


async def test_bad_labels_are_counted_not_fatal() -> None:
    source, backend = StoreSource(), MemoryIdentityBackend()
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=60))
    task = asyncio.create_task(op.run())
    source.apply("ADDED", msgspec.structs.replace(pod("u1"), labels=("a", "1", "a", "2")))
    source.apply("ADDED", pod("u2", labels={"app": "ok"}))
    await settle(op, source)
    assert set(backend.held()) == {IdentityKey("batch", ("app", "ok"))}
    assert metric(op, "podmeter_identity_errors_total", {"op": "key", "reason": "bad_labels"}) == 1
    await stop(task)


async def test_http_endpoints() -> None:
    source, backend = StoreSource(), MemoryIdentityBackend()
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=60))
    task = asyncio.create_task(op.run())
    source.apply("ADDED", pod("u1", labels={"app": "web"}))
    source.apply("ADDED", pod("u2", labels={"app": "web", "pod-template-hash": "abc"}))
    await settle(op, source)
    async with TestClient(TestServer(http_app(op))) as client:
        assert (await (await client.get("/healthz")).text()) == "ok\n"
        assert (await client.get("/readyz")).status == 200
        text = await (await client.get("/metrics")).text()
        assert "podmeter_identities 1.0" in text
        assert "podmeter_identity_gc_released_total 0.0" in text
        debug = json.loads(await (await client.get("/debug/identities")).text())
    assert debug["identities"] == [{"id": 256, "namespace": "batch", "labels": {"app": "web"}, "pods": 2}]
    assert debug["store"] == {"256": "batch:{app=web}"}
    await stop(task)


async def test_two_operators_on_one_etcd_agree_and_clean_up(etcd: EtcdServer) -> None:
    sources = [StoreSource(), StoreSource()]
    backends = [EtcdIdentityBackend([etcd.endpoint], lease_ttl=3, owner=f"op{i}") for i in range(2)]
    ops = [Operator(s, b, settings=OperatorSettings(sweep_period=0.3, gc_period=0.2))
           for s, b in zip(sources, backends, strict=True)]
    tasks = [asyncio.create_task(op.run()) for op in ops]
    for i in range(60):  # both see the same pods, in different orders
        sources[0].apply("ADDED", job_pod(i))
        sources[1].apply("ADDED", job_pod(59 - i))
        sources[i % 2].apply("ADDED", pod(f"x{i}", labels={"app": f"solo{i}"}))
    for op, s in zip(ops, sources, strict=True):
        await settle(op, s)
    shared = {k: v for k, v in backends[0].held().items() if k in backends[1].held()}
    assert shared == {k: backends[1].held()[k] for k in shared}  # one ID per key across operators
    assert len(shared) == len(APPS)
    every = {**backends[0].held(), **backends[1].held()}
    assert len(set(every.values())) == len(every) == len(APPS) + 60  # never one ID for two keys
    for i in range(60):
        for s in sources:
            s.apply("DELETED", job_pod(i))
        sources[i % 2].apply("DELETED", pod(f"x{i}"))
    for op, s in zip(ops, sources, strict=True):
        await settle(op, s)
    for _ in range(50):  # both operators lead here (no elector): two GC rounds empty the store
        if not await backends[0].identities():
            break
        await asyncio.sleep(0.1)
    assert await backends[0].identities() == {}
    assert all(metric(op, "podmeter_identity_gc_released_total") == 0 for op in ops)
    for t in tasks:
        await stop(t)


async def test_operator_waits_for_etcd_at_start(tmp_path: Any) -> None:
    server = EtcdServer(tmp_path)
    source, backend = StoreSource(), EtcdIdentityBackend([server.endpoint], lease_ttl=3, timeout=1)
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=60))
    task = asyncio.create_task(op.run())
    source.apply("ADDED", pod("u1", labels={"app": "x"}))
    await asyncio.sleep(0.5)
    assert metric(op, "podmeter_identity_errors_total", {"op": "start", "reason": "backend"}) >= 1
    server.start()
    try:
        await asyncio.wait_for(op.ready.wait(), 15)
        await settle(op, source)
        assert set(backend.held()) == {IdentityKey("batch", ("app", "x"))}
    finally:
        await stop(task)
        server.stop()


def test_pod_store_diffs_a_relist() -> None:
    store: Store[Pod] = Store(PODS)
    a, b, c = pod("a", labels={"app": "x"}), pod("b", labels={"app": "y"}), pod("c", labels={"app": "z"})
    assert store.changes(Upsert(PODS, a)) == [(None, a)]
    assert store.changes(Upsert(PODS, b)) == [(None, b)]
    assert store.changes(Upsert(PODS, c)) == [(None, c)]
    assert store.changes(Upsert(PODS, c)) == []  # a replayed ADDED of an identical object: no change
    b2 = pod("b", labels={"app": "y2"})
    d = pod("d", labels={"app": "w"})
    # After a gap: a vanished, b changed, c failed to decode (kept), d is new.
    changes = store.changes(Replace(PODS, [b2, d], keep=frozenset({"c"})))
    assert changes == [(a, None), (b, b2), (None, d)]
    assert store.objects == {"b": b2, "c": c, "d": d}
    assert store.changes(Delete(PODS, "d")) == [(d, None)]
    assert store.changes(Delete(PODS, "unknown")) == []
    assert store.changes(Replace(PODS, [b2, c])) == []  # nothing changed: no changes


async def test_a_failing_source_stops_the_operator() -> None:
    class Failing:
        reflector = None

        async def events(self) -> AsyncIterator[Change[Pod]]:
            yield (None, pod("u1", labels={"app": "x"}))
            raise RuntimeError("watch broke for good")

        def pods(self) -> Iterable[Pod]:
            return []

    op = Operator(Failing(), MemoryIdentityBackend(), settings=OperatorSettings(sweep_period=60))
    with pytest.raises(RuntimeError, match="watch broke"):
        await asyncio.wait_for(op.run(), 5)


async def test_a_key_waiting_for_an_id_is_not_retried_on_every_event() -> None:
    source, backend = StoreSource(), MemoryIdentityBackend(first=256, last=256)
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=60, identity_retry_period=60))
    task = asyncio.create_task(op.run())
    source.apply("ADDED", pod("u1", labels={"app": "a"}))
    await settle(op, source)
    source.apply("ADDED", pod("u2", labels={"app": "b"}))
    await settle(op, source)
    for i in range(50):  # status updates of the holder: no crossing, and no hopeless retry either
        source.apply("MODIFIED", pod("u1", labels={"app": "a"}, resource_version=str(i)))
    await settle(op, source)
    exhausted = {"op": "acquire", "reason": "exhausted"}
    assert metric(op, "podmeter_identity_errors_total", exhausted) == 1
    assert op.reconciler.waiting == {IdentityKey("batch", ("app", "b"))}
    assert metric(op, "podmeter_identity_pending") == 1
    source.apply("DELETED", pod("u1"))  # frees the only ID: the waiting key gets it in the same flush
    await settle(op, source)
    assert dict(backend.held()) == {IdentityKey("batch", ("app", "b")): 256}
    assert (op.reconciler.waiting, metric(op, "podmeter_identity_exhausted")) == (frozenset(), 0)
    await stop(task)


async def test_backend_failures_are_retried_by_the_timer(etcd: EtcdServer) -> None:
    source = StoreSource()
    backend = EtcdIdentityBackend([etcd.endpoint], lease_ttl=5, timeout=1)
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=60, identity_retry_period=0.3))
    task = asyncio.create_task(op.run())
    source.apply("ADDED", pod("u1", labels={"app": "a"}))
    await settle(op, source)
    etcd.stop()
    source.apply("ADDED", pod("u2", labels={"app": "b"}))
    await settle(op, source)
    assert op.reconciler.waiting == {IdentityKey("batch", ("app", "b"))}
    assert metric(op, "podmeter_identity_errors_total", {"op": "acquire", "reason": "backend"}) >= 1
    etcd.start()
    for _ in range(100):  # no event arrives: the retry timer alone brings the key in
        if len(backend.held()) == 2:
            break
        await asyncio.sleep(0.1)
    assert set(backend.held()) == {IdentityKey("batch", ("app", "a")), IdentityKey("batch", ("app", "b"))}
    assert metric(op, "podmeter_identity_gc_released_total") == 0
    await stop(task)


def test_pod_store_rebuilds_after_a_burst() -> None:
    store: Store[Pod] = Store(PODS)
    pods = [pod(f"u{i}") for i in range(5000)]
    for p in pods:
        store.apply(Upsert(PODS, p))
    for p in pods[:4990]:
        store.apply(Delete(PODS, p.uid))
    assert len(store.objects) == 10 and store._peak.peak < 1024
    assert set(store.objects) == {p.uid for p in pods[4990:]}
