"""Drops and TCP health in the kernel (root): real pods in network namespaces, real packets, real drops.

Each induced drop kind (a netfilter rule on a pod's input or output, a blackhole route on the node, a
SYN to a closed port, random loss) is counted with the reason the running kernel gives it, for the right
pod and direction, exactly; traffic of unobserved pods is never counted; an IP that leaves the filter
leaves the drop maps with the next drain; a full map counts its losses; reason names are the running
kernel's (checked against tracefs' own table); a tracepoint or BTF the kernel lacks turns only what it
needs off, with a notice.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from bpf_support import Topology, needs_root, run
from drop_support import Drained, lossy_link, nft, routed_pod, send, udp_socket, unread, upload, warm
from flow_support import pod as flow_pod
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.adapters.datapath.ebpf.drops import (
    DROP_FLOWS_MAP,
    DROPS_MAP,
    TCP_FLOWS_MAP,
    TCP_MAP,
    DropsUnavailable,
    DropTracer,
    read_reasons,
)
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.adapters.flow_serving import FlowFeed
from podmeter.model.datapath import Direction
from podmeter.model.drops import HOOK_DROPS, HOOKS, LIFECYCLE_REASONS, DropDrain, DropLedger, TcpEvent
from podmeter.model.flows import TCP, UDP
from podmeter.runtime.drop_drain import DropDrainer

pytestmark = needs_root

IN, OUT = Direction.INGRESS, Direction.EGRESS
TRACEFS = Path("/sys/kernel/tracing")
Opener = Callable[..., EbpfDatapath]


@pytest.fixture
def datapath(open_datapath: Opener) -> EbpfDatapath:
    return open_datapath(64)


@pytest.fixture
def tracer(datapath: EbpfDatapath) -> Iterator[DropTracer]:
    with DropTracer.open(datapath.filter_map, 64) as opened:
        assert opened.hooks == dict.fromkeys(HOOKS, True), opened.notices
        yield opened


# --- reasons ---------------------------------------------------------------------------------------------


def tracefs_reasons() -> dict[int, str]:
    """The kernel's own reason table, from the kfree_skb event's print format (an independent source)."""
    if not (TRACEFS / "events").is_dir():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=False, capture_output=True)
    text = (TRACEFS / "events/skb/kfree_skb/format").read_text()
    return {int(code): name for code, name in re.findall(r'\{ (\d+), "(\w+)" \}', text)}


def test_reasons_decode_from_this_kernels_btf_as_tracefs_names_them() -> None:
    reasons = read_reasons()
    assert len(reasons) > 50
    table = tracefs_reasons()
    assert table, "tracefs printed no reason table"
    assert {code: reasons.name(code) for code in table} == table
    assert "NETFILTER_DROP" in reasons.names.values() and "NOT_SPECIFIED" in reasons.names.values()


# --- each kind of drop, for the right pod and direction ---------------------------------------------------


def test_a_netfilter_drop_on_a_pods_input_counts_for_both_ends_with_its_reason(
        topology: Topology, datapath: EbpfDatapath, tracer: DropTracer) -> None:
    sender, receiver = routed_pod(topology, datapath), routed_pod(topology, datapath)
    warm(sender, receiver)
    nft(receiver, "in udp dport 9998 drop")
    with udp_socket(sender) as sock:
        sock.bind((sender.ip, 0))
        send(sock, (receiver.ip, 9998), 7)
        port = sock.getsockname()[1]
    seen = Drained(tracer).until(lambda d: d.drops[receiver.ip, IN, "NETFILTER_DROP"] >= 7)
    assert seen.drops == {(receiver.ip, IN, "NETFILTER_DROP"): 7, (sender.ip, OUT, "NETFILTER_DROP"): 7}
    assert seen.flows == {(sender.ip, receiver.ip, port, 9998, UDP, "NETFILTER_DROP"): 7}
    assert seen.tcp == {} and seen.retransmits == {}


def test_a_netfilter_drop_on_a_pods_output_counts_for_the_sender_only_when_the_peer_is_not_observed(
        topology: Topology, datapath: EbpfDatapath, tracer: DropTracer) -> None:
    sender, peer = routed_pod(topology, datapath), routed_pod(topology, None)
    nft(sender, "out udp dport 9997 drop")
    with udp_socket(sender) as sock:
        send(sock, (peer.ip, 9997), 5)
    seen = Drained(tracer).until(lambda d: sum(d.drops.values()) >= 5)
    assert seen.drops == {(sender.ip, OUT, "NETFILTER_DROP"): 5}


def test_ipv6_drops_count_like_ipv4(topology: Topology, datapath: EbpfDatapath, tracer: DropTracer) -> None:
    pod = topology.add_pod(ipv6=True)
    assert pod.ip6 is not None and pod.host_ip6 is not None
    assert datapath.insert([pod.ip6]).error is None
    nft(pod, "in udp dport 9996 drop")
    with udp_socket(pod, socket.AF_INET6) as listener:  # resolve the neighbour first, through an open port
        listener.bind((pod.ip6, 0))
        with topology.in_host():
            host = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        with host:
            host.sendto(b"hi", listener.getsockname())
            listener.settimeout(5)
            listener.recvfrom(10)
            send(host, (pod.ip6, 9996), 4)
    seen = Drained(tracer).until(lambda d: sum(d.drops.values()) >= 4)
    assert seen.drops == {(pod.ip6, IN, "NETFILTER_DROP"): 4}


def test_a_blackhole_route_on_the_node_drops_what_a_pod_sends_into_it(
        topology: Topology, datapath: EbpfDatapath, tracer: DropTracer) -> None:
    pod = routed_pod(topology, datapath)
    run("ip", "-n", topology.host, "route", "add", "blackhole", "198.51.100.7")
    with udp_socket(pod) as sock:
        send(sock, ("198.51.100.7", 53), 9)
    seen = Drained(tracer).until(lambda d: sum(d.drops.values()) >= 9)
    # The reason is the running kernel's: this one gives a forwarded packet that meets a blackhole route
    # NOT_SPECIFIED (newer kernels may name it); either way one per packet, egress of the pod.
    ((key, count),) = seen.drops.items()
    assert (key[0], key[1], count) == (pod.ip, OUT, 9)
    assert key[2] in read_reasons().names.values()


def test_a_syn_to_a_closed_port_is_a_no_socket_drop_a_reset_sent_and_a_reset_received(
        topology: Topology, datapath: EbpfDatapath, tracer: DropTracer) -> None:
    client, server = routed_pod(topology, datapath), routed_pod(topology, datapath)
    warm(client, server)
    with netns(client.netns_path):
        sock = socket.socket()
    with sock, pytest.raises(ConnectionRefusedError):
        sock.settimeout(5)
        sock.connect((server.ip, 4444))
    seen = Drained(tracer).until(lambda d: sum(d.tcp.values()) >= 2)
    assert seen.tcp == {(server.ip, TcpEvent.RESET_SENT): 1, (client.ip, TcpEvent.RESET_RECEIVED): 1}
    assert seen.drops == {(server.ip, IN, "NO_SOCKET"): 1, (client.ip, OUT, "NO_SOCKET"): 1}


def test_random_loss_makes_the_sender_retransmit_and_nobody_else(
        topology: Topology, datapath: EbpfDatapath, tracer: DropTracer) -> None:
    client, server = routed_pod(topology, datapath), routed_pod(topology, datapath)
    warm(client, server)
    lossy_link(topology, client, "meta l4proto tcp ip length > 100 numgen random mod 4 0 drop")
    client_port, server_port = upload(client, server, 3_000_000)
    seen = Drained(tracer).until(lambda d: d.tcp[client.ip, TcpEvent.RETRANSMIT] > 0)
    assert seen.tcp[client.ip, TcpEvent.RETRANSMIT] > 0
    assert seen.tcp[server.ip, TcpEvent.RETRANSMIT] == 0
    assert seen.drops[client.ip, OUT, "NETFILTER_DROP"] > 0
    assert set(seen.retransmits) == {(client.ip, server.ip, client_port, server_port)}
    assert seen.retransmits[client.ip, server.ip, client_port, server_port] == seen.tcp[client.ip, TcpEvent.RETRANSMIT]
    assert {(f[0], f[4]) for f in seen.flows} == {(client.ip, TCP)}  # the client's data segments, lost


class Recorded:
    """A drop source that is the tracer, with everything it drained kept (what the kernel said)."""

    def __init__(self, tracer: DropTracer) -> None:
        self.tracer, self.seen = tracer, Drained(tracer)

    @property
    def hooks(self) -> Mapping[str, bool]:
        return self.tracer.hooks

    def drain_drops(self) -> DropDrain:
        return self.seen.drain()

    def drops_lost(self) -> Mapping[str, int]:
        return self.tracer.drops_lost()


def test_a_connection_closed_with_unread_data_is_a_lifecycle_drop_not_a_drop_nor_a_dropped_flow(
        topology: Topology, datapath: EbpfDatapath, tracer: DropTracer) -> None:
    """A segment left in the accept queue of a listener that closes without accepting it: the kernel frees
    it as QUEUE_PURGE, for both ends. Through the agent's drain it is a lifecycle drop of each pod, and
    neither a drop of either nor a dropped flow."""
    assert "QUEUE_PURGE" in read_reasons().names.values()
    client, server = routed_pod(topology, datapath), routed_pod(topology, datapath)
    warm(client, server)
    pods = [flow_pod("client", client.ip), flow_pod("server", server.ip)]
    ledger, feed = DropLedger(grace=10), FlowFeed(100)
    for one in pods:
        ledger.assign(one.ips[0], one, now=0)
    source = Recorded(tracer)
    drainer = DropDrainer(source, ledger, "node-a", feed)
    with unread(client, server) as ports:
        deadline = time.monotonic() + 5
        while not ledger.node_lifecycle and time.monotonic() < deadline:
            drainer.drain(pods)
            time.sleep(0.02)
        time.sleep(0.1)
        drainer.drain(pods)
    seen = source.seen
    purged = seen.drops[server.ip, IN, "QUEUE_PURGE"]
    assert purged >= 1 and seen.drops[client.ip, OUT, "QUEUE_PURGE"] == purged  # the kernel's word for it
    assert {f: n for f, n in seen.flows.items() if f[5] == "QUEUE_PURGE"} == {
        (client.ip, server.ip, *ports, TCP, "QUEUE_PURGE"): purged}  # a dropped flow, as the kernel counts it
    by_name = {s.name: s for s in ledger.values()}
    assert by_name["server"].lifecycle == {(IN, "QUEUE_PURGE"): purged}
    assert by_name["client"].lifecycle == {(OUT, "QUEUE_PURGE"): purged}
    assert not [key for s in ledger.values() for key in s.drops if key[1] in LIFECYCLE_REASONS]
    assert not [key for key in ledger.node_drops if key[1] in LIFECYCLE_REASONS]
    assert [r for _, r in feed.ring.after(0) if r.drop_reason in LIFECYCLE_REASONS] == []


# --- what is not counted, and what leaves ------------------------------------------------------------------


def test_drops_between_unobserved_pods_are_never_counted(
        topology: Topology, datapath: EbpfDatapath, tracer: DropTracer) -> None:
    observed = routed_pod(topology, datapath)  # in the filter, but not part of the exchange
    one, two = routed_pod(topology, None), routed_pod(topology, None)
    warm(one, two)
    nft(two, "in udp dport 9998 drop")
    run("ip", "-n", topology.host, "route", "add", "blackhole", "198.51.100.8")
    with udp_socket(one) as sock:
        send(sock, (two.ip, 9998), 20)
        send(sock, ("198.51.100.8", 53), 20)
    with netns(one.netns_path), socket.socket() as tcp, pytest.raises(ConnectionRefusedError):
        tcp.connect((two.ip, 4444))
    time.sleep(0.3)
    for name in (DROPS_MAP, DROP_FLOWS_MAP, TCP_MAP, TCP_FLOWS_MAP):
        assert tracer.entries(name) == [], name
    assert not tracer.drain_drops()
    assert observed.ip  # (its IP stayed in the filter throughout)


def test_an_ip_that_leaves_the_filter_leaves_the_drop_maps_with_the_next_drain(
        topology: Topology, datapath: EbpfDatapath, tracer: DropTracer) -> None:
    pod = routed_pod(topology, datapath)
    nft(pod, "out udp dport 9995 drop")
    with udp_socket(pod) as sock:
        send(sock, ("192.0.2.1", 9995), 3)
        time.sleep(0.1)
        assert {entry[0][:16] for entry in tracer.entries(DROPS_MAP)}  # counted, waiting for the drain
        assert datapath.delete([pod.ip]).error is None  # the pod was deleted: the agent deletes, then drains
        seen = Drained(tracer).until(lambda d: sum(d.drops.values()) >= 3)
        assert seen.drops == {(pod.ip, OUT, "NETFILTER_DROP"): 3}
        send(sock, ("192.0.2.1", 9995), 3)  # its IP is no longer observed: nothing new
        time.sleep(0.2)
    for name in (DROPS_MAP, DROP_FLOWS_MAP, TCP_MAP, TCP_FLOWS_MAP):
        assert tracer.entries(name) == [], name


def test_a_full_map_counts_what_it_lost_and_per_pod_drops_stay_exact(
        topology: Topology, datapath: EbpfDatapath) -> None:
    pod = routed_pod(topology, datapath)
    nft(pod, "out udp dport 9994 drop")
    with DropTracer.open(datapath.filter_map, 4) as small:
        sockets = [udp_socket(pod) for _ in range(10)]  # ten flows (source ports), two packets each
        try:
            for sock in sockets:
                send(sock, ("192.0.2.1", 9994), 2)
        finally:
            for sock in sockets:
                sock.close()
        seen = Drained(small).until(lambda d: sum(d.drops.values()) >= 20)
        assert seen.drops == {(pod.ip, OUT, "NETFILTER_DROP"): 20}  # one entry: it fits
        assert len(seen.flows) == 4 and sum(seen.flows.values()) == 8
        assert small.drops_lost() == {"drops": 0, "drop_flows": 12, "tcp": 0, "tcp_flows": 0}


# --- kernels without the hooks ---------------------------------------------------------------------------


def test_unreadable_btf_turns_drops_off_with_a_clear_reason(datapath: EbpfDatapath) -> None:
    with pytest.raises(DropsUnavailable, match=r"cannot read the kernel's BTF at /nonexistent/vmlinux .*drops and "
                                               r"TCP health are off"):
        DropTracer.open(datapath.filter_map, btf_path="/nonexistent/vmlinux")


def test_a_missing_tracepoint_turns_only_its_hook_off(topology: Topology, datapath: EbpfDatapath) -> None:
    with DropTracer.open(datapath.filter_map, tracepoints={HOOK_DROPS: "kfree_skb_gone"}) as partial:
        assert partial.hooks == {**dict.fromkeys(HOOKS, True), HOOK_DROPS: False}
        assert partial.notices == ["tracepoint skb:kfree_skb_gone is not in this kernel (no btf_trace_kfree_skb_gone "
                                   "in its BTF): drops are not counted"]
        client, server = routed_pod(topology, datapath), routed_pod(topology, datapath)
        with netns(client.netns_path), socket.socket() as sock, pytest.raises(ConnectionRefusedError):
            sock.connect((server.ip, 4444))
        seen = Drained(partial).until(lambda d: sum(d.tcp.values()) >= 2)
        assert seen.drops == {} and sum(seen.tcp.values()) == 2
    every = {hook: f"{hook}_gone" for hook in HOOKS}
    with pytest.raises(DropsUnavailable, match="tcp:tcp_receive_reset_gone is not in this kernel"):
        DropTracer.open(datapath.filter_map, tracepoints=every)


def test_closing_detaches_every_program(datapath: EbpfDatapath) -> None:
    before = run("bpftool", "prog", "show")
    tracer = DropTracer.open(datapath.filter_map)
    ids = set(re.findall(r"^(\d+): tracing\s+name (pm_\w+)", run("bpftool", "prog", "show"), re.M)) - set(
        re.findall(r"^(\d+): tracing\s+name (pm_\w+)", before, re.M))
    assert {name for _, name in ids} == {"pm_kfree_skb", "pm_tcp_retransmit", "pm_tcp_send_reset",
                                         "pm_tcp_receive_reset"}
    tracer.close()
    deadline = time.monotonic() + 10  # tracing programs are freed after an RCU grace period
    while ids & set(re.findall(r"^(\d+): tracing\s+name (pm_\w+)", run("bpftool", "prog", "show"), re.M)):
        assert time.monotonic() < deadline, "programs still loaded after close"
        time.sleep(0.1)


PRIVILEGES = """
import json, shutil, sys
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.adapters.datapath.ebpf.drops import DropsUnavailable, DropTracer
dp = EbpfDatapath.open(sys.argv[1], filter_size=16)
try:
    with DropTracer.open(dp.filter_map) as tracer:
        print(json.dumps({"hooks": tracer.hooks}))
except DropsUnavailable as error:
    print(json.dumps({"off": str(error)}))
finally:
    dp.close()
"""


@pytest.mark.parametrize("perfmon", [False, True], ids=["bpf+net_admin", "bpf+net_admin+perfmon"])
def test_tracing_needs_cap_perfmon_and_says_so(pin_dir: Path, perfmon: bool) -> None:
    caps = "-all,+bpf,+net_admin" + (",+perfmon" if perfmon else "")
    result = subprocess.run(["setpriv", "--reuid=0", f"--inh-caps={caps}", f"--ambient-caps={caps}",
                             f"--bounding-set={caps}", sys.executable, "-c", PRIVILEGES, str(pin_dir)],
                            capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    outcome = json.loads(result.stdout.splitlines()[-1])
    if perfmon:
        assert outcome == {"hooks": dict.fromkeys(HOOKS, True)}
    else:
        assert outcome["off"].startswith("tracing programs need CAP_PERFMON (or CAP_SYS_ADMIN) besides CAP_BPF")
