"""``podmeter observe`` against answers it must not trust: the real command as a process, real HTTP.

Names and fields with terminal control characters are printed escaped (the compact line cannot be
rewritten, a flow cannot be faked) and ``-o json`` stays valid JSON; a line longer than the bound is an
error after at most that much, not memory that grows with the line; an answer that is not HTTP, not JSON,
JSON of another shape or an error status is said in one line on stderr with a non-zero exit, never a
traceback; a follower is told the flows it lost (``{"lost": N}``) and why the agent ended its stream
(``{"error": "..."}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from flow_support import observe, sample_records, served
from podmeter.adapters.flow_serving import FlowFeed
from podmeter.cli.observe import MAX_LINE
from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_records import FlowEnd, FlowRecord
from podmeter.model.flows import TCP, Observation

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# What a terminal acts on or does not show: C0 but the newline that ends each line, DEL, C1, and the
# characters Python calls unprintable (bidirectional overrides, line separators, zero-width ones).
UNSAFE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u200b-\u200f\u202a-\u202e\u2066-\u2069]")
FAKE = "\x1b[2K\r10.0.0.66:1 -> shop/vault 10.0.0.2:443 TCP [SYN] from-pod 1 pkts 60 B\n"


def record() -> dict[str, Any]:
    """A record as the agent writes it (a TCP one, so every field the compact line shows is there)."""
    return next(r for r in sample_records(3) if r.protocol == TCP).to_json()


@contextlib.asynccontextmanager
async def answering(handler: Handler) -> AsyncIterator[int]:
    """An aiohttp server on a free loopback port whose ``/debug/flows`` is ``handler``."""
    app = web.Application()
    app.router.add_get("/debug/flows", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def lines_of(*items: Any) -> Handler:
    """A handler that streams ``items`` (bytes as they are, anything else as JSON), one per line."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        for item in items:
            await response.write(item if isinstance(item, bytes) else json.dumps(item).encode() + b"\n")
        await response.write_eof()
        return response

    return handler


def one_line_error(code: int, err: str) -> str:
    assert code != 0, err
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("podmeter observe: "), err
    return err


# --- escapes ---------------------------------------------------------------------------------------------


async def test_control_characters_in_names_are_printed_escaped_and_json_stays_json() -> None:
    """A pod name as the agent names it (from a PodSlice of the cluster, say) cannot rewrite the line."""
    hostile = Endpoint("shop", "web" + FAKE, "Deployment", "web\x9b31m", "node-b\u202e")
    good = Endpoint("shop", "db", "StatefulSet", "db", "node-a")
    feed = FlowFeed(10)
    feed.publish([FlowRecord(1700000000.0, 1700000000.0, "node-a\x07", FlowEnd("10.0.0.1", 40000, hostile),
                             FlowEnd("10.0.0.2", 5432, good), TCP, Observation.FROM_POD, 1, 60, 0b10)])
    async with served(feed) as port:
        (code, lines, err), (jcode, jlines, jerr) = await asyncio.gather(
            observe(port, "--last", "5"), observe(port, "--last", "5", "-o", "json"))
    assert code == 0, err
    assert len(lines) == 1, lines  # one record, one line: the name's newline did not make a second one
    assert not UNSAFE.search(lines[0]), ascii(lines[0])
    assert "shop/web\\x1b[2K\\x0d10.0.0.66:1 -> shop/vault" in lines[0] and "node-a\\x07: " in lines[0]
    assert jcode == 0, jerr
    (line,) = jlines
    assert line.isascii() and not UNSAFE.search(line), line
    assert json.loads(line)["source"]["pod"] == "web" + FAKE and json.loads(line)["node"] == "node-a\x07"


