"""``cni: bridge``, piece by piece: the scenario's rules, the network configuration each node gets, a
missing plugin said in one line, the plugin called as a runtime calls it (a stand-in that records its
environment and stdin, and one that fails), and, as root with the real plugin, sandboxes made and removed
in a node namespace of their own with nothing left, and what a node leaked found and removed.

The whole scenario runs in tests/lab/test_lab_cni.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
from pathlib import Path

import pytest

from podmeter.lab import cni
from podmeter.lab.cni import CniError, CniPlugin, CniSandbox, LabCni, PluginMissing
from podmeter.lab.netns import host_side, in_namespace, node_namespace
from podmeter.lab.scenario import ScenarioError, parse_scenario

BASE = "name: t\nduration: 10\ncni: bridge\nnamespaces: [{name: web}]\n"


@pytest.mark.fast
def test_the_scenario_key_and_what_a_real_plugin_cannot_be_asked() -> None:
    assert parse_scenario("name: t\nduration: 5").cni == "lab"
    assert parse_scenario(BASE + "node: {pod_cidr: 10.250.0.0/26}").cni == "bridge"
    for text, message in [
        (BASE + "node: {link_prefix: eni}", "$.node.link_prefix: with cni: bridge the plugin names the pods' links"),
        (BASE + "node: {ip_reuse: oldest}", "$.node.ip_reuse: with cni: bridge host-local IPAM chooses the IPs"),
        (BASE + "steps: [{at: 1, do: reuse-during-flow, namespace: web}]",
         "$.steps[0]: reuse-during-flow needs the lab's own IP allocation"),
        (BASE + "nodes: [{name: a, pod_cidr: 10.250.0.0/27}, {name: b, pod_cidr: 10.250.1.0/27, link_prefix: azv}]",
         "$.nodes[1].link_prefix: with cni: bridge"),
        ("name: t\nduration: 5\ncni: flannel", "$.cni: Invalid enum value 'flannel'"),
    ]:
        with pytest.raises(ScenarioError) as caught:
            parse_scenario(text, "s.yaml")
        assert message in str(caught.value)


@pytest.mark.fast
def test_each_node_gets_a_bridge_a_subnet_and_ipam_state_of_its_own(tmp_path: Path) -> None:
    networks = [cni.bridge_network(node, cidr, tmp_path / node / "ipam")
                for node, cidr in (("lab-0", "10.250.0.0/27"), ("lab-1", "10.250.1.0/27"))]
    first, second = networks
    assert first["type"] == "bridge" and first["isGateway"] is True and first["ipMasq"] is False
    assert first["bridge"] != second["bridge"] and first["name"] != second["name"]
    assert all(len(n["bridge"]) <= 15 for n in networks)  # an interface name
    ipam = first["ipam"]
    assert ipam["type"] == "host-local" and ipam["ranges"] == [[{"subnet": "10.250.0.0/27"}]]
    assert ipam["routes"] == [{"dst": "0.0.0.0/0"}]  # traffic to other nodes and outside goes via the gateway
    assert ipam["dataDir"] == str(tmp_path / "lab-0" / "ipam")  # the lab's, never /var/lib/cni


@pytest.mark.fast
def test_a_missing_plugin_is_said_with_the_package_to_install(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    scenario = parse_scenario(BASE)
    monkeypatch.setattr(cni, "PLUGIN_DIRS", (tmp_path / "nothing-here",))
    with pytest.raises(PluginMissing, match="apt-get install containernetworking-plugins") as caught:
        LabCni.for_run(scenario, "ebpf", tmp_path)
    assert isinstance(caught.value, RuntimeError)  # podmeter lab: one line, exit status 2
    assert "scenario t: cni: bridge wires the pods with the bridge CNI plugin" in str(caught.value)
    memory = LabCni.for_run(scenario, "memory", tmp_path)  # no sandboxes: nothing to wire, and said
    assert not memory.active and memory.note is not None and "memory mode" in memory.note
    assert memory.node_environment("lab-node", "10.250.0.0/26") is None
    lab = LabCni.for_run(parse_scenario("name: t\nduration: 5"), "ebpf", tmp_path)
    assert not lab.active and lab.note is None


STAND_IN = """#!/bin/sh
env | grep '^CNI_' | sort > "$0.env"
cat > "$0.stdin"
if [ "$CNI_COMMAND" = ADD ]; then
  cat <<'EOF'
{"cniVersion": "1.0.0",
 "interfaces": [{"name": "BRIDGE"}, {"name": "veth0a1b2c3d", "mac": "aa:bb:cc:dd:ee:ff"},
                {"name": "eth0", "sandbox": "/run/netns/x"}],
 "ips": [{"interface": 2, "address": "fd00::5/64"}, {"interface": 2, "address": "10.250.0.7/26",
          "gateway": "10.250.0.1"}]}
