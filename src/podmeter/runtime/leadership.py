"""Leader election on a ``coordination.k8s.io/v1`` Lease, with client-go's semantics.

Every candidate reads the Lease each ``retry_period``. The holder renews it (an update with the
resourceVersion it read, so two writers can never both win). A candidate takes over only when the record
has not changed for ``lease_duration`` *as measured by its own clock* since it last saw it change: clocks
of different machines are never compared. A leader that cannot renew for ``renew_deadline`` (shorter than
the lease duration) steps down before anyone else may take over. On a clean exit the holder empties the
Lease so that a successor need not wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Protocol

from podmeter.model.lease import LeaseConflict, LeaseRecord

log = logging.getLogger(__name__)


class LeaseStore(Protocol):
    """One Lease object. ``update`` and ``create`` raise LeaseConflict on a lost race."""

    async def get(self) -> LeaseRecord | None: ...

    async def create(self, record: LeaseRecord) -> LeaseRecord: ...

    async def update(self, record: LeaseRecord) -> LeaseRecord: ...


class LeaderElector:
    """Decides whether this process leads.

    Invariant: ``is_leader`` is True iff this process's last successful write of the Lease (naming it
    as holder) happened less than ``renew_deadline`` ago; since ``renew_deadline < lease_duration`` and
    others wait ``lease_duration`` after the last change they saw, two processes never both believe they
    lead (given clocks that advance at a similar rate). ``on_change`` is called on every flip.
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
        self._last_renew = -1e18
        self._observed_version: str | None = None
        self._observed_at = 0.0
        self._leader = False
        self.transitions_seen = 0
        self.errors = 0

    @property
    def is_leader(self) -> bool:
        return self._leader and self._clock() - self._last_renew < self.renew_deadline

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
        """One round: try to acquire or renew; returns whether this process leads now."""
        try:
            if await self._try_acquire_or_renew():
                self._last_renew = self._clock()
        except LeaseConflict:
            pass
        except Exception as exc:  # an unreachable server must not end the campaign
            self.errors += 1
            log.warning("leader election: %s: %s", type(exc).__name__, exc)
        self._set(self._clock() - self._last_renew < self.renew_deadline)
        return self._leader

    def _set(self, leader: bool) -> None:
        if leader != self._leader:
            self._leader = leader
            log.info("leader election: %s %s", self.identity, "leads" if leader else "does not lead")
            if self._on_change is not None:
                self._on_change(leader)

    async def _try_acquire_or_renew(self) -> bool:
        now, wall = self._clock(), datetime.now(UTC)
        record = await self._store.get()
        if record is None:
            mine = LeaseRecord(self.identity, int(self.lease_duration), wall, wall, 0)
            self._observe(await self._store.create(mine), now)
            return True
        if record.resource_version != self._observed_version:
            self._observe(record, now)
        held_by_other = record.holder not in ("", self.identity)
        # The candidate's own --lease-duration decides (client-go's rule), never the record's: a forged or
        # misconfigured leaseDurationSeconds cannot stop leader-only work for longer than that.
        if held_by_other and now - self._observed_at < self.lease_duration:
            return False
        taking = record.holder != self.identity
        new = replace(
            record,
            holder=self.identity,
            duration_s=int(self.lease_duration),
            renew_time=wall,
            acquire_time=wall if taking else record.acquire_time,
            transitions=record.transitions + (1 if taking and record.holder else 0),
        )
        self._observe(await self._store.update(new), now)
        self.transitions_seen += taking
        return True

    def _observe(self, record: LeaseRecord, now: float) -> None:
        self._observed_version, self._observed_at = record.resource_version, now

    async def _release(self) -> None:
        record = await self._store.get()
        if record is not None and record.holder == self.identity:
            await self._store.update(replace(record, holder="", renew_time=datetime.now(UTC)))
