"""A store of one collection, mirroring the API server: the level every derived state is computed from.

client-go's ``tools/cache`` store, for slim records: a reflector's deltas go in (:meth:`Store.apply`), the
changes they made come out, as calls ``changed(old, new)`` (``None`` on the side where the object did not
exist) or as a list of such pairs (:meth:`Store.changes`). The relist diff
(:class:`~podmeter.model.deltas.Replace`) is written here once, for the agent's view and the operator's
pod store alike.

Next stage: the owner of the store derives its state from the changes (``model.view`` for the agent's
desired filter, ``runtime.operator`` for identity references).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from podmeter.model.compaction import PeakTracker
from podmeter.model.deltas import Collection, Delete, Delta, Replace, Upsert

R = TypeVar("R")

# One change: the object before and after (None where it did not exist).
Change = tuple[R | None, R | None]
Changed = Callable[[R | None, R | None], None]


def _ignore(old: object, new: object) -> None:
    return None


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
        self._key = collection.key
        self._peak = PeakTracker()

    def __len__(self) -> int:
        return len(self.objects)

    def __iter__(self) -> Iterator[R]:
        return iter(self.objects.values())

    def get(self, key: str) -> R | None:
        return self.objects.get(key)

    def apply(self, delta: Delta[R], changed: Changed[R] = _ignore) -> int:
        """Apply one delta of this store's collection; ``changed(old, new)`` is called for each change it
        made, in order (the hot path: no list of changes is built); returns how many there were."""
        if isinstance(delta, Upsert):  # the hot path: every watch event
            return self.upsert(delta.item, changed)
        if isinstance(delta, Delete):
            return self.delete(delta.key, changed)
        return self.replace(delta, changed)

    def changes(self, delta: Delta[R]) -> list[Change[R]]:
        """:meth:`apply`, returning the changes as ``(old, new)`` pairs."""
        out: list[Change[R]] = []
        self.apply(delta, lambda old, new: out.append((old, new)))
        return out

    def upsert(self, item: R, changed: Changed[R] = _ignore) -> int:
        key = self._key(item)
        objects = self.objects
        old = objects.get(key)
        if old == item:
            return 0
        objects[key] = item
        self._peak.grew_to(len(objects))
        changed(old, item)
        return 1

    def delete(self, key: str, changed: Changed[R] = _ignore) -> int:
        old = self.objects.pop(key, None)
        if old is None:
            return 0
        if self._peak.should_rebuild(len(self.objects)):
            self.objects = dict(self.objects)
        changed(old, None)
        return 1

    def replace(self, delta: Replace[R], changed: Changed[R] = _ignore) -> int:
        """A relist as a diff: deletes for what vanished (unless kept), then upserts for the listed."""
        key = self._key
        listed = {key(item): item for item in delta.items}
        vanished = [k for k in self.objects if k not in listed and k not in delta.keep]
        count = sum(self.delete(k, changed) for k in vanished)
        return count + sum(self.upsert(item, changed) for item in listed.values())
