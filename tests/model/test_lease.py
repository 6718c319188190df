"""The Lease as leader election reads and writes it (``model.lease``): an immutable value."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

from podmeter.model.lease import LeaseConflict, LeaseRecord, acquired, created, released, renewed

pytestmark = pytest.mark.fast  # the pure tier: make test-fast


def test_a_lease_record_is_a_value_replaced_never_edited() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    read = LeaseRecord("op-a", 15, renew_time=now, acquire_time=now, transitions=2, resource_version="7")
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.holder = "op-b"  # type: ignore[misc]
    taken = dataclasses.replace(read, holder="op-b", transitions=read.transitions + 1)
    assert (read.holder, taken.holder, taken.transitions, taken.resource_version) == ("op-a", "op-b", 3, "7")
    assert LeaseRecord("op-a", 15) == LeaseRecord("op-a", 15, None, None, 0, "")  # the defaults: never renewed
    assert issubclass(LeaseConflict, Exception)


T0, T1, T2 = (datetime(2026, 1, 1, 0, 0, s, tzinfo=UTC) for s in (0, 10, 20))


def test_a_created_lease_is_held_by_its_creator_with_no_transition() -> None:
    first = created("op-a", 15, T0)
    assert (first.holder, first.duration_s, first.renew_time, first.acquire_time, first.transitions) == \
        ("op-a", 15, T0, T0, 0)


def test_renewing_keeps_the_acquisition_and_the_transitions() -> None:
    held = LeaseRecord("op-a", 15, renew_time=T0, acquire_time=T0, transitions=3, resource_version="7")
    again = renewed(held, 20, T1)
    assert (again.holder, again.duration_s, again.renew_time, again.acquire_time, again.transitions) == \
        ("op-a", 20, T1, T0, 3)


@pytest.mark.parametrize("previous", ["op-a", "", "op-b"],
                         ids=["ran-out", "emptied-on-a-clean-exit", "left-under-the-same-name"])
def test_every_acquisition_counts_one_transition_whoever_the_lease_names(previous: str) -> None:
    """client-go's leaseTransitions: one more at every acquisition by a candidate that does not lead."""
    read = LeaseRecord(previous, 15, renew_time=T0, acquire_time=T0, transitions=2, resource_version="7")
    taken = acquired(read, "op-b", 15, T1)
    assert (taken.holder, taken.renew_time, taken.acquire_time, taken.transitions) == ("op-b", T1, T1, 3)
    assert taken.resource_version == "7"  # the write is conditional on the version it read


def test_a_hand_over_through_a_release_counts_once() -> None:
    """A rolling update: the leader empties the Lease on SIGTERM, the other replica takes it."""
    lease = created("op-a", 15, T0)
    emptied = released(lease, T1)
    assert (emptied.holder, emptied.renew_time, emptied.acquire_time, emptied.transitions) == ("", T1, T0, 0)
    successor = acquired(emptied, "op-b", 15, T2)
    assert (successor.holder, successor.transitions) == ("op-b", 1)
    back = acquired(released(successor, T2), "op-a", 15, T2)
    assert (back.holder, back.transitions) == ("op-a", 2)
