"""``podmeter operator`` as a real process (no tests here): :class:`OperatorProcess` and the ``operators``
fixture, which starts them against the lab API server and stops every one it started.

A pytest plugin (``pytest_plugins`` in conftest.py): the fixture is found by every test without an import.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lab_server import LabServer
from waiting import free_port, stop_process, wait_for

LEASE_S = 3.0  # the operators' --lease-duration


class OperatorProcess:
    """``python -m podmeter operator`` with short timings; ``get(path)`` reads its HTTP endpoints."""

    def __init__(self, server: LabServer, workdir: Path, name: str, extra: list[str]) -> None:
        self.name, self.port = name, free_port()
        self.log = workdir / f"{name}.log"
        args = [
            "--kubeconfig", str(server.kubeconfig), "--listen", f"127.0.0.1:{self.port}",
            "--holder-identity", name, "--lease-namespace", "default",
            "--lease-duration", str(LEASE_S), "--renew-deadline", "2", "--retry-period", "0.3",
            "--sweep-period", "1", "--gc-period", "0.5", "--config-period", "0.3", *extra,
        ]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "podmeter", "operator", *args],
                                         stdout=out, stderr=subprocess.STDOUT)
        wait_for(self._up, what=f"{name} HTTP")

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return self.get("/readyz") == "ready\n"
        except OSError:
            return False

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
            return str(resp.read().decode())

    def debug(self) -> dict[str, Any]:
        return dict(json.loads(self.get("/debug/identities")))

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def label_sets(self) -> set[str]:
        return {d["labels"]["app"] for d in self.debug()["identities"] if d["id"] is not None}

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_process(self.proc, sig)


@pytest.fixture
def operators(lab_apiserver: LabServer, tmp_path: Path) -> Iterator[Callable[..., OperatorProcess]]:
    started: list[OperatorProcess] = []

    def start(name: str, *extra: str) -> OperatorProcess:
        op = OperatorProcess(lab_apiserver, tmp_path, name, list(extra))
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()
