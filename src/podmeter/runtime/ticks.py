"""Timer ticks: the non-delta items of the agent's and the operator's event queues.

A periodic job (resync, expiry, sweep) is not run by its timer: the timer queues a :class:`Tick`, and the
one task that owns the state runs the job between two deltas. So a job never races the event stream,
and there is one writer of each piece of state.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any


class Tick(enum.Enum):
    RESYNC = "resync"  # agent: compare the filter with what the kernel holds, repair drift
    RETRY = "retry"  # agent: try a flush the datapath refused again
    EXPIRE = "expire"  # agent: drop traffic series whose grace period is over
    DRAIN = "drain"  # agent: drain the datapath's flows
    SWEEP = "sweep"  # operator: recompute identity references from the pod store
    SYNCED = "synced"  # operator: a (re)list was applied


async def every(period: float, queue: asyncio.Queue[Any], tick: Tick) -> None:
    """Queue ``tick`` every ``period`` seconds, until cancelled."""
    while True:
        await asyncio.sleep(period)
        await queue.put(tick)
