"""Multi-core benchmark: podmeter's per-packet cost with two CPUs sending at once to the same observed pod.

Run (root): ``.venv/bin/python -m bench.multicore [--rounds 5] [--seconds 2] [--payload 16]``

Real traffic through network namespaces, as on a node: a "node" netns forwards between three pod
netns, each on a veth whose host side is in the node (sender pods ``s0`` and ``s1``, receiver pod
``r``). Two senders (``bench/multicore_sender.c``, compiled at start with ``cc``: a ``sendmmsg`` loop,
so that the kernel's path is most of a packet's cost) run at once, one pinned to CPU 0 and one to CPU 1
(``os.sched_setaffinity``), each from its pod to the receiver's UDP port for ``--seconds``, small
datagrams (``--payload`` bytes), at saturation: each CPU sends, forwards and delivers its own packets
(the veths hand a packet on within the sender's softirq). The receiver's socket is never read: every
datagram that reaches UDP is counted by the kernel (``Udp: InDatagrams`` + ``RcvbufErrors`` of the
receiver's netns), and the figure is those datagrams per second.

Modes, each round running every mode once, interleaved (the order rotates from round to round):
* ``none``: no program attached (the reference);
* ``bare``: the parse-only program (``podmeter_bare.bpf.o``) on both hooks of every pod veth;
* ``counting``: podmeter's counting alone (``podmeter_noflows.bpf.o``);
* ``podmeter``: podmeter's programs as the agent runs them (``podmeter.bpf.o``, counting and flows,
  attached by :class:`~podmeter.adapters.datapath.ebpf.attach.Attacher` as the agent does: TCX where
  the kernel has it, else clsact), every pod's IP in the filter;
* ``none_same_flow`` and ``podmeter_same_flow``: both senders in pod ``s0`` on one source port
  (``SO_REUSEPORT``), so both CPUs add to the same flow entries (the shared cache lines and atomic adds a
  per-CPU design would avoid), without and with podmeter;
* ``percpu_same_flow``: the same with ``podmeter_ref_percpu.bpf.o`` (``bench.flows``'s reference with
  per-CPU flows maps and plain adds): what a per-CPU design would save there.

The machine is shared: other work takes CPU time from the senders, and the wall-clock rate moves with
it. So each run also reads the senders' CPU time (``wait4``'s rusage, user + system: without
``CONFIG_IRQ_TIME_ACCOUNTING`` the softirq work done in a sender's context, the forwarding and delivery
of its packets, is charged to it), and the figures are datagrams per second of the senders' CPU time,
the throughput a CPU of its own would give. ``pps_<mode>`` is the wall-clock rate (information).

Figures: medians over ``--rounds`` rounds; the ratios ``podmeter_vs_none`` (the throughput podmeter
leaves), ``bare_vs_none``, ``counting_vs_none``, ``podmeter_same_flow_vs_none_same_flow``,
``percpu_same_flow_vs_none_same_flow``;
``ns_per_packet_podmeter`` = 1 / rate(podmeter) - 1 / rate(none): what podmeter adds to a packet's CPU
time (its two programs: from-pod at the sender's veth, to-pod at the receiver's), and the same for one
shared flow. Read the ratios, not the absolute rates. Nothing is pinned; every namespace is removed.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from podmeter.adapters.datapath.ebpf.attach import Attacher, Attachment, AttachMode
from podmeter.adapters.datapath.ebpf.datapath import FROM_POD, TO_POD, EbpfDatapath, Programs, map_sizes
from podmeter.adapters.datapath.ebpf.loader import Loaded, load
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.adapters.datapath.ebpf.preflight import BARE_OBJECT_NAME, NOFLOWS_OBJECT_NAME, OBJECT_NAME, object_path

SENDER_SOURCE = Path(__file__).resolve().parent / "multicore_sender.c"
PORT = 9000
SUBNET = "10.236"
PERCPU_OBJECT_NAME = "podmeter_ref_percpu.bpf.o"  # bench.flows's reference: per-CPU flows maps
MODES = ("none", "bare", "counting", "podmeter", "none_same_flow", "podmeter_same_flow", "percpu_same_flow")
PROGRAMS = {"bare": BARE_OBJECT_NAME, "counting": NOFLOWS_OBJECT_NAME, "podmeter": OBJECT_NAME,
            "podmeter_same_flow": OBJECT_NAME, "percpu_same_flow": PERCPU_OBJECT_NAME}
CPUS = (0, 1)
SAME_FLOW = "same_flow"  # the suffix of the modes whose two senders share one flow


@dataclass(frozen=True)
class Pod:
    netns: str
    host_veth: str
    ip: str

    @property
    def path(self) -> str:
        return f"/run/netns/{self.netns}"


@dataclass(frozen=True)
class Node:
    netns: str
    senders: tuple[Pod, Pod]
    receiver: Pod

    @property
    def path(self) -> str:
        return f"/run/netns/{self.netns}"

    @property
    def pods(self) -> tuple[Pod, ...]:
        return (*self.senders, self.receiver)


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@contextlib.contextmanager
def topology() -> Iterator[Node]:
    """The node netns and its three pods, names unique to this run; removed afterwards."""
    tag = uuid.uuid4().hex[:6]
    node = f"pmmc{tag}"
    pods = tuple(Pod(f"pmmc{tag}{name}", f"pmc{tag}{name}", f"{SUBNET}.{n}.2")
                 for n, name in enumerate(("a", "b", "r")))
    made = [node]
    try:
        sh("ip", "netns", "add", node)
        sh("ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for n, pod in enumerate(pods):
            sh("ip", "netns", "add", pod.netns)
            made.append(pod.netns)
            sh("ip", "-n", node, "link", "add", pod.host_veth, "type", "veth", "peer", "name", "eth0", "netns",
               pod.netns)
            sh("ip", "-n", node, "addr", "add", f"{SUBNET}.{n}.1/24", "dev", pod.host_veth)
            sh("ip", "-n", node, "link", "set", pod.host_veth, "up")
            sh("ip", "-n", pod.netns, "addr", "add", f"{pod.ip}/24", "dev", "eth0")
            sh("ip", "-n", pod.netns, "link", "set", "eth0", "up")
            sh("ip", "-n", pod.netns, "link", "set", "lo", "up")
            sh("ip", "-n", pod.netns, "route", "add", "default", "via", f"{SUBNET}.{n}.1")
        for name in made:
            sh("ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        yield Node(node, (pods[0], pods[1]), pods[2])
    finally:
        for name in reversed(made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def build_sender(directory: str) -> str:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise SystemExit("bench.multicore needs a C compiler (cc, gcc or clang) for its sender")
    binary = os.path.join(directory, "multicore_sender")
    subprocess.run([compiler, "-O2", "-o", binary, str(SENDER_SOURCE)], check=True)
    return binary


class Receiver:
    """The receiver pod's UDP socket (never read) and the kernel's count of datagrams that reached UDP."""

    def __init__(self, pod: Pod) -> None:
        self.pod = pod
        with netns(pod.path):
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.bind((pod.ip, PORT))

    def arrived(self) -> int:
        with netns(self.pod.path):
            lines = Path("/proc/thread-self/net/snmp").read_text().splitlines()
        names, values = (line.split()[1:] for line in lines if line.startswith("Udp:"))
        udp = dict(zip(names, values, strict=True))
        return int(udp["InDatagrams"]) + int(udp["RcvbufErrors"])

    def close(self) -> None:
        self.sock.close()


@dataclass(frozen=True)
class Sent:
    datagrams: int  # what the senders' sendmmsg calls accepted
    cpu_seconds: float  # the senders' user + system time, the softirq work done in their context included


def send(sender: str, node: Node, same_flow: bool, seconds: float, payload: int) -> Sent:
    """Both senders at once, pinned to CPU 0 and 1."""
    processes = []
    for cpu, pod in zip(CPUS, (node.senders[0], node.senders[0] if same_flow else node.senders[1]), strict=True):
        argv = ["nsenter", f"--net={pod.path}", sender, pod.ip, "40000", node.receiver.ip, str(PORT),
                str(seconds), str(payload)]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        os.sched_setaffinity(process.pid, {cpu})  # before it sends: it first execs nsenter, then the sender
        processes.append(process)
    datagrams, cpu_seconds = 0, 0.0
    for process in processes:
        assert process.stdout is not None
        out = process.stdout.read()
        process.stdout.close()
        _, status, usage = os.wait4(process.pid, 0)  # the child's own rusage (nsenter execs the sender)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            raise RuntimeError(f"sender failed ({process.returncode})")
        datagrams += int(out.strip())
        cpu_seconds += usage.ru_utime + usage.ru_stime
    return Sent(datagrams, cpu_seconds)


@dataclass
class Loadout:
    """One object's programs, loaded once, attached to every pod veth for its mode's runs."""

    loaded: Loaded
    programs: Programs

    @classmethod
    def of(cls, name: str, node: Node) -> Loadout:
        if name == BARE_OBJECT_NAME:
            loaded = load(object_path(name), None, {}, ["pm_parse_only"])
            program = loaded.programs["pm_parse_only"]
            return cls(loaded, Programs(program, program))
        sizes = map_sizes(256, 65536)
        if name == NOFLOWS_OBJECT_NAME:
            sizes = {map_name: sizes[map_name] for map_name in ("filter", "counters")}
        loaded = load(object_path(name), None, sizes, [FROM_POD, TO_POD])
        datapath = EbpfDatapath.from_loaded(loaded)
        assert datapath.insert([pod.ip for pod in node.pods]).error is None
        return cls(loaded, Programs(loaded.programs[FROM_POD], loaded.programs[TO_POD]))

    def attach(self, node: Node) -> list[Attachment]:
        attacher = Attacher(self.programs, AttachMode.AUTO)
        with netns(node.path):
            return [attacher.attach(socket.if_nametoindex(pod.host_veth), pod.host_veth) for pod in node.pods]

    def detach(self, node: Node, attachments: list[Attachment]) -> None:
        attacher = Attacher(self.programs, AttachMode.AUTO)
        with netns(node.path):
            for attachment in attachments:
                attacher.detach(attachment, exists=True)

    def close(self) -> None:
        self.loaded.close()


@dataclass
class Rates:
    """Per mode, one value a run: datagrams received per second, and per second of the senders' CPU."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]


