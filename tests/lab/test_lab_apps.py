"""The apps step's checks (podmeter.lab.appcheck) on records shaped as the agent serves them: the payload
is a record's frames less their headers, each connection's bytes must be what its server counted and the
records must name the backend that served it; a difference of one byte is a problem. Without the
programs the step says so and is skipped. The real programs run in the shipped ``services`` scenario
(tests/lab/test_lab_services.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from podmeter.lab import appcheck
from podmeter.lab.appcheck import FRAME, SYN_OPTIONS, check_nginx, check_redis, seen
from podmeter.lab.scenario import ServiceApps
from podmeter.lab.traffic import Endpoint

pytestmark = pytest.mark.fast
CLIENT = Endpoint("shop/client-1", "10.244.0.9", "/run/netns/x")
VIP, SERVICE = "10.96.0.10", {"namespace": "shop", "name": "web-svc"}


def record(port: int, payload: int, packets: int, request: bool, pod: str = "web-1", syn: bool = True,
           ) -> dict[str, Any]:
    backend = {"ip": VIP, "port": 80, "service": SERVICE, "namespace": "shop", "pod": pod}
    client = {"ip": CLIENT.ip, "port": port, "service": None, "namespace": "shop", "pod": "client-1"}
    size = payload + FRAME * packets + (SYN_OPTIONS if syn else 0)
    return {"source": client if request else backend, "destination": backend if request else client,
            "observation": "from-pod" if request else "to-pod", "bytes": size, "packets": packets,
            "tcp_flags": ["SYN", "ACK"] if syn else ["ACK"], "verdict": "forwarded"}


def connection(port: int, sent: int, answered: int, pod: str = "web-1") -> list[dict[str, Any]]:
    """A connection's records over two drains: its SYN in the first, more segments in the second."""
    return [record(port, sent - 100, 3, True, pod), record(port, 100, 2, True, pod, syn=False),
            record(port, answered, 4, False, pod)]


def test_each_connections_bytes_and_backend_must_be_what_its_nginx_logged() -> None:
    records = [*connection(40001, 300, 7000), *connection(40002, 150, 14000, "web-2"), *connection(40003, 80, 0)]
    found = seen(records, CLIENT, VIP, "shop/web-svc", skip={40003})  # the probe: no request
    logs = {"shop/web-1": {40001: (300, 7000)}, "shop/web-2": {40002: (150, 14000)}}
    assert check_nginx(found, logs) == []
    off_by_one = {"shop/web-1": {40001: (301, 7000)}, "shop/web-2": {40002: (150, 14000)}}
    assert check_nginx(found, off_by_one) == [
        "port 40001: records carry 300 B of requests and 7000 B of responses, shop/web-1's nginx read 301 "
        "and wrote 7000"]
    swapped = {"shop/web-2": {40001: (300, 7000)}, "shop/web-1": {40002: (150, 14000)}}
    assert len(check_nginx(found, swapped)) == 2, "each connection named by the backend that served it"


def test_each_backends_bytes_must_be_what_its_redis_server_counted() -> None:
    records = [*connection(40001, 3000, 500), *connection(40002, 1000, 200), *connection(40003, 900, 90, "web-2")]
    found = seen(records, CLIENT, VIP, "shop/web-svc", skip=set())
    assert check_redis(found, {"shop/web-1": (4000, 700), "shop/web-2": (900, 90)}) == []
    assert len(check_redis(found, {"shop/web-1": (4000, 701), "shop/web-2": (900, 90)})) == 1
    unnamed = [{**r, "destination": {**r["destination"], "service": None}} for r in connection(40004, 10, 1)]
    assert any("names Service None" in p for p in check_redis(seen(unnamed, CLIENT, VIP, "shop/web-svc", set()),
                                                               {}))


def test_without_the_programs_the_step_is_skipped_and_says_which(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    step = ServiceApps(at=0, namespace="shop", backends="web", clients="client", program="redis")
    done = appcheck.run_step(step, None, None, [], lambda _: True, directory=tmp_path)  # type: ignore[arg-type]
    assert done["skipped"] == "redis-server, redis-benchmark not installed (scripts/setup.sh installs them)"
    assert "ok" not in done
