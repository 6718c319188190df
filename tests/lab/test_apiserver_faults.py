"""Every fault knob, shown on the wire; and a minimal correct consumer (list, watch, resume, relist on 410)
end to end."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lab_server import FAST_ENTRY, LabServer


@pytest.fixture
def srv() -> Iterator[LabServer]:
    with LabServer(process=False) as server:
        yield server


def pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "c", "image": "busybox"}], "nodeName": "node-a"},
    }


def list_rv(srv: LabServer, path: str = "/api/v1/namespaces/default/pods") -> str:
    status, _, body = srv.request("GET", path)
    assert status == 200
    rv: str = body["metadata"]["resourceVersion"]
    return rv


def test_close_watches_ends_every_stream_cleanly(srv: LabServer) -> None:
    rv = list_rv(srv)
    streams = [
        srv.watch(f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={rv}&timeoutSeconds=60") for _ in range(3)
    ]
    deadline = time.monotonic() + 5
    while srv.admin.open_watches() < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.admin.close_watches() == 3
    for stream in streams:
        assert stream.next(5) is None  # EOF, no ERROR event
        stream.close()
    assert srv.admin.open_watches() == 0
    assert srv.admin.stats()["watchesClosed"]["fault"] == 3


def test_compact_makes_old_rv_expire(srv: LabServer) -> None:
    rv = list_rv(srv)
    srv.request("POST", "/api/v1/namespaces/default/pods", pod("a"))
    with srv.watch(f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={rv}&timeoutSeconds=1") as w:
        assert [e["type"] for e in w.events()] == ["ADDED"]  # before compaction: served from history
    floor = srv.admin.compact()
    with srv.watch(f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={rv}&timeoutSeconds=5") as w:
        events = w.events()
    assert [(e["type"], e["object"]["code"], e["object"]["reason"]) for e in events] == [("ERROR", 410, "Expired")]
    status, _, body = srv.request(
        "GET", f"/api/v1/namespaces/default/pods?resourceVersion={rv}&resourceVersionMatch=Exact"
    )
    assert status == 410 and body["message"] == "The resourceVersion for the provided list is too old."
    with srv.watch(f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={floor}&timeoutSeconds=1") as w:
        assert w.events() == []  # the floor itself is still fine


def test_stall_silences_open_streams_then_delivers(srv: LabServer) -> None:
    rv = list_rv(srv)
    with srv.watch(
        f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=30"
    ) as w:
        time.sleep(0.1)
        srv.admin.stall()
        srv.request("POST", "/api/v1/namespaces/default/pods", pod("a"))
        with pytest.raises(TimeoutError):
            w.next(1.0)
        # A stream opened after the stall is not stalled (unless includeNew).
        with srv.watch(f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={rv}&timeoutSeconds=1") as fresh:
            assert [e["type"] for e in fresh.events()] == ["ADDED"]
        srv.admin.unstall()
        event = w.next(2)
        assert event is not None and event["type"] == "ADDED"


def test_watch_that_falls_too_far_behind_is_closed() -> None:
    with LabServer(process=False, args=["--watch-queue-limit", "5"]) as srv:
        rv = list_rv(srv)
        with srv.watch(f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={rv}&timeoutSeconds=30") as w:
            time.sleep(0.1)
            srv.admin.stall()
            for i in range(6):
                srv.request("POST", "/api/v1/namespaces/default/pods", pod(f"p{i}"))
            assert w.next(3) is None  # closed while stalled: EOF, nothing else
        assert srv.admin.stats()["watchesClosed"] == {"overflow": 1}


def test_client_that_stops_reading_is_dropped() -> None:
    """TCP back-pressure: the server's writes block, the queue overflows, the connection is dropped."""
    import socket

    with LabServer(process=False, args=["--watch-queue-limit", "5"]) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(
            f"GET /api/v1/namespaces/default/pods?watch=1&resourceVersion={list_rv(srv)}"
            f"&timeoutSeconds=60 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {srv.token}\r\n\r\n".encode()
        )
        deadline = time.monotonic() + 5
        while srv.admin.open_watches() < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        big = "x" * 200_000
        for i in range(60):  # ~12 MB of events, far more than the socket buffers hold
            srv.admin.inject(
                "pods", {"metadata": {"name": f"p{i}", "namespace": "default", "annotations": {"pad": big}}}
            )
        deadline = time.monotonic() + 10
        while srv.admin.open_watches() > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.admin.open_watches() == 0
        assert srv.admin.stats()["watchesClosed"] == {"overflow": 1}
        sock.close()


