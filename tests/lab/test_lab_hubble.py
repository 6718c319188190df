"""``podmeter lab --hubble``: each lab agent serves Hubble's Observer API on a loopback port of its own, the lab
says where and how to follow it, and a client speaking Hubble's protocol reads the run's flows live.

The run test is the shipped ``default`` scenario, shortened to its first exchanges (traffic needs the eBPF
datapath: root). Its client is built from podmeter's own stubs and runs as the printed ``hubble observe``
command would: through its ``ip netns exec`` prefix, inside the lab node's network namespace, where the
agent's loopback is.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from podmeter.lab.cluster import ClusterRun
from podmeter.lab.netns import NETNS_DIR
from podmeter.lab.report import write_report
from podmeter.lab.run import NODE_NAME, LabOptions, LabRun
from podmeter.lab.scenario import ScenarioError, load_scenario, parse_scenario

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (bpf, netns)")

# Follows GetFlows (follow, no history: only flows that come while it is connected) and prints one JSON line
# per flow; ServerStatus first. Ends when the agent goes away at the end of the run.
CLIENT = """
import json, sys, time
import grpc
from podmeter.adapters.hubble.proto import observer_pb2, observer_pb2_grpc

channel = grpc.insecure_channel(sys.argv[1])
grpc.channel_ready_future(channel).result(timeout=40)
stub = observer_pb2_grpc.ObserverStub(channel)
status = stub.ServerStatus(observer_pb2.ServerStatusRequest(), timeout=5)
print(json.dumps({"status": {"max_flows": status.max_flows, "version": status.version,
                             "nodes": status.num_connected_nodes.value}}), flush=True)
try:
    for response in stub.GetFlows(observer_pb2.GetFlowsRequest(follow=True)):
        flow = response.flow
        print(json.dumps({"t": time.time(), "node": response.node_name,
                          "src": f"{flow.source.namespace}/{flow.source.pod_name}",
                          "dst": f"{flow.destination.namespace}/{flow.destination.pod_name}"}), flush=True)
except grpc.RpcError as exc:
    print(json.dumps({"end": exc.code().name}), flush=True)
"""


# --- the switch, the agent's flags, what the lab prints (no root) -------------------------------------


def test_the_scenario_field_turns_the_hubble_api_on_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    default = load_scenario("default")
    assert default.agent.hubble is False
    on = msgspec.structs.replace(default, agent=msgspec.structs.replace(default.agent, hubble=True))
    for scenario, override, wanted in ((default, None, False), (on, None, True), (default, True, True),
                                       (on, False, False)):
        lab = LabRun(scenario, LabOptions(tmp_path, datapath="memory", hubble=override))
        argv = lab._agent_argv()
        if not wanted:
            assert "--hubble-listen" not in argv and lab.hubble_command() is None and lab.result.hubble == {}
            continue
        address = argv[argv.index("--hubble-listen") + 1]
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) not in (lab.agent_port, lab.operator_port)
        assert lab.hubble_command() == f"hubble observe --server {address} -f"  # memory mode: no namespace
        assert lab.result.hubble == {NODE_NAME: address}


def test_a_mistyped_hubble_field_is_refused_with_its_place() -> None:
    text = "name: x\nduration: 5\nagent: {hubble: sometimes}\n"
    with pytest.raises(ScenarioError, match=r"\$\.agent\.hubble: Expected `bool`"):
        parse_scenario(text, "x.yaml")


def test_the_live_panel_shows_the_hubble_address_and_command_next_to_the_observe_one(tmp_path: Path) -> None:
    from rich.console import Console

    lab = LabRun(load_scenario("short"), LabOptions(tmp_path, datapath="memory", hubble=True))
    console = Console(width=200, record=True)
    console.print(lab._render())
    text = console.export_text()
    row = next(line for line in text.splitlines() if "agent Hubble API at" in line)
    assert f"127.0.0.1:{lab.hubble_port}" in row
    assert lab.observe_command() in text and f"hubble observe --server 127.0.0.1:{lab.hubble_port} -f" in text


def test_a_cluster_gives_every_agent_its_own_hubble_port_and_shows_each_one(tmp_path: Path) -> None:
    """Per node: its own port in its agent's flags, in the report's record and in the panel's commands (the
    ports are relayed to the runner's loopback in eBPF mode, so no command needs a namespace)."""
    from rich.console import Console

    lab = ClusterRun(load_scenario("cluster"), LabOptions(tmp_path, datapath="memory", hubble=True))
    addresses = {}
    for node in lab.nodes:
        argv = lab._node_agent_argv(node)
        assert argv.count("--hubble-listen") == 1
        addresses[node.name] = argv[argv.index("--hubble-listen") + 1]
    assert len(set(addresses.values())) == len(lab.nodes) == 3
    assert lab.result.hubble == addresses
    console = Console(width=200, record=True)
    console.print(lab._render())  # a cluster's panel: the nodes' rows, then every agent's commands
    text = console.export_text()
    for node in lab.nodes:
        assert f"hubble observe --server {addresses[node.name]} -f" in text
        assert f"podmeter observe --server 127.0.0.1:{node.port} -f" in text


