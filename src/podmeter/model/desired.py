"""The desired filter: IP -> the observed pods that hold it, with side effects only on crossings.

Next stage: the writer (``runtime.writer``) takes the IPs that crossed (:meth:`DesiredFilter.take_dirty`)
and makes the kernel filter agree.
"""

from __future__ import annotations

from collections.abc import Iterator, KeysView

from podmeter.model.refs import Refs


class DesiredFilter:
    """IPs that should be in the kernel filter, each with the UIDs of the observed pods holding it.

    Invariants:
    * an IP is desired iff at least one UID holds it (:class:`~podmeter.model.refs.Refs`);
    * every 0->1 and 1->0 crossing of an IP puts it in ``dirty``; nothing else does;
    * iteration order is the order in which IPs last became desired (the capacity rule, earliest first,
      relies on it).
    The caller (the view) says which IPs a UID held before and holds now; the filter keeps no per-UID
    record of its own, which is what keeps it small.
    """

    def __init__(self, track_moves: bool = False) -> None:
        self.refs: Refs[str] = Refs()
        self.dirty: dict[str, None] = {}  # ordered: crossing order
        # IPs whose holders changed at all (not only crossings), for traffic attribution; kept only when
        # someone consumes them with take_moved(), else it would grow without bound.
        self.moved: dict[str, None] | None = {} if track_moves else None

    def __contains__(self, ip: object) -> bool:
        return ip in self.refs

    def ips(self) -> KeysView[str]:
        """The desired IPs as a live view: for scans, where ``in`` on the view costs no Python call."""
        return self.refs.keys()

    def __len__(self) -> int:
        return len(self.refs)

    def __iter__(self) -> Iterator[str]:
        return iter(self.refs)

    def uids(self, ip: str) -> tuple[str, ...]:
        return self.refs.holders(ip)

    def move(self, uid: str, old: tuple[str, ...], new: tuple[str, ...]) -> None:
        """``uid`` held ``old`` and now holds ``new`` (either may be empty)."""
        if old == new:
            return
        moved = self.moved
        for ip in old:
            if ip not in new:
                if self.refs.discard(ip, uid):
                    self.dirty[ip] = None
                if moved is not None:
                    moved[ip] = None
        for ip in new:
            if ip not in old:
                if self.refs.add(ip, uid):
                    self.dirty[ip] = None
                if moved is not None:
                    moved[ip] = None

    def take_dirty(self) -> list[str]:
        """The IPs that crossed since the last call, in crossing order; clears the dirty set."""
        dirty = list(self.dirty)
        self.dirty = {}
        return dirty

    def take_moved(self) -> list[str]:
        """IPs whose holders changed since the last call (empty unless tracking moves)."""
        if not self.moved:
            return []
        moved = list(self.moved)
        self.moved = {}
        return moved
