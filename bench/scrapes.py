"""Remote scrapers versus the datapath writes: what ``/metrics`` on the node costs the agent's writer.

Run: ``.venv/bin/python -m bench.scrapes [--pods 2000] [--samples 60] [--scrapers 8]``

A real lab API server (a process) and an agent in this process (its own event loop and thread, as the
agent command runs it: the writer task and the HTTP endpoints share the loop) with ``--pods`` observed pods,
so a scrape renders about four samples per pod. Then ``--samples`` pods are created one by one (create,
then the status write that gives the IP) and the time from the status write's answer to the IP's insert
into the datapath is taken, three times in the same run:

* ``pod_add_to_filter_p50_ms_idle``: nobody scrapes (the reference);
* ``pod_add_to_filter_p50_ms_scrapers_uncached``: ``--scrapers`` threads scrape in a loop, every scrape
  rendered (``--metrics-min-interval 0``, how the agent behaved before);
* ``pod_add_to_filter_p50_ms_scrapers``: the same scrapers with the default ``--metrics-min-interval 1``.
p99 figures beside each; ratios against idle. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from bench.cluster import Api, start_apiserver, wait
from bench.measure import json_line, table
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.http import build_app, serve
from podmeter.adapters.kube.connection import load_connection
from podmeter.adapters.metrics.agent_state import AgentStateCollector
from podmeter.adapters.metrics.pod_traffic import PodTrafficExposition
from podmeter.model.datapath import BatchResult
from podmeter.runtime.agent import Agent, AgentSettings


class StampedDatapath(MemoryDatapath):
    """The in-memory datapath, stamping when each IP was inserted."""

    def __init__(self) -> None:
        super().__init__(65536)
        self.inserted: dict[str, float] = {}

    def insert(self, ips: Sequence[str]) -> BatchResult:
        result = super().insert(ips)
        now = time.monotonic()
        for ip in ips[: result.applied]:
            self.inserted.setdefault(ip, now)
        return result


def pod(name: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name[:3]}},
            "spec": {"nodeName": "node-a", "containers": [{"name": "c", "image": "x"}]}}


def add_pod(api: Api, name: str, ip: str) -> float:
    api.request("POST", "/api/v1/namespaces/shop/pods", pod(name))
    api.request("PATCH", f"/api/v1/namespaces/shop/pods/{name}/status",
                {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}, "application/merge-patch+json")
    return time.monotonic()


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


def measure(api: Api, datapath: StampedDatapath, start: int, samples: int) -> list[float]:
    latencies = []
    for i in range(start, start + samples):
        ip = ip_of(i)
        written = add_pod(api, f"new-{i}", ip)
        wait(lambda ip=ip: ip in datapath.inserted, f"{ip} inserted", timeout=20)  # type: ignore[misc]
        latencies.append((datapath.inserted[ip] - written) * 1000)
        time.sleep(0.02)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--scrapers", type=int, default=8)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="podmeter-bench-scrapes-"))
    server, kubeconfig, url = start_apiserver(workdir)
    api = Api(url)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        api.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": "shop", "annotations": {"podmeter.io/observe": "true"}}})
        datapath = StampedDatapath()
        agent = Agent(AgentSettings(node_name="node-a"), load_connection(str(kubeconfig), allow_plain_http=True),
                      datapath)
        print(f"creating {args.pods} observed pods ...")
        for i in range(args.pods):
            add_pod(api, f"base-{i}", ip_of(100_000 + i))
        ports: dict[float, int] = {}
        for interval in (0.0, 1.0):
            registry = CollectorRegistry()
            registry.register(AgentStateCollector(agent.snapshot))
            traffic = PodTrafficExposition(agent.ledger, datapath.read_counters)
            app = build_app(registry, agent.ready.is_set, {}, expositions=[traffic.render],
                            metrics_min_interval=interval)
            _, ports[interval] = asyncio.run_coroutine_threadsafe(serve(app, "127.0.0.1:0"), loop).result(30)
        asyncio.run_coroutine_threadsafe(agent.start(), loop).result(30)
        wait(lambda: len(datapath.inserted) >= args.pods, "the base pods in the filter", timeout=120)
        results: dict[str, list[float]] = {"idle": measure(api, datapath, 0, args.samples)}
        scrape_counts = {}
        for name, interval in (("scrapers_uncached", 0.0), ("scrapers", 1.0)):
            scrapers = Scrapers(f"http://127.0.0.1:{ports[interval]}/metrics", args.scrapers)
            time.sleep(1.0)
            offset = len(results) * args.samples
            results[name] = measure(api, datapath, offset, args.samples)
            scrapers.close()
            scrape_counts[name] = scrapers.scrapes
        asyncio.run_coroutine_threadsafe(agent.stop(), loop).result(30)
    finally:
        server.terminate()
        server.wait(10)
    figures: dict[str, float] = {}
    for name, latencies in results.items():
        figures[f"pod_add_to_filter_p50_ms_{name}"] = round(statistics.median(latencies), 1)
        figures[f"pod_add_to_filter_p99_ms_{name}"] = round(statistics.quantiles(latencies, n=100)[98], 1)
    idle = figures["pod_add_to_filter_p50_ms_idle"]
    table([(f"pod_add_to_filter_p50_ms_{name}", figures[f"pod_add_to_filter_p50_ms_{name}"], idle,
            f"{args.scrapers} scrapers, {scrape_counts.get(name, 0)} scrapes" if name != "idle" else "reference")
           for name in results])
    json_line(figures | {"scrapers": args.scrapers, "pods": args.pods})


if __name__ == "__main__":
    main()
