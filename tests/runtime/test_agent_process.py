"""``podmeter agent`` as a user runs it: a real process, flags and env vars, HTTP endpoints, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent_harness import Cluster
from lab_server import LabServer
from waiting import free_port, wait_for
from waiting import http_get as get


@pytest.fixture
def agent_process(lab_apiserver: LabServer, tmp_path):  # type: ignore[no-untyped-def]
    port = free_port()
    env = {**os.environ, "PODMETER_NODE_NAME": "node-a", "PODMETER_DATAPATH": "memory",
           "PODMETER_LOG_FORMAT": "json", "KUBECONFIG": str(lab_apiserver.kubeconfig)}
    log = open(tmp_path / "agent.log", "w+b")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "podmeter", "agent", "--listen", f"127.0.0.1:{port}"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    yield proc, f"http://127.0.0.1:{port}", tmp_path / "agent.log"
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


def test_agent_process_endpoints_and_sigterm(lab_apiserver: LabServer, agent_process) -> None:  # type: ignore[no-untyped-def]
    proc, url, log_path = agent_process
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop", observe=True)
    cluster.pod("shop", "web", "10.3.0.1")
    wait_for(lambda: get(url + "/readyz")[0] == 200, timeout=20, what="/readyz")
    assert get(url + "/healthz") == (200, "ok\n")
    wait_for(lambda: "10.3.0.1" in json.loads(get(url + "/debug/state")[1])["filter"]["actual"],
             what="IP in the filter")
    state = json.loads(get(url + "/debug/state")[1])
    assert state["filter"]["desired"] == {"10.3.0.1": ["shop/web"]}
    assert state["filter"]["leaked"] == [] and state["filter"]["missing"] == []
    status, metrics = get(url + "/metrics")
    assert status == 200
    assert "podmeter_filter_entries 1.0" in metrics
    assert "podmeter_filter_desired 1.0" in metrics
    assert 'podmeter_store_objects{resource="pods"} 1.0' in metrics
    assert 'podmeter_watch_relists_total{reason="initial",resource="pods"} 1.0' in metrics
    assert "process_resident_memory_bytes" in metrics
    documented = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    families = {line.split()[2] for line in metrics.splitlines() if line.startswith("# TYPE podmeter_")}
    assert "podmeter_pod_bytes_total" in families
    undocumented = sorted(f for f in families if f not in documented and f.removesuffix("_total") not in documented)
    assert not undocumented, f"series missing from docs/metrics.md: {undocumented}"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert any("stopping" in entry["msg"] for entry in lines)
    assert all({"ts", "level", "logger", "msg"} <= entry.keys() for entry in lines)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "nonsense"], "expected HOST:PORT"),
        (["--kubeconfig", "/nonexistent/kubeconfig"], "does not exist"),
        (["--filter-map-size", "0"], "must be a positive integer"),
        (["--datapath", "magic"], "invalid choice"),
    ],
)
def test_bad_flags_are_clear_errors(args: list[str], message: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    result = subprocess.run([sys.executable, "-m", "podmeter", "agent", "--node-name", "n", "--datapath", "memory",
                             *args], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert message in result.stderr


def test_unreachable_api_server_keeps_the_agent_up_and_not_ready(tmp_path) -> None:  # type: ignore[no-untyped-def]
    kubeconfig = tmp_path / "kubeconfig"
    dead = free_port()
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{dead}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "podmeter", "agent", "--node-name", "n", "--datapath", "memory",
                             "--kubeconfig", str(kubeconfig), "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: get(f"http://127.0.0.1:{port}/healthz")[0] == 200, timeout=20, what="healthz")
        assert get(f"http://127.0.0.1:{port}/readyz")[0] == 503
        assert proc.poll() is None
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "retrying in" in err
