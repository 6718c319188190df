"""The lab's own HTTP client: kept-alive connections, and a connection the server closed while idle."""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Iterator

import pytest

from lab_server import LabServer
from podmeter.lab.kube import KubeClient, KubeError, pod_path


class CountingServer(socketserver.ThreadingTCPServer):
    """HTTP/1.1 on loopback that answers ``per_connection`` requests per connection, then hangs up
    without saying so (as a server whose keep-alive timeout expired does)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, per_connection: int) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.per_connection = per_connection
        self.connections = 0
        self.requests = 0


class Handler(socketserver.StreamRequestHandler):
    server: CountingServer

    def handle(self) -> None:
        self.server.connections += 1
        for _ in range(self.server.per_connection):
            if not self._answer_one():
                return

    def _answer_one(self) -> bool:
        request_line = self.rfile.readline()
        if not request_line:
            return False
        length = 0
        while (line := self.rfile.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        self.rfile.read(length)
        self.server.requests += 1
        body = json.dumps({"n": self.server.requests}).encode()
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        return True


@pytest.fixture
def serve() -> Iterator[list[CountingServer]]:
    started: list[CountingServer] = []
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


def start(serve: list[CountingServer], per_connection: int) -> tuple[CountingServer, KubeClient]:
    server = CountingServer(per_connection)
    serve.append(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, KubeClient(f"http://127.0.0.1:{server.server_address[1]}", None, None, timeout=5)


def test_requests_share_one_kept_alive_connection(serve: list[CountingServer]) -> None:
    server, client = start(serve, per_connection=1000)
    assert [client.list("/x")["n"] for _ in range(50)] == list(range(1, 51))
    assert server.connections == 1


def test_a_connection_closed_while_idle_is_replaced_and_the_request_goes_through(
        serve: list[CountingServer]) -> None:
    server, client = start(serve, per_connection=1)
    assert [client.create("/x", {"a": 1})["n"] for _ in range(5)] == [1, 2, 3, 4, 5]
    assert server.connections == 5  # each request once: no duplicate sent on the dead connection


def test_an_unreachable_server_is_a_status_0_error() -> None:
    client = KubeClient("http://127.0.0.1:9", None, None, timeout=2)
    with pytest.raises(KubeError) as caught:
        client.list("/api/v1/pods")
    assert caught.value.status == 0


def test_threads_each_keep_their_own_connection_to_the_lab_server(lab_apiserver: LabServer) -> None:
    client = KubeClient.from_kubeconfig(str(lab_apiserver.kubeconfig))
    client.create("/api/v1/namespaces", {"metadata": {"name": "keepalive"}})
    errors: list[BaseException] = []

    def churn(worker: int) -> None:
        try:
            for i in range(20):
                name = f"p{worker}-{i}"
                client.create(pod_path("keepalive"), {"metadata": {"name": name},
                                                      "spec": {"containers": [{"name": "c", "image": "i"}]}})
                assert client.delete(pod_path("keepalive", name)) is not None
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=churn, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert client.list(pod_path("keepalive"))["items"] == []
