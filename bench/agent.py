"""Benchmark of the agent's watch layer against the official client and lightkube, on the same stream.

    python -m bench.agent [--events 3000] [--runs 3]

One recorded stream of MODIFIED events of realistic pods (about 7 KiB of JSON each, managedFields
included) is served by ``bench/replay.py`` in a separate process, the same bytes to each contender:
* podmeter: the reflector's watch (httpx stream, line split, msgspec into slim records, deltas queued);
* the official ``kubernetes`` client: ``watch.Watch().stream(list_pod_for_all_namespaces)`` (V1Pod models);
* lightkube: ``Client.watch(Pod)`` (typed lightkube-models).
Each figure is the median of ``--runs`` runs. Also: ``agent_bytes_per_pod`` (tracemalloc, the store with
10,000 pods) and ``agent_idle_rss_mib`` (a real ``podmeter agent --datapath memory`` process, idle,
against the lab API server). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec

from bench.core import bytes_per_pod
from bench.measure import json_line, median_of, table
from podmeter.lab.podgen import realistic_pod


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def record_stream(events: int) -> bytes:
    lines = []
    for i in range(events):
        pod = realistic_pod(i, ip=f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}")
        pod["metadata"]["resourceVersion"] = str(100 + i)
        lines.append(msgspec.json.encode({"type": "MODIFIED", "object": pod}))
    return b"\n".join(lines) + b"\n"


def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answered (401 without a token counts)
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


def podmeter_rate(base: str, events: int) -> float:
    """The reflector's watch path exactly as the agent runs it, deltas into an asyncio queue."""
    from lightkube.config.kubeconfig import KubeConfig
    from lightkube.config.models import Cluster, User

    from podmeter.adapters.kube.reflector import Reflector
    from podmeter.adapters.kube.resources import PODS
    from podmeter.adapters.kube.transport import make_transport

    config = KubeConfig.from_one(cluster=Cluster(server=base), user=User(token="bench")).get()
    assert config is not None

    async def run() -> float:
        received = 0

        async def sink(delta: object) -> None:
            nonlocal received
            received += 1

        transport = make_transport(config)
        try:
            reflector = Reflector(PODS, transport, sink)
            reflector.resource_version = "1"
            start = time.perf_counter()
            await reflector.watch_once()
            elapsed = time.perf_counter() - start
        finally:
            await transport.close()
        assert received == events, (received, events)
        return events / elapsed

    return asyncio.run(run())


def official_rate(base: str, events: int) -> float:
    from kubernetes import client, watch

    configuration = client.Configuration()
    configuration.host = base
    api = client.CoreV1Api(client.ApiClient(configuration))
    start = time.perf_counter()
    received = 0
    for _event in watch.Watch().stream(api.list_pod_for_all_namespaces, resource_version="1", timeout_seconds=600):
        received += 1
    elapsed = time.perf_counter() - start
    assert received == events, (received, events)
    return events / elapsed


def lightkube_rate(base: str, events: int) -> float:
    import lightkube
    from lightkube.config.kubeconfig import KubeConfig
    from lightkube.config.models import Cluster, User
    from lightkube.resources.core_v1 import Pod

    config = KubeConfig.from_one(cluster=Cluster(server=base), user=User(token="bench"))
    kube = lightkube.Client(config, field_manager="bench")
    start = time.perf_counter()
    received = 0
    try:
        for _kind, _pod in kube.watch(Pod, namespace=lightkube.ALL_NS, resource_version="1"):
            received += 1
            if received == events:
                break  # lightkube re-watches forever on EOF: stop at the end of the recording
    finally:
        close = getattr(kube, "close", None)
        if close is not None:
            close()
    elapsed = time.perf_counter() - start
    assert received == events, (received, events)
    return events / elapsed


def agent_idle_rss_mib() -> float:
    """RSS of a real idle agent process (memory datapath) connected to an empty lab API server."""
    with tempfile.TemporaryDirectory() as tmp:
        kubeconfig = Path(tmp) / "kubeconfig"
        api_port, agent_port = free_port(), free_port()
        server = subprocess.Popen([sys.executable, "-m", "podmeter", "apiserver", "--listen",
                                   f"127.0.0.1:{api_port}", "--kubeconfig-out", str(kubeconfig), "--plain-http"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        agent = None
        try:
            wait_http(f"http://127.0.0.1:{api_port}/readyz")
            agent = subprocess.Popen([sys.executable, "-m", "podmeter", "agent", "--datapath", "memory",
                                      "--node-name", "node-a", "--kubeconfig", str(kubeconfig),
                                      "--listen", f"127.0.0.1:{agent_port}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PODMETER_ALLOW_PLAIN_HTTP_CREDENTIALS": "1"})  # test server
            wait_http(f"http://127.0.0.1:{agent_port}/readyz")
            time.sleep(3)
            return _rss_of(agent.pid)
        finally:
            for proc in (agent, server):
                if proc is not None:
                    proc.terminate()
                    proc.wait(10)


def _rss_of(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    stream = record_stream(args.events)
    print(f"recorded {args.events:,} events, {len(stream) / args.events / 1024:.1f} KiB each")
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as recording:
        recording.write(stream)
        recording.flush()
        port = free_port()
        replay = subprocess.Popen([sys.executable, "-m", "bench.replay", recording.name, str(port)],
                                  cwd=Path(__file__).resolve().parent.parent, env={**os.environ})
        try:
            base = f"http://127.0.0.1:{port}"
            wait_http(base + "/api/v1/pods")
            ours = median_of(args.runs, lambda: podmeter_rate(base, args.events))
            official = median_of(args.runs, lambda: official_rate(base, args.events))
            light = median_of(args.runs, lambda: lightkube_rate(base, args.events))
        finally:
            replay.terminate()
            replay.wait(10)
    per_pod = bytes_per_pod(10_000)
    idle = agent_idle_rss_mib()
    table([
        ("ingest_events_per_s (podmeter)", ours, None, "reflector + msgspec slim records"),
        ("official client Watch events/s", official, None, "kubernetes V1Pod models"),
        ("lightkube typed watch events/s", light, None, "lightkube-models Pod"),
        ("ratio_vs_official_client", ours / official, 10.0, "target >= 10 (ratio >= 1 meets it)"),
        ("ratio_vs_lightkube", ours / light, 2.0, "target >= 2 (ratio >= 1 meets it)"),
        ("agent_bytes_per_pod", per_pod, 1024.0, "store with 10,000 pods; target <= 1024 (ratio <= 1)"),
        ("agent_idle_rss_mib", idle, None, "idle agent process, memory datapath"),
    ])
    json_line({
        "ingest_events_per_s": round(ours),
        "ratio_vs_official_client": round(ours / official, 1),
        "ratio_vs_lightkube": round(ours / light, 1),
        "agent_bytes_per_pod": round(per_pod),
        "agent_idle_rss_mib": round(idle, 1),
    })


if __name__ == "__main__":
    main()
