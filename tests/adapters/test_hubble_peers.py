"""The agent's Hubble peer service (``peer.Peer/Notify``) announces every node of the cluster, as Hubble Relay
needs to merge them: the agent watches the cluster's Node objects (only with the Hubble API on), and a real gRPC
client reads the nodes at their InternalIP and the agents' port, then each change: a node deleted
(``PEER_DELETED``), an address changed (``PEER_UPDATED``), a node that gets its first address (``PEER_ADDED``);
an update that moves no address sends nothing. Without RBAC for nodes (a 403) or without the resource (404) the
agent is ready and announces itself only, with one warning. A client that falls behind is dropped and counted;
on loopback (no ``announce_peers``) only this node is announced; the Node decoder refuses bad addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from grpc import aio
from prometheus_client import CollectorRegistry

from agent_harness import AgentHarness
from api_proxy import ApiProxy
from hubble_support import Certificates, make_certificates
from lab_server import LabServer
from podmeter.adapters.flow_serving import FlowFeed
from podmeter.adapters.hubble.proto import peer_pb2, peer_pb2_grpc
from podmeter.adapters.hubble.server import HubbleServer, hubble_config, parse_listen
from podmeter.adapters.metrics.hubble_state import HubbleStateCollector
from podmeter.model.deltas import NODES, Delete, Upsert
from podmeter.model.records import DecodeError, Node, decode_node
from podmeter.model.store import Store
from waiting import wait_for

ADDED, DELETED, UPDATED = peer_pb2.PEER_ADDED, peer_pb2.PEER_DELETED, peer_pb2.PEER_UPDATED


def node_json(name: str, *internal: str, external: tuple[str, ...] = (), labels: dict[str, str] | None = None
              ) -> dict[str, Any]:
    addresses = [{"type": "Hostname", "address": name}]
    addresses += [{"type": "InternalIP", "address": ip} for ip in internal]
    addresses += [{"type": "ExternalIP", "address": ip} for ip in external]
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}},
            "status": {"addresses": addresses}}


# --- the Node record ---------------------------------------------------------------------------------------


def test_a_node_decodes_to_its_addresses_internal_first_then_external() -> None:
    node = decode_node(json.dumps(node_json("n1", "10.0.0.1", "fd00::0001", external=("203.0.113.7",))).encode())
    assert (node.name, node.internal_ips, node.external_ips, node.address) == (
        "n1", ("10.0.0.1", "fd00::1"), ("203.0.113.7",), "10.0.0.1")
    assert decode_node(node_json("n2", external=("203.0.113.8",))).address == "203.0.113.8"  # no private one
    assert decode_node({"metadata": {"name": "n3"}}).address is None  # the kubelet has not reported yet
    assert decode_node(node_json("n4", "fe80::1%eth0")).address is None  # zone-scoped: not reachable elsewhere


@pytest.mark.parametrize(("obj", "field"), [
    (node_json("n1", "10.0.0.300"), "$.status.addresses"),
    ({"metadata": {"name": "n1"}, "status": {"addresses": [{"type": "InternalIP", "address": 7}]}},
     "$.status.addresses[0].address"),
    ({"metadata": {}, "status": {}}, "$.metadata.name"),
    (b"{not json", "$"),
])
def test_a_bad_node_is_a_decode_error_naming_the_field(obj: Any, field: str) -> None:
    with pytest.raises(DecodeError) as error:
        decode_node(obj if isinstance(obj, bytes) else json.dumps(obj).encode())
    assert error.value.kind == "Node" and error.value.field == field


# --- the server over a node store ----------------------------------------------------------------------------


class Nodes:
    """A node store and its listeners, as the agent holds them (``runtime.agent.Agent`` in the tests below)."""

    def __init__(self, *nodes: dict[str, Any]) -> None:
        self.store: Store[Node] = Store(NODES)
        self.listeners: list[Callable[[Node | None, Node | None], None]] = []
        for obj in nodes:
            self.store.upsert(decode_node(obj))

    def cluster_nodes(self) -> Store[Node]:
        return self.store

    def on_nodes_changed(self, changed: Callable[[Node | None, Node | None], None]) -> None:
        self.listeners.append(changed)

    def upsert(self, obj: dict[str, Any]) -> None:
        self.store.apply(Upsert(NODES, decode_node(obj)), self._changed)

    def delete(self, name: str) -> None:
        self.store.apply(Delete(NODES, name), self._changed)

    def _changed(self, old: Node | None, new: Node | None) -> None:
        for listener in self.listeners:
            listener(old, new)


def seen(change: peer_pb2.ChangeNotification) -> tuple[str, str, int]:
    return change.name, change.address, change.type


async def read(call: Any, count: int, timeout: float = 10.0) -> list[tuple[str, str, int]]:
    return [seen(await asyncio.wait_for(call.read(), timeout)) for _ in range(count)]


async def nothing_more(call: Any, wait: float = 0.3) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(call.read()), wait)


@contextlib.asynccontextmanager
async def serving(nodes: Nodes | None, listen: str = "127.0.0.1:0", **options: Any
                  ) -> AsyncIterator[tuple[HubbleServer, Any]]:
    server = HubbleServer(FlowFeed(10), "node-a", parse_listen(listen), nodes=nodes, **options)
    await server.start()
    channel = aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, peer_pb2_grpc.PeerStub(channel)
    finally:
        await channel.close()
        await server.stop(0)


async def test_on_loopback_only_this_node_is_announced_and_the_log_says_why(caplog: pytest.LogCaptureFixture
                                                                             ) -> None:
    nodes = Nodes(node_json("node-a", "10.0.0.1"), node_json("node-b", "10.0.0.2"))
    with caplog.at_level(logging.INFO, "podmeter.hubble"):
        async with serving(nodes) as (server, peer):
            call = peer.Notify(peer_pb2.NotifyRequest())
            assert await read(call, 1) == [("node-a", f"127.0.0.1:{server.port}", ADDED)]
            nodes.upsert(node_json("node-c", "10.0.0.3"))
            await nothing_more(call)
            call.cancel()
    assert any("announces this node only" in r.getMessage() and "127.0.0.1:0" in r.getMessage()
               for r in caplog.records)


async def test_a_client_that_falls_behind_is_dropped_counted_and_reconnects_to_the_current_peers() -> None:
    nodes = Nodes()
    async with serving(nodes, announce_peers=True, peer_queue=2) as (server, peer):
        call = peer.Notify(peer_pb2.NotifyRequest())
        assert await read(call, 1) == [("node-a", f"127.0.0.1:{server.port}", ADDED)]
        for i in range(10):  # in one step of the loop: faster than any client reads
            nodes.upsert(node_json(f"node-{i}", f"10.0.1.{i}"))
        assert [name for name, _, _ in await read(call, 2)] == ["node-0", "node-1"]  # what its queue held
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await asyncio.wait_for(call.read(), 10)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "dropped" in error.value.details()
        assert server.peer_clients_dropped == 1
        registry = CollectorRegistry()
        registry.register(HubbleStateCollector(server.peer_figures))
        assert registry.get_sample_value("podmeter_hubble_peer_clients_dropped_total") == 1
        again = peer.Notify(peer_pb2.NotifyRequest())
        assert {name for name, _, kind in await read(again, 11) if kind == ADDED} == {
            "node-a", *(f"node-{i}" for i in range(10))}
        assert registry.get_sample_value("podmeter_hubble_peer_clients") == 1
        again.cancel()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


async def test_with_tls_on_every_address_each_node_carries_its_server_name_and_this_node_its_internal_ip(
        certificates: Certificates) -> None:
    config = hubble_config("0.0.0.0:0", str(certificates.server_cert), str(certificates.server_key),
                           str(certificates.ca))
    assert config is not None
    nodes = Nodes(node_json("node-a", "10.0.0.1"), node_json("node.b.example", "fd00::2"))
    server = HubbleServer(FlowFeed(10), "node-a", config.address, tls=config.tls, nodes=nodes)
    await server.start()
    credentials = grpc.ssl_channel_credentials(certificates.ca.read_bytes(), certificates.client_key.read_bytes(),
                                               certificates.client_cert.read_bytes())
    channel = aio.secure_channel(f"127.0.0.1:{server.port}", credentials,
                                 options=[("grpc.ssl_target_name_override", "localhost")])
    try:
        call = peer_pb2_grpc.PeerStub(channel).Notify(peer_pb2.NotifyRequest())
        got = [await asyncio.wait_for(call.read(), 10) for _ in range(2)]
        assert {(c.name, c.address, c.tls.server_name) for c in got} == {
            ("node-a", f"10.0.0.1:{server.port}", "node-a.default.hubble-grpc.cilium.io"),
            ("node.b.example", f"[fd00::2]:{server.port}", "node-b-example.default.hubble-grpc.cilium.io")}
        nodes.delete("node-a")  # this node is always a peer: back at its name, which Relay resolves
        assert seen(await asyncio.wait_for(call.read(), 10)) == ("node-a", f"node-a:{server.port}", UPDATED)
        call.cancel()
    finally:
        await channel.close()
        await server.stop(0)


# --- the agent: nodes from the API server ----------------------------------------------------------------------


class Cluster:
    """Nodes as a kubelet makes them: created, then their addresses through the status subresource."""

    def __init__(self, server: LabServer) -> None:
        self.server = server

    def _ok(self, method: str, path: str, body: Any, content_type: str = "application/json") -> None:
        status, _, answer = self.server.request(method, path, body, content_type)
        assert 200 <= status < 300, f"{method} {path}: {status} {answer}"

    def node(self, name: str, *ips: str) -> None:
        self._ok("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        if ips:
            self.addresses(name, *ips)

    def addresses(self, name: str, *ips: str) -> None:
        self._ok("PATCH", f"/api/v1/nodes/{name}/status", {"status": node_json(name, *ips)["status"]},
                 "application/merge-patch+json")

    def label(self, name: str, **labels: str) -> None:
        self._ok("PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": labels}}, "application/merge-patch+json")

    def delete(self, name: str) -> None:
        self._ok("DELETE", f"/api/v1/nodes/{name}", None)


class AgentWithHubble:
    """The agent of node-a (in-process, on the lab API server) with its Hubble API on loopback, announcing the
    peers anyway (``announce_peers``: every agent of this test would be on this machine)."""

    def __init__(self, kubeconfig_of: Any) -> None:
        self.harness = AgentHarness(kubeconfig_of, node="node-a")
        self.harness.agent.settings.watch_nodes = True  # as `podmeter agent --hubble-listen` sets it
        self.server = HubbleServer(self.harness.agent.flow_feed, "node-a", parse_listen("127.0.0.1:0"),
                                   nodes=self.harness.agent, announce_peers=True)

    def __enter__(self) -> AgentWithHubble:
        self.harness.__enter__()
        self.harness.call(self.server.start)
        return self

    def __exit__(self, *exc: object) -> None:
        self.harness.call(lambda: self.server.stop(0))
        self.harness.__exit__(*exc)

    def run(self, scenario: Callable[[Any], Any], timeout: float = 30.0) -> None:
        """Run ``scenario(peer_stub)`` on the agent's loop (one gRPC event loop for server and client)."""

        async def main() -> None:
            channel = aio.insecure_channel(f"127.0.0.1:{self.server.port}")
            try:
                await asyncio.wait_for(scenario(peer_pb2_grpc.PeerStub(channel)), timeout)
            finally:
                await channel.close()

        asyncio.run_coroutine_threadsafe(main(), self.harness.loop).result(timeout + 5)

    def nodes(self) -> set[str]:
        return self.harness.on_loop(lambda: set(self.harness.agent.nodes.objects))


