"""A lean, correct list/watch consumer (client-go's reflector, without the full-object cache).

One :class:`Reflector` per watched collection. It lists (chunked), then watches from the list's
resourceVersion with bookmarks and a randomised timeout, and turns what it sees into deltas for the one
writer. Its only state is the resourceVersion to resume from: the store lives with the writer, which is
why a relist is handed over whole (:class:`Replace`) and diffed there.

Rules it follows (``reference`` is the Kubernetes wire behaviour the lab API server reproduces):
* it never watches from RV "" or "0": those replay every object as ADDED in key order, not RV order, so no
  RV seen in such a burst is safe to resume from; it always lists first and watches from the list RV;
* EOF or the server's timeout: watch again from the last event or bookmark RV, no relist;
* 410 Expired/Gone (as an HTTP status or an ERROR event): relist, and the writer diffs;
* 429: wait Retry-After; connection errors and 5xx: back off (:class:`Backoff`); other errors: back off
  and relist;
* an inactivity deadline: a stream silent for longer than its timeout plus a grace is dead: re-watch;
* a watch that ends at once without a line is a failure (back off), not a reason to re-watch at once;
* every line is decoded with msgspec straight into a slim record; a bad object is counted and skipped
  (its key goes in ``Replace.keep`` on a list), its last good state stays with the writer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import msgspec

from podmeter.adapters.kube.backoff import Backoff
from podmeter.adapters.kube.resources import ResourceKind
from podmeter.adapters.kube.transport import Answer, Transport, TransportError
from podmeter.model.deltas import Delete, Delta, Replace, Upsert
from podmeter.model.records import DecodeError

log = logging.getLogger("podmeter.reflector")

R = TypeVar("R")
Sink = Callable[[Delta[R]], Awaitable[None]]


class _Status(msgspec.Struct):
    code: int = 0
    reason: str = ""
    message: str = ""


class _Meta(msgspec.Struct):
    resourceVersion: str = ""
    uid: object = None
    name: object = None
    continue_: str = msgspec.field(default="", name="continue")


class _MetaOnly(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)


class _List(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)
    items: list[msgspec.Raw] | None = None


class _Event(msgspec.Struct):
    type: str
    object: msgspec.Raw


_list_decoder = msgspec.json.Decoder(_List)
_event_decoder = msgspec.json.Decoder(_Event)
_meta_decoder = msgspec.json.Decoder(_MetaOnly)
_status_decoder = msgspec.json.Decoder(_Status)


class ApiError(Exception):
    """The API server answered an error (HTTP status or watch ERROR event)."""

    def __init__(self, code: int, reason: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.retry_after = retry_after

    @property
    def expired(self) -> bool:
        return self.code == 410 or self.reason in ("Expired", "Gone")


class StreamStalled(Exception):
    """A watch stream sent nothing within its inactivity deadline."""


class WatchEndedEarly(Exception):
    """A watch ended at once without a single line: re-watching at once would spin (client-go backs off)."""


EARLY_END = 1.0  # seconds: a watch that ends sooner than this without any line is a failure


@dataclass
class ReflectorSettings:
    """Tunables; the defaults are production values (tests shrink the timeouts)."""

    page_size: int = 500
    watch_timeout: tuple[float, float] = (300.0, 600.0)  # timeoutSeconds drawn uniformly in [lo, hi)
    inactivity_grace: float = 30.0  # silence allowed beyond timeoutSeconds before the stream is dead
    inactivity_deadline: float | None = None  # fixed deadline instead of the ones below
    # A watch that sends nothing, not even a bookmark (the API server sends one about every minute), for
    # this long is dead though its connection stays open: restart it (counted as StreamStalled).
    progress_deadline: float = 90.0
    request_timeout: float = 30.0
    field_selector: str | None = None
    label_selector: str | None = None
    optional: bool = False  # a 404 (the CRD not installed) is an empty collection, listed again later
    # With optional: the statuses that mean the collection is not there for us (a kind may add 403, RBAC
    # not granting it), and what the one warning tells the operator to do.
    missing_statuses: frozenset[int] = frozenset({404})
    missing_hint: str = "install the CRD from deploy/base to use it"
    backoff: Backoff = field(default_factory=Backoff)


@dataclass
class ReflectorStats:
    """Counters for ``/metrics``; they only grow."""

    events: Counter[str] = field(default_factory=Counter)  # by watch event type
    relists: Counter[str] = field(default_factory=Counter)  # by reason: initial | expired | error
    decode_errors: int = 0
    requests: int = 0
    failures: Counter[str] = field(default_factory=Counter)  # by cause


class Reflector(Generic[R]):
    """Lists and watches one collection and sends deltas to ``sink``.

    Invariant: ``resource_version`` is None iff the next step is a (re)list; otherwise it is the RV of
    the last list, event or bookmark seen, which is always safe to resume a watch from.
    """

    def __init__(self, kind: ResourceKind[R], transport: Transport, sink: Sink[R],
                 settings: ReflectorSettings | None = None) -> None:
        self.kind = kind
        self.transport = transport
        self.sink = sink
        self.settings = settings or ReflectorSettings()
        self.stats = ReflectorStats()
        self.resource_version: str | None = None
        self.synced = asyncio.Event()  # set once the first list has been delivered
        self._relist_reason = "initial"
        self._rng = random.Random()

    async def run(self) -> None:
        """List and watch until cancelled; never returns otherwise, never raises for API trouble."""
        while True:
            try:
                if self.resource_version is None:
                    await self._list()
                await self.watch_once()
            except ApiError as exc:
                await self._after_api_error(exc)
            except (TransportError, StreamStalled, WatchEndedEarly, OSError) as exc:
                await self._after_failure(type(exc).__name__, str(exc) or type(exc).__name__, None)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # a 200 that is no list (a proxy's page)
                self.resource_version = None
                await self._after_failure("bad_list", f"the list answer is not a list: {exc}", None)

    # --- list ------------------------------------------------------------------------------------

    async def _list(self) -> None:
        reason, self._relist_reason = self._relist_reason, "error"
        self.stats.relists[reason] += 1
        items: list[R] = []
        keep: set[str] = set()
        token = ""
        while True:
            page = await self._get_page(token)
            rv = page.metadata.resourceVersion
            for raw in page.items or ():
                self._decode_into(raw, items, keep)
            token = page.metadata.continue_
            if not token:
                break
        await self.sink(Replace(self.kind.collection, items, frozenset(keep)))
        self.settings.backoff.succeeded()
        self.resource_version = rv
        self.synced.set()
        log.info("listed %s: %d objects at resourceVersion %s (%s)", self.kind.name, len(items), rv, reason)

    async def _get_page(self, token: str) -> _List:
        params = self._selectors() | {"limit": str(self.settings.page_size)}
        if token:
            params["continue"] = token
        answer = await self._request(params)
        return _list_decoder.decode(answer.body)

    def _decode_into(self, raw: msgspec.Raw, items: list[R], keep: set[str]) -> None:
        try:
            items.append(self._decode(raw))
        except DecodeError as exc:
            key = self._raw_key(raw)
            if key:
                keep.add(key)
            self._report_invalid(exc)

    # --- watch -----------------------------------------------------------------------------------

    async def watch_once(self) -> None:
        """One watch request from ``resource_version`` until EOF; raises on errors (run() handles them)."""
        timeout = int(self._rng.uniform(*self.settings.watch_timeout))
        params = self._selectors() | {
            "watch": "1",
            "resourceVersion": str(self.resource_version),
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout),
        }
        deadline = self.settings.inactivity_deadline
        if deadline is None:
            deadline = min(timeout + self.settings.inactivity_grace, self.settings.progress_deadline)
        started, lines = time.monotonic(), 0
        async with self.transport.stream(self.kind.path, params) as stream:
            self.stats.requests += 1
            if stream.answer.status != 200:
                raise _api_error(stream.answer)
            async for line in _lines(stream.chunks(), deadline):
                if not lines:
                    self.settings.backoff.succeeded()  # the server answers again
                lines += 1
                await self._on_line(line)
        if not lines and time.monotonic() - started < EARLY_END:
            raise WatchEndedEarly(f"the watch from resourceVersion {self.resource_version} ended at once")

    async def _on_line(self, line: bytes) -> None:
        if self.kind.decode_event is not None and await self._on_line_fast(line, self.kind.decode_event):
            return
        try:
            event = _event_decoder.decode(line)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._report_invalid(DecodeError(self.kind.name, "", "$", f"malformed watch event: {exc}"))
            return
        self.stats.events[event.type] += 1
        if event.type == "ERROR":
            status = _decode_status(bytes(event.object))
            raise ApiError(status.code, status.reason, status.message)
        if event.type in ("ADDED", "MODIFIED", "DELETED"):
            await self._on_object(event.type, event.object)
        rv = _decode_meta(bytes(event.object)).resourceVersion
        if rv:
            self.resource_version = rv

    async def _on_line_fast(self, line: bytes, decode_event: Callable[[bytes], tuple[str, R]]) -> bool:
        """One-pass decode of an ordinary event; False sends the line down the general path."""
        try:
            kind, item = decode_event(line)
        except Exception:  # DecodeError, or a decoder's bug: the general path names it
            return False
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return False
        self.stats.events[kind] += 1
        if kind == "DELETED":
            await self.sink(Delete(self.kind.collection, self.kind.key(item), item))
        else:
            await self.sink(Upsert(self.kind.collection, item))
        self.resource_version = self.kind.resource_version(item) or self.resource_version
        return True

    async def _on_object(self, kind: str, raw: msgspec.Raw) -> None:
        try:
            item = self._decode(raw)
        except DecodeError as exc:
            self._report_invalid(exc)
            key = self._raw_key(raw)
            if kind == "DELETED" and key:  # a delete needs only the key: never lose one
                await self.sink(Delete(self.kind.collection, key))
            return
        if kind == "DELETED":
            await self.sink(Delete(self.kind.collection, self.kind.key(item), item))
        else:
            await self.sink(Upsert(self.kind.collection, item))

    # --- errors ----------------------------------------------------------------------------------

    async def _after_api_error(self, exc: ApiError) -> None:
        if exc.expired:
            log.info("%s: resourceVersion %s expired: relisting", self.kind.name, self.resource_version)
            self.resource_version = None
            self._relist_reason = "expired"
            self.stats.failures["expired"] += 1
            return
        if exc.code == 429 or exc.code >= 500:
            await self._after_failure(f"http_{exc.code}", str(exc), exc.retry_after)
            return
        if exc.code in self.settings.missing_statuses and self.settings.optional:
            await self._missing(exc)
        # Anything else (400, 401, 403, 404 ...) cannot be fixed by re-watching: relist after a pause.
        self.resource_version = None
        await self._after_failure(f"http_{exc.code}", str(exc), exc.retry_after)

    async def _after_failure(self, cause: str, message: str, retry_after: float | None) -> None:
        self.stats.failures[cause] += 1
        delay = self.settings.backoff.next_delay()
        if retry_after is not None:
            delay = max(delay, retry_after)
        log.warning("%s: %s; retrying in %.1fs", self.kind.name, message, delay)
        await asyncio.sleep(delay)

    async def _missing(self, exc: ApiError) -> None:
        """An optional collection is not served (its CRD is not installed) or not allowed (a status in
        ``missing_statuses``): it is empty until it appears.
        Said once; the relists after the usual pauses pick the CRD up when it is installed."""
        if self.synced.is_set():
            return
        what = "not served by the API server" if exc.code == 404 else "not allowed"
        log.warning("%s: %s (%s): treated as empty (a degraded mode) until it appears; %s", self.kind.name,
                    what, exc, self.settings.missing_hint)
        await self.sink(Replace(self.kind.collection, []))
        self.synced.set()

    def _report_invalid(self, exc: DecodeError) -> None:
        self.stats.decode_errors += 1
        log.warning("%s: skipped an invalid object: %s", self.kind.name, exc)

    # --- helpers ---------------------------------------------------------------------------------

    def _decode(self, raw: msgspec.Raw) -> R:
        """The kind's decoder, held to its contract: whatever an object holds, the only failure is a
        :class:`DecodeError` (counted, the object skipped, the rest applied). Anything else a decoder raises
        is its bug, never a reason to stop the agent: logged as one, and treated as bad input."""
        try:
            return self.kind.decode(bytes(raw))
        except DecodeError:
            raise
        except Exception as exc:  # the contract above
            log.error("%s: the decoder failed on an object (a bug; the object is skipped): %r",
                      self.kind.name, exc)
            raise DecodeError(self.kind.name, self._raw_key(raw), "$", f"decoder failed: {exc!r}"[:300]) from None

    def _selectors(self) -> dict[str, str]:
        params: dict[str, str] = {}
        if self.settings.field_selector:
            params["fieldSelector"] = self.settings.field_selector
        if self.settings.label_selector:
            params["labelSelector"] = self.settings.label_selector
        return params

    async def _request(self, params: dict[str, str]) -> Answer:
        self.stats.requests += 1
        answer = await self.transport.get(self.kind.path, params, self.settings.request_timeout)
        if answer.status != 200:
            raise _api_error(answer)
        return answer

    def _raw_key(self, raw: msgspec.Raw) -> str:
        meta = _decode_meta(bytes(raw))
        value = meta.uid if self.kind.key_field == "uid" else meta.name
        return value if isinstance(value, str) and 0 < len(value) <= 253 else ""


async def _lines(stream: AsyncIterator[bytes], deadline: float) -> AsyncIterator[bytes]:
    """Split a watch stream into lines, failing with StreamStalled when it goes silent too long.

    Lines are memoryview slices of the received chunk (msgspec decodes from any buffer), so a 7 KiB pod
    is never copied between the socket and the decoder.
    """
    chunks = stream.__aiter__()
    rest = b""
    while True:
        try:
            async with asyncio.timeout(deadline):
                chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise StreamStalled(f"no data for {deadline:.0f}s") from None
        data = rest + chunk if rest else chunk
        view = memoryview(data)
        start = 0
        while (end := data.find(b"\n", start)) != -1:
            if end > start:
                yield view[start:end]  # type: ignore[misc]
            start = end + 1
        rest = data[start:]


def _decode_meta(raw: bytes) -> _Meta:
    try:
        return _meta_decoder.decode(raw).metadata
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _Meta()


def _decode_status(raw: bytes) -> _Status:
    try:
        return _status_decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _Status(500, "InternalError", "undecodable Status")


def _api_error(answer: Answer) -> ApiError:
    # A body that is no Status (a plain-text 404 of a resource that is not served) says nothing more
    # than the HTTP status: report that, not an invented 500.
    status = _decode_status(answer.body) if answer.body else _Status()
    if status.reason == "InternalError" and status.message == "undecodable Status":
        status = _Status()
    retry_after = _retry_after(answer.headers.get("Retry-After"))
    return ApiError(status.code or answer.status, status.reason or answer.reason,
                    status.message or answer.body[:200].decode(errors="replace"), retry_after)


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return min(max(float(value), 0.0), 300.0)
    except ValueError:
        return None
