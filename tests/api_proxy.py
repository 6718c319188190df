"""An HTTP front of the lab API server that answers some requests itself, as a real kube-apiserver would
(a 403 where RBAC grants nothing, a 404 where a CRD is not installed), and passes everything else through,
watches included, chunk by chunk. The lab API server serves every resource, so the tests that need a
refusal put this in front of it and give the process under test ``kubeconfig``."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from lab_server import LabServer

# request -> the answer to give instead of the API server's, or None to pass the request through
Answer = Callable[[web.Request], "web.Response | None"]


class ApiProxy:
    """``with ApiProxy(upstream, answer, directory) as proxy``: ``proxy.kubeconfig`` names it, ``answered``
    counts the requests ``answer`` took."""

    def __init__(self, upstream: LabServer, answer: Answer, directory: Path, name: str = "kubeconfig-proxy") -> None:
        self.upstream, self.answer = upstream, answer
        self.kubeconfig = directory / name
        self.answered = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ApiProxy:
        self.thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        config = yaml.safe_load(self.upstream.kubeconfig.read_text())
        config["clusters"][0]["cluster"]["server"] = f"http://127.0.0.1:{port}"
        self.kubeconfig.write_text(yaml.safe_dump(config))
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()

    async def _start(self) -> int:
        self.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # Watches passed through stay open after their client went: cancelled at the end, not waited for.
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port: int = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return port

    async def _stop(self) -> None:
        await self.session.close()  # ends the watches passed through first: nothing for cleanup to wait on
        await self.runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        own = self.answer(request)
        if own is not None:
            self.answered += 1
            return own
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self.session.request(request.method, self.upstream.url + request.path_qs, headers=headers,
                                        data=await request.read()) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "connection")})
            await response.prepare(request)
            with contextlib.suppress(aiohttp.ClientError, ConnectionResetError):  # a watch cut at the end
                async for chunk in upstream.content.iter_any():  # watch lines as they come
                    await response.write(chunk)
                await response.write_eof()
            return response
