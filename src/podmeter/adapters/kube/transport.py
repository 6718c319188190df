"""The HTTP seam under the reflector: one protocol, two implementations.

* :class:`AiohttpTransport` (default): aiohttp with the TLS context and credentials that lightkube
  derives from the configuration (CA, client certificate, insecure flag, bearer token or token file, basic
  auth). Its stream reader is several times faster than httpx's on 7 KiB watch lines, which is most of
  the agent's ingest cost (see ``bench/agent.py``).
* :class:`HttpxTransport`: lightkube's own httpx client, used when the credentials need an exec plugin
  or an auth provider, which only lightkube knows how to run.

Both raise :class:`TransportError` for anything that is not an HTTP answer (refused, reset, TLS, DNS).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp
import httpx2 as httpx
from lightkube.config import client_adapter
from lightkube.config.kubeconfig import SingleConfig

Params = dict[str, str]


class TransportError(Exception):
    """The request got no HTTP answer."""


@dataclass
class Answer:
    """An HTTP answer: status, headers and (for non-streams) the whole body."""

    status: int
    reason: str
    headers: dict[str, str]
    body: bytes = b""


class Stream(Protocol):
    answer: Answer

    def chunks(self) -> AsyncIterator[bytes]: ...


class Transport(Protocol):
    async def get(self, path: str, params: Params, timeout: float) -> Answer: ...

    def stream(self, path: str, params: Params) -> contextlib.AbstractAsyncContextManager[Stream]: ...

    async def close(self) -> None: ...


def make_transport(config: SingleConfig, request_timeout: float = 30.0) -> Transport:
    user = config.user
    if user is not None and (user.exec is not None or user.auth_provider is not None):
        return HttpxTransport(config, request_timeout)
    return AiohttpTransport(config)


# --- aiohttp -------------------------------------------------------------------------------------


TLS_CLOSE_GRACE = 0.25  # seconds


class _BearerToken:
    """Static token, or a token file re-read when the server answers 401 (the kubelet rotates it)."""

    def __init__(self, token: str | None, token_file: str | None) -> None:
        self._token = token.strip() if token else None
        self._file = token_file

    def header(self, refresh: bool = False) -> str | None:
        if self._file and (refresh or self._token is None):
            self._token = Path(self._file).read_text().strip()
        return f"Bearer {self._token}" if self._token else None


@dataclass
class _AiohttpStream:
    answer: Answer
    response: aiohttp.ClientResponse

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, OSError) as exc:
            raise TransportError(str(exc) or type(exc).__name__) from exc


class AiohttpTransport:
    def __init__(self, config: SingleConfig) -> None:
        self.base = str(config.cluster.server).rstrip("/")
        user = config.user
        self._ssl: ssl.SSLContext | bool = False
        if self.base.startswith("https"):
            assert user is not None
            self._ssl = client_adapter.verify_cluster(config.cluster, user, config.abs_file, trust_env=False)
        # A relative tokenFile is relative to the kubeconfig's directory, like every path a kubeconfig names.
        token_file = str(config.abs_file(user.token_file)) if user is not None and user.token_file else None
        self._token = _BearerToken(user.token if user else None, token_file)
        self._basic = None
        if user is not None and user.username and user.password:
            raw = f"{user.username}:{user.password}".encode()
            self._basic = "Basic " + base64.b64encode(raw).decode()
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl, limit=16)
            self._session = aiohttp.ClientSession(connector=connector, read_bufsize=1 << 18)
        return self._session

    def _headers(self, refresh: bool = False) -> dict[str, str]:
        auth = self._token.header(refresh) or self._basic
        return {"Accept": "application/json", **({"Authorization": auth} if auth else {})}

    async def get(self, path: str, params: Params, timeout: float) -> Answer:
        for refresh in (False, True):
            try:
                async with self._client().get(self.base + path, params=params, headers=self._headers(refresh),
                                              timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                    answer = Answer(response.status, response.reason or "", dict(response.headers),
                                    await response.read())
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                raise TransportError(str(exc) or type(exc).__name__) from exc
            if answer.status != 401 or refresh:
                return answer
        return answer

    @contextlib.asynccontextmanager
    async def stream(self, path: str, params: Params) -> AsyncIterator[Stream]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        try:
            response = await self._client().get(self.base + path, params=params, headers=self._headers(),
                                                 timeout=timeout)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise TransportError(str(exc) or type(exc).__name__) from exc
        try:
            answer = Answer(response.status, response.reason or "", dict(response.headers))
            if response.status != 200:
                answer.body = await response.read()
                if response.status == 401:
                    self._token.header(refresh=True)
            yield _AiohttpStream(answer, response)
        finally:
            response.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
            if self._ssl:  # TLS connections finish their close_notify after the session closes (aiohttp's
                await asyncio.sleep(TLS_CLOSE_GRACE)  # documented graceful shutdown): give them the moment


# --- httpx (lightkube's client) ---------------------------------------------------------------------


@dataclass
class _HttpxStream:
    answer: Answer
    response: httpx.Response

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.aiter_bytes():
                yield chunk
        except httpx.TransportError as exc:
            raise TransportError(str(exc) or type(exc).__name__) from exc


class HttpxTransport:
    def __init__(self, config: SingleConfig, request_timeout: float = 30.0) -> None:
        params = client_adapter.ConnectionParams(timeout=httpx.Timeout(request_timeout, read=None), trust_env=False)
        self._client = client_adapter.AsyncClient(config, params)

    async def get(self, path: str, params: Params, timeout: float) -> Answer:
        try:
            response = await self._client.get(path, params=params, timeout=timeout)
        except httpx.TransportError as exc:
            raise TransportError(str(exc) or type(exc).__name__) from exc
        return Answer(response.status_code, response.reason_phrase, dict(response.headers), response.content)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, params: Params) -> AsyncIterator[Stream]:
        try:
            async with self._client.stream("GET", path, params=params) as response:
                answer = Answer(response.status_code, response.reason_phrase, dict(response.headers))
                if response.status_code != 200:
                    answer.body = await response.aread()
                yield _HttpxStream(answer, response)
        except httpx.TransportError as exc:
            raise TransportError(str(exc) or type(exc).__name__) from exc

    async def close(self) -> None:
        await self._client.aclose()
