"""The lab with pod links named as another CNI names them: the shipped ``other-cni`` scenario (AWS VPC CNI's
``eni<hash>``) passes with the eBPF datapath, and the agent, given no name pattern, attached to exactly
such links, at its start, as pods came, and after its SIGKILL; and the scenario's link naming is checked.
The shipped ``bridge-cni`` scenario, whose pods the real bridge CNI plugin wires (host-local IPAM, a
bridge per node), passes too, its pods' IPs IPAM's, the agent attached to the plugin's ``veth<hex>``
links only, and nothing of the plugin's left afterwards.

Root only (namespaces, veths, bpffs), like tests/lab/test_lab_run.py.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections import Counter
from pathlib import Path

import pytest

from podmeter.cli.lab import failed_checks
from podmeter.lab import cni
from podmeter.lab.cluster import lab_run
from podmeter.lab.netns import NETNS_DIR, Sandbox, host_device_of
from podmeter.lab.report import write_report
from podmeter.lab.run import LabOptions, LabRun
from podmeter.lab.scenario import ScenarioError, link_prefix_of, load_scenario, parse_scenario

ATTACHED = re.compile(r"podmeter\.attach: attached to (\S+) \(ifindex")
AWS_LINK = re.compile(r"^eni[0-9a-z]{11}$")  # eni + 11 characters: what AWS VPC CNI's names look like


def attachments(log: Path) -> Counter[str]:
    """How often the agents of the run (the log is appended to) attached to each link. One agent attaches
    to a link once (a link is a pod's, and a pod UID never runs twice): twice is the first agent and its
    successor."""
    return Counter(m.group(1) for m in ATTACHED.finditer(log.read_text(errors="replace")))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (bpf, netns)")
def test_links_named_like_aws_vpc_cni_are_found_by_what_they_are(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PODMETER_INTERFACE_PATTERN", raising=False)  # detection, not names, must find them
    scenario = load_scenario("other-cni")
    assert scenario.datapath == "ebpf" and scenario.node.link_prefix == "eni"
    lab = LabRun(scenario, LabOptions(tmp_path, progress=False))
    result = lab.run()
    assert result.error is None
    assert result.failures == [], result.failures
    assert result.passed, failed_checks(result)
    assert not any(flag.startswith("--interface") for flag in lab.processes["agent"].argv)
    traffic = [t for t in result.traffic if "skipped" not in t]
    assert len(traffic) == len(result.traffic) == 6 and all(t["ok"] for t in traffic), result.traffic
    assert all(t["flow"]["ok"] for t in traffic if "flow" in t)
    assert result.counts["agent_kills"] == 1 and result.counts["lifecycles"] >= 10
    attached = attachments(tmp_path / "logs" / "agent.log")
    assert len(attached) >= 4 + 10, attached  # the steady pods' links and the churn's, as they came
    assert sum(1 for n in attached.values() if n == 2) >= 4, attached  # the successor found the standing ones
    assert all(AWS_LINK.match(name) for name in attached), sorted(attached)


TWO_NODES = "name: t\nduration: 5\nnodes: [{name: a, %s}, {name: b, pod_cidr: 10.244.1.0/24, %s}]"
UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def test_a_scenario_names_its_links_like_a_cni_or_is_refused() -> None:
    scenario = parse_scenario("name: t\nduration: 5\nnode: {link_prefix: azv}")
    assert link_prefix_of(scenario, None) == "azv"
    assert Sandbox.for_pod(UID, "10.0.0.2", "azv").host_device == "azv5b4c3d2e1f0"
    assert Sandbox.for_pod(UID, "10.0.0.2").host_device == "pm5b4c3d2e1f0"
    several = parse_scenario(TWO_NODES % ("link_prefix: eni", "ip_reuse: lowest"))
    assert (link_prefix_of(several, "a"), link_prefix_of(several, "b")) == ("eni", "pm")
    for bad in ("calix", "Eni", "9ab", "e-n", ""):  # 5 + 11 characters is one too many for Linux
        with pytest.raises(ScenarioError, match=rf"\$\.node\.link_prefix: '{bad}' is not a link name prefix"):
            parse_scenario(f"name: t\nduration: 5\nnode: {{link_prefix: '{bad}'}}")
    with pytest.raises(ScenarioError, match=r"\$\.nodes\[1\]\.link_prefix: 'lxc_' is not a link name prefix"):
        parse_scenario(TWO_NODES % ("ip_reuse: lowest", "link_prefix: lxc_"))
    with pytest.raises(ValueError, match="at most 15"):
        Sandbox.for_pod(UID, "10.0.0.2", "toolong")
    # A killed node's leftovers are found whatever the prefix (the lab's cleanup).
    netns = Sandbox.for_pod(UID, "10.0.0.2", "eni").netns
    assert host_device_of(netns, ["lo", "pm0000000000a", "eni5b4c3d2e1f0"]) == "eni5b4c3d2e1f0"
    assert host_device_of(netns, ["lo", "x5b4c3d2e1f0x", "fabric0"]) is None


# --- the real bridge CNI plugin ---------------------------------------------------------------------------

ADDED = re.compile(r"podmeter\.node: pod (\S+): bridge ADD gave (\S+), host side (\S+), netns (\S+)")
CALLS = re.compile(r"cni: the bridge plugin was called ADD (\d+) times, DEL (\d+) times")
BRIDGE_LINK = re.compile(r"^veth[0-9a-f]{1,8}$")  # the plugin's names (ip.RandomVethName)


def leftovers(tag: str) -> list[str]:
    """The run's node namespace and pins, if still there."""
    netns = [p.name for p in NETNS_DIR.glob(f"{tag}*")] if NETNS_DIR.is_dir() else []
    return netns + [p.name for p in Path("/sys/fs/bpf").glob(f"{tag}*")]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (bpf, netns)")
@pytest.mark.skipif(cni.plugin_dir("bridge") is None, reason=cni.missing_plugin("bridge"))
def test_pods_wired_by_the_real_bridge_plugin_count_exactly_and_leave_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PODMETER_INTERFACE_PATTERN", raising=False)  # detection, not names, must find them
    scenario = load_scenario("bridge-cni")
    assert scenario.datapath == "ebpf" and scenario.cni == "bridge"
    lab = LabRun(scenario, LabOptions(tmp_path, progress=False))
    result = lab.run()
    write_report(result, tmp_path)
    assert result.error is None
    assert result.failures == [], result.failures
    assert result.passed and "PASSED" in (tmp_path / "report.html").read_text()
    assert not any(flag.startswith("--interface") for flag in lab.processes["agent"].argv)
    traffic = [t for t in result.traffic if "skipped" not in t]
    assert len(traffic) == len(result.traffic) == 7 and all(t["ok"] for t in traffic), result.traffic
    assert all(t["flow"]["ok"] for t in traffic if "flow" in t)
    assert {t.get("kind") for t in traffic} == {None, "drops netfilter-input", "loss"}
    assert result.counts["agent_kills"] == 1 and result.counts["lifecycles"] >= 10

    # Every sandbox was the plugin's: its IP the one host-local gave (never the bridge's gateway), its link
    # a veth<hex>; the pods' status carries those IPs (the traffic's ends are read from it).
    node_log = (tmp_path / "logs" / "node.log").read_text()
    added = {netns: (pod, ip, veth) for pod, ip, veth, netns in ADDED.findall(node_log)}
    assert len(added) >= 6 + 10, node_log[-3000:]  # the steady pods and the churn's
    subnet = ipaddress.ip_network(scenario.node.pod_cidr)
    ips = {ip for _, ip, _ in added.values()}
    assert all(ipaddress.ip_address(ip) in subnet for ip in ips) and str(subnet[1]) not in ips
    assert {end for t in traffic for end in (t["src_ip"], t.get("dst_ip")) if end} <= ips
    veths = {veth for _, _, veth in added.values()}
    assert all(BRIDGE_LINK.match(veth) for veth in veths), sorted(veths)
    attached = attachments(tmp_path / "logs" / "agent.log")
    assert set(attached) <= veths, sorted(set(attached) - veths)  # the plugin's links, and nothing else
    assert len(attached) >= 6 + 8, attached  # the steady pods' (unobserved ones too) and the churn's, as they came
    assert sum(1 for n in attached.values() if n == 2) >= 6, attached  # the successor found the standing ones

    # Back to baseline: every ADD had its DEL, nothing the plugin made is left (the lab checked its node
    # before removing it: no reservation, no veth on the bridge; then the bridge and the IPAM state went).
    [(adds, dels)] = CALLS.findall(node_log)
    assert int(adds) == len(added) and int(dels) >= int(adds)
    assert result.counts["cni"] == {"plugin": "bridge", "nodes": 1, "bridges_removed": 1, "leaks": 0}
    assert not (tmp_path / "cni").exists()
    assert [netns for netns in added if (NETNS_DIR / netns).exists()] == []
    assert leftovers(lab.tag) == []
    assert result.samples[-1].kernel == 0 and result.samples[-1].pods == 0


TWO_BRIDGED_NODES = """
name: bridge-cni-two-nodes
seed: 3
datapath: ebpf
cni: bridge
duration: 8
settle: 3
nodes:
  - {name: lab-0, pod_cidr: 10.250.1.0/27}
  - {name: lab-1, pod_cidr: 10.250.2.0/27}
agent: {resync_interval: 5}
operator: {sweep_period: 5}
namespaces: [{name: web}]
steps:
  - {at: 0, do: pods, namespace: web, count: 4, prefix: api, deployment: true}
  - {at: 2, do: traffic, namespace: web, protocol: udp, pairs: 2, packets: 30, size: 300, rate: 200, across_nodes: true}
  - {at: 4, do: traffic, namespace: web, protocol: tcp, pairs: 1, packets: 30, size: 1000, across_nodes: true}
  - {at: 5, do: churn, namespace: web, rate: 2, duration: 2, lifetime: 1}
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (bpf, netns)")
@pytest.mark.skipif(cni.plugin_dir("bridge") is None, reason=cni.missing_plugin("bridge"))
def test_two_nodes_each_with_its_bridge_and_subnet_exchange_exactly(tmp_path: Path) -> None:
    """Each node's plugin wires its pods on a bridge and a subnet of its own; across nodes the traffic
    leaves one bridge, crosses the fabric and enters the other, exact against both agents."""
    lab = lab_run(parse_scenario(TWO_BRIDGED_NODES), LabOptions(tmp_path, progress=False))
    result = lab.run()
    assert result.error is None
    assert result.failures == [], result.failures
    assert result.passed, failed_checks(result)
    traffic = [t for t in result.traffic if "skipped" not in t]
    assert len(traffic) == 3 and all(t["ok"] for t in traffic), result.traffic
    for i, node in enumerate(("lab-0", "lab-1")):
        log = (tmp_path / "logs" / f"node-{node}.log").read_text()
        added = ADDED.findall(log)
        assert added and all(ip.startswith(f"10.250.{i + 1}.") and BRIDGE_LINK.match(veth)
                             for _, ip, veth, _ in added), added
        assert {veth for _, _, veth, _ in added} >= set(attachments(tmp_path / "logs" / f"agent-{node}.log"))
        assert f"bridge {cni.bridge_name(node)}" in log
    assert {(t["src_ip"].split(".")[2], t["dst_ip"].split(".")[2]) for t in traffic} >= {("1", "2"), ("2", "1")}
    assert result.counts["cni"] == {"plugin": "bridge", "nodes": 2, "bridges_removed": 2, "leaks": 0}
    assert not (tmp_path / "cni").exists() and leftovers(lab.tag) == []
