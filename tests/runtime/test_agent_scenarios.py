"""The agent over real HTTP against the lab API server: F1, F2 and F17 of docs/design.md as users meet them."""

from __future__ import annotations

import pytest

from agent_harness import AgentHarness, Cluster, wait_for
from lab_server import LabServer


def test_a_namespace_annotation_removed_then_pod_deleted(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop", observe=True)
    with AgentHarness(lab_apiserver) as agent:
        cluster.pod("shop", "web", "10.1.0.5")
        agent.wait_filter({"10.1.0.5"})
        cluster.annotate_namespace("shop", None)
        agent.wait_filter(set())
        cluster.pod("shop", "other", "10.1.0.6")
        cluster.delete_pod("shop", "web")
        wait_for(lambda: agent.state()["pods"] == 1, what="web deleted from the store")
        assert agent.filter() == set()


def test_b_include_list_changed_then_pod_deleted(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop")
    cluster.namespace("blog")
    assert cluster.configuration({"namespaces": {"include": ["shop"]}}) in (200, 201)
    with AgentHarness(lab_apiserver) as agent:
        cluster.pod("shop", "web", "10.1.0.5")
        cluster.pod("blog", "post", "10.1.0.7")
        agent.wait_filter({"10.1.0.5"})
        cluster.configuration({"namespaces": {"include": ["blog"]}})
        agent.wait_filter({"10.1.0.7"})
        cluster.delete_pod("shop", "web")
        cluster.delete_pod("blog", "post")
        agent.wait_filter(set())
        assert agent.state()["pods"] == 0


def test_c_pod_annotation_removed_then_pod_deleted(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop")
    with AgentHarness(lab_apiserver) as agent:
        cluster.pod("shop", "web", "10.1.0.5", observe=True)
        agent.wait_filter({"10.1.0.5"})
        cluster.annotate_pod("shop", "web", None)
        agent.wait_filter(set())
        cluster.delete_pod("shop", "web")
        wait_for(lambda: agent.state()["pods"] == 0, what="web deleted from the store")
        assert agent.filter() == set()


def test_only_this_nodes_pods_are_watched(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop", observe=True)
    cluster.pod("shop", "elsewhere", "10.1.0.9", node="node-b")
    with AgentHarness(lab_apiserver) as agent:
        cluster.pod("shop", "here", "10.1.0.5")
        agent.wait_filter({"10.1.0.5"})
        assert agent.state()["pods"] == 1
    reads = [r for r in lab_apiserver.admin.requests(resource="pods") if r["verb"] in ("list", "watch")]
    assert reads and all(r["query"].get("fieldSelector") == "spec.nodeName=node-a" for r in reads)


def test_invalid_configuration_keeps_the_last_valid_one(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop")
    cluster.configuration({"namespaces": {"include": ["shop"]}})
    with AgentHarness(lab_apiserver) as agent:
        cluster.pod("shop", "web", "10.1.0.5")
        agent.wait_filter({"10.1.0.5"})
        status = cluster.configuration({"namespaces": {"include": ["shop"], "exclude": ["blog"]}})
        if status >= 300:
            pytest.skip("the API server rejected the invalid spec at admission")
        wait_for(lambda: agent.state()["reflectors"]["metricsconfigurations"]["decode_errors"] >= 1,
                 what="invalid configuration counted")
        assert agent.filter() == {"10.1.0.5"}
        assert agent.state()["configuration"]["include"] == ["shop"]
