"""Services and EndpointSlices on the lab API server, through real HTTP, with the real server's defaults,
allocations and error messages (kube-apiserver 1.36: pkg/registry/core/service, pkg/apis/core/validation,
pkg/apis/discovery/validation, apimachinery's rendering of bad values), real client libraries and kubectl."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from lab_server import KUBECTL, LabServer
from podmeter.lab.apiserver import protobuf
from podmeter.lab.apiserver.app import LabApiServer, Settings
from podmeter.lab.apiserver.server import RunningServer
from podmeter.lab.apiserver.services import ServiceAllocator

SVC = "/api/v1/namespaces/{ns}/services"
SLICES = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
CIDR = ipaddress.ip_network("10.96.0.0/16")
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


@pytest.fixture(scope="module")
def srv() -> Iterator[LabServer]:
    with LabServer(process=False) as server:
        for ns in ("svc", "eps", "churn"):
            server.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        yield server


def service(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": name}, "spec": {"selector": {"app": name}, **spec}}
    body["spec"].setdefault("ports", [{"port": 80}])
    return body


def create(srv: LabServer, body: dict[str, Any], ns: str = "svc") -> tuple[int, dict[str, Any]]:
    status, _, answer = srv.request("POST", SVC.format(ns=ns), body)
    return status, answer


def rv(srv: LabServer) -> str:
    value: str = srv.request("GET", "/api/v1/namespaces")[2]["metadata"]["resourceVersion"]
    return value


def allocations(srv: LabServer) -> tuple[int, int]:
    stats = srv.admin.stats()["serviceAllocations"]
    return stats["clusterIPs"]["IPv4"]["used"], stats["nodePorts"]["used"]


def delete(srv: LabServer, name: str, ns: str = "svc") -> None:
    assert srv.request("DELETE", f"{SVC.format(ns=ns)}/{name}")[0] == 200


# --- Services: defaults and allocation --------------------------------------------------------------------


def test_created_service_has_the_real_defaults(srv: LabServer) -> None:
    status, svc = create(srv, service("web", ports=[{"port": 80, "targetPort": 8080, "name": "http"},
                                                    {"port": 53, "name": "dns", "protocol": "UDP"}]))
    assert status == 201, svc
    spec = svc["spec"]
    ip = spec["clusterIP"]
    assert list(spec) == ["ports", "selector", "clusterIP", "clusterIPs", "type", "sessionAffinity", "ipFamilies",
                          "ipFamilyPolicy", "internalTrafficPolicy"]
    assert spec["ports"] == [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080},
                             {"name": "dns", "protocol": "UDP", "port": 53, "targetPort": 53}]
    assert spec["clusterIPs"] == [ip] and ipaddress.ip_address(ip) in CIDR
    assert ip not in ("10.96.0.0", "10.96.0.1", "10.96.255.255")
    # dynamic allocation prefers the upper band (KEP-3070: the first 256 addresses are for static requests)
    assert ipaddress.ip_address(ip) > ipaddress.ip_address("10.96.1.0")
    assert (spec["type"], spec["sessionAffinity"], spec["ipFamilies"], spec["ipFamilyPolicy"],
            spec["internalTrafficPolicy"]) == ("ClusterIP", "None", ["IPv4"], "SingleStack", "Cluster")
    assert svc["status"] == {"loadBalancer": {}}
    assert "generation" not in svc["metadata"]  # Services keep none
    got = srv.request("GET", f"{SVC.format(ns='svc')}/web")[2]
    assert got["spec"] == spec and got["kind"] == "Service"


def test_the_kubernetes_service_holds_the_first_address(srv: LabServer) -> None:
    svc = srv.request("GET", "/api/v1/namespaces/default/services/kubernetes")[2]
    assert svc["spec"]["clusterIP"] == "10.96.0.1" and svc["spec"]["clusterIPs"] == ["10.96.0.1"]
    assert svc["spec"]["ports"] == [{"name": "https", "protocol": "TCP", "port": 443, "targetPort": 6443}]
    assert "selector" not in svc["spec"]
    status, answer = create(srv, service("takes-first", clusterIP="10.96.0.1"))
    assert status == 422 and answer["message"] == (
        'Service "takes-first" is invalid: spec.clusterIPs: Invalid value: ["10.96.0.1"]: '
        "failed to allocate IP 10.96.0.1: provided IP is already allocated"
    )


def test_cluster_ips_are_unique_and_within_the_cidr(srv: LabServer) -> None:
    ips = set()
    for i in range(40):
        status, svc = create(srv, service(f"many-{i}"), ns="churn")
        assert status == 201, svc
        ips.add(svc["spec"]["clusterIP"])
    assert len(ips) == 40 and all(ipaddress.ip_address(ip) in CIDR for ip in ips)
    listed = srv.request("GET", "/api/v1/services")[2]["items"]
    assert len({s["spec"]["clusterIP"] for s in listed}) == len(listed)
    for i in range(40):
        delete(srv, f"many-{i}", ns="churn")


def test_a_requested_cluster_ip_is_checked_like_the_real_allocator(srv: LabServer) -> None:
    status, svc = create(srv, service("fixed", clusterIP="10.96.100.100"))
    assert status == 201 and svc["spec"]["clusterIPs"] == ["10.96.100.100"]
    cases = {
        "10.96.100.100": 'spec.clusterIPs: Invalid value: ["10.96.100.100"]: failed to allocate IP 10.96.100.100: '
        "provided IP is already allocated",
        "192.168.1.1": 'spec.clusterIPs: Invalid value: ["192.168.1.1"]: failed to allocate IP 192.168.1.1: the '
        "provided network does not match the current range",
        "10.96.0.0": 'spec.clusterIPs: Invalid value: ["10.96.0.0"]: failed to allocate IP 10.96.0.0: the provided IP '
        "(10.96.0.0) is not in the valid range. The range of valid IPs is 10.96.0.0/16",
        "10.96.255.255": 'spec.clusterIPs: Invalid value: ["10.96.255.255"]: failed to allocate IP 10.96.255.255: the '
        "provided IP (10.96.255.255) is not in the valid range. The range of valid IPs is 10.96.0.0/16",
        "not-an-ip": 'spec.clusterIPs[0]: Invalid value: "not-an-ip": must be a valid IP address, (e.g. 10.9.8.7 or '
        "2001:db8::ffff)",
        "fd00::1": 'spec.clusterIPs[0]: Invalid value: ["fd00::1"]: IPv6 is not configured on this cluster',
    }
    before = (rv(srv), allocations(srv))
    for ip, message in cases.items():
        status, answer = create(srv, service("other", clusterIP=ip))
        assert status == 422, answer
        assert answer["message"] == f'Service "other" is invalid: {message}', ip
        assert answer["details"]["causes"][0]["field"] == message.split(":")[0]
    assert (rv(srv), allocations(srv)) == before  # refused writes consume nothing
    delete(srv, "fixed")
    assert create(srv, service("fixed-again", clusterIP="10.96.100.100"))[0] == 201  # released, reusable
    delete(srv, "fixed-again")


def test_node_ports_are_allocated_from_the_range(srv: LabServer) -> None:
    status, svc = create(srv, service("np", type="NodePort", ports=[
        {"name": "http", "port": 80}, {"name": "dns-tcp", "port": 53}, {"name": "dns-udp", "port": 53,
                                                                         "protocol": "UDP"}]))
    assert status == 201, svc
    spec = svc["spec"]
    ports = [p["nodePort"] for p in spec["ports"]]
    assert all(30000 <= p <= 32767 for p in ports)
    assert ports[1] == ports[2] != ports[0]  # one NodePort per port number, whatever the protocol
    assert spec["externalTrafficPolicy"] == "Cluster" and spec["type"] == "NodePort"
    assert list(spec)[:5] == ["ports", "selector", "clusterIP", "clusterIPs", "type"]
    assert list(spec["ports"][0]) == ["name", "protocol", "port", "targetPort", "nodePort"]
    taken = ports[0]
    status, answer = create(srv, service("np2", type="NodePort", ports=[{"port": 80, "nodePort": taken}]))
    assert status == 422 and answer["message"] == (
        f'Service "np2" is invalid: spec.ports[0].nodePort: Invalid value: {taken}: provided port is already allocated'
    )
    delete(srv, "np")
    assert create(srv, service("np2", type="NodePort", ports=[{"port": 80, "nodePort": taken}]))[0] == 201
    delete(srv, "np2")


@pytest.mark.parametrize(
    ("name", "spec", "message"),
    [
        ("low", {"type": "NodePort", "ports": [{"port": 80, "nodePort": 80}]},
         "spec.ports[0].nodePort: Invalid value: 80: provided port is not in the valid range. The range of valid "
         "ports is 30000-32767"),
        ("twice", {"type": "NodePort", "ports": [{"name": "a", "port": 80, "nodePort": 30080},
                                                 {"name": "b", "port": 81, "nodePort": 30080}]},
         "spec.ports[1].nodePort: Invalid value: 30080: provided port is already allocated"),
        ("on-cip", {"ports": [{"port": 80, "nodePort": 30081}]},
         "spec.ports[0].nodePort: Forbidden: may not be used when `type` is 'ClusterIP'"),
        ("noports", {"ports": []}, "spec.ports: Required value"),
        ("bigport", {"ports": [{"port": 70000, "targetPort": 80}]},
         "spec.ports[0].port: Invalid value: 70000: must be between 1 and 65535, inclusive"),
        ("zeroport", {"ports": [{"targetPort": 80}]},
         "spec.ports[0].port: Invalid value: 0: must be between 1 and 65535, inclusive"),
        ("proto", {"ports": [{"port": 80, "protocol": "ICMP"}]},
         'spec.ports[0].protocol: Unsupported value: "ICMP": supported values: "SCTP", "TCP", "UDP"'),
        ("unnamed", {"ports": [{"port": 80}, {"port": 81}]},
         "[spec.ports[0].name: Required value, spec.ports[1].name: Required value]"),
        ("dupport", {"ports": [{"name": "a", "port": 80}, {"name": "b", "port": 80}]},
         'spec.ports[1]: Duplicate value: {"Name":"","Protocol":"TCP","AppProtocol":null,"Port":80,"TargetPort":0,'
         '"NodePort":0}'),
        ("badtarget", {"ports": [{"port": 80, "targetPort": "http_port"}]},
         'spec.ports[0].targetPort: Invalid value: "http_port": must contain only alpha-numeric characters (a-z, '
         "0-9), and hyphens (-)"),
        ("kind", {"type": "Magic"},
         'spec.type: Unsupported value: "Magic": supported values: "ClusterIP", "ExternalName", "LoadBalancer", '
         '"NodePort"'),
        ("affinity", {"sessionAffinity": "Sticky"},
         'spec.sessionAffinity: Unsupported value: "Sticky": supported values: "ClientIP", "None"'),
        ("etp", {"externalTrafficPolicy": "Local"},
         'spec.externalTrafficPolicy: Invalid value: "Local": may only be set for externally-accessible services'),
        ("dual", {"ipFamilyPolicy": "RequireDualStack"},
         'spec.ipFamilyPolicy: Invalid value: "RequireDualStack": this cluster is not configured for dual-stack '
         "services"),
        ("v6", {"ipFamilies": ["IPv6"]}, 'spec.ipFamilies[0]: Invalid value: "IPv6": not configured on this cluster'),
        ("cname", {"type": "ExternalName", "ports": []}, "spec.externalName: Required value"),
        ("np-headless", {"type": "NodePort", "clusterIP": "None"},
         "spec.clusterIPs[0]: Invalid value: \"None\": may not be set to 'None' for NodePort services"),
        ("selector", {"selector": {"app": "bad value!"}},
         'spec.selector: Invalid value: "bad value!": a valid label must be an empty string or consist of '
         "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. "
         "'MyValue',  or 'my_value',  or '12345', regex used for validation is "
         "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"),
    ],
)
def test_invalid_services_get_the_real_messages(srv: LabServer, name: str, spec: dict[str, Any],
                                                message: str) -> None:
    before = (rv(srv), allocations(srv))
    status, answer = create(srv, service(name, **spec))
    assert status == 422, answer
    assert (answer["reason"], answer["details"]["kind"], answer["details"]["name"]) == ("Invalid", "Service", name)
    assert answer["message"] == f'Service "{name}" is invalid: {message}'
    assert (rv(srv), allocations(srv)) == before


def test_a_service_name_is_a_dns_1035_label(srv: LabServer) -> None:
    status, answer = create(srv, service("1web"))
    assert status == 422 and answer["details"]["causes"][0] == {
        "reason": "FieldValueInvalid",
        "field": "metadata.name",
        "message": 'Invalid value: "1web": a DNS-1035 label must consist of lower case alphanumeric characters or '
        "'-', start with an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
        "'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')",
    }


def test_a_port_of_the_wrong_json_type_is_a_400(srv: LabServer) -> None:
    status, answer = create(srv, service("typed", ports=[{"port": "80"}]))
    assert status == 400 and answer["reason"] == "BadRequest"
    assert answer["message"] == ('Service in version "v1" cannot be handled as a Service: json: cannot unmarshal '
                                 "string into Go struct field ServicePort.spec.ports.port of type int32")


def test_headless_services_allocate_nothing(srv: LabServer) -> None:
    before = allocations(srv)
    status, svc = create(srv, {"metadata": {"name": "hl"}, "spec": {"clusterIP": "None", "selector": {"app": "hl"}}})
    assert status == 201, svc
    assert svc["spec"] == {"selector": {"app": "hl"}, "clusterIP": "None", "clusterIPs": ["None"],
                           "type": "ClusterIP", "sessionAffinity": "None", "ipFamilies": ["IPv4"],
                           "ipFamilyPolicy": "SingleStack", "internalTrafficPolicy": "Cluster"}
    # headless without a selector: RequireDualStack and both families, whatever the cluster has
    status, bare = create(srv, {"metadata": {"name": "hl-bare"}, "spec": {"clusterIP": "None"}})
    assert status == 201 and (bare["spec"]["ipFamilyPolicy"], bare["spec"]["ipFamilies"]) == (
        "RequireDualStack", ["IPv4", "IPv6"])  # initIPFamilyFields' exception: even on a single-stack cluster
    assert allocations(srv) == before
    status, _, answer = srv.request("PATCH", f"{SVC.format(ns='svc')}/hl", {"spec": {"clusterIP": "10.96.7.7"}},
                                    MERGE)
    assert status == 422 and answer["message"] == (  # and, no longer headless, it would need ports
        'Service "hl" is invalid: [spec.clusterIPs[0]: Invalid value: ["10.96.7.7"]: may not change once set, '
        "spec.ports: Required value]")
    delete(srv, "hl")
    delete(srv, "hl-bare")


def test_load_balancer_defaults_and_status(srv: LabServer) -> None:
    status, svc = create(srv, service("lb", type="LoadBalancer", externalTrafficPolicy="Local"))
    assert status == 201, svc
    spec = svc["spec"]
    assert spec["allocateLoadBalancerNodePorts"] is True and spec["externalTrafficPolicy"] == "Local"
    assert 30000 <= spec["ports"][0]["nodePort"] <= 32767 and 30000 <= spec["healthCheckNodePort"] <= 32767
    assert spec["healthCheckNodePort"] != spec["ports"][0]["nodePort"]
    path = f"{SVC.format(ns='svc')}/lb/status"
    status, _, after = srv.request("PATCH", path,
                                   {"status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}}}, MERGE)
    assert status == 200 and after["status"]["loadBalancer"]["ingress"] == [{"ip": "192.0.2.10", "ipMode": "VIP"}]
    table = srv.request("GET", f"{SVC.format(ns='svc')}/lb")[2]
    assert table["spec"] == spec  # a status write leaves the spec alone
    status, _, bad = srv.request("PATCH", path, {"status": {"loadBalancer": {"ingress": [{"ip": "nope"}]}}}, MERGE)
    assert status == 422 and "status.loadBalancer.ingress[0].ip" in bad["message"]
    before = allocations(srv)
    delete(srv, "lb")
    assert allocations(srv) == (before[0] - 1, before[1] - 2)


def test_updates_keep_allocations_and_type_changes_allocate_or_release(srv: LabServer) -> None:
    path = f"{SVC.format(ns='svc')}/shift"
    status, svc = create(srv, service("shift"))
    ip = svc["spec"]["clusterIP"]
    base = allocations(srv)
    # a PUT that leaves out clusterIP keeps it (patchAllocatedValues), with the rest of the new spec
    body = {"metadata": {"name": "shift", "resourceVersion": svc["metadata"]["resourceVersion"]},
            "spec": {"selector": {"app": "other"}, "ports": [{"port": 8080}]}}
    status, _, put = srv.request("PUT", path, body)
    assert status == 200, put
    assert put["spec"]["clusterIP"] == ip and put["spec"]["selector"] == {"app": "other"}
    assert put["spec"]["ports"] == [{"protocol": "TCP", "port": 8080, "targetPort": 8080}]
    # ClusterIP -> NodePort allocates a NodePort; a later update without it keeps it
    status, _, np = srv.request("PATCH", path, {"spec": {"type": "NodePort"}}, MERGE)
    assert status == 200 and np["spec"]["clusterIP"] == ip
    node_port = np["spec"]["ports"][0]["nodePort"]
    assert allocations(srv) == (base[0], base[1] + 1)
    status, _, same = srv.request("PATCH", path, {"spec": {"ports": [{"port": 8080, "targetPort": 9090}]}}, MERGE)
    assert status == 200 and same["spec"]["ports"][0]["nodePort"] == node_port
    # NodePort -> ClusterIP: the unchanged NodePort goes (dropTypeDependentFields) and is released
    status, _, back = srv.request("PATCH", path, {"spec": {"type": "ClusterIP", "externalTrafficPolicy": None}},
                                  MERGE)
    assert status == 200, back
    assert "nodePort" not in back["spec"]["ports"][0] and allocations(srv) == base
    # ClusterIP -> ExternalName releases the ClusterIP; back to ClusterIP allocates a new one
    status, _, cname = srv.request("PATCH", path, {"spec": {"type": "ExternalName", "externalName": "db.example.com",
                                                         "clusterIP": None, "clusterIPs": None, "ipFamilies": None,
                                                         "ipFamilyPolicy": None}}, MERGE)
    assert status == 200, cname
    assert "clusterIP" not in cname["spec"] and allocations(srv) == (base[0] - 1, base[1])
    status, _, again = srv.request("PATCH", path, {"spec": {"type": "ClusterIP", "externalName": None}}, MERGE)
    assert status == 200, again
    assert ipaddress.ip_address(again["spec"]["clusterIP"]) in CIDR and allocations(srv) == base
    delete(srv, "shift")


def test_strategic_merge_patches_merge_service_ports_by_port(srv: LabServer) -> None:
    create(srv, service("smp", ports=[{"name": "a", "port": 80}, {"name": "b", "port": 81}]))
    status, _, svc = srv.request("PATCH", f"{SVC.format(ns='svc')}/smp",
                              {"spec": {"ports": [{"port": 81, "targetPort": 9090}]}}, STRATEGIC)
    assert status == 200, svc
    assert [(p["name"], p["targetPort"]) for p in svc["spec"]["ports"]] == [("a", 80), ("b", 9090)]
    delete(srv, "smp")


def test_dry_run_allocates_nothing(srv: LabServer) -> None:
    before = (rv(srv), allocations(srv))
    status, _, svc = srv.request("POST", f"{SVC.format(ns='svc')}?dryRun=All", service("dry", type="NodePort"))
    assert status == 201
    # what the real dry-run allocators answer: the network address and a dummy port above the range
    assert svc["spec"]["clusterIP"] == "10.96.0.0" and svc["spec"]["ports"][0]["nodePort"] == 32769
    assert (rv(srv), allocations(srv)) == before
    assert srv.request("GET", f"{SVC.format(ns='svc')}/dry")[0] == 404


def test_namespace_deletion_releases_its_services(srv: LabServer) -> None:
    srv.request("POST", "/api/v1/namespaces", {"metadata": {"name": "gone"}})
    before = allocations(srv)
    create(srv, service("a", clusterIP="10.96.200.1", type="NodePort", ports=[{"port": 80, "nodePort": 30999}]),
           ns="gone")
    assert allocations(srv) == (before[0] + 1, before[1] + 1)
    assert srv.request("DELETE", "/api/v1/namespaces/gone")[0] == 200
    assert allocations(srv) == before
    status, svc = create(srv, service("b", clusterIP="10.96.200.1", type="NodePort",
                                      ports=[{"port": 80, "nodePort": 30999}]))
    assert status == 201, svc
    delete(srv, "b")


def test_field_selectors_of_services(srv: LabServer) -> None:
    create(srv, service("sel-a"))
    create(srv, service("sel-b", type="NodePort"))
    listed = srv.request("GET", "/api/v1/services?fieldSelector=spec.type%3DNodePort")[2]["items"]
    assert [s["metadata"]["name"] for s in listed] == ["sel-b"]
    listed = srv.request("GET", "/api/v1/services?fieldSelector=metadata.namespace%3Ddefault")[2]["items"]
    assert [s["metadata"]["name"] for s in listed] == ["kubernetes"]
    listed = srv.request("GET", "/api/v1/services?fieldSelector=spec.clusterIP%3D10.96.0.1")[2]["items"]
    assert [s["metadata"]["name"] for s in listed] == ["kubernetes"]
    listed = srv.request("GET", f"{SVC.format(ns='svc')}?fieldSelector=metadata.name%3Dsel-a")[2]["items"]
    assert [s["metadata"]["name"] for s in listed] == ["sel-a"]
    status, _, answer = srv.request("GET", "/api/v1/services?fieldSelector=spec.selector%3Dx")
    assert status == 400 and answer["message"] == "field label not supported: spec.selector"
    delete(srv, "sel-a")
    delete(srv, "sel-b")


def test_watch_and_bookmarks_of_services(srv: LabServer) -> None:
    with srv.watch(f"{SVC.format(ns='svc')}?watch=1&allowWatchBookmarks=true&timeoutSeconds=5") as w:
        bookmark = w.next()
        while bookmark is not None and bookmark["type"] == "ADDED":  # the current ones first
            bookmark = w.next()
        assert bookmark is not None and bookmark["type"] == "BOOKMARK"
        obj = bookmark["object"]
        assert (obj["kind"], obj["spec"], obj["status"]) == ("Service", {}, {"loadBalancer": {}})
        create(srv, service("watched"))
        event = w.next()
        assert event is not None and event["type"] == "ADDED"
        assert event["object"]["spec"]["clusterIP"] and event["object"]["apiVersion"] == "v1"
    delete(srv, "watched")


def test_server_side_table_of_services(srv: LabServer) -> None:
    create(srv, service("tab", type="NodePort", ports=[{"port": 80, "nodePort": 30123}]))
    req = urllib.request.Request(srv.url + f"{SVC.format(ns='svc')}/tab", headers={
        "Authorization": f"Bearer {srv.token}", "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        table = json.loads(resp.read())
    assert [c["name"] for c in table["columnDefinitions"]] == [
        "Name", "Type", "Cluster-IP", "External-IP", "Port(s)", "Age", "Selector"]
    cells = table["rows"][0]["cells"]
    assert cells[:5] == ["tab", "NodePort", cells[2], "<none>", "80:30123/TCP"] and cells[6] == "app=tab"
    delete(srv, "tab")


def test_protobuf_service_create_is_understood(srv: LabServer) -> None:
    """What ``kubectl create service`` sends (its typed client speaks protobuf and does not fall back)."""

    def field(number: int, payload: bytes | int) -> bytes:
        def varint(v: int) -> bytes:
            out = b""
            while True:
                out += bytes([(v & 0x7F) | (0x80 if v > 0x7F else 0)])
                v >>= 7
                if not v:
                    return out
        if isinstance(payload, int):
            return varint(number << 3) + varint(payload)
        return varint(number << 3 | 2) + varint(len(payload)) + payload

    target = field(1, 0) + field(2, 8080)
    port = field(1, b"80-8080") + field(2, b"TCP") + field(3, 80) + field(4, target)
    spec = field(1, port) + field(2, field(1, b"app") + field(2, b"pb")) + field(4, b"ClusterIP")
    meta = field(1, b"pb") + field(11, field(1, b"app") + field(2, b"pb"))
    raw = field(1, meta) + field(2, spec)
    body = protobuf.MAGIC + field(1, field(1, b"v1") + field(2, b"Service")) + field(2, raw)
    assert protobuf.decode_service(body)["spec"]["ports"] == [
        {"name": "80-8080", "protocol": "TCP", "port": 80, "targetPort": 8080}]
    status, _, svc = srv.request("POST", SVC.format(ns="svc"), body, protobuf.CONTENT_TYPE)
    assert status == 201, svc
    assert svc["spec"]["selector"] == {"app": "pb"} and svc["spec"]["ports"][0]["targetPort"] == 8080
    delete(srv, "pb")


# --- a small CIDR: exhaustion, release and reuse ------------------------------------------------------------


@contextlib.contextmanager
def small_server(**settings: Any) -> Iterator[LabServer]:
    """A lab API server with custom Settings (the service CIDR) on a thread, driven like ``LabServer``."""
    lab = LabApiServer(Settings(token="t", **settings))
    running = RunningServer(lab, "127.0.0.1", 0)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        await running.start()
        started.set()
        await stop.wait()
        await running.stop()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    assert started.wait(5)
    server = LabServer(process=False, token="t")
    server.url = running.url
    try:
        yield server
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(5)
        loop.close()
        server.stop()  # only its temporary directory: it started nothing


def test_a_small_cidr_fills_up_and_frees_on_delete() -> None:
    with small_server(service_cidr="10.100.0.0/28", service_node_port_range="30000-30003") as srv:
        # 14 usable addresses (.1-.14), .1 is the kubernetes Service's: 13 left
        ips = []
        for i in range(13):
            status, svc = create(srv, service(f"s{i}"), ns="default")
            assert status == 201, svc
            ips.append(svc["spec"]["clusterIP"])
        assert sorted(ips, key=ipaddress.ip_address) == [f"10.100.0.{n}" for n in range(2, 15)]
        status, full = create(srv, service("one-too-many"), ns="default")
        assert status == 500 and full["message"] == (
            "Internal error occurred: failed to allocate a serviceIP: range is full")
        delete(srv, "s3", ns="default")
        status, svc = create(srv, service("one-too-many"), ns="default")
        assert status == 201 and svc["spec"]["clusterIP"] == ips[3]
        for i in range(4):
            assert srv.request("PATCH", f"{SVC.format(ns='default')}/s{i if i != 3 else 4}",
                               {"spec": {"type": "NodePort"}}, MERGE)[0] == 200
        status, _, full = srv.request("PATCH", f"{SVC.format(ns='default')}/s5", {"spec": {"type": "NodePort"}},
                                      MERGE)
        assert status == 500 and full["message"] == (
            "Internal error occurred: failed to allocate a nodePort: range is full")
        stats = srv.request("GET", "/_lab/stats")[2]["serviceAllocations"]
        assert stats["nodePorts"] == {"range": "30000-30003", "used": 4}
        for i in range(13):
            if i != 3:
                delete(srv, f"s{i}", ns="default")
        delete(srv, "one-too-many", ns="default")
        stats = srv.request("GET", "/_lab/stats")[2]["serviceAllocations"]
        assert stats["clusterIPs"]["IPv4"]["used"] == 1 and stats["nodePorts"]["used"] == 0  # kubernetes only


def test_a_dual_stack_cluster_gives_both_families_on_request() -> None:
    with small_server(service_cidr="10.100.0.0/24,fd00:10:96::/112") as srv:
        status, single = create(srv, service("single"), ns="default")
        assert status == 201 and single["spec"]["ipFamilies"] == ["IPv4"]
        status, dual = create(srv, service("dual", ipFamilyPolicy="PreferDualStack"), ns="default")
        assert status == 201, dual
        assert dual["spec"]["ipFamilies"] == ["IPv4", "IPv6"] and len(dual["spec"]["clusterIPs"]) == 2
        assert ipaddress.ip_address(dual["spec"]["clusterIPs"][1]) in ipaddress.ip_network("fd00:10:96::/112")
        status, v6 = create(srv, service("v6", ipFamilies=["IPv6"]), ns="default")
        assert status == 201 and ":" in v6["spec"]["clusterIP"]
        stats = srv.request("GET", "/_lab/stats")[2]["serviceAllocations"]["clusterIPs"]
        assert (stats["IPv4"]["used"], stats["IPv6"]["used"]) == (3, 2)


def test_allocator_rebuilds_from_what_the_store_holds() -> None:
    allocator = ServiceAllocator("10.96.0.0/16")
    allocator.record("a/x", {"spec": {"clusterIPs": ["10.96.0.5"], "ports": [{"nodePort": 30001}]}})
    allocator.record("a/y", {"spec": {"clusterIPs": ["None"]}})
    assert allocator.stats()["clusterIPs"]["IPv4"]["used"] == 1 and allocator.stats()["services"] == 1
    allocator.record("a/x", {"spec": {"clusterIPs": ["10.96.0.5"], "ports": []}})  # an update dropped the port
    assert allocator.stats()["nodePorts"]["used"] == 0
    allocator.forget("a/x")
    assert allocator.ip_owner == {} and allocator.port_owner == {} and allocator.claims == {}
    with pytest.raises(ValueError, match="mask must be >= 12"):
        ServiceAllocator("10.0.0.0/8")


# --- EndpointSlices ---------------------------------------------------------------------------------------


def endpoint_slice(name: str, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": name, "labels": {"kubernetes.io/service-name": "web"}},
                            "addressType": "IPv4", "endpoints": [{"addresses": ["10.244.0.5"]}],
                            "ports": [{"port": 8080}]}
    body.update(fields)
    return body


def test_endpointslice_create_fills_defaults_and_reads_back(srv: LabServer) -> None:
    body = endpoint_slice("web-abcde", endpoints=[
        {"addresses": ["10.244.0.5"], "conditions": {"ready": True, "serving": True, "terminating": False},
         "nodeName": "node-a", "zone": "z1", "targetRef": {"kind": "Pod", "name": "web-1", "namespace": "eps"}},
        {"addresses": ["10.244.0.6"]},
    ], ports=[{"port": 8080, "name": "http", "appProtocol": "http"}, {"port": 53, "protocol": "UDP", "name": "dns"}])
    status, _, eps = srv.request("POST", SLICES.format(ns="eps"), body)
    assert status == 201, eps
    assert list(eps) == ["kind", "apiVersion", "metadata", "addressType", "endpoints", "ports"]
    assert eps["metadata"]["generation"] == 1
    assert eps["endpoints"] == [
        {"addresses": ["10.244.0.5"], "conditions": {"ready": True, "serving": True, "terminating": False},
         "targetRef": {"kind": "Pod", "namespace": "eps", "name": "web-1"}, "nodeName": "node-a", "zone": "z1"},
        {"addresses": ["10.244.0.6"], "conditions": {}},
    ]
    assert eps["ports"] == [{"name": "http", "protocol": "TCP", "port": 8080, "appProtocol": "http"},
                            {"name": "dns", "protocol": "UDP", "port": 53}]
    listed = srv.request("GET", "/apis/discovery.k8s.io/v1/endpointslices?labelSelector=kubernetes.io%2Fservice-name"
                                "%3Dweb")[2]
    assert listed["kind"] == "EndpointSliceList" and [s["metadata"]["name"] for s in listed["items"]] == ["web-abcde"]
    # empty endpoints and ports read back as null (no omitempty on these fields)
    status, _, empty = srv.request("POST", SLICES.format(ns="eps"), endpoint_slice("web-empty", endpoints=[],
                                                                                  ports=[]))
    assert status == 201 and (empty["endpoints"], empty["ports"]) == (None, None)


def test_endpointslice_updates_bump_generation_and_keep_address_type(srv: LabServer) -> None:
    srv.request("POST", SLICES.format(ns="eps"), endpoint_slice("gen"))
    path = f"{SLICES.format(ns='eps')}/gen"
    status, _, eps = srv.request("PATCH", path, {"endpoints": [{"addresses": ["10.244.0.9"]}]}, STRATEGIC)
    assert status == 200 and eps["metadata"]["generation"] == 2
    assert eps["endpoints"] == [{"addresses": ["10.244.0.9"], "conditions": {}}]  # atomic list: replaced
    status, _, eps = srv.request("PATCH", path, {"metadata": {"labels": {"x": "y"}}}, MERGE)
    assert status == 200 and eps["metadata"]["generation"] == 3  # its strategy counts label changes
    status, _, eps = srv.request("PATCH", path, {"metadata": {"annotations": {"x": "y"}}}, MERGE)
    assert status == 200 and eps["metadata"]["generation"] == 3
    status, _, answer = srv.request("PATCH", path, {"addressType": "FQDN",
                                                    "endpoints": [{"addresses": ["web.example.com"]}]}, MERGE)
    assert status == 422 and answer["message"] == (
        'EndpointSlice.discovery.k8s.io "gen" is invalid: addressType: Invalid value: "FQDN": field is immutable')


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        ("no-type", {"addressType": None}, "addressType: Required value"),
        ("bad-type", {"addressType": "IP"},
         'addressType: Unsupported value: "IP": supported values: "FQDN", "IPv4", "IPv6"'),
        ("v6-in-v4", {"endpoints": [{"addresses": ["fd00::5"]}]},
         'endpoints[0].addresses[0]: Invalid value: "fd00::5": must be an IPv4 address'),
        ("v4-in-v6", {"addressType": "IPv6", "endpoints": [{"addresses": ["10.0.0.1"]}]},
         'endpoints[0].addresses[0]: Invalid value: "10.0.0.1": must be an IPv6 address'),
        ("not-ip", {"endpoints": [{"addresses": ["ten"]}]},
         'endpoints[0].addresses[0]: Invalid value: "ten": must be a valid IP address, (e.g. 10.9.8.7 or '
         "2001:db8::ffff)"),
        ("loopback", {"endpoints": [{"addresses": ["127.0.0.1"]}]},
         'endpoints[0].addresses[0]: Invalid value: "127.0.0.1": may not be in the loopback range (127.0.0.0/8, '
         "::1/128)"),
        ("no-address", {"endpoints": [{"addresses": []}]},
         "endpoints[0].addresses: Required value: must contain at least 1 address"),
        ("many-addresses", {"endpoints": [{"addresses": [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(101)]}]},
         "endpoints[0].addresses: Too many: 101: must have at most 100 items"),
        ("many-endpoints", {"endpoints": [{"addresses": [f"10.0.{i // 250}.{i % 250 + 1}"]} for i in range(1001)]},
         "endpoints: Too many: 1001: must have at most 1000 items"),
        ("fqdn", {"addressType": "FQDN", "endpoints": [{"addresses": ["single"]}]},
         'endpoints[0].addresses[0]: Invalid value: "single": should be a domain with at least two segments '
         "separated by dots"),
        ("proto", {"ports": [{"port": 80, "protocol": "HTTP"}]},
         'ports[0].protocol: Unsupported value: "HTTP": supported values: "SCTP", "TCP", "UDP"'),
        ("dup-names", {"ports": [{"port": 80}, {"port": 81}]}, 'ports[1].name: Duplicate value: ""'),
        ("node", {"endpoints": [{"addresses": ["10.0.0.1"], "nodeName": "Node_A"}]},
         'endpoints[0].nodeName: Invalid value: "Node_A": a lowercase RFC 1123 subdomain must consist of lower case '
         "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. "
         "'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*"
         "[a-z0-9])?)*')"),
    ],
)
def test_invalid_endpointslices_get_the_real_messages(srv: LabServer, name: str, fields: dict[str, Any],
                                                      message: str) -> None:
    before = rv(srv)
    body = endpoint_slice(name, **fields)
    if fields.get("addressType", "") is None:
        del body["addressType"]
    status, _, answer = srv.request("POST", SLICES.format(ns="eps"), body)
    assert status == 422, answer
    assert answer["message"] == f'EndpointSlice.discovery.k8s.io "{name}" is invalid: {message}'
    assert answer["details"]["group"] == "discovery.k8s.io" and answer["details"]["kind"] == "EndpointSlice"
    assert rv(srv) == before


def test_endpointslice_of_the_wrong_json_type_is_a_400(srv: LabServer) -> None:
    status, _, answer = srv.request("POST", SLICES.format(ns="eps"), endpoint_slice("typed", ports=[{"port": "80"}]))
    assert status == 400 and answer["message"] == (
        'EndpointSlice in version "v1" cannot be handled as a EndpointSlice: json: cannot unmarshal string into Go '
        "struct field EndpointPort.ports.port of type int32")
    assert srv.request("GET", f"{SLICES.format(ns='eps')}/anything/status")[0] == 404  # no status subresource


# --- real clients -------------------------------------------------------------------------------------------


def test_official_client_reads_services_and_endpointslices(srv: LabServer) -> None:
    kubernetes = pytest.importorskip("kubernetes")
    api = kubernetes.config.new_client_from_config(config_file=str(srv.kubeconfig))
    core = kubernetes.client.CoreV1Api(api)
    body = kubernetes.client.V1Service(
        metadata=kubernetes.client.V1ObjectMeta(name="official"),
        spec=kubernetes.client.V1ServiceSpec(selector={"app": "official"}, type="NodePort",
                                             ports=[kubernetes.client.V1ServicePort(port=80, target_port="http")]),
    )
    created = core.create_namespaced_service("svc", body)
    assert created.spec.cluster_ip and created.spec.ports[0].node_port and created.spec.ports[0].target_port == "http"
    names = [s.metadata.name for s in core.list_namespaced_service("svc").items]
    assert "official" in names
    srv.request("POST", SLICES.format(ns="eps"), endpoint_slice("official-x"))
    slices = kubernetes.client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
        "eps", label_selector="kubernetes.io/service-name=web")
    got = {s.metadata.name: s for s in slices.items}
    assert got["official-x"].address_type == "IPv4" and got["official-x"].endpoints[0].addresses == ["10.244.0.5"]
    core.delete_namespaced_service("official", "svc")


def test_lightkube_reads_services_and_endpointslices(srv: LabServer) -> None:
    lightkube = pytest.importorskip("lightkube")
    from lightkube.resources.core_v1 import Service
    from lightkube.resources.discovery_v1 import EndpointSlice

    client = lightkube.Client(config=lightkube.KubeConfig.from_file(str(srv.kubeconfig)))
    try:
        create(srv, service("light"))
        svc = client.get(Service, "light", namespace="svc")
        assert svc.spec is not None and svc.spec.clusterIP and svc.spec.ipFamilies == ["IPv4"]
        srv.request("POST", SLICES.format(ns="eps"), endpoint_slice("light-x"))
        slices = {s.metadata.name: s for s in client.list(EndpointSlice, namespace="eps") if s.metadata}
        assert slices["light-x"].ports is not None and slices["light-x"].ports[0].protocol == "TCP"
        delete(srv, "light")
    finally:
        client.close()


# --- kubectl -----------------------------------------------------------------------------------------------

SERVICE_YAML = """
apiVersion: v1
kind: Service
metadata:
  name: applied
  namespace: kc
