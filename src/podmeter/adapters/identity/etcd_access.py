"""How the etcd backend reaches its store: endpoints, TLS with client certificates, an etcd user.

The options are etcdctl's: ``--cacert`` (the CA that signed the servers' certificates; without it, the
system's CAs), ``--cert`` and ``--key`` (this client's certificate, for servers started with
``--client-cert-auth``), and a user (``--user``; podmeter reads the password from a file, never from
a flag or the environment). Rules, checked before anything connects (:meth:`EtcdAccess.endpoints`):

- ``https://HOST:PORT`` is TLS, ``http://HOST:PORT`` plaintext; a bare ``HOST:PORT`` is TLS when a
  certificate option is given and plaintext otherwise (as etcdctl reads it). All endpoints use one scheme.
- Certificate options need TLS endpoints: ``http://`` with ``--etcd-cacert`` is an error, not a silent
  downgrade. ``--etcd-cert`` and ``--etcd-key`` go together.
- A password is never sent in clear: ``--etcd-username`` needs TLS endpoints and a password file.

Files are read each time a connection is made (:meth:`EtcdAccess.load`), so a rotated Secret is picked up
by the next connection; a missing, unreadable or malformed file is an :class:`EtcdAccessError` naming the
option and the file.

The client library, aetcd 1.0, opens plaintext gRPC channels only and authenticates once per connection
(etcd's tokens expire: 5 minutes idle by default). :class:`_Client` is aetcd's client with a connection
step of its own: a TLS channel when the endpoints are ``https``, and the user's token requested over it;
the backend reconnects (and so authenticates again) when etcd says the token is no longer valid.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc
import grpc.aio

from podmeter.adapters.identity.base import IdentityBackendError
from podmeter.model.hostport import host_port

DEFAULT_PORT = 2379


class EtcdAccessError(IdentityBackendError, ValueError):
    """The options or the files they name are wrong: a clear message, nothing to retry until fixed."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    tls: bool

    @property
    def target(self) -> str:
        """gRPC's ``HOST:PORT`` (an IPv6 address in brackets)."""
        return host_port(self.host, self.port)

    def __str__(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.target}"


@dataclass(frozen=True, slots=True)
class Credentials:
    """What one connection uses: file contents, read by :meth:`EtcdAccess.load`."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    username: str | None = None
    password: str | None = None


@dataclass(frozen=True, slots=True)
class EtcdAccess:
    """The access options as given (paths, not contents); empty means not given."""

    cacert: str = ""
    cert: str = ""
    key: str = ""
    username: str = ""
    password_file: str = ""

    @property
    def certificates(self) -> bool:
        return bool(self.cacert or self.cert or self.key)

    def endpoints(self, urls: Sequence[str]) -> list[Endpoint]:
        """The endpoints these options allow, or a clear error (see the module docstring for the rules)."""
        if not urls:
            raise EtcdAccessError("the etcd backend needs at least one endpoint (--etcd-endpoints)")
        if bool(self.cert) != bool(self.key):
            raise EtcdAccessError("--etcd-cert and --etcd-key go together: a client certificate needs its key")
        if bool(self.username) != bool(self.password_file):
            raise EtcdAccessError("--etcd-username and --etcd-password-file go together")
        out = [parse_endpoint(url, tls_default=self.certificates) for url in urls]
        if len({e.tls for e in out}) > 1:
            raise EtcdAccessError(f"etcd endpoints {', '.join(urls)}: some are https, some http; use one scheme")
        if not out[0].tls:
            if self.certificates:
                given = [f for f, v in (("--etcd-cacert", self.cacert), ("--etcd-cert", self.cert),
                                        ("--etcd-key", self.key)) if v]
                raise EtcdAccessError(f"{', '.join(given)} given, but the etcd endpoints are http://; "
                                      "use https:// endpoints (certificates are for TLS)")
            if self.username:
                raise EtcdAccessError("--etcd-username sends a password, which is never sent in clear: "
                                      "use https:// etcd endpoints")
        return out

    def load(self) -> Credentials:
        """Read the files the options name; EtcdAccessError says which option and file failed and why."""
        password = None
        if self.password_file:
            raw = _read("--etcd-password-file", self.password_file)
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                raise EtcdAccessError(f"--etcd-password-file {self.password_file}: not UTF-8 text") from None
            password = text.removesuffix("\n").removesuffix("\r")  # a file written by echo ends in one
            if not password:
                raise EtcdAccessError(f"--etcd-password-file {self.password_file}: the file is empty")
        return Credentials(
            root_certificates=_pem("--etcd-cacert", self.cacert, b"CERTIFICATE") if self.cacert else None,
            private_key=_pem("--etcd-key", self.key, b"PRIVATE KEY") if self.key else None,
            certificate_chain=_pem("--etcd-cert", self.cert, b"CERTIFICATE") if self.cert else None,
            username=self.username or None,
            password=password,
        )


def parse_endpoint(url: str, tls_default: bool = False) -> Endpoint:
    """``https://HOST:PORT``, ``http://HOST:PORT`` or ``HOST:PORT`` (TLS iff ``tls_default``)."""
    parts = urlsplit(url if "//" in url else f"//{url}")
    if parts.scheme not in ("http", "https", ""):
        raise EtcdAccessError(f"etcd endpoint {url!r}: expected https://HOST:PORT or http://HOST:PORT")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise EtcdAccessError(f"etcd endpoint {url!r}: the port is not a number from 1 to 65535") from None
    if not parts.hostname or parts.path not in ("", "/") or parts.query or parts.username:
        raise EtcdAccessError(f"etcd endpoint {url!r}: expected https://HOST:PORT or http://HOST:PORT")
    tls = parts.scheme == "https" or (not parts.scheme and tls_default)
    return Endpoint(parts.hostname, port, tls)


