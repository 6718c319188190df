"""Leader election on a Lease (optimistic concurrency) and the MetricsConfiguration status."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import pytest

from podmeter.adapters.kube.lease import MemoryLeaseStore
from podmeter.model.configuration import accepted_condition
from podmeter.model.lease import LeaseConflict, LeaseRecord
from podmeter.runtime.leadership import LeaderElector
from podmeter.runtime.operator import ConfigurationStatus

LEASE, RENEW, RETRY = 2.0, 1.2, 0.1
FAST: dict[str, Any] = {"lease_duration": LEASE, "renew_deadline": RENEW, "retry_period": RETRY}


async def test_store_rejects_stale_writes() -> None:
    store = MemoryLeaseStore()
    first = await store.create(LeaseRecord("a", 15))
    with pytest.raises(LeaseConflict):
        await store.create(LeaseRecord("b", 15))
    await store.update(LeaseRecord("a", 15, resource_version=first.resource_version))
    with pytest.raises(LeaseConflict):
        await store.update(LeaseRecord("b", 15, resource_version=first.resource_version))


def test_timings_must_nest() -> None:
    with pytest.raises(ValueError, match="retry_period < renew_deadline < lease_duration"):
        LeaderElector(MemoryLeaseStore(), "a", lease_duration=5, renew_deadline=6)


async def campaign(electors: list[LeaderElector], seconds: float, alive: set[str]) -> list[set[str]]:
    """Step every live elector each retry period; record who believes it leads after each round."""
    rounds: list[set[str]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for e in electors:
            if e.identity in alive:
                await e.step()
        rounds.append({e.identity for e in electors if e.identity in alive and e.is_leader})
        await asyncio.sleep(0.1)
    return rounds


async def test_one_leader_and_takeover_after_the_leader_dies() -> None:
    store = MemoryLeaseStore()
    a, b = LeaderElector(store, "a", **FAST), LeaderElector(store, "b", **FAST)
    alive = {"a", "b"}
    rounds = await campaign([a, b], 1.0, alive)
    assert all(len(r) <= 1 for r in rounds)
    assert rounds[-1] == {"a"}  # the first to try holds it, and keeps renewing
    alive.discard("a")  # the leader dies without releasing (SIGKILL)
    died = time.monotonic()
    while not b.is_leader:
        await b.step()
        assert time.monotonic() - died < LEASE + 2 * RETRY
        await asyncio.sleep(RETRY)
    took = time.monotonic() - died
    assert took >= LEASE - 0.2  # not before the lease ran out
    record = await store.get()
    assert record is not None and (record.holder, record.transitions) == ("b", 1)


async def test_a_leader_that_cannot_renew_steps_down_before_takeover() -> None:
    store = MemoryLeaseStore()
    changes: list[bool] = []
    a = LeaderElector(store, "a", on_change=changes.append, **FAST)
    assert await a.step()

    async def broken() -> LeaseRecord | None:
        raise OSError("api server unreachable")

    store.get = broken  # type: ignore[method-assign]
    started = time.monotonic()
    while a.is_leader:
        await a.step()
        await asyncio.sleep(0.05)
    assert time.monotonic() - started < LEASE  # steps down before anyone may take over
    await a.step()
    assert changes == [True, False] and a.errors > 0


async def test_clean_exit_hands_over_at_once() -> None:
    store = MemoryLeaseStore()
    a, b = LeaderElector(store, "a", **FAST), LeaderElector(store, "b", **FAST)
    task = asyncio.create_task(a.run())
    while not a.is_leader:
        await asyncio.sleep(0.05)
    assert not await b.step()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await b.step()  # no need to wait for the lease to run out


async def forge(store: MemoryLeaseStore, holder: str) -> LeaseRecord:
    """Rewrite the Lease as anyone with write access to it could (a real, versioned write)."""
    record = await store.get()
    assert record is not None
    return await store.update(replace(record, holder=holder))


async def test_a_forged_lease_naming_the_standby_never_gives_two_leaders() -> None:
    store = MemoryLeaseStore()
    a, b = LeaderElector(store, "a", **FAST), LeaderElector(store, "b", **FAST)
    tasks = [asyncio.create_task(a.run())]
    while not a.is_leader:
        await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(b.run()))
    await asyncio.sleep(5 * RETRY)
    await forge(store, "b")  # the standby's name, written by neither elector
    forged = time.monotonic()
    samples: list[tuple[float, bool, bool]] = []
    try:
        while time.monotonic() - forged < LEASE + 1.5:
            samples.append((time.monotonic() - forged, a.is_leader, b.is_leader))
            await asyncio.sleep(0.05)
        record = await store.get()
        leaders = [e for e in (a, b) if e.is_leader]
        assert len(leaders) == 1, "one leader at the end"
        assert record is not None and record.holder == leaders[0].identity and leaders[0].holds
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert not [t for t, x, y in samples if x and y], "two leaders at once"
    # The text "b" made nobody lead: the one who leads now waited the lease out and wrote the Lease itself.
    assert not [t for t, _, y in samples if y and t < LEASE - 2 * RETRY]
    assert not [t for t, x, _ in samples if x and RETRY + 0.05 < t < LEASE - 2 * RETRY]  # a stepped down


async def test_a_leader_steps_down_at_once_when_a_read_shows_another_holder() -> None:
    store = MemoryLeaseStore()
    clock = [0.0]
    changes: list[bool] = []
    a = LeaderElector(store, "a", on_change=changes.append, clock=lambda: clock[0], **FAST)
    assert await a.step()
    await forge(store, "c")
    assert not await a.step()  # the same instant: no renew deadline to wait for
    assert not a.is_leader and changes == [True, False]
    clock[0] = LEASE - 0.1
    assert not await a.step()  # c's lease is waited out like any other
    clock[0] = LEASE + 0.1
    assert await a.step()
    record = await store.get()
    assert record is not None and (record.holder, record.transitions) == ("a", 1)


async def test_a_lease_left_under_the_same_identity_is_waited_out_then_written() -> None:
    """A restarted process with a fixed identity finds its name in the Lease: it did not write that."""
    store = MemoryLeaseStore()
    clock = [0.0]
    earlier = LeaderElector(store, "a", clock=lambda: clock[0], **FAST)
    assert await earlier.step()
    left = await store.get()
    clock[0] = 0.5  # the earlier process is SIGKILLed; its successor starts under the same name
    successor = LeaderElector(store, "a", clock=lambda: clock[0], **FAST)
    assert not await successor.step() and not successor.is_leader
    assert await store.get() == left  # not renewed on the strength of its text
    clock[0] = 0.5 + LEASE
    assert await successor.step()
    taken = await store.get()
    assert taken is not None and left is not None
    assert taken.resource_version != left.resource_version and taken.acquire_time != left.acquire_time
    assert not await earlier.step()  # had it survived, the successor's write would end its leadership


class DictConfigApi:
    """The ConfigApi over a dict (the server-side behaviour is tested against the lab API server)."""

    def __init__(self, obj: dict[str, Any] | None) -> None:
        self.obj = obj
        self.writes: list[dict[str, Any]] = []

    async def get(self, name: str) -> dict[str, Any] | None:
        return self.obj

    async def write_status(self, name: str, status: dict[str, Any]) -> None:
        assert self.obj is not None
        self.writes.append(status)
        self.obj = self.obj | {"status": status}


def config(spec: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    return {"apiVersion": "podmeter.io/v1alpha1", "kind": "MetricsConfiguration",
            "metadata": {"name": "default", "generation": generation}, "spec": spec}


def test_condition_names_the_invalid_field() -> None:
    bad = accepted_condition(config({"namespaces": {"include": ["Not_A_Namespace"]}}))
    assert (bad["status"], bad["reason"]) == ("False", "Invalid")
    assert "include[0]" in bad["message"] and "Not_A_Namespace" in bad["message"]
    both = accepted_condition(config({"namespaces": {"include": ["a"], "exclude": ["b"]}}))
    assert "cannot both be non-empty" in both["message"]
    good = accepted_condition(config({"namespaces": {"include": ["a"]}}, generation=4))
    assert (good["status"], good["reason"], good["observedGeneration"]) == ("True", "Valid", 4)


async def test_status_written_on_change_only() -> None:
    api = DictConfigApi(config({"namespaces": {"exclude": ["kube-system"]}}))
    status = ConfigurationStatus(api)
    assert status.valid is None  # nothing read yet: no object is a valid setup
    await status.reconcile()
    await status.reconcile()
    assert len(api.writes) == 1
    assert api.writes[0]["conditions"][0]["status"] == "True"
    api.obj = config({"annotations": "yes"}, generation=2) | {"status": api.obj["status"]}  # type: ignore[index]
    await status.reconcile()
    cond = api.writes[-1]["conditions"][0]
    assert (len(api.writes), cond["status"], cond["reason"]) == (2, "False", "Invalid")
    assert "annotations" in cond["message"]
    assert status.valid is False
    api.obj = None
    assert await status.reconcile() is None
    assert status.valid is None
