"""The protocol every identity backend implements, and its errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from podmeter.model.identity import IdentityError, IdentityKey


class IdentityBackendError(IdentityError):
    """The backend could not complete an operation now (store unreachable, too much contention).

    The operator counts it and retries on its next sweep; nothing is lost.
    """


class IdentityBackend(Protocol):
    """Allocates one numeric ID per identity key and holds this operator's references to them.

    Contract: ``acquire`` is idempotent per key (one reference per key per operator, however often it is
    called); two keys never share an ID and a key never has two IDs, across every operator using one
    store; ``release`` drops this operator's reference (the ID itself may stay allocated until ``gc``);
    ``held()`` is exactly the keys acquired and not released since, with their IDs.
    """

    name: str

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def acquire(self, key: IdentityKey) -> int:
        """The ID of ``key``, allocating it if needed; raises IdentityExhausted or IdentityBackendError."""
        ...

    async def release(self, key: IdentityKey) -> None:
        """Drop this operator's reference to ``key`` (no-op if it holds none)."""
        ...

    def held(self) -> Mapping[IdentityKey, int]: ...

    def store_corrupt(self) -> Mapping[str, int]:
        """Corrupt store entries found so far, by kind (counted once per entry; never used)."""
        ...

    async def identities(self) -> dict[int, IdentityKey]:
        """Every ID allocated in the store (all operators), with its key."""
        ...

    async def gc(self) -> int:
        """Remove allocated IDs that no operator references; the number removed. Leader only."""
        ...
