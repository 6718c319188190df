"""Fault knobs: the failures that make consumers leak in the field, switched on over the admin endpoint.

- ``fail``: the next N API requests (optionally only of one verb) answer 500 InternalError, 503
  ServiceUnavailable or 429 TooManyRequests with ``Retry-After``, before any other processing.
- ``stall``: open watch streams (and, with ``include_new``, streams opened later) stop sending anything,
  bookmarks included, until ``unstall`` or the optional duration ends; what they missed is delivered after.
- ``close-watches``, ``compact`` and ``restart`` act on the server directly (see app.py); this module only
  holds the state the request path consults.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from podmeter.lab.apiserver.errors import ApiError, internal, service_unavailable, too_many_requests


@dataclass
class FailPlan:
    remaining: int
    code: int
    retry_after: int
    verb: str | None

    def error(self) -> ApiError:
        if self.code == 429:
            return too_many_requests(self.retry_after)
        if self.code == 503:
            return service_unavailable()
        return internal("injected fault (podmeter lab)")


@dataclass
class Faults:
    """Mutable fault state. ``stall_generation`` lets a stream know whether it is affected."""

    fail: FailPlan | None = None
    stalled: bool = False
    stall_new: bool = False
    stall_until: float | None = None
    stall_epoch: int = 0
    injected_failures: int = 0
    history: list[dict[str, object]] = field(default_factory=list)

    def set_fail(self, count: int, code: int, retry_after: int = 1, verb: str | None = None) -> None:
        if code not in (429, 500, 503):
            raise ValueError("fail code must be 429, 500 or 503")
        self.fail = FailPlan(count, code, retry_after, verb) if count > 0 else None
        self._log("fail", count=count, code=code, verb=verb)

    def take_failure(self, verb: str) -> ApiError | None:
        """The error to answer this request with, if a fail plan covers it (consumes one)."""
        plan = self.fail
        if plan is None or (plan.verb is not None and plan.verb != verb):
            return None
        plan.remaining -= 1
        if plan.remaining <= 0:
            self.fail = None
        self.injected_failures += 1
        return plan.error()

    def stall(self, seconds: float | None, include_new: bool) -> None:
        self.stalled = True
        self.stall_new = include_new
        self.stall_until = time.monotonic() + seconds if seconds else None
        self.stall_epoch += 1
        self._log("stall", seconds=seconds, include_new=include_new)

    def unstall(self) -> None:
        self.stalled = False
        self.stall_until = None
        self._log("unstall")

    def is_stalled(self, stream_epoch: int) -> bool:
        """Whether a stream opened at ``stream_epoch`` must stay silent now."""
        if not self.stalled:
            return False
        if self.stall_until is not None and time.monotonic() >= self.stall_until:
            self.unstall()
            return False
        return stream_epoch < self.stall_epoch or self.stall_new

    def _log(self, what: str, **info: object) -> None:
        self.history.append({"fault": what, "at": time.time(), **info})
        del self.history[:-100]
