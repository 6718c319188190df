"""The flow export of a real agent: `podmeter agent --datapath ebpf --flow-export-file PATH`, netns pods, UDP
between them and datagrams an nft rule drops.

Every line of the file parses as JSON in Hubble's exporter format, and the records are those `podmeter
observe -o json` shows for the same interval (both read the agent's one flow feed from its start), the
dropped ones included; allow and deny filters and the field mask apply and rotation keeps at most N backups
of about the maximum size; a file system that fills (a 64 KiB tmpfs) is counted while the agent's drain,
``/metrics`` and ``/readyz`` stay responsive, and the agent stops cleanly (exit 0: its writer thread ended).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from agent_harness import Cluster
from bpf_support import Pod, Topology, needs_root
from drop_support import AgentProcess, nft, routed_pod, send, udp_socket, warm
from lab_server import LabServer
from podmeter.model.flow_export import is_backup
from waiting import wait_for

pytestmark = needs_root
DROPPED_PORT = 9998
LISTENER_PORT = 9997


@pytest.fixture
def pods(topology: Topology, server: LabServer) -> tuple[Pod, Pod]:
    web, client = routed_pod(topology, None), routed_pod(topology, None)
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.pod("shop", "web", web.ip)
        cluster.pod("shop", "client", client.ip)
    return web, client


def start(topology: Topology, server: LabServer, pins: Path, tmp: Path, *args: str) -> AgentProcess:
    agent = AgentProcess(topology, server, pins, tmp / "agent.log", args=args)
    wait_for(lambda: agent.get("/readyz")[0] == 200, 30, "agent ready", agent.log)
    wait_for(lambda: agent.metric("podmeter_flow_export_records_written_total") is not None, 10, "the export's metrics",
             agent.log)
    wait_for(lambda: len(json.loads(agent.get("/debug/state")[1])["filter"]["actual"]) == 2, 10, "both pods observed",
             agent.log)
    return agent


def traffic(web: Pod, client: Pod, ports: int, dropped: int = 0, port: int = 0) -> None:
    """UDP from ``ports`` client ports to web's ``port`` (each a flow of its own, seen leaving the client and
    entering web; the kernel drops what the listener did not read as it closes), then ``dropped`` datagrams
    web's input drops."""
    warm(client, web)
    with udp_socket(web) as listener:
        listener.bind((web.ip, port))
        for _ in range(ports):
            with udp_socket(client) as sock:
                send(sock, listener.getsockname(), 1)
    if dropped:
        drop(web, client, dropped)


def drop(web: Pod, client: Pod, count: int) -> None:
    nft(web, f"in udp dport {DROPPED_PORT} drop")
    with udp_socket(client) as sock:
        send(sock, (web.ip, DROPPED_PORT), count)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def exported_dropped(path: Path) -> bool:
    """Whether the file holds a record of the datagrams web drops now (between a rotation's rename and its
    new file, none)."""
    try:
        return any(line["flow"]["verdict"] == "DROPPED" and DROPPED_PORT in ports(line["flow"]) for line in lines(path))
    except FileNotFoundError:
        return False


def ports(flow: dict[str, Any]) -> set[int]:
    return {p for l4 in flow.get("l4", {}).values() for p in l4.values() if isinstance(p, int)}


def stamp(text: str) -> tuple[int, int]:
    """An RFC 3339 time of protobuf's JSON (``...T03:04:05.123Z``) as (seconds, nanoseconds)."""
    whole, _, fraction = text.rstrip("Z").partition(".")
    return int(datetime.fromisoformat(whole + "+00:00").timestamp()), int(fraction.ljust(9, "0"))


def float_stamp(seconds: float) -> tuple[int, int]:
    """A record's time as the agent's Hubble encoder makes its timestamp."""
    whole = int(seconds)
    return whole, min(999_999_999, max(0, round((seconds - whole) * 1e9)))


def exported_key(line: dict[str, Any]) -> tuple[Any, ...]:
    flow = line["flow"]
    l4 = flow.get("l4", {})
    ports = next(iter(l4.values()), {}) if l4 else {}
    return (stamp(flow["time"]), flow["IP"]["source"], ports.get("source_port", 0), flow["IP"]["destination"],
            ports.get("destination_port", 0), next(iter(l4), "").upper(), flow["verdict"].lower(),
            flow["traffic_direction"])


def observed_key(record: dict[str, Any]) -> tuple[Any, ...]:
    ends = record["source"], record["destination"]
    return (float_stamp(record["time"]), ends[0]["ip"], ends[0]["port"] or 0, ends[1]["ip"], ends[1]["port"] or 0,
            record["protocol"].upper(), record["verdict"],
            "EGRESS" if record["observation"] == "from-pod" else "INGRESS")


