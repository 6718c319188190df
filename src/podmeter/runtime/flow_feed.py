"""The agent's flow feed: the ring of recent flow records, and the readers that follow it.

The writer task publishes each drain's records (:meth:`FlowFeed.publish`); each follower has a bounded
queue of its own, filled with the records its filter wants. A follower that does not keep up (its queue
is full) is cut off and counted, so a reader that stops reading can never grow the agent's memory: what
the feed holds is bounded by the ring plus ``followers * queue_size`` records.

Next stage: ``adapters.flow_http`` streams a follower's records as NDJSON.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from podmeter.model.flow_records import FlowFilter, FlowRecord, FlowRing

log = logging.getLogger("podmeter.flows")

FOLLOWER_QUEUE = 4096  # records a follower may lag behind before it is cut off
MAX_FOLLOWERS = 64


class TooManyFollowers(Exception):
    """Every follower slot is taken."""


@dataclass(eq=False)
class Follower:
    """One reader's queue of new records (None at its end: it was cut off)."""

    wanted: FlowFilter
    queue: asyncio.Queue[FlowRecord | None] = field(default_factory=lambda: asyncio.Queue(FOLLOWER_QUEUE))
    cut_off: bool = False


class FlowFeed:
    """Recent records (:class:`FlowRing`) and the followers of new ones.

    Invariant: a follower receives, in order, every record published after it subscribed that its
    filter wants, unless it was cut off for lagging (then its stream ends and ``slow_followers`` counts
    it). ``published`` counts every record ever published.
    """

    def __init__(self, capacity: int, max_followers: int = MAX_FOLLOWERS) -> None:
        self.ring = FlowRing(capacity)
        self.max_followers = max_followers
        self.published = 0
        self.slow_followers = 0
        self._followers: list[Follower] = []

    @property
    def followers(self) -> int:
        return len(self._followers)

    def can_follow(self) -> bool:
        return len(self._followers) < self.max_followers

    def last(self, count: int, wanted: FlowFilter) -> list[FlowRecord]:
        return self.ring.last(count, wanted)

    def publish(self, records: list[FlowRecord]) -> None:
        self.ring.extend(records)
        self.published += len(records)
        for follower in list(self._followers):
            self._offer(follower, records)

    def _offer(self, follower: Follower, records: list[FlowRecord]) -> None:
        for record in records:
            if not follower.wanted.matches(record):
                continue
            if follower.queue.full():
                self._cut_off(follower)
                return
            follower.queue.put_nowait(record)

    def _cut_off(self, follower: Follower) -> None:
        follower.cut_off = True
        self.slow_followers += 1
        self._followers.remove(follower)
        while not follower.queue.empty():  # free what it held, then tell it the stream is over
            follower.queue.get_nowait()
        follower.queue.put_nowait(None)
        log.warning("a flow reader fell %d records behind and was cut off", FOLLOWER_QUEUE)

    def subscribe(self, wanted: FlowFilter) -> Follower:
        r"""A new follower of the records ``wanted`` matches; its queue ends with None if it is cut off.
        Every follower must be :meth:`unsubscribe`\ d when its reader goes."""
        if not self.can_follow():
            raise TooManyFollowers(f"{self.max_followers} readers already follow the flows")
        follower = Follower(wanted)
        self._followers.append(follower)
        return follower

    def unsubscribe(self, follower: Follower) -> None:
        if follower in self._followers:
            self._followers.remove(follower)
