"""Retina's DNS series from the DNS drain's records: names, labels, values, the name and series bounds and
the pods' lifecycle; and their text as the agent's /metrics serves it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from podmeter.adapters.metrics.retina_dns import render_retina_dns
from podmeter.model.flow_series import OTHER
from podmeter.model.retina_dns import ADV_REQUESTS, ADV_RESPONSES, REQUESTS, RESPONSES, RetinaDns
from record_support import RESOLVER, asked_records

WEB, DB = "10.0.0.1", "10.0.0.2"
WEB_POD, DB_POD = ("shop", "web-5d9f7-x2x7p"), ("shop", "db-0")


def table(names: int = 100, limit: int = 100, *, remote: bool = True, idle: float = 300.0,
          grace: float = 30.0) -> RetinaDns:
    return RetinaDns(names, limit, idle, grace, remote=remote)


def by_family(t: RetinaDns) -> dict[str, dict[tuple[str, ...], int]]:
    out: dict[str, dict[tuple[str, ...], int]] = {name: {} for name in t.families}
    for (family, values), value in t.values():
        out[family][values] = value
    return out


ASKED = [(WEB, "cart.shop.svc.cluster.local.", 1, None, 3), (WEB, "cart.shop.svc.cluster.local.", 1, 0, 3),
         (WEB, "gone.test.", 28, None, 2), (WEB, "gone.test.", 28, 3, 2), (DB, "x.example.", 16, None, 1),
         (DB, "x.example.", 16, 5, 1), (DB, "x.example.", 16, 9, 1)]


def test_the_node_series_have_retinas_labels_and_the_tracers_return_codes() -> None:
    t = table(remote=False)
    t.add(asked_records(ASKED), 1.0)
    families = by_family(t)
    assert set(families) == {REQUESTS, RESPONSES}
    assert families[REQUESTS] == {("NoError", "A", "cart.shop.svc.cluster.local.", "", "0"): 3,
                                  ("NoError", "AAAA", "gone.test.", "", "0"): 2,
                                  ("NoError", "TXT", "x.example.", "", "0"): 1}
    assert families[RESPONSES] == {("NoError", "A", "cart.shop.svc.cluster.local.", "", ""): 3,
                                   ("NXDomain", "AAAA", "gone.test.", "", ""): 2,
                                   ("Refused", "TXT", "x.example.", "", ""): 1,
                                   ("NotAuth", "TXT", "x.example.", "", ""): 1}


def test_the_remote_context_series_name_both_ends_with_retinas_own_return_codes() -> None:
    t = table()
    t.add(asked_records(ASKED), 1.0)
    families = by_family(t)
    web = ("10.0.0.1", "shop", "web-5d9f7-x2x7p", "Deployment", "web")
    server = (RESOLVER, "unknown", "unknown", "unknown", "unknown")
    assert families[ADV_REQUESTS][("A", "cart.shop.svc.cluster.local.", *web, *server)] == 3
    assert families[ADV_RESPONSES][("NXDOMAIN", "AAAA", "gone.test.", "", "", *server, *web)] == 2
    db = ("10.0.0.2", "shop", "db-0", "StatefulSet", "db")
    assert families[ADV_RESPONSES][("", "TXT", "x.example.", "", "", *server, *db)] == 1  # NOTAUTH: Retina's ""
    assert sum(families[ADV_RESPONSES].values()) == sum(families[RESPONSES].values()) == 7


def test_names_past_the_limit_are_other_and_counted_and_a_name_leaves_with_its_series() -> None:
    t = table(names=2)
    t.add(asked_records([(WEB, "a.", 1, None, 1), (WEB, "b.", 1, None, 1), (WEB, "c.", 1, None, 5),
                       (WEB, "a.", 1, 0, 1)]), 0.0)
    assert set(t.names) == {"a.", "b."}
    assert t.names_folded == 5
    assert by_family(t)[REQUESTS][("NoError", "A", OTHER, "", "0")] == 5
    t.add(asked_records([(DB, "b.", 1, None, 1)]), 100.0)  # b. stays in use; a. and _other_ go idle
    assert t.expire(300.0, lambda: {WEB_POD, DB_POD}) > 0
    assert set(t.names) == {"b."}
    t.add(asked_records([(WEB, "c.", 1, None, 1)]), 301.0)  # room again: c. has series of its own now
    assert set(t.names) == {"b.", "c."}


def test_series_end_with_the_pods_whose_messages_they_count_and_go_after_the_grace() -> None:
    t = table(grace=30.0)
    t.add(asked_records([(WEB, "a.", 1, None, 1), (DB, "a.", 1, None, 1)]), 0.0)
    assert t.expire(10.0, lambda: {WEB_POD}) == 0  # db is gone: its adv series ends; the node series has web
    assert t.expire(40.0, lambda: {WEB_POD}) == 1
    assert t.expire(50.0, set) == 0
    assert t.expire(80.0, set) == 2
    assert t.series == {} and t.names == {}


@given(st.lists(st.tuples(st.sampled_from([WEB, DB]), st.sampled_from(["a.", "b.", "c.", "d."]),
                          st.sampled_from([1, 28]), st.sampled_from([None, 0, 3]), st.integers(1, 5)),
                max_size=30), st.integers(1, 4), st.integers(1, 12))
def test_bounded_tables_keep_every_message_of_an_unbounded_one(asked: list[tuple[str, str, int, int | None, int]],
                                                                names: int, limit: int) -> None:
    bounded, unbounded = table(names, limit), table(1000, 1000)
    for t in (bounded, unbounded):
        t.add(asked_records(asked), 0.0)
    for family in unbounded.families:
        assert sum(by_family(bounded)[family].values()) == sum(by_family(unbounded)[family].values())
    assert len(bounded.names) <= names
    assert len(bounded.series) <= limit + len(bounded.families)


def test_the_text_has_every_family_with_sorted_labels_and_the_bounds() -> None:
    t = table(names=1)
    empty = render_retina_dns(t).decode()
    assert "# TYPE networkobservability_adv_dns_response_count counter" in empty
    t.add(asked_records(ASKED), 1.0)
    text = render_retina_dns(t).decode()
    assert ('networkobservability_dns_request_count{num_response="0",query="cart.shop.svc.cluster.local.",'
            'query_type="A",response="",return_code="NoError"} 3') in text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("podmeter_retina_dns_names", ())] == 1
    assert samples[("podmeter_retina_dns_names_folded_total", ())] == 2 + 2 + 1 + 1 + 1  # all but cart.: messages
