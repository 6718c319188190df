"""The lab's own HTTP client over TLS: it verifies the server by the kubeconfig's CA, keeps one connection
(one handshake) per thread, and follows the product's credential rules (no token over plain HTTP without
the test servers' allowance; exec plugins and auth providers refused with a clear error)."""

from __future__ import annotations

import http.server
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from podmeter.adapters.kube.connection import ALLOW_PLAIN_HTTP, ConnectionConfigError
from podmeter.lab.apiserver.server import TlsFiles, generate_self_signed
from podmeter.lab.kube import KubeClient, KubeError


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_GET(self) -> None:
        body = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class TlsServer(http.server.ThreadingHTTPServer):
    """HTTPS on loopback that counts the connections whose handshake succeeded."""

    daemon_threads = True

    def __init__(self, tls: TlsFiles) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(tls.cert), str(tls.key))
        self.socket = context.wrap_socket(self.socket, server_side=True)
        self.handshakes = 0

    def get_request(self) -> tuple[ssl.SSLSocket, object]:
        request = super().get_request()  # the handshake happens here (and raises when the client refuses)
        self.handshakes += 1
        return request  # type: ignore[return-value]

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def tls(tmp_path: Path) -> TlsFiles:
    return generate_self_signed(tmp_path / "tls", "127.0.0.1")


@pytest.fixture
def server(tls: TlsFiles) -> Iterator[TlsServer]:
    running = TlsServer(tls)
    threading.Thread(target=running.serve_forever, daemon=True).start()
    yield running
    running.shutdown()
    running.server_close()


def test_requests_share_one_tls_connection_verified_by_the_ca(server: TlsServer, tls: TlsFiles) -> None:
    client = KubeClient(server.url, "t", str(tls.cert), timeout=5)
    assert [client.list(f"/x{i}")["path"] for i in range(50)] == [f"/x{i}" for i in range(50)]
    assert server.handshakes == 1


def test_a_server_the_ca_does_not_vouch_for_is_refused(server: TlsServer, tmp_path: Path) -> None:
    other = generate_self_signed(tmp_path / "other", "127.0.0.1")  # same name, another key: not the server
    for ca in (None, str(other.cert)):  # the system's CAs, and a CA that signed another certificate
        with pytest.raises(KubeError, match="CERTIFICATE_VERIFY_FAILED") as caught:
            KubeClient(server.url, "t", ca, timeout=5).list("/x")
        assert caught.value.status == 0


def kubeconfig(path: Path, server: str, user: dict[str, object]) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return path


def test_a_token_over_plain_http_needs_the_test_servers_allowance(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = kubeconfig(tmp_path / "kc", "http://127.0.0.1:9", {"token": "secret"})
    monkeypatch.delenv(ALLOW_PLAIN_HTTP, raising=False)
    with pytest.raises(ConnectionConfigError, match="over plain HTTP"):
        KubeClient.from_kubeconfig(str(path))
    monkeypatch.setenv(ALLOW_PLAIN_HTTP, "1")
    assert KubeClient.from_kubeconfig(str(path)).token == "secret"


@pytest.mark.parametrize("user", [
    {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "/bin/false"}},
    {"auth-provider": {"name": "oidc", "config": {}}},
], ids=["exec", "auth-provider"])
def test_exec_plugins_and_auth_providers_are_refused_clearly(user: dict[str, object], tmp_path: Path) -> None:
    path = kubeconfig(tmp_path / "kc", "https://127.0.0.1:9", user)
    with pytest.raises(ConnectionConfigError, match="not an exec plugin or an auth provider"):
        KubeClient.from_kubeconfig(str(path))
