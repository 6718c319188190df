"""The agent's CPU per flow, end to end: a real ``podmeter agent --datapath ebpf`` on real traffic.

Run (root, ``make bpf``): ``.venv/bin/python -m bench.agent_flows [--flows 1000,10000,100000] [--intervals 10]``
(about 5.5 minutes; ``--quick``: 1,000 and 10,000 flows, 4 intervals each, about 2 minutes).

The node is a private network namespace (the agent, the lab API server and every reader run in it, so the
agent attaches to this bench's links only): ``SENDERS`` pods, each a namespace of its own wired to it by a
veth, and ``GHOSTS`` more pods that exist only in the API server (names without links). The agent runs as
``podmeter agent`` does, with ``--flow-interval 5`` (``--interval``), drops and TCP health on (their
default), the Hubble API on a Unix socket, and reads on it all the time:

* ``--followers`` (10) reads of ``/debug/flows?follow=1``, what ``podmeter observe -f`` asks for: threads of
  one process that count the lines (ten ``observe`` processes formatting every line would take the
  machine's two cores from the agent), or with ``--observe`` the real command, its output thrown away;
* one Hubble ``GetFlows`` follower (``follow: true``, what ``hubble observe -f`` sends; a process of its own);
* ``/metrics`` scraped every ``--scrape`` (15) seconds, as Prometheus would: the workload-pair series and
  everything else the agent renders.

**Traffic.** Precomputed Ethernet frames (IPv4/UDP, checksummed) written to an ``AF_PACKET`` socket on each
sender pod's ``eth0`` (one ``send`` per frame, no IP stack on the sending side): ``N`` distinct flows, the
pods' addresses to ``DESTINATIONS`` addresses of 10.238.0.0/16 (the first ``GHOSTS`` of them the ghost pods',
so about a fifth of the far ends are named pods, the rest world) and source ports, every flow sent twice per
interval (so each drain sees every flow whatever the phase of the agent's timer). The node delivers them to
one UDP socket (a ``local`` route for 10.238.0.0/16 and a reader process): nothing is dropped, no ICMP
goes back, and the drop tracer has nothing to record. The agent's own counters say whether it saw ``N``
flows per drain (``podmeter_flow_entries_drained_total`` / ``podmeter_flow_drains_total``), lost none
(``podmeter_flows_lost_packets_total``), and the sink whether every frame arrived.

**Figures.** For each ``N`` (after two warm-up intervals: the first drain after a change holds part of
it) the agent's CPU seconds per second, from ``/proc/<pid>/stat`` (utime + stime, every thread), over
windows of ``--scrape`` seconds (each holds its drains and one scrape): the median of the windows. The
reference, in the same run, is the same agent with the same readers and no traffic
(``agent_cpu_fraction_idle``). ``us_per_flow_record``: the largest ``N``'s CPU per interval divided by its
records (everything the agent did, idle work included); ``us_per_flow_record_above_idle`` without the idle
part. RSS (``/proc/<pid>/status``) after the warm-up and every interval; ``rss_growth_mib``: at the largest
``N``, RSS after the last interval minus after the warm-up. Targets: 0.5 % of one core at 10,000 flows per
5 s drain, 4 % at 100,000 (2 µs per record), RSS flat. Then the sizes from ``--without-hubble`` (10,000)
on again with the Hubble follower stopped (``agent_cpu_fraction_*_without_hubble_follower``: what one
follower of the Hubble API costs is the difference). ``--agent-src DIR`` runs the agent from another source
tree (``PYTHONPATH``), for a before/after comparison in the same conditions.

``--profile FILE`` (needs ``py-spy``: ``pip install py-spy``) records the agent during the largest ``N``'s
windows (``py-spy record --gil --format raw``: collapsed stacks of the thread holding the GIL, for
``flamegraph.pl`` or a sort by count).

Everything (namespaces, pins under /sys/fs/bpf, processes) is removed at the end. Prints a table; the last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.measure import json_line, table

NODE = "node-a"
SENDERS = 4  # pods with a link, each sending a quarter of the flows
GHOSTS = 1000  # pods known to the API server only: the named far ends
DESTINATIONS = 5000  # distinct destination addresses (10.238.0.0/16, the first GHOSTS of them pods)
SINK_PORT = 7  # every flow's destination port: one socket receives them all
FRAME_PAYLOAD = 18  # UDP payload bytes: a 60-byte frame
TOKEN = "bench-token"
CLK_TCK = os.sysconf("SC_CLK_TCK")
ETH_P_IP = 0x0800
SO_RCVBUFFORCE = 33
CHUNK = 500  # frames a sender writes between two looks at the clock


def label(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def ghost_ip(i: int) -> str:
    return destination(i)


def destination(i: int) -> str:
    """The ``i``-th destination address: 10.238.0.1 onwards (never .0 or .255 of a /24)."""
    return f"10.238.{i // 250}.{i % 250 + 1}"


# --- the node: namespaces, links, routes -------------------------------------------------------------------


@dataclass
class Sender:
    netns: str
    host_veth: str
    ip: str
    host_ip: str

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"


@dataclass
class Node:
    """A host netns standing in for the node's root namespace, with ``SENDERS`` pods wired to it."""

    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    senders: list[Sender] = field(default_factory=list)

    @property
    def host(self) -> str:
        return f"pmfh{self.tag}"

    @property
    def host_path(self) -> str:
        return f"/run/netns/{self.host}"

    def create(self) -> None:
        run("ip", "netns", "add", self.host)
        self._sysctl(self.host, "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
                     "net.ipv4.ip_forward=0")
        run("ip", "-n", self.host, "link", "set", "lo", "up")
        run("ip", "-n", self.host, "route", "add", "local", "10.238.0.0/16", "dev", "lo")
        for k in range(SENDERS):
            sender = Sender(f"pmfp{self.tag}x{k}", f"pmf{self.tag}x{k}", f"10.237.{k + 1}.2", f"10.237.{k + 1}.1")
            run("ip", "netns", "add", sender.netns)
            self.senders.append(sender)
            self._sysctl(sender.netns, "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
            run("ip", "-n", self.host, "link", "add", sender.host_veth, "type", "veth", "peer", "name", "eth0",
                "netns", sender.netns)
            run("ip", "-n", self.host, "addr", "add", f"{sender.host_ip}/24", "dev", sender.host_veth)
            run("ip", "-n", self.host, "link", "set", sender.host_veth, "up")
            run("ip", "-n", sender.netns, "addr", "add", f"{sender.ip}/24", "dev", "eth0")
            run("ip", "-n", sender.netns, "link", "set", "eth0", "up")
            run("ip", "-n", sender.netns, "link", "set", "lo", "up")

    def mac(self, sender: Sender) -> str:
        return run("ip", "netns", "exec", self.host, "cat", f"/sys/class/net/{sender.host_veth}/address").strip()

    def destroy(self) -> None:
        for name in [self.host, *(s.netns for s in self.senders)]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)

    @staticmethod
    def _sysctl(namespace: str, *settings: str) -> None:
        run("ip", "netns", "exec", namespace, "sysctl", "-qw", *settings)


