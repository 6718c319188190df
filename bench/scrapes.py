"""Remote scrapers versus the datapath writes: what ``/metrics`` on the node costs the agent's writer.

Run: ``.venv/bin/python -m bench.scrapes [--pods 2000] [--samples 60] [--scrapers 8] [--datapath ebpf]``

A real lab API server (a process) and an agent in this process (its own event loop and thread, as the
agent command runs it: the writer task and the HTTP endpoints share the loop) with ``--pods`` observed pods,
so a scrape renders about four samples per pod. Then ``--samples`` pods are created one by one (create,
then the status write that gives the IP) and the time from sending the status write to the IP's insert
into the datapath is taken, three times in the same run:

* ``pod_add_to_filter_p50_ms_idle``: nobody scrapes (the reference);
* ``pod_add_to_filter_p50_ms_scrapers_uncached``: ``--scrapers`` threads scrape in a loop, every scrape
  rendered (``--metrics-min-interval 0``, how the agent behaved before);
* ``pod_add_to_filter_p50_ms_scrapers``: the same scrapers with the default ``--metrics-min-interval 1``.
p99 figures beside each; ratios against idle (``*_ratio``). The last line is one JSON object.

``--datapath ebpf`` (root) runs the same on the real eBPF datapath (pins in a directory of their own under
/sys/fs/bpf, removed at the end): the time is taken when the batch insert into the kernel's ``filter`` map has
returned, so the IP is in the kernel map, and each base pod carries kernel counters in both directions, so
every rendered scrape reads two entries per pod from the per-CPU ``counters`` map, as on a busy node. The
agent drains the kernel's flows on its timer as ``podmeter agent`` does. The figures are then named
``pod_add_to_kernel_filter_*``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from bench.cluster import Api, start_apiserver, wait
from bench.measure import json_line, table
from podmeter.adapters.datapath.ebpf import EbpfDatapath, layout
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.http import build_app, serve
from podmeter.adapters.kube.connection import load_connection
from podmeter.adapters.metrics.agent_state import AgentStateCollector
from podmeter.adapters.metrics.pod_traffic import PodTrafficExposition
from podmeter.model.datapath import BatchResult, Datapath, Direction
from podmeter.runtime.agent import Agent, AgentSettings


class Stamped:
    """A datapath whose inserts are stamped: when each IP's batch insert returned (for the eBPF datapath,
    when the kernel's filter map held it). Everything else is the datapath's own."""

    def __init__(self, datapath: MemoryDatapath | EbpfDatapath) -> None:
        self.datapath = datapath
        self.inserted: dict[str, float] = {}
        inner: Callable[[Sequence[str]], BatchResult] = datapath.insert

        def insert(ips: Sequence[str]) -> BatchResult:
            result = inner(ips)
            now = time.monotonic()
            for ip in ips[: result.applied]:
                self.inserted.setdefault(ip, now)
            return result

        datapath.insert = insert  # type: ignore[method-assign]  # the agent calls the datapath itself


@contextlib.contextmanager
def opened(kind: str, capacity: int) -> Iterator[Stamped]:
    """The stamped datapath of ``kind``; an eBPF one on pins of its own, removed afterwards."""
    if kind == "memory":
        yield Stamped(MemoryDatapath(65536))
        return
    if os.geteuid() != 0:
        sys.exit("bench.scrapes --datapath ebpf needs root (bpf maps and programs)")
    pins = Path("/sys/fs/bpf") / f"podmeter-bench-scrapes-{os.getpid()}"
    datapath = EbpfDatapath.open(pins, filter_size=capacity)
    try:
        yield Stamped(datapath)
    finally:
        datapath.close()
        shutil.rmtree(pins, ignore_errors=True)


def give_traffic(datapath: EbpfDatapath, ips: Sequence[str]) -> None:
    """Kernel counters for ``ips`` in both directions, spread over the CPUs (as the programs would count)."""
    cpus = datapath.counters_map.value_bytes // layout.COUNTER_STRIDE
    keys = [layout.counter_key(ip, direction) for ip in ips for direction in Direction]
    values = [b"".join(layout.COUNTER_VALUE.pack(n + cpu, 1000 * (n + cpu)) for cpu in range(cpus))
              for n in range(len(keys))]
    result = datapath.counters_map.update_batch(keys, values)
    if result.error is not None:
        raise RuntimeError(f"writing the base pods' counters failed: {result.error}")


def pod(name: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name[:3]}},
            "spec": {"nodeName": "node-a", "containers": [{"name": "c", "image": "x"}]}}


def add_pod(api: Api, name: str, ip: str) -> float:
    """Create the pod, then give it its IP; returns when the status write was sent. (Its answer can come
    after the agent's insert: the watch event and the answer race, and an idle agent often wins.)"""
    api.request("POST", "/api/v1/namespaces/shop/pods", pod(name))
    sent = time.monotonic()
    api.request("PATCH", f"/api/v1/namespaces/shop/pods/{name}/status",
                {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}, "application/merge-patch+json")
    return sent


def ip_of(i: int) -> str:
    return f"10.{20 + (i >> 16 & 255)}.{i >> 8 & 255}.{i & 255}"


class Scrapers:
    def __init__(self, url: str, count: int) -> None:
        self.url, self.stop, self.scrapes = url, threading.Event(), 0
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=10) as response:
                    response.read()
                self.scrapes += 1
            except OSError:
                time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(15)