def test_notify_announces_every_node_and_follows_them_as_they_come_go_and_move(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.node("node-a", "10.0.0.1")
    cluster.node("node-b", "10.0.0.2")
    cluster.node("node-c", "fd00::3")
    with AgentWithHubble(lab_apiserver) as agent:
        wait_for(lambda: agent.nodes() == {"node-a", "node-b", "node-c"}, what="the nodes listed")
        port = agent.server.port

        async def scenario(peer: Any) -> None:
            call = peer.Notify(peer_pb2.NotifyRequest())
            assert sorted(await read(call, 3)) == [  # this node where it listens; the others at InternalIP:port
                ("node-a", f"127.0.0.1:{port}", ADDED), ("node-b", f"10.0.0.2:{port}", ADDED),
                ("node-c", f"[fd00::3]:{port}", ADDED)]
            await asyncio.to_thread(cluster.delete, "node-c")
            assert await read(call, 1) == [("node-c", f"[fd00::3]:{port}", DELETED)]
            await asyncio.to_thread(cluster.addresses, "node-b", "10.0.0.22")
            assert await read(call, 1) == [("node-b", f"10.0.0.22:{port}", UPDATED)]
            await asyncio.to_thread(cluster.label, "node-b", zone="z1")  # an update that moves no address
            await asyncio.to_thread(cluster.node, "node-d")  # no address yet: not a peer yet
            await asyncio.to_thread(cluster.addresses, "node-d", "10.0.0.4")
            assert await read(call, 1) == [("node-d", f"10.0.0.4:{port}", ADDED)]
            await nothing_more(call)
            call.cancel()

        agent.run(scenario)


def refusing_nodes(code: int) -> Callable[[web.Request], web.Response | None]:
    """Answers for nodes with ``code`` (403: RBAC does not grant the agent nodes; 404: not served) as a real
    API server does; everything else passes through (``api_proxy.ApiProxy``)."""

    def answer(request: web.Request) -> web.Response | None:
        if not request.path.startswith("/api/v1/nodes"):
            return None
        reason = "Forbidden" if code == 403 else "NotFound"
        message = ('nodes is forbidden: User "system:serviceaccount:podmeter:podmeter-agent" cannot list '
                   'resource "nodes" in API group "" at the cluster scope') if code == 403 else "not found"
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                                  "reason": reason, "details": {"kind": "nodes"}, "code": code}, status=code)

    return answer


