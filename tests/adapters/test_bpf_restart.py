"""Pinned state across processes: a clean restart continues the counters; a SIGKILLed agent's successor
converges to the desired filter (I6) by driving the core's writer against the maps it left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bpf_support import Pod, Sender, Topology, needs_root, needs_tcx, run, udp_echo
from core_harness import Core
from factories import make_pod
from podmeter.adapters.datapath.ebpf import AttachManager, AttachMode, EbpfDatapath, LinkSelection
from podmeter.adapters.datapath.ebpf import frames as f
from podmeter.adapters.datapath.ebpf.link_pins import program_id
from podmeter.model.datapath import Direction, Traffic

pytestmark = needs_root

Opener = Callable[..., EbpfDatapath]
TESTS = str(Path(__file__).parents[1])  # the shared helpers
PEER = "192.0.2.1"

# One agent run: open the pins, make sure the IP is observed, count N packets leaving it, report.
COUNTING_RUN = """
import json, sys
from podmeter.adapters.datapath.ebpf import EbpfDatapath, frames
pins, ip, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with EbpfDatapath.open(pins, filter_size=16) as dp:
    dp.insert([ip])
    dp.programs.from_pod.test_run(frames.udp_frame(ip, "192.0.2.1"), repeat=n)
    print(json.dumps({k[0] + "/" + k[1].value: [v.packets, v.bytes] for k, v in dp.read_counters().items()}))
"""

# An agent that writes pods A, B, C through the core's writer, sees traffic of B (IPv6), then hangs (to be
# killed).
DOOMED_AGENT = """
import sys, time
from factories import make_pod
from podmeter.adapters.datapath.ebpf import EbpfDatapath, frames
from core_harness import Core
pins, ips = sys.argv[1], sys.argv[2:]
dp = EbpfDatapath.open(pins, filter_size=16)
writer = Core(dp)
for n, ip in enumerate(ips):
    writer.upsert_pod(make_pod(f"pod-{n}", ips=(ip,), observe=True))
