"""One test per state-related failure mode of docs/design.md (F1-F9, F11, F17), on the core.

Each drives the real view + writer + in-memory datapath (kernel semantics) and asserts what ends up in
the filter: the only thing that matters to a user whose map fills up.
"""

from __future__ import annotations

import pytest

from core_harness import Core
from factories import make_namespace, make_pod, with_changes
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.configuration import Interest
from podmeter.model.datapath import DatapathError

pytestmark = pytest.mark.fast  # the pure tier: make test-fast


def writer(capacity: int = 64) -> tuple[Core, MemoryDatapath]:
    datapath = MemoryDatapath(capacity)
    return Core(datapath), datapath


def settle(w: Core) -> None:
    w.flush()
    assert not w.view.desired.dirty


# --- F1-F2: interest removed before the delete -------------------------------------------


def test_namespace_annotation_removed_then_pod_deleted() -> None:
    w, dp = writer()
    w.upsert_namespace(make_namespace("team", observe=True))
    pod = make_pod("web", "team", ips=("10.0.0.1",))
    w.upsert_pod(pod)
    settle(w)
    assert dp.entries == {"10.0.0.1"}
    w.upsert_namespace(make_namespace("team", observe=False))
    settle(w)
    assert dp.entries == set()
    w.delete_pod(pod.uid)
    settle(w)
    assert dp.entries == set()


def test_namespace_annotation_stays_then_pod_deleted_removes_ip() -> None:
    w, dp = writer()
    w.upsert_namespace(make_namespace("team", observe=True))
    pod = make_pod("web", "team", ips=("10.0.0.1",))
    w.upsert_pod(pod)
    settle(w)
    w.delete_pod(pod.uid)
    settle(w)
    assert dp.entries == set()


def test_pod_annotation_removed_then_pod_deleted() -> None:
    w, dp = writer()
    pod = make_pod("web", ips=("10.0.0.1",), observe=True)
    w.upsert_pod(pod)
    settle(w)
    assert dp.entries == {"10.0.0.1"}
    w.upsert_pod(with_changes(pod, observe=False))
    settle(w)
    assert dp.entries == set()
    w.delete_pod(pod.uid)
    settle(w)
    assert dp.entries == set() and not w.view.pods


def test_include_list_changed_then_pod_deleted() -> None:
    w, dp = writer()
    w.configure(Interest(include=frozenset({"team"})))
    pod = make_pod("web", "team", ips=("10.0.0.1",))
    w.upsert_pod(pod)
    settle(w)
    assert dp.entries == {"10.0.0.1"}
    w.configure(Interest(include=frozenset({"other"})))
    settle(w)
    assert dp.entries == set()
    w.delete_pod(pod.uid)
    settle(w)
    assert dp.entries == set()


def test_delete_needs_no_metadata_from_the_add() -> None:
    """Added as 'namespace-observed', deleted after it became 'pod-annotated': one delete suffices."""
    w, dp = writer()
    w.upsert_namespace(make_namespace("team", observe=True))
    pod = make_pod("web", "team", ips=("10.0.0.1",))
    w.upsert_pod(pod)
    w.upsert_pod(with_changes(pod, observe=True))
    w.upsert_namespace(make_namespace("team", observe=False))
    settle(w)
    assert dp.entries == {"10.0.0.1"}
    w.delete_pod(pod.uid)
    settle(w)
    assert dp.entries == set()


# --- F3-F4: IP reuse in every order ----------------------------------------------------------


@pytest.mark.parametrize("order", ["delete-first", "add-first"])
@pytest.mark.parametrize("flush_between", [True, False])
def test_ip_reuse_every_order(order: str, flush_between: bool) -> None:
    w, dp = writer()
    old = make_pod("old", ips=("10.0.0.9",), observe=True)
    new = make_pod("new", ips=("10.0.0.9",), observe=True)
    w.upsert_pod(old)
    settle(w)
    steps = [lambda: w.delete_pod(old.uid), lambda: w.upsert_pod(new)]
    for step in steps if order == "delete-first" else reversed(steps):
        step()
        if flush_between:
            settle(w)
    settle(w)
    assert dp.entries == {"10.0.0.9"}
    assert [p.name for p in w.view.owners("10.0.0.9")] == ["new"]