EOF
fi
"""

FAILING = """#!/bin/sh
cat > /dev/null
echo '{"cniVersion": "1.0.0", "code": 11, "msg": "failed to allocate for range 0",'
echo ' "details": "no IP addresses available"}'
exit 1
"""


def stand_in(tmp_path: Path, script: str) -> CniPlugin:
    binary = tmp_path / "bridge"
    binary.write_text(script.replace("BRIDGE", cni.bridge_name("lab-node")))  # the result names the bridge too
    binary.chmod(0o755)
    conf = json.dumps(cni.bridge_network("lab-node", "10.250.0.0/26", tmp_path / "ipam")).encode()
    return CniPlugin(conf, tmp_path)


@pytest.mark.process
def test_the_plugin_is_called_as_a_container_runtime_calls_it(tmp_path: Path) -> None:
    plugin = stand_in(tmp_path, STAND_IN)
    added = plugin.add("0f1e2d3c-4b5a", "/run/netns/pmpod-test")
    assert added == cni.Added("10.250.0.7", "veth0a1b2c3d")  # the IPv4 address, the host side (not the bridge)
    environment = (tmp_path / "bridge.env").read_text().splitlines()
    assert environment == ["CNI_COMMAND=ADD", "CNI_CONTAINERID=0f1e2d3c-4b5a", "CNI_IFNAME=eth0",
                           "CNI_NETNS=/run/netns/pmpod-test", f"CNI_PATH={tmp_path}"]
    assert json.loads((tmp_path / "bridge.stdin").read_text()) == json.loads(plugin.conf)  # the config on stdin
    plugin.delete("0f1e2d3c-4b5a", "/run/netns/pmpod-test")
    assert "CNI_COMMAND=DEL" in (tmp_path / "bridge.env").read_text()
    assert plugin.calls == {"ADD": 1, "DEL": 1}


@pytest.mark.process
def test_a_failing_plugin_is_an_error_with_its_own_message(tmp_path: Path) -> None:
    plugin = stand_in(tmp_path, FAILING)
    with pytest.raises(CniError, match=r"bridge ADD for u1 failed \(exit 1\): failed to allocate for range 0 "
                                       r"no IP addresses available"):
        plugin.add("u1", "/run/netns/pmpod-test")
    gone = CniPlugin(plugin.conf, tmp_path / "nowhere")
    with pytest.raises(CniError, match="cannot run it"):
        gone.add("u1", "/run/netns/pmpod-test")


def bridge_links(bridge: str) -> list[str]:
    """The links enslaved to ``bridge`` in the caller's namespace."""
    from pyroute2 import IPRoute

    index = socket.if_nametoindex(bridge)
    with IPRoute() as ipr:
        return [str(link.get_attr("IFLA_IFNAME")) for link in ipr.get_links() if link.get_attr("IFLA_MASTER") == index]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns)")
@pytest.mark.skipif(cni.plugin_dir("bridge") is None, reason=cni.missing_plugin("bridge"))
def test_real_sandboxes_come_and_go_and_what_a_node_leaks_is_found(tmp_path: Path) -> None:
    """In a namespace standing for a node: two pods wired by the real plugin, one removed as the node removes
    it, one left behind as a killed node would; the lab's end check names the leak and removes it all."""
    wiring = LabCni("bridge", True, tmp_path, cni.plugin_dir("bridge"))
    environment = wiring.node_environment("lab-t", "10.250.7.0/28")
    assert environment is not None
    plugin = CniPlugin.from_environment(environment)
    assert plugin is not None and plugin.bridge == cni.bridge_name("lab-t")
    wired = wiring.nodes["lab-t"]
    with node_namespace(f"pmcnit{os.getpid()}") as node, in_namespace(node):
        kept, leaked = (CniSandbox(str(uuid.uuid4()), plugin) for _ in range(2))
        try:
            kept.create()
            leaked.create()
            assert (kept.ip, leaked.ip) == ("10.250.7.2", "10.250.7.3")  # IPAM's; .1 is the bridge's gateway
            assert kept.host_device is not None and kept.host_device.startswith("veth")
            assert host_side(kept.netns_path) == kept.host_device  # found from the pod's eth0, whatever its name
            assert sorted(bridge_links(plugin.bridge)) == sorted([kept.host_device, leaked.host_device or ""])
            assert wired.reservations() == {kept.ip: kept.container_id, leaked.ip: leaked.container_id}
            assert gateway_of(plugin.bridge) == ["10.250.7.1"]  # isGateway: the bridge carries it
            kept.destroy()
            kept.destroy()  # idempotent
            assert not kept.exists() and wired.reservations() == {leaked.ip: leaked.container_id}
            assert bridge_links(plugin.bridge) == [leaked.host_device]
            failures, counts = wiring.finish(lambda node: contextlib.nullcontext())
            assert [(f["invariant"], f["subject"]) for f in failures] == [("CNI", leaked.ip)]
            assert f"pod uid {leaked.container_id}" in failures[0]["detail"]
            assert counts == {"plugin": "bridge", "nodes": 1, "bridges_removed": 1, "leaks": 1}
            assert not leaked.exists()  # the leftover's namespace went with its DEL
            with pytest.raises(OSError):
                socket.if_nametoindex(plugin.bridge)
            assert not (tmp_path / "cni").exists()
        finally:  # a failed assertion leaves nothing either
            for sandbox in (kept, leaked):
                if sandbox.exists():
                    with contextlib.suppress(OSError):
                        sandbox.destroy()
            with contextlib.suppress(OSError):
                socket.if_nametoindex(plugin.bridge)
                cni._remove_bridge(plugin.bridge)


def gateway_of(bridge: str) -> list[str]:
    """The IPv4 addresses of ``bridge`` in the caller's namespace."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return [str(a.get_attr("IFA_ADDRESS"))
                for a in ipr.get_addr(index=socket.if_nametoindex(bridge), family=socket.AF_INET)]
