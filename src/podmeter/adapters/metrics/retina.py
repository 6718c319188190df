"""Retina-compatible series, for clusters moving from Retina's advanced (pod-level) metrics to podmeter.

``--retina-compat`` takes Retina's two advanced modes by their names (docs/metrics.md, "Retina names"):

* ``local`` (the flag alone; Retina's ``remoteContext: false``): per-pod series read from the kernel
  counters, labels ``direction``, ``ip``, ``namespace``, ``podname``, ``workload_kind``, ``workload_name``
  (rendered by :mod:`podmeter.adapters.metrics.pod_traffic`);
* ``remote`` (Retina's ``remoteContext: true``): series per flow between two ends, labels ``direction`` and
  ``source_``/``destination_`` ``ip``, ``namespace``, ``podname``, ``workload_kind``, ``workload_name``,
  built from the agent's flow records (:mod:`podmeter.model.retina_flows`) and rendered here. They are
  what Retina's pod-level dashboards query.

Both modes also export Retina's drop series, ``networkobservability_adv_drop_count`` (packets) and
``_bytes``, gauges as Retina's exporter types them, with ``reason`` after the context's labels: ``local``
from the per-pod drop ledger (:mod:`podmeter.adapters.metrics.pod_drops`, the per-pod series' lifecycle),
``remote`` from the dropped flow records (rendered here, bounded and expired as the forward series).

The two are never exported together: both are ``networkobservability_adv_forward_count``, and a dashboard
query such as ``{source_podname!="unknown"}`` would match every local series too (they have no
``source_podname``), so it would show the node's whole traffic as one pod with an empty name.
"""

from __future__ import annotations

import argparse

from podmeter.adapters.metrics.flow_traffic import traffic_families
from podmeter.adapters.metrics.pod_traffic import RETINA_HELP, escape
from podmeter.model.retina_flows import END_LABELS, RetinaFlows, RetinaKey

# Retina writes its drop series as gauges (it adds to them; they never go down while they exist).
RETINA_DROP_HELP = {
    "networkobservability_adv_drop_bytes": "Dropped bytes, under Retina's advanced pod-level name.",
    "networkobservability_adv_drop_count": "Dropped packets, under Retina's advanced pod-level name.",
}

LOCAL, REMOTE = "local", "remote"
_ON = ("1", "true", "yes", "on")  # an environment variable may still say the flag's old boolean way
_OFF = ("", "0", "false", "no", "off")


def retina_context(value: str) -> str | None:
    """``--retina-compat``'s value: ``local``, ``remote``, or None (off). Raises ArgumentTypeError for
    anything else, which the command line turns into a usage error naming the option."""
    text = value.strip().lower()
    if text in (LOCAL, REMOTE):
        return text
    if text in _ON:
        return LOCAL
    if text in _OFF:
        return None
    raise argparse.ArgumentTypeError(f"must be local or remote, not {value!r}")


def _labels(key: RetinaKey) -> str:
    """Label names in the order Retina's exporter writes them (sorted: destination_, direction, reason for a
    drop, source_)."""
    reason = [f'reason="{escape(key.reason)}"'] if key.reason else []
    ends = [*(f'destination_{name}="{escape(value)}"' for name, value in zip(END_LABELS, key.destination, strict=True)),
            f'direction="{key.direction}"', *reason,
            *(f'source_{name}="{escape(value)}"' for name, value in zip(END_LABELS, key.source, strict=True))]
    return "{" + ",".join(ends) + "}"


def _families(flows: RetinaFlows, kind: str, helps: dict[str, str]) -> list[str]:
    """The ``_bytes`` and ``_count`` families of ``helps``' names (in that order) from ``flows``' keys."""
    sizes_name, counts_name = sorted(helps)
    return traffic_families(flows.values(), _labels, ((sizes_name, helps[sizes_name]),
                                                      (counts_name, helps[counts_name])), kind)


def render_remote(flows: RetinaFlows, drops: RetinaFlows | None = None) -> bytes:
    """Retina's remote-context forward series, then how many keys exist and how many records were folded
    into the overflow keys (``--flow-series-limit``); with ``drops``, Retina's drop series and their two
    figures likewise."""
    out = _families(flows, "counter", RETINA_HELP)
    if drops is not None:
        out += _families(drops, "gauge", RETINA_DROP_HELP)
    out += ["# HELP podmeter_retina_flow_series Retina remote-context keys with a series (forward count and bytes).",
            "# TYPE podmeter_retina_flow_series gauge",
            f"podmeter_retina_flow_series {len(flows.keys)}",
            "# HELP podmeter_retina_flow_series_folded_total Flow records counted in a Retina overflow series.",
            "# TYPE podmeter_retina_flow_series_folded_total counter",
            f"podmeter_retina_flow_series_folded_total {flows.folded}"]
    if drops is not None:
        out += ["# HELP podmeter_retina_drop_series Retina remote-context drop keys with a series (count and bytes).",
                "# TYPE podmeter_retina_drop_series gauge",
                f"podmeter_retina_drop_series {len(drops.keys)}",
                "# HELP podmeter_retina_drop_series_folded_total Dropped flow records counted in a Retina overflow "
                "drop series.",
                "# TYPE podmeter_retina_drop_series_folded_total counter",
                f"podmeter_retina_drop_series_folded_total {drops.folded}"]
    return ("\n".join(out) + "\n").encode()
