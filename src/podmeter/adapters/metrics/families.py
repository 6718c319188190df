"""Building metric families at scrape time: the helpers every podmeter collector uses.

Collectors (``agent_state``, ``operator_state``) read a snapshot of the process's state on each scrape and
turn it into families here, so no gauge is ever kept in sync by hand. A series for a label value that
never occurred does not exist, unless the value is known in advance (:func:`with_zeros`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

K = TypeVar("K")
# Values by label tuple (Mapping's key is invariant: one alternative per label count in use).
Labelled = Mapping[tuple[str], int] | Mapping[tuple[str, str], int]


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def labelled_gauge(name: str, documentation: str, label: str, values: Mapping[str, float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


def counter(name: str, documentation: str, labels: tuple[str, ...] = (), values: Labelled | None = None,
            value: float | None = None) -> CounterMetricFamily:
    """A counter family: one unlabelled ``value``, or ``values`` by label tuple (exported as ``name_total``)."""
    family = CounterMetricFamily(name, documentation, labels=list(labels))
    if value is not None:
        family.add_metric([], value)
    for key, number in sorted((values or {}).items()):
        family.add_metric(list(key), number)
    return family


def with_zeros(values: Mapping[K, int], known: Iterable[K]) -> dict[K, int]:
    """``values`` with a 0 for each ``known`` label value not yet counted: a counter whose label values
    are known in advance exists from the start, so a healthy process's panel shows 0, not "No data"."""
    return {**dict.fromkeys(known, 0), **values}


def by_one(values: Mapping[str, int]) -> Mapping[tuple[str], int]:
    """Values keyed by one label value, as the label tuples :func:`counter` takes."""
    return {(key,): value for key, value in values.items()}


V = TypeVar("V")


def pruned(cache: dict[str, V], live: Collection[str]) -> dict[str, V]:
    """A per-series text cache, without the series gone once it holds more than twice the live ones (and
    1,024): rebuilt rarely, so a scrape does not pay for every churned pod."""
    if len(cache) > 2 * len(live) + 1024:
        return {uid: value for uid, value in cache.items() if uid in live}
    return cache
