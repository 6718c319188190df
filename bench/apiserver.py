"""Lab API server figures: one unchunked list of 10,000 realistic pods, and watch fan-out to 50 watchers.

    .venv/bin/python -m bench.apiserver                 # ~30 s
    .venv/bin/python -m bench.apiserver --pods 2000 --events 200

The server runs as a real ``podmeter apiserver`` subprocess (its own process, as in the lab); pods are
``podmeter.lab.podgen.realistic_pod`` (~7 KiB of JSON each), loaded through the test-only bulk inject.
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.measure import json_line, table, timed_ms, traced_bytes
from podmeter.lab.apiserver.client import AdminClient
from podmeter.lab.apiserver.resources import PODS
from podmeter.lab.apiserver.store import Store
from podmeter.lab.podgen import realistic_pod

SOAK_HISTORY = 2000
TOKEN = "bench"


def start_server(workdir: Path, history: int) -> tuple[subprocess.Popen[bytes], str]:
    workdir.mkdir(parents=True, exist_ok=True)
    kubeconfig = workdir / "kubeconfig"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "podmeter",
            "apiserver",
            "--listen",
            "127.0.0.1:0",
            "--kubeconfig-out",
            str(kubeconfig),
            "--token",
            TOKEN,
            "--history",
            str(history),
            "--plain-http",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if kubeconfig.exists():
            url: str = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
            try:
                AdminClient(url, TOKEN).stats()
                return proc, url
            except OSError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("apiserver did not start")


def load_pods(admin: AdminClient, count: int) -> list[dict[str, Any]]:
    pods = [realistic_pod(i, node=f"node-{i % 20}") for i in range(count)]
    for start in range(0, count, 250):
        admin.inject_many("pods", pods[start : start + 250])
    return pods


async def list_ms(url: str, runs: int) -> tuple[float, int]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    times, size = [], 0
    async with aiohttp.ClientSession(headers=headers) as session:
        for _ in range(runs):
            start = time.perf_counter()
            async with session.get(f"{url}/api/v1/pods") as resp:
                body = await resp.read()
            times.append((time.perf_counter() - start) * 1000)
            size = len(body)
    return statistics.median(times), size


async def fanout(url: str, watchers: int, events: int, pod_names: list[tuple[str, str]]) -> tuple[float, float]:
    """(delivered events/s across all watchers, writer-alone writes/s)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    connector = aiohttp.TCPConnector(limit=watchers + 4)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        writes_alone = await _write(session, url, events, pod_names, offset=0)
        async with session.get(f"{url}/api/v1/pods?limit=1") as resp:
            rv = (await resp.json())["metadata"]["resourceVersion"]
        counts = [0] * watchers
        done = asyncio.Event()

        async def watch(i: int) -> None:
            path = f"{url}/api/v1/pods?watch=1&resourceVersion={rv}&timeoutSeconds=300"
            async with session.get(path, timeout=aiohttp.ClientTimeout(total=None)) as resp:
                async for chunk in resp.content.iter_any():
                    counts[i] += chunk.count(b"\n")
                    if all(c >= events for c in counts):
                        done.set()
                    if counts[i] >= events:
                        return

        tasks = [asyncio.create_task(watch(i)) for i in range(watchers)]
        await asyncio.sleep(0.5)  # all watches open
        start = time.perf_counter()
        await _write(session, url, events, pod_names, offset=events)
        await asyncio.wait_for(done.wait(), timeout=300)
        elapsed = time.perf_counter() - start
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return watchers * events / elapsed, writes_alone


async def _write(
    session: aiohttp.ClientSession, url: str, events: int, pod_names: list[tuple[str, str]], offset: int
) -> float:
    """``events`` status patches (one writer, sequential); returns writes/s."""
    start = time.perf_counter()
    for i in range(events):
        ns, name = pod_names[i % len(pod_names)]
        body = json.dumps({"status": {"message": f"write {offset + i}"}})
        async with session.patch(
            f"{url}/api/v1/namespaces/{ns}/pods/{name}/status",
            data=body,
            headers={"Content-Type": "application/merge-patch+json"},
        ) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"patch failed: {resp.status}")
    return events / (time.perf_counter() - start)


