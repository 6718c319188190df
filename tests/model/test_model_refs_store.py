"""The model's two generic pieces: ``Refs`` (crossings) and ``Store`` (deltas in, changes out).

Hypothesis drives both with random sequences against a from-scratch reference: crossings are reported
exactly when a key's holder set goes empty <-> non-empty, and a store's reported changes, applied to the
previous state, give the new state, for every kind of delta (relists with ``keep`` included).
"""

from __future__ import annotations

import sys

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import make_pod
from podmeter.model.deltas import PODS, Delete, Delta, Replace, Upsert
from podmeter.model.records import Pod
from podmeter.model.refs import Refs
from podmeter.model.store import Store

pytestmark = pytest.mark.fast  # the pure tier: make test-fast

KEYS = ["10.0.0.1", "10.0.0.2", "fd00::1"]
HOLDERS = ["u1", "u2", "u3", "u4"]
ref_steps = st.lists(st.tuples(st.booleans(), st.sampled_from(KEYS), st.sampled_from(HOLDERS)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ref_steps)
def test_refs_cross_exactly_when_the_holder_set_empties_or_fills(steps: list[tuple[bool, str, str]]) -> None:
    refs: Refs[str] = Refs()
    truth: dict[str, list[str]] = {}
    for add, key, holder in steps:
        before = bool(truth.get(key))
        if add:
            if holder not in truth.setdefault(key, []):
                truth[key].append(holder)
            crossed = refs.add(key, holder)
        else:
            if holder in truth.get(key, []):
                truth[key].remove(holder)
            crossed = refs.discard(key, holder)
        assert crossed == (before != bool(truth.get(key)))
        truth = {k: v for k, v in truth.items() if v}
        assert {k: list(refs.holders(k)) for k in refs} == truth  # same holders, in the order they came
        assert all(refs.count(k) == len(v) for k, v in truth.items())


def test_refs_give_their_table_back_after_a_burst() -> None:
    refs: Refs[str] = Refs()
    for i in range(5000):
        refs.add(f"10.1.{i // 250}.{i % 250}", "u")
    table, burst_size = refs._held, sys.getsizeof(refs._held)
    for i in range(4990):
        refs.discard(f"10.1.{i // 250}.{i % 250}", "u")
    assert len(refs) == 10 and refs._peak.peak < 1024  # the peak restarted from the survivors
    assert refs._held is not table  # ... because the table was rebuilt,
    assert sys.getsizeof(refs._held) * 10 < burst_size  # at the size of what is left


def test_a_store_gives_its_table_back_after_a_burst() -> None:
    store: Store[Pod] = Store(PODS)
    pods = [make_pod(f"p{i}", uid=f"u{i}") for i in range(5000)]
    for pod in pods:
        store.upsert(pod)
    table, burst_size = store.objects, sys.getsizeof(store.objects)
    for pod in pods[10:]:
        store.delete(pod.uid)
    assert len(store) == 10 and store.objects is not table
    assert sys.getsizeof(store.objects) * 10 < burst_size


def _pod(uid: str, version: int) -> Pod:
    """The same (uid, version) gives an equal record, so replays and unchanged relists are exercised."""
    pod = make_pod(f"p-{uid}", uid=uid, ips=(f"10.0.0.{version}",))
    return msgspec.structs.replace(pod, resource_version=str(version))


uids = st.sampled_from(["a", "b", "c", "d"])
deltas = st.one_of(
    st.builds(lambda u, v: Upsert(PODS, _pod(u, v)), uids, st.integers(1, 3)),
    st.builds(lambda u: Delete(PODS, u), uids),
    st.builds(lambda listed, keep: Replace(PODS, [_pod(u, v) for u, v in listed.items()], frozenset(keep)),
              st.dictionaries(uids, st.integers(1, 3)), st.sets(uids)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(deltas, max_size=30))
def test_store_changes_replayed_on_the_old_state_give_the_new_state(steps: list[Delta[Pod]]) -> None:
    store: Store[Pod] = Store(PODS)
    for delta in steps:
        before = dict(store.objects)
        changes = store.changes(delta)
        replayed = dict(before)
        for old, new in changes:
            assert old != new and (old is None or before[old.uid] == old)
            if new is None:
                assert old is not None
                del replayed[old.uid]
            else:
                replayed[new.uid] = new
        assert replayed == store.objects
        if isinstance(delta, Replace):  # the relist: exactly the listed objects, plus the kept last good ones
            listed = {p.uid: p for p in delta.items}
            kept = {k: v for k, v in before.items() if k in delta.keep and k not in listed}
            assert store.objects == listed | kept
