"""What a reflector tells the writer. Deltas carry slim records, never full objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Replace:
    """A (re)list: the collection is exactly ``items``, except objects under ``keep`` that failed to decode
    (their last good state must stay, so they are neither replaced nor deleted)."""

    resource: str
    items: list[Any]
    keep: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True, slots=True)
class Upsert:
    resource: str
    item: Any


@dataclass(frozen=True, slots=True)
class Delete:
    """The object with ``key`` is gone (``item`` is its last state when it could be decoded)."""

    resource: str
    key: str
    item: Any = None


Delta = Replace | Upsert | Delete
