"""The etcd backend over TLS with client certificates and with an etcd user, against a real etcd whose
certificates are made here with openssl; the options' rules and their errors; the operator process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from etcd_server import ETCD, EtcdServer, Pki, pki
from lab_server import LabServer
from operator_support import OperatorProcess
from podmeter.adapters.identity.base import IdentityBackendError
from podmeter.adapters.identity.etcd import EtcdIdentityBackend
from podmeter.adapters.identity.etcd_access import EtcdAccess, EtcdAccessError
from podmeter.model.identity import IdentityKey
from waiting import free_port, http_get, stop_process, wait_for

__all__ = ["pki"]

PASSWORD = "s3cret-podmeter"
needs_etcd = pytest.mark.skipif(not Path(ETCD).exists(), reason="etcd is not installed (apt-get install etcd-server)")


def key(i: int) -> IdentityKey:
    return IdentityKey("ns", ("app", f"a{i}"))


@contextlib.contextmanager
def server(tmp_path: Path, name: str, **kw: object) -> Iterator[EtcdServer]:
    workdir = tmp_path / name
    workdir.mkdir()
    etcd = EtcdServer(workdir, **kw)  # type: ignore[arg-type]
    etcd.start()
    try:
        yield etcd
    finally:
        etcd.stop()


@pytest.fixture
def etcd_mtls(tmp_path: Path, pki: Pki) -> Iterator[EtcdServer]:
    """TLS only, and only clients with a certificate of the test CA."""
    with server(tmp_path, "mtls", pki=pki, client_cert_auth=True) as etcd:
        yield etcd


@pytest.fixture
def etcd_users(tmp_path: Path, pki: Pki) -> Iterator[EtcdServer]:
    """TLS (no client certificates), authentication on, user podmeter; tokens expire after 2 s idle."""
    with server(tmp_path, "users", pki=pki, users={"podmeter": PASSWORD},
                extra_args=["--auth-token-ttl=2"]) as etcd:
        yield etcd


@pytest.fixture
async def backends() -> AsyncIterator[Callable[..., EtcdIdentityBackend]]:
    made: list[EtcdIdentityBackend] = []

    def make(etcd: EtcdServer, access: EtcdAccess, **kw: object) -> EtcdIdentityBackend:
        b = EtcdIdentityBackend([etcd.endpoint], lease_ttl=3, timeout=3, access=access, **kw)  # type: ignore[arg-type]
        made.append(b)
        return b

    yield make
    for b in made:
        await b.close()


def mtls_access(pki: Pki) -> EtcdAccess:
    return EtcdAccess(cacert=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key))


def password_file(tmp_path: Path, password: str) -> str:
    path = tmp_path / f"password-{len(list(tmp_path.glob('password-*')))}"
    path.write_text(password + "\n")  # as `echo` writes it: the newline is not part of the password
    return str(path)


# -- TLS with client certificates ---------------------------------------------------------------------------


@needs_etcd
async def test_tls_with_client_certificates(etcd_mtls: EtcdServer, pki: Pki,
                                            backends: Callable[..., EtcdIdentityBackend]) -> None:
    assert etcd_mtls.endpoint.startswith("https://")
    a, b = backends(etcd_mtls, mtls_access(pki), owner="a"), backends(etcd_mtls, mtls_access(pki), owner="b")
    await asyncio.gather(a.start(), b.start())
    got_a = {k: await a.acquire(k) for k in map(key, range(5))}
    got_b = {k: await b.acquire(k) for k in map(key, range(4, -1, -1))}
    assert got_a == got_b and sorted(got_a.values()) == list(range(256, 261))
    assert await a.identities() == {v: k for k, v in got_a.items()}
    await a.release(key(0))
    await b.release(key(0))
    assert (await a.gc(), await a.gc()) == (0, 1)
    assert await a.references() == {key(i): {"a", "b"} for i in range(1, 5)}


@needs_etcd
async def test_a_client_without_a_certificate_is_refused_with_a_clear_error(
    etcd_mtls: EtcdServer, pki: Pki, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    anonymous = backends(etcd_mtls, EtcdAccess(cacert=str(pki.ca)))
    with pytest.raises(IdentityBackendError, match=r"TLS handshake failed: the server refused this client's "
                                                   r"certificate \(none was given: --etcd-cert, --etcd-key\)"):
        await anonymous.start()
    stranger = backends(etcd_mtls, EtcdAccess(cacert=str(pki.ca), cert=str(pki.other_client_cert),
                                              key=str(pki.other_client_key)))
    with pytest.raises(IdentityBackendError, match=r"refused this client's certificate \(--etcd-cert .*stranger"):
        await stranger.start()
    # the backend stays usable: once the certificate is there (a Secret mounted late), it connects
    late = backends(etcd_mtls, mtls_access(pki))
    await late.start()
    assert await late.acquire(key(1)) == 256


@needs_etcd
async def test_a_server_certificate_of_another_ca_is_a_clear_error(
    etcd_mtls: EtcdServer, pki: Pki, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    wrong = backends(etcd_mtls, EtcdAccess(cacert=str(pki.other_ca), cert=str(pki.client_cert),
                                           key=str(pki.client_key)))
    with pytest.raises(IdentityBackendError,
                       match=r"the server's certificate is not trusted by --etcd-cacert .*other-ca\.crt"):
        await wrong.start()
    system = backends(etcd_mtls, EtcdAccess(cert=str(pki.client_cert), key=str(pki.client_key)))
    with pytest.raises(IdentityBackendError, match=r"not trusted by the system's CAs \(no --etcd-cacert\)"):
        await system.start()


@needs_etcd
async def test_tls_to_a_plain_server_and_plain_to_a_tls_server_say_so(
    tmp_path: Path, etcd_mtls: EtcdServer, pki: Pki, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    with server(tmp_path, "plain") as plain:
        tls_to_plain = EtcdIdentityBackend([plain.endpoint.replace("http://", "https://")], timeout=3,
                                           access=EtcdAccess(cacert=str(pki.ca)))
        with pytest.raises(IdentityBackendError, match="does the server speak TLS on this port"):
            await tls_to_plain.start()
        await tls_to_plain.close()
    plain_to_tls = EtcdIdentityBackend([etcd_mtls.endpoint.replace("https://", "http://")], timeout=3)
    with pytest.raises(IdentityBackendError, match=r"if the server speaks TLS, use https://"):
        await plain_to_tls.start()
    await plain_to_tls.close()


# -- an etcd user ---------------------------------------------------------------------------------------------


@needs_etcd
async def test_username_and_password(etcd_users: EtcdServer, pki: Pki, tmp_path: Path,
                                     backends: Callable[..., EtcdIdentityBackend],
                                     caplog: pytest.LogCaptureFixture) -> None:
    access = EtcdAccess(cacert=str(pki.ca), username="podmeter", password_file=password_file(tmp_path, PASSWORD))
    a = backends(etcd_users, access, owner="a")
    await a.start()
    assert [await a.acquire(key(i)) for i in range(3)] == [256, 257, 258]
    assert await a.identities() == {256 + i: key(i) for i in range(3)}
    # etcd's token expires after --auth-token-ttl idle seconds: the backend authenticates again by itself
    await asyncio.sleep(3)
    with caplog.at_level(logging.INFO, "podmeter.adapters.identity.etcd"):
        assert await a.acquire(key(3)) == 259
    assert "authenticating again" in caplog.text
    await a.release(key(3))
    assert (await a.gc(), await a.gc()) == (0, 1)


@needs_etcd
async def test_a_wrong_password_or_no_user_is_a_clear_error(
    etcd_users: EtcdServer, pki: Pki, tmp_path: Path, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    path = password_file(tmp_path, "not-the-password")
    wrong = backends(etcd_users, EtcdAccess(cacert=str(pki.ca), username="podmeter", password_file=path))
    with pytest.raises(IdentityBackendError,
                       match=r"user 'podmeter' was refused: wrong name or password .*--etcd-password-file"):
        await wrong.start()
    Path(path).write_text(PASSWORD)  # the Secret is fixed: the file is read again at the next connection
    await wrong.start()
    assert await wrong.acquire(key(1)) == 256
    nobody = backends(etcd_users, EtcdAccess(cacert=str(pki.ca)))
    with pytest.raises(IdentityBackendError, match=r"the server requires an etcd user \(--etcd-username"):
        await nobody.start()


@needs_etcd
async def test_a_user_without_permission_on_the_prefix_is_a_clear_error(
    etcd_users: EtcdServer, pki: Pki, tmp_path: Path, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    access = EtcdAccess(cacert=str(pki.ca), username="podmeter", password_file=password_file(tmp_path, PASSWORD))
    outside = backends(etcd_users, access, prefix="/elsewhere/identities/")
    with pytest.raises(IdentityBackendError, match=r"user 'podmeter' may not read and write podmeter's keys"):
        await outside.start()


@needs_etcd
async def test_with_client_certificates_and_users_the_certificate_names_the_user(
    tmp_path: Path, pki: Pki, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    """etcd takes a client certificate's CN as the user when no password is given: no password file."""
    with server(tmp_path, "both", pki=pki, client_cert_auth=True, users={"podmeter": PASSWORD}) as etcd:
        a = backends(etcd, mtls_access(pki))
        await a.start()
        assert await a.acquire(key(1)) == 256
        outside = backends(etcd, mtls_access(pki), prefix="/elsewhere/")
        with pytest.raises(IdentityBackendError, match="the user named by the client certificate's CN may not"):
            await outside.start()


