"""Random event sequences through the identity reconciler: held identities == label sets of the store."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podmeter.adapters.identity.memory import MemoryIdentityBackend
from podmeter.model.identity import IdentityKey, LabelFilter, key_of_flat
from podmeter.model.interest import holds_identity
from podmeter.model.records import Pod
from podmeter.runtime.operator import IdentityReconciler

pytestmark = pytest.mark.fast  # the pure tier: make test-fast

UIDS = [f"u{i}" for i in range(6)]
LABELS = [("app", "a"), ("app", "b"), ("app", "a", "job-name", "j1"), ("app", "a", "job-name", "j2"), ()]
PHASES = ["Running", "Pending", "Succeeded"]


def make_pod(uid: str, labels: tuple[str, ...], phase: str) -> Pod:
    return Pod(uid=uid, namespace="ns", name=uid, node_name="n", ips=(), host_network=False, phase=phase,
               deleting=False, observe=False, labels=labels, resource_version="1")


event = st.tuples(
    st.sampled_from(["ADDED", "MODIFIED", "DELETED"]),
    st.sampled_from(UIDS),
    st.sampled_from(LABELS),
    st.sampled_from(PHASES),
    st.booleans(),  # delivered (False: the event is lost, only the store changes)
)


def expected(store: dict[str, Pod]) -> set[IdentityKey]:
    f = LabelFilter()
    return {key_of_flat(p.namespace, p.labels, f) for p in store.values() if holds_identity(p)}


async def run(events: list[tuple[str, str, tuple[str, ...], str, bool]]) -> None:
    backend = MemoryIdentityBackend()
    rec = IdentityReconciler(backend, LabelFilter())
    store: dict[str, Pod] = {}
    lost = False
    for kind, uid, labels, phase, delivered in events:
        p = make_pod(uid, labels, phase)
        old = store.pop(uid, None) if kind == "DELETED" else store.get(uid)
        new = None if kind == "DELETED" else p
        if new is not None:
            store[uid] = new
        if delivered:
            rec.observe(old or (p if new is None else None), new)
        lost |= not delivered
        await rec.flush()
        if not lost:  # every event arrived: the incremental state is exact after each flush
            assert set(backend.held()) == expected(store)
    released = await rec.sweep(store.values())
    assert set(backend.held()) == expected(store)
    assert rec.refs.counts() == {k: sum(1 for p in store.values() if holds_identity(p)
                                       and key_of_flat("ns", p.labels, LabelFilter()) == k)
                                 for k in expected(store)}
    if not lost:
        assert released == 0 and rec.stats.gc_released == 0
    assert await rec.sweep(store.values()) == 0  # a second sweep finds nothing


@settings(max_examples=150, deadline=None)
@given(st.lists(event, max_size=40))
def test_reconciler_matches_recompute(events: list[tuple[str, str, tuple[str, ...], str, bool]]) -> None:
    asyncio.run(run(events))


@settings(max_examples=60, deadline=None)
@given(st.lists(event.filter(lambda e: e[4]), max_size=40))
def test_no_lost_events_no_sweep_releases(events: list[tuple[str, str, tuple[str, ...], str, bool]]) -> None:
    asyncio.run(run(events))
