"""Client configuration: kubeconfig (token, token file, CA), KUBECONFIG, in-cluster; both transports; no
credentials over plain HTTP."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from agent_harness import AgentHarness, Cluster
from lab_server import LabServer
from podmeter.adapters.kube.connection import ConnectionConfigError, load_connection
from podmeter.adapters.kube.transport import AiohttpTransport, HttpxTransport, TransportError


def with_user(server: LabServer, path: Path, user: dict[str, object]) -> Path:
    config = yaml.safe_load(server.kubeconfig.read_text())
    config["users"][0]["user"] = user
    path.write_text(json.dumps(config))
    return path


def status_of(transport: AiohttpTransport | HttpxTransport) -> int:
    async def run() -> int:
        try:
            return (await transport.get("/api/v1/namespaces", {}, 5)).status
        finally:
            await transport.close()

    return asyncio.run(run())


def test_rotated_token_file_is_reread_on_401(lab_apiserver: LabServer, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("expired-token\n")
    kubeconfig = with_user(lab_apiserver, tmp_path / "kubeconfig", {"tokenFile": str(token_file)})
    connection = load_connection(str(kubeconfig))
    transport = connection.transport()
    assert isinstance(transport, AiohttpTransport)

    async def run() -> list[int]:
        try:
            first = (await transport.get("/api/v1/namespaces", {}, 5)).status
            token_file.write_text(lab_apiserver.token + "\n")  # the kubelet rotated it
            second = (await transport.get("/api/v1/namespaces", {}, 5)).status
            return [first, second]
        finally:
            await transport.close()

    assert asyncio.run(run()) == [401, 200]


def test_tls_with_the_kubeconfig_ca(tmp_path: Path) -> None:
    with LabServer(tls=True, process=False) as server:
        connection = load_connection(str(server.kubeconfig))
        assert connection.server.startswith("https://")
        assert status_of(connection.transport()) == 200
        untrusting = yaml.safe_load(server.kubeconfig.read_text())
        del untrusting["clusters"][0]["cluster"]["certificate-authority"]
        (tmp_path / "kc").write_text(json.dumps(untrusting))
        with pytest.raises(TransportError):  # a server whose certificate nobody vouched for
            status_of(load_connection(str(tmp_path / "kc")).transport())


def test_the_agent_works_over_tls(tmp_path: Path) -> None:
    with LabServer(tls=True, process=False) as server:
        cluster = Cluster(server)
        cluster.namespace("shop", observe=True)
        with AgentHarness(server) as agent:
            cluster.pod("shop", "web", "10.6.0.1")
            agent.wait_filter({"10.6.0.1"})


def test_httpx_transport_for_exec_credentials(lab_apiserver: LabServer, tmp_path: Path) -> None:
    """Exec plugins are run by lightkube: its httpx client is the transport then."""
    plugin = tmp_path / "credential-plugin"
    plugin.write_text("#!/bin/sh\nprintf '%s' '" + json.dumps({
        "apiVersion": "client.authentication.k8s.io/v1beta1", "kind": "ExecCredential",
        "status": {"token": lab_apiserver.token}}) + "'\n")
    plugin.chmod(0o755)
    kubeconfig = with_user(lab_apiserver, tmp_path / "kubeconfig", {
        "exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": str(plugin)}})
    transport = load_connection(str(kubeconfig)).transport()
    assert isinstance(transport, HttpxTransport)
    assert status_of(transport) == 200


def test_kubeconfig_from_the_environment(lab_apiserver: LabServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(lab_apiserver.kubeconfig))
    assert load_connection(None).source == f"kubeconfig {lab_apiserver.kubeconfig}"


def test_nothing_configured_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConnectionConfigError, match="pass --kubeconfig"):
        load_connection(None)


def test_unusable_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "kc").write_text("apiVersion: v1\nkind: Config\nclusters: 7\n")
    with pytest.raises(ConnectionConfigError, match=r"not usable|no current context"):
        load_connection(str(tmp_path / "kc"))


def test_credentials_over_plain_http_are_refused_unless_allowed_for_a_test_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from podmeter.adapters.kube.connection import ALLOW_PLAIN_HTTP

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://10.0.0.1:8080'}}]\n"
        "users: [{name: u, user: {token: secret}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n")
    monkeypatch.delenv(ALLOW_PLAIN_HTTP, raising=False)
    with pytest.raises(ConnectionConfigError, match="over plain HTTP"):
        load_connection(str(kubeconfig))
    monkeypatch.setenv(ALLOW_PLAIN_HTTP, "1")
    assert load_connection(str(kubeconfig)).server == "http://10.0.0.1:8080"
    monkeypatch.delenv(ALLOW_PLAIN_HTTP)
    kubeconfig.write_text(kubeconfig.read_text().replace("{token: secret}", "{}"))
    assert load_connection(str(kubeconfig)).server == "http://10.0.0.1:8080"  # no credentials: nothing to leak


EXEC = {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "/bin/false"}
PLAIN_HTTP_CREDENTIALS = {
    "token file": ({"tokenFile": "/nonexistent/token"}, "a token"),
    "basic auth": ({"username": "admin", "password": "secret"}, "a username and password"),
    "exec plugin": ({"exec": EXEC}, "an exec plugin's token"),
    "auth provider": ({"auth-provider": {"name": "oidc", "config": {"id-token": "secret"}}},
                      "an auth provider's token"),
}


def plain_http_kubeconfig(path: Path, user: dict[str, object]) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "http://10.0.0.1:8080"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return path


@pytest.mark.parametrize("user, named", PLAIN_HTTP_CREDENTIALS.values(), ids=PLAIN_HTTP_CREDENTIALS.keys())
def test_every_kind_of_credential_over_plain_http_is_refused_unless_allowed(
        user: dict[str, object], named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An exec plugin or an auth provider makes a token that would travel in the clear like a written one.
    from podmeter.adapters.kube.connection import ALLOW_PLAIN_HTTP

    kubeconfig = plain_http_kubeconfig(tmp_path / "kubeconfig", user)
    monkeypatch.delenv(ALLOW_PLAIN_HTTP, raising=False)
    with pytest.raises(ConnectionConfigError, match=rf"sends credentials \({named}\) .* over plain HTTP"):
        load_connection(str(kubeconfig))
    monkeypatch.setenv(ALLOW_PLAIN_HTTP, "1")
    assert load_connection(str(kubeconfig)).server == "http://10.0.0.1:8080"


@pytest.mark.parametrize("user", [
    {"client-certificate": "/tmp/client.crt", "client-key": "/tmp/client.key"},
    {"client-certificate-data": "Y2VydA==", "client-key-data": "a2V5"},
], ids=["files", "data"])
def test_a_client_certificate_with_a_plain_http_server_is_refused_even_when_allowed(
        user: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No TLS handshake, no certificate presented: the agent would run anonymous, not with less security.
    from podmeter.adapters.kube.connection import ALLOW_PLAIN_HTTP

    monkeypatch.setenv(ALLOW_PLAIN_HTTP, "1")
    with pytest.raises(ConnectionConfigError, match=r"client certificate .* every request would be anonymous"):
        load_connection(str(plain_http_kubeconfig(tmp_path / "kubeconfig", user)))
