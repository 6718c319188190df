"""Where the API server is and how to authenticate: kubeconfig, ``KUBECONFIG`` or the service account.

The maintained client library (lightkube) parses the configuration and builds the HTTP client: bearer
tokens, client certificates, CA bundles, the insecure flag, exec plugins, and the in-cluster service
account whose token file is re-read when the API server answers 401 (the kubelet rotates it). podmeter
owns only what comes after: the reflector.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.config.models import User
from lightkube.core.exceptions import ConfigError

from podmeter.adapters.kube.transport import Transport, make_transport

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Test servers only (the lab, the test suite): send credentials over plain HTTP anyway.
ALLOW_PLAIN_HTTP = "PODMETER_ALLOW_PLAIN_HTTP_CREDENTIALS"


class ConnectionConfigError(RuntimeError):
    """No usable API server configuration; the message says what was tried."""


@dataclass(frozen=True)
class Connection:
    """An API server endpoint with its credentials; ``source`` says where it came from (for logs)."""

    config: SingleConfig
    source: str

    @property
    def server(self) -> str:
        return str(self.config.cluster.server)

    def transport(self, request_timeout: float = 30.0) -> Transport:
        """The HTTP transport for the reflectors, with auth and TLS set up (see :mod:`.transport`)."""
        return make_transport(self.config, request_timeout)


def load_connection(kubeconfig: str | None, context: str | None = None, *,
                    allow_plain_http: bool = False) -> Connection:
    """The ``--kubeconfig`` flag, else ``$KUBECONFIG``, else the in-cluster service account. Credentials
    (a token or token file, basic auth, an exec plugin, an auth provider) are never sent over plain HTTP
    (kubectl does not either): such a configuration is refused, unless ``PODMETER_ALLOW_PLAIN_HTTP_CREDENTIALS``
    is set (or ``allow_plain_http``), for test servers. A client certificate with an http:// server is
    refused always: it would never be presented."""
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        return _checked(_from_file(path, context), allow_plain_http)
    if SERVICE_ACCOUNT_DIR.joinpath("token").exists() and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            config = KubeConfig.from_service_account(SERVICE_ACCOUNT_DIR).get()
        except (ConfigError, KeyError) as exc:
            raise ConnectionConfigError(f"in-cluster service account unusable: {exc}") from exc
        assert config is not None
        return Connection(config, "in-cluster service account")
    raise ConnectionConfigError(
        "no API server configured: pass --kubeconfig PATH, set KUBECONFIG, "
        "or run in a pod with a service account"
    )


def _checked(connection: Connection, allowed: bool) -> Connection:
    """Refuse what would authenticate over plain HTTP: a secret sent in the clear (a token, a password, or
    what an exec plugin or auth provider makes: a token too), unless allowed for a test server; and a client
    certificate always, which only a TLS handshake presents (over http:// every request would be anonymous,
    whatever is allowed)."""
    if not connection.server.startswith("http://") or connection.config.user is None:
        return connection
    user = connection.config.user
    if user.client_cert or user.client_cert_data or user.client_key or user.client_key_data:
        raise ConnectionConfigError(
            f"{connection.source} names a client certificate for {connection.server}, but a client certificate "
            "is presented only in a TLS handshake: over plain HTTP every request would be anonymous; use an "
            "https:// server")
    secrets = _secrets(user)
    allowed = allowed or os.environ.get(ALLOW_PLAIN_HTTP, "").lower() in ("1", "true", "yes")
    if secrets and not allowed:
        raise ConnectionConfigError(
            f"{connection.source} sends credentials ({', '.join(secrets)}) to {connection.server} over plain "
            "HTTP, where anyone on the path can read them: use an https:// server (for a test server only, set "
            f"{ALLOW_PLAIN_HTTP}=1)")
    return connection


def _secrets(user: User) -> list[str]:
    """The kinds of secret ``user`` sends with each request; exec plugins and auth providers make tokens."""
    kinds = {"a token": user.token or user.token_file, "a username and password": user.username or user.password,
             "an exec plugin's token": user.exec, "an auth provider's token": user.auth_provider}
    return [kind for kind, present in kinds.items() if present]


def _from_file(path: str, context: str | None) -> Connection:
    if not Path(path).is_file():
        raise ConnectionConfigError(f"kubeconfig {path} does not exist")
    try:
        config = KubeConfig.from_file(path).get(context_name=context)
    except (ConfigError, KeyError, ValueError, TypeError) as exc:
        raise ConnectionConfigError(f"kubeconfig {path} is not usable: {exc}") from exc
    if config is None:
        raise ConnectionConfigError(f"kubeconfig {path} has no current context")
    return Connection(config, f"kubeconfig {path}")
