"""The ``--hubble-metrics`` value: Cilium's syntax parsed, rendered back, and what podmeter refuses named."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from podmeter.model.hubble_metrics_config import (
    CONTEXT_OPTIONS,
    CONTEXTS,
    FLAGS,
    LABELS,
    METRICS,
    NOT_EXPORTED,
    REFUSED_CONTEXTS,
    HubbleMetricsConfig,
    HubbleMetricsError,
    MetricSpec,
    parse,
    render,
)

ISSUE_VALUE = ("drop tcp dns port-distribution icmp flows-to-world flow:sourceContext=workload-name|reserved-identity;"
               "destinationContext=workload-name|reserved-identity;labelsContext=source_namespace,source_workload,"
               "destination_namespace,destination_workload,traffic_direction")

# What a user of Retina's Hubble dashboards runs: the metrics of Retina's Hubble chart (its values.yaml,
# hubble.metrics.enabled), per-direction contexts and all.
RETINA_VALUE = ("flow:sourceEgressContext=pod;destinationIngressContext=pod "
                "tcp:sourceEgressContext=pod;destinationIngressContext=pod "
                "dns:query;sourceEgressContext=pod;destinationIngressContext=pod "
                "drop:sourceEgressContext=pod;destinationIngressContext=pod")

contexts = st.lists(st.sampled_from(CONTEXTS), min_size=1, max_size=4, unique=True).map(tuple)
maybe_contexts = st.one_of(st.just(()), contexts)


@st.composite
def specs(draw: st.DrawFn, name: str) -> MetricSpec:
    ends = [draw(maybe_contexts) for _ in range(6)]
    wanted = draw(st.sets(st.sampled_from(LABELS)))
    flags = draw(st.sets(st.sampled_from(FLAGS[name]))) if name in FLAGS else set()
    return MetricSpec(name, ends[0], ends[1], tuple(label for label in LABELS if label in wanted),
                      tuple(sorted(flags)), *ends[2:])


configs = st.lists(st.sampled_from(METRICS), unique=True).flatmap(
    lambda names: st.tuples(*(specs(name) for name in names))).map(HubbleMetricsConfig)


@given(configs)
def test_parse_of_render_is_the_config(config: HubbleMetricsConfig) -> None:
    assert parse(render(config)) == config


@given(configs)
def test_case_and_spacing_do_not_matter(config: HubbleMetricsConfig) -> None:
    text = render(config)
    shouted = text.replace("Context=", "CONTEXT=").replace("workload-name", "Workload-Name")
    assert parse("  " + shouted.replace(" ", " \n\t ") + " ") == config


def test_the_value_of_a_cilium_user_carries_over() -> None:
    config = parse(ISSUE_VALUE)
    assert [m.name for m in config.metrics] == ["drop", "tcp", "dns", "port-distribution", "icmp",
                                                "flows-to-world", "flow"]
    flow = config.get("flow")
    assert flow is not None and flow.source == flow.destination == ("workload-name", "reserved-identity")
    assert flow.context_label_names == ("source_namespace", "source_workload", "destination_namespace",
                                        "destination_workload", "traffic_direction", "source", "destination")
    assert render(config) == ISSUE_VALUE


def test_the_value_of_retinas_hubble_chart_carries_over() -> None:
    config = parse(RETINA_VALUE)
    assert [m.name for m in config.metrics] == ["flow", "tcp", "dns", "drop"]
    for spec in config.metrics:
        assert (spec.source, spec.source_egress, spec.source_ingress) == ((), ("pod",), ())
        assert (spec.destination, spec.destination_egress, spec.destination_ingress) == ((), (), ("pod",))
        assert spec.context_label_names == ("source", "destination")
    assert render(config) == RETINA_VALUE.replace("dns:query;sourceEgressContext=pod;destinationIngressContext=pod",
                                                  "dns:sourceEgressContext=pod;destinationIngressContext=pod;query")


def test_a_per_direction_context_takes_precedence_over_the_general_one_for_its_direction_only() -> None:
    spec = parse("flow:sourceContext=namespace;sourceIngressContext=pod;destinationEgressContext=ip").metrics[0]
    assert spec.source_context("ingress") == ("pod",)
    assert spec.source_context("egress") == spec.source_context(None) == ("namespace",)
    assert spec.destination_context("egress") == ("ip",)
    assert spec.destination_context("ingress") == spec.destination_context(None) == ()
    assert spec.context_label_names == ("source", "destination")


def test_labels_come_in_ciliums_order_and_flags_may_carry_a_value() -> None:
    spec = parse("flows-to-world:port=true;labelsContext=traffic_direction,source_pod;any-drop").metrics[0]
    assert (spec.labels, spec.flags) == (("source_pod", "traffic_direction"), ("any-drop", "port"))


refused = st.one_of(
    st.sampled_from(sorted(NOT_EXPORTED)).map(lambda name: (name, name)),
    st.sampled_from(sorted(REFUSED_CONTEXTS)).map(lambda c: (f"flow:sourceContext=namespace|{c}", c)),
    st.sampled_from(["sourceEgressContext", "destinationIngressContext"]).map(
        lambda k: (f"drop:{k}=pod|identity", "identity")),
    st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).filter(
        lambda w: w not in METRICS and w not in NOT_EXPORTED).map(lambda w: (w, w)),
    st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12).filter(lambda w: w not in LABELS).map(
        lambda w: (f"tcp:labelsContext=source_pod,{w}", w)),
    st.text("abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=12).filter(
        lambda w: w.lower() not in {k.lower() for k in CONTEXT_OPTIONS}).map(
        lambda w: (f"icmp:{w}", w)),
)


@given(refused)
def test_every_refused_part_names_itself(case: tuple[str, str]) -> None:
    value, name = case
    with pytest.raises(HubbleMetricsError) as caught:
        parse(value)
    assert name in str(caught.value)


@pytest.mark.parametrize(("value", "says"), [
    ("flow:sourceContext=identity", "no Cilium identity"),
    ("http", "no HTTP records"),
    ("tcp:query", "unknown option 'query' of tcp"),  # dns's flag, not tcp's
    ("drop drop", "given twice"),
    ("flow:sourceContext=", "unknown sourceContext ''"),
])
def test_refusals_say_why(value: str, says: str) -> None:
    with pytest.raises(HubbleMetricsError, match=says):
        parse(value)


def test_an_empty_value_names_no_metric() -> None:
    assert parse("") == HubbleMetricsConfig()
