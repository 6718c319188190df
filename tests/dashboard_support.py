"""The dashboards against the real thing (no tests here): a real ``podmeter agent --datapath ebpf`` and a
``podmeter operator`` in a topology's host netns, four netns pods in two namespaces with TCP and UDP
traffic, refused connections and drops between them and with addresses no pod holds, the node's own TCP
connections to a pod (a kubelet's probe) and drops on the node's interfaces (:class:`InterfaceDrops`), DNS
lookups to
Debian's dnsmasq in a fifth pod (the cluster's DNS server, in a namespace not observed), Debian's Prometheus
scraping the agent, its Hubble metrics listener (in ``remote`` mode) and the operator every second, and
every panel's queries (:mod:`dashboard_queries`) evaluated through Prometheus's HTTP API
(``/api/v1/query``). Used by ``tests/adapters/test_bpf_dashboards.py`` and ``python -m bench.dashboards``.

The agent's arguments are :func:`agent_arguments` and Prometheus's targets :func:`scrape_targets`, each
the one place to change: a new metrics address of the agent is one line in each.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import dashboard_queries as dq
from agent_harness import Cluster
from bpf_support import Pod, Topology
from dns_support import AAAA, A, Dnsmasq, ask_from, message
from drop_support import AgentProcess, nft, routed_pod, send, udp_socket, upload, warm
from lab_server import LabServer
from operator_support import OperatorProcess
from podmeter.adapters.datapath.ebpf.netns import netns
from waiting import stop_process, wait_for

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
NODE = "node-a"  # the agent's node: Retina's scrape configuration makes it the `instance` label
DEFAULT, REMOTE = "default", "remote"
NAMESPACES = ("shop", "pay")
DROPPED_PORT = 9998  # a port web's own input chain drops
REFUSED_PORT = 9997  # a TCP port of web where nothing listens
# The cluster's DNS server: a pod of kube-system (the lab server has that namespace), which is not observed.
DNS_NAMESPACE, DNS_POD = "kube-system", "kube-dns"
# The lookups each asking pod makes in a round: names the server answers (NOERROR), names that do not exist
# (NXDOMAIN) and names it refuses (REFUSED: it has no upstream), as Dnsmasq answers them.
LOOKUPS = (("cart.shop.svc.cluster.local", A), ("db.pay.svc.cluster.local", AAAA), ("gone.nxdomain.test", A),
           ("elsewhere.example", A))


# What a user of Retina's Hubble dashboards (hubble-pod-flows-workload, -namespace, hubble-dns) configures:
# the metrics of Retina's Hubble Helm chart (microsoft/retina, deploy/hubble/manifests/controller/helm/retina/
# values.yaml, `hubble.metrics.enabled`), one per line there. Their `pod` contexts give `source` (of what
# leaves a pod) and `destination` (of what enters one) the `namespace/pod` form the dashboards match
# (`source=~"^$namespace/$workload"`, `$workload` being a pod name: `kube_pod_info`'s `pod` label).
HUBBLE_METRICS = ("flow:sourceEgressContext=pod;destinationIngressContext=pod "
                  "tcp:sourceEgressContext=pod;destinationIngressContext=pod "
                  "dns:query;sourceEgressContext=pod;destinationIngressContext=pod "
                  "drop:sourceEgressContext=pod;destinationIngressContext=pod")


def agent_arguments(mode: str, hubble_port: int = 0) -> list[str]:
    """What the agent runs with beyond :class:`drop_support.AgentProcess`' defaults (eBPF, drops on): in
    ``remote`` mode, what a user of Retina's dashboards runs, Retina's series and Hubble's metrics (on
    ``hubble_port``)."""
    args = ["--flow-interval", "0.5", "--series-grace", "30"]
    if mode == REMOTE:
        args += ["--retina-compat=remote", "--hubble-metrics-server", f"127.0.0.1:{hubble_port}",
                 "--hubble-metrics", HUBBLE_METRICS]
    return args


@dataclass(frozen=True)
class Target:
    job: str
    port: int
    labels: Mapping[str, str]


def scrape_targets(ports: Mapping[str, int]) -> list[Target]:
    """Prometheus's targets, labelled as Retina's scrape configuration and podmeter's ServiceMonitor label
    them (``cluster``, ``instance`` = the node, ``component``)."""
    node = {"cluster": dq.CLUSTER, "instance": NODE}
    hubble = [Target("hubble-metrics", ports["hubble"], {**node, "component": "hubble"})] if "hubble" in ports else []
    return [Target("podmeter-agent", ports["agent"], {**node, "component": "agent"}),
            Target("podmeter-operator", ports["operator"], {**node, "component": "operator"}), *hubble]


def prometheus_config(targets: Sequence[Target]) -> dict[str, Any]:
    return {"global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": t.job, "static_configs": [{"targets": [f"127.0.0.1:{t.port}"],
                                                                       "labels": dict(t.labels)}]}
                               for t in targets]}


class Prometheus:
    """Debian's ``prometheus`` in the topology's host netns, its data in a temp dir (removed at stop)."""

    def __init__(self, topology: Topology, targets: Sequence[Target]) -> None:
        self.topology = topology
        self.dir = Path(tempfile.mkdtemp(prefix="pm-prometheus-"))
        self.port = topology.free_port()
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(targets)))
        self.log = self.dir / "prometheus.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["nsenter", f"--net={topology.host_path}", "--", PROMETHEUS,
                 f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"], stdout=out, stderr=subprocess.STDOUT)
        wait_for(self._ready, 30, "Prometheus ready", self.log_tail)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log_tail()
        try:
            return self._get("/-/ready").startswith("Prometheus Server is Ready")
        except OSError:
            return False

    def _get(self, path: str) -> str:
        with self.topology.in_host(), urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                                             timeout=10) as response:
            return str(response.read().decode())

    def query(self, expr: str, at: float | None = None) -> list[Any]:
        """The result of an instant query (raises on a query Prometheus refuses)."""
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        answer = json.loads(self._get("/api/v1/query?" + urllib.parse.urlencode(params)))
        assert answer["status"] == "success", (expr, answer)
        return list(answer["data"]["result"])

    def targets_up(self) -> bool:
        return all(t["health"] == "up" for t in json.loads(self._get("/api/v1/targets"))["data"]["activeTargets"])

    def stop(self) -> None:
        stop_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Traffic:
    """TCP uploads and UDP datagrams between the pods, to and from the host (an address no pod holds) and
    into web's dropped port (from pods, and from the host: a drop seen entering a pod), connections refused
    by web (a SYN answered by a RST), a TCP probe of web from the node (:func:`probe`), drops on the node's
    interfaces (:class:`InterfaceDrops`), DNS lookups of client and api (:data:`LOOKUPS`) and one to an
    address where no DNS server listens (its answer missing), again and again until :meth:`stop`."""

    pods: Mapping[str, Pod]
    host_ip: str
    topology: Topology
    resolver: str
    stopping: threading.Event = field(default_factory=threading.Event)
    failures: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.interface_drops = InterfaceDrops(self.topology, self.pods["shop/client"])
        self.interface_drops.create()

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        web, client, api = self.pods["shop/web"], self.pods["shop/client"], self.pods["pay/api"]
        try:
            while not self.stopping.is_set():
                upload(client, web, 20_000)
                upload(api, self.pods["pay/db"], 10_000)
                for sender in (client, api):
                    with udp_socket(sender) as sock:
                        send(sock, (web.ip, 9999), 3)
                        send(sock, (web.ip, DROPPED_PORT), 2)
                with udp_socket(web) as sock:
                    send(sock, (self.host_ip, 9999), 2)  # to an address no pod holds
                with self.topology.in_host(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                    send(sock, (web.ip, DROPPED_PORT), 2)  # from an address no pod holds
                refused(client, web)
                probe(self.topology, web)
                self.interface_drops.send()
                for asker in (client, api):
                    lookups(asker, self.resolver)
                ask_from(client, self.host_ip, message(0, "lost.shop.svc.cluster.local"), timeout=0.05)
                self.stopping.wait(0.3)
        except BaseException as exc:  # reported by stop()
            self.failures.append(exc)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(30)
        if self.failures:
            raise self.failures[0]


def probe(topology: Topology, server: Pod) -> None:
    """A TCP connection from the node (the host netns) to ``server``, closed by the node, as a kubelet's TCP
    probe: the node's socket stays in TIME_WAIT with the pod's address as its remote end."""
    with netns(server.netns_path):
        listener = socket.socket()
    with topology.in_host():
        sock = socket.socket()
    with listener, sock:
        listener.bind((server.ip, 0))
        listener.listen(1)
        sock.settimeout(5)
        sock.connect(listener.getsockname())
        accepted, _ = listener.accept()
        with accepted:
            sock.close()  # the node closes first: its end waits in TIME_WAIT


# A frame of a protocol the node does not speak (an EtherType of IEEE's local experimental range): the
# interface that receives it counts it in rx_dropped.
UNKNOWN_ETHERTYPE = 0x88B5
STRAY_FRAME = bytes.fromhex("ffffffffffff" "020000000001") + UNKNOWN_ETHERTYPE.to_bytes(2, "big") + bytes(46)
DOWN_VETH, DOWN_PEER = "pmdown0", "pmdown1"  # a link of the node whose other end is down
DOWN_NET, DOWN_NEIGHBOUR = "10.232.0.1/30", "10.232.0.2"


@dataclass
class InterfaceDrops:
    """Real drops on the node's interfaces, as the kernel counts them in /proc/net/dev: a pod's frames of
    an unknown protocol (rx_dropped of its veth's host side) and datagrams routed onto a veth whose peer is
    down (tx_dropped: the kernel cannot forward to a device that is not up)."""

    topology: Topology
    sender: Pod

    def create(self) -> None:
        host = self.topology.host
        subprocess.run(["ip", "-n", host, "link", "add", DOWN_VETH, "type", "veth", "peer", "name", DOWN_PEER],
                       check=True)
        subprocess.run(["ip", "-n", host, "addr", "add", DOWN_NET, "dev", DOWN_VETH], check=True)
        subprocess.run(["ip", "-n", host, "link", "set", DOWN_VETH, "up"], check=True)
        subprocess.run(["ip", "-n", host, "neigh", "add", DOWN_NEIGHBOUR, "lladdr", "02:00:00:00:00:02", "dev",
                        DOWN_VETH, "nud", "permanent"], check=True)  # no ARP: only the test's datagrams

    def send(self) -> None:
        with netns(self.sender.netns_path):
            raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        with raw:
            raw.bind(("eth0", 0))
            for _ in range(2):
                raw.send(STRAY_FRAME)
        with self.topology.in_host(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            send(sock, (DOWN_NEIGHBOUR, 9), 2)


def refused(client: Pod, server: Pod) -> None:
    """A TCP connection to a port of ``server`` where nothing listens: its SYN is answered by a RST."""
    with netns(client.netns_path):
        sock = socket.socket()
    with sock, contextlib.suppress(ConnectionRefusedError):
        sock.settimeout(5)
        sock.connect((server.ip, REFUSED_PORT))


def lookups(pod: Pod, resolver: str) -> None:
    """One round of :data:`LOOKUPS` from ``pod``; each must be answered (dnsmasq answers every one)."""
    for ident, (name, qtype) in enumerate(LOOKUPS):
        if ask_from(pod, resolver, message(ident, name, qtype)) is None:
            raise AssertionError(f"{resolver} did not answer {name}")


@dataclass(frozen=True)
class PanelResult:
    panel: dq.Panel
    has_data: bool
    expected: str | None  # None: podmeter should fill it; else why not


@contextlib.contextmanager
def running(topology: Topology, server: LabServer, pins: Path, workdir: Path,
            mode: str) -> Iterator[tuple[Prometheus, list[str]]]:
    """The agent (in ``mode``; its arguments are yielded too) and the operator scraped by Prometheus, with
    :class:`Traffic` flowing and the drops, the DNS answers and the pods' own series already scraped once."""
    pods = {f"{ns}/{name}": routed_pod(topology, None) for ns, name in
            (("shop", "web"), ("shop", "client"), ("pay", "api"), ("pay", "db"))}
    dns_pod = routed_pod(topology, None)
    cluster = Cluster(server)
    with topology.in_host():
        for namespace in NAMESPACES:
            cluster.namespace(namespace, observe=True)
        for key, pod in pods.items():
            cluster.pod(*key.split("/"), pod.ip)
        cluster.pod(DNS_NAMESPACE, DNS_POD, dns_pod.ip)
        operator = OperatorProcess(server, workdir, "operator", [])
    resolver = Dnsmasq(dns_pod.netns_path, dns_pod.ip)
    ports = {"hubble": topology.free_port()} if mode == REMOTE else {}
    args = agent_arguments(mode, ports.get("hubble", 0))
    agent = AgentProcess(topology, server, pins, workdir / "agent.log", args=args)
    stack = contextlib.ExitStack()
    try:
        stack.callback(operator.stop)
        stack.callback(agent.stop)
        resolver.start()
        stack.callback(resolver.stop)
        wait_for(lambda: agent.get("/readyz")[0] == 200, 30, "agent ready", agent.log)
        wait_for(lambda: {p.ip for p in pods.values()} <= set(json.loads(agent.get("/debug/state")[1])["filter"]
                                                                 ["actual"]), 10, "filter", agent.log)
        for key in ("shop/client", "pay/api"):
            warm(pods[key], pods["shop/web"])
        nft(pods["shop/web"], f"in udp dport {DROPPED_PORT} drop")
        prometheus = Prometheus(topology, scrape_targets({"agent": agent.port, "operator": operator.port, **ports}))
        stack.callback(prometheus.stop)
        wait_for(prometheus.targets_up, 30, "targets up", prometheus.log_tail)
        traffic = Traffic(pods, pods["shop/web"].host_ip, topology, resolver.address)
        traffic.start()
        stack.callback(traffic.stop)
        wait_for(lambda: bool(prometheus.query("rate(podmeter_pod_drops_total[15s]) > 0")), 60, "drops scraped",
                 agent.log)
        wait_for(lambda: bool(prometheus.query("rate(podmeter_pod_dns_responses_total[15s]) > 0")), 30,
                 "DNS scraped", agent.log)
        time.sleep(3)  # a few scrapes of the flows and drops that followed
        yield prometheus, args
    finally:
        stack.close()


def evaluate(prometheus: Prometheus, args: Sequence[str], picked: Mapping[str, str]) -> list[PanelResult]:
    """Every panel of every dashboard, evaluated at one moment: with data if one of its queries has a result."""
    at = time.time()
    return [PanelResult(panel, any(prometheus.query(dq.promql(q, picked), at) for q in panel.queries),
                        dq.expected(panel, args)) for panel in dq.all_panels()]


def measure(topology: Topology, server: LabServer, pins: Path, workdir: Path, mode: str) -> list[PanelResult]:
    with running(topology, server, pins, workdir, mode) as (prometheus, args):
        return evaluate(prometheus, args, {**dq.PICKED, "namespace": NAMESPACES[0]})


def summary(results: Sequence[PanelResult]) -> dict[str, dict[str, int]]:
    """Per dashboard: panels, panels with data, panels podmeter should fill."""
    out: dict[str, dict[str, int]] = {}
    for r in results:
        row = out.setdefault(r.panel.dashboard, {"panels": 0, "with_data": 0, "expected": 0})
        row["panels"] += 1
        row["with_data"] += r.has_data
        row["expected"] += r.expected is None
    return out
