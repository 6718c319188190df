"""Hubble's and Retina's DNS series of a real agent (root): `podmeter agent --datapath ebpf --retina-compat=remote
--hubble-metrics dns:...`, a netns pod asking Debian's dnsmasq for names it answers, names that do not
exist and names it refuses; exact counts per pod, qtype and rcode on Hubble's own listener (linted by
Debian's `promtool check metrics`) and on the agent's /metrics; the pod's series gone after its grace."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from agent_harness import wait_for
from bpf_support import Topology, needs_root
from dns_support import AAAA, A, ask_from, message, pod_with_resolver
from drop_support import AgentProcess
from lab_server import LabServer

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
pytestmark = [needs_root, pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="promtool missing"),
              pytest.mark.skipif(not (shutil.which("dnsmasq") or Path("/usr/sbin/dnsmasq").exists()),
                                 reason="dnsmasq missing")]
HUBBLE_DNS = "dns:query;sourceEgressContext=pod;destinationIngressContext=pod"  # Retina's Hubble chart's
ASKED = [("cart.shop.svc.cluster.local", A)] * 2 + [("gone.nxdomain.test", AAAA), ("elsewhere.example", A)]
SAMPLE = re.compile(r"(?P<name>[a-z_]+)(?:\{(?P<labels>.*)\})? (?P<value>\S+)")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(topology: Topology, port: int) -> str:
    with topology.in_host(), urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def dns_samples(text: str) -> Samples:
    """The DNS samples as written (a parser would rename Retina's counters, which lack ``_total``)."""
    out = {}
    for line in text.splitlines():
        found = SAMPLE.fullmatch(line)
        if found and "dns" in found["name"]:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', found["labels"] or ""))
            out[found["name"], labels] = float(found["value"])
    return out


def having(samples: Samples, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    wanted = set(labels.items())
    return {k: v for (n, k), v in samples.items() if n == name and wanted <= k}


def test_a_real_agents_dns_in_hubbles_and_retinas_series(topology: Topology, server: LabServer, pin_dir: Path,
                                                         tmp_path: Path) -> None:
    web, cluster, resolver = pod_with_resolver(topology, server)
    hubble_port = topology.free_port()
    agent = AgentProcess(topology, server, pin_dir, tmp_path / "agent.log", args=[
        "--retina-compat=remote", "--hubble-metrics-server", f"127.0.0.1:{hubble_port}",
        "--hubble-metrics", HUBBLE_DNS])
    try:
        resolver.start()
        wait_for(lambda: agent.metric(r'podmeter_pod_dns_response_seconds_count\{namespace="shop",pod="web"\}')
                 is not None, 30, "web's DNS series", agent.log)
        for ident, (name, qtype) in enumerate(ASKED):
            assert ask_from(web, resolver.address, message(ident, name, qtype)) is not None

        def hubble() -> Samples:
            return dns_samples(scrape(topology, hubble_port))

        responses = {  # destination: the pod an answer entered (destinationIngressContext=pod)
            ("shop/web", "No Error", "A", "cart.shop.svc.cluster.local."): 2.0,
            ("shop/web", "Non-Existent Domain", "AAAA", "gone.nxdomain.test."): 1.0,
            ("shop/web", "Query Refused", "A", "elsewhere.example."): 1.0}

        def hubble_responses() -> dict[tuple[str, ...], float]:
            return {(d["destination"], d["rcode"], d["qtypes"], d["query"]): v for k, v in
                    having(hubble(), "hubble_dns_responses_total").items() if (d := dict(k))}

        wait_for(lambda: hubble_responses() == responses, 20, "Hubble's DNS responses", hubble_responses)
        samples = hubble()
        queries = {(d["source"], d["destination"], d["rcode"], d["qtypes"], d["ips_returned"], d["query"]): v
                   for k, v in having(samples, "hubble_dns_queries_total").items() if (d := dict(k))}
        assert queries == {("shop/web", "", "", "A", "0", "cart.shop.svc.cluster.local."): 2.0,
                           ("shop/web", "", "", "AAAA", "0", "gone.nxdomain.test."): 1.0,
                           ("shop/web", "", "", "A", "0", "elsewhere.example."): 1.0}
        assert {dict(k)["ips_returned"] for k in having(samples, "hubble_dns_responses_total")} == {""}
        assert having(samples, "hubble_dns_response_types_total") == {}  # no answer records read
        linted = subprocess.run([PROMTOOL, "check", "metrics"], input=scrape(topology, hubble_port).encode(),
                                capture_output=True, check=False)
        assert linted.returncode == 0, linted.stdout.decode() + linted.stderr.decode()

        retina = dns_samples(scrape(topology, agent.port))
        node = {(d["return_code"], d["query_type"], d["query"]): v for k, v in
                having(retina, "networkobservability_dns_response_count").items() if (d := dict(k))}
        assert node == {("NoError", "A", "cart.shop.svc.cluster.local."): 2.0,
                        ("NXDomain", "AAAA", "gone.nxdomain.test."): 1.0,
                        ("Refused", "A", "elsewhere.example."): 1.0}
        assert sum(having(retina, "networkobservability_dns_request_count", return_code="NoError").values()) == 4
        adv = having(retina, "networkobservability_adv_dns_response_count", destination_podname="web",
                     destination_namespace="shop", source_ip=web.host_ip)
        assert {dict(k)["return_code"]: v for k, v in adv.items()} == {"NOERROR": 2.0, "NXDOMAIN": 1.0,
                                                                       "REFUSED": 1.0}
        assert having(retina, "podmeter_retina_dns_names")[frozenset()] == 3

        with topology.in_host():
            cluster.delete_pod("shop", "web")  # its series go after their grace, and the names with them
        wait_for(lambda: not having(hubble(), "hubble_dns_queries_total"), 20, "Hubble's DNS series gone", agent.log)
        retina_gone = "networkobservability_dns_request_count"
        wait_for(lambda: not having(dns_samples(scrape(topology, agent.port)), retina_gone), 20,
                 "Retina's DNS series gone", agent.log)
        assert having(dns_samples(scrape(topology, agent.port)), "podmeter_retina_dns_names")[frozenset()] == 0
    finally:
        agent.stop()
        resolver.stop()