# --- a run read over Hubble's protocol (root) -----------------------------------------------------------


def _follow(lab: LabRun, out: Path, started: list[subprocess.Popen[bytes]], stop: threading.Event) -> None:
    """Once the lab's node namespace is mounted, the printed command's prefix with podmeter's client in
    place of ``hubble observe`` (the client waits for the agent itself)."""
    command = lab.hubble_command()
    assert command is not None
    words = shlex.split(command)
    prefix, address = words[: words.index("hubble")], words[words.index("--server") + 1]
    netns = NETNS_DIR / lab.tag
    deadline = time.monotonic() + 30
    while not os.path.ismount(netns) and not stop.is_set():
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    script = out / "client.py"
    script.write_text(CLIENT)
    with (out / "client.out").open("wb") as sink:
        started.append(subprocess.Popen([*prefix, sys.executable, str(script), address], stdout=sink,
                                        stderr=subprocess.STDOUT))


@root_only
def test_a_hubble_client_follows_the_default_scenarios_flows_live_and_the_run_passes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = load_scenario("default")
    # The first 11 s: the pods, then UDP and TCP between pods of the web Deployments (every exchange checked).
    lab = LabRun(scenario, LabOptions(tmp_path, progress=False, duration=11, hubble=True))
    assert lab.datapath == "ebpf"
    started: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(lab, tmp_path, started, stop), daemon=True)
    follower.start()
    try:
        result = lab.run()
        ended = time.time()
    finally:
        stop.set()
        follower.join(timeout=5)
        for process in started:
            try:
                process.wait(timeout=10)  # the agent is gone: the stream ends
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    output = (tmp_path / "client.out").read_text()
    lines: list[dict[str, Any]] = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert lines, output

    assert result.passed, (result.error, result.failures, [t for t in result.traffic if not t.get("ok", True)])
    printed = capsys.readouterr().out
    assert f"with Hubble's CLI: ip netns exec {lab.tag} hubble observe --server 127.0.0.1:{lab.hubble_port} -f" \
        in printed

    status = lines[0]["status"]
    # the flow ring and the DNS ring, each --flow-buffer records (docs/hubble.md, "DNS")
    assert status["max_flows"] == 2 * scenario.agent.flow_buffer and status["version"].startswith("podmeter/")
    assert status["nodes"] == 1
    flows = [line for line in lines if "src" in line]
    assert flows and all(f["node"] == NODE_NAME and f["t"] < ended for f in flows)
    # Every named end is a pod of the scenario's namespaces; every checked exchange came through, by name.
    declared = {ns.name for ns in scenario.namespaces}
    ends = {end for f in flows for end in (f["src"], f["dst"]) if end != "/"}
    assert ends and {end.split("/")[0] for end in ends} <= declared, ends
    exchanges = {(t["src"], t["dst"]) for t in result.traffic if "flow" in t}
    assert len(exchanges) == 5  # 3 UDP and 2 TCP pairs
    assert exchanges <= {(f["src"], f["dst"]) for f in flows}, (exchanges, flows[:20])
    assert lines[-1].get("end") is not None  # the stream ended with the run, not before

    report = json.loads(write_report(result, tmp_path)[0].read_text())
    assert report["hubble"] == {NODE_NAME: f"127.0.0.1:{lab.hubble_port}"}
