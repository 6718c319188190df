"""The ``memory`` identity backend: one operator, IDs in a process-local pool."""

from __future__ import annotations

from collections.abc import Mapping

from podmeter.model.compaction import PeakTracker
from podmeter.model.identity import DEFAULT_FIRST_ID, DEFAULT_LAST_ID, IdentityKey, IdPool


class MemoryIdentityBackend:
    """IDs for one operator process, freed as soon as their key is released.

    Invariants: a key is in ``held()`` iff it was acquired and not released since; an ID is in use in
    the pool iff some held key maps to it; so released IDs are reused lowest first, and after every key
    is released the pool and the dict are back to their empty state.
    """

    name = "memory"

    def __init__(self, first: int = DEFAULT_FIRST_ID, last: int = DEFAULT_LAST_ID) -> None:
        self._pool = IdPool(first, last)
        self._ids: dict[IdentityKey, int] = {}
        self._peak = PeakTracker()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def acquire(self, key: IdentityKey) -> int:
        ident = self._ids.get(key)
        if ident is None:
            ident = self._ids[key] = self._pool.take()
            self._peak.grew_to(len(self._ids))
        return ident

    async def release(self, key: IdentityKey) -> None:
        ident = self._ids.pop(key, None)
        if ident is None:
            return
        self._pool.release(ident)
        if self._peak.should_rebuild(len(self._ids)):
            self._ids = dict(self._ids)

    def held(self) -> Mapping[IdentityKey, int]:
        return self._ids

    def store_corrupt(self) -> Mapping[str, int]:
        return {}  # nothing is read back: there is nothing to find corrupt

    async def identities(self) -> dict[int, IdentityKey]:
        return {ident: key for key, ident in self._ids.items()}

    async def gc(self) -> int:
        return 0  # released IDs are freed at once: there is never anything to collect
