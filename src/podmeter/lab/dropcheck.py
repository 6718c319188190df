"""The lab's drops and loss steps: induce them in chosen pods, then check what the agent counted.

``drops`` (:class:`~podmeter.lab.scenario.InduceDrops`): a seeded pair of running observed pods A -> B,
one datagram warms the path (both neighbours resolved), then a rule drops exactly what A sends next:

* ``netfilter-input``: an nftables rule in B's namespace drops UDP to the step's port on B's input: A's
  ``egress`` and B's ``ingress`` each count ``packets`` drops with reason ``NETFILTER_DROP``;
* ``netfilter-output``: the rule is in A's namespace, on its output: the packets never leave A, and
  count all the same for both ends (A's ``egress``, B's ``ingress``: a drop is credited to every observed
  end of the packet, wherever it happened);
* ``blackhole``: the node routes a TEST-NET address into a ``blackhole`` and A sends there: A's
  ``egress`` counts ``packets`` drops with the reason the kernel gives a forwarded packet that meets a
  blackhole route (``NOT_SPECIFIED`` on 6.x kernels; the step's ``reason`` says which to expect). A
  blackhole route in A's own namespace would make no packet at all: the send fails (EINVAL).

The check is exact: the agent's ``podmeter_pod_drops_total`` of each expected (pod, direction, reason)
grew by exactly ``packets``, no other drop series of the two pods grew, and the dropped-flow records of
the step's port (``/debug/flows?verdict=dropped``) add up to ``packets`` with that reason, both ends named.

``loss`` (:class:`~podmeter.lab.scenario.InduceLoss`): random loss on A's link (an nftables rule on the
host side of A's veth, in the node's namespace: ``numgen random mod N 0 drop`` of A's TCP data segments),
then A uploads ``bytes`` to B. A's ``podmeter_pod_tcp_retransmits_total`` must grow (> 0), no other pod's
may (0 elsewhere: B only acknowledges, and the lab's other traffic runs before or after); A's drops with
reason ``NETFILTER_DROP`` grow too, and the connection's from-pod flow records carry ``tcp_retransmits``.
Only data segments (IP length above 100) are dropped, so B never waits for a lost ACK and never
retransmits its FIN. A rule in A's own namespace would not do: a segment its own output chain drops fails
the send, which TCP queues again rather than retransmits.

Every rule and route is removed at the end of its step. Results go to the run's traffic checks (the
report's tables) with ``kind`` ``drops`` or ``loss``.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from podmeter.lab import scenario as sc
from podmeter.lab.checks import Samples
from podmeter.lab.flowcheck import WINDOW_SLACK
from podmeter.lab.netns import host_side, in_namespace
from podmeter.lab.traffic import Endpoint, UdpSink, send_datagrams, send_tcp

if TYPE_CHECKING:
    from podmeter.lab.run import LabRun

log = logging.getLogger("podmeter.lab")

BLACKHOLE = "198.51.100.66"  # TEST-NET-2: no pod has it, the node routes it nowhere
TABLE = "pmlabdrops"
DropKey = tuple[str, str, str]  # (ns/pod, direction, reason)


def drop_counts(samples: Samples) -> dict[DropKey, float]:
    return {(f"{lab.get('namespace')}/{lab.get('pod')}", lab.get("direction", ""), lab.get("reason", "")): value
            for lab, value in samples.get("podmeter_pod_drops_total", [])}


def node_drop_counts(samples: Samples) -> dict[str, float]:
    return {f"{lab.get('direction')} {lab.get('reason')}": value
            for lab, value in samples.get("podmeter_node_drops_total", [])}


def retransmit_counts(samples: Samples) -> dict[str, float]:
    return {f"{lab.get('namespace')}/{lab.get('pod')}": value
            for lab, value in samples.get("podmeter_pod_tcp_retransmits_total", [])}


def grown(before: dict[Any, float], after: dict[Any, float]) -> dict[Any, float]:
    """What grew between two scrapes (a series that appeared grew from 0)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items() if value > before.get(key, 0.0)}


