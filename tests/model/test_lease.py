"""The Lease as leader election reads and writes it (``model.lease``): an immutable value."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

from podmeter.model.lease import LeaseConflict, LeaseRecord


def test_a_lease_record_is_a_value_replaced_never_edited() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    read = LeaseRecord("op-a", 15, renew_time=now, acquire_time=now, transitions=2, resource_version="7")
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.holder = "op-b"  # type: ignore[misc]
    taken = dataclasses.replace(read, holder="op-b", transitions=read.transitions + 1)
    assert (read.holder, taken.holder, taken.transitions, taken.resource_version) == ("op-a", "op-b", 3, "7")
    assert LeaseRecord("op-a", 15) == LeaseRecord("op-a", 15, None, None, 0, "")  # the defaults: never renewed
    assert issubclass(LeaseConflict, Exception)
