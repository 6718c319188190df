"""``GET /debug/flows``: the agent's flow records as NDJSON, one JSON object per line (``podmeter observe``).

Query parameters: ``last=N`` (the last N matching records; default 20 without ``follow``, 0 with it),
``follow=1`` (then keep streaming new records until the client goes), and the filters of
:class:`~podmeter.model.flow_records.FlowFilter`: ``namespace``, ``pod``, ``from_pod``, ``to_pod``,
``workload``, ``service``, ``from_service``, ``to_service``, ``protocol``, ``port``, ``since`` (wall-clock
seconds), ``verdict`` (forwarded, dropped);
``labels=1`` adds each end's labels (a pod of this node: its own; another node's: its identity's). A
bad parameter is a 400 that says which. The path is under ``/debug/``, so the debug endpoints' access rule
applies (loopback only unless the agent runs with ``--debug-remote``): records name pods and IPs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec
from aiohttp import web

from podmeter.adapters.flow_serving import Batch, Busy, Encoded, FlowFeed, Gap, Reader
from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_records import VERDICTS, FlowFilter, FlowRecord, encode_json

# An endpoint's labels, flat (k1, v1, k2, v2, ...); () when unknown.
Labels = Callable[[Endpoint], tuple[str, ...]]

DEFAULT_LAST = 20
MAX_LAST = 1_000_000
_encode = msgspec.json.Encoder().encode


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
    known = {"last", "follow", "labels", "namespace", "pod", "from_pod", "to_pod", "workload", "service",
             "from_service", "to_service", "protocol", "port", "since", "verdict"}
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
            since = math.nan
        if not math.isfinite(since):
            raise BadQuery(f"since={params['since']!r}: expected seconds since the epoch")
    verdict = params.get("verdict")
    if verdict is not None and verdict not in VERDICTS:
        raise BadQuery(f"verdict={verdict!r}: expected one of {', '.join(VERDICTS)}")
    wanted = FlowFilter(
        namespace=params.get("namespace"), pod=params.get("pod"), from_pod=params.get("from_pod"),
        to_pod=params.get("to_pod"), workload=params.get("workload"), service=params.get("service"),
        from_service=params.get("from_service"), to_service=params.get("to_service"), protocol=params.get("protocol"),
        port=_int(params, "port", 0, 65535), since=since, verdict=verdict,
    )
    return wanted, (0 if follow else DEFAULT_LAST) if last is None else last, follow


ENCODED = 8192  # recent records' lines kept encoded, at most the ring's


def _line_encoder(labels: Labels | None) -> Callable[[FlowRecord], bytes]:
    """A record as one NDJSON line, with both ends' labels when ``labels`` is given."""
    if labels is None:
        return lambda record: encode_json(record) + b"\n"

    def labelled(record: FlowRecord) -> bytes:
        out = record.to_json()
        for side, end in (("source", record.source), ("destination", record.destination)):
            flat = labels(end.endpoint) if end.endpoint is not None else ()
            out[side]["labels"] = dict(zip(flat[::2], flat[1::2], strict=True))
        return _encode(out) + b"\n"

    return labelled


def flows_handler(feed: FlowFeed, labels: Labels | None = None,
                  dns_feed: FlowFeed | None = None) -> Callable[[web.Request], Any]:
    """The handler: a read of the flow-serving core (``adapters.flow_serving``) written as NDJSON. The slot
    is taken before the response starts, so a reader refused for want of one is told so by a 503, never by
    a stream cut after its headers. A follower that fell behind gets a line ``{"lost": N}`` where records
    are missing; a stream the agent ends (its reader did not read, or yielded its slot) ends with a line
    ``{"error": "..."}`` when the reader can still read it. ``protocol=dns`` reads ``dns_feed``, the DNS
    records (a feed of their own: the flows' readers and ring never see them)."""

    plain = Encoded(_line_encoder(None), min(ENCODED, feed.ring.capacity))  # labelled lines: never cached
    dns_plain = None if dns_feed is None else Encoded(_line_encoder(None), min(ENCODED, dns_feed.ring.capacity))

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            wanted, last, follow = parse_query(request.query)
        except BadQuery as exc:
            return web.Response(status=400, text=f"{exc}\n")
        source, unlabelled = feed, plain
        if dns_feed is not None and dns_plain is not None and (wanted.protocol or "").lower() == "dns":
            source, unlabelled = dns_feed, dns_plain
        line = _line_encoder(labels) if labels is not None and _flag(request.query, "labels") else unlabelled
        try:
            reader = source.open(wanted, follow=follow, client=_connection(request))
        except Busy as exc:
            return web.Response(status=503, text=f"{exc}\n")
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        reader.alive = lambda: request.transport is not None and not request.transport.is_closing()
        reader.end = _ender(request)
        try:
            async with reader:
                with reader.writing():
                    await response.prepare(request)
                for chunk in _chunks(await reader.history(last) if last else [], line):
                    with reader.writing():
                        await response.write(chunk)
                if follow:
                    await _follow(reader, response, unlabelled.lines if line is unlabelled else _joiner(line))
                with reader.writing():
                    if reader.cut_off is not None:
                        await response.write(_encode({"error": reader.cut_off}) + b"\n")
                    await response.write_eof()
                await reader.finish()
        except ConnectionError:  # reset, or aiohttp's "Connection lost" in a write: the reader went away
            pass
        return response

    return handler


CHUNK = 64 * 1024  # bytes of lines per write of the past records (one write, one syscall, per chunk)


def _chunks(records: list[FlowRecord], line: Callable[[FlowRecord], bytes]) -> Iterator[bytes]:
    batch: list[bytes] = []
    size = 0
    for record in records:
        data = line(record)
        batch.append(data)
        size += len(data)
        if size >= CHUNK:
            yield b"".join(batch)
            batch, size = [], 0
    if batch:
        yield b"".join(batch)


def _connection(request: web.Request) -> str:
    """The client's connection (address and port): the streams-per-client bound is per connection, as
    every local reader (kubectl port-forward, ip netns exec) shares one address."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(request.remote or "")


def _ender(request: web.Request) -> Callable[[str], Any]:
    async def end(reason: str) -> None:
        if request.transport is not None:
            request.transport.abort()  # a reader stuck mid-write: drop what waits for it, end the write
    return end


def _joiner(line: Callable[[FlowRecord], bytes]) -> Callable[[Batch], bytes]:
    return lambda batch: b"".join(map(line, batch.records))


async def _follow(reader: Reader, response: web.StreamResponse, lines: Callable[[Batch], bytes]) -> None:
    """New records as they come, a write per batch (one line per record, joined once for every follower
    without a filter: ``Encoded.lines``)."""
    async for item in reader.follow_batches():
        data = _encode({"lost": item.lost}) + b"\n" if isinstance(item, Gap) else lines(item)
        with reader.writing():
            await response.write(data)
