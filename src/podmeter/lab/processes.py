"""The lab's process tree: the API server, the node, the agent and the operator as real subprocesses.

Each is started with an argv list (never a shell), logs to ``<out>/logs/<name>.log`` (appended across
restarts) and is stopped with SIGTERM, then SIGKILL after a timeout. :meth:`ProcessSet.stop_all` is safe
to call at any point of a failed start. Each inherits the runner's environment except the names its set
withholds (the embedded API server's runs withhold the plain-HTTP credentials allowance: see
:class:`~podmeter.lab.run.LabRun`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PODMETER = [sys.executable, "-m", "podmeter"]
# The test-only faulty agent is started through the cli layer (which may patch the runtime); the lab
# names the module as a string and never imports it.
FAULTY_AGENT = [sys.executable, "-m", "podmeter.cli.lab", "--faulty-agent"]


class LabProcessError(RuntimeError):
    """A lab process did not start or died; the message ends with the tail of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def rss_mib(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class LabProcess:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    withheld: frozenset[str] = frozenset()  # names of the runner's environment this process does not get

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        inherited = {name: value for name, value in os.environ.items() if name not in self.withheld}
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                          env={**inherited, **(env or {})}, start_new_session=True)
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None and self.popen.poll() is None else None

    def alive(self) -> bool:
        return self.pid is not None

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind (what a crash or the OOM killer does)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def fail(self, what: str) -> LabProcessError:
        return LabProcessError(f"{self.name} {what}; last lines of {self.log_path}:\n{self.log_tail()}")


@dataclass
class ProcessSet:
    processes: dict[str, LabProcess] = field(default_factory=dict)
    withheld: frozenset[str] = frozenset()  # for every process of the set (LabProcess.withheld)

    def add(self, name: str, argv: list[str], log_dir: Path) -> LabProcess:
        process = LabProcess(name, argv, log_dir / f"{name}.log", withheld=self.withheld)
        self.processes[name] = process
        return process

    def __getitem__(self, name: str) -> LabProcess:
        return self.processes[name]

    def stop_all(self) -> None:
        # The nodes (``node``, ``node-<name>``) last but one: they remove the sandboxes; the API server last,
        # the others need it.
        def rank(name: str) -> int:
            return 2 if name == "apiserver" else 1 if name == "node" or name.startswith("node-") else 0

        for name in sorted(self.processes, key=rank):
            self.processes[name].stop()


def wait_for_file(path: Path, process: LabProcess, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if not process.alive():
            raise process.fail("exited before it was ready")
        if time.monotonic() > deadline:
            raise process.fail(f"did not write {path} within {timeout:.0f} s")
        time.sleep(0.05)


def wait_ready(url: str, process: LabProcess, timeout: float = 30.0) -> None:
    """Poll ``url`` (a /readyz) until it answers 200."""
    deadline = time.monotonic() + timeout
    while True:
        if not process.alive():
            raise process.fail("exited before it was ready")
        with contextlib.suppress(OSError, urllib.error.URLError), \
                urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 (loopback, ours)
            if response.status == 200:
                return
        if time.monotonic() > deadline:
            raise process.fail(f"was not ready ({url}) within {timeout:.0f} s")
        time.sleep(0.1)


def http_text(url: str, timeout: float = 3.0) -> str | None:
    """GET ``url`` (loopback endpoints of the lab's processes); None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (loopback, ours)
            text: str = response.read().decode()
            return text
    except (OSError, urllib.error.URLError):
        return None
