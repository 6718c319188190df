"""A small synchronous Kubernetes client for the lab's own processes (node, scenario runner, checks).

Standard library HTTP (any thread, no event loop), one kept-alive connection per thread: a soak makes
hundreds of requests a second, and a new TCP connection per request cost the lab, the node and the API
server more CPU than the requests themselves. The checks must not share code paths with the product
they judge, so this is not the agent's client. Configuration comes from a kubeconfig through the
product's loader: a token (or token file), a CA (file or data), a client certificate and key (file or data)
or the insecure flag; ``podmeter lab --kubeconfig`` points it at any API server (docs/lab.md). Exec plugins
and auth providers are refused (a clear error, not a run of 401s). Over HTTPS the server's certificate is
verified against the kubeconfig's CA.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightkube.config.kubeconfig import SingleConfig
from lightkube.config.models import FileStr

from podmeter.adapters.kube.connection import ConnectionConfigError, load_connection

MERGE_PATCH = "application/merge-patch+json"
RETRIES = 8
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class KubeError(RuntimeError):
    """The API server answered an error status (``status``), or could not be reached (``status`` 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status


class KubeClient:
    """``KubeClient.from_kubeconfig(path).list("/api/v1/pods", fieldSelector=...)`` and friends."""

    def __init__(self, server: str, token: str | None, ca_file: str | None, timeout: float = 10.0, *,
                 client_cert: tuple[str, str] | None = None, insecure: bool = False) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self.ca_file = ca_file  # (a *-data CA's temporary file lives as long as this reference)
        self.timeout = timeout
        self._context: ssl.SSLContext | None = None
        if self.server.startswith("https"):
            # Verifies the server's certificate and name against the kubeconfig's CA (else the system's);
            # each thread's kept-alive connection makes the handshake once, not per request.
            self._context = ssl.create_default_context(cafile=ca_file)
            if insecure:
                self._context.check_hostname = False
                self._context.verify_mode = ssl.CERT_NONE
            if client_cert is not None:
                self._context.load_cert_chain(*client_cert)
        self._address = urllib.parse.urlsplit(self.server)
        self._local = threading.local()  # .held: this thread's kept-alive connection
        self._held: weakref.WeakSet[_Held] = weakref.WeakSet()

    @classmethod
    def from_kubeconfig(cls, path: str, timeout: float = 10.0) -> KubeClient:
        # The product's rules: no credentials over plain HTTP unless PODMETER_ALLOW_PLAIN_HTTP_CREDENTIALS
        # says so (a test server); the lab's own server is HTTPS.
        connection = load_connection(path)
        config = connection.config
        cluster, user = config.cluster, config.user
        if user is not None and (user.exec or user.auth_provider):  # else: a client without credentials, 401s
            raise ConnectionConfigError(f"{connection.source}: the lab's client authenticates with a token, a token "
                                        "file or a client certificate, not an exec plugin or an auth provider: give "
                                        "it a kubeconfig whose user has a token")
        # *-data fields become temporary files (lightkube's FileStr), read at once by the SSL context.
        ca = _file(config, cluster.certificate_auth, cluster.certificate_auth_data)
        cert = key = None
        token = None
        if user is not None:
            cert = _file(config, user.client_cert, user.client_cert_data)
            key = _file(config, user.client_key, user.client_key_data)
            token = user.token
            if token is None and user.token_file:
                token = Path(str(config.abs_file(user.token_file))).read_text().strip()
        return cls(cluster.server, token, ca, timeout, client_cert=(cert, key) if cert and key else None,
                   insecure=cluster.insecure)

    # --- verbs ------------------------------------------------------------------------------------

    def get(self, path: str, **query: str) -> dict[str, Any] | None:
        """The object at ``path``, or None when it does not exist (404)."""
        try:
            return self._call("GET", path, query)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, path: str, **query: str) -> dict[str, Any]:
        return self._call("GET", path, query)

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", path, {}, body)

    def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """A merge patch; None when the object is gone (a pod deleted meanwhile is no error for the lab)."""
        try:
            return self._call("PATCH", path, {}, body, MERGE_PATCH)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def delete(self, path: str, grace_seconds: int | None = None) -> dict[str, Any] | None:
        """Delete; the server's answer (the object as it was deleted), or None when it was already gone."""
        body = {"gracePeriodSeconds": grace_seconds} if grace_seconds is not None else None
        try:
            return self._call("DELETE", path, {}, body)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def watch(self, path: str, timeout_seconds: int, **query: str) -> Iterator[dict[str, Any]]:
        """Watch events (parsed lines) until the server ends the stream; raises KubeError on failure."""
        params = {**query, "watch": "1", "timeoutSeconds": str(timeout_seconds), "allowWatchBookmarks": "true"}
        request = self._request("GET", path, params)
        try:
            with urllib.request.urlopen(  # noqa: S310 (the kubeconfig's server)
                request, timeout=timeout_seconds + 10, context=self._context
            ) as response:
                for line in response:
                    if line.strip():
                        yield json.loads(line)
        except urllib.error.HTTPError as exc:
            raise KubeError(exc.code, exc.read().decode(errors="replace")[:500]) from None
        except (OSError, ValueError) as exc:
            raise KubeError(0, f"watch {path}: {exc}") from None

    # --- plumbing ---------------------------------------------------------------------------------

    def _request(self, method: str, path: str, query: dict[str, str]) -> urllib.request.Request:
        url = self.server + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        return urllib.request.Request(url, method=method, headers=self._headers(None, None)[0])  # noqa: S310

    def _headers(self, body: dict[str, Any] | None, content_type: str | None) -> tuple[dict[str, str], bytes | None]:
        """The request's headers and encoded body."""
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if body is None:
            return headers, None
        headers["Content-Type"] = content_type or "application/json"
        return headers, json.dumps(body).encode()

    def _call(self, method: str, path: str, query: dict[str, str], body: dict[str, Any] | None = None,
              content_type: str | None = None) -> dict[str, Any]:
        """One request, retried like a client library would on 429/5xx (scenarios inject those faults
        for the agent; the lab's own requests must get through them)."""
        for attempt in range(RETRIES):
            try:
                return self._once(method, path, query, body, content_type)
            except KubeError as exc:
                if exc.status not in RETRY_STATUSES or attempt == RETRIES - 1:
                    raise
                time.sleep(min(1.0, 0.05 * 2**attempt))
        raise AssertionError("unreachable")

    def _once(self, method: str, path: str, query: dict[str, str], body: dict[str, Any] | None,
              content_type: str | None) -> dict[str, Any]:
        target = path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        headers, data = self._headers(body, content_type)
        status, payload = self._exchange(method, target, data, headers)
        if status >= 400:
            raise KubeError(status, f"{method} {path}: {payload.decode(errors='replace')[:500]}")
        result: dict[str, Any] = json.loads(payload or b"{}")
        return result

    def _exchange(self, method: str, target: str, data: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        """Send on this thread's connection. A kept-alive connection the server has closed meanwhile fails
        on first use; then (only then) the request goes once more on a fresh connection."""
        for may_retry in (True, False):
            connection, was_open = self._connection()
            try:
                connection.request(method, target, body=data, headers=headers)
                response = connection.getresponse()
                return response.status, response.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self._drop()
                if not (may_retry and was_open):
                    raise KubeError(0, f"{method} {target}: {exc}") from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop()
                raise KubeError(0, f"{method} {target}: {exc}") from None
        raise AssertionError("unreachable")

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it was already open (kept alive from an earlier call)."""
        holder: _Held | None = getattr(self._local, "held", None)
        if holder is not None and holder.connection is not None:
            return holder.connection, True
        host, port = self._address.hostname or "localhost", self._address.port
        if self._address.scheme == "https":
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=self.timeout, context=self._context)
        else:
            connection = http.client.HTTPConnection(host, port, timeout=self.timeout)
        holder = self._local.held = _Held(connection)
        self._held.add(holder)
        return connection, False

    def _drop(self) -> None:
        holder: _Held | None = getattr(self._local, "held", None)
        if holder is not None:
            holder.close()

    def close(self) -> None:
        """Close every thread's kept-alive connection (a thread's own also goes when the thread ends)."""
        for holder in list(self._held):
            holder.close()


class _Held:
    """One thread's connection, closed when the thread ends (its thread-local goes) or the client closes:
    never left to the garbage collector open."""

    def __init__(self, connection: http.client.HTTPConnection) -> None:
        self.connection: http.client.HTTPConnection | None = connection

    def close(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.close()

    def __del__(self) -> None:
        self.close()


def _file(config: SingleConfig, path: str | None, data: str | None) -> str | None:
    if path:
        return str(config.abs_file(path))
    return FileStr(data) if data else None


def pod_path(namespace: str, name: str = "", subresource: str = "") -> str:
    path = f"/api/v1/namespaces/{namespace}/pods"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path
