"""The reflector's protocol rules, one by one, through the MockTransport fake: no server, no sockets.

Each test scripts the API server's answers in order (a list page or a watch stream each), runs the reflector
until the script is used up and checks two things: the requests it sent (paths, params, resourceVersions) and
the deltas it handed to the sink. Sleeps of the reflector (backoff, Retry-After) are recorded, not slept;
the only real waiting is the inactivity test's few milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pytest

from factories import pod_json
from mock_transport import (
    MockAnswer,
    MockTransport,
    Reset,
    Stall,
    bookmark_line,
    error_line,
    list_body,
    watch_line,
)
from podmeter.adapters.kube import reflector as reflector_module
from podmeter.adapters.kube.backoff import Backoff
from podmeter.adapters.kube.reflector import Reflector, ReflectorSettings
from podmeter.adapters.kube.resources import PODS
from podmeter.adapters.kube.transport import Params, TransportError
from podmeter.model import deltas
from podmeter.model.deltas import Delete, Delta, Replace, Upsert
from podmeter.model.records import Pod

pytestmark = pytest.mark.fast  # the pure tier: make test-fast

_real_sleep = asyncio.sleep

Verb = Literal["list", "watch"]
Entry = tuple[Verb, MockAnswer | TransportError]


class Script:
    """The server's answers in order; each names the request it expects ("list" or "watch").

    A request of the other kind fails the test (the AssertionError escapes ``Reflector.run``). Once the
    script is used up, ``exhausted`` is set and the next request gets an answer that never ends; that last
    request is recorded too: it shows where the reflector goes next (the RV it would resume from).
    """

    def __init__(self, entries: Sequence[Entry]) -> None:
        self.entries = list(entries)
        self.exhausted = asyncio.Event()

    def __call__(self, method: str, path: str, params: Params) -> MockAnswer:
        assert method == "GET"
        assert path == "/api/v1/pods"
        verb: Verb = "watch" if params.get("watch") == "1" else "list"
        if not self.entries:
            self.exhausted.set()
            return MockAnswer.stream([Stall()])
        expected, answer = self.entries.pop(0)
        assert verb == expected, f"the reflector sent a {verb}, the script expected a {expected}: {params}"
        if isinstance(answer, TransportError):
            raise answer
        return answer


class _AsyncioRecordingSleeps:
    """The reflector module's view of asyncio: the real one, except that sleep records its delay."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        await _real_sleep(0)


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every delay the reflector asked to sleep, in order (it does not really sleep)."""
    fake = _AsyncioRecordingSleeps()
    monkeypatch.setattr(reflector_module, "asyncio", fake)
    return fake.sleeps


class Run:
    """A reflector over a MockTransport playing ``script``, with every delta it sent."""

    def __init__(self, script: Sequence[Entry], **settings: Any) -> None:
        self.script = Script(script)
        self.transport = MockTransport(self.script)
        self.deltas: list[Delta[Pod]] = []
        settings.setdefault("backoff", Backoff(initial=0.8, jitter=0.0))
        self.reflector: Reflector[Pod] = Reflector(PODS, self.transport, self._sink, ReflectorSettings(**settings))

    async def _sink(self, delta: Delta[Pod]) -> None:
        self.deltas.append(delta)

    async def until_exhausted(self) -> Run:
        """Run the reflector until the script is used up, then cancel it; its own failures are raised."""
        task = asyncio.create_task(self.reflector.run())
        waiter = asyncio.create_task(self.script.exhausted.wait())
        try:
            done, _ = await asyncio.wait({task, waiter}, timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()  # raises what escaped run()
                raise AssertionError("Reflector.run returned")
            assert done, f"the script was not used up in 2 s; left: {self.script.entries}"
        finally:
            for t in (task, waiter):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        assert self.transport.open_streams == 0, "a watch stream was left open"
        return self

    def requests(self, verb: Verb) -> list[Mapping[str, str]]:
        return [r.params for r in self.transport.requests if (r.params.get("watch") == "1") == (verb == "watch")]

    def watch_rvs(self) -> list[str]:
        return [p["resourceVersion"] for p in self.requests("watch")]


def pod(name: str, rv: str, **kwargs: Any) -> dict[str, Any]:
    obj = pod_json(name, uid=f"uid-{name}", **kwargs)
    obj["metadata"]["resourceVersion"] = rv
    return obj


def bad_pod(name: str, rv: str) -> dict[str, Any]:
    """A pod the record decoder rejects (an invalid IP), whose uid can still be read from its metadata."""
    return pod(name, rv, ips=("not-an-ip",))


def listing(*items: Mapping[str, object], rv: str, token: str = "") -> Entry:
    return "list", MockAnswer.json(list_body(items, rv, token))


def watching(*steps: bytes | Stall | Reset) -> Entry:
    return "watch", MockAnswer.stream(steps)


def failing(status: int, reason: str = "", headers: Mapping[str, str] | None = None, verb: Verb = "watch") -> Entry:
    return verb, MockAnswer.error(status, reason, f"scripted {status}", headers)


def uids(delta: Delta[Pod]) -> list[str]:
    assert isinstance(delta, Replace)
    return [p.uid for p in delta.items]


# --- list, then watch from the list's resourceVersion ------------------------------------------------


async def test_initial_list_is_chunked_then_watch_starts_at_the_list_rv_with_bookmarks(sleeps: list[float]) -> None:
    run = await Run([
        listing(pod("a", "3"), pod("b", "4"), rv="20", token="page-2"),
        listing(pod("c", "5"), rv="20"),
        watching(watch_line("ADDED", pod("d", "21"))),
    ], page_size=2, field_selector="spec.nodeName=node-a", watch_timeout=(300.0, 301.0)).until_exhausted()

    assert run.requests("list") == [
        {"fieldSelector": "spec.nodeName=node-a", "limit": "2"},
        {"fieldSelector": "spec.nodeName=node-a", "limit": "2", "continue": "page-2"},
    ]
    first_watch = run.requests("watch")[0]
    assert first_watch == {"fieldSelector": "spec.nodeName=node-a", "watch": "1", "resourceVersion": "20",
                           "allowWatchBookmarks": "true", "timeoutSeconds": "300"}
    assert all(r.path == "/api/v1/pods" for r in run.transport.requests)

    replace, upsert = run.deltas
    assert isinstance(replace, Replace)
    assert replace.collection is deltas.PODS
    assert uids(replace) == ["uid-a", "uid-b", "uid-c"]  # one Replace for all pages, in order
    assert replace.keep == frozenset()
    assert isinstance(upsert, Upsert)
    assert (upsert.collection, upsert.item.uid) == (deltas.PODS, "uid-d")

    assert run.reflector.synced.is_set()
    assert run.reflector.stats.relists == {"initial": 1}
    assert run.reflector.stats.events == {"ADDED": 1}
    assert sleeps == []


async def test_eof_resumes_from_the_last_event_then_from_the_bookmark_without_relisting(sleeps: list[float]) -> None:
    run = await Run([
        listing(pod("a", "3"), rv="10"),
        watching(watch_line("ADDED", pod("b", "11")), watch_line("MODIFIED", pod("a", "12"))),  # then EOF
        watching(bookmark_line("15")),  # then EOF
        watching(),  # EOF at once: nothing seen; back off, then resume from the same RV
    ]).until_exhausted()

    assert run.watch_rvs() == ["10", "12", "15", "15"]
    assert len(run.requests("list")) == 1
    assert run.reflector.stats.relists == {"initial": 1}
    assert run.reflector.stats.events == {"ADDED": 1, "MODIFIED": 1, "BOOKMARK": 1}
    assert [type(d) for d in run.deltas] == [Replace, Upsert, Upsert]  # a bookmark is not a delta
    assert sleeps == [0.8]  # EOF after lines is the normal end of a watch; an empty one at once backs off


async def test_a_line_split_across_chunks_and_two_lines_in_one_chunk_are_both_read(sleeps: list[float]) -> None:
    one, two, three = (watch_line("ADDED", pod(n, rv)) for n, rv in (("b", "11"), ("c", "12"), ("d", "13")))
    run = await Run([
        listing(rv="10"),
        watching(one[:7], one[7:40], one[40:] + two, three),
    ]).until_exhausted()

    assert [d.item.uid for d in run.deltas if isinstance(d, Upsert)] == ["uid-b", "uid-c", "uid-d"]
    assert run.watch_rvs() == ["10", "13"]


# --- 410: relist --------------------------------------------------------------------------------------


async def test_410_as_http_status_relists_and_hands_over_a_replace(sleeps: list[float]) -> None:
    run = await Run([
        listing(pod("a", "3"), rv="10"),
        failing(410, "Expired"),
        listing(pod("a", "3"), pod("b", "25"), rv="30"),
    ]).until_exhausted()

    assert [r.params.get("watch", "list") for r in run.transport.requests] == ["list", "1", "list", "1"]
    assert run.watch_rvs() == ["10", "30"]
    first, second = run.deltas
    assert uids(first) == ["uid-a"]
    assert uids(second) == ["uid-a", "uid-b"]
    assert run.reflector.stats.relists == {"initial": 1, "expired": 1}
    assert run.reflector.stats.failures == {"expired": 1}
    assert sleeps == []  # an expired RV is not the server's trouble: relist at once


async def test_410_as_an_error_event_relists_after_applying_the_events_before_it(sleeps: list[float]) -> None:
    run = await Run([
        listing(pod("a", "3"), rv="10"),
        watching(watch_line("ADDED", pod("b", "11")), error_line(410, "Expired", "too old resource version: 10"),
                 watch_line("ADDED", pod("never", "12"))),  # nothing after the ERROR is read
        listing(pod("a", "3"), pod("b", "11"), rv="40"),
    ]).until_exhausted()

    assert run.watch_rvs() == ["10", "40"]
    assert len(run.requests("list")) == 2
    replace1, upsert, replace2 = run.deltas
    assert uids(replace1) == ["uid-a"]
    assert isinstance(upsert, Upsert) and upsert.item.uid == "uid-b"
    assert uids(replace2) == ["uid-a", "uid-b"]
    assert run.reflector.stats.events == {"ADDED": 1, "ERROR": 1}
    assert run.reflector.stats.relists == {"initial": 1, "expired": 1}
    assert sleeps == []


# --- 429, 5xx, connection errors: wait, keep the RV ----------------------------------------------------


@pytest.mark.parametrize(("retry_after", "waited"), [("7", 7.0), ("0", 0.8), ("soon", 0.8)])
async def test_429_waits_retry_after_then_watches_again_from_the_same_rv(
        sleeps: list[float], retry_after: str, waited: float) -> None:
    run = await Run([
        listing(rv="10"),
        failing(429, "TooManyRequests", {"Retry-After": retry_after}),
    ]).until_exhausted()

    assert sleeps == [waited]  # Retry-After, but never less than the backoff (0.8 s here); junk is ignored
    assert run.watch_rvs() == ["10", "10"]
    assert run.reflector.stats.relists == {"initial": 1}
    assert run.reflector.stats.failures == {"http_429": 1}


async def test_429_on_the_list_waits_retry_after_then_lists_again(sleeps: list[float]) -> None:
    run = await Run([
        failing(429, "TooManyRequests", {"Retry-After": "3"}, verb="list"),
        listing(pod("a", "3"), rv="10"),
    ]).until_exhausted()

    assert sleeps == [3.0]
    assert len(run.requests("list")) == 2
    assert run.watch_rvs() == ["10"]
    assert [uids(d) for d in run.deltas] == [["uid-a"]]  # a failed list delivers nothing


async def test_5xx_backs_off_exponentially_and_keeps_the_rv(sleeps: list[float]) -> None:
    run = await Run([
        listing(rv="10"),
        failing(500, "InternalError"),
        failing(503, "ServiceUnavailable"),
        failing(500, "InternalError"),
        watching(watch_line("ADDED", pod("a", "11"))),
    ]).until_exhausted()

    assert sleeps == [0.8, 1.6, 3.2]
    assert run.watch_rvs() == ["10", "10", "10", "10", "11"]
    assert run.reflector.stats.relists == {"initial": 1}
    assert run.reflector.stats.failures == {"http_500": 2, "http_503": 1}


async def test_connection_errors_back_off_and_keep_the_rv(sleeps: list[float]) -> None:
    run = await Run([
        listing(rv="10"),
        ("watch", TransportError("connection refused")),
        watching(watch_line("ADDED", pod("a", "11")), Reset()),  # broken mid-stream
    ]).until_exhausted()

    assert sleeps == [0.8, 0.8]  # the watch delivered a line in between: the server was back, backoff reset
    assert run.watch_rvs() == ["10", "10", "11"]
    assert [type(d) for d in run.deltas] == [Replace, Upsert]
    assert run.reflector.stats.relists == {"initial": 1}
    assert run.reflector.stats.failures == {"TransportError": 2}


async def test_other_errors_back_off_and_relist(sleeps: list[float]) -> None:
    run = await Run([
        listing(pod("a", "3"), rv="10"),
        failing(403, "Forbidden"),
        listing(pod("a", "3"), rv="50"),
    ]).until_exhausted()

    assert sleeps == [0.8]
    assert run.watch_rvs() == ["10", "50"]
    assert [uids(d) for d in run.deltas] == [["uid-a"], ["uid-a"]]
    assert run.reflector.stats.relists == {"initial": 1, "error": 1}
    assert run.reflector.stats.failures == {"http_403": 1}


# --- a silent stream is dead ---------------------------------------------------------------------------


async def test_a_stream_silent_past_the_inactivity_deadline_is_rewatched(sleeps: list[float]) -> None:
    run = await Run([
        listing(rv="10"),
        watching(Stall(0.005), watch_line("ADDED", pod("a", "11")), Stall(0.005), bookmark_line("12"),
                 Stall()),  # short pauses are fine; then silence for good
    ], inactivity_deadline=0.05).until_exhausted()

    assert run.watch_rvs() == ["10", "12"]
    assert [type(d) for d in run.deltas] == [Replace, Upsert]
    assert run.reflector.stats.failures == {"StreamStalled": 1}
    assert run.reflector.stats.relists == {"initial": 1}
    assert sleeps == [0.8]


# --- undecodable objects -------------------------------------------------------------------------------


async def test_an_undecodable_object_in_a_list_is_skipped_counted_and_kept(sleeps: list[float]) -> None:
    run = await Run([
        listing(pod("a", "3"), bad_pod("b", "4"), rv="10", token="more"),
        listing(pod("c", "5"), {"metadata": {"resourceVersion": "6"}}, rv="10"),  # no uid: cannot be kept
    ]).until_exhausted()

    (replace,) = run.deltas
    assert isinstance(replace, Replace)
    assert uids(replace) == ["uid-a", "uid-c"]
    assert replace.keep == frozenset({"uid-b"})  # its last good state stays with the writer
    assert run.reflector.stats.decode_errors == 2
    assert run.watch_rvs() == ["10"]


async def test_an_undecodable_deleted_still_deletes_by_key(sleeps: list[float]) -> None:
    run = await Run([
        listing(pod("a", "3"), pod("b", "4"), rv="10"),
        watching(watch_line("DELETED", bad_pod("a", "11")),
                 watch_line("DELETED", pod("b", "12")),
                 watch_line("ADDED", bad_pod("c", "13")),  # skipped, but its RV still counts
                 b'{"type": "ADDED", "object": \n'),  # not even JSON: skipped
    ]).until_exhausted()

    _, undecodable_delete, delete, *rest = run.deltas
    assert undecodable_delete == Delete(deltas.PODS, "uid-a")
    assert undecodable_delete.last is None
    assert isinstance(delete, Delete) and delete.key == "uid-b"
    assert delete.last is not None and delete.last.uid == "uid-b"
    assert rest == []
    assert run.reflector.stats.decode_errors == 3
    assert run.watch_rvs() == ["10", "13"]


# --- the fake itself -------------------------------------------------------------------------------------


async def test_the_mock_records_requests_and_reads_error_bodies_whole() -> None:
    seen: list[tuple[str, str, dict[str, str]]] = []

    def handler(method: str, path: str, params: Params) -> MockAnswer:
        seen.append((method, path, dict(params)))
        if "watch" in params:
            return MockAnswer.stream([b"ignored"], status=410)
        return MockAnswer.stream([b'{"a":', Stall(0.001), b" 1}"])

    transport = MockTransport(handler)
    params = {"limit": "1"}
    answer = await transport.get("/x", params, timeout=1.0)
    params["limit"] = "changed"
    assert (answer.status, answer.reason, json.loads(answer.body)) == (200, "OK", {"a": 1})
    async with transport.stream("/x", {"watch": "1"}) as stream:
        assert (stream.answer.status, stream.answer.reason, stream.answer.body) == (410, "Gone", b"ignored")
        assert [c async for c in stream.chunks()] == []
        assert transport.open_streams == 1
    assert transport.open_streams == 0
    assert [(r.path, dict(r.params), r.stream) for r in transport.requests] == [
        ("/x", {"limit": "1"}, False), ("/x", {"watch": "1"}, True)]
    assert seen == [("GET", "/x", {"limit": "1"}), ("GET", "/x", {"watch": "1"})]


async def test_the_mock_get_honours_its_timeout_and_resets() -> None:
    answers = iter([MockAnswer.stream([Stall()]), MockAnswer.stream([b"{", Reset("peer went away")])])
    transport = MockTransport(lambda method, path, params: next(answers))
    with pytest.raises(TransportError, match="no answer within"):
        await transport.get("/x", {}, timeout=0.01)
    with pytest.raises(TransportError, match="peer went away"):
        await transport.get("/x", {}, timeout=1.0)
    await transport.close()
    with pytest.raises(TransportError, match="closed"):
        await transport.get("/x", {}, timeout=1.0)
    assert len(transport.requests) == 2


# --- answers that are not what they claim ---------------------------------------------------------------


async def test_a_list_answer_that_is_not_json_backs_off_instead_of_killing_the_reflector(
        sleeps: list[float]) -> None:
    run = await Run([
        ("list", MockAnswer(200, {"Content-Type": "text/html"}, b"<html>proxy error</html>")),
        listing(rv="10"),
    ]).until_exhausted()
    assert sleeps == [0.8]
    assert run.watch_rvs() == ["10"]


async def test_a_watch_that_keeps_ending_at_once_backs_off_instead_of_spinning(sleeps: list[float]) -> None:
    run = await Run([listing(rv="10"), watching(), watching(), watching(), watching()]).until_exhausted()
    assert set(run.watch_rvs()) == {"10"}
    assert sleeps[:4] == [0.8, 1.6, 3.2, 6.4]  # growing pauses between the empty watches, no relist
    assert len(run.requests("list")) == 1


async def test_failures_in_a_row_grow_the_backoff_and_an_answer_resets_it(sleeps: list[float]) -> None:
    run = await Run([
        listing(rv="10"),
        ("watch", TransportError("refused")), ("watch", TransportError("refused")),
        ("watch", TransportError("refused")),
        watching(watch_line("ADDED", pod("a", "11"))),  # the server is back
        ("watch", TransportError("refused")),
    ]).until_exhausted()
    assert sleeps[:4] == [0.8, 1.6, 3.2, 0.8]
    assert run.reflector.stats.relists == {"initial": 1}


async def test_a_watch_without_even_a_bookmark_is_restarted_within_the_progress_deadline(
        sleeps: list[float]) -> None:
    run = await Run([
        listing(rv="10"),
        watching(Stall()),  # connection open, nothing at all
        watching(bookmark_line("12")),
    ], progress_deadline=0.05).until_exhausted()
    assert run.watch_rvs()[:2] == ["10", "10"]
    assert run.reflector.stats.failures["StreamStalled"] == 1
