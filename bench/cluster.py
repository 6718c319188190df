"""Cluster-wide endpoints benchmark: propagation to every agent, API writes, cache memory, publication.

Run: ``.venv/bin/python -m bench.cluster [--seconds 30] [--rate 20] [--pods 100000] [--lab [--datapath ebpf]]``

* ``endpoint_propagation_p99_ms``: a real lab API server and a real ``podmeter operator`` process, and
  three agents (in this process, each on its own event loop and thread, memory datapath, nodes ``node-0``
  to ``node-2``); ``--rate`` pod lifecycles per second for ``--seconds`` (a pod is created, gets its IP
  through the status subresource, lives ~3 s, is deleted). Per pod: from the answer to the status write
  that gave it its IP to the moment the last of the three agents' caches names it (each cache's change
  handler stamps the arrival). Target <= 1,000.
* ``api_writes_per_pod_lifecycle``: PodSlice writes the operator made during that churn (its
  ``podmeter_slice_writes_total``) divided by the lifecycles. Target <= 1.
* ``agent_endpoint_bytes_per_entry``: tracemalloc of an agent's slice store and endpoint cache holding
  ``--pods`` pods (100,000) decoded from the JSON slices the publisher makes. Target <= 200.
* ``operator_publish_100k_pods_s``: the publisher computing and writing the slices of ``--pods`` pods from
  nothing, against an in-memory slice API (the model, the diff and the write loop; HTTP excluded: the lab
  API server's write rate is measured by bench.apiserver).
* ``--lab``: ``endpoint_propagation_p99_ms`` and ``api_writes_per_pod_lifecycle`` measured in the
  multi-node lab instead (``podmeter.lab.cluster``): three nodes, each with its own ``podmeter node`` and
  its own agent *process* (memory datapath by default: the endpoints' path does not touch the kernel, and
  the nodes then run pods at the full rate; ``--datapath ebpf`` as root: namespaces, veths and eBPF agents,
  where building sandboxes limits how many pods get an IP), one operator, ``--rate`` lifecycles per second
  (each pod deleted 3 s after its creation). Per pod: from the moment the runner's own watch sees the IP
  the node wrote (a few ms after the write: the figure is that much low) to the first poll (every 20 ms,
  through each agent's ``/debug/endpoints``) at which all three agents name it (up to 20 ms high). The
  lab's checks run meanwhile (I1-I7), and its verdict is printed. The operator runs with its default
  ``--publish-period`` (0.5 s: a sync at most every half second, so the figure is spread over it), or
  ``--publish-period S``. The other two figures are not measured.
Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import yaml

from bench.agent import free_port
from bench.measure import json_line, table, traced_bytes
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.kube.connection import ALLOW_PLAIN_HTTP, load_connection
from podmeter.adapters.kube.reflector import ReflectorSettings
from podmeter.lab.apiserver.client import AdminClient
from podmeter.model.deltas import POD_SLICES, Replace, Upsert
from podmeter.model.endpoint_slices import ClusterEndpoints, PodSlice, decode_slice, unpack_ip
from podmeter.model.identity import IdentityKey, LabelFilter, key_of_flat
from podmeter.model.records import Pod
from podmeter.model.store import Store
from podmeter.runtime.agent import Agent, AgentSettings
from podmeter.runtime.endpoint_publisher import EndpointPublisher
from podmeter.runtime.operator import OperatorSettings

TOKEN = "bench-token"


def pods(count: int) -> list[Pod]:
    return [Pod(uid=f"{i:08x}-2222-4000-8000-{i:012x}", namespace=f"ns-{i % 50}", name=f"web-{i}",
                node_name=f"node-{i % 100}", ips=(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",),
                host_network=False, phase="Running", deleting=False, observe=False,
                labels=("app", f"app-{i % 500}"), resource_version="1", owner_kind="ReplicaSet",
                owner_name=f"app-{i % 500}-5d9f7") for i in range(count)]


def identity_of_factory() -> Any:
    ids: dict[IdentityKey, int] = {}
    label_filter = LabelFilter()

    def identity_of(pod: Pod) -> tuple[int, IdentityKey]:
        key = key_of_flat(pod.namespace, pod.labels, label_filter)
        return ids.setdefault(key, 256 + len(ids)), key

    return identity_of


class MemorySliceApi:
    def __init__(self) -> None:
        self.specs: dict[str, dict[str, Any]] = {}
        self.version = 0

    async def create(self, name: str, spec: dict[str, Any]) -> str:
        self.specs[name] = spec
        self.version += 1
        return str(self.version)

    async def replace(self, name: str, resource_version: str, spec: dict[str, Any]) -> str:
        return await self.create(name, spec)

    async def delete(self, name: str) -> None:
        self.specs.pop(name, None)


def publish_from_nothing(count: int) -> tuple[float, MemorySliceApi]:
    api = MemorySliceApi()
    publisher = EndpointPublisher(api, max_writes=1_000_000)
    publisher.apply(Replace(publisher.actual.collection, []))
    population, identity_of = pods(count), identity_of_factory()
    start = time.perf_counter()
    asyncio.run(publisher.sync(population, identity_of))
    return time.perf_counter() - start, api


def cache_bytes_per_entry(api: MemorySliceApi, count: int) -> float:
    encoded = [msgspec.json.encode({"metadata": {"name": name, "resourceVersion": "1"}, "spec": spec})
               for name, spec in api.specs.items()]

    def build() -> tuple[Store[PodSlice], ClusterEndpoints]:
        store: Store[PodSlice] = Store(POD_SLICES)
        cache = ClusterEndpoints()
        for data in encoded:
            store.apply(Upsert(POD_SLICES, decode_slice(data)), cache.changed)
        return store, cache

    (_, cache), used = traced_bytes(build)
    assert len(cache) == count
    return used / count


# --- propagation through a real API server and operator ------------------------------------------------


def start_apiserver(workdir: Path) -> tuple[subprocess.Popen[bytes], Path, str]:
    kubeconfig = workdir / "kubeconfig"
    proc = subprocess.Popen([sys.executable, "-m", "podmeter", "apiserver", "--listen", "127.0.0.1:0",
                             "--kubeconfig-out", str(kubeconfig), "--token", TOKEN, "--plain-http"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if kubeconfig.exists():
            url: str = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
            try:
                AdminClient(url, TOKEN).stats()
                return proc, kubeconfig, url
            except OSError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the lab API server did not start")


def start_operator(kubeconfig: Path, port: int, workdir: Path) -> subprocess.Popen[bytes]:
    log = (workdir / "operator.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "podmeter", "operator", "--kubeconfig", str(kubeconfig),
                             "--listen", f"127.0.0.1:{port}", "--lease-namespace", "default",
                             "--sweep-period", "30"], stdout=log, stderr=log,  # its default --publish-period
                            env={**os.environ, ALLOW_PLAIN_HTTP: "1"})  # the lab API server: plain HTTP
    # its own answer: a process left by an earlier run on the same port must not pass for it
    wait(lambda: proc.poll() is None and http(f"http://127.0.0.1:{port}/readyz") == "ready\n", "operator ready")
    if proc.poll() is not None:
        raise RuntimeError(f"the operator exited with {proc.returncode}: see {workdir / 'operator.log'}")
    return proc


class Api:
    """Plain requests to the lab API server, with the bench's token."""

    def __init__(self, url: str) -> None:
        self.url = url

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> None:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type})
        with urllib.request.urlopen(req, timeout=10) as response:
            response.read()


