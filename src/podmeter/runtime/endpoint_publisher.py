"""The operator's leader publishes the cluster's endpoints as ``PodSlice`` objects.

Level-triggered: each sync computes the desired slices from the pod store and the identities
(``model.endpoint_slices.desired_slices``), compares each one's digest with the slices the API server holds
(read back by a reflector into a store of digests, updated at once after each of our own writes), and
writes only what differs: creates, replaces, and deletes of slices nobody wants (deleted pods, reused IPs,
a bucket count that changed, slices a dead leader left). A sync runs at most every ``interval`` seconds
and writes at most ``max_writes`` slices, so a burst of pod changes is coalesced into one write per
changed slice and the API server sees a bounded write rate; what is left is written by the next sync.

Next stage: every agent's reflector reads the slices into its endpoint cache (``model.endpoint_slices``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from podmeter.adapters.kube.connection import Connection
from podmeter.adapters.kube.reflector import Reflector, ReflectorSettings
from podmeter.adapters.kube.resources import SLICE_DIGESTS
from podmeter.adapters.kube.slices import SliceConflict
from podmeter.model.deltas import Delta, Replace
from podmeter.model.endpoint_slices import IdentityOf, SliceDigest, desired_slices, spec_digest
from podmeter.model.records import Pod
from podmeter.model.store import Store

log = logging.getLogger("podmeter.publisher")


class SliceApi(Protocol):
    async def create(self, name: str, spec: dict[str, Any]) -> str: ...

    async def replace(self, name: str, resource_version: str, spec: dict[str, Any]) -> str: ...

    async def delete(self, name: str) -> None: ...


@dataclass
class PublishStats:
    """Counters exported as metrics; they only grow."""

    syncs: int = 0
    writes: Counter[str] = field(default_factory=Counter)  # create | replace | delete
    conflicts: int = 0
    errors: int = 0


@dataclass(frozen=True, slots=True)
class LastSync:
    """What the last sync found, replaced whole by each sync (exported as gauges, read at scrape time)."""

    endpoints: int = 0  # endpoints in the desired set
    slices: int = 0  # slices in the desired set
    pending: int = 0  # writes it left to the next sync (``max_writes``)


class EndpointPublisher:
    """Keeps the API server's slices equal to the desired slices (leader only: see the operator).

    Invariant: after a sync that left nothing pending and met no error, the digests of the slices in
    ``actual`` are exactly the digests of the desired slices, and no other slice exists in ``actual``.
    """

    def __init__(self, api: SliceApi, *, interval: float = 0.5, max_writes: int = 100) -> None:
        self.api = api
        self.interval = interval
        self.max_writes = max_writes
        self.actual: Store[SliceDigest] = Store(SLICE_DIGESTS.collection)
        self.synced = asyncio.Event()  # the slices were listed once: actual is known
        self.stats = PublishStats()
        self.last = LastSync()
        self.reflector: Reflector[SliceDigest] | None = None

    def apply(self, delta: Delta[SliceDigest]) -> None:
        self.actual.apply(delta)
        if isinstance(delta, Replace):
            self.synced.set()

    async def watch(self, connection: Connection, settings: ReflectorSettings | None = None) -> None:
        """Read the slices back, until cancelled (the reflector applies its deltas to ``actual``)."""
        transport = connection.transport()

        async def sink(delta: Delta[SliceDigest]) -> None:
            self.apply(delta)

        self.reflector = Reflector(SLICE_DIGESTS, transport, sink, settings)
        try:
            await self.reflector.run()
        finally:
            with contextlib.suppress(Exception):
                await transport.close()

    async def sync(self, pods: Iterable[Pod], identity_of: IdentityOf) -> int:
        """One sync; returns how many writes it made. Needs the slices listed once (else it does nothing)."""
        if not self.synced.is_set():
            return 0
        self.stats.syncs += 1
        desired = desired_slices(pods, identity_of, len(self.actual))
        todo = self._differences(desired)
        self.last = LastSync(endpoints=sum(len(spec["endpoints"]) for spec in desired.values()),
                             slices=len(desired), pending=max(0, len(todo) - self.max_writes))
        writes = 0
        for name, spec in todo[: self.max_writes]:
            writes += await self._write(name, spec)
        return writes

    def _differences(self, desired: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any] | None]]:
        """Writes that make ``actual`` the desired slices: creates and replaces first (so agents never
        miss an endpoint that moves between slices), deletes last."""
        actual = self.actual.objects
        upserts: list[tuple[str, dict[str, Any] | None]] = [
            (name, spec) for name, spec in sorted(desired.items())
            if name not in actual or actual[name].digest != spec_digest(spec)]
        deletes: list[tuple[str, dict[str, Any] | None]] = [(name, None) for name in sorted(actual)
                                                              if name not in desired]
        return upserts + deletes

    async def _write(self, name: str, spec: dict[str, Any] | None) -> int:
        current = self.actual.get(name)
        try:
            if spec is None:
                await self.api.delete(name)
                self.actual.delete(name)
                self.stats.writes["delete"] += 1
            elif current is None:
                version = await self.api.create(name, spec)
                self.actual.upsert(SliceDigest(name, version, spec_digest(spec)))
                self.stats.writes["create"] += 1
            else:
                version = await self.api.replace(name, current.resource_version, spec)
                self.actual.upsert(SliceDigest(name, version, spec_digest(spec)))
                self.stats.writes["replace"] += 1
        except SliceConflict as exc:
            # Someone else wrote it (another leader's last write, a user): the reflector brings the
            # current version; the next sync decides again from there.
            self.stats.conflicts += 1
            log.info("slice %s changed under us (%s); the next sync retries", name, exc)
            return 0
        except Exception as exc:  # the API server may be unreachable; the next sync retries
            self.stats.errors += 1
            log.warning("slice %s: %s: %s (the next sync retries)", name, type(exc).__name__, exc)
            return 0
        return 1

    def due(self, last: float | None) -> bool:
        return last is None or time.monotonic() - last >= self.interval