def measure(api: Api, datapath: Stamped, start: int, samples: int) -> list[float]:
    latencies = []
    for i in range(start, start + samples):
        ip = ip_of(i)
        written = add_pod(api, f"new-{i}", ip)
        wait(lambda ip=ip: ip in datapath.inserted, f"{ip} inserted", timeout=20)
        latencies.append((datapath.inserted[ip] - written) * 1000)
        time.sleep(0.02)
    return latencies


def serve_metrics(agent: Agent, datapath: Datapath, loop: asyncio.AbstractEventLoop) -> dict[float, int]:
    """The agent's /metrics on two ports: every scrape rendered (interval 0), and the default render cache."""
    ports: dict[float, int] = {}
    for interval in (0.0, 1.0):
        registry = CollectorRegistry()
        registry.register(AgentStateCollector(agent.snapshot))
        traffic = PodTrafficExposition(agent.ledger, datapath.read_counters)
        app = build_app(registry, agent.ready.is_set, {}, expositions=[traffic.render],
                        metrics_min_interval=interval)
        _, ports[interval] = asyncio.run_coroutine_threadsafe(serve(app, "127.0.0.1:0"), loop).result(30)
    return ports


def run_cases(api: Api, agent: Agent, stamped: Stamped, args: argparse.Namespace,
              loop: asyncio.AbstractEventLoop) -> tuple[dict[str, list[float]], dict[str, int]]:
    print(f"creating {args.pods} observed pods ...")
    for i in range(args.pods):
        add_pod(api, f"base-{i}", ip_of(100_000 + i))
    ports = serve_metrics(agent, stamped.datapath, loop)
    asyncio.run_coroutine_threadsafe(agent.start(), loop).result(30)
    wait(lambda: len(stamped.inserted) >= args.pods, "the base pods in the filter", timeout=120)
    if isinstance(stamped.datapath, EbpfDatapath):
        give_traffic(stamped.datapath, [ip_of(100_000 + i) for i in range(args.pods)])
    results: dict[str, list[float]] = {"idle": measure(api, stamped, 0, args.samples)}
    scrape_counts = {}
    for name, interval in (("scrapers_uncached", 0.0), ("scrapers", 1.0)):
        scrapers = Scrapers(f"http://127.0.0.1:{ports[interval]}/metrics", args.scrapers)
        time.sleep(1.0)
        offset = len(results) * args.samples
        results[name] = measure(api, stamped, offset, args.samples)
        scrapers.close()
        scrape_counts[name] = scrapers.scrapes
    measured = {ip_of(i) for i in range(3 * args.samples)}
    held = asyncio.run_coroutine_threadsafe(asyncio.to_thread(stamped.datapath.contents), loop).result(30)
    if not measured <= held:  # each sample's IP must really be in the (kernel's) filter
        raise RuntimeError(f"{len(measured - held)} measured IPs are not in the filter")
    asyncio.run_coroutine_threadsafe(agent.stop(), loop).result(30)
    return results, scrape_counts


def figures_of(results: dict[str, list[float]], prefix: str) -> dict[str, float]:
    figures: dict[str, float] = {}
    for name, latencies in results.items():
        figures[f"{prefix}_p50_ms_{name}"] = round(statistics.median(latencies), 1)
        figures[f"{prefix}_p99_ms_{name}"] = round(statistics.quantiles(latencies, n=100)[98], 1)
    for name in results:
        if name != "idle":
            for q in ("p50", "p99"):
                figures[f"{prefix}_{q}_ratio_{name}"] = round(
                    figures[f"{prefix}_{q}_ms_{name}"] / max(figures[f"{prefix}_{q}_ms_idle"], 0.1), 2)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--scrapers", type=int, default=8)
    parser.add_argument("--datapath", choices=("memory", "ebpf"), default="memory",
                        help="where the filter lives: in memory, or the kernel's eBPF maps (root)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="podmeter-bench-scrapes-"))
    server, kubeconfig, url = start_apiserver(workdir)
    api = Api(url)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        api.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": "shop", "annotations": {"podmeter.io/observe": "true"}}})
        with opened(args.datapath, args.pods + 3 * args.samples + 64) as stamped:
            flows = stamped.datapath if isinstance(stamped.datapath, EbpfDatapath) else None
            agent = Agent(AgentSettings(node_name="node-a"),
                          load_connection(str(kubeconfig), allow_plain_http=True), stamped.datapath, flows)
            results, scrape_counts = run_cases(api, agent, stamped, args, loop)
    finally:
        server.terminate()
        server.wait(10)
    prefix = "pod_add_to_filter" if args.datapath == "memory" else "pod_add_to_kernel_filter"
    figures = figures_of(results, prefix)
    idle = figures[f"{prefix}_p50_ms_idle"]
    table([(f"{prefix}_p50_ms_{name}", figures[f"{prefix}_p50_ms_{name}"], idle,
            f"{args.scrapers} scrapers, {scrape_counts.get(name, 0)} scrapes" if name != "idle" else "reference")
           for name in results])
    json_line(figures | {"scrapers": args.scrapers, "pods": args.pods, "datapath": args.datapath,
                         "scrapes_uncached": scrape_counts["scrapers_uncached"],
                         "scrapes_cached": scrape_counts["scrapers"]})


if __name__ == "__main__":
    main()
