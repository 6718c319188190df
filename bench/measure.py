"""Shared helpers for the benchmarks: medians, RSS, tracemalloc sizes, the closing JSON line."""

from __future__ import annotations

import gc
import json
import statistics
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def rss_mib() -> float:
    """Resident set size of this process, from /proc (what the kernel charges us)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def median_of(runs: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(runs))


def timed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def traced_bytes(build: Callable[[], T]) -> tuple[T, int]:
    """Build something and return it with the bytes it still holds (tracemalloc, after a collection)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    value = build()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return value, after - before


def table(rows: list[tuple[str, float, float | None, str]]) -> None:
    """Print figure | value | reference | ratio. ``reference`` is a target or a contender's figure."""
    print(f"{'figure':<36} {'value':>14} {'reference':>14} {'ratio':>8}  note")
    for name, value, reference, note in rows:
        ratio = f"{value / reference:8.2f}" if reference else f"{'-':>8}"
        ref = f"{reference:14.2f}" if reference is not None else f"{'-':>14}"
        print(f"{name:<36} {value:14.2f} {ref} {ratio}  {note}")


def json_line(figures: dict[str, Any]) -> None:
    print(json.dumps(figures, sort_keys=True))
