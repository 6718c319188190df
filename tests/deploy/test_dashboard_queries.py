"""The dashboards' queries as ``dashboard_queries`` reads them, and its table of what podmeter exports
against docs/metrics.md (the kernel test that evaluates them is tests/adapters/test_bpf_dashboards.py)."""

from __future__ import annotations

import hashlib
import re
from collections import Counter

import pytest

import dashboard_queries as dq

pytestmark = pytest.mark.fast  # the pure tier: make test-fast
DOCS = dq.ROOT / "docs" / "metrics.md"


def docs_table() -> dict[str, str]:
    """docs/metrics.md's table of the dashboards' series: name -> its "exported" cell."""
    section = DOCS.read_text().split("### The series the dashboards people run query", 1)[1].split("\n## ", 1)[0]
    return {m[1]: m[2].strip() for m in re.finditer(r"^\| `([a-z0-9_]+)` \| ([^|]+) \|", section, re.MULTILINE)}


def test_the_docs_table_is_the_code_table() -> None:
    expected = {name: f"yes, `{s.requires}`" if s.requires else "yes" for name, s in dq.EXPORTED.items()}
    expected |= dict.fromkeys(dq.NOT_EXPORTED, "no") | dict.fromkeys(dq.NOT_YET, "not yet")
    assert docs_table() == expected


def test_every_series_retinas_panels_query_is_in_exactly_one_table() -> None:
    tables = [set(dq.EXPORTED), set(dq.NOT_EXPORTED), set(dq.NOT_YET)]
    assert sum(len(t) for t in tables) == len(set().union(*tables))  # disjoint
    assert dq.queried_series() == set().union(*tables)  # nothing queried is missing, nothing listed is unused


def test_the_copies_are_retinas_files_unchanged() -> None:
    readme = (dq.RETINA_DASHBOARDS / "README.md").read_text()
    listed = dict((name, digest) for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+\.json)$", readme, re.M))
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dq.RETINA_DASHBOARDS.glob("*.json")}
    assert len(files) == 6
    assert files == listed


def test_the_panels_with_queries_rows_and_text_panels_left_out() -> None:
    counts = Counter(p.dashboard for p in dq.all_panels())
    assert {name: n for name, n in counts.items() if not dq.is_own(name)} == {
        "retina/standard-pod-level": 11, "retina/clusters": 41, "retina/standard-dns": 8,
        "retina/hubble-pod-flows-workload": 49, "retina/hubble-pod-flows-namespace": 53, "retina/hubble-dns": 9}
    own = [p for p in dq.all_panels() if dq.is_own(p.dashboard)]
    assert own and all(s.name.startswith(dq.OWN_PREFIXES) for p in own for q in p.queries
                       for alt in dq.alternatives(q) for s in alt)


def test_variables_become_what_grafana_sends() -> None:
    query = ('sum(label_replace(rate(x{cluster="$cluster", instance=~"$Nodes", source=~"^${namespace}/$workload"}'
             '[$__rate_interval]), "reason", "$1", "s", "(.*)"))')
    assert dq.promql(query) == ('sum(label_replace(rate(x{cluster="podmeter-lab", instance=~".*", source=~"^.*/.*"}'
                                '[15s]), "reason", "$1", "s", "(.*)"))')
    with pytest.raises(KeyError):
        dq.promql('x{namespace="$namespace"}')
    assert dq.promql('x{namespace="$namespace"}', {"namespace": "shop"}) == 'x{namespace="shop"}'


def test_a_panel_is_expected_when_one_alternative_has_every_series_with_its_values() -> None:
    def panel(*queries: str) -> dq.Panel:
        return dq.Panel("retina/x", 1, "t", queries)

    remote = ["--retina-compat=remote"]
    assert dq.expected(panel('sum(rate(networkobservability_drop_count{direction="egress"}[1m]))'), remote) is None
    assert "direction" in str(dq.expected(panel('networkobservability_drop_count{direction="unknown"}'), remote))
    assert dq.expected(panel('networkobservability_tcp_connection_stats{statistic_name=~"reset.*"}'), remote) is None
    assert "only with --retina-compat" in str(dq.expected(panel("networkobservability_forward_count"), []))
    # local gives the node-level series, not the remote-context pair series
    assert dq.expected(panel("networkobservability_forward_count"), ["--retina-compat=local"]) is None
    assert dq.expected(panel("networkobservability_adv_forward_count"), ["--retina-compat=local"]) is not None
    either = ('sum(networkobservability_drop_count) or # a comment\n'
              'sum(networkobservability_interface_stats{statistic_name="rx_comp_full"})')
    assert dq.expected(panel(either), remote) is None
    both = ("sum(networkobservability_drop_count) and "
            "sum(networkobservability_node_apiserver_handshake_latency_ms_bucket)")
    assert "apiserver" in str(dq.expected(panel(both), remote))
    # the node's generic interface counters, not its driver's
    assert dq.expected(panel('networkobservability_interface_stats{statistic_name="tx_dropped"}'), remote) is None
    assert "statistic_name" in str(dq.expected(panel(
        'networkobservability_interface_stats{statistic_name="rx_comp_full"}'), remote))
    assert "only with --hubble-metrics" in str(dq.expected(panel("sum(rate(hubble_dns_queries_total[1m]))"), remote))
    # a negative matcher no value podmeter has passes: a panel asking for answers podmeter never reads
    table = 'sum(networkobservability_dns_response_count{num_response!="0", response!=""})'
    assert 'response!=""' in str(dq.expected(panel(table), remote))
    errors = 'sum(networkobservability_dns_response_count{return_code!="NoError"})'
    assert dq.expected(panel(errors), remote) is None
    assert "return_code" in str(dq.expected(panel('networkobservability_dns_response_count{return_code!~".*"}'),
                                            remote))
    hubble = [*remote, "--hubble-metrics-server", "127.0.0.1:9965", "--hubble-metrics", "flow tcp"]
    flows = 'sum(rate(hubble_flows_processed_total{source=~"^shop/.*", verdict="DROPPED"}[1m]))'
    assert "only with --hubble-metrics" in str(dq.expected(panel(flows), remote))
    assert dq.expected(panel(flows), hubble) is None
    assert "verdict" in str(dq.expected(panel('hubble_flows_processed_total{verdict="AUDIT"}'), hubble))
