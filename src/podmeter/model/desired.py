"""The desired filter: IP -> the pods that hold it, with side effects only on crossings.

Reference counts are sets of pod UIDs, not integers, so a duplicate or a missed event cannot skew a
count: a pod holds an IP or it does not.
"""

from __future__ import annotations

from collections.abc import Iterator

from podmeter.model.compaction import PeakTracker


class DesiredFilter:
    """IPs that should be in the kernel filter, each with the UIDs of the observed pods holding it.

    Invariants:
    * an IP is a key of ``holders`` iff at least one UID holds it; no UID appears twice for one IP;
    * ``contributions[uid]`` is exactly the set of IPs whose holders contain ``uid`` (absent if none);
    * every 0->1 and 1->0 crossing of an IP puts it in ``dirty``; nothing else does;
    * iteration order of ``holders`` is the order in which IPs last became desired (the capacity rule,
      earliest first, relies on it).
    """

    def __init__(self) -> None:
        self.holders: dict[str, tuple[str, ...]] = {}
        self.contributions: dict[str, tuple[str, ...]] = {}
        self.dirty: dict[str, None] = {}  # ordered: crossing order
        self._holders_peak = PeakTracker()
        self._contrib_peak = PeakTracker()

    def __contains__(self, ip: object) -> bool:
        return ip in self.holders

    def __len__(self) -> int:
        return len(self.holders)

    def __iter__(self) -> Iterator[str]:
        return iter(self.holders)

    def set_contribution(self, uid: str, ips: tuple[str, ...]) -> None:
        """Make ``uid`` hold exactly ``ips`` (empty: hold nothing)."""
        old = self.contributions.get(uid, ())
        if old == ips:
            return
        for ip in old:
            if ip not in ips:
                self._release(ip, uid)
        for ip in ips:
            if ip not in old:
                self._acquire(ip, uid)
        if ips:
            self.contributions[uid] = ips
            self._contrib_peak.grew_to(len(self.contributions))
        else:
            del self.contributions[uid]
            if self._contrib_peak.should_rebuild(len(self.contributions)):
                self.contributions = dict(self.contributions)

    def take_dirty(self) -> list[str]:
        """The IPs that crossed since the last call, in crossing order; clears the dirty set."""
        dirty = list(self.dirty)
        self.dirty = {}
        return dirty

    def _acquire(self, ip: str, uid: str) -> None:
        current = self.holders.get(ip)
        if current is None:
            self.holders[ip] = (uid,)
            self._holders_peak.grew_to(len(self.holders))
            self.dirty[ip] = None
        elif uid not in current:
            self.holders[ip] = (*current, uid)

    def _release(self, ip: str, uid: str) -> None:
        current = self.holders.get(ip, ())
        remaining = tuple(u for u in current if u != uid)
        if remaining:
            self.holders[ip] = remaining
            return
        self.holders.pop(ip, None)
        self.dirty[ip] = None
        if self._holders_peak.should_rebuild(len(self.holders)):
            self.holders = dict(self.holders)
