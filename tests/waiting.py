"""Small helpers every process-level test needs: a free loopback port, and waiting for a condition."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition",
             describe: Callable[[], object] | None = None) -> None:
    """Poll ``predicate`` every 50 ms; fail naming ``what`` (and ``describe()``) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    detail = f"; {describe()}" if describe is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{detail}")


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
    """Send ``sig`` and wait ``grace`` seconds; kill what is still running then. Safe on a dead process."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; (0, "") when nothing answers (a process still starting or gone)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError:
        return 0, ""
