"""Watch streams: the initial burst, replay from history, live fan-out, bookmarks, timeout, faults.

A :class:`Watcher` is subscribed to the store; ``offer`` turns each committed event into this watcher's
view of it (ADDED when an object starts matching the selectors, DELETED with the previous content when it
stops, as the real cacher does) and queues the line. The stream loop drains the queue, sends a BOOKMARK
every ``bookmark_interval`` and once shortly before ``timeoutSeconds`` when the client allowed them, and
ends the response cleanly (EOF) at the timeout or when closed by a fault. A bookmark is only sent when the
queue is empty, so its RV is always safe to resume from.

A watcher whose queue exceeds its limit is closed, like the real server drops a watcher that cannot keep up.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from podmeter.lab.apiserver.errors import ApiError, rv_too_large, too_old_watch
from podmeter.lab.apiserver.faults import Faults
from podmeter.lab.apiserver.resources import ResourceType
from podmeter.lab.apiserver.selectors import Selector
from podmeter.lab.apiserver.store import ADDED, DELETED, MODIFIED, Event, Store, Stored, encode, event_line

INITIAL_EVENTS_END = "k8s.io/initial-events-end"


@dataclass(frozen=True)
class WatchOptions:
    """Parsed, validated watch parameters."""

    resource_version: str
    labels: Selector
    fields: Selector
    namespace: str | None
    bookmarks: bool
    timeout: float
    send_initial_events: bool | None
    transform: Callable[[bytes], bytes] | None = None  # e.g. into Table rows for kubectl


def bookmark_line(resource: ResourceType, rv: int, initial_end: bool = False) -> bytes:
    meta: dict[str, object] = {"resourceVersion": str(rv)}
    if initial_end:
        meta["annotations"] = {INITIAL_EVENTS_END: "true"}
    obj = {"metadata": meta, **resource.bookmark_skeleton}
    return event_line("BOOKMARK", resource, encode(obj))


def error_line(err: ApiError) -> bytes:
    return b'{"type":"ERROR","object":' + encode(err.status()) + b"}\n"


class Watcher:
    """One open watch: its filter, its pending lines and why it was closed (if it was)."""

    def __init__(self, resource: ResourceType, opts: WatchOptions, limit: int, epoch: int) -> None:
        self.resource = resource
        self.opts = opts
        self.limit = limit
        self.epoch = epoch
        self.pending: deque[bytes] = deque()
        self.wake = asyncio.Event()
        self.closed: str | None = None
        self.abort = False
        self.transport: asyncio.BaseTransport | None = None

    def matches(self, stored: Stored) -> bool:
        if self.opts.namespace is not None and stored.namespace != self.opts.namespace:
            return False
        return self.opts.labels.matches(stored.labels) and self.opts.fields.matches(stored.fields)

    def view(self, event: Event) -> str | None:
        """This watcher's event type for ``event``, or None if it does not concern it."""
        if event.type == ADDED:
            return ADDED if self.matches(event.obj) else None
        was = event.prev is not None and self.matches(event.prev)
        if event.type == DELETED:
            return DELETED if was else None
        now = self.matches(event.obj)
        if now:
            return MODIFIED if was else ADDED
        return DELETED if was else None

    def offer(self, event: Event) -> None:
        if self.closed is not None:
            return
        kind = self.view(event)
        if kind is None:
            return
        if len(self.pending) >= self.limit:
            self.close("overflow", abort=True)
            return
        self.pending.append(event.line(kind))
        self.wake.set()

    def push_raw(self, line: bytes) -> None:
        """Test-only: queue a line verbatim (see the inject fault)."""
        if self.closed is None:
            self.pending.append(line)
            self.wake.set()

    def close(self, reason: str, abort: bool = False) -> None:
        """End the stream at the next step; ``abort`` drops the connection instead of ending it cleanly."""
        if self.closed is None:
            self.closed = reason
            self.abort = abort
        if abort and self.transport is not None:
            _drop(self.transport)  # also frees a write blocked on a client that stopped reading
        self.wake.set()