def http(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return ""


def wait(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out: {what}")


class StampedAgent:
    """An agent on its own loop whose endpoint cache stamps when each IP first arrives."""

    def __init__(self, kubeconfig: Path, node: str) -> None:
        settings = AgentSettings(node_name=node, reflector=lambda _: ReflectorSettings(watch_timeout=(60.0, 90.0)))
        self.agent = Agent(settings, load_connection(str(kubeconfig), allow_plain_http=True), MemoryDatapath())
        self.arrived: dict[str, float] = {}
        route = self.agent.view._routes[POD_SLICES]  # the bench's probe: stamps each slice change it passes on
        original = route.changed

        def stamped(old: PodSlice | None, new: PodSlice | None) -> None:
            now = time.monotonic()
            for ip in map(unpack_ip, new.ips if new is not None else ()):
                self.arrived.setdefault(ip, now)
            original(old, new)

        self.agent.view._routes[POD_SLICES] = dataclasses.replace(route, changed=stamped)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.agent.start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.agent.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def operator_writes(port: int) -> float:
    total = 0.0
    for line in http(f"http://127.0.0.1:{port}/metrics").splitlines():
        if line.startswith("podmeter_slice_writes_total"):
            total += float(line.split()[-1])
    return total


def propagation(seconds: float, rate: float) -> tuple[list[float], float, int]:
    workdir = Path(tempfile.mkdtemp(prefix="podmeter-bench-cluster-"))
    server, kubeconfig, url = start_apiserver(workdir)
    admin = Api(url)
    port = free_port()
    operator = agents = None
    try:
        admin.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                     "metadata": {"name": "churn"}})
        operator = start_operator(kubeconfig, port, workdir)
        agents = [StampedAgent(kubeconfig, f"node-{n}") for n in range(3)]
        writes_before = operator_writes(port)
        written: dict[str, float] = {}
        live: list[tuple[float, str]] = []
        start, i = time.monotonic(), 0
        while time.monotonic() - start < seconds:
            ip = f"10.9.{i // 250 % 250}.{i % 250 + 1}"
            name = f"p-{i}"
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": f"a{i % 5}"}},
                   "spec": {"nodeName": f"node-{i % 3}", "containers": [{"name": "c", "image": "x"}]}}
            admin.request("POST", "/api/v1/namespaces/churn/pods", pod)
            admin.request("PATCH", f"/api/v1/namespaces/churn/pods/{name}/status",
                          {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}},
                          "application/merge-patch+json")
            written[ip] = time.monotonic()
            live.append((time.monotonic(), name))
            while live and time.monotonic() - live[0][0] > 3.0:
                admin.request("DELETE", f"/api/v1/namespaces/churn/pods/{live.pop(0)[1]}")
            i += 1
            time.sleep(max(0.0, start + i / rate - time.monotonic()))
        time.sleep(3.0)  # let the last ones arrive
        lifecycles = i
        latencies = [(max(a.arrived[ip] for a in agents) - at) * 1000 for ip, at in written.items()
                     if all(ip in a.arrived for a in agents)]
        writes = operator_writes(port) - writes_before
        return latencies, writes, lifecycles
    finally:
        for agent in agents or []:
            agent.stop()
        for proc in (operator, server):
            if proc is not None:
                proc.terminate()
                proc.wait(10)


