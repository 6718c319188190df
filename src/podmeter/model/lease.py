"""A Lease as leader election sees it: the record read from and written to the API server.

Next stage: ``runtime.leadership`` decides from these records who leads.
"""

from __future__ import annotations

from dataclasses import dataclass
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
