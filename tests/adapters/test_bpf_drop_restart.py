"""The drop tracer across restarts (root): its maps and tracing links pinned in ``<pin dir>/drops``, reused
and adopted by a successor, replaced when they do not match, removed with the pins; and real `podmeter
agent` processes under a steady drop storm, SIGKILLed mid-interval and restarted after about 1 s and
3 s: every dropped packet in ``podmeter_pod_drops_total`` once, for the pod it was dropped for.

The pods' addresses are this process's own (``topology`` below): the drop tracepoints are the whole
kernel's, so a pod of another test run with the same address would count here.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_harness import Cluster, wait_for
from bpf_support import BPFFS, Pod, Topology, needs_root, remove_pin_dir, run, unique
from drop_support import AgentProcess, Drained, nft, routed_pod, udp_socket
from lab_server import LabServer
from podmeter.adapters.datapath.ebpf import EbpfDatapath, preflight
from podmeter.adapters.datapath.ebpf.drops import (
    DROPS_MAP,
    OWNERS_MAP,
    PIN_DIR,
    TCP_MAP,
    DropTracer,
    OwnerRecord,
    attach_program,
    create_map,
    owner_digest,
)
from podmeter.adapters.datapath.ebpf.layout import address_bytes
from podmeter.adapters.datapath.ebpf.link_pins import TracingPins
from podmeter.adapters.datapath.ebpf.maps import MapShape
from podmeter.adapters.datapath.ebpf.pins import PinDir
from podmeter.model.datapath import Direction
from podmeter.model.drops import HOOK_DROPS, HOOKS
from podmeter.runtime.drop_drain import open_drops

pytestmark = needs_root

IN = Direction.INGRESS
REASON = "NETFILTER_DROP"
PORT = 9998
RATE = 1000  # datagrams a second into the drop rule
TESTS = str(Path(__file__).parents[1])
_subnet_base = 100 + os.getpid() % 100  # 10.231.100-199.x: away from the small subnets other runs use
_subnets = itertools.count(0)


@pytest.fixture
def topology() -> Iterator[Topology]:
    """The shared topology with this process's own pod subnets (it overrides bpf_support's fixture, also for
    ``server``)."""
    topo = Topology(_subnets=itertools.count(_subnet_base + next(_subnets) * 8 % 56))
    try:
        topo.create()
        yield topo
    finally:
        topo.destroy()


@pytest.fixture
def datapath(open_datapath: Callable[..., EbpfDatapath]) -> EbpfDatapath:
    return open_datapath(64)


def drop_rule(pod: Pod) -> None:
    nft(pod, f"in udp dport {PORT} counter drop")


def nft_dropped(pod: Pod) -> int:
    """Packets the pod's drop rule dropped (its counter): the truth the tracer is compared with."""
    shown = json.loads(run("ip", "netns", "exec", pod.netns, "nft", "-j", "list", "table", "inet", "pmtest"))
    return sum(expr["counter"]["packets"] for item in shown["nftables"] if "rule" in item
               for expr in item["rule"]["expr"] if "counter" in expr)


def host_socket(topology: Topology) -> socket.socket:
    with topology.in_host():
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def send_from_host(topology: Topology, pod: Pod, count: int) -> None:
    with host_socket(topology) as sock:
        for _ in range(count):
            sock.sendto(b"d" * 64, (pod.ip, PORT))


def warm(topology: Topology, pod: Pod) -> None:
    """One datagram from the node to a port the pod listens on: the neighbour is resolved before the storm
    (packets waiting for ARP can overflow its queue, drops of another reason)."""
    with udp_socket(pod) as listener, host_socket(topology) as sender:
        listener.bind((pod.ip, 0))
        listener.settimeout(5)
        sender.sendto(b"hi", listener.getsockname())
        listener.recvfrom(100)


class Storm:
    """Datagrams from the node to a pod's dropped port at about RATE a second, on a thread."""

    def __init__(self, topology: Topology, pod: Pod) -> None:
        self.sock, self.target = host_socket(topology), (pod.ip, PORT)
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            self.sock.sendto(b"s" * 64, self.target)
            self.sent += 1
            time.sleep(max(0.0, start + self.sent / RATE - time.monotonic()))

    def __enter__(self) -> Storm:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(10)
            self.sock.close()


