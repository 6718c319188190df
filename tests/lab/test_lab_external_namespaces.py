"""A real API server finalizes namespaces asynchronously: the lab against one waits, at its teardown, until
the namespaces it deleted are gone, and a run that finds a previous run's namespaces still terminating
waits for them instead of refusing. The client here is a seam that answers like such a server (the
embedded API server finalizes at once; tests/lab/test_lab_cluster.py runs the lab against it for real)."""

from __future__ import annotations

from typing import Any

import pytest

from podmeter.lab import external
from podmeter.lab.external import LAB_LABEL, ExternalCluster, ExternalError


class SlowFinalizingClient:
    """Namespaces that, once deleted, stay Terminating for ``polls`` more reads (``None``: for ever)."""

    server = "https://api.example:6443"

    def __init__(self, polls: int | None) -> None:
        self.polls = polls
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.left: dict[str, int | None] = {}

    def add(self, name: str, labels: dict[str, str], terminating: bool = False) -> None:
        meta: dict[str, Any] = {"name": name, "labels": labels}
        if terminating:
            meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
            self.left[name] = self.polls
        self.namespaces[name] = {"metadata": meta, "status": {"phase": "Terminating" if terminating else "Active"}}

    def get(self, path: str) -> dict[str, Any] | None:
        name = path.rsplit("/", 1)[-1]
        if not path.startswith("/api/v1/namespaces/") or name not in self.namespaces:
            return None
        if name in self.left:
            left = self.left[name]
            if left is not None and left <= 0:
                del self.namespaces[name], self.left[name]
                return None
            self.left[name] = None if left is None else left - 1
        return self.namespaces[name]

    def list(self, path: str, **_: str) -> dict[str, Any]:
        return {"items": []}

    def delete(self, path: str, grace_seconds: int | None = None) -> None:
        name = path.rsplit("/", 1)[-1]
        if path.startswith("/api/v1/namespaces/") and name in self.namespaces:
            labels = self.namespaces[name]["metadata"]["labels"]
            self.add(name, labels, terminating=True)


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(external, "PROGRESS_S", 0.0)
    monkeypatch.setattr(external, "POLL_S", 0.001)


def test_teardown_waits_until_the_namespaces_are_gone_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    client = SlowFinalizingClient(polls=5)
    lab = ExternalCluster(client, "pmlab1")  # type: ignore[arg-type]
    client.add("web", {LAB_LABEL: "pmlab1"})
    assert lab.cleanup(["web"]) == []
    assert "web" not in client.namespaces
    assert "waiting for the lab's namespaces to be gone" in capsys.readouterr().out


def test_a_namespace_that_never_goes_is_reported_not_waited_for_for_ever(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(external, "NAMESPACE_GONE_S", 0.05)
    client = SlowFinalizingClient(polls=None)
    lab = ExternalCluster(client, "pmlab1")  # type: ignore[arg-type]
    client.add("web", {LAB_LABEL: "pmlab1"})
    (problem,) = lab.cleanup(["web"])
    assert "namespace web: still terminating" in problem


def test_a_previous_runs_terminating_namespace_is_waited_for_a_foreign_one_refused() -> None:
    client = SlowFinalizingClient(polls=3)
    client.add("web", {LAB_LABEL: "pmlab0"}, terminating=True)  # the run before this one's
    lab = ExternalCluster(client, "pmlab1")  # type: ignore[arg-type]
    assert lab._terminating_lab_namespaces(["web"]) == ["web"]
    assert lab._wait_gone(["web"], "a previous lab run's namespaces") == []
    client.add("jobs", {}, terminating=True)  # not the lab's: never waited for (prepare refuses it as taken)
    client.add("quiet", {LAB_LABEL: "pmlab0"})  # the lab's, but alive: taken
    assert lab._terminating_lab_namespaces(["jobs", "quiet"]) == []
    with pytest.raises(ExternalError, match="namespace jobs, quiet already exists"):
        lab.prepare(["jobs", "quiet"], [])