def server_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def soak(url: str, pid: int, cycles: int) -> tuple[float, float]:
    """Create and delete ``cycles`` realistic pods (one watcher open); server RSS after a warm-up round of
    the same size and at the end. Live objects stay ~0, so only the history window may hold memory."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as session:
        watch = asyncio.create_task(_drain(session, f"{url}/api/v1/namespaces/soak/pods?watch=1&timeoutSeconds=600"))
        await session.post(f"{url}/api/v1/namespaces", data=json.dumps({"metadata": {"name": "soak"}}))
        baseline = 0.0
        # The warm-up round fills the history window (2 events per cycle) before the baseline is taken.
        for round_, count in enumerate((max(cycles, SOAK_HISTORY // 2 + 100), cycles)):
            for i in range(count):
                pod = realistic_pod(round_ * 1_000_000 + i, namespace="soak")
                async with session.post(f"{url}/api/v1/namespaces/soak/pods", data=json.dumps(pod)) as resp:
                    await resp.read()
                async with session.delete(f"{url}/api/v1/namespaces/soak/pods/{pod['metadata']['name']}") as resp:
                    await resp.read()
            if round_ == 0:
                baseline = server_rss_mib(pid)
        watch.cancel()
    return baseline, server_rss_mib(pid)


async def _drain(session: aiohttp.ClientSession, url: str) -> None:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=None)) as resp:
        async for _ in resp.content.iter_any():
            pass


def store_kib_per_pod(count: int = 2000) -> tuple[float, float]:
    """Memory per stored pod in the lab server's store (JSON bytes + labels + selectable fields), and the
    reference: the same pods kept as decoded dicts (what a store of ``json.loads`` objects would hold)."""
    pods = [realistic_pod(i) for i in range(count)]

    def stored() -> Store:
        store = Store(history=1)
        for pod in pods:
            store.commit(PODS, "ADDED", pod)
        return store

    _, held = traced_bytes(stored)
    _, as_dicts = traced_bytes(lambda: [json.loads(json.dumps(p)) for p in pods])
    return held / count / 1024, as_dicts / count / 1024


def naive_encode_ms(pods: list[dict[str, Any]]) -> float:
    """Reference: what a straightforward server spends encoding the same list with the json module."""
    items = [{k: v for k, v in p.items() if k not in ("kind", "apiVersion")} for p in pods]
    return timed_ms(
        lambda: json.dumps(
            {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items}
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pods", type=int, default=10_000)
    parser.add_argument("--watchers", type=int, default=50)
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--soak", type=int, default=3000, help="create+delete cycles per soak round")
    args = parser.parse_args()
    kib_per_pod, kib_per_dict = store_kib_per_pod()
    with tempfile.TemporaryDirectory(prefix="bench-apiserver-") as tmp:
        proc, url = start_server(Path(tmp), history=max(10_000, 2 * args.events))
        soak_proc, soak_url = start_server(Path(tmp) / "soak", history=SOAK_HISTORY)
        try:
            admin = AdminClient(url, TOKEN)
            pods = load_pods(admin, args.pods)
            stats = admin.stats()
            listed_ms, size = asyncio.run(list_ms(url, args.runs))
            reference_ms = statistics.median(naive_encode_ms(pods) for _ in range(3))
            names = [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods]
            events_per_s, writes_per_s = asyncio.run(fanout(url, args.watchers, args.events, names))
            rss_warm, rss_end = asyncio.run(soak(soak_url, soak_proc.pid, args.soak))
        finally:
            for p in (proc, soak_proc):
                p.terminate()
                p.wait(10)
    table(
        [
            (
                f"list_{args.pods // 1000}k_pods_ms",
                listed_ms,
                reference_ms,
                f"{size / 2**20:.1f} MiB; reference: json.dumps of the same list",
            ),
            (
                "watch_fanout_events_per_s",
                events_per_s,
                writes_per_s * args.watchers,
                f"{args.watchers} watchers x {args.events} events; reference: writer alone x watchers",
            ),
            ("writer_alone_writes_per_s", writes_per_s, None, "status patches, one client, sequential"),
            ("server_object_mib", stats["objectBytes"] / 2**20, None, f"{args.pods} pods as stored JSON"),
            ("store_kib_per_pod", kib_per_pod, kib_per_dict, "tracemalloc; reference: the same pods as dicts"),
            (
                "soak_rss_growth_mib",
                rss_end - rss_warm,
                None,
                f"server RSS {rss_warm:.1f} -> {rss_end:.1f} MiB, 2nd round of {args.soak} create+delete",
            ),
        ]
    )
    json_line(
        {
            f"list_{args.pods // 1000}k_pods_ms": round(listed_ms, 1),
            "list_bytes": size,
            "list_reference_json_dumps_ms": round(reference_ms, 1),
            "watch_fanout_events_per_s": round(events_per_s),
            "watch_fanout_watchers": args.watchers,
            "writer_alone_writes_per_s": round(writes_per_s),
            "soak_rss_growth_mib": round(rss_end - rss_warm, 2),
            "store_kib_per_pod": round(kib_per_pod, 1),
            "store_kib_per_pod_as_dicts": round(kib_per_dict, 1),
        }
    )


if __name__ == "__main__":
    main()