def bpftool(*args: str) -> list[dict[str, object]]:
    shown: list[dict[str, object]] = json.loads(run("bpftool", "-j", *args) or "[]")
    return shown


def pinned_ids(pins: Path) -> tuple[set[int], set[int]]:
    """(the ids of the programs pinned in ``pins``/programs, of the links pinned in ``pins``/links)."""
    return pinned("prog", pins / "programs"), pinned("link", pins / "links")


def pinned(kind: str, folder: Path) -> set[int]:
    """The kernel ids of the objects (``prog`` or ``link``) pinned in ``folder``."""
    return {int(json.loads(run("bpftool", "-j", kind, "show", "pinned", str(p)))["id"]) for p in folder.iterdir()}


def tracing_links(programs: set[int]) -> set[int]:
    """The raw tracepoint links in the kernel that run one of ``programs``."""
    return {int(str(link["id"])) for link in bpftool("link", "show")
            if link.get("type") == "raw_tracepoint" and link.get("prog_id") in programs}


def loaded(programs: set[int]) -> set[int]:
    return {int(str(prog["id"])) for prog in bpftool("prog", "show")} & programs


def modes(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): stat.S_IMODE(p.stat().st_mode) for p in [path, *path.rglob("*")]}


# --- the tracer's pins ----------------------------------------------------------------------------------


def test_pinned_maps_and_links_outlive_the_tracer_and_a_successor_adopts_them(
        topology: Topology, datapath: EbpfDatapath, pin_dir: Path) -> None:
    web = routed_pod(topology, datapath)
    drop_rule(web)
    pins = pin_dir / PIN_DIR
    first = DropTracer.open(datapath.filter_map, 64, pins=pins)
    assert not first.inherited and first.adopted == set()
    programs, links = pinned_ids(pins)
    assert tracing_links(programs) == links and len(links) == len(HOOKS)
    send_from_host(topology, web, 5)
    first.record_owners({web.ip: "uid-of-web"})
    first.close()  # what an agent's stop does: the pins stay, attached and counting

    assert tracing_links(programs) == links
    send_from_host(topology, web, 7)  # nobody holds the maps: the pinned links count on
    assert modes(pins) == {".": 0o700, "links": 0o700, "programs": 0o700,
                           **{str(p.relative_to(pins)): 0o600 for p in pins.rglob("*") if p.is_file()}}
    assert {p.name for p in pins.iterdir() if p.is_file()} == {
        "drops", "drop_flows", "tcp", "tcp_flows", "drops_lost", OWNERS_MAP}

    with DropTracer.open(datapath.filter_map, 64, pins=pins) as second:
        assert second.inherited and second.adopted == set(HOOKS)
        assert pinned_ids(pins) == (programs, links) and tracing_links(programs) == links  # no second link
        assert second.held_throughout({web.ip: "uid-of-web"}) == {web.ip}
        assert second.held_throughout({web.ip: "uid-of-another"}) == frozenset()
        seen = Drained(second).until(lambda d: d.drops[web.ip, IN, REASON] >= 12)
        assert seen.drops == {(web.ip, IN, REASON): 12} == {(web.ip, IN, REASON): nft_dropped(web)}


# A tracer process that pins, counts, and hangs (to be killed).
PINNED_TRACER = """
import sys, time
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.adapters.datapath.ebpf.drops import DropTracer
pin_dir, ip = sys.argv[1:]
dp = EbpfDatapath.open(pin_dir, filter_size=64)
dp.insert([ip])
tracer = DropTracer.open(dp.filter_map, 64, pins=pin_dir + "/drops")
print("ready", flush=True)
time.sleep(600)
"""


def test_a_sigkilled_tracers_successor_drains_what_it_left_and_what_the_gap_dropped(
        topology: Topology, pin_dir: Path, open_datapath: Callable[..., EbpfDatapath]) -> None:
    web = routed_pod(topology, None)
    drop_rule(web)
    child = subprocess.Popen([sys.executable, "-c", PINNED_TRACER, str(pin_dir), web.ip], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 filter(None, (TESTS, os.environ.get("PYTHONPATH"))))})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        send_from_host(topology, web, 4)
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=10)
    send_from_host(topology, web, 6)
    datapath = open_datapath(64)
    with DropTracer.open(datapath.filter_map, 64, pins=pin_dir / PIN_DIR) as successor:
        assert successor.inherited and successor.adopted == set(HOOKS)
        send_from_host(topology, web, 3)
        seen = Drained(successor).until(lambda d: d.drops[web.ip, IN, REASON] >= 13)
        assert seen.drops == {(web.ip, IN, REASON): 13} and nft_dropped(web) == 13