def test_stall_include_new_and_duration(srv: LabServer) -> None:
    rv = list_rv(srv)
    srv.admin.stall(seconds=1.0, include_new=True)
    started = time.monotonic()
    srv.request("POST", "/api/v1/namespaces/default/pods", pod("a"))
    with srv.watch(f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={rv}&timeoutSeconds=5") as w:
        event = w.next(3)
    assert event is not None and event["type"] == "ADDED"
    assert time.monotonic() - started >= 0.9


@pytest.mark.parametrize("code", [500, 503, 429])
def test_fail_next_requests(srv: LabServer, code: int) -> None:
    srv.admin.fail(2, code=code, retry_after=3)
    answers = [srv.request("GET", "/api/v1/namespaces/default/pods") for _ in range(3)]
    assert [a[0] for a in answers] == [code, code, 200]
    _, headers, body = answers[0]
    if code == 429:
        assert headers["Retry-After"] == "3"
        assert body == {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": "Too many requests, please try again later.",
            "reason": "TooManyRequests",
            "details": {"retryAfterSeconds": 3},
            "code": 429,
        }
    elif code == 503:
        assert (body["reason"], body["code"]) == ("ServiceUnavailable", 503)
    else:
        assert (body["reason"], body["code"]) == ("InternalError", 500)
        assert body["message"].startswith("Internal error occurred: ")
    counts = {(c["verb"], c["code"]): c["count"] for c in srv.admin.stats()["requests"]}
    assert counts[("list", code)] == 2 and counts[("list", 200)] == 1


def test_fail_only_one_verb(srv: LabServer) -> None:
    srv.admin.fail(1, code=500, verb="watch")
    assert srv.request("GET", "/api/v1/namespaces/default/pods")[0] == 200
    with srv.watch("/api/v1/namespaces/default/pods?watch=1&timeoutSeconds=1") as w:
        assert w.status == 500
    with srv.watch("/api/v1/namespaces/default/pods?watch=1&timeoutSeconds=1") as w:
        assert w.status == 200
    assert srv.admin.count("watch", "pods") == 2


def test_restart_drops_connections_keeps_state() -> None:
    with LabServer(process=True) as srv:
        srv.request("POST", "/api/v1/namespaces/default/pods", pod("a"))
        rv = list_rv(srv)
        with srv.watch(f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={rv}&timeoutSeconds=60") as w:
            time.sleep(0.1)
            srv.admin.restart(down_seconds=0.5)
            assert w.next(5) is None  # connection dropped
        time.sleep(0.2)
        with pytest.raises(OSError):
            srv.request("GET", "/api/v1/namespaces/default/pods", timeout=1)  # down
        time.sleep(0.6)
        status, _, body = srv.request("GET", "/api/v1/namespaces/default/pods")
        assert status == 200 and body["metadata"]["resourceVersion"] == rv
        assert [p["metadata"]["name"] for p in body["items"]] == ["a"]
        srv.request("POST", "/api/v1/namespaces/default/pods", pod("b"))
        with srv.watch(f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={rv}&timeoutSeconds=1") as w:
            assert [(e["type"], e["object"]["metadata"]["name"]) for e in w.events()] == [("ADDED", "b")]


def test_fault_cli(srv: LabServer) -> None:
    def cli(*args: str, console: bool = False) -> str:
        entry = [sys.executable, "-m", "podmeter"] if console else [sys.executable, "-c", FAST_ENTRY]
        command = [*entry, "apiserver", "fault", *args, "--url", srv.url, "--token", srv.token]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout

    assert '"failing": 2' in cli("fail", "2", "--code", "429", console=True)
    assert [srv.request("GET", "/api/v1/namespaces")[0] for _ in range(3)] == [429, 429, 200]
    assert '"floor"' in cli("compact")
    assert '"closed": 0' in cli("close-watches")
    assert '"openWatches"' in cli("stats")


def test_inject_bypasses_validation_for_tests(srv: LabServer) -> None:
    with srv.watch("/api/v1/namespaces/default/pods?watch=1&timeoutSeconds=2") as w:
        time.sleep(0.1)
        bad = {
            "metadata": {
                "name": "bad",
                "namespace": "default",
                "labels": ["not", "a", "map"],
                "annotations": {"big": "x" * (1024 * 1024)},
            },
            "spec": {"nodeName": "node-a"},
            "status": {"podIP": "999.1.2.3", "podIPs": [{"ip": "999.1.2.3"}]},
        }
        assert srv.admin.inject("pods", bad)["type"] == "ADDED"
        assert srv.admin.inject_line("pods", "this is not json") == 1
        event = w.next(3)
        assert event is not None and event["object"]["status"]["podIP"] == "999.1.2.3"
        assert len(event["object"]["metadata"]["annotations"]["big"]) == 1024 * 1024
        with pytest.raises(ValueError):
            w.next(3)  # the raw garbage line
    status, _, body = srv.request("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-a")
    assert status == 200 and [p["metadata"]["name"] for p in body["items"]] == ["bad"]


# --- What a correct consumer does: list, watch from the list's RV, resume, relist on 410 --------------------


class Reflector:
    """A minimal correct consumer: list, watch from the list RV, resume from the last RV, relist on 410."""

    def __init__(self, srv: LabServer) -> None:
        self.srv = srv
        self.store: dict[str, dict[str, Any]] = {}
        self.rv = ""
        self.log: list[str] = []

    def relist(self) -> None:
        status, _, body = self.srv.request("GET", "/api/v1/namespaces/default/pods?limit=2")
        assert status == 200
        items = list(body["items"])
        while body["metadata"].get("continue"):
            _, _, body = self.srv.request(
                "GET", f"/api/v1/namespaces/default/pods?limit=2&continue={body['metadata']['continue']}"
            )
            items += body["items"]
        fresh = {p["metadata"]["uid"]: p for p in items}
        for uid in set(self.store) - set(fresh):
            self.log.append(f"delete {self.store[uid]['metadata']['name']} (relist)")
        self.store = fresh
        self.rv = body["metadata"]["resourceVersion"]
        self.log.append("list")

    def watch_once(self, timeout: int) -> None:
        with self.srv.watch(
            f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={self.rv}"
            f"&allowWatchBookmarks=true&timeoutSeconds={timeout}"
        ) as w:
            while (event := w.next(timeout + 5)) is not None:
                obj = event["object"]
                if event["type"] == "ERROR":
                    self.log.append(f"error {obj['code']}")
                    self.relist()
                    return
                self.rv = obj["metadata"]["resourceVersion"]
                self.log.append(event["type"].lower())
                if event["type"] == "DELETED":
                    self.store.pop(obj["metadata"]["uid"], None)
                elif event["type"] != "BOOKMARK":
                    self.store[obj["metadata"]["uid"]] = obj
        self.log.append("eof")


def test_correct_consumer_transcript() -> None:
    with LabServer(process=False, args=["--bookmark-interval", "0.5"]) as srv:
        for name in ("a", "b", "c"):
            srv.request("POST", "/api/v1/namespaces/default/pods", pod(name))
        r = Reflector(srv)
        r.relist()
        assert {p["metadata"]["name"] for p in r.store.values()} == {"a", "b", "c"}
        r.watch_once(timeout=1)  # nothing happens: a bookmark, then EOF at the timeout
        assert r.log[-2:] == ["bookmark", "eof"]
        bookmark_rv = r.rv
        srv.request("DELETE", "/api/v1/namespaces/default/pods/b")  # while disconnected
        r.watch_once(timeout=1)  # resume from the bookmark: the delete arrives
        assert "deleted" in r.log[-3:] and {p["metadata"]["name"] for p in r.store.values()} == {"a", "c"}
        srv.request("DELETE", "/api/v1/namespaces/default/pods/c")  # while disconnected, then compaction
        srv.admin.compact()
        r.watch_once(timeout=1)  # 410 → relist, and the diff finds the lost delete
        assert r.log[-3:] == ["error 410", "delete c (relist)", "list"]
        assert {p["metadata"]["name"] for p in r.store.values()} == {"a"}
        assert int(r.rv) > int(bookmark_rv)