async def test_every_field_a_server_sends_is_printed_escaped() -> None:
    base = record()
    hostile = {**base, "node": "n\x1b]0;owned\x07", "protocol": "TCP\x7f", "observation": "from-pod\u2028",
               "verdict": "dropped\x1b[8m", "drop_reason": "X\u009b2J", "tcp_flags": ["SYN\x1b[1A", "ACK\u200b"],
               "source": {**base["source"], "ip": "10.0.0.1\x1b[K", "namespace": "ns\u202e", "pod": "p\\x1b",
                          "labels": {"app\x1b": "v\r"}},
               "destination": {**base["destination"], "world": True, "ip": "8.8.8.8\x00"}}
    async with answering(lines_of(hostile, {**base, "protocol": "ICMPv4\x1b", "icmp": {"type": 8, "code": 0},
                                            "source": {**base["source"], "port": None}})) as port:
        code, lines, err = await observe(port, "--last", "5")
    assert code == 0, err
    assert len(lines) == 2, lines
    for line in lines:
        assert not UNSAFE.search(line), ascii(line)
    first = lines[0]
    for shown in ("n\\x1b]0;owned\\x07:", "ns\\u202e/p\\\\x1b {app\\x1b=v\\x0d} 10.0.0.1\\x1b[K:", "world 8.8.8.8\\x00",
                  "TCP\\x7f [SYN\\x1b[1A ACK\\u200b]", "from-pod\\u2028 DROPPED\\x1b[8M (X\\u009b2J)"):
        assert shown in first, (shown, first)
    assert "ICMPv4\\x1b type 8 code 0" in lines[1]


# --- a line beyond the bound -------------------------------------------------------------------------------


async def test_a_line_longer_than_the_bound_is_an_error_after_reading_about_that_much() -> None:
    line_size = 128 * MAX_LINE
    written = 0
    done = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal written
        response = web.StreamResponse()
        try:
            await response.prepare(request)
            await response.write(json.dumps(record()).encode() + b"\n")
            block = b"x" * 65536
            with contextlib.suppress(ConnectionResetError):  # the reader went: the line is never finished
                while written < line_size:
                    await response.write(block)
                    written += len(block)
                await response.write(b"\n")
        finally:
            done.set()
        return response

    async with answering(endless) as port:
        code, lines, err = await observe(port, "--last", "5")
        await asyncio.wait_for(done.wait(), 30)
    assert "a line of the answer is longer than 1048576 bytes" in one_line_error(code, err)
    assert len(lines) == 1 and "shop/web" in lines[0]  # the record before it was shown
    assert written < line_size // 4, written  # it stopped reading at the bound: the rest was never sent


# --- bad answers -------------------------------------------------------------------------------------------


def status(code: int, body: str) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=code, text=body)
    return handler


BAD: dict[str, tuple[Handler, str]] = {
    "not-json": (lines_of(b"hello\n"), "line 1 is not JSON"),
    "not-utf8": (lines_of(b'\xff\xfe{"a": 1}\n'), "line 1 is not JSON"),
    "array": (lines_of(json.dumps(record()).encode() + b"\n", [1, 2]), "line 2 is a JSON array, not an object"),
    "string": (lines_of("flows"), "line 1 is a JSON string, not an object"),
    "nested": (lines_of(b"[" * 200_000 + b"\n"), "line 1 is JSON nested too deep"),
    "nan": (lines_of(json.dumps({**record(), "time": float("nan")}).encode() + b"\n"), "line 1 is not JSON"),
    "infinite": (lines_of(json.dumps(record()).replace('"time": ', '"time": 1e999, "x": ').encode() + b"\n"),
                 "line 1 is not JSON"),
    "digits": (lines_of(b'{"lost": ' + b"9" * 5000 + b"}\n"), "line 1 is not JSON"),
    "wrong-type": (lines_of({**record(), "packets": "many"}), "field packets of a record is a JSON string"),
    "no-pod": (lines_of({**record(), "source": {"ip": "10.0.0.1", "port": 1}}),
               "field source.namespace of a record is a JSON null"),
    "end-not-object": (lines_of({**record(), "destination": "db"}),
                       "field destination of a record is a JSON string, not an object"),
    "far-time": (lines_of({**record(), "time": 1e300}), "field time of a record is 1e+300, not a time"),
    "lost-not-count": (lines_of({"lost": "many"}), "'lost' is a JSON string, not a count of flows"),
    "lost-negative": (lines_of({"lost": -3}), "'lost' is a JSON number, not a count of flows"),
    "unknown": (lines_of({"hello": 1}), "neither a flow record, nor 'lost', nor 'error' (its fields: hello)"),
    "status-500": (status(500, "boom\x1b[31m\nand more"), "answered 500: boom\\x1b[31m\\x0aand more"),
    "status-404": (status(404, ""), "answered 404"),
    "status-503-long": (status(503, "y" * 100_000), "answered 503: " + "y" * 300 + "..."),
}