writer.flush()
dp.programs.from_pod.test_run(frames.udp_frame(ips[1], "2001:db8::1"), repeat=9)
print("ready", flush=True)
time.sleep(600)
"""


# An agent with real attachments: observe one IP, attach in a netns, then hang (to be killed).
ATTACHED_AGENT = """
import sys, time
from podmeter.adapters.datapath.ebpf import AttachManager, AttachMode, EbpfDatapath
pins, ip, netns, mode = sys.argv[1:]
dp = EbpfDatapath.open(pins, filter_size=16)
dp.insert([ip])
manager = AttachManager(dp.programs, mode=AttachMode(mode), netns=netns)
manager.start()
print("ready", len(manager.attached()), flush=True)
time.sleep(600)
"""


def python(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": TESTS}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env)


def test_a_new_process_reuses_the_pins_and_counters_continue(pin_dir: Path) -> None:
    ip = "10.60.0.1"
    size = len(f.udp_frame(ip, PEER))
    runs = []
    for packets in (3, 4):
        child = python(COUNTING_RUN, str(pin_dir), ip, str(packets))
        out, _ = child.communicate(timeout=30)
        assert child.returncode == 0
        runs.append(json.loads(out))
    assert runs == [{f"{ip}/egress": [3, 3 * size]}, {f"{ip}/egress": [7, 7 * size]}]


def test_successor_of_a_killed_agent_converges(pin_dir: Path, open_datapath: Opener) -> None:
    a, b, c, d = "10.61.0.1", "fd00:61::2", "10.61.0.3", "10.61.0.4"
    doomed = python(DOOMED_AGENT, str(pin_dir), a, b, c)
    try:
        assert doomed.stdout is not None
        assert doomed.stdout.readline().strip() == "ready"
    finally:
        doomed.send_signal(signal.SIGKILL)
        doomed.communicate(timeout=10)
    assert doomed.returncode == -signal.SIGKILL

    # Meanwhile pods B and C were deleted and D was created; A lives on (same UID is irrelevant here:
    # the successor knows only the current state).
    datapath = open_datapath(16)
    writer = Core(datapath)
    survivors = [make_pod("pod-0", ips=(a,), observe=True), make_pod("pod-3", ips=(d,), observe=True)]
    writer.replace_pods(survivors)
    repairs = writer.resync()
    released = repairs.final

    assert datapath.contents() == {a, d}
    assert repairs.leaked == tuple(sorted([b, c]))
    assert writer.installed == {a, d}
    frame_size = len(f.udp_frame(b, "2001:db8::1"))
    assert released == {(b, Direction.EGRESS): Traffic(9, 9 * frame_size)}  # B's last reading
    assert datapath.read_counters() == {}
    with EbpfDatapath.open_pinned(pin_dir) as reader:  # what another process sees
        assert reader.contents() == {a, d}
    writer.resync()
    assert writer.stats.drift_repaired["leaked"] == 2  # the second resync found nothing more


@pytest.mark.parametrize("mode", [AttachMode.TCX, AttachMode.TC], ids=["tcx", "tc"])
def test_killed_agent_with_real_traffic(
    mode: AttachMode, pin_dir: Path, topology: Topology, open_datapath: Opener
) -> None:
    """Counters survive the kill; unpinned TCX links die with the process, tc filters stay and are replaced."""
    pod = topology.add_pod()
    sizes = [10, 20, 30]
    per_round = Traffic(len(sizes), sum(size + 42 for size in sizes))

    def counted() -> Traffic:
        with EbpfDatapath.open_pinned(pin_dir) as reader:
            return reader.read_counters().get((pod.ip, Direction.EGRESS), Traffic())

    agent = python(ATTACHED_AGENT, str(pin_dir), pod.ip, topology.host_path, mode.value)
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().split() == ["ready", "1"]
        udp_echo(topology, pod, sizes)
        assert counted() == per_round
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.communicate(timeout=10)

    udp_echo(topology, pod, sizes)  # nobody runs: TCX counts nothing, a leftover tc filter still does
    assert counted() == (per_round if mode is AttachMode.TCX else per_round + per_round)

    datapath = open_datapath(16)
    assert datapath.programs is not None
    with AttachManager(datapath.programs, mode=mode, netns=topology.host_path):
        udp_echo(topology, pod, sizes)
        if mode is AttachMode.TC:  # the successor replaced the leftover filter: one per hook
            shown = run("tc", "-n", topology.host, "filter", "show", "dev", pod.host_veth, "ingress")
            assert sum("handle 0x706d" in line for line in shown.splitlines()) == 1
    rounds_counted = 2 if mode is AttachMode.TCX else 3
    assert counted() == Traffic(rounds_counted * per_round.packets, rounds_counted * per_round.bytes)


# An agent whose TCX links are pinned (as `podmeter agent` pins them): observe one pod, attach to its link,
# then hang (to be killed).
PINNED_AGENT = """
import sys, time
from podmeter.adapters.datapath.ebpf import AttachManager, EbpfDatapath, LinkSelection
from podmeter.adapters.datapath.ebpf.link_pins import program_id
pins, ip, netns, links = sys.argv[1:]
dp = EbpfDatapath.open(pins, filter_size=16)
dp.insert([ip])
manager = AttachManager(dp.programs, netns=netns, selection=LinkSelection.PODS,
                        link_pins=None if links == "-" else links)
manager.set_pod_ips([ip])
manager.start()
while not (manager.settled() and manager.attached()):
    time.sleep(0.01)
print("ready", len(manager.attached()), flush=True)
print(program_id(dp.programs.from_pod.fd), program_id(dp.programs.to_pod.fd), flush=True)
time.sleep(600)
"""


def kill_and_restart(pin_dir: Path, topology: Topology, pod: Pod, links: Path | None, gap: float,
                     opener: Opener) -> tuple[Traffic, Traffic]:
    """Traffic through an agent, SIGKILL, ``gap`` seconds with no agent, a successor: (sent, counted)."""
    agent = python(PINNED_AGENT, str(pin_dir), pod.ip, topology.host_path, str(links) if links else "-")
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().split() == ["ready", "1"]
        with Sender(topology, pod) as sender:
            time.sleep(0.5)
            agent.send_signal(signal.SIGKILL)
            agent.communicate(timeout=10)
            time.sleep(gap)
            counted = successor_counts(topology, pod, links, sender, opener)  # stops the sender
            return sender.expected(), counted
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.communicate(timeout=10)


def successor_counts(topology: Topology, pod: Pod, links: Path | None, sender: Sender,
                     opener: Opener) -> Traffic:
    """Start a successor, let it count, stop the sender: the pod's egress in the kernel."""
    datapath = opener(16)
    assert datapath.programs is not None
    successor = AttachManager(datapath.programs, netns=topology.host_path, selection=LinkSelection.PODS,
                              link_pins=links)
    successor.set_pod_ips([pod.ip])
    with successor:
        assert len(successor.attached()) == 1
        time.sleep(0.5)
        sender.stop()
        time.sleep(0.05)  # the last datagrams cross the veth
        return datapath.read_counters().get((pod.ip, Direction.EGRESS), Traffic())