# -- connections ----------------------------------------------------------------------------------------------


async def test_a_dropped_connection_does_not_cancel_the_requests_still_on_it() -> None:
    """Closing a gRPC channel cancels its requests (their callers would see CancelledError, as if their task
    was cancelled): a client dropped after a failure is closed only once its requests have timed out."""
    import grpc.aio

    async def never(request: bytes, context: object) -> bytes:
        await asyncio.sleep(60)
        return b""

    slow = grpc.aio.server()  # an etcd whose Range never answers
    slow.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("etcdserverpb.KV", {
        "Range": grpc.unary_unary_rpc_method_handler(never)})])
    port = slow.add_insecure_port("127.0.0.1:0")
    await slow.start()
    try:
        b = EtcdIdentityBackend([f"http://127.0.0.1:{port}"], timeout=1)
        b._lease_id = 1
        pending = asyncio.create_task(b.acquire(key(1)))
        await asyncio.sleep(0.3)  # the request is on the wire
        await b._drop_client(rotate=False)  # as the keepalive does after a connection failure
        with pytest.raises(IdentityBackendError, match="ConnectionTimeoutError"):
            await pending
        await b.close()
    finally:
        await slow.stop(None)


# -- the options -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("access", "urls", "message"), [
    (EtcdAccess(cacert="ca.crt"), ["http://etcd:2379"], "--etcd-cacert given, but the etcd endpoints are http://"),
    (EtcdAccess(cert="c.crt"), ["https://etcd:2379"], "--etcd-cert and --etcd-key go together"),
    (EtcdAccess(key="c.key"), ["https://etcd:2379"], "--etcd-cert and --etcd-key go together"),
    (EtcdAccess(username="u"), ["https://etcd:2379"], "--etcd-username and --etcd-password-file go together"),
    (EtcdAccess(username="u", password_file="p"), ["http://etcd:2379"], "never sent in clear"),
    (EtcdAccess(username="u", password_file="p"), ["etcd:2379"], "never sent in clear"),
    (EtcdAccess(), ["https://a:2379", "http://b:2379"], "some are https, some http"),
    (EtcdAccess(), ["https://a:99999"], "the port is not a number"),
    (EtcdAccess(), ["https://a:2379/v3"], "expected https://HOST:PORT"),
    (EtcdAccess(), [], "at least one endpoint"),
])
def test_inconsistent_options_are_clear_errors(access: EtcdAccess, urls: list[str], message: str) -> None:
    with pytest.raises(EtcdAccessError, match=message):
        access.endpoints(urls)