def by_namespace(request: web.Request) -> Handler:
    return BAD[request.query["namespace"]][0]


JSON_TOO = ("not-json", "array", "wrong-type", "nan", "status-500")  # -o json as well: the same errors


async def test_odd_answers_are_one_line_errors_never_tracebacks() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await by_namespace(request)(request)

    runs = [(case, output) for case in BAD for output in ("compact", "json") if output == "compact" or case in JSON_TOO]
    room = asyncio.Semaphore(4)  # a few processes at a time: each takes most of a second to start

    async def run(case: str, output: str) -> tuple[int, list[str], str]:
        async with room:
            return await observe(port, "--last", "5", "--namespace", case, "-o", output)

    async with answering(handler) as port:
        answers = await asyncio.gather(*(run(case, output) for case, output in runs))
    for (case, output), (code, lines, err) in zip(runs, answers, strict=True):
        assert BAD[case][1] in one_line_error(code, err), (case, output, err)
        assert not UNSAFE.search(err), (case, err)
        assert code == 1, (case, output)
        assert len(lines) == (1 if case == "array" else 0), (case, output, lines)  # what came before was shown


@contextlib.asynccontextmanager
async def raw(answer: bytes) -> AsyncIterator[int]:
    """A TCP server that reads the request's head, writes ``answer`` and closes."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(("answer", "said"), [
    (b"SSH-2.0-OpenSSH_9.2\r\n", "not an HTTP answer (BadStatusLine"),
    (b"", "closed the connection without answering"),
    (b"HTTP/1.1 200 OK\r\n" + b"X-Long: " + b"h" * 100_000 + b"\r\n\r\n", "not an HTTP answer (LineTooLong"),
    (CHUNKED + b"zz\r\n", "the answer broke off in the middle"),
    (CHUNKED + b"%x\r\n" % 10_000 + b'{"source": {', "the answer broke off in the middle"),
], ids=["not-http", "nothing", "long-header", "bad-chunk", "cut-off"])
async def test_what_is_not_http_is_a_one_line_error(answer: bytes, said: str) -> None:
    async with raw(answer) as port:
        code, lines, err = await observe(port, "--last", "5")
    assert said in one_line_error(code, err)
    assert code == 1 and lines == []


# --- what a follower is told -------------------------------------------------------------------------------


async def test_a_follower_is_told_what_it_lost_and_why_the_agent_ended_its_stream() -> None:
    first, second = record(), {**record(), "packets": 9}
    answer = lines_of(first, {"lost": 7}, second, {"error": "the reader did not read for 30 s\x1b[2J"})
    async with answering(answer) as port:
        (code, lines, err), (jcode, jlines, jerr) = await asyncio.gather(
            observe(port, "--follow"), observe(port, "--follow", "-o", "json"))
    for status_code, stderr in ((code, err), (jcode, jerr)):
        assert status_code == 1, stderr
        assert "Traceback" not in stderr
        notice, ended = stderr.splitlines()
        assert notice == ("podmeter observe: 7 flows lost: this reader fell behind (the agent's ring of recent "
                          "flows overwrote them before they were sent)")
        assert ended == (f"podmeter observe: the agent at 127.0.0.1:{port} ended the stream: the reader did not "
                         "read for 30 s\\x1b[2J")
    assert len(lines) == 2 and " 1 pkts " in lines[0] and " 9 pkts " in lines[1]
    assert [json.loads(line)["packets"] for line in jlines] == [1, 9]  # stdout holds records only


def test_since_must_be_a_time() -> None:
    from podmeter.cli.observe import parse_since

    for value in ("nan", "inf", "-inf", "1e999"):
        with pytest.raises(Exception, match="expected a duration"):
            parse_since(value)


async def test_a_since_that_is_no_time_is_a_usage_error() -> None:
    code, lines, err = await observe(1, "--since", "nan")
    assert code == 2 and "--since 'nan': expected a duration" in err and lines == []
