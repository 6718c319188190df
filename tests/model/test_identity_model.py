"""The pure identity model: label filtering, keys, per-UID references, the ID pool."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from podmeter.model.identity import (
    DEFAULT_EXCLUDED_LABELS,
    BadIdentityKey,
    Crossing,
    IdentityExhausted,
    IdentityKey,
    IdPool,
    LabelFilter,
    PodRefs,
    key_of_flat,
    make_key,
)

pytestmark = pytest.mark.fast  # the pure tier: make test-fast

DEFAULT = LabelFilter()


def job_labels(i: int) -> list[tuple[str, str]]:
    return [
        ("app", "report"),
        ("job-name", f"report-{i}"),
        ("controller-uid", f"uid-{i}"),
        ("batch.kubernetes.io/job-name", f"report-{i}"),
        ("batch.kubernetes.io/controller-uid", f"uid-{i}"),
    ]


def test_default_filter_drops_per_run_labels() -> None:
    for name in DEFAULT_EXCLUDED_LABELS:
        assert DEFAULT.excludes(name)
    assert not DEFAULT.excludes("app")
    keys = {make_key("batch", job_labels(i), DEFAULT) for i in range(50)}
    assert keys == {IdentityKey("batch", ("app", "report"))}


def test_key_is_sorted_and_namespaced() -> None:
    a = make_key("ns", [("z", "1"), ("a", "2")], DEFAULT)
    assert a.labels == ("a", "2", "z", "1")
    assert a != make_key("other", [("z", "1"), ("a", "2")], DEFAULT)
    assert key_of_flat("ns", ("a", "2", "z", "1"), DEFAULT) == a


def test_duplicate_label_key_is_an_error() -> None:
    with pytest.raises(BadIdentityKey, match="twice"):
        make_key("ns", [("a", "1"), ("a", "2")], DEFAULT)


def test_filter_configuration_add_remove_prefix() -> None:
    f = LabelFilter.configure(add=["example.com/*", "run"], remove=["job-name"])
    assert f.excludes("example.com/build") and f.excludes("run")
    assert not f.excludes("job-name") and f.excludes("controller-uid")
    assert not f.excludes("example.org/x")
    with pytest.raises(ValueError, match="empty"):
        LabelFilter.configure(add=[""])
    with pytest.raises(ValueError, match="everything"):
        LabelFilter.configure(add=["*"])


labels_st = st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=5)


@given(st.text(max_size=10), labels_st)
def test_encode_decode_roundtrip(namespace: str, labels: dict[str, str]) -> None:
    key = make_key(namespace, labels.items(), LabelFilter(frozenset()))
    assert IdentityKey.decode(key.encode()) == key


@pytest.mark.parametrize("text", ["", "{", "[1,[]]", '["ns",["a"]]', '["ns",[1,2]]', '"x"'])
def test_decode_rejects_malformed(text: str) -> None:
    with pytest.raises(BadIdentityKey):
        IdentityKey.decode(text)


def test_450_job_pods_take_one_reference_set() -> None:
    """Failure modes F12/F13 (docs/design.md) at the model level: churned Job pods leave nothing behind."""
    refs = PodRefs()
    acquired = released = 0
    for i in range(450):
        c = refs.upsert(f"pod-{i}", make_key("batch", job_labels(i), DEFAULT))
        acquired += c.acquired is not None
        if i >= 5:
            released += refs.delete(f"pod-{i - 5}").released is not None
    for i in range(445, 450):
        released += refs.delete(f"pod-{i}").released is not None
    assert (acquired, released, len(refs), refs.counts()) == (1, 1, 0, {})


def test_duplicate_and_unknown_events_change_nothing() -> None:
    refs = PodRefs()
    k = IdentityKey("ns", ("app", "a"))
    assert refs.upsert("u1", k).acquired == k
    assert not refs.upsert("u1", k)
    assert refs.count(k) == 1
    assert not refs.delete("nope")
    assert refs.delete("u1").released == k
    assert not refs.delete("u1")


def test_relabel_moves_the_reference() -> None:
    refs = PodRefs()
    a, b = IdentityKey("ns", ("app", "a")), IdentityKey("ns", ("app", "b"))
    refs.upsert("u1", a)
    c = refs.upsert("u1", b)
    assert (c.acquired, c.released) == (b, a)
    assert refs.counts() == {b: 1}


def test_refs_rebuild_after_shrinking() -> None:
    refs = PodRefs()
    for i in range(5000):
        refs.upsert(f"u{i}", IdentityKey("ns", ("i", str(i))))
    for i in range(5000):
        refs.delete(f"u{i}")
    assert refs._pods_peak.peak < 1024 and refs._canonical_peak.peak < 1024 and len(refs._refs) == 0


KEYS = [IdentityKey("ns", ("app", str(i))) for i in range(4)]


class RefsMachine(RuleBasedStateMachine):
    """Random event sequences: the incremental references equal a from-scratch recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.refs = PodRefs()
        self.truth: dict[str, IdentityKey] = {}
        self.live: set[IdentityKey] = set()

    def _apply(self, crossings: list[Crossing], before: set[IdentityKey]) -> None:
        after = set(self.truth.values())
        acquired = {c.acquired for c in crossings if c.acquired is not None}
        released = {c.released for c in crossings if c.released is not None}
        # Side effects exactly on 0->1 and 1->0, and the live set follows them.
        self.live = (self.live - released) | acquired
        assert self.live == after
        assert acquired - released == after - before
        assert released - acquired == before - after

    @rule(uid=st.sampled_from("abcdef"), key=st.sampled_from(KEYS))
    def upsert(self, uid: str, key: IdentityKey) -> None:
        before = set(self.truth.values())
        self.truth[uid] = key
        self._apply([self.refs.upsert(uid, key)], before)

    @rule(uid=st.sampled_from("abcdefg"))
    def delete(self, uid: str) -> None:
        before = set(self.truth.values())
        self.truth.pop(uid, None)
        self._apply([self.refs.delete(uid)], before)

    @rule(state=st.dictionaries(st.sampled_from("abcdefg"), st.sampled_from(KEYS)))
    def relist(self, state: dict[str, IdentityKey]) -> None:
        before = set(self.truth.values())
        self.truth = dict(state)
        self._apply(list(self.refs.replace_all(state)), before)

    @invariant()
    def counts_match_recompute(self) -> None:
        expected: dict[IdentityKey, int] = {}
        for key in self.truth.values():
            expected[key] = expected.get(key, 0) + 1
        assert self.refs.counts() == expected
        assert len(self.refs) == len(self.truth)