@needs_tcx
def test_pinned_links_count_every_packet_across_a_sigkill(
    pin_dir: Path, topology: Topology, open_datapath: Opener
) -> None:
    """At 1,000 pps, SIGKILL, 1 s without an agent, a successor: every packet counted, and once."""
    pod = topology.add_pod()
    links = pin_dir / "links"
    sent, counted = kill_and_restart(pin_dir, topology, pod, links, 1.0, open_datapath)
    assert sent.packets > 1500
    assert counted == sent


@needs_tcx
def test_unpinned_links_lose_the_gap(pin_dir: Path, topology: Topology, open_datapath: Opener) -> None:
    """The reference: without link pins the links die with the process and the gap goes uncounted."""
    pod = topology.add_pod()
    sent, counted = kill_and_restart(pin_dir, topology, pod, None, 1.0, open_datapath)
    assert 0.5 * Sender.RATE < sent.packets - counted.packets < 2 * Sender.RATE


@needs_tcx
def test_a_successor_adopts_the_pinned_links_and_runs_its_programs(
    pin_dir: Path, topology: Topology, open_datapath: Opener
) -> None:
    pod = topology.add_pod()
    links = pin_dir / "links"
    predecessor = killed_pinned_agent(pin_dir, topology, pod, links)
    ifindex = int(run("ip", "-n", topology.host, "-j", "link", "show", pod.host_veth).split('"ifindex":')[1]
                  .split(",")[0])
    assert {p.name for p in links.iterdir()} == {f"{ifindex}_ingress", f"{ifindex}_egress"}
    assert tcx_links(predecessor) == 2  # the dead agent's links, still attached

    datapath = open_datapath(16)
    assert datapath.programs is not None
    manager = AttachManager(datapath.programs, netns=topology.host_path, selection=LinkSelection.PODS,
                            link_pins=links)
    manager.set_pod_ips([pod.ip])
    with manager:
        ours = {program_id(datapath.programs.from_pod.fd), program_id(datapath.programs.to_pod.fd)}
        assert tcx_links(ours) == 2 and tcx_links(predecessor) == 0  # the two links run the new programs
        assert manager.inherited([pod.ip, "10.231.200.9"]) == {pod.ip}  # its counts are its pod's
        udp_echo(topology, pod, [10, 20])
        assert datapath.read_counters()[(pod.ip, Direction.EGRESS)] == Traffic(2, 30 + 2 * 42)  # once
        manager.set_pod_ips([])  # the pod left: its links are detached and unpinned
        wait_for(lambda: not manager.attached())
        assert tcx_links(ours) == 0 and not any(links.iterdir())


@needs_tcx
def test_pinned_links_of_links_that_carry_no_pod_are_unpinned(
    pin_dir: Path, topology: Topology, open_datapath: Opener
) -> None:
    """A successor that finds the pod gone (its IP on no link) detaches the link the predecessor pinned,
    but only once it knows the node's pods: before, the pinned links keep counting."""
    pod = topology.add_pod()
    links = pin_dir / "links"
    predecessor = killed_pinned_agent(pin_dir, topology, pod, links)
    datapath = open_datapath(16)
    assert datapath.programs is not None
    manager = AttachManager(datapath.programs, netns=topology.host_path, selection=LinkSelection.PODS,
                            link_pins=links)
    with manager:
        assert tcx_links(predecessor) == 2  # no pod IPs given yet: left alone
        manager.set_pod_ips(["10.231.200.9"])
        wait_for(lambda: manager.settled() and not any(links.iterdir()))
        assert tcx_links(predecessor) == 0


def killed_pinned_agent(pin_dir: Path, topology: Topology, pod: Pod, links: Path) -> set[int]:
    """Run an agent that pins its links to the pod's veth, SIGKILL it: the ids of its two programs."""
    agent = python(PINNED_AGENT, str(pin_dir), pod.ip, topology.host_path, str(links))
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().split() == ["ready", "1"]
        programs = {int(word) for word in agent.stdout.readline().split()}
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.communicate(timeout=10)
    return programs


def tcx_links(programs: set[int]) -> int:
    """How many TCX links in the kernel run one of these programs (the ids are the kernel's, unique)."""
    shown = json.loads(run("bpftool", "-j", "link", "show"))
    return sum(link.get("type") in (11, "tcx") and link.get("prog_id") in programs for link in shown)


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
