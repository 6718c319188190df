"""Backoff between failed API requests: 0.8 s doubling to 30 s with jitter.

The numbers are client-go's: they keep a fleet of agents from stampeding an API server that is coming
back, while a single blip costs under a second. The reset rule is podmeter's: the delay goes back to its
start as soon as the server answers again (a list that completes, a watch that delivers a line), not
after two minutes of health, so an API server restart of a few seconds costs a few seconds, not the 30 s
the last failures had grown the delay to. (A failure long after the last one also starts afresh.)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Invariant: ``current`` is the base delay of the next failure, in [initial, cap]."""

    initial: float = 0.8
    cap: float = 30.0
    factor: float = 2.0
    jitter: float = 1.0  # up to +100 %, as client-go's wait.Jitter(1.0)
    reset_after: float = 120.0
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    current: float = 0.0
    _last_failure: float | None = None

    def __post_init__(self) -> None:
        self.current = self.initial

    def succeeded(self) -> None:
        """The server answered: the next failure waits the initial delay again."""
        self.current = self.initial
        self._last_failure = None

    def next_delay(self) -> float:
        """The delay to wait after a failure now; grows the next one."""
        now = self.clock()
        if self._last_failure is not None and now - self._last_failure > self.reset_after:
            self.current = self.initial
        self._last_failure = now
        delay = min(self.cap, self.current * (1 + self.jitter * self.rng.random()))
        self.current = min(self.cap, self.current * self.factor)
        return delay
