"""The one access rule of ``/debug/*`` (adapters/http.py), on every debug path of both processes.

Loopback clients only, unless ``--debug-remote``: 127.0.0.0/8, ::1, and 127.0.0.1 mapped into IPv6, which is
how an IPv4 client of a dual-stack ``[::]`` socket arrives (Python 3.11 does not call that loopback). Real
servers and clients: the operator's app in this process on a dual-stack socket (clients 127.0.0.1, ::1),
the agent as a real ``podmeter agent --datapath memory --listen [::]:PORT`` (asyncio makes that socket IPv6
only: client ::1); and, where the machine has one, a client address of its own that is not loopback, which
gets the 403 naming the flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from lab_server import LabServer
from podmeter.adapters.http import FORBIDDEN, is_loopback
from podmeter.adapters.identity.memory import MemoryIdentityBackend
from podmeter.cli.main import build_parser
from podmeter.cli.operator import settings_from
from podmeter.runtime.operator import Operator
from podmeter.runtime.operator_process import http_app
from waiting import free_port, wait_for

AGENT_PATHS = ("/debug/state", "/debug/endpoints", "/debug/flows?last=1")
OPERATOR_PATHS = ("/debug/identities",)


@pytest.mark.parametrize(("remote", "loopback"), [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
    ("::ffff:127.0.0.1", True), ("::ffff:7f00:2", True),  # IPv4-mapped loopback, however written
    ("10.0.0.1", False), ("::ffff:10.0.0.1", False), ("192.0.2.2", False), ("fd00::2", False),
    ("fe80::1%eth0", False), ("::", False), ("0.0.0.0", False),
    (None, False), ("", False), ("/run/podmeter.sock", False),  # no address: a Unix socket's peer
])
def test_which_clients_count_as_loopback(remote: str | None, loopback: bool) -> None:
    assert is_loopback(remote) is loopback


def own_address(families: tuple[socket.AddressFamily, ...] = (socket.AF_INET, socket.AF_INET6)) -> str | None:
    """An address of this machine that is not loopback (the source of a route out), or None."""
    targets = {socket.AF_INET: "192.0.2.254", socket.AF_INET6: "2001:db8::1"}
    for family in families:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            target = targets[family]
            try:
                probe.connect((target, 9))  # UDP: nothing is sent, the kernel only picks the source
            except OSError:
                continue
            address = str(probe.getsockname()[0])
            if not is_loopback(address):
                return address
    return None


def fetch(host: str, port: int, path: str) -> tuple[int, str]:
    """GET from ``host`` (connecting from it: the server sees it as the client)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_connection((host, port), timeout=5, source_address=(host, 0)) as sock:
        assert sock.family == family
        conn = http.client.HTTPConnection(host, port, timeout=5)
        conn.sock = sock
        conn.request("GET", path)
        response = conn.getresponse()
        status = response.status
        # /debug/flows streams: the status and the first bytes are all this needs.
        body = response.read(200).decode(errors="replace") if status != 200 else ""
        return status, body


def check(port: int, paths: tuple[str, ...], remote_open: bool, loopback: tuple[str, ...],
          other: str | None) -> None:
    for path in paths:
        for client in loopback:
            assert fetch(client, port, path)[0] == 200, (client, path)
        if other is not None:
            status, body = fetch(other, port, path)
            assert (status, body) == ((200, "") if remote_open else (403, FORBIDDEN)), (other, path)


@contextlib.asynccontextmanager
async def operator_on_any(remote: bool) -> AsyncIterator[int]:
    app = http_app(Operator(_NoPods(), MemoryIdentityBackend()), debug_remote=remote)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual stack: IPv4 clients arrive mapped
    sock.bind(("::", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield int(sock.getsockname()[1])
    finally:
        await runner.cleanup()


class _NoPods:
    """An empty pod source: the operator's debug view needs none."""

    reflector = None

    async def events(self) -> AsyncIterator[None]:
        yield None

    def pods(self) -> list[object]:
        return []


@pytest.mark.parametrize("remote", [False, True], ids=["loopback-only", "debug-remote"])
async def test_the_operators_debug_endpoints(remote: bool) -> None:
    async with operator_on_any(remote) as port:
        # 127.0.0.1 arrives as ::ffff:127.0.0.1: loopback.
        await asyncio.to_thread(check, port, OPERATOR_PATHS, remote, ("127.0.0.1", "::1"), own_address())


def test_the_operator_takes_debug_remote_from_its_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser("operator").parse_args
    assert [settings_from(parse(["operator", *flag])).debug_remote for flag in ([], ["--debug-remote"])] == [
        False, True]
    monkeypatch.setenv("PODMETER_DEBUG_REMOTE", "true")
    assert settings_from(build_parser("operator").parse_args(["operator"])).debug_remote
    with pytest.raises(SystemExit):  # the pre-release alias is gone
        parse(["operator", "--debug-anywhere"])


@pytest.fixture
def agent_on_any(lab_apiserver: LabServer, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[int]:
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(lab_apiserver.kubeconfig)}
    env.pop("PODMETER_DEBUG_REMOTE", None)
    flags = ["--debug-remote"] if request.param else []
    with (tmp_path / "agent.log").open("w+b") as log:
        proc = subprocess.Popen([sys.executable, "-m", "podmeter", "agent", "--node-name", "node-a", "--datapath",
                                 "memory", "--listen", f"[::]:{port}", *flags], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: _ready(port), timeout=20, what="the agent's /readyz",
                     describe=lambda: (tmp_path / "agent.log").read_text()[-2000:])
            yield port
        finally:
            proc.kill()
            proc.wait()


def _ready(port: int) -> bool:
    try:
        return fetch("::1", port, "/readyz")[0] == 200
    except OSError:
        return False


@pytest.mark.parametrize("agent_on_any", [False, True], ids=["loopback-only", "debug-remote"], indirect=True)
def test_the_agents_debug_endpoints(agent_on_any: int, request: pytest.FixtureRequest) -> None:
    remote = request.node.callspec.id == "debug-remote"
    check(agent_on_any, AGENT_PATHS, remote, ("::1",), own_address((socket.AF_INET6,)))
