"""The value of ``--hubble-metrics``: which of Hubble's metrics podmeter exports, and their label options.

The syntax is Cilium's own ``hubble-metrics`` value, so that a user's existing value carries over:
metrics separated by spaces; a metric's options after a ``:``, separated by ``;``; an option is
``key=value`` or a bare ``key``; a context's alternatives separated by ``|`` (the first that names the
end is its label value); ``labelsContext``'s labels separated by ``,``. For example::

    drop tcp flow:sourceContext=workload-name|reserved-identity;labelsContext=source_namespace,traffic_direction

The ``source`` label is there with any of ``sourceContext``, ``sourceEgressContext`` and
``sourceIngressContext``: for a flow leaving a pod (egress) ``sourceEgressContext`` says its value, for one
entering a pod (ingress) ``sourceIngressContext``, each in place of ``sourceContext``, which says it
otherwise (no context for the flow's direction: an empty value). The same for ``destination``. Retina's
Hubble chart configures ``flow:sourceEgressContext=pod;destinationIngressContext=pod``: the source of what
leaves a pod, the destination of what enters one.

Keys and context identifiers are case-insensitive, as Cilium reads them. :func:`parse` gives a
:class:`HubbleMetricsConfig` in one canonical form, :func:`render` writes it back
(``parse(render(c)) == c``); what podmeter cannot honour is refused by name (:class:`HubbleMetricsError`),
never ignored: a metric Cilium has and podmeter has no records for (``http``), a context Cilium has and
podmeter cannot fill (``identity``), an option of another metric, or anything unknown.

Next stage: ``model.hubble_metrics`` keeps the series of the metrics a config names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The metrics podmeter exports, by their name in the value (docs/metrics.md, "Hubble metrics").
METRICS = ("flow", "drop", "tcp", "port-distribution", "icmp", "flows-to-world", "dns")
# Cilium's other metrics: refused with the reason (podmeter has no record that could feed them).
NOT_EXPORTED = {
    "http": "podmeter has no HTTP records",
    "httpv2": "podmeter has no HTTP records",
    "kafka": "podmeter has no Kafka records",
    "policy": "podmeter enforces no network policy, so it has no policy verdicts",
    "sctp": "podmeter's datapath does not parse SCTP",
    "flows-per-pod": "not implemented by podmeter",
}
# Context identifiers podmeter fills; the two of Cilium's it cannot, with why.
CONTEXTS = ("namespace", "pod", "pod-name", "workload-name", "app", "dns", "ip", "reserved-identity")
REFUSED_CONTEXTS = {
    "identity": "podmeter's flow ends carry no Cilium identity label set",
    "pod-short": "deprecated in Cilium; use workload-name",
}
# labelsContext's labels, in the order they are exported (Cilium's order).
LABELS = ("source_ip", "source_pod", "source_namespace", "source_workload", "source_app",
          "destination_ip", "destination_pod", "destination_namespace", "destination_workload", "destination_app",
          "traffic_direction")
SOURCE_CONTEXT, DESTINATION_CONTEXT, LABELS_CONTEXT = "sourceContext", "destinationContext", "labelsContext"
# The context options of an end, in the order they are rendered: the field of MetricSpec each one sets.
END_CONTEXTS = {
    SOURCE_CONTEXT: "source", "sourceEgressContext": "source_egress", "sourceIngressContext": "source_ingress",
    DESTINATION_CONTEXT: "destination", "destinationEgressContext": "destination_egress",
    "destinationIngressContext": "destination_ingress",
}
CONTEXT_OPTIONS = (*END_CONTEXTS, LABELS_CONTEXT)
# Options without a value, by metric (Cilium ignores a value given to them; so does podmeter).
FLAGS = {"flows-to-world": ("any-drop", "port", "syn-only"), "dns": ("query", "ignoreAAAA")}


class HubbleMetricsError(ValueError):
    """A value podmeter refuses; the message names the part it refuses and why."""


@dataclass(frozen=True)
class MetricSpec:
    """One metric of the value: its name, its contexts (alternatives in order; empty: not given), its
    labelsContext labels (in :data:`LABELS` order) and its flags (sorted). ``source_egress`` and
    ``source_ingress`` are the per-direction contexts of the source, in place of ``source`` for a flow
    of that direction; the same for the destination."""

    name: str
    source: tuple[str, ...] = ()
    destination: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    source_egress: tuple[str, ...] = ()
    source_ingress: tuple[str, ...] = ()
    destination_egress: tuple[str, ...] = ()
    destination_ingress: tuple[str, ...] = ()

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def has_source(self) -> bool:
        return bool(self.source or self.source_egress or self.source_ingress)

    @property
    def has_destination(self) -> bool:
        return bool(self.destination or self.destination_egress or self.destination_ingress)

    @property
    def is_per_direction(self) -> bool:
        return bool(self.source_egress or self.source_ingress or self.destination_egress or self.destination_ingress)

    def source_context(self, direction: str | None) -> tuple[str, ...]:
        """The source's context for a flow of ``direction`` (``egress``, ``ingress``; None: not known)."""
        return _for_direction(direction, self.source, self.source_egress, self.source_ingress)

    def destination_context(self, direction: str | None) -> tuple[str, ...]:
        return _for_direction(direction, self.destination, self.destination_egress, self.destination_ingress)

    def all_contexts(self, side: str) -> tuple[str, ...]:
        """Every identifier any context of ``side`` (``source``, ``destination``) may use."""
        return (*getattr(self, side), *getattr(self, f"{side}_egress"), *getattr(self, f"{side}_ingress"))

    @property
    def context_label_names(self) -> tuple[str, ...]:
        """The label names its contexts add, in Cilium's order: labelsContext's, then source, destination."""
        return (*self.labels, *(("source",) if self.has_source else ()),
                *(("destination",) if self.has_destination else ()))


