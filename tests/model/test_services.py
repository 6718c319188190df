"""Services in the pure core: decoding Services and EndpointSlices as the API server serves them, which
Service a frontend is, and which backend served a translated connection, from each tuple a flow record of
the connection can carry."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from podmeter.model.flows import FlowCounts, FlowEntry, FlowKey, Observation
from podmeter.model.records import DecodeError
from podmeter.model.services import (
    ServiceIndex,
    ServiceName,
    ServiceNaming,
    ServicePort,
    Translations,
    decode_service,
    decode_service_backends,
    service_backends,
)

pytestmark = pytest.mark.fast
TCP, UDP = 6, 17
WEB = ServiceName("shop", "web")
FROM, TO = Observation.FROM_POD, Observation.TO_POD
COUNTS = FlowCounts(1, 100, 1, 2, 0x10)


def service(name: str = "web", spec: dict[str, Any] | None = None,
            status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"kind": "Service", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": "shop", "uid": f"uid-{name}", "resourceVersion": "7",
                         "managedFields": [{"manager": "kubectl"}]},
            "spec": spec if spec is not None else {
                "type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}],
                "selector": {"app": "web"}},
            "status": status or {"loadBalancer": {}}}


def endpoint_slice(addresses: list[str], ports: list[dict[str, Any]], address_type: str = "IPv4",
                   service_name: str | None = "web") -> dict[str, Any]:
    labels = {"kubernetes.io/service-name": service_name} if service_name else {}
    return {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", "addressType": address_type,
            "metadata": {"name": "web-abc12", "namespace": "shop", "uid": "uid-slice", "labels": labels},
            "endpoints": [{"addresses": [a], "conditions": {"ready": True}, "nodeName": "n1"} for a in addresses],
            "ports": ports}


def test_a_cluster_ip_service_decodes_to_its_frontends_and_ports() -> None:
    decoded = decode_service(json.dumps(service()).encode())
    assert decoded.key == "shop/web" and decoded.type == "ClusterIP"
    assert decoded.frontends == ("10.96.0.10",)
    assert decoded.ports.ports == (ServicePort("http", TCP, 80, 0),) and decoded.ports.keys == {(80, TCP)}
    assert decode_service(json.dumps(service("other")).encode()).ports is decoded.ports, "one shared port table"


def test_every_frontend_of_a_load_balancer_is_kept_once_and_canonical() -> None:
    spec = {"type": "LoadBalancer", "clusterIP": "10.96.0.11", "clusterIPs": ["10.96.0.11", "fd00:96:0:0::b"],
            "externalIPs": ["192.0.2.7", "10.96.0.11"],
            "ports": [{"protocol": "UDP", "port": 53, "nodePort": 30053}, {"protocol": "SCTP", "port": 9},
                      {"protocol": "FOO", "port": 1}]}
    decoded = decode_service(service(spec=spec, status={"loadBalancer": {"ingress": [{"ip": "203.0.113.9"},
                                                                                        {"hostname": "lb.example"}]}}))
    assert decoded.frontends == ("10.96.0.11", "fd00:96::b", "192.0.2.7", "203.0.113.9")
    assert decoded.ports.ports == (ServicePort("", UDP, 53, 30053), ServicePort("", 132, 9, 0))


def test_a_headless_service_has_no_frontend() -> None:
    spec = {"clusterIP": "None", "clusterIPs": ["None"], "ports": [{"port": 80}]}
    assert decode_service(service(spec=spec)).frontends == ()


@pytest.mark.parametrize(("spec", "field"), [
    ({"clusterIP": "10.96.0.300"}, "$"),
    ({"clusterIPs": ["nonsense"]}, "$"),
    ({"ports": [{"port": 70000}]}, "$.spec.ports[0].port"),
    ({"ports": "80"}, "$.spec.ports"),
])
def test_a_malformed_service_is_a_decode_error_naming_it(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(DecodeError) as caught:
        decode_service(service(spec=spec))
    assert caught.value.name == "shop/web" and caught.value.field == field


def test_an_endpoint_slice_decodes_to_its_service_addresses_and_ports() -> None:
    decoded = decode_service_backends(endpoint_slice(["10.0.1.5", "10.0.2.6"],
                                                     [{"name": "http", "port": 8080, "protocol": "TCP"},
                                                      {"port": None}]))
    assert (decoded.service, decoded.addresses, decoded.ports.keys) == ("web", ("10.0.1.5", "10.0.2.6"), {(8080, TCP)})
    assert decoded.v4 == bytes([10, 0, 1, 5, 10, 0, 2, 6]), "IPv4 addresses packed"
    both = decode_service_backends(endpoint_slice(["fd00::5", "10.0.1.5"], [{"port": 80}], address_type="IPv6"))
    assert both.addresses == ("10.0.1.5", "fd00::5")
    fqdn = decode_service_backends(endpoint_slice(["db.example.com"], [{"port": 5432}], address_type="FQDN"))
    assert fqdn.addresses == ()


# Values the API server accepts in the fields the decoders read, and strings that break naive parsers.
TEXT = st.one_of(st.sampled_from(["", "None", "10.96.0.1", "fd00::1", "\u00b2", "1" * 300, "\x1b[2K", "TCP", "UDP"]),
                 st.text(max_size=20))
ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), TEXT),
                   lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)


@given(spec=st.dictionaries(st.sampled_from(["type", "clusterIP", "clusterIPs", "externalIPs", "ports"]), ANY),
       ports=st.lists(st.fixed_dictionaries({}, optional={"port": st.integers(-5, 70000), "protocol": TEXT,
                                                          "nodePort": st.integers(-5, 70000), "name": TEXT})))
def test_the_service_decoder_is_total(spec: dict[str, Any], ports: list[dict[str, Any]]) -> None:
    for candidate in (spec, {**spec, "ports": ports}):
        with contextlib.suppress(DecodeError):
            decode_service(json.dumps(service(spec=candidate)).encode())


@given(body=st.dictionaries(st.sampled_from(["addressType", "endpoints", "ports"]), ANY),
       addresses=st.lists(TEXT, max_size=4))
def test_the_endpoint_slice_decoder_is_total(body: dict[str, Any], addresses: list[str]) -> None:
    for candidate in ({**endpoint_slice(addresses, []), **body}, endpoint_slice(addresses, [{"port": 1}])):
        with contextlib.suppress(DecodeError):
            decode_service_backends(json.dumps(candidate).encode())


def index() -> ServiceIndex:
    web = decode_service(service())
    node_port = decode_service(service("admin", {"type": "NodePort", "clusterIP": "10.96.0.20",
                                                 "ports": [{"port": 443, "nodePort": 30443}]}))
    backends = decode_service_backends(endpoint_slice(["10.0.1.5"], [{"port": 8080}]))
    return ServiceIndex([web, node_port], [backends, service_backends("shop", "orphan", "u", "", addresses=["10.0.9.9"],
                                                                      ports=[(TCP, 1)])])


def test_a_frontend_names_its_service_and_a_node_port_only_at_a_node_address() -> None:
    found = index()
    assert named(found.frontend("10.96.0.10", 80, TCP)) == WEB.named
    assert found.frontend("10.96.0.10", 80, UDP) is None and found.frontend("10.96.0.10", 81, TCP) is None
    assert named(found.frontend("192.168.1.4", 30443, TCP, frozenset({"192.168.1.4"}))) == ("shop", "admin")
    assert found.frontend("192.168.1.5", 30443, TCP, frozenset({"192.168.1.4"})) is None
    assert found.backend("10.0.1.5", 8080, TCP) == WEB and found.backend("10.0.9.9", 1, TCP) is None


def test_an_address_two_services_list_is_named_by_port_and_one_without_ports_by_none() -> None:
    web = decode_service_backends(endpoint_slice(["10.0.1.5"], [{"port": 8080}]))
    metrics = service_backends("shop", "metrics-x", "m", "metrics", addresses=["10.0.1.5"], ports=[(TCP, 9090)])
    portless = service_backends("shop", "empty-x", "e", "empty", addresses=["10.0.1.6"], ports=[])
    index = ServiceIndex([], [web, metrics, portless])
    assert index.backend("10.0.1.5", 8080, TCP) == WEB
    assert index.backend("10.0.1.5", 9090, TCP) == ServiceName("shop", "metrics")
    assert index.backend("10.0.1.5", 1, TCP) is None and index.backend("10.0.1.6", 80, TCP) is None


CLIENT, BACKEND, VIP = "10.0.2.7", "10.0.1.5", "10.96.0.10"
ORIGINAL = (TCP, CLIENT, 40000, VIP, 80)
REPLY = (TCP, BACKEND, 8080, CLIENT, 40000)


@pytest.mark.parametrize(("record", "source", "destination"), [
    (ORIGINAL, (None, CLIENT), (WEB, BACKEND)),                        # the request, at the client's link
    ((TCP, CLIENT, 40000, BACKEND, 8080), (None, CLIENT), (WEB, BACKEND)),  # ... at the backend's
    (REPLY, (WEB, BACKEND), (None, CLIENT)),                           # the reply, at the backend's link
    ((TCP, VIP, 80, CLIENT, 40000), (WEB, BACKEND), (None, CLIENT)),   # ... at the client's
])
def test_each_tuple_of_a_translated_connection_names_the_service_and_the_backend(
        record: tuple[int, str, int, str, int], source: object, destination: object) -> None:
    naming = ServiceNaming(index(), Translations([(ORIGINAL, REPLY)]))
    assert named(naming.ends(record)) == named((source, destination))


def test_a_frontend_whose_connection_conntrack_does_not_know_keeps_the_service_with_no_backend() -> None:
    naming = ServiceNaming(index(), Translations([(ORIGINAL, REPLY)]))
    assert named(naming.ends((TCP, CLIENT, 40001, VIP, 80))) == ((None, CLIENT), (WEB.named, None))
    assert named(naming.ends((TCP, CLIENT, 40001, "10.0.3.3", 80))) == ((None, CLIENT), (None, "10.0.3.3"))


def test_a_node_port_connection_names_the_service_by_its_node_port() -> None:
    node = "192.168.1.4"
    original, reply = (TCP, "198.51.100.2", 5000, node, 30443), (TCP, BACKEND, 8443, "198.51.100.2", 5000)
    naming = ServiceNaming(index(), Translations([(original, reply)]), node_addresses=[node])
    assert named(naming.ends(reply)) == ((("shop", "admin"), BACKEND), (None, "198.51.100.2"))


@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 65535), st.integers(1, 3)), max_size=20,
                unique_by=lambda c: (c[0], c[1])))
def test_each_connection_is_resolved_under_its_four_records_and_counted_at_its_real_ends(
        connections: list[tuple[int, int, int]]) -> None:
    """resolve() over every record a drain can hold of the connections (and one pod-to-pod record) gives
    what ends() says of each tuple, and the series' entries carry the backend where the record carries
    the frontend: one pass, three readers."""
    entries = [((TCP, f"10.0.2.{c}", port, VIP, 80), (TCP, f"10.0.1.{b}", 8080, f"10.0.2.{c}", port))
               for c, port, b in connections]
    naming = ServiceNaming(index(), Translations(entries))
    assert len(naming.translations) == len(entries)
    records: list[FlowEntry] = [(FlowKey("10.0.2.9", "10.0.1.9", 1, 2, TCP, FROM), COUNTS)]
    for (_, client, port, _, _), (_, backend, _, _, _) in entries:
        records += [(FlowKey(client, VIP, port, 80, TCP, FROM), COUNTS), (FlowKey(client, backend, port, 8080, TCP, TO),
                    COUNTS), (FlowKey(backend, client, 8080, port, TCP, FROM), COUNTS),
                    (FlowKey(VIP, client, 80, port, TCP, TO), COUNTS)]
    resolved = naming.resolve(records)
    assert resolved.found[0] is None and resolved.touched == 4 * len(entries)
    for (key, _), found, (real, _) in zip(records[1:], resolved.found[1:], resolved.counted[1:], strict=True):
        assert found is not None and named(naming.ends((key[4], key[0], key[2], key[1], key[3]))) == named(
            ((found.source_service, found.source), (found.destination_service, found.destination)))
        assert VIP not in (real[0], real[1]) and real[4:] == key[4:]
        assert (found.destination_service or found.source_service).named == WEB.named  # type: ignore[union-attr]
    assert resolved.counted[0] is records[0]


def named(value: Any) -> Any:
    """Services as (namespace, name), whatever their record (a Service, or a bare name)."""
    if isinstance(value, ServiceName):
        return value.named
    if isinstance(value, tuple):
        return tuple(named(item) for item in value)
    return value
