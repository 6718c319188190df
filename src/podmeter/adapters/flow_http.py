"""``GET /debug/flows``: the agent's flow records as NDJSON, one JSON object per line (``podmeter observe``).

Query parameters: ``last=N`` (the last N matching records; default 20 without ``follow``, 0 with it),
``follow=1`` (then keep streaming new records until the client goes), and the filters of
:class:`~podmeter.model.flow_records.FlowFilter`: ``namespace``, ``pod``, ``from_pod``, ``to_pod``,
``workload``, ``protocol``, ``port``, ``since`` (wall-clock seconds), ``verdict`` (forwarded, dropped);
``labels=1`` adds each end's labels (a pod of this node: its own; another node's: its identity's). A
bad parameter is a 400 that says which. The path is under ``/debug/``, so the debug endpoints' access rule
applies (loopback only unless the agent runs with ``--debug-remote``): records name pods and IPs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import msgspec
from aiohttp import web

from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_records import VERDICTS, FlowFilter, FlowRecord

# An endpoint's labels, flat (k1, v1, k2, v2, ...); () when unknown.
Labels = Callable[[Endpoint], tuple[str, ...]]

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


def _flag(params: Mapping[str, str], name: str) -> bool:
    return params.get(name, "0") in ("1", "true", "yes")


def parse_query(params: Mapping[str, str]) -> tuple[FlowFilter, int, bool]:
    """The filter, how many past records, and whether to follow; :class:`BadQuery` names a bad one."""
    known = {"last", "follow", "labels", "namespace", "pod", "from_pod", "to_pod", "workload", "protocol", "port",
             "since", "verdict"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise BadQuery(f"unknown parameter {unknown[0]!r} (known: {', '.join(sorted(known))})")
    follow = _flag(params, "follow")
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


def _line_encoder(labels: Labels | None) -> Callable[[FlowRecord], bytes]:
    """A record as one NDJSON line, with both ends' labels when ``labels`` is given."""
    if labels is None:
        return lambda record: _encode(record.to_json()) + b"\n"

    def labelled(record: FlowRecord) -> bytes:
        out = record.to_json()
        for side, end in (("source", record.source), ("destination", record.destination)):
            flat = labels(end.endpoint) if end.endpoint is not None else ()
            out[side]["labels"] = dict(zip(flat[::2], flat[1::2], strict=True))
        return _encode(out) + b"\n"

    return labelled


def flows_handler(feed: Feed[Any], labels: Labels | None = None) -> Callable[[web.Request], Any]:
    """The handler. Invariant (as the feed's): a follower gets every matching record published after its
    past ones, in order, none twice. The slot is taken and the past read at once, before the first await:
    nothing can be published in between (no gap, no overlap), and a reader refused for want of a slot is
    told so by a 503, never by a stream cut after its headers."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            wanted, last, follow = parse_query(request.query)
        except BadQuery as exc:
            return web.Response(status=400, text=f"{exc}\n")
        line = _line_encoder(labels if labels is not None and _flag(request.query, "labels") else None)
        if follow and not feed.can_follow():
            return web.Response(status=503, text="too many readers follow the flows; try again later\n")
        follower = feed.subscribe(wanted) if follow else None
        past = feed.last(last, wanted) if last else []
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await response.prepare(request)
            for record in past:
                await response.write(line(record))
            if follower is not None and not await _follow(request, response, follower, line):
                return response  # the reader went away: nobody to end the stream for
            await response.write_eof()
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError too: the reader went away
            pass
        finally:
            if follower is not None:
                feed.unsubscribe(follower)
        return response

    return handler


async def _follow(request: web.Request, response: web.StreamResponse, follower: Follower,
                  line: Callable[[FlowRecord], bytes]) -> bool:
    """Stream new records until the feed cuts the follower off (True) or its client goes (False; a quiet
    stream is checked every second, so a reader that left does not keep its slot)."""
    waiting: asyncio.Future[FlowRecord | None] | None = None
    try:
        while True:
            if waiting is None:
                waiting = asyncio.ensure_future(follower.queue.get())
            done, _ = await asyncio.wait({waiting}, timeout=CLOSED_CHECK)
            if not done:
                if request.transport is None or request.transport.is_closing():
                    return False
                continue
            record, waiting = waiting.result(), None
            if record is None:
                return True
            await response.write(line(record))
    finally:
        if waiting is not None:
            waiting.cancel()
