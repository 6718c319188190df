"""A zone-scoped IPv6 pod address (``fe80::1%eth0``) against the real eBPF datapath and its key encoder.

A real API server refuses such an address, so it reaches an agent only from a buggy or fake server; the
test puts it in the lab API server's store behind its validation. The eBPF filter's 16-byte keys cannot
hold a zone: the pod must count as not having that address (counted in ``podmeter_unusable_pod_ips``),
its valid IPv4 must reach the kernel, and the writer must go on applying later changes (I2, I3).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent_harness import AgentHarness, Cluster
from bpf_support import needs_root
from factories import pod_json
from lab_server import LabServer
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.adapters.metrics.agent_state import AgentStateCollector

pytestmark = needs_root

ZONED, VALID, LATER = "fe80::1%eth0", "10.7.0.5", "10.7.0.6"


def kernel_filter(pins: Path) -> set[str]:
    """The filter map as another process reads it through its pin."""
    with EbpfDatapath.open_pinned(pins) as reader:
        return reader.contents()


def unusable_gauge(harness: AgentHarness) -> float | None:
    registry = CollectorRegistry()
    registry.register(AgentStateCollector(harness.agent.snapshot))
    return harness.on_loop(lambda: registry.get_sample_value("podmeter_unusable_pod_ips"))


def test_a_zone_scoped_address_never_reaches_the_kernel_and_the_writer_goes_on(
        lab_apiserver: LabServer, open_datapath: Callable[..., EbpfDatapath], pin_dir: Path) -> None:
    datapath = open_datapath(64)
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop", observe=True)
    with AgentHarness(lab_apiserver, datapath=datapath) as harness:
        odd = pod_json("odd", "shop", ips=(ZONED, VALID))
        assert odd["status"]["podIP"] == ZONED and [e["ip"] for e in odd["status"]["podIPs"]] == [ZONED, VALID]
        lab_apiserver.admin.inject("pods", odd)
        harness.wait_filter({VALID})
        assert kernel_filter(pin_dir) == {VALID}
        assert unusable_gauge(harness) == 1
        assert harness.state()["filter"]["desired"] == {VALID: ["shop/odd"]}

        cluster.pod("shop", "web", LATER)  # a later change is still applied
        harness.wait_filter({VALID, LATER})
        cluster.delete_pod("shop", "odd")
        harness.wait_filter({LATER})
        assert kernel_filter(pin_dir) == {LATER}
        assert unusable_gauge(harness) == 0
        state = harness.state()
        assert state["write_errors"] == {} and state["filter"]["leaked"] == state["filter"]["missing"] == []
        assert harness.agent.supervisor.healthy and harness.agent.task_failures == {}
