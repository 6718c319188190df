"""Benchmark of the core: store -> desired -> datapath, with the in-memory datapath.

    python -m bench.core            # full sizes (about a minute)
    python -m bench.core --quick    # a tenth of the sizes, for a smoke run

Prints a table (figure, value, reference = podmeter's target for it, ratio) and, last, one JSON line with
``apply_events_per_s``, ``reconcile_100k_ms``, ``bytes_per_pod`` and ``rss_growth_mib_1m_lifecycles``.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

import msgspec

from bench.measure import json_line, median_of, rss_mib, table, timed_ms, traced_bytes
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.lab.podgen import realistic_pod
from podmeter.model.configuration import DEFAULT_NAME, Interest, MetricsConfiguration
from podmeter.model.deltas import CONFIGURATIONS, PODS, Delete, Delta, Upsert
from podmeter.model.records import Pod, decode_pod
from podmeter.model.view import NodeView
from podmeter.runtime.writer import Writer

FLUSH_EVERY = 256  # the agent's writer flushes after a burst of queued events, not after each one


def ip_of(i: int) -> str:
    return f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"


def template_pods(n: int) -> list[Pod]:
    """n pods decoded from realistic JSON: the real decoder, real label sets."""
    return [decode_pod(msgspec.json.encode(realistic_pod(i, ip=ip_of(i)))) for i in range(n)]


def observed_writer(capacity: int) -> tuple[NodeView, Writer]:
    """A view whose configuration observes namespace ``default``, and its writer over the memory datapath."""
    view = NodeView("node-a")
    config = MetricsConfiguration(DEFAULT_NAME, "1", 1, Interest(include=frozenset({"default"})))
    view.apply(Upsert(CONFIGURATIONS, config))
    return view, Writer(view.desired, MemoryDatapath(capacity))


def apply_events_per_s(pods: list[Pod]) -> float:
    """Create every pod, then churn: each pod deleted and recreated with a new UID and a new IP. The deltas
    are built before the clock starts (building them is the reflector's work, measured by bench.agent)."""
    view, writer = observed_writer(len(pods) * 2)
    n = len(pods)
    reborn = [msgspec.structs.replace(p, uid=p.uid + "-2", ips=(ip_of(i + n),)) for i, p in enumerate(pods)]
    deltas: list[Delta[Pod]] = [Upsert(PODS, pod) for pod in pods]
    for pod in reborn:
        deltas += [Delete(PODS, pod.uid[:-2]), Upsert(PODS, pod)]
    start = time.perf_counter()
    for events, delta in enumerate(deltas, 1):
        view.apply(delta)
        if events % FLUSH_EVERY == 0:
            writer.flush()
    writer.flush()
    elapsed = time.perf_counter() - start
    assert writer.datapath.contents() == set(view.desired)
    return len(deltas) / elapsed


def reconcile_ms(pods: list[Pod]) -> float:
    view, writer = observed_writer(len(pods))
    for pod in pods:
        view.apply(Upsert(PODS, pod))
    writer.flush()
    assert len(writer.datapath.contents()) == len(pods)

    def one() -> float:
        return timed_ms(writer.resync)

    result = median_of(5, one)
    assert sum(writer.stats.drift_repaired.values()) == 0
    return result


def bytes_per_pod(n: int) -> float:
    """tracemalloc: what a view holding n observed pods costs, decoding included (the JSON is freed)."""
    raw = [msgspec.json.encode(realistic_pod(i, ip=ip_of(i))) for i in range(n)]

    def build() -> Writer:
        view, writer = observed_writer(n)
        for data in raw:
            view.apply(Upsert(PODS, decode_pod(data)))
        writer.flush()
        return view, writer

    # Build the writer first so its empty containers are part of the baseline, not the figure.
    (view, writer), used = traced_bytes(build)
    assert len(view.pods) == n
    # The in-memory datapath's own set is not the agent's memory (the kernel holds the map): subtract it.
    _, datapath_bytes = traced_bytes(lambda: set(writer.datapath.contents()))
    return (used - datapath_bytes) / n


def rss_growth_mib(lifecycles: int, live: int) -> tuple[float, float, float]:
    """lifecycles pod create -> delete with at most ``live`` alive; RSS at 10 % vs at the end."""
    template = decode_pod(msgspec.json.encode(realistic_pod(0, ip=ip_of(0))))
    view, writer = observed_writer(live * 2)
    alive: list[str] = []
    checkpoint = lifecycles // 10
    rss_at_10 = 0.0
    start = time.perf_counter()
    for i in range(lifecycles):
        pod = msgspec.structs.replace(
            template, uid=f"uid-{i:08d}", name=f"job-{i:08d}", ips=(ip_of(i % 60000),)
        )
        view.apply(Upsert(PODS, pod))
        alive.append(pod.uid)
        if len(alive) >= live:
            view.apply(Delete(PODS, alive.pop(0)))
        if i % FLUSH_EVERY == 0:
            writer.flush()
        if i == checkpoint:
            gc.collect()
            rss_at_10 = rss_mib()
        if i and i % (lifecycles // 5) == 0:
            rate = i / (time.perf_counter() - start)
            print(f"  ... {i:,} lifecycles, {rate:,.0f}/s, RSS {rss_mib():.1f} MiB")
    for uid in alive:
        view.apply(Delete(PODS, uid))
    writer.flush()
    gc.collect()
    end = rss_mib()
    assert not view.pods and not writer.datapath.contents()
    return end - rss_at_10, rss_at_10, end


def lifecycles_in_fresh_process(lifecycles: int) -> tuple[float, float, float]:
    """RSS is per process: measured in a new one, the figure is not hidden under the memory the other
    figures of this run allocated."""
    result = subprocess.run([sys.executable, "-m", "bench.core", "--lifecycles-only", str(lifecycles)],
                            capture_output=True, text=True, check=True)
    for line in result.stdout.splitlines():
        if line.startswith("  ..."):
            print(line)
    growth, rss10, rss_end = json.loads(result.stdout.splitlines()[-1])
    return float(growth), float(rss10), float(rss_end)


def churn_figures(pods: list[Pod]) -> tuple[float, float]:
    return median_of(3, lambda: apply_events_per_s(pods)), reconcile_ms(pods)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a tenth of the sizes")
    parser.add_argument("--lifecycles-only", type=int, metavar="N", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lifecycles_only:  # the RSS figure, in a process of its own (see lifecycles_in_fresh_process)
        print(json.dumps(rss_growth_mib(args.lifecycles_only, 1000)))
        return
    scale = 10 if args.quick else 1
    n = 100_000 // scale

    print(f"decoding {n:,} realistic pods ...")
    events, reconcile = churn_figures(template_pods(n))
    per_pod = bytes_per_pod(n)
    print(f"running {1_000_000 // scale:,} lifecycles in a fresh process ...")
    growth, rss10, rss_end = lifecycles_in_fresh_process(1_000_000 // scale)

    table([
        ("apply_events_per_s", events, None, f"{n:,} pods created then churned, flush every {FLUSH_EVERY}"),
        ("reconcile_100k_ms", reconcile, 300.0, "target <= 300 ms (ratio <= 1 meets it)"),
        ("bytes_per_pod", per_pod, 1024.0, "target <= 1024 B (ratio <= 1 meets it)"),
        ("rss_growth_mib_1m_lifecycles", growth, 2.0, f"RSS {rss10:.1f} -> {rss_end:.1f} MiB; target <= 2"),
    ])
    json_line({
        "apply_events_per_s": round(events),
        "reconcile_100k_ms": round(reconcile, 1),
        "bytes_per_pod": round(per_pod),
        "rss_growth_mib_1m_lifecycles": round(growth, 2),
        "scale": json.dumps(1 / scale),
    })


if __name__ == "__main__":
    main()
