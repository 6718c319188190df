"""Giving memory back: CPython dicts and sets never shrink when entries are deleted.

After a burst (10,000 pods, then 10) a dict keeps the table it needed at its peak. A
:class:`PeakTracker` remembers the peak size of one container and says when the container has become much
smaller than it; the owner then rebuilds it (``dict(d)``), which allocates a table sized for what is left.
The rebuild costs O(len) and happens only after the container shrank by ``factor`` (or emptied), so it is
amortised O(1) per deletion. This is the one shrink rule of podmeter: every store, reference table and
ledger uses it (failure mode F14 in docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_PEAK = 1024  # below this, a table is a few tens of KiB at most: not worth rebuilding unless empty
EMPTY_PEAK = 8  # an emptied container that once held more than this is rebuilt (that costs nothing)


@dataclass(slots=True)
class PeakTracker:
    """Invariant: ``peak`` >= the container's size at every moment since the last rebuild."""

    peak: int = 0
    factor: int = 4

    def grew_to(self, size: int) -> None:
        if size > self.peak:  # noqa: PLR1730 (not max(): it runs on every insert, and a call costs)
            self.peak = size

    def should_rebuild(self, size: int) -> bool:
        """True once when ``size`` fell far below the peak; the caller rebuilds and the peak resets."""
        if (self.peak >= MIN_PEAK and size * self.factor < self.peak) or (size == 0 and self.peak > EMPTY_PEAK):
            self.peak = size
            return True
        return False