def test_endpoints_and_schemes() -> None:
    assert [str(e) for e in EtcdAccess().endpoints(["etcd:4001", "http://[::1]:2379"])] == \
        ["http://etcd:4001", "http://[::1]:2379"]
    with_certs = EtcdAccess(cacert="ca.crt").endpoints(["etcd-0:2379", "https://etcd-1"])
    assert [(e.target, e.tls) for e in with_certs] == [("etcd-0:2379", True), ("etcd-1:2379", True)]


def test_missing_unreadable_and_malformed_files_are_clear_errors(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(EtcdAccessError, match=r"--etcd-cacert /nope/ca.crt: No such file or directory"):
        EtcdAccess(cacert="/nope/ca.crt").load()
    with pytest.raises(EtcdAccessError, match=r"--etcd-key .*: Is a directory"):  # root reads any mode: a dir
        EtcdAccess(cert=str(pki.client_cert), key=str(tmp_path)).load()
    with pytest.raises(EtcdAccessError, match=r"--etcd-cert .*podmeter.key: no PEM certificate"):
        EtcdAccess(cert=str(pki.client_key), key=str(pki.client_key)).load()
    with pytest.raises(EtcdAccessError, match=r"--etcd-key .*podmeter.crt: no PEM private key"):
        EtcdAccess(cert=str(pki.client_cert), key=str(pki.client_cert)).load()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(EtcdAccessError, match=r"--etcd-password-file .*empty: the file is empty"):
        EtcdAccess(username="u", password_file=str(empty)).load()
    assert EtcdAccess(username="u", password_file=password_file(tmp_path, " spaced ")).load().password == " spaced "


@pytest.mark.parametrize(("args", "message"), [
    (["--etcd-endpoints", "https://127.0.0.1:1", "--etcd-cacert", "/nope/ca.crt"],
     "--etcd-cacert /nope/ca.crt: No such file or directory"),
    (["--etcd-endpoints", "http://127.0.0.1:1", "--etcd-username", "u", "--etcd-password-file", "/nope"],
     "never sent in clear"),
    (["--etcd-endpoints", "https://127.0.0.1:1", "--etcd-username", "u", "--etcd-password-file", "/nope/pw"],
     "--etcd-password-file /nope/pw: No such file or directory"),
])
def test_the_operator_refuses_bad_etcd_options_at_once(args: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from podmeter.cli.main import main

    assert main(["operator", "--identity-backend", "etcd", *args]) == 2
    said = capsys.readouterr()
    assert message in said.out + said.err


def test_the_cli_passes_the_options_to_the_backend(pki: Pki) -> None:
    from podmeter.cli.main import build_parser
    from podmeter.cli.operator import settings_from
    from podmeter.runtime.operator_process import make_backend

    args = build_parser().parse_args(["operator", "--identity-backend", "etcd", "--etcd-endpoints", "etcd:2379",
                                      "--etcd-cacert", str(pki.ca), "--etcd-cert", str(pki.client_cert),
                                      "--etcd-key", str(pki.client_key), "--etcd-username", "podmeter",
                                      "--etcd-password-file", "/run/pw"])
    backend = make_backend(settings_from(args).identities)
    assert isinstance(backend, EtcdIdentityBackend)
    assert backend._access == EtcdAccess(str(pki.ca), str(pki.client_cert), str(pki.client_key), "podmeter",
                                         "/run/pw")
    assert [str(t) for t in backend._targets] == ["https://etcd:2379"]


# -- the operator process --------------------------------------------------------------------------------------


@needs_etcd
def test_the_operator_over_tls_and_one_that_cannot_connect_keeps_retrying(
    lab_apiserver: LabServer, etcd_mtls: EtcdServer, pki: Pki, tmp_path: Path
) -> None:
    tls = ["--identity-backend", "etcd", "--etcd-endpoints", etcd_mtls.endpoint, "--etcd-lease-ttl", "3",
           "--etcd-cacert", str(pki.ca)]
    # without its certificate: a clear error in the log, counted, retried with the backoff; no crash
    port = free_port()
    log = tmp_path / "refused.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "podmeter", "operator", "--kubeconfig",
                                 str(lab_apiserver.kubeconfig), "--listen", f"127.0.0.1:{port}", *tls],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        def errors() -> float:
            status, text = http_get(f"http://127.0.0.1:{port}/metrics")
            found = [line for line in text.splitlines()
                     if line.startswith('podmeter_identity_errors_total{op="start",reason="backend"}')]
            return float(found[0].split()[1]) if status == 200 and found else 0.0

        wait_for(lambda: errors() >= 3, timeout=20, what="three failed starts",
                 describe=lambda: log.read_text()[-2000:])
        assert proc.poll() is None  # still running, still retrying
        assert "refused this client's certificate (none was given: --etcd-cert, --etcd-key)" in log.read_text()
        assert http_get(f"http://127.0.0.1:{port}/readyz")[0] == 503
    finally:
        stop_process(proc)
    # with it: ready, identities in the TLS store
    op = OperatorProcess(lab_apiserver, tmp_path, "op-tls", [*tls, "--etcd-cert", str(pki.client_cert),
                                                                "--etcd-key", str(pki.client_key)])
    try:
        lab_apiserver.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                            "metadata": {"name": "shop"}})
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-1", "labels": {"app": "web"}},
               "spec": {"nodeName": "node-a", "containers": [{"name": "c", "image": "busybox"}]}}
        status, _, answer = lab_apiserver.request("POST", "/api/v1/namespaces/shop/pods", pod)
        assert status == 201, answer
        wait_for(lambda: op.label_sets() == {"web"}, what="an identity over TLS",
                 describe=lambda: op.log.read_text()[-2000:])
        started = time.monotonic()
        wait_for(lambda: op.debug().get("store") == {"256": "shop:{app=web}"}, what="the store read over TLS",
                 describe=lambda: (op.debug(), time.monotonic() - started))
    finally:
        op.stop()
