"""Supervision of the long-running tasks of a process (reflectors, the writer, timers).

None of them ever ends by itself. If one does, or dies of an unexpected error, the supervisor logs it
with its traceback at once, counts it (``podmeter_task_failures_total{task}``), marks the process
unhealthy (``/healthz`` answers 503) and sets ``failed``: the command then exits non-zero, so the
DaemonSet (or Deployment) restarts it from a clean state. For the agent that is safe and complete: the
successor lists everything again and adopts what is pinned in the kernel (invariant I6), so nothing is
lost and nothing is left half-done by a task that silently stopped. The operator's successor lists every
pod again and takes its references back (its etcd references are bound to a lease: failure mode F15).

Work that runs outside the supervisor's own tasks (a thread, a task a library started) is watched
through :meth:`Supervisor.spawn` of a coroutine that raises once that work has failed, or through
:meth:`Supervisor.watch` of the task itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Coroutine
from typing import Any, NoReturn

log = logging.getLogger("podmeter.supervision")


class TaskEnded(RuntimeError):
    """A supervised task returned, which none of them ever should."""


class Supervisor:
    """Invariant: ``failed`` is set iff some supervised task ended other than by cancellation, and
    ``first_failure`` then names the first of them with its error."""

    def __init__(self) -> None:
        self.failures: Counter[str] = Counter()
        self.failed = asyncio.Event()
        self.first_failure: tuple[str, BaseException] | None = None
        self.tasks: list[asyncio.Task[Any]] = []

    @property
    def healthy(self) -> bool:
        return not self.failed.is_set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._ended)
        self.tasks.append(task)
        return task

    def watch(self, task: asyncio.Task[Any]) -> None:
        """Supervise a task someone else started and will cancel (not cancelled by :meth:`cancel_all`)."""
        task.add_done_callback(self._ended)

    async def wait_failure(self) -> NoReturn:
        """Wait until a supervised task fails, then raise its error (:class:`TaskEnded` if it returned)."""
        await self.failed.wait()
        assert self.first_failure is not None  # set together with ``failed``
        raise self.first_failure[1]

    def _ended(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        name = task.get_name()
        self.failures[name] += 1
        if error is None:
            log.error("task %s ended, which it never should: the process stops to be restarted", name)
            error = TaskEnded(f"task {name} ended")
        else:
            log.error("task %s died: %s: %s; the process stops to be restarted", name, type(error).__name__,
                      error, exc_info=error)
        if self.first_failure is None:
            self.first_failure = (name, error)
        self.failed.set()

    async def cancel_all(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            if not task.done():
                with contextlib.suppress(asyncio.CancelledError, Exception):  # a failure was logged by _ended
                    await task
        self.tasks = []
