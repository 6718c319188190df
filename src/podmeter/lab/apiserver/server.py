"""Listening: the TCP (optionally TLS) site, the kubeconfig the server writes for itself, restart.

``restart`` is the fault "the API server went away and came back": every connection is dropped and the
listener is closed for ``down`` seconds, then reopened on the same address; objects, resourceVersions and
history are kept, as they would be in etcd.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import ssl
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml
from aiohttp import web

from podmeter.lab.apiserver.app import LabApiServer, Settings


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path


def generate_self_signed(directory: Path, host: str) -> TlsFiles:
    """A self-signed certificate for ``host`` (an IP or a name), made by the openssl CLI (argv, no shell)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "apiserver.crt", directory / "apiserver.key"
    san = f"IP:{host}" if host.replace(".", "").isdigit() or ":" in host else f"DNS:{host}"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "30",
            "-subj",
            "/CN=podmeter-lab-apiserver",
            "-addext",
            f"subjectAltName={san},DNS:localhost",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    key.chmod(0o600)
    return TlsFiles(cert, key)


def kubeconfig(url: str, token: str, ca_file: Path | None, *, beside: Path | None = None) -> dict[str, object]:
    """The kubeconfig of a lab API server. ``beside``: where the kubeconfig will live, so that the CA's path
    resolves by the readers' rule (kubectl's and podmeter's): relative paths in a kubeconfig are relative to
    the kubeconfig's own directory, never to the writer's working directory."""
    cluster: dict[str, object] = {"server": url}
    if ca_file is not None:
        cluster["certificate-authority"] = kubeconfig_path(ca_file, beside)
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "preferences": {},
        "clusters": [{"name": "podmeter-lab", "cluster": cluster}],
        "users": [{"name": "podmeter-lab", "user": {"token": token}}],
        "contexts": [
            {
                "name": "podmeter-lab",
                "context": {"cluster": "podmeter-lab", "user": "podmeter-lab", "namespace": "default"},
            }
        ],
        "current-context": "podmeter-lab",
    }


def kubeconfig_path(target: Path, kubeconfig_file: Path | None) -> str:
    """How a kubeconfig at ``kubeconfig_file`` names ``target``: relative to the kubeconfig's directory when
    the target lies under it (the directory can be moved or copied whole, a lab report's is), else absolute."""
    target = target.resolve()
    if kubeconfig_file is None:
        return str(target)
    home = kubeconfig_file.resolve().parent
    return str(target.relative_to(home)) if target.is_relative_to(home) else str(target)


def write_kubeconfig(path: Path, url: str, token: str, ca_file: Path | None) -> None:
    """Atomically write the kubeconfig (mode 0600: it holds the token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kubeconfig-")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(kubeconfig(url, token, ca_file, beside=path), f, sort_keys=False)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


class RunningServer:
    """An :class:`LabApiServer` bound to a host and port, able to drop everything and come back."""

    def __init__(self, lab: LabApiServer, host: str, port: int, tls: TlsFiles | None = None) -> None:
        self.lab = lab
        self.host = host
        self.port = port
        self.tls = tls
        self.ssl_context: ssl.SSLContext | None = None
        if tls is not None:
            self.ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self.ssl_context.load_cert_chain(str(tls.cert), str(tls.key))
        # One access-log line per request, only when the process logs at INFO (``podmeter apiserver -v``).
        access = logging.getLogger("podmeter.lab.apiserver.access")
        self.runner = web.AppRunner(
            lab.make_app(),
            handle_signals=False,
            access_log=access if access.isEnabledFor(logging.INFO) else None,
            access_log_format='%a "%r" %s %b %Tf',
            shutdown_timeout=0.5,
        )
        self.site: web.TCPSite | None = None
        lab.restart_hook = self.restart

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> None:
        await self.runner.setup()
        await self._listen()

    async def _listen(self) -> None:
        self.site = web.TCPSite(self.runner, self.host, self.port, ssl_context=self.ssl_context, reuse_address=True)
        await self.site.start()
        if self.port == 0:
            server = self.site._server
            sockets = getattr(server, "sockets", None) or []
            self.port = sockets[0].getsockname()[1]
        self.lab.settings.server_address = f"{self.host}:{self.port}"

    async def restart(self, down: float) -> None:
        """Drop every connection and the listener; listen again after ``down`` seconds."""
        await asyncio.sleep(0.05)  # let the admin response that asked for this go out first
        if self.site is not None:
            await self.site.stop()
        server = self.runner.server
        if server is not None:
            await server.shutdown(0.1)
        await asyncio.sleep(down)
        await self._listen()

    async def stop(self) -> None:
        self.lab.hub.close_all("shutdown", abort=True)
        await self.runner.cleanup()


def new_token() -> str:
    return secrets.token_urlsafe(24)


async def serve_forever(
    settings: Settings,
    host: str,
    port: int,
    *,
    kubeconfig_out: Path | None,
    tls_dir: Path | None,
    ready: asyncio.Event | None = None,
) -> None:
    """Run until cancelled. Writes the kubeconfig once the port is known (so a reader can connect)."""
    tls = generate_self_signed(tls_dir, host) if tls_dir is not None else None
    running = RunningServer(LabApiServer(settings), host, port, tls)
    await running.start()
    if kubeconfig_out is not None:
        write_kubeconfig(kubeconfig_out, running.url, settings.token, tls.cert if tls else None)
    print(f"podmeter apiserver: listening on {running.url}", flush=True)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await running.stop()