def test_spurious_delete_for_a_reused_ip_keeps_the_entry() -> None:
    """A late delete of the old owner must not remove the IP the new owner holds."""
    w, dp = writer()
    old = make_pod("old", ips=("10.0.0.9",), observe=True)
    new = make_pod("new", ips=("10.0.0.9",), observe=True)
    w.upsert_pod(old)
    w.upsert_pod(new)
    settle(w)
    w.delete_pod(old.uid)
    w.delete_pod(old.uid)  # duplicate delete: a no-op
    settle(w)
    assert dp.entries == {"10.0.0.9"}


@pytest.mark.parametrize("new_observed", [True, False])
def test_ip_reuse_new_owner_interest_decides(new_observed: bool) -> None:
    w, dp = writer()
    old = make_pod("old", ips=("10.0.0.9",), observe=True)
    w.upsert_pod(old)
    settle(w)
    w.delete_pod(old.uid)
    w.upsert_pod(make_pod("new", ips=("10.0.0.9",), observe=new_observed))
    settle(w)
    assert dp.entries == ({"10.0.0.9"} if new_observed else set())


# --- F5-F6: full map, partial batch ---------------------------------------------------------


def test_full_map_keeps_only_desired_ips_and_reports_overflow() -> None:
    w, dp = writer(capacity=3)
    pods = [make_pod(f"p{i}", ips=(f"10.0.0.{i}",), observe=True) for i in range(5)]
    for pod in pods:
        w.upsert_pod(pod)
    settle(w)
    assert dp.entries == {"10.0.0.0", "10.0.0.1", "10.0.0.2"}  # earliest observed first
    assert w.overflow == 2
    calls = dp.calls
    for _ in range(50):  # nothing can be inserted: no retry loop against a full map
        w.flush()
    assert dp.calls == calls
    w.delete_pod(pods[1].uid)
    settle(w)
    assert dp.entries == {"10.0.0.0", "10.0.0.2", "10.0.0.3"}
    assert w.overflow == 1


def test_partial_batch_is_accounted_and_retried() -> None:
    w, dp = writer()
    dp.fail_next(DatapathError("EIO", "injected"), times=1)
    for i in range(4):
        w.upsert_pod(make_pod(f"p{i}", ips=(f"10.0.1.{i}",), observe=True))
    assert w.flush().ok is False
    assert dp.entries == set()  # the first element failed: nothing applied, nothing believed
    assert w.installed == set() and len(w.pending) == 4
    assert w.stats.write_errors[("insert", "EIO")] == 1
    assert w.flush().ok is True  # the failed adds were kept, not dropped (F7)
    assert dp.entries == {f"10.0.1.{i}" for i in range(4)}


def test_partial_batch_in_the_middle() -> None:
    w, dp = writer()
    for i in range(2):
        w.upsert_pod(make_pod(f"p{i}", ips=(f"10.0.1.{i}",), observe=True))
    w.flush()
    for i in range(2, 6):
        w.upsert_pod(make_pod(f"p{i}", ips=(f"10.0.1.{i}",), observe=True))
    # the memory datapath fails element operations in order: let two succeed, then fail
    original = dp.insert

    def insert_two_then_fail(ips: list[str]):  # type: ignore[no-untyped-def]
        result = original(ips[:2])
        from podmeter.model.datapath import BatchResult

        return BatchResult(result.applied, DatapathError("EIO", "injected"))

    dp.insert = insert_two_then_fail  # type: ignore[method-assign,assignment]
    w.flush()
    dp.insert = original  # type: ignore[method-assign]
    assert w.installed == dp.entries  # kernel and writer agree on what the partial batch did
    w.flush()
    assert dp.entries == {f"10.0.1.{i}" for i in range(6)}


def test_failed_delete_is_retried() -> None:
    w, dp = writer()
    pod = make_pod("p", ips=("10.0.0.1",), observe=True)
    w.upsert_pod(pod)
    settle(w)
    w.delete_pod(pod.uid)
    dp.fail_next(DatapathError("EIO", "injected"))
    assert w.flush().ok is False
    assert dp.entries == {"10.0.0.1"}
    assert w.flush().ok is True
    assert dp.entries == set()