def observe(topology: Topology, agent: AgentProcess) -> list[dict[str, Any]]:
    done = subprocess.run(["nsenter", f"--net={topology.host_path}", "--", sys.executable, "-m", "podmeter", "observe",
                           "--server", f"127.0.0.1:{agent.port}", "--last", "100000", "-o", "json"],
                          capture_output=True, text=True, timeout=30, check=True)
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_the_export_holds_the_records_observe_shows_in_hubbles_exporter_format(
        topology: Topology, server: LabServer, pods: tuple[Pod, Pod], pin_dir: Path, tmp_path: Path) -> None:
    web, client = pods
    path = tmp_path / "export" / "flows.log"
    agent = start(topology, server, pin_dir, tmp_path, "--flow-export-file", str(path))
    try:
        traffic(web, client, 20, dropped=5)
        wait_for(lambda: exported_dropped(path), 15, "a dropped record exported", agent.log)

        def same() -> bool:
            shown, exported = observe(topology, agent), lines(path)
            return bool(shown) and Counter(map(observed_key, shown)) == Counter(map(exported_key, exported))

        wait_for(same, 15, "the export equal to observe's records", agent.log)
        exported = lines(path)
        assert all(list(line) == ["flow", "node_name", "time"] and line["node_name"] == "node-a"
                   and line["time"] == line["flow"]["time"] for line in exported)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3}|\.\d{6}|\.\d{9})?Z", exported[0]["time"])
        to_web = [line["flow"] for line in exported if line["flow"].get("destination", {}).get("pod_name") == "web"]
        assert {f["destination"]["namespace"] for f in to_web} == {"shop"}
        assert ("client", "shop") in {(f["source"].get("pod_name"), f["source"].get("namespace")) for f in to_web}
        dropped = [f for f in (line["flow"] for line in exported)
                   if f["verdict"] == "DROPPED" and DROPPED_PORT in ports(f)]
        assert dropped and all(f["Summary"] == "NETFILTER_DROP" and f["event_type"]["type"] == 1 for f in dropped)
        assert agent.metric("podmeter_flow_export_records_written_total") == len(exported)
        assert agent.metric('podmeter_flow_export_records_dropped_total{reason="lost"}') == 0
        assert oct(path.stat().st_mode & 0o777) == "0o600"
    finally:
        agent.stop()
    assert agent.proc.returncode == 0, agent.log()


def test_filters_the_field_mask_and_rotation_apply_to_a_real_agents_export(
        topology: Topology, server: LabServer, pods: tuple[Pod, Pod], pin_dir: Path, tmp_path: Path) -> None:
    web, client = pods
    path = tmp_path / "flows.log"
    agent = start(topology, server, pin_dir, tmp_path, "--flow-export-file", str(path),
                  "--flow-export-allow", "to-pod=shop/web", "--flow-export-allow", "verdict=dropped",
                  "--flow-export-deny", f"verdict=dropped port={LISTENER_PORT}",
                  "--flow-export-deny", f"port={DROPPED_PORT} protocol=tcp",  # UDP: denies nothing
                  "--flow-export-field-mask",
                  "time,source.pod_name,destination.pod_name,verdict,l4.UDP.destination_port",
                  "--flow-export-file-max-size-mb", "0.005", "--flow-export-file-max-backups", "2")
    try:
        traffic(web, client, 150, port=LISTENER_PORT)
        wait_for(lambda: (agent.metric("podmeter_flow_export_rotations_total") or 0) >= 3, 20, "rotations", agent.log)
        drop(web, client, 3)  # after them: the drops of a drain come before its forwarded records
        wait_for(lambda: exported_dropped(path), 20, "the dropped record", agent.log)
    finally:
        agent.stop()
    assert agent.proc.returncode == 0, agent.log()
    backups = sorted(p for p in tmp_path.iterdir() if is_backup(p.name, path.name))
    assert len(backups) == 2
    for backup in backups:
        assert 5242 - 200 < backup.stat().st_size <= 5242  # 0.005 MiB: a line is about 150 bytes
    for line in [line for p in [*backups, path] for line in lines(p)]:
        flow = line["flow"]
        assert set(flow) <= {"time", "source", "destination", "verdict", "l4"} and set(line) == {"flow", "time"}
        assert "UDP" in flow["l4"] or flow["verdict"] == "DROPPED"
        if flow["verdict"] == "FORWARDED":  # allowed for going to web; any dropped record is allowed
            assert flow["destination"] == {"pod_name": "web"} and flow["source"] == {"pod_name": "client"}
            assert flow["l4"] == {"UDP": {"destination_port": flow["l4"]["UDP"]["destination_port"]}}
    kept = [line["flow"] for p in [*backups, path] for line in lines(p)]
    assert any(f["verdict"] == "DROPPED" and f["l4"] == {"UDP": {"destination_port": DROPPED_PORT}} for f in kept)
    assert any(f["verdict"] == "FORWARDED" and LISTENER_PORT in ports(f) for f in kept)
    assert not any(f["verdict"] == "DROPPED" and LISTENER_PORT in ports(f) for f in kept)  # denied


def test_a_full_file_system_is_counted_and_the_agent_keeps_draining_and_answering(
        topology: Topology, server: LabServer, pods: tuple[Pod, Pod], pin_dir: Path, tmp_path: Path,
        small_tmpfs: Path) -> None:
    web, client = pods
    path = small_tmpfs / "flows.log"
    agent = start(topology, server, pin_dir, tmp_path, "--flow-export-file", str(path))
    try:
        traffic(web, client, 400)  # about 700 bytes a line: more than 64 KiB
        wait_for(lambda: (agent.metric("podmeter_flow_export_write_errors_total") or 0) > 0, 20, "a write error",
                 agent.log)
        assert (agent.metric('podmeter_flow_export_records_dropped_total{reason="write_error"}') or 0) > 0
        assert agent.metric("podmeter_flow_export_failing") == 1
        assert all("flow" in line for line in lines(path))  # whole lines only
        drained = agent.metric("podmeter_flow_entries_drained_total") or 0
        for _ in range(3):  # the drain goes on, /metrics and /readyz answer
            assert agent.get("/readyz")[0] == 200
            traffic(web, client, 5)
        wait_for(lambda: len(observe(topology, agent)) >= 400 * 2 + 15 * 2, 15, "the drain goes on", agent.log)
        assert (agent.metric("podmeter_flow_entries_drained_total") or 0) > drained
        assert agent.log().count("cannot write") == 1  # logged once, not per batch
    finally:
        agent.stop()
    assert agent.proc.returncode == 0, agent.log()