LAB_SCENARIO = """
name: bench-cluster
seed: 21
datapath: {datapath}
duration: {duration}
settle: 3
sample_interval: 1
nodes:
  - {{name: lab-0, pod_cidr: 10.248.0.0/24, ip_reuse: oldest}}
  - {{name: lab-1, pod_cidr: 10.248.1.0/24, ip_reuse: oldest}}
  - {{name: lab-2, pod_cidr: 10.248.2.0/24, ip_reuse: oldest}}
agent: {{resync_interval: 30}}
operator: {{sweep_period: 30}}
apiserver: {{history: 50000}}
namespaces: [{{name: bench}}]
steps:
  - {{at: 1, do: churn, namespace: bench, rate: {rate}, duration: {seconds}, lifetime: 3, label_sets: 5}}
"""


class _PropagationProbe:
    """Stamps each bench pod's IP when the runner's watch sees it, and when all three agents name it."""

    def __init__(self, lab: Any) -> None:
        self.lab = lab
        self.stop = threading.Event()
        self.seen: dict[str, tuple[str, str, float]] = {}  # uid -> ip, name, when its IP was seen
        self.latencies_ms: list[float] = []
        self.gone_first = 0  # deleted before every agent named it
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._watch, daemon=True), threading.Thread(target=self._poll, daemon=True)]
        for thread in threads:
            thread.start()
        return threads

    def _watch(self) -> None:
        from podmeter.lab.kube import KubeError

        client = self.lab.client
        while not self.stop.is_set():
            try:
                listed = client.list("/api/v1/namespaces/bench/pods")
                for event in client.watch("/api/v1/namespaces/bench/pods", 30,
                                          resourceVersion=listed["metadata"]["resourceVersion"]):
                    if self.stop.is_set():
                        return
                    self._event(event.get("type"), event.get("object") or {})
            except KubeError:
                time.sleep(0.2)

    def _event(self, kind: str | None, pod: dict[str, Any]) -> None:
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        status = pod.get("status") or {}
        with self._lock:
            if kind == "DELETED" or (pod.get("metadata") or {}).get("deletionTimestamp"):
                if self.seen.pop(uid, None) is not None:
                    self.gone_first += 1
            elif status.get("podIP") and status.get("phase") == "Running" and uid not in self.seen \
                    and uid not in self._done:
                self.seen[uid] = (status["podIP"], pod["metadata"]["name"], time.monotonic())

    def _poll(self) -> None:
        from podmeter.lab.endpointcheck import cache_of

        while not self.stop.wait(0.02):
            with self._lock:
                pending = dict(self.seen)
            if not pending:
                continue
            caches = []
            for node in self.lab.nodes:
                text = http_text_or_none(f"{node.url}/debug/endpoints")
                caches.append(cache_of(json.loads(text)) if text else {})
            now = time.monotonic()
            with self._lock:
                for uid, (ip, name, at) in pending.items():
                    if uid in self.seen and all(c.get(ip, ("", "", None))[:2] == ("bench", name) for c in caches):
                        self.latencies_ms.append((now - at) * 1000)
                        del self.seen[uid]
                        self._done.add(uid)