def _read(option: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise EtcdAccessError(f"{option} {path}: {exc.strerror or exc}") from None


def _pem(option: str, path: str, kind: bytes) -> bytes:
    data = _read(option, path)
    if b"-----BEGIN " not in data or kind + b"-----" not in data:
        raise EtcdAccessError(f"{option} {path}: no PEM {kind.decode().lower()} in the file")
    return data


# -- the client ------------------------------------------------------------------------------------------

_ERRORS: dict[grpc.StatusCode, type[aetcd.exceptions.ClientError]] = {
    grpc.StatusCode.UNAVAILABLE: aetcd.exceptions.ConnectionFailedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: aetcd.exceptions.ConnectionTimeoutError,
    grpc.StatusCode.INVALID_ARGUMENT: aetcd.exceptions.InvalidArgumentError,
    grpc.StatusCode.UNAUTHENTICATED: aetcd.exceptions.UnauthenticatedError,
}


class _Client(aetcd.Client):  # type: ignore[misc]  # aetcd has no type information
    """aetcd's client, connected by a step of our own: TLS when the endpoint is https, and the user's token
    requested over that channel. Everything after the connection (requests, errors) is aetcd's; the step
    sets exactly the attributes aetcd's own ``connect`` sets (channel, metadata, stubs, watcher)."""

    def __init__(self, endpoint: Endpoint, credentials: Credentials, *, timeout: float,
                 options: dict[str, Any]) -> None:
        super().__init__(host=endpoint.host, port=endpoint.port, username=credentials.username,
                         password=credentials.password, timeout=int(max(1, timeout)), options=options)
        self._endpoint = endpoint
        self._channel_credentials = grpc.ssl_channel_credentials(
            root_certificates=credentials.root_certificates, private_key=credentials.private_key,
            certificate_chain=credentials.certificate_chain) if endpoint.tls else None
        self._connect_lock = asyncio.Lock()

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        async with self._connect_lock:
            if self._connected.is_set():
                return
            options = list(self._options.items())
            if self._channel_credentials is not None:
                channel = grpc.aio.secure_channel(self._endpoint.target, self._channel_credentials, options)
            else:
                channel = grpc.aio.insecure_channel(self._endpoint.target, options)
            metadata = None
            if self._username is not None:
                try:
                    reply = await aetcd.rpc.AuthStub(channel).Authenticate(
                        aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password),
                        timeout=self._timeout)
                except grpc.aio.AioRpcError as exc:
                    await channel.close()
                    raise _ERRORS.get(exc.code(), aetcd.exceptions.ClientError)(exc.details()) from exc
                metadata = (("token", reply.token),)
            self.channel, self.metadata = channel, metadata
            self.auth_stub = aetcd.rpc.AuthStub(channel)
            self.kvstub = aetcd.rpc.KVStub(channel)
            self.clusterstub = aetcd.rpc.ClusterStub(channel)
            self.leasestub = aetcd.rpc.LeaseStub(channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(channel)
            self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(channel), timeout=self._timeout,
                                                  metadata=metadata)
            self._connected.set()


def open_client(endpoint: Endpoint, access: EtcdAccess, *, timeout: float, options: dict[str, Any]) -> Any:
    """A client for ``endpoint`` with the files read now (it connects on its first request)."""
    return _Client(endpoint, access.load(), timeout=timeout, options=options)


# -- errors a person can act on --------------------------------------------------------------------------

_TLS_MARKERS = ("handshake", "ssl", "tsi_", "certificate", "peer name")


def explain(exc: aetcd.exceptions.ClientError, endpoint: Endpoint, access: EtcdAccess) -> str:
    """What went wrong with ``endpoint``, in words that point at the option to fix."""
    details = str(exc) or type(exc).__name__
    low = details.lower()
    where = f"etcd {endpoint}"
    if isinstance(exc, aetcd.exceptions.InvalidArgumentError) and "authentication failed" in low:
        return (f"{where}: user {access.username!r} was refused: wrong name or password "
                f"(--etcd-username, --etcd-password-file {access.password_file}): {details}")
    if "user name is empty" in low or (isinstance(exc, aetcd.exceptions.UnauthenticatedError)
                                       and not access.username):
        return f"{where}: the server requires an etcd user (--etcd-username, --etcd-password-file): {details}"
    if "permission denied" in low:
        who = (f"user {access.username!r}" if access.username
               else "the user named by the client certificate's CN" if access.cert else "an anonymous client")
        return (f"{where}: {who} may not read and write podmeter's keys "
                f"(grant its role readwrite on the prefix): {details}")
    if isinstance(exc, aetcd.exceptions.ConnectionFailedError) and endpoint.tls:
        if "certificate_verify_failed" in low:
            trust = f"--etcd-cacert {access.cacert}" if access.cacert else "the system's CAs (no --etcd-cacert)"
            return f"{where}: TLS handshake failed: the server's certificate is not trusted by {trust}: {details}"
        if "tsi_data_corrupted" in low or "bad_certificate" in low or "certificate_required" in low:
            mine = (f"--etcd-cert {access.cert}" if access.cert
                    else "none was given: --etcd-cert, --etcd-key")
            return f"{where}: TLS handshake failed: the server refused this client's certificate ({mine}): {details}"
        if "handshake read failed" in low:
            return f"{where}: TLS handshake failed: does the server speak TLS on this port (http://)? {details}"
        if any(m in low for m in _TLS_MARKERS):
            return f"{where}: TLS handshake failed: {details}"
    if isinstance(exc, aetcd.exceptions.ConnectionFailedError) and not endpoint.tls and "socket closed" in low:
        return f"{where}: the connection was closed (if the server speaks TLS, use https://): {details}"
    return f"{where}: {type(exc).__name__}: {details}"
