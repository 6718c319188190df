"""Leader election on a ``coordination.k8s.io/v1`` Lease, with client-go's semantics.

Every candidate reads the Lease each ``retry_period``. The holder renews it (an update with the
resourceVersion it read, so two writers can never both win). A candidate takes over only when the record
has not changed for ``lease_duration`` *as measured by its own clock* since it last saw it change: clocks
of different machines are never compared. A leader that cannot renew for ``renew_deadline`` (shorter than
the lease duration) steps down before anyone else may take over. On a clean exit the holder empties the
Lease so that a successor need not wait.

Leading rests on this process's own writes, never on the Lease's text: a record naming this candidate
that it did not write (forged, or left by an earlier process with the same identity) is someone else's
lease, waited out like any other and then taken over with a write of its own; and a read that shows any
record other than the one its last write produced ends its leadership at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Protocol

from podmeter.model.lease import LeaseConflict, LeaseRecord, acquired, created, released, renewed

log = logging.getLogger(__name__)


class LeaseStore(Protocol):
    """One Lease object. ``update`` and ``create`` raise LeaseConflict on a lost race."""

    async def get(self) -> LeaseRecord | None: ...

    async def create(self, record: LeaseRecord) -> LeaseRecord: ...

    async def update(self, record: LeaseRecord) -> LeaseRecord: ...


class LeaderElector:
    """Decides whether this process leads.

    Invariant: ``is_leader`` is True iff (a) the record this process last read or wrote is the very one
    its own last acquire-or-renew write produced (same resourceVersion, naming it as holder) and (b) that
    write happened less than ``renew_deadline`` ago. Any other candidate waits ``lease_duration`` (longer
    than ``renew_deadline``) after the last change it saw before writing, and a read showing a record this
    process did not write ends (a) at once; so two processes never both believe they lead, beyond the
    one ``retry_period`` a leader needs to read what another wrote (given clocks that advance at a
    similar rate). ``on_change`` is called on every flip.
    """

    def __init__(
        self,
        store: LeaseStore,
        identity: str,
        *,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not retry_period < renew_deadline < lease_duration:
            raise ValueError("need retry_period < renew_deadline < lease_duration")
        self._store, self.identity = store, identity
        self.lease_duration, self.renew_deadline = lease_duration, renew_deadline
        self.retry_period = retry_period
        self._on_change = on_change
        self._clock = clock
        self._renewed_at = -1e18  # when this process last acquired or renewed the Lease (its own clock)
        self._written_version: str | None = None  # the resourceVersion that write produced
        self._observed: LeaseRecord | None = None  # the record last read or written
        self._observed_at = 0.0  # when the observed record last changed, by this process's clock
        self._leader = False
        self.transitions_seen = 0
        self.errors = 0

    @property
    def holds(self) -> bool:
        """The record last read or written is this process's own write naming it as holder."""
        seen = self._observed
        return (seen is not None and seen.holder == self.identity
                and self._written_version is not None and seen.resource_version == self._written_version)

    @property
    def is_leader(self) -> bool:
        return self._leader and self.holds and self._clock() - self._renewed_at < self.renew_deadline

    async def run(self) -> None:
        """Campaign and renew until cancelled; on cancellation, give the Lease up if held."""
        try:
            while True:
                await self.step()
                await asyncio.sleep(self.retry_period)
        finally:
            if self._leader:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._release())
            self._set(False)

    async def step(self) -> bool:
        """One round: read the Lease, then acquire or renew it if this process may; returns whether it
        leads now."""
        try:
            await self._try_acquire_or_renew()
        except LeaseConflict:
            # Someone wrote between our read and our write: whatever the Lease says now, it is not ours.
            self._written_version = None
        except Exception as exc:  # an unreachable server must not end the campaign
            self.errors += 1
            log.warning("leader election: %s: %s", type(exc).__name__, exc)
        self._set(self.holds and self._clock() - self._renewed_at < self.renew_deadline)
        return self._leader

    def _set(self, leader: bool) -> None:
        if leader != self._leader:
            self._leader = leader
            log.info("leader election: %s %s", self.identity, "leads" if leader else "does not lead")
            if self._on_change is not None:
                self._on_change(leader)

    async def _try_acquire_or_renew(self) -> None:
        now, wall = self._clock(), datetime.now(UTC)
        record = await self._store.get()
        if record is None:
            self._wrote(await self._store.create(created(self.identity, int(self.lease_duration), wall)), now)
            self.transitions_seen += 1
            return
        self._observe(record, now)  # a record we did not write ends our leadership here, before any write
        renewing = self.holds
        # The candidate's own --lease-duration decides (client-go's rule), never the record's: a forged or
        # misconfigured leaseDurationSeconds cannot stop leader-only work for longer than that.
        if not renewing and record.holder and now - self._observed_at < self.lease_duration:
            return
        # Renewing keeps the record's acquisition and transitions; anything else is an acquisition, which
        # counts one more transition (client-go's leaseTransitions), even over an emptied Lease.
        duration = int(self.lease_duration)
        new = renewed(record, duration, wall) if renewing else acquired(record, self.identity, duration, wall)
        self._wrote(await self._store.update(new), now)
        self.transitions_seen += not renewing

    def _observe(self, record: LeaseRecord, now: float) -> None:
        if self._observed is None or record.resource_version != self._observed.resource_version:
            self._observed_at = now
        self._observed = record

    def _wrote(self, record: LeaseRecord, now: float) -> None:
        self._observed, self._observed_at = record, now
        self._written_version, self._renewed_at = record.resource_version, now

    async def _release(self) -> None:
        record = await self._store.get()
        if record is not None and record.holder == self.identity and record.resource_version == self._written_version:
            await self._store.update(released(record, datetime.now(UTC)))
