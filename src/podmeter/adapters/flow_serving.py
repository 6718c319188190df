"""The one core that serves the agent's flows to every reader: ``/debug/flows`` (``podmeter observe``) and
Hubble's ``GetFlows`` are two encodings of the same reads.

* **Readers are cursors on one ring.** The writer task publishes each drain's records into the ring
  (:meth:`FlowFeed.publish`: an append and a wake-up, never a filter). A reader remembers the number of
  the last record it looked at; its own task applies its filter, in slices that let the event loop run
  between them (at most :data:`SLICE_SECONDS` at a time), so no filter, however costly, delays the datapath
  writes, ``/readyz`` or another reader. Nothing is queued per reader: what the feed holds is the ring.
  A follower reads in batches (:meth:`Reader.follow_batches`), one write each, and a record's bytes are
  made once for every reader (:class:`Encoded`; an unfiltered follower's batch is joined once for all).
* **A reader that falls behind is told what it lost.** When the ring overwrote records before a follower
  read them, it gets a :class:`Gap` with their number (counted in ``lost``), then goes on from the oldest
  record still held; it is never cut off for one big drain.
* **Every open read counts against a bound**, following or not: :data:`MAX_STREAMS` in all,
  :data:`MAX_STREAMS_PER_CLIENT` from one client connection, :data:`MAX_FOLLOWERS` followers. When the
  followers' slots are all taken, a new follower takes the slot of the one that has been sent nothing for
  longest, if that is more than :data:`FOLLOWER_IDLE` (a follower whose filter matches nothing cannot lock
  everyone else out).
* **A client that does not read is cut off and its memory returned.** A write that does not complete
  within :data:`WRITE_TIMEOUT` ends the read (``cut_off``). Why a time and not a byte budget: what a read
  holds beyond the ring is the answer being written (references into the ring, at most the ring) and the
  transport's buffer, which HTTP/2's and TCP's flow control bound per stream; a reader that does not read
  holds it until it is cut off, so time bounds the memory and the stream caps bound the sum.

Next stage: ``adapters.flow_http`` (NDJSON) and ``adapters.hubble.server`` (gRPC) write what a
:class:`Reader` yields.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from podmeter.adapters.memory import give_back
from podmeter.model.flow_records import FlowRecord, FlowRing

log = logging.getLogger("podmeter.flows")

MAX_STREAMS = 256  # reads of the flows open at once, following or not
MAX_STREAMS_PER_CLIENT = 32  # of them over one client connection
MAX_FOLLOWERS = 64
WRITE_TIMEOUT = 30.0  # seconds a write may wait for its client to read before the read is cut off
FOLLOWER_IDLE = 60.0  # seconds without a record after which a follower yields its slot to a new one
CHECK_PERIOD = 1.0  # seconds between two checks of a read's writes and its client
SLICE_SECONDS = 0.002  # longest run of filter work before a reader lets the event loop run others
ABANDON_GRACE = 1.0  # seconds an end through a stuck stream may take before its handler is cancelled
GIVE_BACK_DELAY = 1.0  # seconds after a burst of reads ends before its memory is given back
SLICE_CHECK = 32  # records between two looks at the clock
SLICE_RECORDS = 512  # records of the past a reader filters before it lets the event loop run others
BATCH_RECORDS = 256  # records a follower is sent in one write at most (about 128 KiB of NDJSON)


class Selector(Protocol):
    """Which records a reader wants (``model.flow_records.FlowFilter``, ``adapters.hubble.filters``)."""

    def matches(self, record: FlowRecord) -> bool: ...


@dataclass(frozen=True)
class Gap:
    """``lost`` records a follower did not see: the ring overwrote them before it read them."""

    lost: int


class Encoded:
    """The bytes of recent records in one encoding, made once for every reader that sends them (a record
    followed by ten clients is encoded once). Bounded by ``size``, the oldest out; it keeps a record alive
    (so that its id is not reused while cached), so its size is at most the ring's.

    :meth:`lines` joins the bytes of a :class:`Batch`; a whole batch (every record of its numbers, what a
    follower without a filter reads) is joined once for every reader of those numbers too, so ten such
    followers cost one encoding and one join per record, and each a write per batch. At most ``size``
    records' worth of joined batches are kept (their numbers are unique in a feed: never reused)."""

    def __init__(self, encode: Callable[[FlowRecord], bytes], size: int) -> None:
        self.encode, self.size = encode, size
        # OrderedDicts: the oldest goes in O(1) (a dict's first key after many deletions is a scan)
        self._bytes: OrderedDict[int, tuple[FlowRecord, bytes]] = OrderedDict()
        self._joined: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._joined_records = 0

    def __call__(self, record: FlowRecord) -> bytes:
        found = self._bytes.get(id(record))
        if found is not None and found[0] is record:
            return found[1]
        data = self.encode(record)
        if len(self._bytes) >= self.size:
            self._bytes.popitem(last=False)
        self._bytes[id(record)] = (record, data)
        return data

    def lines(self, batch: Batch) -> bytes:
        """The bytes of the batch's records, one after the other."""
        if not batch.whole:
            return b"".join(map(self, batch.records))
        key = (batch.low, batch.high)
        found = self._joined.get(key)
        if found is None:
            found = self._joined[key] = b"".join(map(self, batch.records))
            self._joined_records += len(batch.records)
            while self._joined_records > self.size:
                (low, high), _ = self._joined.popitem(last=False)
                self._joined_records -= high - low + 1
        return found

    def __len__(self) -> int:
        return len(self._bytes)


