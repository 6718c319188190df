"""A real etcd server for tests: Debian's ``etcd`` on free loopback ports in a temporary directory.

Use the ``etcd`` fixture (import it into a test module) or :class:`EtcdServer` directly. The server can
be stopped and started again on the same ports and data directory, to test recovery.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from waiting import free_port, stop_process

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


class EtcdServer:
    """One etcd member; ``endpoint`` is its client URL. ``stop()`` then ``start()`` keeps the data."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = (self.workdir / "etcd.log").open("ab")
        self.proc = subprocess.Popen(
            [
                ETCD,
                "--name=test",
                f"--data-dir={self.workdir / 'data'}",
                f"--listen-client-urls={self.endpoint}",
                f"--advertise-client-urls={self.endpoint}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                "--heartbeat-interval=50",
                "--election-timeout=250",
                "--log-level=warn",
            ],
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {(self.workdir / 'etcd.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.client_port), 0.2):
                if self._healthy():
                    return
            time.sleep(0.1)
        raise RuntimeError("etcd did not become healthy")

    def _healthy(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as resp:
                return b"true" in resp.read()
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            stop_process(self.proc, sig)
        self.proc = None


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    if not os.path.exists(ETCD):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    server = EtcdServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
