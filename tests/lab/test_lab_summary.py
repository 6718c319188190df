"""The lab's terminal summary names a failed traffic check in words people read, never a Python repr."""

from __future__ import annotations

from types import SimpleNamespace

from podmeter.cli.lab import failed_check_text, failed_checks


def test_a_failed_exchange_reads_as_what_was_expected_and_what_was_counted() -> None:
    check = {"protocol": "udp", "src": "shop/web-1", "dst": "shop/db-0", "src_ip": "10.0.0.1", "dst_ip": "10.0.0.2",
             "ports": [40000, 9000], "delivered": 100, "src_egress": [100, 12800], "dst_ingress": [99, 12672],
             "expected": [100, 12800], "ok": False,
             "flow": {"ok": False, "problems": [f"problem {i}" for i in range(5)], "records": 2}}
    text = failed_check_text(check)
    assert text.startswith("udp shop/web-1 -> shop/db-0: expected 100 pkts 12,800 B, counted src_egress 100 pkts")
    assert "dst_ingress 99 pkts 12,672 B" in text and "delivered 100" in text
    assert "problem 0; problem 1; problem 2; 2 more problems in the report" in text
    assert "{" not in text and "[" not in text


def test_a_check_that_could_not_run_says_why() -> None:
    check = {"protocol": "udp", "kind": "reuse-during-flow", "src": "-", "dst": "shop/db-0", "ok": False,
             "expected": [20, 2560], "problem": "pod A never ran with an IP the agent knew within 30 s"}
    assert failed_check_text(check) == ("reuse-during-flow - -> shop/db-0: pod A never ran with an IP the agent "
                                        "knew within 30 s; expected 20 pkts 2,560 B")
    assert failed_check_text({"protocol": "tcp", "ok": False}) == "tcp - -> -: failed (see the report)"


def test_a_failed_service_step_names_its_client_service_and_problems() -> None:
    check = {"kind": "apps-nginx", "protocol": "tcp", "service": "shop/store-svc", "client": "shop/shopper-21",
             "ok": False, "problems": ["RuntimeError: shop/store-18: nginx did not listen (see lab-report/x)"]}
    assert failed_check_text(check) == ("apps-nginx shop/shopper-21 -> shop/store-svc: RuntimeError: shop/store-18: "
                                        "nginx did not listen (see lab-report/x)")


def test_only_the_failed_checks_of_a_run_are_listed() -> None:
    run = SimpleNamespace(traffic=[{"protocol": "udp", "ok": True}, {"protocol": "tcp", "skipped": "memory mode"},
                                   {"protocol": "tcp", "ok": False}])
    assert failed_checks(run) == ["tcp - -> -: failed (see the report)"]


def test_a_failed_reuse_check_reads_each_holders_counts_in_order() -> None:
    check = {"protocol": "udp", "kind": "reuse-during-flow", "src": "web/reuse-1 then web/reuse-2", "dst": "web/api-7",
             "expected": [30, 10260], "src_egress": [[30, 10260], [0, 0]], "dst_ingress": [60, 20520], "ok": False}
    assert failed_check_text(check) == (
        "reuse-during-flow web/reuse-1 then web/reuse-2 -> web/api-7: expected 30 pkts 10,260 B, counted "
        "src_egress 30 pkts 10,260 B then 0 pkts 0 B, dst_ingress 60 pkts 20,520 B")
