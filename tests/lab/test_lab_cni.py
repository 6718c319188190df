"""The lab with pod links named as another CNI names them: the shipped ``other-cni`` scenario (AWS VPC CNI's
``eni<hash>``) passes with the eBPF datapath, and the agent, given no name pattern, attached to exactly
such links, at its start, as pods came, and after its SIGKILL; and the scenario's link naming is checked.

Root only (namespaces, veths, bpffs), like tests/lab/test_lab_run.py.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest

from podmeter.lab.netns import Sandbox, host_device_of
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
    assert result.passed
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
