"""Whoever can write one PodSlice cannot stop an agent: a slice the API server accepts (by the shipped CRD's
schema) but the agent cannot use is counted and skipped, the other slices applied, before and after a
restart. The two keys found in the field: an identity key of another script's digits ("²") and one of
5,000 digits (``int`` refuses both with a ValueError, which once escaped the reflector)."""

from __future__ import annotations

from typing import Any

import pytest

from agent_harness import AgentHarness
from lab_server import LabServer
from waiting import wait_for

SLICES = "/apis/podmeter.io/v1alpha1/podslices"
HOSTILE_KEYS = ["\u00b2", "1" * 5000]


def slice_object(name: str, ip: str, identities: dict[str, Any]) -> dict[str, Any]:
    endpoint = {"uid": f"u-{name}", "namespace": "shop", "name": f"pod-{name}", "ips": [ip], "node": "node-b",
                "workloadKind": "Deployment", "workload": "web", "identity": 300}
    return {"apiVersion": "podmeter.io/v1alpha1", "kind": "PodSlice", "metadata": {"name": name},
            "spec": {"endpoints": [endpoint], "identities": identities}}


def create(server: LabServer, body: dict[str, Any]) -> None:
    status, _, answer = server.request("POST", SLICES, body)
    assert status == 201, answer


def cached(harness: AgentHarness) -> set[str]:
    return set(harness.on_loop(harness.agent.debug_endpoints)["endpoints"])


def decode_errors(harness: AgentHarness) -> int:
    for reflector in harness.agent._reflectors:
        if reflector.kind.name == "podslices":
            return int(reflector.stats.decode_errors)
    raise AssertionError("the agent has no PodSlice reflector")


@pytest.mark.parametrize("key", HOSTILE_KEYS, ids=["superscript-two", "5000-digits"])
def test_a_slice_with_a_hostile_identity_key_is_skipped_and_the_rest_applied(lab_apiserver: LabServer,
                                                                              key: str) -> None:
    labels = {"namespace": "shop", "labels": {"app": "web"}}
    create(lab_apiserver, slice_object("pods-2-0", "10.9.0.1", {"300": labels}))
    with AgentHarness(lab_apiserver) as harness:
        wait_for(lambda: cached(harness) == {"10.9.0.1"}, what="the good slice in the cache")
        create(lab_apiserver, slice_object("pods-2-1", "10.9.0.2", {key: labels}))
        create(lab_apiserver, slice_object("pods-4-0", "10.9.0.3", {"300": labels}))  # after it: still applied
        wait_for(lambda: cached(harness) == {"10.9.0.1", "10.9.0.3"}, what="the slice after the hostile one",
                 describe=lambda: f"cache {sorted(cached(harness))}")
        assert decode_errors(harness) == 1
    # A restarted agent meets the hostile slice in its first list: it becomes ready and applies the rest.
    with AgentHarness(lab_apiserver) as restarted:
        wait_for(lambda: cached(restarted) == {"10.9.0.1", "10.9.0.3"}, what="the cache after a restart")
        assert decode_errors(restarted) == 1
