"""Reading the agent's Prometheus exposition in tests (no tests here): the per-pod series of an in-process
agent (:func:`scrape`, :func:`pod_value`) and one sample of a scraped text (:func:`metric`)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from agent_harness import AgentHarness
from podmeter.adapters.metrics.pod_traffic import PodTrafficExposition

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, sorted labels) -> value


def scrape(agent: AgentHarness, retina: bool = False) -> Samples:
    """The in-process agent's per-pod series, rendered on its loop (``retina``: under Retina's names)."""
    exposition = PodTrafficExposition(agent.agent.ledger, agent.datapath.read_counters, retina)
    text = agent.on_loop(exposition.render).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def pod_value(samples: Samples, metric: str, pod: str, direction: str) -> float | None:
    """The value of ``metric`` for ``pod`` and ``direction`` in :func:`scrape`'s samples; None: no such series."""
    for (name, labels), value in samples.items():
        d = dict(labels)
        if name == metric and d.get("pod") == pod and d.get("direction") == direction:
            return float(value)
    return None


def metric(text: str, name: str) -> float | None:
    """The value of the first sample named ``name`` (whatever its labels; ``name{labels}`` names one series)
    in an exposition's text; None when there is none."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None
