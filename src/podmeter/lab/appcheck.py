"""The lab's apps step: real programs in lab pods talking through a Service, and the bytes they say they
moved checked against the agent's records of the connections, exactly.

``nginx``: Debian's nginx in each backend pod (a config of its own in the run's directory, an access log
of ``$remote_port $request_length $bytes_sent`` per request), curl in one client pod fetching a file
through the ClusterIP twice: once with every request on one kept-alive connection, once with a new
connection per request (``Connection: close``). Each connection's bytes, per client port, as nginx
counted them (the request bytes it read, the response bytes it wrote) must be what the agent's records of
that connection carry, and the records name the Service and the backend whose log has that port.

``redis``: redis-server in each backend pod, redis-benchmark in the client: SET/GET pipelined 16 deep on
kept-alive connections, then a reconnect per request. Each backend's own count (``INFO stats``:
``total_net_input_bytes``, ``total_net_output_bytes``, read on the pod's loopback before and after, the
reading's own bytes taken out) must be what the records naming that backend carry.

A record counts whole frames; the payload is its bytes less 66 per packet (Ethernet 14, IPv4 20, TCP 32:
Linux puts a timestamp option on every segment once both ends agreed on it) and 8 more for a
connection's SYN (its options: MSS, SACK permitted, window scale). That is exact while no segment
carries other options (SACK blocks after a loss: the lab's links lose nothing here); a difference is
reported as one. The programs are started with argument lists, in the pods' netns (``nsenter``), and
stopped and waited at the end. Without them the step says so and is skipped.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podmeter.lab.flowcheck import WINDOW_SLACK, FlowClient, Record
from podmeter.lab.kube import KubeClient, KubeError
from podmeter.lab.netns import in_namespace
from podmeter.lab.scenario import ServiceApps
from podmeter.lab.servicecheck import READY_S, create_service, taking_part
from podmeter.lab.traffic import Endpoint

FRAME = 14 + 20 + 32  # Ethernet, IPv4, TCP with the timestamp option
SYN_OPTIONS = 8  # a SYN's (and SYN-ACK's) options beyond the timestamp
SYN = "SYN"
PROGRAMS = {"nginx": ("nginx", "curl"), "redis": ("redis-server", "redis-benchmark")}
PORTS = {"nginx": (80, 8080), "redis": (6379, 6379)}  # Service port, target port
FILE_SIZE = 7000  # nginx's file: a few segments per response
STOP_S = 5.0


def missing(program: str) -> list[str]:
    """The binaries a program's step needs that are not installed."""
    return [name for name in PROGRAMS[program] if shutil.which(name) is None]


def in_pod(endpoint: Endpoint, argv: list[str]) -> list[str]:
    return ["nsenter", f"--net={endpoint.netns_path}", "--", *argv]


@dataclass
class Programs:
    """The step's processes (servers), stopped (SIGTERM, then SIGKILL) and waited at the end."""

    directory: Path
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # nginx takes a relative -p/-c against its own prefix and redis a relative logfile against its dir:
        # every path the servers are given is absolute (``make lab``'s --out is the relative lab-report)
        self.directory = self.directory.resolve()

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self.directory / f"{name}.out", "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.started.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.started:
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_S)


def run_client(argv: list[str], timeout: float = 60.0) -> str:
    """A client program to its end; its output (a failure raises, with what it printed)."""
    done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[3]} exited {done.returncode}: {done.stderr.decode(errors='replace')[-300:]}")
    return done.stdout.decode(errors="replace")


# --- nginx -------------------------------------------------------------------------------------------


