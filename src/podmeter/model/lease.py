"""A Lease as leader election sees it: the record read from and written to the API server, and the records
a candidate writes (client-go's rules, so that ``kubectl get lease`` reads the same as for any controller).

Next stage: ``runtime.leadership`` decides from these records who leads, and when to write which.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime


class LeaseConflict(Exception):
    """The Lease changed since it was read (or already exists on create)."""


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """The fields of a Lease that election uses; ``resource_version`` is the store's version of it."""

    holder: str
    duration_s: int
    renew_time: datetime | None = None
    acquire_time: datetime | None = None
    transitions: int = 0
    resource_version: str = ""


def created(holder: str, duration_s: int, now: datetime) -> LeaseRecord:
    """The first record of a Lease: its creator holds it, and no transition has happened yet."""
    return LeaseRecord(holder, duration_s, renew_time=now, acquire_time=now, transitions=0)


def acquired(record: LeaseRecord, holder: str, duration_s: int, now: datetime) -> LeaseRecord:
    """``record`` taken over by ``holder``, a candidate that does not lead: one more transition, whoever the
    record names. As in client-go, each acquisition by a candidate counts: over a Lease its last holder
    emptied on a clean exit (the usual hand-over of a rolling update), over one that ran out, and over one
    left under this candidate's own name by an earlier process."""
    return replace(record, holder=holder, duration_s=duration_s, renew_time=now, acquire_time=now,
                   transitions=record.transitions + 1)


def renewed(record: LeaseRecord, duration_s: int, now: datetime) -> LeaseRecord:
    """``record`` renewed by the leader that wrote it: same holder, same acquisition, same transitions."""
    return replace(record, duration_s=duration_s, renew_time=now)


def released(record: LeaseRecord, now: datetime) -> LeaseRecord:
    """``record`` given up by its leader on a clean exit: no holder, so that a successor need not wait; the
    transitions stay (the successor's acquisition adds its own)."""
    return replace(record, holder="", renew_time=now)