@dataclass(frozen=True, slots=True)
class Batch:
    """What a follower reads next: the records numbered ``low`` to ``high`` that its selector wants, in
    order; ``whole`` when that is every one of them (a follower without a filter)."""

    low: int
    high: int
    records: list[FlowRecord]
    whole: bool


class Busy(Exception):
    """No slot for another read (the message says which bound, and what to do)."""


class Reader:
    """One read of the flows: its past records, then, following, the new ones as they come. Use it as an
    async context manager (its slot is held from :meth:`FlowFeed.open` until the end of the block).

    ``end`` is how the adapter ends its stream when the core cuts the read off (a reader that does not
    read, or a follower that yielded its slot); it is called once, from the watchdog if the handler is
    stuck in a write, else from :meth:`finish`. ``alive`` says whether the client is still there."""

    def __init__(self, feed: FlowFeed, selector: Selector, follow: bool, client: str, pinned: bool = False) -> None:
        self.feed, self.selector, self.following, self.client = feed, selector, follow, client
        self.pinned = pinned  # never yields its slot to a new follower (the agent's own: the flow export)
        self.cursor = feed.ring.last_seq  # the past is up to here, the followed records after it
        self.end: Callable[[str], Awaitable[None]] | None = None
        self.alive: Callable[[], bool] = lambda: True
        self.cut_off: str | None = None
        self.last_sent = time.monotonic()
        self._writing_since: float | None = None
        self._ended = False
        self._end_called = False
        self._wake = asyncio.Event()
        self._watchdog: asyncio.Task[None] | None = None
        self._task: asyncio.Task[object] | None = None

    async def __aenter__(self) -> Reader:
        self._task = asyncio.current_task()
        self._watchdog = asyncio.create_task(self._watch(), name="flow-reader-watchdog")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        self.feed._close(self)

    # --- the past

    async def history(self, count: int, first: bool = False) -> list[FlowRecord]:
        """The last ``count`` matching records up to the moment the read opened (the first ``count`` with
        ``first``), oldest first. Records the ring overwrote meanwhile are skipped."""
        ring = self.feed.ring
        if getattr(self.selector, "everything", False):
            held = ring.span(ring.first_seq, self.cursor)
            return held[:count] if first else held[max(0, len(held) - count):]
        return await (self._oldest(count) if first else self._newest(count))

    async def _newest(self, count: int) -> list[FlowRecord]:
        ring, high = self.feed.ring, self.cursor
        found: list[FlowRecord] = []
        while len(found) < count and high >= ring.first_seq:  # newest first, a slice at a time
            low = max(ring.first_seq, high - SLICE_RECORDS + 1)
            found.extend(r for r in reversed(ring.span(low, high)) if self.selector.matches(r))
            high = low - 1
            await asyncio.sleep(0)
        return found[:count][::-1]

    async def _oldest(self, count: int) -> list[FlowRecord]:
        ring, low = self.feed.ring, self.feed.ring.first_seq
        found: list[FlowRecord] = []
        while len(found) < count and low <= self.cursor:
            low = max(low, ring.first_seq)  # what the ring overwrote meanwhile is gone
            high = min(self.cursor, low + SLICE_RECORDS - 1)
            found.extend(r for r in ring.span(low, high) if self.selector.matches(r))
            low = high + 1
            await asyncio.sleep(0)
        return found[:count]

    # --- the new records

    async def follow(self) -> AsyncIterator[FlowRecord | Gap]:
        """Every matching record published after the read opened, in order, none twice, and a
        :class:`Gap` wherever the ring overwrote records before this reader read them; until the read is
        cut off (then ``cut_off`` says why). One record at a time: :meth:`follow_batches` is the same in
        batches, what the adapters send."""
        async with contextlib.aclosing(self.follow_batches(1)) as batches:
            async for item in batches:
                if isinstance(item, Gap):
                    yield item
                else:
                    for record in item.records:
                        yield record

    async def follow_batches(self, limit: int = BATCH_RECORDS) -> AsyncGenerator[Batch | Gap, None]:
        """What :meth:`follow` yields, as :class:`Batch`\\ es of what the ring holds beyond the cursor (at
        most ``limit`` numbers each, ending at multiples of ``limit``, so that followers at different
        cursors read the same batches after their first: ``Encoded.lines`` joins them once) and
        :class:`Gap`\\ s. A selector is applied :data:`SLICE_CHECK` records at a time, and the event
        loop runs others once a reader has worked :data:`SLICE_SECONDS`."""
        ring = self.feed.ring
        everything = bool(getattr(self.selector, "everything", False))
        matches = self.selector.matches
        started = time.perf_counter()
        while not self._ended:
            cursor, first, last = self.cursor, ring.first_seq, ring.last_seq
            if cursor + 1 < first:
                lost = first - cursor - 1
                self.cursor += lost
                self.feed.gaps += 1
                self.feed.lost += lost
                yield Gap(lost)
                continue
            if cursor >= last:
                self._wake.clear()
                await self._wake.wait()
                started = time.perf_counter()
                continue
            low, high = cursor + 1, min(last, (cursor // limit + 1) * limit)
            if everything:
                records = ring.span(cursor + 1, high)
            else:
                records = []
                while cursor < high and time.perf_counter() - started <= SLICE_SECONDS:
                    step = min(high, cursor + SLICE_CHECK)
                    records.extend(r for r in ring.span(cursor + 1, step) if matches(r))
                    cursor = step
                high = cursor
            self.cursor = high
            if records:
                self.last_sent = time.monotonic()
                yield Batch(low, high, records, everything)
            if time.perf_counter() - started > SLICE_SECONDS:
                await asyncio.sleep(0)
                started = time.perf_counter()

    # --- writes and the end

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around every write to the client: one that waits longer than the write timeout cuts it off."""
        self._writing_since = time.monotonic()
        try:
            yield
        finally:
            self._writing_since = None

    def woken(self) -> None:
        self._wake.set()

    def cut(self, reason: str) -> None:
        """End this read (it stops following at once); the stream is ended by the watchdog or :meth:`finish`."""
        if self.cut_off is None:
            self.cut_off = reason
        self._ended = True
        self._wake.set()

    async def finish(self) -> None:
        """End the stream the way the adapter does, if the read was cut off and nobody has yet."""
        if self.cut_off is None or self.end is None or self._end_called:
            return
        self._end_called = True
        with contextlib.suppress(Exception):
            await self.end(self.cut_off)

    async def _watch(self) -> None:
        timeout = self.feed.write_timeout
        while True:
            await asyncio.sleep(CHECK_PERIOD)
            if not self.alive():
                self.cut("the client went away")
                self.cut_off = None  # nobody to tell
                return
            since = self._writing_since
            if since is not None and time.monotonic() - since > timeout:
                self.feed.cut_off += 1
                log.warning("a flow reader (%s) read nothing for %.0f s and was cut off", self.client, timeout)
                self.cut(f"this reader read nothing for {timeout:.0f} s and was cut off "
                         "(podmeter_flow_followers_cut_off_total); read faster, or filter more")
            if self.cut_off is not None and self._writing_since is not None:
                await self._abandon()
                return

    async def _abandon(self) -> None:
        """The handler is stuck in a write to a client that does not read: end the stream from here. An end
        that must itself go through the stuck stream (gRPC's status) is given a moment; then the handler is
        cancelled, which resets the stream and frees what it buffered."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.finish(), ABANDON_GRACE)
        if self._writing_since is not None and self._task is not None:
            self._task.cancel()


class FlowFeed:
    """Recent records (:class:`FlowRing`) and the reads open on them.

    Invariants: a follower receives, in order and none twice, every record published after it opened
    that its selector wants, except those a :class:`Gap` it received counts; at most ``max_streams`` reads
    are open (``max_per_client`` per client, ``max_followers`` following); ``published`` counts every
    record ever published.
    """

    def __init__(self, capacity: int, *, max_streams: int = MAX_STREAMS, max_per_client: int = MAX_STREAMS_PER_CLIENT,
                 max_followers: int = MAX_FOLLOWERS, write_timeout: float = WRITE_TIMEOUT,
                 follower_idle: float = FOLLOWER_IDLE) -> None:
        self.ring = FlowRing(capacity)
        self.max_streams, self.max_per_client, self.max_followers = max_streams, max_per_client, max_followers
        self.write_timeout, self.follower_idle = write_timeout, follower_idle
        self.cut_off = 0  # reads cut off because their client did not read
        self.evicted = 0  # idle followers that yielded their slot to a new one
        self.refused = 0  # reads refused for want of a slot
        self.gaps = 0
        self.lost = 0  # records followers did not see (in gaps)
        self._readers: list[Reader] = []
        self._busiest = 0  # the most reads open at once since the last burst ended
        # What else each drain's records feed, called with (records, passed) (Hubble's metrics).
        self.taps: list[Callable[[list[FlowRecord], int], None]] = []

    @property
    def published(self) -> int:
        return self.ring.last_seq

    @property
    def streams(self) -> int:
        return len(self._readers)

    @property
    def followers(self) -> int:
        return sum(1 for r in self._readers if r.following)

    def publish(self, records: list[FlowRecord], passed: int = 0) -> None:
        """The writer task's only call: append, and wake the followers (which filter in their own tasks).
        ``passed``: records of the drain before these that nobody could read (``FlowRing.extend``)."""
        for tap in self.taps:
            tap(records, passed)
        if not records:
            return
        self.ring.extend(records, passed)
        for reader in self._readers:
            if reader.following:
                reader.woken()

    def open(self, selector: Selector, *, follow: bool, client: str = "", pinned: bool = False) -> Reader:
        """A new read, holding its slot from now (so a refusal is an answer, never a stream cut after its
        headers); :class:`Busy` if a bound is reached. A ``pinned`` follower is never evicted for being idle."""
        if len(self._readers) >= self.max_streams:
            self._refuse(f"too many readers: {self.max_streams} reads of this agent's flows are open")
        if client and sum(1 for r in self._readers if r.client == client) >= self.max_per_client:
            self._refuse(f"too many readers: this client has {self.max_per_client} reads of the flows open")
        if follow and self.followers >= self.max_followers and not self._evict_idle_follower():
            self._refuse(f"too many readers: {self.max_followers} follow this agent's flows")
        reader = Reader(self, selector, follow, client, pinned)
        self._readers.append(reader)
        return reader

    def _refuse(self, why: str) -> None:
        self.refused += 1
        raise Busy(f"{why}; try again later")

    def _evict_idle_follower(self) -> bool:
        followers = [r for r in self._readers if r.following and r.cut_off is None and not r.pinned]
        if not followers:
            return False
        idlest = min(followers, key=lambda r: r.last_sent)
        if time.monotonic() - idlest.last_sent < self.follower_idle:
            return False
        self.evicted += 1
        idlest.cut(f"this follower was sent nothing for {self.follower_idle:.0f} s and every follower slot was "
                   "wanted: it yielded its slot to a new reader; follow again")
        self._readers.remove(idlest)
        return True

    def _close(self, reader: Reader) -> None:
        if reader in self._readers:
            self._readers.remove(reader)
        self._busiest = max(self._busiest, len(self._readers) + 1)
        if len(self._readers) <= self.max_per_client and self._busiest > 2 * self.max_per_client:
            self._busiest = 0  # a burst of reads is over: what their answers held goes back to the system,
            loop = asyncio.get_running_loop()  # once the last of them closed, and once more for stragglers
            loop.call_later(GIVE_BACK_DELAY, give_back)
            loop.call_later(3 * GIVE_BACK_DELAY, give_back)
