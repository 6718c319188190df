"""A fake :class:`~podmeter.adapters.kube.transport.Transport` for tests, in the style of httpx's MockTransport.

It lives with the tests, not in the product: nothing in podmeter uses it, and podmeter is a program, not a
library whose users would fake its transport (the reflector's rules are tested through it: tests/adapters).

A handler decides every answer::

    def handler(method: str, path: str, params: Params) -> MockAnswer:
        if "watch" not in params:
            return MockAnswer.json(list_body([pod], resource_version="10"))
        return MockAnswer.stream([watch_line("ADDED", pod), bookmark_line("12"), Stall(0.01)])

    transport = MockTransport(handler)
    ...
    assert transport.requests[1].params["resourceVersion"] == "10"

``method`` is always ``"GET"`` (the reflector only reads); a watch is told apart by ``params["watch"]``, as on
the wire. The handler may also raise :class:`~podmeter.adapters.kube.transport.TransportError` itself, which the
caller sees as "no HTTP answer" (connection refused, DNS, TLS).

An answer is a status, headers and a sequence of steps, played in order:

* ``bytes``: one chunk, sent as is (so a test can split a line across chunks, or send two lines in one);
* a ``Mapping``: one JSON line (the mapping encoded, then ``\\n``), in one chunk;
* :class:`Stall`: send nothing for ``seconds`` (``None``: forever, until the reader gives up or is cancelled);
* :class:`Reset`: the connection breaks: the reader gets a ``TransportError``; later steps are never played;
* the end of the sequence is the end of the body (EOF).

``get`` reads the whole answer (``body`` then every step) within its ``timeout`` and raises ``TransportError``
past it, as the real transports do; ``stream`` hands a status-200 answer's steps over one by one through
``chunks()``, and reads any other answer whole into ``answer.body`` (again as the real transports do).

Nothing here does I/O: stalls are asyncio sleeps, so a test controls time by choosing short ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from podmeter.adapters.kube.transport import Answer, Params, Stream, TransportError

__all__ = [
    "Handler",
    "MockAnswer",
    "MockRequest",
    "MockTransport",
    "Reset",
    "Stall",
    "Step",
    "bookmark_line",
    "error_line",
    "list_body",
    "status_body",
    "watch_line",
]


@dataclass(frozen=True)
class Stall:
    """Send nothing for ``seconds``; ``None`` stalls forever (the reader's deadline or a cancel ends it)."""

    seconds: float | None = None


@dataclass(frozen=True)
class Reset:
    """The connection breaks here: the reader gets ``TransportError(message)``."""

    message: str = "connection reset by peer"


Step: TypeAlias = bytes | Mapping[str, object] | Stall | Reset


@dataclass(frozen=True)
class MockAnswer:
    """What the fake server answers: ``status``, ``headers``, then ``body`` followed by ``steps``.

    ``reason`` defaults to the standard phrase of ``status``.
    """

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    steps: Sequence[Step] = ()
    reason: str = ""

    @classmethod
    def json(cls, obj: object, status: int = 200, headers: Mapping[str, str] | None = None) -> MockAnswer:
        """A whole JSON body (a list page, a Status)."""
        return cls(status, dict(headers or {}), json.dumps(obj).encode())

    @classmethod
    def stream(cls, steps: Sequence[Step], status: int = 200,
               headers: Mapping[str, str] | None = None) -> MockAnswer:
        """A body played step by step (a watch)."""
        return cls(status, dict(headers or {}), b"", tuple(steps))

    @classmethod
    def error(cls, status: int, reason: str = "", message: str = "",
              headers: Mapping[str, str] | None = None) -> MockAnswer:
        """An HTTP error with a Kubernetes ``Status`` body, e.g. ``MockAnswer.error(410, "Expired")``."""
        return cls.json(status_body(status, reason, message), status, headers)

    def phrase(self) -> str:
        if self.reason:
            return self.reason
        try:
            return http.HTTPStatus(self.status).phrase
        except ValueError:
            return ""


@dataclass(frozen=True)
class MockRequest:
    """One request the transport received: ``stream`` tells ``stream()`` from ``get()``."""

    method: str
    path: str
    params: Mapping[str, str]
    stream: bool
    timeout: float | None = None


Handler: TypeAlias = Callable[[str, str, Params], MockAnswer]


class MockTransport:
    """A :class:`~podmeter.adapters.kube.transport.Transport` whose answers come from ``handler``.

    ``requests`` lists every request in the order received (a copy of its params, so later changes by the
    caller do not rewrite history); ``open_streams`` counts streams entered and not yet left; ``closed`` is
    set by :meth:`close`, after which every request raises ``TransportError``.
    """

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[MockRequest] = []
        self.open_streams = 0
        self.closed = False

    async def _answer(self, path: str, params: Params, stream: bool, timeout: float | None) -> MockAnswer:
        await asyncio.sleep(0)  # a real request always waits for the network: let other tasks (a cancel) run
        if self.closed:
            raise TransportError("transport closed")
        self.requests.append(MockRequest("GET", path, dict(params), stream, timeout))
        return self.handler("GET", path, dict(params))

    async def get(self, path: str, params: Params, timeout: float) -> Answer:
        mock = await self._answer(path, params, False, timeout)
        try:
            async with asyncio.timeout(timeout):
                body = await _read_all(mock)
        except TimeoutError:
            raise TransportError(f"no answer within {timeout}s") from None
        return Answer(mock.status, mock.phrase(), dict(mock.headers), body)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, params: Params) -> AsyncIterator[Stream]:
        mock = await self._answer(path, params, True, None)
        answer = Answer(mock.status, mock.phrase(), dict(mock.headers))
        body: Sequence[Step] = (mock.body, *mock.steps)
        if mock.status != 200:
            answer.body, body = await _read_all(mock), ()
        self.open_streams += 1
        try:
            yield _MockStream(answer, body)
        finally:
            self.open_streams -= 1

    async def close(self) -> None:
        self.closed = True