def test_maps_of_another_size_or_layout_are_replaced_and_the_links_that_counted_into_them_too(
        datapath: EbpfDatapath, pin_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    pins = pin_dir / PIN_DIR
    DropTracer.open(datapath.filter_map, 64, pins=pins).close()
    programs, links = pinned_ids(pins)
    foreign = create_map(TCP_MAP, MapShape(1, 8, 8, 0, 16))  # a map of another layout under the name
    PinDir(pins).install(foreign, TCP_MAP)
    foreign.close()
    with caplog.at_level(logging.INFO, "podmeter.datapath.drops"), \
            DropTracer.open(datapath.filter_map, 128, pins=pins) as resized:
        assert not resized.inherited and resized.adopted == set()
        new_programs, new_links = pinned_ids(pins)
        assert tracing_links(programs) == set() and tracing_links(new_programs) == new_links
        assert new_links.isdisjoint(links) and len(new_links) == len(HOOKS)
        assert resized.maps[DROPS_MAP].shape.max_entries == 128
    text = caplog.text
    assert re.search(r"pinned map drops/drops \(type 1, key 24 B, value 16 B, flags 0x0, 64 entries\) does not "
                     r"match this agent's \(.*128 entries\): replaced by a new one, its 0 undrained entries", text)
    assert "pinned map drops/tcp (type 1, key 8 B, value 8 B" in text
    assert "pinned tracing link of kfree_skb replaced: its program counts into other maps" in text


def test_a_pinned_link_running_another_program_is_replaced(
        topology: Topology, datapath: EbpfDatapath, pin_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    web = routed_pod(topology, datapath)
    drop_rule(web)
    pins = pin_dir / PIN_DIR
    other, other_link = attach_program(preflight.object_path("podmeter_drops_nop.bpf.o"), "pm_kfree_skb_nop",
                                       "kfree_skb")
    stale = TracingPins(pins)
    stale.ensure()
    stale.pin(HOOK_DROPS, other_link, other.fd)
    nop = {int(json.loads(run("bpftool", "-j", "prog", "show", "pinned", str(pins / "programs" / HOOK_DROPS)))["id"])}
    os.close(other_link)
    other.close()
    assert len(tracing_links(nop)) == 1  # held by its pin
    with caplog.at_level(logging.INFO, "podmeter.datapath.drops"), \
            DropTracer.open(datapath.filter_map, 64, pins=pins) as tracer:
        assert tracer.adopted == set() and tracing_links(nop) == set()
        send_from_host(topology, web, 3)
        assert Drained(tracer).until(lambda d: sum(d.drops.values()) >= 3).drops == {(web.ip, IN, REASON): 3}
    assert re.search(r"pinned tracing link of kfree_skb replaced: it runs another program \(pm_kfree_skb_no, "
                     r"tag \w+; this agent's: pm_kfree_skb, tag \w+\)", caplog.text)


def test_leftovers_and_the_links_of_hooks_no_longer_traced_are_removed(
        datapath: EbpfDatapath, pin_dir: Path) -> None:
    pins = pin_dir / PIN_DIR
    DropTracer.open(datapath.filter_map, 64, pins=pins).close()
    programs, _ = pinned_ids(pins)
    staging = pins / "links" / "tcp_send_reset__swap"
    run("bpftool", "link", "pin", "id", str(next(iter(pinned_ids(pins)[1]))), str(staging))
    renamed = {HOOK_DROPS: "kfree_skb_gone"}  # as on a kernel without the tracepoint
    with DropTracer.open(datapath.filter_map, 64, pins=pins, tracepoints=renamed) as tracer:
        assert tracer.hooks[HOOK_DROPS] is False
        assert {p.name for p in (pins / "links").iterdir()} == set(HOOKS) - {HOOK_DROPS}
        assert {p.name for p in (pins / "programs").iterdir()} == set(HOOKS) - {HOOK_DROPS}
        assert len(tracing_links(programs)) == len(HOOKS) - 1  # the others adopted, kfree_skb's detached


@pytest.mark.parametrize("how", ["--drop-map-size 0", "no CAP_PERFMON"])
def test_an_agent_without_drop_tracing_removes_what_a_predecessor_pinned(
        datapath: EbpfDatapath, pin_dir: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pins = pin_dir / PIN_DIR
    DropTracer.open(datapath.filter_map, 64, pins=pins).close()
    programs, _ = pinned_ids(pins)
    if how == "no CAP_PERFMON":
        monkeypatch.setattr("podmeter.adapters.datapath.ebpf.preflight.effective_capabilities", lambda: 0)
    tracing = open_drops(datapath, 0 if how.startswith("--") else 64)
    assert tracing.source is None
    assert not pins.exists() and tracing_links(programs) == set()


@pytest.fixture(scope="module")
def owners_pins() -> Iterator[PinDir]:
    """One pin directory for all Hypothesis examples."""
    pins = PinDir(BPFFS / unique("pmown"))
    pins.ensure()
    try:
        yield pins
    finally:
        remove_pin_dir(pins.path)


OWNER_IPS = ["10.231.250.1", "10.231.250.2", "fd00:231::3", "10.231.250.4", "fd00:231::5"]
owner_maps = st.dictionaries(st.sampled_from(OWNER_IPS), st.sampled_from(["uid-a", "uid-b", "uid-c"]))


@settings(max_examples=60, deadline=None)
@given(st.lists(owner_maps, max_size=6))
def test_the_owners_record_holds_what_was_last_written(owners_pins: PinDir,
                                                       writes: list[dict[str, str]]) -> None:
    """Its incremental writes against the whole map, and what a successor reads from it."""
    owners_pins.remove([OWNERS_MAP])
    owners_pins.ensure()
    record = OwnerRecord.open(owners_pins, 8)
    try:
        for owners in writes:
            record.write(owners)
            expected = {address_bytes(ip): owner_digest(uid) for ip, uid in owners.items()}
            assert dict(record.map.collect_items()) == expected == record.recorded
        last = writes[-1] if writes else {}
        successor = OwnerRecord.open(owners_pins, 8)
        try:
            asked = {ip: "uid-a" for ip in OWNER_IPS}
            assert successor.held_throughout(asked) == {ip for ip, uid in last.items() if uid == "uid-a"}
        finally:
            successor.close()
    finally:
        record.close()


# --- real agents: a drop storm across a SIGKILL ---------------------------------------------------------


def drops_of(agent: AgentProcess, pod: str) -> int:
    return agent.metric(re.escape(f'podmeter_pod_drops_total{{namespace="shop",pod="{pod}",direction="ingress",'
                                  f'reason="{REASON}"}}')) or 0


def node_drops(agent: AgentProcess) -> int:
    return agent.metric(re.escape(f'podmeter_node_drops_total{{direction="ingress",reason="{REASON}"}}')) or 0


def restart_under_a_storm(topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path, gap: float,
                          simulate: str | None = None) -> dict[str, int | float]:
    """A drop storm into pod web; agent A drains at a change of hands (pod spare deleted) and is SIGKILLed
    0.5 s later, mid-interval (its interval is 60 s); ``gap`` seconds later agent B starts; the storm
    stops 1 s after B is ready. Returns what the pod's rule dropped and what each agent counted."""
    web, spare = routed_pod(topology, None), routed_pod(topology, None)
    drop_rule(web)
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.pod("shop", "web", web.ip)
        cluster.pod("shop", "spare", spare.ip)
    first = AgentProcess(topology, server, pin_dir, tmp_path / "a.log", simulate, ["--flow-interval", "60"])
    second: AgentProcess | None = None
    try:
        wait_for(lambda: first.get("/readyz")[0] == 200, 30, "agent A ready", first.log)
        wait_for(lambda: web.ip in json.loads(first.get("/debug/state")[1])["filter"]["actual"], 10, "filter")
        warm(topology, web)
        with Storm(topology, web) as storm:
            time.sleep(0.5)
            drains = first.metric("podmeter_drop_drains_total") or 0
            with topology.in_host():
                cluster.delete_pod("shop", "spare")  # A drains at the change of hands: its series moves
            wait_for(lambda: (first.metric("podmeter_drop_drains_total") or 0) > drains, 10, "A's drain", first.log)
            counted_by_first = drops_of(first, "web")
            time.sleep(0.5)
            assert drops_of(first, "web") == counted_by_first  # no drain since: the series is what A counted
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait(10)
            killed_at = storm.sent
            time.sleep(gap)
            second = AgentProcess(topology, server, pin_dir, tmp_path / "b.log", simulate)
            wait_for(lambda: second is not None and second.get("/readyz")[0] == 200, 30, "agent B ready",
                     second.log)
            restarted_at = storm.sent
            time.sleep(1.0)
        dropped = nft_dropped(web)
        assert dropped == storm.sent  # every datagram met the rule
        last: list[int] = []

        def settled() -> bool:  # two scrapes 0.6 s apart (two drains) agree
            assert second is not None
            last.append(drops_of(second, "web"))
            time.sleep(0.6)
            return last[-1] == drops_of(second, "web") and last[-1] > 0

        wait_for(settled, 20, "B's count settled", second.log)
        return {"gap_s": gap, "dropped": dropped, "counted_by_a": counted_by_first, "counted_by_b": last[-1],
                "node_b": node_drops(second), "dropped_without_agent": restarted_at - killed_at,
                "series_b": len(re.findall(r"^podmeter_pod_drops_total\{", second.get("/metrics")[1], re.M))}
    finally:
        first.stop()
        if second is not None:
            second.stop()


@pytest.mark.parametrize("gap", [1.0, 3.0], ids=["gap-1s", "gap-3s"])
def test_a_drop_storm_across_a_sigkill_is_counted_once_for_its_pod(
        topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path, gap: float) -> None:
    figures = restart_under_a_storm(topology, server, pin_dir, tmp_path, gap)
    print("drop-restart", json.dumps(figures))
    assert figures["counted_by_a"] > 0 and figures["dropped_without_agent"] > 0.5 * RATE * gap
    assert figures["counted_by_a"] + figures["counted_by_b"] == figures["dropped"]
    assert figures["node_b"] == figures["counted_by_b"]  # nothing of B's left to the node alone
    assert figures["series_b"] == 1  # web's, ingress, NETFILTER_DROP: no other pod credited


@pytest.mark.parametrize("gap", [1.0, 3.0], ids=["gap-1s", "gap-3s"])
def test_unpinned_drop_tracing_loses_the_gap(
        topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path, gap: float) -> None:
    """The reference: the tracer as it was before its pins loses what A had not drained and the gap."""
    figures = restart_under_a_storm(topology, server, pin_dir, tmp_path, gap, "unpinned-drops")
    print("drop-restart-unpinned", json.dumps(figures))
    lost = figures["dropped"] - figures["counted_by_a"] - figures["counted_by_b"]
    assert lost >= figures["dropped_without_agent"] > 0.5 * RATE * gap


# --- back to the baseline ---------------------------------------------------------------------------------


def test_a_stopped_agent_leaves_its_drop_tracing_pinned_and_removing_the_pins_leaves_nothing(
        topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path) -> None:
    web = routed_pod(topology, None)
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.pod("shop", "web", web.ip)
    agent = AgentProcess(topology, server, pin_dir, tmp_path / "agent.log")
    try:
        wait_for(lambda: agent.get("/readyz")[0] == 200, 30, "agent ready", agent.log)
        wait_for(lambda: agent.metric('podmeter_drop_tracing_enabled{hook="kfree_skb"}') == 1, 10, "drops on")
        programs, links = pinned_ids(pin_dir / PIN_DIR)
        tcx = pinned("link", pin_dir / "links")
    finally:
        agent.stop()
    assert agent.proc.returncode == 0, agent.log()
    assert tracing_links(programs) == links and len(links) == len(HOOKS)  # a clean stop keeps them (upgrades)
    assert len(tcx) == 2

    run("rm", "-r", str(pin_dir))  # the uninstall (docs/install.md)
    shown = {int(str(link["id"])) for link in bpftool("link", "show")}
    assert shown.isdisjoint(links | tcx)
    deadline = time.monotonic() + 10  # programs are freed after an RCU grace period
    while loaded(programs):
        assert time.monotonic() < deadline, f"programs {loaded(programs)} still loaded"
        time.sleep(0.1)
    with contextlib.suppress(FileNotFoundError):
        assert not any(pin_dir.iterdir())
