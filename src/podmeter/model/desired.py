"""The desired filter: IP -> the pods that hold it, with side effects only on crossings.

Reference counts are sets of pod UIDs, not integers, so a duplicate or a missed event cannot skew a
count: a pod holds an IP or it does not.
"""

from __future__ import annotations

from collections.abc import Iterator

from podmeter.model.compaction import PeakTracker

Holders = str | tuple[str, ...]  # one UID (the common case, no tuple allocated) or several


def holder_uids(holders: Holders) -> tuple[str, ...]:
    return (holders,) if isinstance(holders, str) else holders


class DesiredFilter:
    """IPs that should be in the kernel filter, each with the UIDs of the observed pods holding it.

    Invariants:
    * an IP is a key of ``holders`` iff at least one UID holds it; no UID appears twice for one IP;
      a single holder is stored as the bare UID string (most IPs have one owner: no tuple per IP);
    * every 0->1 and 1->0 crossing of an IP puts it in ``dirty``; nothing else does;
    * iteration order of ``holders`` is the order in which IPs last became desired (the capacity rule,
      earliest first, relies on it).
    The caller (the view) says which IPs a UID held before and holds now; the filter keeps no per-UID
    record of its own, which is what keeps it small.
    """

    def __init__(self, track_moves: bool = False) -> None:
        self.holders: dict[str, Holders] = {}
        self.dirty: dict[str, None] = {}  # ordered: crossing order
        # IPs whose holders changed at all (not only crossings), for traffic attribution; kept only when
        # someone consumes them with take_moved(), else it would grow without bound.
        self.moved: dict[str, None] | None = {} if track_moves else None
        self._holders_peak = PeakTracker()

    def __contains__(self, ip: object) -> bool:
        return ip in self.holders

    def __len__(self) -> int:
        return len(self.holders)

    def __iter__(self) -> Iterator[str]:
        return iter(self.holders)

    def uids(self, ip: str) -> tuple[str, ...]:
        holders = self.holders.get(ip)
        return () if holders is None else holder_uids(holders)

    def move(self, uid: str, old: tuple[str, ...], new: tuple[str, ...]) -> None:
        """``uid`` held ``old`` and now holds ``new`` (either may be empty)."""
        if old == new:
            return
        for ip in old:
            if ip not in new:
                self._release(ip, uid)
        for ip in new:
            if ip not in old:
                self._acquire(ip, uid)

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

    def _acquire(self, ip: str, uid: str) -> None:
        if self.moved is not None:
            self.moved[ip] = None
        current = self.holders.get(ip)
        if current is None:
            self.holders[ip] = uid
            self._holders_peak.grew_to(len(self.holders))
            self.dirty[ip] = None
            return
        uids = holder_uids(current)
        if uid not in uids:
            self.holders[ip] = (*uids, uid)

    def _release(self, ip: str, uid: str) -> None:
        if self.moved is not None:
            self.moved[ip] = None
        remaining = tuple(u for u in self.uids(ip) if u != uid)
        if remaining:
            self.holders[ip] = remaining[0] if len(remaining) == 1 else remaining
            return
        self.holders.pop(ip, None)
        self.dirty[ip] = None
        if self._holders_peak.should_rebuild(len(self.holders)):
            self.holders = dict(self.holders)