@dataclass
class _MockStream:
    answer: Answer
    steps: Sequence[Step]

    async def chunks(self) -> AsyncIterator[bytes]:
        for step in self.steps:
            chunk = await _play(step)
            if chunk:
                yield chunk


async def _play(step: Step) -> bytes:
    """One step: the bytes it sends (``b""`` for a stall), or TransportError for a reset."""
    if isinstance(step, Stall):
        if step.seconds is None:
            await asyncio.get_running_loop().create_future()  # never set: only a cancel ends it
        else:
            await asyncio.sleep(step.seconds)
        return b""
    if isinstance(step, Reset):
        raise TransportError(step.message)
    if isinstance(step, bytes):
        return step
    return json.dumps(step).encode() + b"\n"


async def _read_all(mock: MockAnswer) -> bytes:
    parts = [mock.body]
    for step in mock.steps:
        parts.append(await _play(step))
    return b"".join(parts)


# --- Kubernetes shapes -------------------------------------------------------------------------------


def status_body(code: int, reason: str = "", message: str = "") -> dict[str, object]:
    """A ``metav1.Status`` failure, as in an error answer or a watch ERROR event."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def list_body(items: Sequence[Mapping[str, object]], resource_version: str, continue_token: str = "",
              kind: str = "PodList") -> dict[str, object]:
    """One page of a list answer; a non-empty ``continue_token`` says more pages follow."""
    metadata: dict[str, object] = {"resourceVersion": resource_version}
    if continue_token:
        metadata["continue"] = continue_token
    return {"kind": kind, "apiVersion": "v1", "metadata": metadata, "items": list(items)}


def watch_line(event_type: str, obj: Mapping[str, object]) -> bytes:
    """One watch event line (``ADDED``, ``MODIFIED``, ``DELETED``, ``BOOKMARK``, ``ERROR``)."""
    return json.dumps({"type": event_type, "object": obj}).encode() + b"\n"


def bookmark_line(resource_version: str, kind: str = "Pod") -> bytes:
    """A BOOKMARK event: only the object's resourceVersion is meaningful."""
    return watch_line("BOOKMARK", {"kind": kind, "apiVersion": "v1",
                                   "metadata": {"resourceVersion": resource_version}})


def error_line(code: int, reason: str = "", message: str = "") -> bytes:
    """A watch ERROR event carrying a Status, e.g. ``error_line(410, "Expired")``."""
    return watch_line("ERROR", status_body(code, reason, message))
