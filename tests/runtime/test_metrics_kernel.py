"""Per-pod traffic from real packets: netns pods, the eBPF datapath, the agent, a Prometheus scrape."""

from __future__ import annotations

from collections.abc import Callable

from agent_harness import AgentHarness, Cluster
from bpf_support import UDP_HEADERS, Topology, needs_root, udp_echo
from lab_server import LabServer
from metrics_support import pod_value, scrape
from podmeter.adapters.datapath.ebpf import AttachManager, EbpfDatapath

pytestmark = needs_root


def test_exact_per_pod_counts_from_real_udp(lab_apiserver: LabServer, topology: Topology,
                                            open_datapath: Callable[..., EbpfDatapath]) -> None:
    datapath = open_datapath(64)
    observed, unobserved = topology.add_pod(), topology.add_pod()
    assert datapath.programs is not None
    manager = AttachManager(datapath.programs, netns=topology.host_path)
    manager.start()
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop")
    try:
        with AgentHarness(lab_apiserver, datapath=datapath) as agent:
            cluster.pod("shop", "seen", observed.ip, observe=True)
            cluster.pod("shop", "unseen", unobserved.ip)
            agent.wait_filter({observed.ip})
            sizes = [10, 200, 1000, 1400]
            udp_echo(topology, observed, sizes)
            udp_echo(topology, unobserved, sizes)
            samples = scrape(agent)
            expected_bytes = sum(size + UDP_HEADERS for size in sizes)
            for direction in ("egress", "ingress"):  # each datagram out, its echo in
                assert pod_value(samples, "podmeter_pod_packets_total", "seen", direction) == len(sizes)
                assert pod_value(samples, "podmeter_pod_bytes_total", "seen", direction) == expected_bytes
                assert pod_value(samples, "podmeter_pod_bytes_total", "unseen", direction) is None
            # The narrow read (an IP changing hands) is the whole read's entries of those IPs, key by key.
            narrow = agent.on_loop(lambda: datapath.read_counters_of([observed.ip, unobserved.ip, "10.99.0.1"]))
            assert narrow == {(observed.ip, direction): value for (ip, direction), value
                              in agent.on_loop(datapath.read_counters).items() if ip == observed.ip}
            assert len(narrow) == 2
            cluster.delete_pod("shop", "seen")
            agent.wait_filter(set())
            final = scrape(agent)  # within the grace period: the final value, kept in userspace
            assert pod_value(final, "podmeter_pod_bytes_total", "seen", "egress") == expected_bytes
            assert datapath.read_counters() == {}  # the kernel entry was read one last time and removed
    finally:
        manager.stop()
