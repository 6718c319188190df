"""Helpers of the Hubble API tests and bench (no tests here): certificates, a client built from the project's own
definitions (the generated stubs of ``podmeter.adapters.hubble.proto``), and a way to read a whole stream.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from podmeter.adapters.flow_serving import FlowFeed
from podmeter.adapters.hubble.proto import (
    flow_pb2,
    health_pb2,
    health_pb2_grpc,
    observer_pb2,
    observer_pb2_grpc,
)
from podmeter.adapters.hubble.server import HubbleServer, parse_listen

__all__ = ["Certificates", "Client", "flow_pb2", "health_pb2", "make_certificates", "observer_pb2"]


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # a client certificate signed by another CA
    rogue_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _signed(directory: Path, name: str, ca: str, subject: str, extensions: str | None = None) -> tuple[Path, Path]:
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.pem"
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key),
             "-out", str(csr), "-subj", subject)
    argv = ["x509", "-req", "-in", str(csr), "-CA", str(directory / f"{ca}.pem"), "-CAkey",
            str(directory / f"{ca}.key"), "-CAcreateserial", "-out", str(cert), "-days", "2"]
    if extensions:
        ext = directory / f"{name}.ext"
        ext.write_text(extensions)
        argv += ["-extfile", str(ext)]
    _openssl(*argv)
    return cert, key


def make_certificates(directory: Path) -> Certificates:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate it signed, and a client
    certificate of another CA (EC P-256, two days)."""
    directory.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "rogue-ca"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
                 str(directory / f"{ca}.key"), "-out", str(directory / f"{ca}.pem"), "-days", "2",
                 "-subj", f"/CN=podmeter test {ca}")
    server_cert, server_key = _signed(directory, "server", "ca", "/CN=node-a.hubble-grpc.cilium.io",
                                      "subjectAltName=DNS:localhost,DNS:node-a.hubble-grpc.cilium.io,IP:127.0.0.1\n"
                                      "extendedKeyUsage=serverAuth\n")
    client_cert, client_key = _signed(directory, "client", "ca", "/CN=hubble-relay-client",
                                      "extendedKeyUsage=clientAuth\n")
    rogue_cert, rogue_key = _signed(directory, "rogue", "rogue-ca", "/CN=intruder", "extendedKeyUsage=clientAuth\n")
    return Certificates(directory / "ca.pem", server_cert, server_key, client_cert, client_key, rogue_cert, rogue_key)


class Client:
    """An async client of one server: ``observer`` and ``health`` stubs over one channel."""

    def __init__(self, target: str, certificates: Certificates | None = None, *, client_cert: bool = True,
                 rogue: bool = False) -> None:
        if certificates is None:
            self.channel = aio.insecure_channel(target)
        else:
            chain = key = None
            if client_cert:
                cert_path, key_path = ((certificates.rogue_cert, certificates.rogue_key) if rogue
                                       else (certificates.client_cert, certificates.client_key))
                chain, key = cert_path.read_bytes(), key_path.read_bytes()
            credentials = grpc.ssl_channel_credentials(certificates.ca.read_bytes(), key, chain)
            self.channel = aio.secure_channel(target, credentials,
                                              options=[("grpc.ssl_target_name_override", "localhost")])
        self.observer = observer_pb2_grpc.ObserverStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def flows(self, timeout: float = 10.0, **request: Any) -> list[observer_pb2.GetFlowsResponse]:
        """Every response of a GetFlows call that ends by itself (not ``follow``)."""
        call = self.observer.GetFlows(observer_pb2.GetFlowsRequest(**request), timeout=timeout)
        return [response async for response in call]

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def ports(responses: list[observer_pb2.GetFlowsResponse]) -> list[int]:
    """The source port of each response's flow (TCP or UDP; ICMP: its type)."""
    out = []
    for response in responses:
        l4 = response.flow.l4
        kind = l4.WhichOneof("protocol")
        if kind in ("TCP", "UDP"):
            out.append(getattr(l4, kind).source_port)
        elif kind is not None:
            out.append(getattr(l4, kind).type)
    return out


@contextlib.asynccontextmanager
async def serving(feed: FlowFeed, **options: Any) -> AsyncIterator[tuple[HubbleServer, Client]]:
    """A Hubble server of node-a on a loopback port over ``feed``, and a client of it; both stopped after."""
    server = HubbleServer(feed, "node-a", parse_listen("127.0.0.1:0"), **options)
    await server.start()
    client = Client(f"127.0.0.1:{server.port}")
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop(0)
