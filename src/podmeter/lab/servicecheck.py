"""The lab's services step: connections through a real Service, each checked to be named by the Service and
by the backend that really served it.

The truth comes from the backends themselves: each backend pod runs a TCP echo server that records the
client port of every connection it accepted, so the lab knows which backend the node's Service proxy
chose for each connection. The agent's records of the client's requests (``from-pod``, to the ClusterIP)
must carry ``destination.service`` and name that backend pod, one for one. Next stage: the run's verdict
(a failed check is a failed run).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from podmeter.lab.flowcheck import WINDOW_SLACK, FlowClient, Record
from podmeter.lab.kube import KubeClient, KubeError
from podmeter.lab.netns import in_namespace
from podmeter.lab.scenario import ServiceApps, ServiceCalls
from podmeter.lab.traffic import Endpoint

READY_S = 20.0  # the Service's slice and the proxy's rule, at most


@dataclass
class Served:
    """Which backend served which client port (the backends' own account)."""

    by_port: dict[int, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, port: int, pod: str) -> None:
        with self.lock:
            self.by_port[port] = pod

    def per_backend(self, ports: Iterable[int] | None = None) -> dict[str, int]:
        """Connections each backend served (of ``ports``: default, all)."""
        with self.lock:
            served = self.by_port if ports is None else {p: self.by_port[p] for p in ports if p in self.by_port}
            return dict(Counter(served.values()))


@contextlib.contextmanager
def echo_servers(backends: list[Endpoint], port: int, size: int, served: Served, ipv6: bool = False,
                 ) -> Iterator[None]:
    """A TCP echo server in each backend pod (``size`` bytes back per connection; IPv4, and with ``ipv6``
    IPv6 too), each connection recorded in ``served`` under its client port."""
    stop = threading.Event()
    threads = []
    for backend in backends:
        with in_namespace(backend.netns_path):
            listener = (socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True) if ipv6
                        else socket.create_server(("0.0.0.0", port)))
        listener.settimeout(0.2)
        thread = threading.Thread(target=_serve, args=(listener, backend.pod, size, served, stop), daemon=True)
        thread.start()
        threads.append(thread)
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(2)


def _serve(listener: socket.socket, pod: str, size: int, served: Served, stop: threading.Event) -> None:
    with listener:
        while not stop.is_set():
            try:
                connection, peer = listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.settimeout(5)
                got = b""
                with contextlib.suppress(OSError):
                    while len(got) < size:
                        chunk = connection.recv(65536)
                        if not chunk:
                            break
                        got += chunk
                    connection.sendall(got)
                served.add(int(peer[1]), pod)


def call(client: Endpoint, address: str, port: int, size: int) -> int:
    """One connection: ``size`` bytes there and back; the client's port."""
    with in_namespace(client.netns_path):
        sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    with sock:
        sock.settimeout(5)
        sock.connect((address, port))
        sock.sendall(b"s" * size)
        got = 0
        while got < size:
            chunk = sock.recv(65536)
            if not chunk:
                raise OSError("the backend closed the connection early")
            got += len(chunk)
        return int(sock.getsockname()[1])


def create_service(client: KubeClient, namespace: str, backends: str, port: int, target_port: int) -> tuple[str, str]:
    """The Service (name, ClusterIP) the lab's API server allocates, selecting the ``backends`` pods."""
    name = f"{backends}-svc"
    body = {"metadata": {"name": name},
            "spec": {"selector": {"app": backends},
                     "ports": [{"name": "tcp", "port": port, "targetPort": target_port}]}}
    made = client.create(f"/api/v1/namespaces/{namespace}/services", body)
    return name, str(made["spec"]["clusterIP"])