def measure(args: argparse.Namespace) -> Rates:
    rates = Rates({mode: [] for mode in MODES}, {mode: [] for mode in MODES})
    with tempfile.TemporaryDirectory() as directory, topology() as node, contextlib.ExitStack() as stack:
        sender = build_sender(directory)
        receiver = Receiver(node.receiver)
        stack.callback(receiver.close)
        loadouts = {}
        for mode, name in PROGRAMS.items():
            loadouts[mode] = Loadout.of(name, node)
            stack.callback(loadouts[mode].close)
        send(sender, node, False, 0.5, args.payload)  # warm up (ARP, routes, caches)
        for round_number in range(args.rounds):
            order = MODES[round_number % len(MODES):] + MODES[:round_number % len(MODES)]
            for mode in order:
                attached = loadouts[mode].attach(node) if mode in loadouts else []
                try:
                    before = receiver.arrived()
                    sent = send(sender, node, mode.endswith(SAME_FLOW), args.seconds, args.payload)
                    arrived = receiver.arrived() - before
                finally:
                    if attached:
                        loadouts[mode].detach(node, attached)
                rates.wall[mode].append(arrived / args.seconds)
                rates.cpu[mode].append(arrived / sent.cpu_seconds)
            print(f"  ... round {round_number + 1}/{args.rounds}", file=sys.stderr, flush=True)
    return rates