TestRefsMachine = RefsMachine.TestCase
TestRefsMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_pool_lowest_free_first_and_exhaustion() -> None:
    pool = IdPool(first=10, last=13)
    assert [pool.take() for _ in range(4)] == [10, 11, 12, 13]
    with pytest.raises(IdentityExhausted, match="10-13 exhausted"):
        pool.take()
    pool.release(11)
    pool.release(12)
    assert pool.take() == 11
    pool.release(13)
    pool.release(13)  # twice: no effect
    assert len(pool) == 2
    assert [pool.take(), pool.take()] == [12, 13]


def test_pool_take_specific() -> None:
    pool = IdPool(first=1, last=100)
    pool.take_specific(5)
    assert [pool.take() for _ in range(5)] == [1, 2, 3, 4, 6]
    with pytest.raises(ValueError, match="outside"):
        pool.take_specific(101)


def test_pool_bad_range() -> None:
    with pytest.raises(ValueError, match="bad identity range"):
        IdPool(first=5, last=4)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=80))
def test_pool_matches_reference(ops: list[tuple[bool, int]]) -> None:
    pool, used = IdPool(first=1, last=20), set[int]()
    for take, n in ops:
        if take:
            free = sorted(set(range(1, 21)) - used)
            if not free:
                with pytest.raises(IdentityExhausted):
                    pool.take()
                continue
            assert pool.take() == free[0]
            used.add(free[0])
        else:
            pool.release(n)
            used.discard(n)
        assert len(pool) == len(used)
        assert all(pool.in_use(i) == (i in used) for i in range(0, 22))
    for i in list(used):
        pool.release(i)
    assert (pool._next, pool._free) == (1, set())