def first_call(client: Endpoint, address: str, port: int, size: int) -> int | None:
    """A first connection, tried until the slice and the proxy's rule are there (None: never)."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            return call(client, address, port, size)
        time.sleep(0.2)
    return None


@dataclass(frozen=True)
class Calls:
    """What the step did: the Service, its ClusterIP, the client and the client ports of its connections."""

    service: str
    cluster_ip: str
    client: Endpoint
    ports: list[int]


def check(step: ServiceCalls, records: list[Record] | None, calls: Calls, served: Served) -> dict[str, Any]:
    """Each measured connection's request record names the Service and the backend that served it."""
    problems: list[str] = []
    named: dict[int, str | None] = {}
    service, client, cluster_ip, ports = calls.service, calls.client, calls.cluster_ip, calls.ports
    measured = set(ports)  # not the first call, made while the Service may still be new to the agent
    for record in records or []:
        source, destination = record["source"], record["destination"]
        if (source["ip"], destination["ip"], record.get("observation")) == (client.ip, cluster_ip, "from-pod") \
                and source["port"] in measured:
            if destination.get("service") != {"namespace": step.namespace, "name": service}:
                problems.append(f"port {source['port']}: destination.service is {destination.get('service')!r}")
            pod = destination.get("pod")
            named[int(source["port"])] = f"{destination.get('namespace')}/{pod}" if pod else None
    if records is None:
        problems.append("the agent's /debug/flows did not answer")
    for port in ports:
        truth = served.by_port.get(port)
        if truth is None:
            problems.append(f"port {port}: no backend says it served the connection")
        elif port not in named:
            problems.append(f"port {port}: no request record")
        elif named[port] != truth:
            problems.append(f"port {port}: named {named[port]}, served by {truth}")
    return {"ok": not problems, "problems": problems[:20], "per_backend": served.per_backend(ports)}


def taking_part(step: ServiceCalls | ServiceApps, endpoints: list[Endpoint]) -> tuple[list[Endpoint], list[Endpoint]]:
    """(the backends, the clients) among the running pods."""
    backends = [e for e in endpoints if e.pod.split("/", 1)[1].startswith(f"{step.backends}-")]
    clients = [e for e in endpoints if e.pod.split("/", 1)[1].startswith(f"{step.clients}-")]
    return backends, clients


FarSide = Callable[["Calls", Served, float], dict[str, Any]]


def run_step(step: ServiceCalls, kube: KubeClient, flows: FlowClient, endpoints: list[Endpoint],
             wait_drained: Callable[[float | None], bool], *, far_side: FarSide | None = None) -> dict[str, Any]:
    """The whole step; the record the run's report and verdict take. ``flows``: the client's node's agent;
    ``far_side(calls, served, since)``: the checks of the backends' nodes (several nodes), whose
    ``problems`` join the step's."""
    record: dict[str, Any] = {"kind": "service", "protocol": "tcp", "namespace": step.namespace}
    backends, clients = taking_part(step, endpoints)
    if not backends or not clients:
        return {**record, "ok": False, "problems": [f"no running {step.backends} or {step.clients} pods"]}
    client = clients[0]
    name, cluster_ip = create_service(kube, step.namespace, step.backends, step.port, step.target_port)
    record.update(service=f"{step.namespace}/{name}", cluster_ip=cluster_ip, client=client.pod,
                  backends=sorted(b.pod for b in backends))
    served = Served()
    try:
        with echo_servers(backends, step.target_port, step.size, served):
            if first_call(client, cluster_ip, step.port, step.size) is None:
                silent = f"{cluster_ip}:{step.port} did not answer in {READY_S:g} s"
                return {**record, "ok": False, "problems": [silent]}
            since = time.time()
            ports = [call(client, cluster_ip, step.port, step.size) for _ in range(step.connections)]
            drained = wait_drained(flows.drains())  # two drains from now: the second began after the last call
            time.sleep(0.3)  # the servers' accounts of the last connections
        found = flows.records(since - WINDOW_SLACK, protocol="tcp", port=step.port)
        calls = Calls(name, cluster_ip, client, ports)
        verdict = check(step, found, calls, served)
        if not drained:
            verdict["problems"].insert(0, "the agent did not drain its flows twice in time")
            verdict["ok"] = False
        if far_side is not None:
            extra = far_side(calls, served, since)
            verdict["problems"] += extra.pop("problems")
            verdict.update(extra, ok=verdict["ok"] and not verdict["problems"])
    finally:
        with contextlib.suppress(KubeError):
            kube.delete(f"/api/v1/namespaces/{step.namespace}/services/{name}")
    return {**record, **verdict, "connections": len(ports)}