def nginx_config(directory: Path, port: int) -> Path:
    """A config of its own for one backend's nginx: everything under ``directory``."""
    (directory / "www").mkdir(parents=True, exist_ok=True)
    (directory / "www" / "file").write_bytes(b"n" * FILE_SIZE)
    temp = "\n".join(f"  {kind}_temp_path {directory / kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                              "uwsgi", "scgi"))
    config = directory / "nginx.conf"
    config.write_text(f"""worker_processes 1;
daemon off;
user root;
pid {directory / "nginx.pid"};
error_log {directory / "error.log"} warn;
events {{ worker_connections 256; }}
http {{
  log_format sizes '$remote_port $request_length $bytes_sent';
  access_log {directory / "access.log"} sizes;
  keepalive_requests 10000;
{temp}
  server {{ listen {port}; root {directory / "www"}; }}
}}
""")
    return config


def nginx_log(directory: Path) -> dict[int, tuple[int, int]]:
    """Client port -> (request bytes read, response bytes written), summed over its requests."""
    found: dict[int, tuple[int, int]] = {}
    path = directory / "access.log"
    for line in path.read_text().splitlines() if path.exists() else ():
        port, read, written = (int(part) for part in line.split())
        before = found.get(port, (0, 0))
        found[port] = (before[0] + read, before[1] + written)
    return found


def nginx_argv(directory: Path, port: int) -> list[str]:
    return ["nginx", "-p", str(directory), "-c", str(nginx_config(directory, port)), "-e", str(directory / "error.log")]


def curl_argv(address: str, port: int, requests: int, close: bool) -> list[str]:
    url = f"http://{address}:{port}/file"
    argv = ["curl", "--silent", "--show-error", "--fail", "--http1.1"]
    if close:
        argv += ["--header", "Connection: close"]
    for _ in range(requests):
        argv += ["--output", "/dev/null", url]
    return argv


# --- redis -------------------------------------------------------------------------------------------

INFO = b"*2\r\n$4\r\nINFO\r\n$5\r\nstats\r\n"


def redis_config(directory: Path, port: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "redis.conf"
    config.write_text(f'port {port}\nbind 0.0.0.0\nprotected-mode no\nsave ""\nappendonly no\n'
                      f"daemonize no\ndir {directory}\nlogfile {directory / 'redis.log'}\n")
    return config


def redis_argv(directory: Path, port: int) -> list[str]:
    return ["redis-server", str(redis_config(directory, port))]


def redis_stats(backend: Endpoint, port: int) -> tuple[int, int, int]:
    """(total_net_input_bytes, total_net_output_bytes, the reply's length), read on the pod's loopback
    (podmeter does not see it). The server counts this command in its input before answering, and the
    reply in its output only once written: the next reading holds it."""
    with in_namespace(backend.netns_path):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    with sock:
        sock.sendall(INFO)
        reply = b""
        while b"\r\n" not in reply:
            reply += sock.recv(65536)
        header, _, body = reply.partition(b"\r\n")
        size = int(header[1:])
        while len(body) < size + 2:
            body += sock.recv(65536)
    stats = dict(line.split(":", 1) for line in body.decode().splitlines() if ":" in line)
    return int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"]), len(header) + 2 + len(body)


def wait_listening(backend: Endpoint, port: int, proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline and proc.poll() is None:
        with in_namespace(backend.netns_path):
            probe = socket.socket()
        with probe, contextlib.suppress(OSError):
            probe.settimeout(1)
            probe.connect(("127.0.0.1", port))
            return True
        time.sleep(0.1)
    return False


def benchmark_argv(address: str, port: int, requests: int, keepalive: bool) -> list[str]:
    argv = ["redis-benchmark", "-h", address, "-p", str(port), "-q", "-n", str(requests)]
    if keepalive:
        return [*argv, "-c", "4", "-P", "16", "-t", "set,get"]
    return [*argv, "-c", "2", "-k", "0", "-t", "set"]


# --- the agent's side --------------------------------------------------------------------------------


@dataclass
class Seen:
    """The records of one client's connections to a ClusterIP, added up per client port and direction:
    frames' bytes and packets, whether a SYN is among them, and the backend pod they name."""

    request: dict[int, list[int]] = field(default_factory=dict)  # port -> [bytes, packets, syn]
    reply: dict[int, list[int]] = field(default_factory=dict)
    backend: dict[int, set[str | None]] = field(default_factory=dict)
    unnamed: list[str] = field(default_factory=list)

    def add(self, record: Record, port: int, into: dict[int, list[int]], end: dict[str, Any], service: str) -> None:
        total = into.setdefault(port, [0, 0, 0])
        total[0] += int(record["bytes"])
        total[1] += int(record["packets"])
        total[2] |= SYN in record.get("tcp_flags", ())
        named = end.get("service") or {}
        if f"{named.get('namespace')}/{named.get('name')}" != service:
            self.unnamed.append(f"port {port}: the record names Service {end.get('service')!r}")
        pod = end.get("pod")
        self.backend.setdefault(port, set()).add(f"{end.get('namespace')}/{pod}" if pod else None)

    def payload(self, port: int, direction: dict[int, list[int]]) -> int:
        frames, packets, syn = direction.get(port, (0, 0, 0))
        return frames - FRAME * packets - SYN_OPTIONS * syn


def seen(records: list[Record], client: Endpoint, cluster_ip: str, service: str, skip: set[int]) -> Seen:
    found = Seen()
    for record in records:
        source, destination = record["source"], record["destination"]
        if record.get("verdict", "forwarded") != "forwarded":
            continue
        if (source["ip"], destination["ip"], record.get("observation")) == (client.ip, cluster_ip, "from-pod"):
            port = int(source["port"])
            if port not in skip:
                found.add(record, port, found.request, destination, service)
        elif (source["ip"], destination["ip"], record.get("observation")) == (cluster_ip, client.ip, "to-pod"):
            port = int(destination["port"])
            if port not in skip:
                found.add(record, port, found.reply, source, service)
    return found


def probe(client: Endpoint, address: str, port: int) -> int | None:
    """A connection opened and closed (no data) until the Service answers; its client port (None: never)."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        with in_namespace(client.netns_path):
            sock = socket.socket()
        with sock, contextlib.suppress(OSError):
            sock.settimeout(1)
            sock.connect((address, port))
            return int(sock.getsockname()[1])
        time.sleep(0.2)
    return None


# --- the checks --------------------------------------------------------------------------------------


def check_nginx(found: Seen, logs: dict[str, dict[int, tuple[int, int]]]) -> list[str]:
    """Per connection: nginx's bytes are the records' payload, and the records name the backend whose log
    has the connection."""
    problems = list(found.unnamed)
    served = {port: pod for pod, log in logs.items() for port in log}
    for port in sorted(set(served) | set(found.request)):
        pod = served.get(port)
        if pod is None:
            problems.append(f"port {port}: no nginx logged a request of this connection")
            continue
        read, written = logs[pod][port]
        sent, answered = found.payload(port, found.request), found.payload(port, found.reply)
        if (sent, answered) != (read, written):
            problems.append(f"port {port}: records carry {sent} B of requests and {answered} B of responses, "
                            f"{pod}'s nginx read {read} and wrote {written}")
        if found.backend.get(port) != {pod}:
            problems.append(f"port {port}: named {sorted(map(str, found.backend.get(port, ())))}, served by {pod}")
    return problems


def check_redis(found: Seen, counted: dict[str, tuple[int, int]]) -> list[str]:
    """Per backend: what its redis-server read and wrote is the payload of the records that name it."""
    problems = list(found.unnamed)
    per_backend: dict[str | None, list[int]] = {}
    for port in set(found.request) | set(found.reply):
        named = found.backend.get(port, {None})
        if len(named) != 1:
            problems.append(f"port {port}: named {sorted(map(str, named))}")
            continue
        total = per_backend.setdefault(next(iter(named)), [0, 0])
        total[0] += found.payload(port, found.request)
        total[1] += found.payload(port, found.reply)
    if None in per_backend:
        problems.append(f"connections named by no backend: {per_backend[None]} B")
    for pod, (read, written) in counted.items():
        carried = tuple(per_backend.get(pod, (0, 0)))
        if carried != (read, written):
            problems.append(f"{pod}: records carry {carried[0]} B in and {carried[1]} B out, its redis-server "
                            f"read {read} and wrote {written}")
    return problems


# --- the step ----------------------------------------------------------------------------------------


def run_step(step: ServiceApps, kube: KubeClient, flows: FlowClient, endpoints: list[Endpoint],
             wait_drained: Callable[[float | None], bool], *, directory: Path) -> dict[str, Any]:
    """The whole step; the record the run's report and verdict take."""
    record: dict[str, Any] = {"kind": f"apps-{step.program}", "protocol": "tcp", "namespace": step.namespace}
    absent = missing(step.program)
    if absent:
        return {**record, "skipped": f"{', '.join(absent)} not installed (scripts/setup.sh installs them)"}
    backends, clients = taking_part(step, endpoints)
    if not backends or not clients:
        return {**record, "ok": False, "problems": [f"no running {step.backends} or {step.clients} pods"]}
    port, target = PORTS[step.program]
    name, cluster_ip = create_service(kube, step.namespace, step.backends, port, target)
    run = AppRun(step, clients[0], backends, cluster_ip, f"{step.namespace}/{name}", Programs(directory), flows,
                 wait_drained)
    record.update(service=run.service, cluster_ip=cluster_ip, client=run.client.pod,
                  backends=sorted(b.pod for b in backends))
    try:
        outcome = run.nginx() if step.program == "nginx" else run.redis()
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        outcome = {"ok": False, "problems": [f"{type(error).__name__}: {error}"]}
    finally:
        run.programs.stop()
        with contextlib.suppress(KubeError):
            kube.delete(f"/api/v1/namespaces/{step.namespace}/services/{name}")
    return {**record, **outcome}


@dataclass
class AppRun:
    """One apps step under way: who takes part, the Service, the servers started."""

    step: ServiceApps
    client: Endpoint
    backends: list[Endpoint]
    cluster_ip: str
    service: str  # namespace/name
    programs: Programs
    flows: FlowClient
    wait_drained: Callable[[float | None], bool]

    def _start(self, kind: str, argv: Callable[[Path], list[str]], port: int) -> dict[str, Path]:
        """One server per backend (``argv`` of its directory); raise if one does not listen."""
        directories = {}
        for index, backend in enumerate(self.backends):
            directory = self.programs.directory / f"{kind}-{index}"
            directory.mkdir(parents=True, exist_ok=True)
            proc = self.programs.start(f"{kind}-{index}", in_pod(backend, argv(directory)))
            if not wait_listening(backend, port, proc):
                raise RuntimeError(f"{backend.pod}: {kind} did not listen (see {directory})")
            directories[backend.pod] = directory
        return directories

    def _probe(self, port: int) -> int:
        probed = probe(self.client, self.cluster_ip, port)
        if probed is None:
            raise RuntimeError(f"{self.cluster_ip}:{port} did not answer in {READY_S:g} s")
        return probed

    def _records(self, since: float, drains: float | None, port: int, probed: int) -> tuple[Seen, list[str]]:
        """The records of the step's connections, once the agent finished two drains after ``drains`` (read
        when the clients were done: the second began after their last packet)."""
        problems = [] if self.wait_drained(drains) else ["the agent did not drain its flows twice in time"]
        found = self.flows.records(since - WINDOW_SLACK, protocol="tcp", port=port)
        if found is None:
            problems.append("the agent's /debug/flows did not answer")
        return seen(found or [], self.client, self.cluster_ip, self.service, {probed}), problems

    def nginx(self) -> dict[str, Any]:
        port, target = PORTS["nginx"]
        directories = self._start("nginx", lambda d: nginx_argv(d, target), target)
        probed = self._probe(port)
        since = time.time()
        requests = self.step.requests
        run_client(in_pod(self.client, curl_argv(self.cluster_ip, port, requests, close=False)))  # kept alive
        run_client(in_pod(self.client, curl_argv(self.cluster_ip, port, requests, close=True)))  # one each
        found, problems = self._records(since, self.flows.drains(), port, probed)
        logs = {pod: {p: sizes for p, sizes in nginx_log(d).items() if p != probed} for pod, d in directories.items()}
        problems += check_nginx(found, logs)
        connections = sum(len(log) for log in logs.values())
        if connections != 1 + requests:
            problems.append(f"{connections} connections logged, {1 + requests} expected")
        return {"ok": not problems, "problems": problems[:20], "connections": connections,
                "per_backend": {pod: len(log) for pod, log in logs.items()}}

    def redis(self) -> dict[str, Any]:
        port, target = PORTS["redis"]
        self._start("redis", lambda d: redis_argv(d, target), target)
        probed = self._probe(port)
        before = {b.pod: redis_stats(b, target) for b in self.backends}
        since = time.time()
        run_client(in_pod(self.client, benchmark_argv(self.cluster_ip, port, self.step.requests * 50, keepalive=True)))
        run_client(in_pod(self.client, benchmark_argv(self.cluster_ip, port, self.step.requests, keepalive=False)))
        after = {b.pod: redis_stats(b, target) for b in self.backends}
        counted = {pod: (after[pod][0] - before[pod][0] - len(INFO), after[pod][1] - before[pod][1] - before[pod][2])
                   for pod in before}
        found, problems = self._records(since, self.flows.drains(), port, probed)
        problems += check_redis(found, counted)
        return {"ok": not problems, "problems": problems[:20],
                "per_backend": {pod: list(c) for pod, c in counted.items()}}
