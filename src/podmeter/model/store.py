"""A store of one collection, mirroring the API server: the level every derived state is computed from.

client-go's ``tools/cache`` store, for slim records: a reflector's deltas go in (:meth:`Store.apply`), the
changes they made come out, as ``(old, new)`` pairs (``None`` on the side where the object did not
exist). The relist diff (:class:`~podmeter.model.deltas.Replace`) is written here once, for the agent's
view and the operator's pod store alike.

Next stage: the owner of the store derives its state from the changes (``model.view`` for the agent's
desired filter, ``runtime.operator`` for identity references).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from podmeter.model.compaction import PeakTracker
from podmeter.model.deltas import Collection, Delete, Delta, Replace, Upsert

R = TypeVar("R")

# One change: the object before and after (None where it did not exist).
Change = tuple[R | None, R | None]


class Store(Generic[R]):
    """The objects of one collection by key.

    Invariants:
    * ``objects`` is exactly the state after the deltas applied so far: an upsert stores, a delete
      removes, a relist makes it the listed objects, except keys under ``Replace.keep`` (listed but not
      decodable), which keep their last good state;
    * a change is reported only when something changed: an identical upsert, a delete of an unknown key
      and an unchanged object in a relist report nothing;
    * the table is rebuilt when deletes leave it far below its peak (``model.compaction``).
    """

    def __init__(self, collection: Collection[R]) -> None:
        self.collection = collection
        self.objects: dict[str, R] = {}
        self._peak = PeakTracker()

    def __len__(self) -> int:
        return len(self.objects)

    def __iter__(self) -> Iterator[R]:
        return iter(self.objects.values())

    def get(self, key: str) -> R | None:
        return self.objects.get(key)

    def apply(self, delta: Delta[R]) -> list[Change[R]]:
        """Apply one delta of this store's collection; the changes it made, in order."""
        if isinstance(delta, Upsert):
            change = self.upsert(delta.item)
            return [change] if change is not None else []
        if isinstance(delta, Delete):
            gone = self.delete(delta.key)
            return [gone] if gone is not None else []
        return self.replace(delta)

    def upsert(self, item: R) -> Change[R] | None:
        key = self.collection.key(item)
        old = self.objects.get(key)
        if old == item:
            return None
        self.objects[key] = item
        self._peak.grew_to(len(self.objects))
        return old, item

    def delete(self, key: str) -> Change[R] | None:
        old = self.objects.pop(key, None)
        if old is None:
            return None
        if self._peak.should_rebuild(len(self.objects)):
            self.objects = dict(self.objects)
        return old, None

    def replace(self, delta: Replace[R]) -> list[Change[R]]:
        """A relist as a diff: deletes for what vanished (unless kept), then upserts for the listed."""
        key = self.collection.key
        listed = {key(item): item for item in delta.items}
        vanished = [k for k in self.objects if k not in listed and k not in delta.keep]
        changes = [change for k in vanished if (change := self.delete(k)) is not None]
        changes.extend(change for item in listed.values() if (change := self.upsert(item)) is not None)
        return changes