def http_text_or_none(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:  # loopback, the lab's agents
            text: str = response.read().decode()
            return text
    except OSError:
        return None


def lab_propagation(seconds: float, rate: float, datapath: str,
                    publish_period: float | None) -> tuple[list[float], float, int, Any, int, Path]:
    """The churn in a three-node lab: (latencies ms, slice writes, lifecycles, the lab's result, pods
    deleted before every agent named them, the report directory)."""
    from podmeter.lab.cluster import ClusterRun
    from podmeter.lab.run import LabOptions
    from podmeter.lab.scenario import parse_scenario

    scenario = parse_scenario(LAB_SCENARIO.format(datapath=datapath, duration=seconds + 4, rate=rate,
                                                  seconds=seconds), "bench-cluster")
    probe_box: list[_PropagationProbe] = []
    writes: list[float] = []

    class Run(ClusterRun):
        def _operator_argv(self) -> list[str]:
            extra = ["--publish-period", str(publish_period)] if publish_period is not None else []
            return [*super()._operator_argv(), *extra]

        def _timeline(self) -> None:
            probe = _PropagationProbe(self)
            probe_box.append(probe)
            threads = probe.start()
            before = operator_writes(self.operator_port)
            try:
                super()._timeline()
            finally:
                writes.append(operator_writes(self.operator_port) - before)
                probe.stop.set()
                for thread in threads:
                    thread.join(timeout=5)

    out = Path(tempfile.mkdtemp(prefix="podmeter-bench-cluster-lab-"))
    result = Run(scenario, LabOptions(out, progress=False)).run()
    probe = probe_box[0] if probe_box else _PropagationProbe(None)
    return probe.latencies_ms, writes[0] if writes else 0.0, int(result.counts.get("lifecycles", 0)), result, \
        probe.gone_first, out


def main_lab(args: argparse.Namespace) -> None:
    from podmeter.cli.lab import print_summary
    from podmeter.lab.report import write_report

    print(f"three-node lab ({args.datapath}): {args.rate:g} lifecycles/s for {args.seconds:g} s ...")
    latencies, writes, lifecycles, result, gone, out = lab_propagation(args.seconds, args.rate, args.datapath,
                                                                       args.publish_period)
    print_summary(result, write_report(result, out))
    p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 2 else float("nan")
    figures = {
        "mode": f"lab ({args.datapath})",
        "publish_period_s": OperatorSettings().publish_period if args.publish_period is None else args.publish_period,
        "endpoint_propagation_p99_ms": round(p99, 1),
        "endpoint_propagation_p50_ms": round(statistics.median(latencies), 1) if latencies else None,
        "endpoint_propagation_max_ms": round(max(latencies), 1) if latencies else None,
        "endpoint_propagation_samples": len(latencies),
        "deleted_before_named": gone,
        "api_writes_per_pod_lifecycle": round(writes / max(1, lifecycles), 3),
        "lifecycles": lifecycles,
        "lab_passed": result.passed,
    }
    table([("endpoint_propagation_p99_ms", p99, 1000.0, "target <= 1,000 (three-node lab)"),
           ("api_writes_per_pod_lifecycle", figures["api_writes_per_pod_lifecycle"], 1.0, "target <= 1")])
    json_line(figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=20.0, help="pod lifecycles per second")
    parser.add_argument("--pods", type=int, default=100_000)
    parser.add_argument("--lab", action="store_true",
                        help="measure propagation in the three-node lab (agent processes) instead")
    parser.add_argument("--datapath", choices=("memory", "ebpf"), default="memory", help="--lab: the lab's datapath")
    parser.add_argument("--publish-period", type=float,
                        help="--lab: the operator's --publish-period (default: its own, 0.5 s)")
    args = parser.parse_args()
    if args.lab:
        main_lab(args)
        return
    print(f"publishing {args.pods:,} pods from nothing (in-memory slice API) ...")
    seconds, api = publish_from_nothing(args.pods)
    per_entry = cache_bytes_per_entry(api, args.pods)
    print(f"churn: {args.rate:g} lifecycles/s for {args.seconds:g} s, 3 agents, 1 operator ...")
    latencies, writes, lifecycles = propagation(args.seconds, args.rate)
    p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 2 else float("nan")
    figures = {
        "endpoint_propagation_p99_ms": round(p99, 1),
        "endpoint_propagation_p50_ms": round(statistics.median(latencies), 1) if latencies else None,
        "api_writes_per_pod_lifecycle": round(writes / max(1, lifecycles), 3),
        "agent_endpoint_bytes_per_entry": round(per_entry),
        "operator_publish_100k_pods_s": round(seconds, 2),
        "lifecycles": lifecycles,
        "pods_published": args.pods,
    }
    table([("endpoint_propagation_p99_ms", p99, 1000.0, "target <= 1,000"),
           ("api_writes_per_pod_lifecycle", figures["api_writes_per_pod_lifecycle"], 1.0, "target <= 1"),
           ("agent_endpoint_bytes_per_entry", per_entry, 200.0, "target <= 200"),
           ("operator_publish_100k_pods_s", seconds, None, "in-memory slice API")])
    json_line(figures)


if __name__ == "__main__":
    main()