def _for_direction(direction: str | None, both: tuple[str, ...], egress: tuple[str, ...],
                   ingress: tuple[str, ...]) -> tuple[str, ...]:
    if direction == "egress" and egress:
        return egress
    if direction == "ingress" and ingress:
        return ingress
    return both


@dataclass(frozen=True)
class HubbleMetricsConfig:
    metrics: tuple[MetricSpec, ...] = field(default_factory=tuple)

    def get(self, name: str) -> MetricSpec | None:
        return next((m for m in self.metrics if m.name == name), None)


_CANONICAL_FLAGS = {flag.lower(): flag for flags in FLAGS.values() for flag in flags}
_CANONICAL_OPTIONS = {key.lower(): key for key in CONTEXT_OPTIONS}


def parse(value: str) -> HubbleMetricsConfig:
    """The value as a config; :class:`HubbleMetricsError` naming the first part podmeter refuses."""
    specs: list[MetricSpec] = []
    for item in value.split():
        spec = _metric(item)
        if any(s.name == spec.name for s in specs):
            raise HubbleMetricsError(f"--hubble-metrics: metric {spec.name!r} is given twice")
        specs.append(spec)
    return HubbleMetricsConfig(tuple(specs))


def render(config: HubbleMetricsConfig) -> str:
    """The config in the value's syntax (canonical: options in a fixed order)."""
    return " ".join(_render_metric(spec) for spec in config.metrics)


def _render_metric(spec: MetricSpec) -> str:
    options = [f"{key}={'|'.join(getattr(spec, field))}" for key, field in END_CONTEXTS.items()
               if getattr(spec, field)]
    if spec.labels:
        options.append(f"{LABELS_CONTEXT}={','.join(spec.labels)}")
    options += spec.flags
    return spec.name + (":" + ";".join(options) if options else "")


def _metric(item: str) -> MetricSpec:
    name, _, options = item.partition(":")
    name = name.lower()
    if name in NOT_EXPORTED:
        raise HubbleMetricsError(f"--hubble-metrics: metric {name!r} is not exported by podmeter: "
                                 f"{NOT_EXPORTED[name]} (podmeter's: {', '.join(METRICS)})")
    if name not in METRICS:
        raise HubbleMetricsError(f"--hubble-metrics: unknown metric {name!r} (podmeter's: {', '.join(METRICS)})")
    found: dict[str, str] = {}
    for option in options.split(";"):
        if option:
            key, _, text = option.partition("=")
            found[_option_key(name, key)] = text
    contexts = {field: _context(name, key, found[key]) for key, field in END_CONTEXTS.items() if key in found}
    return MetricSpec(
        name, **contexts,
        labels=_labels(name, found[LABELS_CONTEXT]) if LABELS_CONTEXT in found else (),
        flags=tuple(sorted(key for key in found if key not in CONTEXT_OPTIONS)),
    )


def _option_key(metric: str, key: str) -> str:
    lowered = key.lower()
    if lowered in _CANONICAL_OPTIONS:
        return _CANONICAL_OPTIONS[lowered]
    flag = _CANONICAL_FLAGS.get(lowered)
    if flag is None or flag not in FLAGS.get(metric, ()):
        known = (*CONTEXT_OPTIONS, *FLAGS.get(metric, ()))
        raise HubbleMetricsError(f"--hubble-metrics: unknown option {key!r} of {metric} (its options: "
                                 f"{', '.join(known)})")
    return flag


def _context(metric: str, option: str, text: str) -> tuple[str, ...]:
    out: list[str] = []
    for alternative in text.split("|"):
        identifier = alternative.lower()
        if identifier in REFUSED_CONTEXTS:
            raise HubbleMetricsError(f"--hubble-metrics: {option} {alternative!r} of {metric} is not supported "
                                     f"by podmeter: {REFUSED_CONTEXTS[identifier]}")
        if identifier not in CONTEXTS:
            raise HubbleMetricsError(f"--hubble-metrics: unknown {option} {alternative!r} of {metric} "
                                     f"(podmeter's: {', '.join(CONTEXTS)})")
        if identifier not in out:
            out.append(identifier)
    return tuple(out)


def _labels(metric: str, text: str) -> tuple[str, ...]:
    wanted = text.split(",")
    for label in wanted:
        if label not in LABELS:
            raise HubbleMetricsError(f"--hubble-metrics: unknown {LABELS_CONTEXT} label {label!r} of {metric} "
                                     f"(podmeter's: {', '.join(LABELS)})")
    return tuple(label for label in LABELS if label in wanted)