def check_drops(expected: dict[DropKey, int], before: dict[DropKey, float], after: dict[DropKey, float],
                pods: Iterable[str]) -> list[str]:
    """Exactly ``expected`` more drops, and no other drop series of ``pods`` grew."""
    problems = []
    growth = grown(before, after)
    for key, want in sorted(expected.items()):
        got = growth.get(key, 0.0)
        if got != want:
            problems.append(f"{key[0]} {key[1]} drops {key[2]}: expected {want} more, the agent counted {got:.0f}")
    mine = set(pods)
    for key, got in sorted(growth.items()):
        if key not in expected and key[0] in mine:
            problems.append(f"{key[0]} {key[1]} drops {key[2]} grew by {got:.0f}, nothing of that was induced")
    return problems


def check_drop_records(records: list[dict[str, Any]], want: int, reason: str, source: str,
                       destination: str | None) -> list[str]:
    """The step's dropped-flow records: ``want`` packets in all, ``reason``, both ends named."""
    problems = []
    total = sum(int(r["packets"]) for r in records)
    if total != want:
        problems.append(f"dropped-flow records of the step carry {total} packets, expected {want}")
    for r in records:
        src = f"{r['source'].get('namespace')}/{r['source'].get('pod')}"
        dst = None if r["destination"].get("world") else f"{r['destination']['namespace']}/{r['destination']['pod']}"
        if r.get("drop_reason") != reason or src != source or dst != destination:
            problems.append(f"a dropped-flow record {src} -> {dst or 'world'} says {r.get('drop_reason')}, "
                            f"expected {source} -> {destination or 'world'} {reason}")
    return problems


def check_loss(lossy: str, before: dict[str, float], after: dict[str, float]) -> list[str]:
    """Retransmits grew for ``lossy`` and for nobody else."""
    growth = grown(before, after)
    problems = []
    if growth.get(lossy, 0.0) <= 0:
        problems.append(f"{lossy} lost packets on its link but the agent counted no retransmit")
    problems += [f"{pod} retransmitted {got:.0f} segments but no loss was induced there"
                 for pod, got in sorted(growth.items()) if pod != lossy]
    return problems


def send_dropped(src: Endpoint, target: str, port: int, packets: int, size: int) -> int:
    """``packets`` datagrams from ``src`` to ``target:port``, one socket; a send that the pod's own output
    rule drops fails with EPERM (the packet was made and dropped: it counts). Returns the source port."""
    with in_namespace(src.netns_path):
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sender:
        sender.bind((src.ip, 0))
        payload = b"\x5a" * size
        for _ in range(packets):
            with contextlib.suppress(PermissionError):
                sender.sendto(payload, (target, port))
        bound: int = sender.getsockname()[1]
        return bound


def nft(script: str, netns_path: str | None = None) -> None:
    """``nft`` in the caller's namespace (the node's), or in the pod's at ``netns_path``."""
    prefix = ["nsenter", f"--net={netns_path}", "--"] if netns_path else []
    subprocess.run([*prefix, "nft", script], check=True, capture_output=True, text=True)


def _filter_table(hook: str, rule: str) -> str:
    return (f"add table inet {TABLE}; add chain inet {TABLE} c {{ type filter hook {hook} priority 0; }}; "
            f"add rule inet {TABLE} c {rule}")