# --- the traffic: frames on AF_PACKET sockets, and the socket that receives them ---------------------------


def checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return int(~total & 0xFFFF)


def frame(dst_mac: bytes, src_mac: bytes, src: str, dst: str, sport: int) -> bytes:
    udp = struct.pack("!HHHH", sport, SINK_PORT, 8 + FRAME_PAYLOAD, 0) + b"f" * FRAME_PAYLOAD
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, 17, 0,
                         socket.inet_aton(src), socket.inet_aton(dst))
    header = header[:10] + struct.pack("!H", checksum(header)) + header[12:]
    return dst_mac + src_mac + struct.pack("!H", ETH_P_IP) + header + udp


def flow_frames(n: int, senders: list[tuple[socket.socket, bytes, bytes, str]]) -> list[tuple[socket.socket, bytes]]:
    """``n`` distinct flows: flow ``i`` from sender ``i % SENDERS`` to destination ``i // SENDERS %
    DESTINATIONS``, source port 20000 + ``i // (SENDERS * DESTINATIONS)``; interleaved, so every sender and
    every destination is busy all the time."""
    out = []
    for i in range(n):
        sock, dst_mac, src_mac, ip = senders[i % SENDERS]
        j = i // SENDERS
        out.append((sock, frame(dst_mac, src_mac, ip, destination(j % DESTINATIONS), 20000 + j // DESTINATIONS)))
    return out


def send_role(args: argparse.Namespace) -> None:
    """The traffic generator: commands on stdin (``N``: send ``N`` flows from now on, ``0``: be quiet);
    every ``--round`` seconds each flow's frame once, spread over 80 % of the round."""
    from podmeter.adapters.datapath.ebpf.netns import netns

    senders = []
    for spec in args.sender:
        path, host_mac, ip = spec.split(",")
        with netns(path):
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        sock.bind(("eth0", 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        senders.append((sock, bytes.fromhex(host_mac.replace(":", "")), sock.getsockname()[4], ip))
    frames: list[tuple[socket.socket, bytes]] = []
    sent = rounds = 0
    print(json.dumps({"ready": True}), flush=True)
    next_round = time.monotonic()
    while True:
        timeout = max(0.0, next_round - time.monotonic())
        if select.select([sys.stdin], [], [], timeout)[0]:
            line = sys.stdin.readline()
            if not line:
                break
            frames = flow_frames(int(line), senders)
            print(json.dumps({"flows": len(frames), "sent": sent, "rounds": rounds}), flush=True)
            next_round = time.monotonic()
            continue
        started = next_round = time.monotonic()
        next_round += args.round
        spread = 0.8 * args.round
        for low in range(0, len(frames), CHUNK):
            for sock, data in frames[low:low + CHUNK]:
                sock.send(data)
            ahead = started + spread * (low + CHUNK) / len(frames) - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        sent += len(frames)
        rounds += bool(frames)


def sink_role(args: argparse.Namespace) -> None:
    """Receives every frame (the node delivers 10.238.0.0/16 locally): counts them until SIGTERM."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
    sock.bind(("0.0.0.0", SINK_PORT))
    received = 0
    signal.signal(signal.SIGTERM, lambda *_: (print(json.dumps({"received": received}), flush=True), os._exit(0)))
    print(json.dumps({"ready": True}), flush=True)
    buffer = bytearray(2048)
    recv = sock.recv_into
    while True:
        recv(buffer)
        received += 1


def readers_role(args: argparse.Namespace) -> None:
    """``--followers`` reads of ``/debug/flows?follow=1`` (what ``podmeter observe -f`` asks for), one thread
    each, that count the lines they get and the gaps among them (``{"lost": N}``) until SIGTERM."""
    import http.client

    host, port = args.server.rsplit(":", 1)
    counts = [[0, 0] for _ in range(args.followers)]  # lines, gap lines

    def read(mine: list[int]) -> None:
        connection = http.client.HTTPConnection(host, int(port), timeout=None)
        connection.request("GET", "/debug/flows?follow=1")
        response = connection.getresponse()
        tail = b""
        while data := response.read1(1 << 16):
            mine[0] += data.count(b"\n")
            mine[1] += (tail + data[:8]).count(b'{"lost":') + data[8:].count(b'{"lost":')
            tail = data[-8:]

    for mine in counts:
        threading.Thread(target=read, args=(mine,), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: (print(json.dumps({"lines": [c[0] for c in counts], "gaps": [
        c[1] for c in counts]}), flush=True), os._exit(0)))
    print(json.dumps({"ready": True}), flush=True)
    signal.pause()


def hubble_role(args: argparse.Namespace) -> None:
    """One Hubble ``GetFlows`` follower (``follow: true``): counts flows and lost events until SIGTERM."""
    import grpc

    from podmeter.adapters.hubble.proto import observer_pb2, observer_pb2_grpc

    counts: dict[str, Any] = {"flows": 0, "lost_events": 0, "lost": 0, "error": ""}
    signal.signal(signal.SIGTERM, lambda *_: (print(json.dumps(counts), flush=True), os._exit(0)))
    channel = grpc.insecure_channel(args.socket)
    stub = observer_pb2_grpc.ObserverStub(channel)
    print(json.dumps({"ready": True}), flush=True)
    try:
        for response in stub.GetFlows(observer_pb2.GetFlowsRequest(follow=True)):
            if response.HasField("flow"):
                counts["flows"] += 1
            else:
                counts["lost_events"] += 1
                counts["lost"] += response.lost_events.num_events_lost
    except grpc.RpcError as exc:
        counts["error"] = str(exc.code())
    signal.pause()


# --- the agent and its readers -------------------------------------------------------------------------------


class Child:
    """A child process speaking JSON lines on stdout (and, for the generator, commands on stdin)."""

    def __init__(self, argv: list[str], log: Path, stdin: bool = False, env: dict[str, str] | None = None,
                 quiet: bool = False) -> None:
        self.log = log
        with log.open("wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL if quiet else subprocess.PIPE, stderr=err, env=env)

    def answer(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise RuntimeError(f"{self.proc.args!r} said nothing in {timeout} s: {self.log.read_text()[-2000:]}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args!r} exited: {self.log.read_text()[-2000:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def tell(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        return self.answer()

    def stop(self) -> dict[str, Any] | None:
        """SIGTERM; the last answer, if the child gives one."""
        if self.proc.poll() is not None:
            return None
        self.proc.terminate()
        try:
            answer = self.answer(10) if self.proc.stdout is not None else None
        except (RuntimeError, ValueError):
            answer = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        return answer


def http(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read()
        return body.decode()


def answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url`` (any status)."""
    with contextlib.suppress(urllib.error.HTTPError):
        http(url, 2)
    return True


def wait(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if condition():
                return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text page (the flow counters this bench reads)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            if "{" not in name:
                out[name] = float(value)
    return out


def labelled_total(text: str, prefix: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(prefix))


class Api:
    def __init__(self, url: str) -> None:
        self.url = url

    def request(self, method: str, path: str, body: Any, content_type: str = "application/json") -> None:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method=method,
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type})
        with urllib.request.urlopen(req, timeout=10) as response:
            response.read()

    def namespace(self, name: str) -> None:
        self.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": name, "annotations": {"podmeter.io/observe": "true"}}})

    def pod(self, namespace: str, deployment: str, index: int, ip: str) -> None:
        rs = f"{deployment}-5d9f7"
        meta = {"name": f"{rs}-{index:05d}", "namespace": namespace,
                "labels": {"app": deployment, "pod-template-hash": "5d9f7"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs, "uid": f"rs-{rs}",
                                     "controller": True}]}
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "busybox"}]}}
        self.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)
        self.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{meta['name']}/status",
                     {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}},
                     "application/merge-patch+json")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Process:
    pid: int

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15 of stat(5))

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"no VmRSS for {self.pid}")


