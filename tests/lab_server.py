"""Start the lab API server for a test: as a real ``podmeter apiserver`` subprocess, or in-process.

Usage::

    from lab_server import LabServer  # the fixtures are registered for every test by tests/conftest.py

    def test_something(lab_apiserver):              # in-process (fast), plain HTTP
        lab_apiserver.url, lab_apiserver.token, lab_apiserver.kubeconfig
        lab_apiserver.admin.fail(3, code=429)          # fault knobs, see podmeter.lab.apiserver.client
        lab_apiserver.admin.count("watch", "pods")     # requests answered, by verb and resource

    with LabServer(tls=True) as srv:                   # a real subprocess; TLS so kubectl sends the token
        srv.kubectl("get", "pods", "-A")

``LabServer(process=True)`` (the default) runs ``podmeter apiserver --listen 127.0.0.1:0`` in a subprocess
(``console=True``: through ``python -m podmeter``, else the same code without the other subcommands'
imports) and waits until it answers; ``process=False`` runs the same server on a thread in this process (no
``restart`` limitations, starts in milliseconds). Both write a kubeconfig into a temporary directory.
Extra server flags go in ``args`` (e.g. ``["--history", "50", "--bookmark-interval", "1"]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
import yaml

from podmeter.lab.apiserver.client import AdminClient
from waiting import stop_process

KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
FAST_ENTRY = (
    "import argparse, sys\n"
    "from podmeter.cli import apiserver\n"
    "parser = argparse.ArgumentParser(prog='podmeter')\n"
    "apiserver.register(parser.add_subparsers(dest='command'))\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.func(args))\n"
)


class LabServer:
    """A running lab API server: ``url``, ``token``, ``kubeconfig`` (Path), ``ca_file``, ``admin``."""

    def __init__(
        self,
        tls: bool = False,
        process: bool = True,
        args: Sequence[str] = (),
        token: str = "lab-token",
        startup_timeout: float = 15.0,
        console: bool = False,
        service_cidr: str | None = None,
    ) -> None:
        self.console = console
        self.service_cidr = service_cidr  # the thread's server only (e.g. dual-stack: "10.96.0.0/16,fd00:96::/112")
        self.tls = tls
        self.process = process
        self.args = list(args)
        self.token = token
        self.startup_timeout = startup_timeout
        self.dir = Path(tempfile.mkdtemp(prefix="podmeter-apiserver-"))
        self.kubeconfig = self.dir / "kubeconfig"
        self.url = ""
        self.ca_file: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._admin: AdminClient | None = None

    # --- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self) -> LabServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _cli_args(self) -> list[str]:
        out = ["--listen", "127.0.0.1:0", "--kubeconfig-out", str(self.kubeconfig), "--token", self.token]
        if self.tls:
            out += ["--tls-dir", str(self.dir / "tls")]  # HTTPS is the default
        else:
            out += ["--plain-http"]
        return out + self.args

    def _command(self) -> list[str]:
        """``podmeter apiserver``: through the console entry (``console=True``), or, by default, through the
        same ``podmeter.cli.apiserver`` code without importing every other subcommand (~3 s saved)."""
        if self.console:
            return [sys.executable, "-m", "podmeter", "apiserver"]
        return [sys.executable, "-c", FAST_ENTRY, "apiserver"]

    def start(self) -> None:
        if self.process:
            with open(self.dir / "server.log", "wb") as log:  # the child holds its own copy of the file
                self.proc = subprocess.Popen(
                    [*self._command(), *self._cli_args()],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        else:
            self._start_thread()
        self._wait_ready()

    def _start_thread(self) -> None:
        import argparse

        from podmeter.cli import apiserver as cli
        from podmeter.lab.apiserver import Settings, serve_forever

        # Only this subcommand's parser: importing every CLI module would cost seconds per server.
        parser = argparse.ArgumentParser()
        cli.register(parser.add_subparsers())
        parsed = parser.parse_args(["apiserver", *self._cli_args()])
        settings = Settings(
            token=self.token,
            history=parsed.history,
            bookmark_interval=parsed.bookmark_interval,
            graceful_pod_deletion=parsed.graceful_pod_deletion,
            too_large_wait=parsed.too_large_rv_wait,
            watch_queue_limit=parsed.watch_queue_limit,
            **({"service_cidr": self.service_cidr} if self.service_cidr else {}),
        )
        tls_dir = (self.dir / "tls") if self.tls else None
        started = threading.Event()

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            task = asyncio.create_task(
                serve_forever(settings, "127.0.0.1", 0, kubeconfig_out=self.kubeconfig, tls_dir=tls_dir)
            )
            started.set()
            await self._stop.wait()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), name="lab-apiserver", daemon=True)
        self._thread.start()
        started.wait(5)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"apiserver exited: {(self.dir / 'server.log').read_text()}")
            if self.kubeconfig.exists():
                config = yaml.safe_load(self.kubeconfig.read_text())
                cluster = config["clusters"][0]["cluster"]
                self.url = cluster["server"]
                ca = cluster.get("certificate-authority")  # relative to the kubeconfig's directory, if relative
                self.ca_file = str(self.kubeconfig.parent / ca) if ca else None
                try:
                    self.admin.stats()
                    return
                except OSError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("lab apiserver did not become ready")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace=5)
            self.proc = None
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            if self._thread is not None:
                self._thread.join(5)
            self._loop = None
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- clients ---------------------------------------------------------------------------------------
    @property
    def admin(self) -> AdminClient:
        """Fault knobs, counters and the test-only inject (see podmeter.lab.apiserver.client)."""
        if self._admin is None:
            self._admin = AdminClient(self.url, self.token, self.ca_file)
        return self._admin

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = 10.0,
    ) -> tuple[int, dict[str, str], Any]:
        """One raw API request: (status, headers, decoded JSON body or text)."""
        import ssl

        data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": content_type},
        )
        context = ssl.create_default_context(cafile=self.ca_file) if self.tls else None
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
                raw, status, headers = resp.read(), resp.status, dict(resp.headers)
        except urllib.error.HTTPError as err:
            raw, status, headers = err.read(), err.code, dict(err.headers)
        try:
            return status, headers, json.loads(raw)
        except ValueError:
            return status, headers, raw.decode(errors="replace")

    def watch(self, path: str, timeout: float = 30.0) -> WatchStream:
        """Open a raw watch (``path`` with its query); read events with ``next()`` (see WatchStream)."""
        return WatchStream(self, path, timeout)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this server (needs ``tls=True``: kubectl sends no token over HTTP)."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "HOME": str(self.dir)}
        result = subprocess.run([KUBECTL, *args], input=input, capture_output=True, text=True, env=env, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result


_EOF = object()


class WatchStream:
    """A raw watch read on a thread.

    ``next(timeout)`` returns the next event dict, ``None`` at EOF, and raises ``TimeoutError`` if nothing
    arrives in time. ``status`` is the HTTP status; ``lines`` the raw lines read so far.
    """

    def __init__(self, server: LabServer, path: str, timeout: float) -> None:
        import http.client
        import queue
        import ssl
        import urllib.parse

        parsed = urllib.parse.urlsplit(server.url)
        conn: http.client.HTTPConnection
        if parsed.scheme == "https":
            context = ssl.create_default_context(cafile=server.ca_file)
            conn = http.client.HTTPSConnection(parsed.hostname or "", parsed.port, timeout=timeout, context=context)
        else:
            conn = http.client.HTTPConnection(parsed.hostname or "", parsed.port, timeout=timeout)
        conn.request("GET", path, headers={"Authorization": f"Bearer {server.token}"})
        self.conn = conn
        self.response = conn.getresponse()
        self.status = self.response.status
        self.lines: list[bytes] = []
        self.queue: queue.Queue[object] = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while True:
                line = self.response.readline()
                if not line:
                    break
                self.lines.append(line)
                self.queue.put(line)
        except Exception as exc:  # closed under the reader (OSError, AttributeError...): report as EOF
            self.queue.put(exc)
        self.queue.put(_EOF)

    def next(self, timeout: float = 5.0) -> dict[str, Any] | None:
        import queue

        try:
            item = self.queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("no watch event in time") from None
        if item is _EOF:
            self.queue.put(_EOF)
            return None
        if isinstance(item, Exception):
            return None
        assert isinstance(item, bytes)
        event: dict[str, Any] = json.loads(item)
        return event

    def events(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Every event until EOF (fails with TimeoutError if the stream stays open longer)."""
        out = []
        while (event := self.next(timeout)) is not None:
            out.append(event)
        return out

    def close(self) -> None:
        """Close the connection for real (the response's file object would otherwise keep the socket open)."""
        import socket

        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def lab_apiserver() -> Iterator[LabServer]:
    """An in-process lab API server over plain HTTP (fast); use ``LabServer`` directly for other options."""
    with LabServer(process=False) as server:
        yield server


@pytest.fixture
def lab_apiserver_process() -> Iterator[LabServer]:
    """A real ``podmeter apiserver`` subprocess over TLS (kubectl works against it)."""
    with LabServer(process=True, tls=True) as server:
        yield server
