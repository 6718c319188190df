"""Reference counting by holder: the one place podmeter decides that a key crossed 0→1 or 1→0.

A key (an IP of the desired filter, an identity's label set) is held by pods, named by UID. The count is
the *set* of holders, not an integer, so a duplicate or a missed event cannot skew it: a pod holds a key or
it does not. Callers act only on crossings: an IP is written to the kernel when its first holder comes and
removed when its last goes; an identity is acquired and released the same way.

Next stage: the owners of a :class:`Refs` turn crossings into work (``model.desired``: dirty IPs for the
writer; ``model.identity``: dirty keys for the identity reconciler).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, KeysView
from typing import Generic, TypeVar

from podmeter.model.compaction import PeakTracker

K = TypeVar("K", bound=Hashable)

# One holder (the common case) is stored bare; several in an insertion-ordered dict used as a set.
_Held = str | dict[str, None]


class Refs(Generic[K]):
    """Keys and the holders that hold them.

    Invariants:
    * a key is present iff at least one holder holds it; a holder holds a given key at most once;
    * :meth:`add` returns True exactly when a key goes 0→1, :meth:`discard` exactly when it goes 1→0;
    * holders of a key are in the order they took it (the last one is the newest holder);
    * keys iterate in the order they last crossed 0→1;
    * the table is rebuilt when it shrinks far below its peak (``model.compaction``).
    """

    __slots__ = ("_held", "_peak")

    def __init__(self) -> None:
        self._held: dict[K, _Held] = {}
        self._peak = PeakTracker()

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[K]:
        return iter(self._held)

    def keys(self) -> KeysView[K]:
        """The held keys, as a live view (set operations and ``in`` at C speed, for scans)."""
        return self._held.keys()

    def holders(self, key: K) -> tuple[str, ...]:
        held = self._held.get(key)
        if held is None:
            return ()
        return (held,) if isinstance(held, str) else tuple(held)

    def count(self, key: K) -> int:
        held = self._held.get(key)
        if held is None:
            return 0
        return 1 if isinstance(held, str) else len(held)

    def add(self, key: K, holder: str) -> bool:
        """``holder`` holds ``key``; True iff the key had no holder before (0→1)."""
        held = self._held.get(key)
        if held is None:
            self._held[key] = holder
            self._peak.grew_to(len(self._held))
            return True
        if isinstance(held, str):
            if held != holder:
                self._held[key] = {held: None, holder: None}
        else:
            held[holder] = None
        return False

    def discard(self, key: K, holder: str) -> bool:
        """``holder`` no longer holds ``key``; True iff that was its last holder (1→0)."""
        held = self._held.get(key)
        if held is None:
            return False
        if isinstance(held, str):
            if held != holder:
                return False
            del self._held[key]
            if self._peak.should_rebuild(len(self._held)):
                self._held = dict(self._held)
            return True
        held.pop(holder, None)
        if len(held) == 1:
            self._held[key] = next(iter(held))
        return False
