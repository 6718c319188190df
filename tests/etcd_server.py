"""A real etcd server for tests: Debian's ``etcd`` on free loopback ports in a temporary directory.

Use the ``etcd`` fixture (import it into a test module) or :class:`EtcdServer` directly. The server can
be stopped and started again on the same ports and data directory, to test recovery.

With ``pki`` (certificates made by :func:`make_pki` with openssl) it serves TLS only, and with
``client_cert_auth`` it refuses clients without a certificate its CA signed. With ``users`` it has
authentication enabled: a ``root`` user (``ROOT_PASSWORD``) and each user given, whose role may read and
write ``USER_PREFIX``; set up through etcd's JSON gateway before authentication is on. ``put`` and ``get``
are a foreign client's (gRPC, as root), for forged entries.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from waiting import free_port, stop_process

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"
ROOT_PASSWORD = "root-password-for-tests"
USER_PREFIX = "/podmeter/"


@dataclass(frozen=True)
class Pki:
    """PEM files: a CA, a server certificate for 127.0.0.1 and localhost, a client certificate (CN
    ``podmeter``), and a second CA with a client certificate of its own (trusted by nobody here)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run([OPENSSL, *map(str, args)], check=True, capture_output=True)


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", key, "-out", cert,
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def _leaf(directory: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    cert, key, csr, ext = (directory / f"{name}{suffix}" for suffix in (".crt", ".key", ".csr", ".ext"))
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-subj", f"/CN={name}", "-keyout", key, "-out", csr)
    ext.write_text(f"basicConstraints=CA:FALSE\n{extensions}\n")
    _openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial", "-days", "2",
             "-extfile", ext, "-out", cert)
    return cert, key


def make_pki(directory: Path) -> Pki:
    """Certificates for a TLS etcd and its clients, made with openssl in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, other = _ca(directory, "ca"), _ca(directory, "other-ca")
    # clientAuth too: etcd's JSON gateway dials the server's own gRPC port with the server's certificate
    server = _leaf(directory, "etcd", ca,
                   "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth")
    client = _leaf(directory, "podmeter", ca, "extendedKeyUsage=clientAuth")
    stranger = _leaf(directory, "stranger", other, "extendedKeyUsage=clientAuth")
    return Pki(ca[0], *server, *client, other[0], *stranger)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class EtcdServer:
    """One etcd member; ``endpoint`` is its client URL. ``stop()`` then ``start()`` keeps the data."""

    def __init__(self, workdir: Path, *, pki: Pki | None = None, client_cert_auth: bool = False,
                 users: Mapping[str, str] | None = None, extra_args: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.pki, self.client_cert_auth, self.users = pki, client_cert_auth, dict(users or {})
        self.extra_args = list(extra_args)
        self.endpoint = f"{'https' if pki else 'http'}://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._auth_enabled = False

    def start(self, timeout: float = 20.0) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls = []
        if self.pki is not None:
            tls = [f"--cert-file={self.pki.server_cert}", f"--key-file={self.pki.server_key}"]
            if self.client_cert_auth:  # (a trusted CA alone already makes etcd 3.4 require client certificates)
                tls += ["--client-cert-auth", f"--trusted-ca-file={self.pki.ca}"]
        log = (self.workdir / "etcd.log").open("ab")
        self.proc = subprocess.Popen(
            [
                ETCD,
                "--name=test",
                f"--data-dir={self.workdir / 'data'}",
                f"--listen-client-urls={self.endpoint}",
                f"--advertise-client-urls={self.endpoint}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                "--heartbeat-interval=50",
                "--election-timeout=250",
                "--log-level=warn",
                *tls,
                *self.extra_args,
            ],
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {(self.workdir / 'etcd.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.client_port), 0.2):
                if self._healthy():
                    if self.users and not self._auth_enabled:
                        self._enable_auth()
                    return
            time.sleep(0.1)
        raise RuntimeError("etcd did not become healthy")

    def ssl_context(self) -> ssl.SSLContext | None:
        """What a trusted client (with this PKI's client certificate) uses for the JSON gateway."""
        if self.pki is None:
            return None
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(str(self.pki.client_cert), str(self.pki.client_key))
        return context

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1, context=self.ssl_context()) as resp:
                return b"true" in resp.read()
        except OSError:
            return False

    def gateway(self, path: str, body: Mapping[str, Any], token: str | None = None) -> Any:
        """POST to etcd's JSON gateway (``/v3/...``); raises on an error answer."""
        headers = {"Content-Type": "application/json", **({"Authorization": token} if token else {})}
        request = urllib.request.Request(f"{self.endpoint}{path}", data=json.dumps(body).encode(),
                                         method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=5, context=self.ssl_context()) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"etcd {path}: {err.code} {err.read().decode()}") from None

    def _enable_auth(self) -> None:
        self.gateway("/v3/auth/user/add", {"name": "root", "password": ROOT_PASSWORD})
        self.gateway("/v3/auth/user/grant", {"user": "root", "role": "root"})
        end = USER_PREFIX[:-1] + chr(ord(USER_PREFIX[-1]) + 1)
        for name, password in self.users.items():
            self.gateway("/v3/auth/role/add", {"name": name})
            self.gateway("/v3/auth/role/grant", {"name": name, "perm": {
                "permType": "READWRITE", "key": _b64(USER_PREFIX), "range_end": _b64(end)}})
            self.gateway("/v3/auth/user/add", {"name": name, "password": password})
            self.gateway("/v3/auth/user/grant", {"user": name, "role": name})
        self.gateway("/v3/auth/enable", {})
        self._auth_enabled = True

    @contextlib.contextmanager
    def _kv(self) -> Iterator[tuple[Any, Any]]:
        """A foreign writer's gRPC KV stub and call metadata (root when authentication is on), as etcdctl
        would connect: TLS with this PKI's client certificate. (etcd's JSON gateway refuses requests from
        a client certificate once authentication is on.)"""
        import grpc
        from aetcd import rpc

        target = f"127.0.0.1:{self.client_port}"
        if self.pki is None:
            channel = grpc.insecure_channel(target)
        else:
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(
                self.pki.ca.read_bytes(), self.pki.client_key.read_bytes(), self.pki.client_cert.read_bytes()))
        try:
            metadata = None
            if self._auth_enabled:
                reply = rpc.AuthStub(channel).Authenticate(
                    rpc.AuthenticateRequest(name="root", password=ROOT_PASSWORD), timeout=5)
                metadata = (("token", reply.token),)
            yield rpc.KVStub(channel), metadata
        finally:
            channel.close()

    def put(self, key: bytes, value: bytes) -> None:
        """Write one key directly, as a foreign writer would (``etcdctl put``)."""
        with self._kv() as (kv, metadata):
            from aetcd import rpc

            kv.Put(rpc.PutRequest(key=key, value=value), timeout=5, metadata=metadata)

    def get(self, key: bytes) -> bytes | None:
        """Read one key directly (``etcdctl get``)."""
        with self._kv() as (kv, metadata):
            from aetcd import rpc

            found = kv.Range(rpc.RangeRequest(key=key), timeout=5, metadata=metadata).kvs
            return bytes(found[0].value) if found else None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            stop_process(self.proc, sig)
        self.proc = None


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    if not os.path.exists(OPENSSL):
        pytest.skip("openssl is not installed")
    return make_pki(tmp_path / "pki")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    if not os.path.exists(ETCD):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    server = EtcdServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
