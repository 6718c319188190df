"""``GET /debug/flows``: the agent's flow records as NDJSON, one JSON object per line (``podmeter observe``).

Query parameters: ``last=N`` (the last N matching records; default 20 without ``follow``, 0 with it),
``follow=1`` (then keep streaming new records until the client goes), and the filters of
:class:`~podmeter.model.flow_records.FlowFilter`: ``namespace``, ``pod``, ``from_pod``, ``to_pod``,
``workload``, ``protocol``, ``port``, ``since`` (wall-clock seconds), ``verdict`` (forwarded, dropped). A
bad parameter is a 400 that says which. The path is under ``/debug/``, so the debug endpoints' access rule
applies (loopback only unless the agent runs with ``--debug-remote``): records name pods and IPs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import msgspec
from aiohttp import web

from podmeter.model.flow_records import VERDICTS, FlowFilter, FlowRecord

DEFAULT_LAST = 20
MAX_LAST = 1_000_000
_encode = msgspec.json.Encoder().encode


CLOSED_CHECK = 1.0  # seconds between two checks that a quiet follower's client is still there


class Follower(Protocol):
    queue: asyncio.Queue[FlowRecord | None]


F = TypeVar("F", bound=Follower)


class Feed(Protocol[F]):
    """The flow feed as the endpoint reads it (``runtime.flow_feed.FlowFeed``)."""

    def last(self, count: int, wanted: FlowFilter) -> list[FlowRecord]: ...

    def can_follow(self) -> bool: ...

    def subscribe(self, wanted: FlowFilter) -> F: ...

    def unsubscribe(self, follower: F) -> None: ...


class BadQuery(ValueError):
    """A query parameter podmeter cannot use."""


def _int(params: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    raw = params.get(name)
    if raw is None:
        return None
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise BadQuery(f"{name}={raw!r}: expected an integer from {low} to {high}")
    return int(raw)


def parse_query(params: Mapping[str, str]) -> tuple[FlowFilter, int, bool]:
    """The filter, how many past records, and whether to follow; :class:`BadQuery` names a bad one."""
    known = {"last", "follow", "namespace", "pod", "from_pod", "to_pod", "workload", "protocol", "port", "since",
             "verdict"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise BadQuery(f"unknown parameter {unknown[0]!r} (known: {', '.join(sorted(known))})")
    follow = params.get("follow", "0") in ("1", "true", "yes")
    last = _int(params, "last", 0, MAX_LAST)
    since = None
    if "since" in params:
        try:
            since = float(params["since"])
        except ValueError:
            raise BadQuery(f"since={params['since']!r}: expected seconds since the epoch") from None
    verdict = params.get("verdict")
    if verdict is not None and verdict not in VERDICTS:
        raise BadQuery(f"verdict={verdict!r}: expected one of {', '.join(VERDICTS)}")
    wanted = FlowFilter(
        namespace=params.get("namespace"), pod=params.get("pod"), from_pod=params.get("from_pod"),
        to_pod=params.get("to_pod"), workload=params.get("workload"), protocol=params.get("protocol"),
        port=_int(params, "port", 0, 65535), since=since, verdict=verdict,
    )
    return wanted, (0 if follow else DEFAULT_LAST) if last is None else last, follow


def flows_handler(feed: Feed[Any]) -> Callable[[web.Request], Any]:
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            wanted, last, follow = parse_query(request.query)
        except BadQuery as exc:
            return web.Response(status=400, text=f"{exc}\n")
        if follow and not feed.can_follow():
            return web.Response(status=503, text="too many readers follow the flows; try again later\n")
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        try:
            for record in feed.last(last, wanted) if last else ():
                await response.write(_encode(record.to_json()) + b"\n")
            if follow:
                await _follow(request, response, feed, wanted)
        except ConnectionResetError:
            return response  # the reader went away
        await response.write_eof()
        return response

    return handler


async def _follow(request: web.Request, response: web.StreamResponse, feed: Feed[Any], wanted: FlowFilter) -> None:
    """Stream new records until the feed cuts the follower off or its client goes (a quiet stream is
    checked every second, so a reader that left does not keep its slot)."""
    follower = feed.subscribe(wanted)
    waiting: asyncio.Future[FlowRecord | None] | None = None
    try:
        while True:
            if waiting is None:
                waiting = asyncio.ensure_future(follower.queue.get())
            done, _ = await asyncio.wait({waiting}, timeout=CLOSED_CHECK)
            if not done:
                if request.transport is None or request.transport.is_closing():
                    return
                continue
            record, waiting = waiting.result(), None
            if record is None:
                return
            await response.write(_encode(record.to_json()) + b"\n")
    finally:
        if waiting is not None:
            waiting.cancel()
        feed.unsubscribe(follower)
