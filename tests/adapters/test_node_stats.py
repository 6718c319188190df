"""The node's own-stack series (adapters.metrics.node_stats) rendered from kernel files: from text a real
kernel wrote (tests/data/node_stats/), from this machine's /proc/net, linted by Debian's ``promtool check
metrics``, capped, and with files that cannot be read: their families left out and counted, the rest
served."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
from pathlib import Path

import pytest

from bpf_support import Topology, needs_root
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.adapters.metrics.node_stats import FILES, NodeStatsExposition

CAPTURED = Path(__file__).resolve().parent.parent / "data" / "node_stats"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def render(proc_net: Path, remote_limit: int = 100, interface_limit: int = 128) -> str:
    return NodeStatsExposition(lambda: 4, remote_limit, interface_limit, proc_net).render().decode()


def test_the_captured_files_give_retinas_series() -> None:
    found = samples(render(CAPTURED))
    assert found['networkobservability_tcp_state{state="ESTABLISHED"}'] == 8
    assert found['networkobservability_tcp_state{state="LISTEN"}'] == 3
    assert {k: v for k, v in found.items() if k.startswith("networkobservability_tcp_connection_remote")} == {
        'networkobservability_tcp_connection_remote{address="10.77.0.2"}': 5,
        'networkobservability_tcp_connection_remote{address="fd00:77::2"}': 2}
    assert found['networkobservability_udp_connection_stats{statistic_name="active"}'] == 2
    assert found['networkobservability_tcp_connection_stats{statistic_name="resetcount"}'] == 4
    assert 'networkobservability_tcp_connection_stats{statistic_name="tcptimeouts"}' in found
    assert found['networkobservability_interface_stats{interface_name="eth0",statistic_name="rx_packets"}'] == 17
    assert not any('interface_name="lo"' in key for key in found)
    assert not any(v for k, v in found.items() if k.startswith("podmeter_node_stats_errors_total"))


def test_the_caps_sum_the_rest_under_other(tmp_path: Path) -> None:
    for name in FILES:
        shutil.copy(CAPTURED / name, tmp_path / name)
    dev = (CAPTURED / "dev").read_text() + "  veth9:" + " 0" * 16 + "\n"
    (tmp_path / "dev").write_text(dev)
    found = samples(render(tmp_path, remote_limit=1, interface_limit=1))
    assert found['networkobservability_tcp_connection_remote{address="_other_"}'] == 2
    assert found['networkobservability_tcp_connection_remote{address="10.77.0.2"}'] == 5
    assert found['networkobservability_interface_stats{interface_name="_other_",statistic_name="rx_packets"}'] == 0
    assert 'networkobservability_interface_stats{interface_name="veth9",statistic_name="rx_packets"}' not in found


def test_a_file_that_cannot_be_read_leaves_its_families_out_and_is_counted(tmp_path: Path) -> None:
    for name in ("tcp", "udp", "udp6", "netstat"):
        shutil.copy(CAPTURED / name, tmp_path / name)
    (tmp_path / "tcp6").mkdir()  # reading it fails (EISDIR), as an unreadable file does
    (tmp_path / "netstat").write_text("TcpExt: A B\nTcpExt: 1\n")  # malformed
    exposition = NodeStatsExposition(lambda: 4, 100, 128, tmp_path)
    exposition.render()
    text = exposition.render().decode()
    found = samples(text)
    assert "networkobservability_tcp_state{" not in text and "networkobservability_interface_stats{" not in text
    assert found['networkobservability_udp_connection_stats{statistic_name="active"}'] == 2
    assert found['networkobservability_tcp_connection_stats{statistic_name="resetcount"}'] == 4  # kept alone
    errors = {k: v for k, v in found.items() if k.startswith("podmeter_node_stats_errors_total") and v}
    assert errors == {'podmeter_node_stats_errors_total{file="tcp6",error="unreadable"}': 2,
                      'podmeter_node_stats_errors_total{file="dev",error="unreadable"}': 2,
                      'podmeter_node_stats_errors_total{file="netstat",error="malformed"}': 2}


def test_a_kernel_without_ipv6_tables_has_no_ipv6_sockets_not_an_error(tmp_path: Path) -> None:
    for name in ("tcp", "udp", "netstat", "dev"):
        shutil.copy(CAPTURED / name, tmp_path / name)
    found = samples(render(tmp_path))
    assert found['networkobservability_tcp_state{state="ESTABLISHED"}'] == 5
    assert not any(v for k, v in found.items() if k.startswith("podmeter_node_stats_errors_total"))


@pytest.mark.skipif(not os.path.exists(PROMTOOL), reason="promtool (Debian's prometheus) missing")
@pytest.mark.parametrize("source", [CAPTURED, Path("/proc/net")], ids=["captured", "this-machine"])
def test_promtool_finds_nothing(source: Path) -> None:
    text = render(source)
    assert "networkobservability_tcp_state" in text
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done


def _socket_families(text: str) -> dict[str, float]:
    """The series that follow the node's sockets (the interfaces' counters only grow)."""
    families = ("networkobservability_tcp_state", "networkobservability_tcp_connection_remote",
                "networkobservability_udp_connection_stats")
    return {k: v for k, v in samples(text).items() if k.startswith(families)}


@needs_root
def test_the_socket_series_follow_the_node_and_return_to_their_baseline_after_churn(topology: Topology) -> None:
    """A real node's namespace: 200 connections from the node to a pod, then all closed (RST, so none
    waits in TIME_WAIT): the pod's address has its series while they are open and none after, and every
    socket series is again what it was before; the exposition keeps nothing per address or socket."""
    pod = topology.add_pod()
    with netns(pod.netns_path):
        listener = socket.socket()
    listener.bind((pod.ip, 0))
    listener.listen(256)

    def rendered() -> dict[str, float]:
        with topology.in_host():  # /proc/thread-self/net: the namespace of the thread that reads it
            return _socket_families(exposition.render().decode())

    exposition = NodeStatsExposition(lambda: 0, 100, 128, Path("/proc/thread-self/net"))
    baseline = rendered()
    clients, accepted = [], []
    with listener:
        for _ in range(200):
            with topology.in_host():
                client = socket.socket()
            client.connect(listener.getsockname())
            clients.append(client)
            accepted.append(listener.accept()[0])
        during = rendered()
        for sock in clients:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a RST
            sock.close()
        for sock in accepted:
            sock.close()
    assert during[f'networkobservability_tcp_connection_remote{{address="{pod.ip}"}}'] == 200
    assert during['networkobservability_tcp_state{state="ESTABLISHED"}'] >= 200
    after = rendered()
    assert after == baseline, (baseline, after)
    assert set(exposition.errors) == {(f, e) for f in FILES for e in ("unreadable", "malformed")}
    assert not any(exposition.errors.values())