class WatchHub:
    """The open watchers, for the fault knobs and the admin counters."""

    def __init__(
        self,
        store: Store,
        faults: Faults,
        bookmark_interval: float,
        queue_limit: int = 10_000,
        too_large_wait: float = 3.0,
    ) -> None:
        self.store = store
        self.faults = faults
        self.bookmark_interval = bookmark_interval
        self.queue_limit = queue_limit
        self.too_large_wait = too_large_wait
        self.open: set[Watcher] = set()
        self.closed_by_reason: dict[str, int] = {}

    def close_all(self, reason: str, abort: bool = False) -> int:
        watchers = list(self.open)
        for w in watchers:
            w.close(reason, abort)
        return len(watchers)

    def inject_line(self, resource: ResourceType, line: bytes) -> int:
        count = 0
        for w in self.open:
            if w.resource is resource:
                w.push_raw(line)
                count += 1
        return count

    async def serve(
        self,
        request: web.Request,
        resource: ResourceType,
        opts: WatchOptions,
        on_open: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """Answer one watch request: 504 for an RV from the future, else HTTP 200 from here on (a too-old RV
        becomes an ERROR event, as recorded).

        ``on_open`` runs once the 200 headers are out, so counters see a watch while it is still open."""
        response = web.StreamResponse(
            status=200,
            headers={
                "Audit-Id": str(uuid.uuid4()),
                "Cache-Control": "no-cache, private",
                "Content-Type": "application/json",
            },
        )
        error = await self._await_rv(opts)
        if error is not None:
            raise error  # before the stream starts: a plain HTTP 504 with its Status body
        response.enable_chunked_encoding()
        await response.prepare(request)
        if on_open is not None:
            on_open()
        watcher = Watcher(resource, opts, self.queue_limit, self.faults.stall_epoch)
        watcher.transport = request.transport
        try:
            initial = self._start(watcher)
        except ApiError as err:
            await response.write(error_line(err))
            await response.write_eof()
            return response
        self.open.add(watcher)
        try:
            await self._stream(request, response, watcher, initial)
        finally:
            self.open.discard(watcher)
            self.store.unsubscribe(resource, watcher)
            reason = watcher.closed or "client"
            self.closed_by_reason[reason] = self.closed_by_reason.get(reason, 0) + 1
        if watcher.abort and request.transport is not None:
            _drop(request.transport)
            return response
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write_eof()
        return response

    async def _await_rv(self, opts: WatchOptions) -> ApiError | None:
        """A watch from an RV the server has not reached yet waits for it, then fails like the real one."""
        rv = _int_rv(opts.resource_version)
        if rv is None or rv <= self.store.rv:
            return None
        deadline = time.monotonic() + self.too_large_wait
        while self.store.rv < rv and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.store.rv >= rv:
            return None
        return rv_too_large(rv, self.store.rv)

    def _start(self, watcher: Watcher) -> list[bytes]:
        """Initial lines and subscription, in one synchronous step (see store.py's invariant)."""
        opts, store, resource = watcher.opts, self.store, watcher.resource
        rv = _int_rv(opts.resource_version)
        initial: list[bytes] = []
        synthetic = opts.send_initial_events is True or (opts.send_initial_events is None and rv in (None, 0))
        if synthetic:
            for stored in store.items(resource, opts.namespace):
                if watcher.matches(stored):
                    initial.append(event_line(ADDED, resource, stored.body))
            if opts.bookmarks:
                initial.append(bookmark_line(resource, store.rv, initial_end=True))
        elif rv not in (None, 0):
            if rv < store.floor:
                raise too_old_watch(rv, store.floor + 1)
            for event in store.events_since(rv):
                if event.resource is resource:
                    kind = watcher.view(event)
                    if kind is not None:
                        initial.append(event.line(kind))
        store.subscribe(resource, watcher)
        return initial

    async def _stream(
        self, request: web.Request, response: web.StreamResponse, watcher: Watcher, initial: list[bytes]
    ) -> None:
        """Write until the timeout, a close, or the client going away; nothing at all while stalled."""
        opts = watcher.opts
        clock = BookmarkClock.start(opts, self.bookmark_interval)
        watcher.pending.extendleft(reversed(initial))
        while True:
            now = time.monotonic()
            if watcher.closed is not None or now >= clock.deadline or _client_gone(request):
                return
            if self.faults.is_stalled(watcher.epoch):
                await _wait(watcher.wake, 0.2)
                watcher.wake.clear()
                continue
            if watcher.pending:
                lines = list(watcher.pending)
                watcher.pending.clear()
                watcher.wake.clear()
                if opts.transform is not None:
                    lines = [opts.transform(line) for line in lines]
                if not await _write(response, b"".join(lines)):
                    return
                continue
            if clock.due(now):  # the queue is empty: every event up to store.rv has been written
                if not await _write(response, bookmark_line(watcher.resource, self.store.rv)):
                    return
                continue
            watcher.wake.clear()
            await _wait(watcher.wake, max(0.0, clock.wake_at(now) - now))


@dataclass
class BookmarkClock:
    """When a watch's bookmarks are due: every ``interval``, and once 2 s before the timeout if that is
    still ahead when the watch starts (the real cacher's rule; the recordings show none on a 2 s watch)."""

    deadline: float
    periodic: float | None
    final: float | None
    interval: float

    @classmethod
    def start(cls, opts: WatchOptions, interval: float) -> BookmarkClock:
        now = time.monotonic()
        deadline = now + opts.timeout
        return cls(
            deadline=deadline,
            periodic=now + interval if opts.bookmarks else None,
            final=deadline - 2.0 if opts.bookmarks and opts.timeout > 2.0 else None,
            interval=interval,
        )

    def due(self, now: float) -> bool:
        """Whether a bookmark is due now (and consume it)."""
        if self.periodic is not None and now >= self.periodic:
            self.periodic = now + self.interval
            return True
        if self.final is not None and now >= self.final:
            self.final = None
            return True
        return False

    def wake_at(self, now: float) -> float:
        return min(t for t in (self.deadline, self.periodic, self.final, now + 1.0) if t is not None)


def _int_rv(text: str) -> int | None:
    return int(text) if text else None


def _drop(transport: asyncio.BaseTransport) -> None:
    """Drop the connection now: ``close()`` would first flush what a non-reading client never takes."""
    if isinstance(transport, asyncio.WriteTransport):
        transport.abort()
    else:
        transport.close()


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _wait(event: asyncio.Event, timeout: float) -> None:
    """Wait for ``event`` at most ``timeout`` s (``asyncio.timeout``: no extra task per wait, unlike wait_for,
    which matters with 50 watchers woken per event)."""
    if event.is_set():
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()


async def _write(response: web.StreamResponse, data: bytes) -> bool:
    try:
        await response.write(data)
    except (ConnectionError, RuntimeError):
        return False
    return True


def random_timeout() -> float:
    """The real server's default when no timeoutSeconds is given: between 30 and 60 minutes."""
    return random.uniform(1800, 3600)
