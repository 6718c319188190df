"""Backoff between failed API requests: 0.8 s doubling to 30 s with jitter, reset after 2 minutes healthy.

The numbers are client-go's: they keep a fleet of agents from stampeding an API server that is coming
back, while a single blip costs under a second.
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

    def next_delay(self) -> float:
        """The delay to wait after a failure now; grows the next one."""
        now = self.clock()
        if self._last_failure is not None and now - self._last_failure > self.reset_after:
            self.current = self.initial
        self._last_failure = now
        delay = min(self.cap, self.current * (1 + self.jitter * self.rng.random()))
        self.current = min(self.cap, self.current * self.factor)
        return delay
