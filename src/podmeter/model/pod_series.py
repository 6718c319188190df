"""The lifecycle of per-pod series, written once for every ledger that keeps them.

The traffic ledger (``model.traffic``) and the drop ledger (``model.drops``) both keep one series per pod
(by UID) with the same life: a series exists while its pod holds an observed IP, then ``grace`` seconds
more (so the last scrape sees the final value), then it is gone; a pod observed again starts a new series
from zero (failure mode F20 in docs/design.md). :class:`SeriesBook` is that life; each ledger says what a
new series is and what to keep of one that goes (the traffic ledger moves its totals to the node's).

Pure and synchronous, like the ledgers that use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from podmeter.model.compaction import PeakTracker
from podmeter.model.records import Pod


class Lived(Protocol):
    """What the book needs of a series: whose it is, the IPs it holds, and since when it holds none."""

    uid: str
    ips: set[str]
    ended_at: float | None


S = TypeVar("S", bound=Lived)


def _keep_nothing(series: object) -> None:
    return None


class SeriesBook(Generic[S]):
    """The live and ending series of one ledger, by pod UID.

    Invariants:
    * a series' ``ended_at`` is None iff its ``ips`` is not empty (it ended when it lost its last IP);
    * a series is in ``series`` iff its pod holds an IP, or lost its last one less than ``grace`` ago
      (once :meth:`expire` ran);
    * the table is rebuilt when it shrinks far below its peak (``model.compaction``).
    """

    __slots__ = ("_gone", "_new", "_peak", "grace", "series")

    def __init__(self, grace: float, new: Callable[[Pod], S], gone: Callable[[S], None] = _keep_nothing) -> None:
        """``new(pod)``: a series from zero; ``gone(series)``: called before a series is dropped."""
        self.grace = grace
        self.series: dict[str, S] = {}
        self._new = new
        self._gone = gone
        self._peak = PeakTracker()

    def holds(self, pod: Pod, ip: str) -> S:
        """``pod`` holds ``ip`` from now on; its series (a new one if the last one had ended)."""
        series = self.series.get(pod.uid)
        if series is not None and series.ended_at is not None:
            self._drop(series)  # observed again: a new series that starts from zero
            series = None
        if series is None:
            series = self._new(pod)
            self.series[pod.uid] = series
            self._peak.grew_to(len(self.series))
        series.ended_at = None
        series.ips.add(ip)
        return series

    def lets_go(self, uid: str, ip: str, now: float) -> S | None:
        """The pod ``uid`` no longer holds ``ip``; its series (ended if that was its last IP), if any."""
        series = self.series.get(uid)
        if series is None:
            return None
        series.ips.discard(ip)
        if not series.ips:
            series.ended_at = now
        return series

    def expire(self, now: float) -> int:
        """Drop series whose grace is over; returns how many."""
        done = [s for s in self.series.values() if s.ended_at is not None and now - s.ended_at >= self.grace]
        for series in done:
            self._drop(series)
        if done and self._peak.should_rebuild(len(self.series)):
            self.series = dict(self.series)
        return len(done)

    def _drop(self, series: S) -> None:
        self._gone(series)
        del self.series[series.uid]
