"""The lab's cluster DNS (podmeter.lab.dnscheck): the server's log read exactly, resolv.conf and the hosts
file as a cluster writes them, and, as root, a real dnsmasq answering a real glibc resolver in two network
namespaces, the search-path storm counted from the server's own log."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from podmeter.lab import dnscheck
from podmeter.lab.scenario import DnsLookups, ScenarioError, load_scenario, parse_scenario
from podmeter.lab.traffic import Endpoint

LOG = """\
Dec  2 03:36:36 dnsmasq[2708]: 2 10.244.8.3/56550 query[A] nosuch.shop.svc.cluster.local from 10.244.8.3
Dec  2 03:36:36 dnsmasq[2708]: 2 10.244.8.3/56550 config nosuch.shop.svc.cluster.local is NXDOMAIN
Dec  2 03:36:36 dnsmasq[2708]: 5 10.244.8.3/40544 query[A] nosuch from 10.244.8.3
Dec  2 03:36:36 dnsmasq[2708]: 5 10.244.8.3/40544 config error is REFUSED (EDE: not ready)
Dec  2 03:36:37 dnsmasq[2708]: 6 10.244.8.4/40545 query[AAAA] web.shop.svc.cluster.local from 10.244.8.4
Dec  2 03:36:37 dnsmasq[2708]: 6 10.244.8.4/40545 /tmp/x/hosts web.shop.svc.cluster.local is NODATA-IPv6
Dec  2 03:36:37 dnsmasq[2708]: 7 10.244.8.4/40546 query[A] web.shop.svc.cluster.local from 10.244.8.4
Dec  2 03:36:37 dnsmasq[2708]: 7 10.244.8.4/40546 /tmp/x/hosts web.shop.svc.cluster.local is 10.96.0.20
Dec  2 03:36:37 dnsmasq[2708]: 7 10.244.8.4/40546 /tmp/x/hosts web.shop.svc.cluster.local is 10.96.0.21
Dec  2 03:36:38 dnsmasq[2708]: 8 10.244.8.4/40547 query[A] lost.shop.svc.cluster.local from 10.244.8.4
"""

pytestmark = pytest.mark.fast


def test_server_log_counts_each_query_and_each_answer_once() -> None:
    seen = dnscheck.parse_server_log(LOG)
    assert seen.queries == {"10.244.8.3": Counter(A=2), "10.244.8.4": Counter(A=2, AAAA=1)}
    # two records of one answer are one response; an unanswered query is no response
    assert seen.responses == {"10.244.8.3": Counter(NXDOMAIN=1, REFUSED=1), "10.244.8.4": Counter(NOERROR=2)}
    assert seen.names["10.244.8.3"] == {"nosuch.shop.svc.cluster.local", "nosuch"}


def test_resolv_conf_and_hosts_are_a_clusters() -> None:
    assert dnscheck.kube_dns_address("10.96.0.0/16") == "10.96.0.10"
    assert dnscheck.kube_dns_address("fd00:96::/112") == "fd00:96::a"
    assert dnscheck.resolv_conf("shop", "10.96.0.10").splitlines() == [
        "search shop.svc.cluster.local svc.cluster.local cluster.local", "nameserver 10.96.0.10",
        "options ndots:5"]
    services = [{"metadata": {"name": "web", "namespace": "shop"}, "spec": {"clusterIP": "10.96.0.20"}},
                {"metadata": {"name": "headless", "namespace": "shop"}, "spec": {"clusterIP": "None"}},
                {"metadata": {"name": "broken"}, "spec": {}}]
    assert dnscheck.hosts_file(services) == "10.96.0.20 web.shop.svc.cluster.local\n"


def test_the_shipped_scenario_and_bad_steps() -> None:
    scenario = load_scenario("dns")
    steps = [s for s in scenario.steps if isinstance(s, DnsLookups)]
    assert steps and steps[0].names and steps[0].server_namespace == "lab-dns"
    text = (Path(dnscheck.__file__).parent / "scenarios" / "dns.yaml").read_text()
    with pytest.raises(ScenarioError, match=r"server_namespace: 'nowhere' is not declared"):
        parse_scenario(text.replace("server_namespace: lab-dns", "server_namespace: nowhere"))
    with pytest.raises(ScenarioError, match=r"names"):
        parse_scenario(text.replace("names: [kube-dns.lab-dns, no-such-service, example.org]", "names: ['a b']"))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_pods() -> Iterator[tuple[Endpoint, Endpoint]]:
    """A server and a client namespace joined by a veth pair (10.250.53.1 and .2)."""
    if os.geteuid() != 0 or shutil.which("dnsmasq") is None:
        pytest.skip("needs root and dnsmasq")
    tag = uuid.uuid4().hex[:6]
    server, client = f"pmdns-s{tag}", f"pmdns-c{tag}"
    for name in (server, client):
        _ip("netns", "add", name)
    try:
        _ip("link", "add", f"pmd{tag}a", "netns", server, "type", "veth", "peer", "name", f"pmd{tag}b",
            "netns", client)
        for name, link, address in ((server, f"pmd{tag}a", "10.250.53.1"), (client, f"pmd{tag}b", "10.250.53.2")):
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield (Endpoint("lab-dns/dns-1", "10.250.53.1", f"/run/netns/{server}"),
               Endpoint("shop/client-1", "10.250.53.2", f"/run/netns/{client}"))
    finally:
        for name in (server, client):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


@pytest.mark.process
def test_real_dnsmasq_and_glibc_make_the_search_path_storm(two_pods: tuple[Endpoint, Endpoint],
                                                           tmp_path: Path) -> None:
    server, client = two_pods
    services = [{"metadata": {"name": "web", "namespace": "shop"}, "spec": {"clusterIP": "10.96.0.20"}}]
    etc = dnscheck.NETNS_ETC / Path(client.netns_path).name
    with dnscheck.dns_server(server, services, tmp_path) as log, \
            dnscheck.pointed_at([client], "shop", server.ip):
        assert (etc / "resolv.conf").read_text() == dnscheck.resolv_conf("shop", server.ip)
        assert dnscheck.wait_serving(client, log, "shop")
        start = log.stat().st_size
        assert dnscheck.lookup(client, "web")  # web.shop.svc.cluster.local: the first search domain
        assert not dnscheck.lookup(client, "no-such-service")
        seen = dnscheck.parse_server_log(log.read_bytes()[start:].decode())
    assert not etc.exists()  # the directory it made is gone with the file
    assert seen.responses[client.ip]["NOERROR"] == 1
    assert seen.responses[client.ip]["NXDOMAIN"] == 3  # the three search domains
    assert seen.responses[client.ip]["REFUSED"] >= 1  # the absolute name: no upstream
    assert sum(seen.queries[client.ip].values()) == sum(seen.responses[client.ip].values())
    assert {"no-such-service.shop.svc.cluster.local", "no-such-service"} <= seen.names[client.ip]


def test_the_report_has_a_dns_table_per_client_pod() -> None:
    from podmeter.lab import report

    seen = {"queries": {"A": 5}, "responses": {"NXDOMAIN": 3, "NOERROR": 2}, "names": ["web.shop.svc.cluster.local"]}
    check = {"kind": "dns", "per_pod": {"shop/client-1": seen}}
    html = "".join(report._dns_section([{"kind": "service"}, check]))
    assert "<h2>DNS</h2>" in html and "shop/client-1" in html
    assert "NXDOMAIN 3, NOERROR 2" in html and "web.shop.svc.cluster.local" in html
    assert report._dns_section([{"kind": "service"}]) == []