@dataclass
class Phase:
    """One measurement: ``flows`` distinct flows per interval, the Hubble follower on or not."""

    flows: int
    hubble: bool = True
    cpu_fractions: list[float] = field(default_factory=list)  # CPU seconds per second, one per window
    rss_mib: list[float] = field(default_factory=list)  # after the warm-up, then after every interval
    drains: float = 0.0
    entries: float = 0.0
    last_drain_seconds: list[float] = field(default_factory=list)

    @property
    def cpu_fraction(self) -> float:
        return statistics.median(self.cpu_fractions)

    @property
    def entries_per_drain(self) -> float:
        return self.entries / self.drains if self.drains else 0.0

    @property
    def name(self) -> str:
        return f"{label(self.flows)}_flows" + ("" if self.hubble else "_without_hubble_follower")


class Bench:
    """The node's processes: the API server, the agent, its readers, the traffic. Every child is stopped
    at the end (readers first), and what the readers and the sink said is kept in ``said``."""

    def __init__(self, args: argparse.Namespace, node: Node, work: Path, pins: Path) -> None:
        self.args, self.node, self.work, self.pins = args, node, work, pins
        self.children: list[Child] = []
        self.port = 0
        self.hubble: Child | None = None
        self.scrape_seconds: list[float] = []  # how long each /metrics took to answer
        self.said: dict[str, Any] = {"observe_lost": 0, "observe_gaps": 0}

    def child(self, argv: list[str], name: str, **options: Any) -> Child:
        started = Child(argv, self.work / f"{name}.log", **options)
        self.children.append(started)
        return started

    def start_apiserver(self) -> str:
        kubeconfig = self.work / "kubeconfig"
        self.child([sys.executable, "-m", "podmeter", "apiserver", "--listen", "127.0.0.1:0", "--kubeconfig-out",
                    str(kubeconfig), "--token", TOKEN, "--plain-http"], "apiserver")
        wait(kubeconfig.exists, "the API server's kubeconfig", 30)
        url = next(line.split()[-1] for line in kubeconfig.read_text().splitlines() if "server:" in line)
        wait(lambda: answers(url), "the API server", 30)
        return url

    def populate(self, url: str) -> None:
        api = Api(url)
        for namespace in ("shop", *(f"team-{i}" for i in range(10))):
            api.namespace(namespace)
        for k, sender in enumerate(self.node.senders):
            api.pod("shop", ("web", "api", "cart", "search")[k % 4], k, sender.ip)
        for i in range(GHOSTS):
            api.pod(f"team-{i % 10}", f"svc-{i % 50}", i, ghost_ip(i))

    def start_agent(self) -> Process:
        self.port = free_port()
        env = {**os.environ, "KUBECONFIG": str(self.work / "kubeconfig"),
               "PODMETER_ALLOW_PLAIN_HTTP_CREDENTIALS": "1"}
        if self.args.agent_src is not None:  # another tree of the product (a before/after comparison)
            env["PYTHONPATH"] = str(self.args.agent_src)
        flow_map = max(65536, 2 * max(self.args.flows))
        agent = self.child([sys.executable, "-m", "podmeter", "agent", "--node-name", NODE, "--datapath", "ebpf",
                            "--bpffs", str(self.pins), "--listen", f"127.0.0.1:{self.port}",
                            "--flow-interval", str(self.args.interval), "--flow-map-size", str(flow_map),
                            "--hubble-listen", f"unix://{self.work / 'hubble.sock'}"], "agent", env=env)
        wait(lambda: http(f"http://127.0.0.1:{self.port}/readyz") == "ready\n", "the agent ready", 90)
        return Process(agent.proc.pid)

    def start_readers(self) -> None:
        server = f"127.0.0.1:{self.port}"
        if self.args.observe:
            for i in range(self.args.followers):
                self.child([sys.executable, "-m", "podmeter", "observe", "-f", "--server", server], f"observe-{i}",
                           quiet=True)
        else:
            self.child([sys.executable, "-m", "bench.agent_flows", "--role", "readers", "--server", server,
                        "--followers", str(self.args.followers)], "readers").answer()
        self.hubble = self.child([sys.executable, "-m", "bench.agent_flows", "--role", "hubble", "--socket",
                                  f"unix://{self.work / 'hubble.sock'}"], "hubble")
        self.hubble.answer()

    def start_traffic(self) -> Child:
        self.child([sys.executable, "-m", "bench.agent_flows", "--role", "sink"], "sink").answer()
        specs = []
        for sender in self.node.senders:
            specs += ["--sender", f"{sender.netns_path},{self.node.mac(sender)},{sender.ip}"]
        generator = self.child([sys.executable, "-m", "bench.agent_flows", "--role", "send", "--round",
                                str(self.args.interval / 2), *specs], "send", stdin=True)
        generator.answer()
        return generator

    def scrape(self) -> str:
        started = time.monotonic()
        page = http(f"http://127.0.0.1:{self.port}/metrics", 60)
        self.scrape_seconds.append(time.monotonic() - started)
        return page

    def measure(self, agent: Process, generator: Child, phase: Phase, intervals: int,
                profile: Path | None = None) -> Phase:
        """Two intervals of warm-up with the phase's flows, then windows of ``--scrape`` seconds (each scraped
        once at its start) of ``intervals - 1`` intervals in all (RSS after the warm-up and every interval)."""
        interval = self.args.interval
        generator.tell(str(phase.flows))
        time.sleep(2 * interval)  # the first drain after the switch holds part of the flows, the second all
        phase.rss_mib.append(agent.rss_mib())
        per_window = max(1, round(self.args.scrape / interval))
        windows = max(1, (intervals - 1) // per_window)
        spy = self._profile(agent, profile, windows * per_window * interval) if profile else None
        first = page = metrics(self.scrape())
        for _ in range(windows):
            wall, cpu = time.monotonic(), agent.cpu_seconds()
            for step in range(1, per_window + 1):
                time.sleep(max(0.0, wall + interval * step - time.monotonic()))
                phase.rss_mib.append(agent.rss_mib())
            phase.cpu_fractions.append((agent.cpu_seconds() - cpu) / (time.monotonic() - wall))
            page = metrics(self.scrape())
            phase.last_drain_seconds.append(page.get("podmeter_flow_last_drain_seconds", 0.0))
        phase.drains = page["podmeter_flow_drains_total"] - first["podmeter_flow_drains_total"]
        phase.entries = page["podmeter_flow_entries_drained_total"] - first["podmeter_flow_entries_drained_total"]
        if spy is not None:
            spy.wait(60)
        return phase

    @staticmethod
    def _profile(agent: Process, out: Path, seconds: float) -> subprocess.Popen[bytes]:
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        return subprocess.Popen([spy, "record", "--pid", str(agent.pid), "--duration", str(int(seconds)),
                                 "--format", "raw", "--rate", "200", "--nonblocking", "--gil", "--output", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self, started: Child) -> None:
        answer = started.stop()
        name = started.log.stem
        if name in ("hubble", "sink", "readers") and answer is not None:
            self.said[name] = answer
        if name.startswith("observe-"):  # "podmeter observe: N flows lost: ..." on its stderr
            for line in started.log.read_text(errors="replace").splitlines():
                words = line.split()
                if "flows" in words[1:] and words[words.index("flows") - 1].isdigit():
                    self.said["observe_gaps"] += 1
                    self.said["observe_lost"] += int(words[words.index("flows") - 1])

    def stop_all(self) -> None:
        for started in reversed(self.children):
            self.stop(started)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from podmeter.adapters.datapath.ebpf.netns import netns
    from podmeter.adapters.datapath.ebpf.preflight import object_path

    object_path()  # the built object, or a message that says how
    node = Node()
    work = Path(tempfile.mkdtemp(prefix="podmeter-agent-flows-"))
    pins = Path("/sys/fs/bpf") / f"pmflows{node.tag}"
    runner = Bench(args, node, work, pins)
    try:
        node.create()
        with netns(node.host_path):  # every child starts in the node's namespace
            runner.populate(runner.start_apiserver())
            agent = runner.start_agent()
            runner.start_readers()
            generator = runner.start_traffic()
            time.sleep(2)  # the readers connect
            idle = runner.measure(agent, generator, Phase(0), max(4, args.intervals // 2))
            phases = [runner.measure(agent, generator, Phase(flows), args.intervals,
                                     args.profile if flows == args.flows[-1] else None) for flows in args.flows]
            assert runner.hubble is not None
            runner.stop(runner.hubble)  # then the same without it: what one Hubble follower costs
            phases += [runner.measure(agent, generator, Phase(flows, hubble=False), args.intervals)
                       for flows in args.flows if flows >= args.without_hubble]
            final = metrics(runner.scrape())
            pages = {"lost_packets": final.get("podmeter_flows_lost_packets_total", 0.0),
                     "cut_off": final.get("podmeter_flow_followers_cut_off_total", 0.0),
                     "gaps": final.get("podmeter_flow_reader_gaps_total", 0.0),
                     "sent": generator.tell("0")["sent"]}
            runner.stop_all()
        return {"idle": idle, "phases": phases, "pages": pages, "said": runner.said,
                "scrape_seconds": runner.scrape_seconds}
    finally:
        for started in runner.children:
            with contextlib.suppress(Exception):
                started.stop()
        node.destroy()
        shutil.rmtree(pins, ignore_errors=True)
        if args.keep:
            print(f"logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    idle: Phase = result["idle"]
    phases: list[Phase] = result["phases"]
    pages, said = result["pages"], result["said"]
    readers = f"{args.followers} {'podmeter observe -f' if args.observe else '/debug/flows?follow=1 readers'}"
    rows: list[tuple[str, float, float | None, str]] = [
        ("agent_cpu_fraction_idle", idle.cpu_fraction, None,
         f"no traffic; {readers}, 1 GetFlows follower, /metrics every {args.scrape:g} s")]
    figures: dict[str, Any] = {"agent_cpu_fraction_idle": round(idle.cpu_fraction, 5)}
    targets = {10_000: 0.005, 100_000: 0.04}
    for phase in phases:
        rows.append((f"agent_cpu_fraction_{phase.name}", phase.cpu_fraction,
                     targets.get(phase.flows) if phase.hubble else None,
                     f"median of {len(phase.cpu_fractions)} windows" + ("; reference: the target" if phase.hubble
                                                                        else ", the Hubble follower stopped")))
        figures[f"agent_cpu_fraction_{phase.name}"] = round(phase.cpu_fraction, 5)
        figures[f"agent_cpu_windows_{phase.name}"] = [round(f, 5) for f in phase.cpu_fractions]
        figures[f"rss_mib_{phase.name}"] = round(phase.rss_mib[-1], 1)
        figures[f"last_drain_ms_{phase.name}"] = round(1000 * statistics.median(phase.last_drain_seconds), 1)
        if phase.hubble:
            rows.append((f"entries_per_drain_{label(phase.flows)}", phase.entries_per_drain, float(phase.flows),
                         f"{phase.drains:.0f} drains; reference: the flows sent"))
            figures[f"entries_per_drain_{label(phase.flows)}"] = round(phase.entries_per_drain, 1)
    big = next(p for p in reversed(phases) if p.hubble)
    per_record = big.cpu_fraction * args.interval / big.flows * 1e6
    above_idle = (big.cpu_fraction - idle.cpu_fraction) * args.interval / big.flows * 1e6
    growth = big.rss_mib[-1] - big.rss_mib[0]
    rows += [("us_per_flow_record", per_record, 2.0 if big.flows == 100_000 else None,
              f"at {big.flows} flows, everything the agent did; reference: the target"),
             ("us_per_flow_record_above_idle", above_idle, None, "the same minus the idle agent's CPU"),
             ("rss_growth_mib", growth, None, f"{len(big.rss_mib) - 1} intervals at {big.flows} flows")]
    figures.update({"us_per_flow_record": round(per_record, 3), "us_per_flow_record_above_idle": round(above_idle, 3),
                    "rss_growth_mib": round(growth, 2), "rss_mib_series": [round(r, 1) for r in big.rss_mib],
                    "interval_s": args.interval, "followers": args.followers, "observe_processes": args.observe,
                    "flows_lost_packets": pages["lost_packets"], "reader_gaps": pages["gaps"],
                    "readers_cut_off": pages["cut_off"], "frames_sent": pages["sent"],
                    "frames_received": said.get("sink", {}).get("received"),
                    "hubble_flows_received": said.get("hubble", {}).get("flows"),
                    "reader_lines": said.get("readers", {}).get("lines"),
                    "scrape_ms_median": round(1000 * statistics.median(result["scrape_seconds"]), 1),
                    "scrape_ms_max": round(1000 * max(result["scrape_seconds"]), 1)})
    if args.observe:
        figures.update({"observe_gaps": said["observe_gaps"], "observe_lost": said["observe_lost"]})
    table(rows)
    json_line(figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flows", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 10_000, 100_000],
                        help="distinct active flows per interval, one measurement each (default 1000,10000,100000)")
    parser.add_argument("--intervals", type=int, default=10, help="flow intervals at each size (default 10)")
    parser.add_argument("--interval", type=float, default=5.0, help="the agent's --flow-interval (default 5)")
    parser.add_argument("--scrape", type=float, default=15.0, help="seconds between two scrapes (default 15)")
    parser.add_argument("--followers", type=int, default=10, help="followers of /debug/flows (default 10)")
    parser.add_argument("--observe", action="store_true",
                        help="follow with real `podmeter observe -f` processes (default: readers of the same stream "
                             "that only count its lines, so that the machine's other load stays small)")
    parser.add_argument("--without-hubble", type=int, default=10_000, metavar="N",
                        help="measure the sizes from N flows on again with the Hubble follower stopped (default "
                             "10000; a size above the largest: never)")
    parser.add_argument("--quick", action="store_true", help="1,000 and 10,000 flows, 4 intervals each")
    parser.add_argument("--profile", type=Path, help="py-spy record the agent at the largest size into this file")
    parser.add_argument("--agent-src", type=Path, help="run the agent from this source tree (PYTHONPATH)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (the logs)")
    parser.add_argument("--role", choices=("send", "sink", "hubble", "readers"), help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    parser.add_argument("--sender", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--round", type=float, default=2.5, help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        {"send": send_role, "sink": sink_role, "hubble": hubble_role, "readers": readers_role}[args.role](args)
        return
    if os.geteuid() != 0:
        sys.exit("bench.agent_flows needs root (eBPF, network namespaces)")
    if args.quick:
        args.flows, args.intervals = [1000, 10_000], 4
    report(args, bench(args))


if __name__ == "__main__":
    main()