def summary(rates: Rates, args: argparse.Namespace) -> dict[str, object]:
    wall = {mode: statistics.median(values) for mode, values in rates.wall.items()}
    cpu = {mode: statistics.median(values) for mode, values in rates.cpu.items()}
    spread = {mode: (max(values) - min(values)) / cpu[mode] for mode, values in rates.cpu.items()}

    def ratio(mode: str, reference: str = "none") -> float:
        return round(cpu[mode] / cpu[reference], 3)

    return {
        **{f"pps_{mode}": round(wall[mode]) for mode in MODES},
        **{f"per_cpu_second_{mode}": round(cpu[mode]) for mode in MODES},
        "podmeter_vs_none": ratio("podmeter"),
        "bare_vs_none": ratio("bare"),
        "counting_vs_none": ratio("counting"),
        "podmeter_same_flow_vs_none_same_flow": ratio("podmeter_same_flow", "none_same_flow"),
        "percpu_same_flow_vs_none_same_flow": ratio("percpu_same_flow", "none_same_flow"),
        "podmeter_vs_none_wall": round(wall["podmeter"] / wall["none"], 3),
        "ns_per_packet_podmeter": round((1 / cpu["podmeter"] - 1 / cpu["none"]) * 1e9, 1),
        "ns_per_packet_podmeter_same_flow": round((1 / cpu["podmeter_same_flow"] - 1 / cpu["none_same_flow"]) * 1e9, 1),
        "ns_per_packet_percpu_same_flow": round((1 / cpu["percpu_same_flow"] - 1 / cpu["none_same_flow"]) * 1e9, 1),
        "ns_per_packet_none": round(1e9 / cpu["none"], 1),
        "spread_fraction": {mode: round(value, 3) for mode, value in spread.items()},
        "cpus": len(CPUS),
        "rounds": args.rounds,
        "seconds": args.seconds,
        "payload": args.payload,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each running every mode once")
    parser.add_argument("--seconds", type=float, default=2.0, help="sending time of each run")
    parser.add_argument("--payload", type=int, default=16, help="UDP payload bytes")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench.multicore needs root (network namespaces, BPF programs)", file=sys.stderr)
        return 2
    if len(os.sched_getaffinity(0)) < len(CPUS):
        print("bench.multicore needs 2 CPUs", file=sys.stderr)
        return 2
    rates = measure(args)
    figures = summary(rates, args)
    print(f"multi-core: 2 senders pinned to CPU 0 and 1, {args.payload}-byte UDP payload, {args.rounds} rounds "
          f"of {args.seconds:g} s, medians (spread = (max - min) / median)")
    for mode in MODES:
        reference = "none_same_flow" if mode.endswith(SAME_FLOW) else "none"
        cpu, wall = figures[f"per_cpu_second_{mode}"], figures[f"pps_{mode}"]
        base = figures[f"per_cpu_second_{reference}"]
        assert isinstance(cpu, int) and isinstance(wall, int) and isinstance(base, int)
        print(f"  {mode:<20} {wall:>10,} datagrams/s {cpu:>10,} per sender CPU-second   x{cpu / base:.3f} "
              f"of {reference}")
    print(f"  podmeter adds {figures['ns_per_packet_podmeter']} ns of CPU to a packet (its two programs), "
          f"{figures['ns_per_packet_podmeter_same_flow']} when both CPUs add to the same flow "
          f"({figures['ns_per_packet_percpu_same_flow']} with per-CPU flows maps); "
          f"a packet costs {figures['ns_per_packet_none']} ns without it")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
