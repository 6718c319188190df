"""Giving memory back: CPython dicts and sets never shrink when entries are deleted.

After a burst (10,000 pods, then 10) a dict keeps the table it needed at its peak. A
:class:`PeakTracker` remembers the peak size of one container and says when the container has become much
smaller than it; the owner then rebuilds it (``dict(d)``), which allocates a table sized for what is left.
The rebuild costs O(len) and happens only after the container shrank by ``factor``, so it is amortised
O(1) per deletion.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_PEAK = 2048  # below this, a table is a few tens of KiB at most: not worth rebuilding


@dataclass(slots=True)
class PeakTracker:
    """Invariant: ``peak`` >= the container's size at every moment since the last rebuild."""

    peak: int = 0
    factor: int = 4

    def grew_to(self, size: int) -> None:
        self.peak = max(self.peak, size)

    def should_rebuild(self, size: int) -> bool:
        """True once when ``size`` fell below peak/factor; the caller rebuilds and the peak resets."""
        if self.peak >= MIN_PEAK and size * self.factor < self.peak:
            self.peak = size
            return True
        return False
