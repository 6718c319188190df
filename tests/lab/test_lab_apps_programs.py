"""The apps step's servers start from the directory the lab hands them even when it is relative, as
``make lab``'s default ``--out lab-report`` is: nginx and redis-server run here from the working directory
of a fresh clone, on the host's loopback, and answer (nginx's access log has the request, redis its stats)."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from podmeter.lab.appcheck import FILE_SIZE, INFO, Programs, nginx_argv, nginx_log, redis_argv, wait_listening
from podmeter.lab.traffic import Endpoint
from waiting import free_port, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab's nginx runs as root")


HOST = Endpoint("host", "127.0.0.1", "/proc/self/ns/net")  # the servers run in the test's own network namespace


def received(sock: socket.socket, until: bytes) -> bytes:
    data = b""
    while until not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture
def programs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Programs:
    monkeypatch.chdir(tmp_path)
    started = Programs(Path("lab-report") / "apps-x")
    started.directory.mkdir(parents=True)
    yield started  # type: ignore[misc]
    started.stop()


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed (scripts/setup.sh installs it)")
def test_nginx_serves_from_a_relative_directory(programs: Programs) -> None:
    port, directory = free_port(), programs.directory / "nginx-0"
    proc = programs.start("nginx-0", nginx_argv(directory, port))
    assert wait_listening(HOST, port, proc), (directory.parent / "nginx-0.out").read_text()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /file HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = received(sock, b"\r\n\r\n" + b"n" * FILE_SIZE)
    assert proc.poll() is None
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"n" * FILE_SIZE)
    wait_for(lambda: bool(nginx_log(directory)), 5, "nginx's access log")
    [(_, (read, written))] = nginx_log(directory).items()
    assert written == len(answer) and read > 0


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis is not installed (scripts/setup.sh)")
def test_redis_serves_from_a_relative_directory(programs: Programs) -> None:
    port, directory = free_port(), programs.directory / "redis-0"
    proc = programs.start("redis-0", redis_argv(directory, port))
    assert wait_listening(HOST, port, proc), (directory.parent / "redis-0.out").read_text()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(INFO)
        answer = received(sock, b"total_net_input_bytes")
    assert proc.poll() is None
    assert b"total_net_input_bytes" in answer
    assert (directory / "redis.log").is_absolute() and (directory / "redis.log").exists()