def test_a_failed_delete_is_not_retried_once_the_ip_is_wanted_again() -> None:
    """Found by the property test: interest went and came back while a delete waited for its retry."""
    w, dp = writer()
    w.upsert_pod(make_pod("p", ips=("10.0.0.1",), observe=True))
    settle(w)
    dp.fail_next(DatapathError("EIO", "injected"))
    w.configure(Interest(annotations=False))  # p is no longer observed: its IP must go
    assert w.flush().ok is False and dp.entries == {"10.0.0.1"}
    w.configure(None)  # annotations count again: p is observed again before the retry
    settle(w)
    assert dp.entries == {"10.0.0.1"} and w.installed == {"10.0.0.1"}


def test_a_leaked_entry_that_vanished_before_its_retried_delete_is_not_restored() -> None:
    """Found by the property test: a resync's delete failed, then the entry went by itself."""
    w, dp = writer()
    dp.fail_next(DatapathError("EIO", "injected"), times=2)
    dp.entries.add("10.9.9.9")  # planted: nobody wants it
    w.resync()
    assert dp.entries == {"10.9.9.9"}  # the delete failed
    dp.entries.discard("10.9.9.9")  # and the entry went anyway
    w.resync()
    settle(w)
    assert dp.entries == set() and not w.installed and not w.pending


def test_kernel_full_of_unknown_entries_stops_inserting_until_resync() -> None:
    w, dp = writer(capacity=2)
    dp.entries |= {"10.9.9.1", "10.9.9.2"}  # a predecessor's leftovers the writer does not know
    w.upsert_pod(make_pod("p", ips=("10.0.0.1",), observe=True))
    w.flush()
    calls = dp.calls
    for _ in range(20):
        w.flush()
    assert dp.calls == calls
    repairs = w.resync()
    assert set(repairs.leaked) == {"10.9.9.1", "10.9.9.2"}
    assert dp.entries == {"10.0.0.1"}


# --- F7-F8: restart with stale pinned state ---------------------------------------------------


def test_restart_against_stale_actual_state_converges() -> None:
    dp = MemoryDatapath(64)
    dp.entries |= {"10.0.0.1", "10.0.0.2", "10.0.0.3"}  # left by a dead predecessor
    w = Core(dp)
    w.replace_pods([make_pod("alive", ips=("10.0.0.2",), observe=True),
                    make_pod("new", ips=("10.0.0.4",), observe=True)])
    repairs = w.resync()
    assert dp.entries == {"10.0.0.2", "10.0.0.4"}
    assert set(repairs.leaked) == {"10.0.0.1", "10.0.0.3"}
    assert w.stats.drift_repaired["leaked"] == 2
    assert w.stats.inserts == 1  # the surviving entry was adopted, not rewritten


def test_resync_restores_entries_removed_behind_the_writers_back() -> None:
    w, dp = writer()
    w.upsert_pod(make_pod("p", ips=("10.0.0.1",), observe=True))
    settle(w)
    dp.entries.clear()
    repairs = w.resync()
    assert repairs.missing == ("10.0.0.1",)
    assert dp.entries == {"10.0.0.1"}
    assert w.stats.drift_repaired["missing"] == 1


def test_resync_without_drift_repairs_nothing() -> None:
    w, _ = writer()
    for i in range(10):
        w.upsert_pod(make_pod(f"p{i}", ips=(f"10.0.0.{i}",), observe=True))
    settle(w)
    assert w.resync() == type(w.resync())()
    assert sum(w.stats.drift_repaired.values()) == 0


# --- F9: changing IPs, terminal pods, mode switch, IPv6 -----------------------------------------


def test_pod_whose_ip_changes_keeps_only_the_new_ip() -> None:
    w, dp = writer()
    pod = make_pod("p", ips=("10.0.0.1",), observe=True)
    w.upsert_pod(pod)
    settle(w)
    w.upsert_pod(with_changes(pod, ips=("10.0.0.2",)))
    settle(w)
    assert dp.entries == {"10.0.0.2"}


@pytest.mark.parametrize(
    "kwargs",
    [{"host_network": True}, {"phase": "Succeeded"}, {"phase": "Failed"}, {"ips": ()},
     {"node_name": "node-b"}],
)
def test_ineligible_pods_never_count(kwargs: dict[str, object]) -> None:
    w, dp = writer()
    w.upsert_namespace(make_namespace("default", observe=True))
    pod = make_pod("p", ips=("10.0.0.1",), observe=True)
    w.upsert_pod(pod)
    settle(w)
    w.upsert_pod(with_changes(pod, **kwargs))
    settle(w)
    assert dp.entries == set()


