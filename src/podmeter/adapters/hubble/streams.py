"""A server stream the Hubble API may end early, its reader cut off (GetFlows, Notify): aborted once, by its
handler or, when the handler is stuck in a write to a reader that does not read, by a watchdog.

Next stage: ``adapters.hubble.observer`` and ``adapters.hubble.peer`` end their streams with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio

CUT_OFF_CHECK = 1.0  # seconds between two checks that a reader stuck in a write has been cut off


@dataclass(eq=False)
class EndableStream:
    """A server stream the server may end early, its reader cut off for falling behind (GetFlows, Notify):
    aborted once, by its handler or, when the handler is stuck in a write to a reader that does not read,
    by :meth:`watch`."""

    context: aio.ServicerContext[Any, Any]
    message: str
    ending: bool = False

    async def end(self) -> None:
        await self.end_with(self.message)

    async def end_with(self, message: str) -> None:
        if self.ending:
            return
        self.ending = True
        await self.context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    async def watch(self, cut_off: Callable[[], bool]) -> None:
        """End the stream once ``cut_off()`` holds and its handler has not ended it itself (it would
        notice only once its write completes)."""
        while not cut_off():
            await asyncio.sleep(CUT_OFF_CHECK)
        await asyncio.sleep(CUT_OFF_CHECK)  # the handler, if it is not stuck, ends it itself meanwhile
        with contextlib.suppress(Exception):
            await self.end()
