"""The one HTTP app of the agent and the operator: ``/metrics``, ``/healthz``, ``/readyz``, ``/debug/...``.

One rule for every ``/debug/*`` path of both processes: it answers only requests from loopback unless
``debug_remote`` is set (``--debug-remote`` of the agent and of the operator), because debug views list pod
names and IPs, which a node's metrics port (often reachable cluster-wide for Prometheus) should not. An
IPv4 loopback client of a dual-stack IPv6 socket arrives as an IPv4-mapped address (``::ffff:127.0.0.1``):
that is loopback too.
"""

from __future__ import annotations

import inspect
import ipaddress
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

# A debug view returns JSON-serialisable data, directly or from a coroutine (a backend read).
DebugView = Callable[[], Any | Awaitable[Any]]
DebugViews = Mapping[str, DebugView]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The answer to a client that is not on loopback: which flag opens the debug endpoints (the same one on the
# agent and the operator).
FORBIDDEN = "debug endpoints answer loopback clients only; start podmeter with --debug-remote to open them\n"


def build_app(registry: CollectorRegistry, ready: Callable[[], bool], debug: DebugViews,
              debug_remote: bool = False, expositions: Sequence[Callable[[], bytes]] = (),
              *, debug_streams: Mapping[str, Handler] | None = None,
              healthy: Callable[[], bool] = lambda: True,
              metrics_min_interval: float = 0.0) -> web.Application:
    """``expositions`` render extra series in the text format themselves (the per-pod traffic: too many
    samples to build prometheus_client objects for on every scrape). ``debug_streams`` are handlers of
    their own under ``/debug/`` (the flow stream), behind the same access rule as the debug views."""
    app = web.Application()
    rendered: list[tuple[float, bytes]] = []  # the last exposition and when it was made

    async def metrics(_: web.Request) -> web.Response:
        # Rendering runs on the event loop the writer shares: however many scrapers come, it happens at
        # most once per metrics_min_interval, and the others get that exposition (docs/install.md).
        now = time.monotonic()
        if not rendered or now - rendered[0][0] >= metrics_min_interval:
            rendered[:] = [(now, generate_latest(registry) + b"".join(render() for render in expositions))]
        return web.Response(body=rendered[0][1], headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        if healthy():
            return web.Response(text="ok\n")
        return web.Response(status=503, text="unhealthy: a task died (see the log); the process is stopping\n")

    async def readyz(_: web.Request) -> web.Response:
        if ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready: waiting for the first lists to be applied\n")

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    for path, view in debug.items():
        app.router.add_get(path, _guarded(_json_view(view), debug_remote))
    for path, handler in (debug_streams or {}).items():
        app.router.add_get(path, _guarded(handler, debug_remote))
    return app


def _json_view(view: DebugView) -> Handler:
    async def handler(_: web.Request) -> web.StreamResponse:
        body = view()
        if inspect.isawaitable(body):
            body = await body
        return web.Response(text=json.dumps(body, indent=1, sort_keys=True) + "\n",
                            content_type="application/json")

    return handler


def _guarded(handler: Handler, debug_remote: bool) -> Handler:
    """The one access rule of ``/debug/*``: loopback clients only, unless ``debug_remote``."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        if not debug_remote and not is_loopback(request.remote):
            return web.Response(status=403, text=FORBIDDEN)
        return await handler(request)

    return guarded


def is_loopback(remote: str | None) -> bool:
    """Whether a client address is loopback: 127.0.0.0/8, ::1, or 127.0.0.0/8 mapped into IPv6 (which
    Python before 3.13 does not call loopback). Anything else, no address or not an IP (a Unix socket's
    peer), is not."""
    try:
        address = ipaddress.ip_address((remote or "").split("%", 1)[0])  # a scope id (fe80::1%eth0) aside
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return (mapped or address).is_loopback


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9978`` for IPv6) -> (host, port); ValueError with a clear message."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen {value!r}: expected HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


async def serve(app: web.Application, listen: str) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (for cleanup) and the bound port (useful with port 0)."""
    host, port = parse_listen(listen)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    for address in runner.addresses:  # the real port when 0 was asked for
        bound = int(address[1])
    return runner, bound