def test_completed_pod_frees_its_slot_for_the_reuser() -> None:
    w, dp = writer(capacity=1)
    job = make_pod("job", ips=("10.0.0.1",), observe=True)
    w.upsert_pod(job)
    w.upsert_pod(make_pod("waiting", ips=("10.0.0.2",), observe=True))
    settle(w)
    assert dp.entries == {"10.0.0.1"}
    w.upsert_pod(with_changes(job, phase="Succeeded"))  # stays in the store until deleted
    settle(w)
    assert dp.entries == {"10.0.0.2"}


def test_switching_exclude_to_include_leaves_no_extra_ips() -> None:
    w, dp = writer()
    for ns in ("a", "b", "c"):
        w.upsert_pod(make_pod(f"p-{ns}", ns, ips=(f"10.0.{ord(ns)}.1",)))
    w.configure(Interest(exclude=frozenset({"a"})))
    settle(w)
    assert dp.entries == {"10.0.98.1", "10.0.99.1"}
    w.configure(Interest(include=frozenset({"a"})))
    settle(w)
    assert dp.entries == {"10.0.97.1"}


def test_annotations_off_ignores_annotations() -> None:
    w, dp = writer()
    w.upsert_pod(make_pod("p", ips=("10.0.0.1",), observe=True))
    w.configure(Interest(annotations=False))
    settle(w)
    assert dp.entries == set()


def test_ipv6_and_dual_stack_do_not_poison_a_batch() -> None:
    w, dp = writer()
    w.upsert_pod(make_pod("v4", ips=("10.0.0.1",), observe=True))
    w.upsert_pod(make_pod("v6", ips=("fd00::1",), observe=True))
    w.upsert_pod(make_pod("dual", ips=("10.0.0.2", "fd00::2"), observe=True))
    settle(w)
    assert dp.entries == {"10.0.0.1", "fd00::1", "10.0.0.2", "fd00::2"}


# --- F11: one writer, namespace and pod changes interleaved --------------------------------------


def test_interleaved_namespace_and_pod_changes_match_a_recompute() -> None:
    w, dp = writer()
    pods = [make_pod(f"p{i}", "team", ips=(f"10.0.2.{i}",)) for i in range(20)]
    for i, pod in enumerate(pods):
        w.upsert_pod(pod)
        w.upsert_namespace(make_namespace("team", observe=i % 2 == 0))
    settle(w)
    assert set(w.view.recompute()) == dp.entries == set()  # last state: not observed
    w.upsert_namespace(make_namespace("team", observe=True))
    settle(w)
    assert set(w.view.recompute()) == dp.entries and len(dp.entries) == 20


# --- F17: replays and recreated pods -----------------------------------------------------------------


def test_duplicate_added_is_a_no_op() -> None:
    w, _ = writer()
    pod = make_pod("p", ips=("10.0.0.1",), observe=True)
    assert w.upsert_pod(pod) is True
    settle(w)
    for _ in range(100):
        assert w.upsert_pod(pod) is False
    assert len(w.view.pods) == 1 and not w.view.desired.dirty
    assert w.view.desired.uids("10.0.0.1") == (pod.uid,)


def test_relist_replay_produces_no_changes_and_drops_vanished() -> None:
    w, dp = writer()
    pods = [make_pod(f"p{i}", ips=(f"10.0.0.{i}",), observe=True) for i in range(5)]
    for pod in pods:
        w.upsert_pod(pod)
    settle(w)
    changed = w.replace_pods(pods[1:])  # pods[0] was deleted while we were disconnected
    assert changed == 1  # the one delete; the unchanged pods are no-ops
    settle(w)
    assert dp.entries == {f"10.0.0.{i}" for i in range(1, 5)}


@pytest.mark.parametrize("order", ["delete-first", "add-first"])
def test_recreated_pod_same_name_new_uid(order: str) -> None:
    w, dp = writer()
    first = make_pod("db-0", ips=("10.0.0.1",), observe=True)
    second = make_pod("db-0", ips=("10.0.0.2",), observe=True)
    assert first.uid != second.uid
    w.upsert_pod(first)
    settle(w)
    if order == "delete-first":
        w.delete_pod(first.uid)
        w.upsert_pod(second)
    else:
        w.upsert_pod(second)
        w.delete_pod(first.uid)
    settle(w)
    assert dp.entries == {"10.0.0.2"}
    assert list(w.view.pods) == [second.uid]