@pytest.mark.parametrize("code", [403, 404])
def test_without_nodes_the_agent_is_ready_and_announces_itself_only(lab_apiserver: LabServer, code: int,
                                                                   tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.node("node-a", "10.0.0.1")
    cluster.node("node-b", "10.0.0.2")
    with (caplog.at_level(logging.WARNING, "podmeter.reflector"),
          ApiProxy(lab_apiserver, refusing_nodes(code), tmp_path) as proxy,
          AgentWithHubble(proxy) as agent):  # entering waits for the agent's readiness
        wait_for(lambda: agent.harness.state()["reflectors"]["nodes"]["failures"].get(f"http_{code}", 0) >= 1,
                 what=f"the nodes reflector refused with {code}")
        assert agent.harness.state()["ready"] and agent.nodes() == set()
        port = agent.server.port

        async def scenario(peer: Any) -> None:
            call = peer.Notify(peer_pb2.NotifyRequest())
            assert await read(call, 1) == [("node-a", f"127.0.0.1:{port}", ADDED)]
            await nothing_more(call)
            call.cancel()

        agent.run(scenario)
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nodes: not ")]
    assert len(warnings) == 1 and "degraded mode" in warnings[0] and "announces this node only" in warnings[0]
    assert ("not allowed" if code == 403 else "not served") in warnings[0]
