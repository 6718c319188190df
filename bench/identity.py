"""Identity benchmark: allocation rate (memory, etcd) and memory under Job-pod churn.

Run: ``.venv/bin/python -m bench.identity [--pods 100000] [--live 1000] [--etcd-keys 2000]``

Prints a table, then one JSON line with ``identity_allocs_per_s`` (memory and etcd),
``rss_growth_mib_100k_job_pods`` and ``rss_after_delete_all_vs_baseline_mib``. The churn runs the
operator's real reconciler (label filter, per-UID references, dirty keys, sweep) on the memory backend,
side by side with a reference that behaves like the allocators of failure modes F12 and F13 in
docs/design.md (identity per unfiltered label set,
released only by delete events, 1% of deletes lost).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from podmeter.adapters.identity.etcd import EtcdIdentityBackend
from podmeter.adapters.identity.memory import MemoryIdentityBackend
from podmeter.model.deltas import PODS, Delete, Delta, Upsert
from podmeter.model.identity import IdentityKey, LabelFilter, make_key
from podmeter.model.records import Pod
from podmeter.model.store import Store
from podmeter.runtime.operator import IdentityReconciler

APPS = ("report", "backup", "etl", "sync", "index")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def job_pod(i: int) -> Pod:
    app = APPS[i % len(APPS)]
    labels = {"app": app, "job-name": f"{app}-{i}", "controller-uid": f"{i:08x}-0000-4000-8000-{i:012x}",
              "batch.kubernetes.io/job-name": f"{app}-{i}",
              "batch.kubernetes.io/controller-uid": f"{i:08x}-0000-4000-8000-{i:012x}"}
    flat = tuple(x for k in sorted(labels) for x in (k, labels[k]))
    return Pod(uid=f"{i:08x}-1111-4000-8000-{i:012x}", namespace="batch", name=f"{app}-{i}-x7k2p",
               node_name="n1", ips=(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",), host_network=False,
               phase="Running", deleting=False, observe=False, labels=flat, resource_version=str(i))


async def churn(pods: int, live: int) -> dict[str, float]:
    """The operator's path on Job pods (deltas -> pod store -> reconciler -> memory backend): RSS after
    warm-up, at the end of churn, after delete-all."""
    backend = MemoryIdentityBackend()
    rec = IdentityReconciler(backend, LabelFilter())
    store: Store[Pod] = Store(PODS)

    def apply(delta: Delta[Pod]) -> None:
        for change in store.changes(delta):
            rec.observe(*change)

    await warm_up(rec, store, live)
    gc.collect()
    baseline = rss_mib()
    warm = held_at_end = 0.0
    for i in range(pods):
        apply(Upsert(PODS, job_pod(i)))
        if i >= live:
            apply(Delete(PODS, job_pod(i - live).uid))
        await rec.flush()
        if i % 10_000 == 9_999:
            await rec.sweep(store.objects.values())
        if i == min(pods - 1, 10 * live):
            gc.collect()
            warm = rss_mib()
    gc.collect()
    end, held_at_end = rss_mib(), len(backend.held())
    for uid in list(store.objects):
        apply(Delete(PODS, uid))
    await rec.flush()
    await rec.sweep(store.objects.values())
    gc.collect()
    return {"baseline": baseline, "warm": warm, "end": end, "after_delete": rss_mib(),
            "identities_end": held_at_end, "identities_after_delete": len(backend.held()),
            "gc_released": rec.stats.gc_released}


async def warm_up(rec: IdentityReconciler, store: Store[Pod], live: int) -> None:
    """One round of ``live`` pods created and deleted, so one-time allocations precede the baseline."""
    pods = [job_pod(-1 - i) for i in range(live)]
    deltas: list[Delta[Pod]] = [*(Upsert(PODS, p) for p in pods), *(Delete(PODS, p.uid) for p in pods)]
    for delta in deltas:
        for change in store.changes(delta):
            rec.observe(*change)
        await rec.flush()
    await rec.sweep(())


def reference_churn(pods: int, live: int) -> dict[str, float]:
    """The failing allocators (F12, F13): identity per unfiltered label set, released on delete events, 1% lost."""
    no_filter = LabelFilter(frozenset())
    ids: dict[IdentityKey, int] = {}
    refs: dict[IdentityKey, int] = {}
    gc.collect()
    baseline = rss_mib()
    for i in range(pods):
        p = job_pod(i)
        k = make_key(p.namespace, zip(p.labels[::2], p.labels[1::2], strict=True), no_filter)
        refs[k] = refs.get(k, 0) + 1
        ids.setdefault(k, len(ids) + 256)
        if i >= live and (i - live) % 100 != 0:  # 1% of the deletes never arrive
            old = job_pod(i - live)
            ko = make_key(old.namespace, zip(old.labels[::2], old.labels[1::2], strict=True), no_filter)
            refs[ko] -= 1
            if refs[ko] == 0:
                del refs[ko]
                ids.pop(ko, None)
    gc.collect()
    return {"baseline": baseline, "end": rss_mib(), "identities_end": len(ids)}


async def alloc_rate_memory(n: int) -> float:
    backend = MemoryIdentityBackend()
    keys = [IdentityKey("ns", ("app", str(i))) for i in range(n)]
    t0 = time.perf_counter()
    for k in keys:
        await backend.acquire(k)
    return n / (time.perf_counter() - t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def etcd_server(workdir: Path) -> Iterator[str]:
    etcd = shutil.which("etcd") or "/usr/bin/etcd"
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [etcd, "--name=bench", f"--data-dir={workdir}", f"--listen-client-urls={client}",
         f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}",
         f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=bench={peer}", "--log-level=error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                time.sleep(0.1)
        yield client
    finally:
        proc.terminate()
        proc.wait()


async def alloc_rate_etcd(n: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        for endpoint in etcd_server(Path(tmp)):
            backend = EtcdIdentityBackend([endpoint])
            await backend.start()
            keys = [IdentityKey("ns", ("app", str(i))) for i in range(n)]
            t0 = time.perf_counter()
            for k in keys:
                await backend.acquire(k)
            rate = n / (time.perf_counter() - t0)
            await backend.close()
            return rate
    raise RuntimeError("etcd did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--pods", type=int, default=100_000)
    parser.add_argument("--live", type=int, default=1_000)
    parser.add_argument("--memory-keys", type=int, default=50_000)
    parser.add_argument("--etcd-keys", type=int, default=2_000)
    args = parser.parse_args()

    ours = asyncio.run(churn(args.pods, args.live))
    ref = reference_churn(args.pods, args.live)
    mem_rate = asyncio.run(alloc_rate_memory(args.memory_keys))
    etcd_rate = asyncio.run(alloc_rate_etcd(args.etcd_keys)) if shutil.which("etcd") else float("nan")

    growth = ours["end"] - ours["warm"]
    ref_growth = ref["end"] - ref["baseline"]
    rows = [
        ("identity allocs/s, memory backend", f"{mem_rate:,.0f}", ""),
        ("identity allocs/s, etcd backend (1 operator)", f"{etcd_rate:,.0f}", ""),
        (f"RSS growth, {args.pods:,} Job pods (<= {args.live:,} live), MiB", f"{growth:.2f}",
         f"reference {ref_growth:.2f}"),
        (f"identities held at the end of churn ({args.live:,} live)", f"{ours['identities_end']:.0f}",
         f"reference {ref['identities_end']:.0f}"),
        ("identities held after delete-all", f"{ours['identities_after_delete']:.0f}", ""),
        ("RSS after delete-all vs baseline, MiB", f"{ours['after_delete'] - ours['baseline']:.2f}", ""),
        ("identities released by the sweep (lost events)", f"{ours['gc_released']:.0f}", ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'podmeter':>12}  reference (F12/F13 allocator)")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>12}  {note}")
    print(json.dumps({
        "identity_allocs_per_s": {"memory": round(mem_rate), "etcd": round(etcd_rate)},
        "rss_growth_mib_100k_job_pods": round(growth, 3),
        "rss_after_delete_all_vs_baseline_mib": round(ours["after_delete"] - ours["baseline"], 3),
        "reference_rss_growth_mib": round(ref_growth, 3),
        "pods": args.pods,
        "live": args.live,
    }))


if __name__ == "__main__":
    main()
