"""Where the agent's Hubble API listens, and who may connect: flows name pods and IPs, so the server listens
on a Unix socket or a loopback address unless it has TLS with client certificates (:func:`check_access`), as
Hubble Relay connects to nodes. TLS files are read again when they change (a rotated certificate is used by
new connections without a restart).

Next stage: ``adapters.hubble.server`` binds the address this module checked.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from podmeter.adapters.hubble.flows import CLUSTER
from podmeter.model.hostport import host_port

log = logging.getLogger("podmeter.hubble")


class AccessError(ValueError):
    """A listen address or TLS setting the server refuses (the message says what to do)."""


@dataclass(frozen=True)
class ListenAddress:
    """``unix:///path`` (``unix:path``) or ``HOST:PORT`` (``[v6]:PORT``; an empty host: every address)."""

    text: str
    target: str  # what gRPC binds
    unix_path: Path | None = None
    loopback: bool = False
    host: str = ""  # "" for every address
    port: int = 0

    @property
    def local(self) -> bool:
        """A Unix socket or a loopback address: reachable from this node only."""
        return self.unix_path is not None or self.loopback


def parse_listen(text: str) -> ListenAddress:
    if text.startswith("unix:"):
        path = text.removeprefix("unix://") if text.startswith("unix://") else text.removeprefix("unix:")
        if not path:
            raise AccessError(f"--hubble-listen {text!r}: expected unix:///PATH")
        return ListenAddress(text, f"unix:{path}", unix_path=Path(path))
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdigit() or int(port) > 65535:
        raise AccessError(f"--hubble-listen {text!r}: expected unix:///PATH or HOST:PORT")
    host = host.removeprefix("[").removesuffix("]")
    if host in ("", "*", "0.0.0.0", "::"):
        return ListenAddress(text, f"[::]:{port}", port=int(port))
    loopback = host == "localhost"
    with contextlib.suppress(ValueError):
        loopback = ipaddress.ip_address(host).is_loopback
    return ListenAddress(text, host_port(host, port), loopback=loopback,
                         host=host, port=int(port))


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate and key, and the CA its clients' certificates must be signed by (PEM)."""

    cert: Path
    key: Path
    client_ca: Path


def tls_files(cert: str | None, key: str | None, client_ca: str | None) -> TlsFiles | None:
    given = {"--hubble-tls-cert": cert, "--hubble-tls-key": key, "--hubble-tls-client-ca": client_ca}
    if not any(given.values()):
        return None
    missing = [flag for flag, value in given.items() if not value]
    if missing:
        raise AccessError(f"TLS needs all three of --hubble-tls-cert, --hubble-tls-key and "
                          f"--hubble-tls-client-ca; missing: {', '.join(missing)}")
    assert cert and key and client_ca
    return TlsFiles(Path(cert), Path(key), Path(client_ca))


def check_access(address: ListenAddress, tls: TlsFiles | None) -> None:
    """Refuse a non-local address without TLS: flows name pods and IPs."""
    if not address.local and tls is None:
        raise AccessError(
            f"--hubble-listen {address.text} is reachable from other machines, and flows name pods and IPs: "
            "it needs TLS with client certificates (--hubble-tls-cert, --hubble-tls-key, --hubble-tls-client-ca), "
            "as Hubble Relay connects; or listen on a Unix socket (unix:///var/run/podmeter/hubble.sock) or on "
            "loopback (127.0.0.1:4246)")


class _Certificates:
    """The TLS files, read again when one of them changes (a rotated certificate is used by new
    connections without a restart)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamp = self._mtimes()
        self.initial = self._configuration()

    def _mtimes(self) -> tuple[int, ...]:
        return tuple(os.stat(p).st_mtime_ns for p in (self.files.cert, self.files.key, self.files.client_ca))

    def _configuration(self) -> Any:
        cert, key, ca = (p.read_bytes() for p in (self.files.cert, self.files.key, self.files.client_ca))
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> Any:
        try:
            stamp = self._mtimes()
            if stamp == self._stamp:
                return None
            configuration = self._configuration()
        except (OSError, ValueError) as exc:
            log.warning("Hubble API: cannot read the new TLS files (the previous ones stay): %s", exc)
            return None
        self._stamp = stamp
        log.info("Hubble API: TLS files changed; new connections use them")
        return configuration

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self.initial, self.fetch, require_client_authentication=True)


@dataclass(frozen=True)
class HubbleConfig:
    """Where the agent serves the Hubble API, and with which TLS files."""

    address: ListenAddress
    tls: TlsFiles | None = None


def hubble_config(listen: str | None, cert: str | None = None, key: str | None = None,
                  client_ca: str | None = None) -> HubbleConfig | None:
    """The agent's ``--hubble-*`` options checked before anything starts (None: the API is off);
    :class:`AccessError` says what is wrong."""
    tls = tls_files(cert, key, client_ca)
    if listen is None:
        if tls is not None:
            raise AccessError("--hubble-tls-cert, --hubble-tls-key and --hubble-tls-client-ca need --hubble-listen")
        return None
    address = parse_listen(listen)
    check_access(address, tls)
    if tls is not None:
        try:
            _Certificates(tls)
        except (OSError, ValueError) as exc:
            raise AccessError(f"cannot read the Hubble API's TLS files: {exc}") from None
    return HubbleConfig(address, tls)


def tls_server_name(node: str) -> str:
    """The name Relay checks a node's server certificate against: Hubble's naming for a node's server
    (``NODE.CLUSTER.hubble-grpc.cilium.io``, dots of the node name as dashes; the cluster is ``default``)."""
    return f"{node.replace('.', '-')}.{CLUSTER}.hubble-grpc.cilium.io"