spec:
  selector: {app: applied}
  ports:
  - {name: http, port: 80, targetPort: %s}
"""

SLICE_YAML = """
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: applied-abcde
  namespace: kc
  labels: {kubernetes.io/service-name: applied}
addressType: IPv4
endpoints:
- addresses: [10.244.1.7]
  conditions: {ready: true}
  nodeName: node-a
ports:
- {name: http, port: 8080, protocol: TCP}
"""


@pytest.fixture(scope="module")
def kc() -> Iterator[LabServer]:
    if not os.path.exists(KUBECTL):
        pytest.skip("kubectl is not installed")
    with LabServer(process=True, tls=True) as server:
        server.kubectl("create", "namespace", "kc")
        yield server


def test_kubectl_api_resources_lists_services_and_endpointslices(kc: LabServer) -> None:
    out = kc.kubectl("api-resources").stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rows["services"][1:] == ["svc", "v1", "true", "Service"]
    assert rows["endpointslices"][1:] == ["discovery.k8s.io/v1", "true", "EndpointSlice"]
    names = kc.kubectl("api-resources", "--categories=all", "-o", "name").stdout.split()
    assert "services" in names and "pods" in names


def test_kubectl_creates_and_gets_services_and_endpointslices(kc: LabServer) -> None:
    assert "service/web created" in kc.kubectl("-n", "kc", "create", "service", "clusterip", "web",
                                               "--tcp=80:8080").stdout
    assert "service/np created" in kc.kubectl("-n", "kc", "create", "service", "nodeport", "np", "--tcp=80:8080",
                                              "--node-port=30555").stdout
    assert "service/applied created" in kc.kubectl("create", "-f", "-", input=SERVICE_YAML % 8080).stdout
    assert "endpointslice.discovery.k8s.io/applied-abcde created" in kc.kubectl("create", "-f", "-",
                                                                                input=SLICE_YAML).stdout
    out = kc.kubectl("-n", "kc", "get", "svc,endpointslices").stdout
    lines = out.splitlines()
    header = lines[0].split()
    assert header == ["NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE"]
    rows = {line.split()[0]: line.split() for line in lines if line and not line.startswith("NAME")}
    assert rows["service/web"][1] == "ClusterIP" and ipaddress.ip_address(rows["service/web"][2]) in CIDR
    assert rows["service/np"][1:2] + rows["service/np"][4:5] == ["NodePort", "80:30555/TCP"]
    assert rows["endpointslice.discovery.k8s.io/applied-abcde"][1:4] == ["IPv4", "8080", "10.244.1.7"]
    assert [h for h in lines if h.startswith("NAME")][1].split() == ["NAME", "ADDRESSTYPE", "PORTS", "ENDPOINTS",
                                                                       "AGE"]
    wide = kc.kubectl("-n", "kc", "get", "svc", "web", "-o", "wide").stdout
    assert wide.splitlines()[1].split()[-1] == "app=web"


def test_kubectl_apply_twice_then_change_a_port(kc: LabServer) -> None:
    kc.kubectl("apply", "-f", "-", input=(SERVICE_YAML % 8080).replace("applied", "app2"))
    before = json.loads(kc.kubectl("-n", "kc", "get", "svc", "app2", "-o", "json").stdout)
    assert "unchanged" in kc.kubectl("apply", "-f", "-", input=(SERVICE_YAML % 8080).replace("applied", "app2")).stdout
    assert "configured" in kc.kubectl("apply", "-f", "-", input=(SERVICE_YAML % 9090).replace("applied", "app2")).stdout
    after = json.loads(kc.kubectl("-n", "kc", "get", "svc", "app2", "-o", "json").stdout)
    assert after["spec"]["clusterIP"] == before["spec"]["clusterIP"]
    assert after["spec"]["ports"][0]["targetPort"] == 9090


def test_kubectl_shows_the_real_errors(kc: LabServer) -> None:
    ip = json.loads(kc.kubectl("-n", "kc", "get", "svc", "web", "-o", "json").stdout)["spec"]["clusterIP"]
    dup = kc.kubectl("-n", "kc", "create", "service", "clusterip", "dup", "--tcp=80:80", "--clusterip", ip,
                     check=False)
    assert dup.returncode != 0
    assert (f'Service "dup" is invalid: spec.clusterIPs: Invalid value: ["{ip}"]: failed to allocate IP {ip}: '
            "provided IP is already allocated") in dup.stderr
    taken = kc.kubectl("-n", "kc", "create", "service", "nodeport", "np2", "--tcp=80:80", "--node-port=30555",
                       check=False)
    assert taken.returncode != 0
    assert "spec.ports[0].nodePort: Invalid value: 30555: provided port is already allocated" in taken.stderr
    kc.kubectl("-n", "kc", "delete", "svc", "np")
    assert "service/np2 created" in kc.kubectl("-n", "kc", "create", "service", "nodeport", "np2", "--tcp=80:80",
                                               "--node-port=30555").stdout
    patched = kc.kubectl("-n", "kc", "patch", "svc", "web", "--type=merge", "-p", '{"spec":{"clusterIP":"10.96.9.9"}}',
                         check=False)
    assert patched.returncode != 0 and "may not change once set" in patched.stderr