class DropSteps:
    """The steps, run by :class:`~podmeter.lab.run.LabRun` (its helpers read the agent and the pods)."""

    def __init__(self, lab: LabRun) -> None:
        self.lab = lab

    def _pair(self, pods: list[tuple[str, str]], rng: random.Random) -> list[Endpoint]:
        endpoints = self.lab._endpoints(pods)
        rng.shuffle(endpoints)
        return endpoints[:2]

    def _wait_drains(self, before: float | None) -> bool:
        interval = self.lab.scenario.agent.flow_interval
        return self.lab.flow_client.wait_for_drains(before, 2, time.monotonic() + 3 * interval + 3)

    def _metrics(self, done: Callable[[Samples], bool] = lambda samples: True, timeout: float = 5.0) -> Samples:
        """A scrape of the agent once ``done`` holds for it (or the last one that answered, after
        ``timeout``): a busy agent may miss a scrape, and a scrape that did not answer says nothing."""
        deadline, last = time.monotonic() + timeout, {}
        while True:
            samples = self.lab._agent_metrics()
            if samples:
                last = samples
                if done(samples):
                    return samples
            if time.monotonic() >= deadline:
                return last
            time.sleep(0.1)

    def drops(self, step: sc.InduceDrops, pods: list[tuple[str, str]], rng: random.Random) -> dict[str, Any]:
        record: dict[str, Any] = {"protocol": "udp", "kind": f"drops {step.how}", "src": "-", "dst": "-", "ok": False}
        if self.lab.datapath != "ebpf":
            return {**record, "ok": True, "skipped": "memory mode has no packets"}
        pair = self._pair(pods, rng)
        if len(pair) < 2:
            return {**record, "problem": "fewer than two running pods to drop between"}
        a, b = pair
        reason = step.reason or ("NOT_SPECIFIED" if step.how == "blackhole" else "NETFILTER_DROP")
        target = BLACKHOLE if step.how == "blackhole" else b.ip
        record.update(src=a.pod, dst=b.pod if step.how != "blackhole" else f"blackhole {BLACKHOLE}",
                      src_ip=a.ip, port=step.port, reason=reason)
        self.lab.checker.traffic_pods.update((a.pod, b.pod))
        sink = UdpSink(b, step.port)
        try:  # one datagram each way on the port, before any rule: both neighbours are resolved
            send_datagrams(a, b.ip, step.port, 1, 8)
            sink.receive(1, timeout=2.0)
        finally:
            sink.close()
        expected: dict[DropKey, int] = {(a.pod, "egress", reason): step.packets}
        if step.how != "blackhole":  # for B, wherever it was dropped: B is observed too
            expected[(b.pod, "ingress", reason)] = step.packets
        since, before = time.time(), self._metrics()
        drains = self.lab.flow_client.drains()
        undo = self._induce(step.how, a, b, step.port)
        try:
            source_port = send_dropped(a, target, step.port, step.packets, step.size)
            drained = self._wait_drains(drains)  # the rule stays until the agent has counted the drops
            old = drop_counts(before)
            after = self._metrics(lambda m: all(grown(old, drop_counts(m)).get(key, 0) >= want
                                                for key, want in expected.items()))
        finally:
            undo()
        problems = [] if drained else ["the agent did not drain twice after the drops"]
        problems += check_drops(expected, drop_counts(before), drop_counts(after), (a.pod, b.pod))
        records = self.lab.flow_client.records(since - WINDOW_SLACK, verdict="dropped", port=step.port) or []
        mine = [r for r in records if r["source"]["port"] == source_port and r["source"]["ip"] == a.ip]
        problems += check_drop_records(mine, step.packets, reason, a.pod,
                                       None if step.how == "blackhole" else b.pod)
        counted = grown(drop_counts(before), drop_counts(after))
        record.update(expected=f"{step.packets} x {reason}",
                      src_egress=f"{counted.get((a.pod, 'egress', reason), 0):.0f} {reason}",
                      dst_ingress=f"{counted.get((b.pod, 'ingress', reason), 0):.0f} {reason}",
                      drops={f"{k[0]} {k[1]} {k[2]}": v for k, v in sorted(counted.items())},
                      node_drops=grown(node_drop_counts(before), node_drop_counts(after)),
                      flow={"ok": not problems, "records": len(mine), "problems": problems},
                      ok=not problems)
        return record

    def _induce(self, how: str, a: Endpoint, b: Endpoint, port: int) -> Any:
        if how == "blackhole":
            subprocess.run(["ip", "route", "add", "blackhole", f"{BLACKHOLE}/32"], check=True, capture_output=True)
            return lambda: subprocess.run(["ip", "route", "del", "blackhole", f"{BLACKHOLE}/32"], check=False,
                                          capture_output=True)
        where, hook = (b, "input") if how == "netfilter-input" else (a, "output")
        nft(_filter_table(hook, f"udp dport {port} drop"), where.netns_path)
        return lambda: subprocess.run(["nsenter", f"--net={where.netns_path}", "--", "nft", "delete", "table",
                                       "inet", TABLE], check=False, capture_output=True)

    def loss(self, step: sc.InduceLoss, pods: list[tuple[str, str]], rng: random.Random) -> dict[str, Any]:
        record: dict[str, Any] = {"protocol": "tcp", "kind": "loss", "src": "-", "dst": "-", "ok": False}
        if self.lab.datapath != "ebpf":
            return {**record, "ok": True, "skipped": "memory mode has no packets"}
        pair = self._pair(pods, rng)
        if len(pair) < 2:
            return {**record, "problem": "fewer than two running pods to send between"}
        a, b = pair
        device = self._host_device(a)
        record.update(src=a.pod, dst=b.pod, src_ip=a.ip, dst_ip=b.ip, loss=f"1 in {step.every} of {a.pod}'s data")
        self.lab.checker.traffic_pods.update((a.pod, b.pod))
        since, before = time.time(), self._metrics()
        drains = self.lab.flow_client.drains()
        table = f"{TABLE}{device}"
        nft(f"add table netdev {table}; add chain netdev {table} c {{ type filter hook ingress device {device} "
            f"priority 0; }}; add rule netdev {table} c meta l4proto tcp ip length > 100 "
            f"numgen random mod {step.every} 0 drop")
        try:
            writes = max(1, step.bytes // 1400)
            sent = send_tcp(a, b, writes, 1400, timeout=30.0, port=step.port)
        finally:
            subprocess.run(["nft", "delete", "table", "netdev", table], check=False, capture_output=True)
        drained = self._wait_drains(drains)
        old = retransmit_counts(before)
        after = self._metrics(lambda m: grown(old, retransmit_counts(m)).get(a.pod, 0) > 0)
        problems = [] if drained else ["the agent did not drain twice after the upload"]
        if sent.delivered != writes * 1400:
            problems.append(f"{b.pod} received {sent.delivered} of {writes * 1400} bytes")
        problems += check_loss(a.pod, retransmit_counts(before), retransmit_counts(after))
        lost = grown(drop_counts(before), drop_counts(after)).get((a.pod, "egress", "NETFILTER_DROP"), 0.0)
        if lost <= 0:
            problems.append(f"{a.pod}'s lost segments are not in its drops (egress NETFILTER_DROP)")
        records = self.lab.flow_client.records(since - WINDOW_SLACK, protocol="tcp", port=step.port) or []
        on_records = sum(int(r.get("tcp_retransmits") or 0) for r in records
                         if r["source"]["ip"] == a.ip and r["source"]["port"] == sent.source_port)
        if on_records <= 0:
            problems.append("no flow record of the connection carries its retransmits")
        retransmits = grown(retransmit_counts(before), retransmit_counts(after))
        record.update(expected="retransmits > 0 at the source only",
                      src_egress=f"{retransmits.get(a.pod, 0):.0f} retransmits, {lost:.0f} lost",
                      dst_ingress=f"{retransmits.get(b.pod, 0):.0f} retransmits",
                      retransmits={pod: v for pod, v in sorted(retransmits.items())}, on_records=on_records,
                      flow={"ok": not problems, "records": len(records), "problems": problems}, ok=not problems)
        return record

    def _host_device(self, endpoint: Endpoint) -> str:
        """The host side of the pod's link, whoever named it (the lab's prefix, or a CNI plugin)."""
        device = host_side(endpoint.netns_path)
        if device is None:
            raise RuntimeError(f"{endpoint.pod}: no link from its eth0 to the node")
        return device
