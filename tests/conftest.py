import _posixsubprocess
import asyncio
import gc
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# The test servers (the lab API server fixture) speak plain HTTP with a token: allowed for tests only
# (podmeter refuses credentials over plain HTTP otherwise; tests/adapters/test_kube_connection.py checks it).
os.environ.setdefault("PODMETER_ALLOW_PLAIN_HTTP_CREDENTIALS", "1")

# Fixtures shared by many test files: the lab API server (in-process and as a subprocess), the kernel
# tests' pin directories, netns topologies and attached pods, and operator processes.
pytest_plugins = ["lab_server", "bpf_support", "operator_support"]


class ProcessInFastTests(RuntimeError):
    """A test of the fast tier (``make test-fast``) tried to start a process. Not an OSError, on purpose:
    code that skips when a binary is missing (``except OSError``) must not swallow it."""


@pytest.fixture(autouse=True)
def _no_processes_in_fast_tests(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """With PODMETER_FAST_TESTS=1 (``make test-fast``), every way of starting a process raises
    :class:`ProcessInFastTests`, and the test fails even if it caught that. Otherwise does nothing."""
    if os.environ.get("PODMETER_FAST_TESTS") != "1":
        yield
        return
    attempts: list[str] = []

    def refuse(name: str) -> Callable[..., Any]:
        def spawn(*args: Any, **kwargs: Any) -> Any:
            attempts.append(name)
            raise ProcessInFastTests(f"{name}: the fast tier (PODMETER_FAST_TESTS=1) starts no process; "
                                     "move this test out of make test-fast")
        return spawn

    # Popen covers subprocess.run/check_output, os.popen and asyncio's subprocesses (all go through it).
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse("subprocess.Popen"))
    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse("_posixsubprocess.fork_exec"))  # multiprocessing
    for name in ("create_subprocess_exec", "create_subprocess_shell"):
        monkeypatch.setattr(asyncio, name, refuse(f"asyncio.{name}"))
        monkeypatch.setattr(asyncio.subprocess, name, refuse(f"asyncio.{name}"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):  # os.spawn* use os.fork
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse(f"os.{name}"))
    yield
    if attempts:
        pytest.fail(f"started a process in the fast tier: {', '.join(attempts)}", pytrace=False)


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs a command's main() in-process gets its logging set up (a handler on the test's
    captured stderr); put the root logger back, so later tests do not log into a closed stream."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


class _TaskLeaks(logging.Handler):
    """Collects asyncio's "Task was destroyed but it is pending!" (logged when a task nobody awaited or
    cancelled is garbage collected)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Task was destroyed but it is pending" in message:
            self.found.append(message.splitlines()[0] + " " + message.splitlines()[-1][:300])


@pytest.fixture(autouse=True)
def _no_leaked_tasks() -> Iterator[None]:
    """A test fails if it leaves a pending asyncio task behind (its loop closed under it): collected
    before the next test starts, so the leak is charged to the test that made it."""
    leaks = _TaskLeaks()
    logger = logging.getLogger("asyncio")
    logger.addHandler(leaks)
    try:
        yield
        gc.collect()
    finally:
        logger.removeHandler(leaks)
    if leaks.found:
        pytest.fail(f"the test leaked {len(leaks.found)} pending asyncio task(s): {leaks.found[0]}", pytrace=False)
