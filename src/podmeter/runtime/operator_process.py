"""``podmeter operator`` as one process object, built from one settings value.

:func:`run` is the command (``cli.operator`` parses the arguments into
:class:`~podmeter.runtime.settings.OperatorProcessSettings` and calls it): it checks the settings (exit 2
with the reason in the log: a bad identity range, label list, address, Lease timing or etcd option, a
missing kubeconfig), builds an :class:`OperatorProcess` and serves until SIGTERM or SIGINT (0), or until a
supervised task dies (1, to be restarted).

:class:`OperatorProcess` owns everything the process runs: the kube client (the Lease, the
MetricsConfiguration status, the PodSlices), the leader election, the identity backend, the endpoint
publisher, the operator (``runtime.operator``), the metrics registry and the HTTP app of the endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector

from podmeter.adapters.http import build_app, parse_listen, serve
from podmeter.adapters.identity.base import IdentityBackend
from podmeter.adapters.identity.etcd import EtcdIdentityBackend
from podmeter.adapters.identity.etcd_access import EtcdAccess
from podmeter.adapters.identity.memory import MemoryIdentityBackend
from podmeter.adapters.kube.connection import Connection, ConnectionConfigError, load_connection
from podmeter.adapters.kube.lease import KubeLeaseStore
from podmeter.adapters.kube.slices import KubeSliceApi
from podmeter.adapters.kube.status import KubeConfigApi
from podmeter.adapters.metrics.operator_state import OperatorStateCollector
from podmeter.model.identity import LabelFilter
from podmeter.runtime.endpoint_publisher import EndpointPublisher
from podmeter.runtime.leadership import LeaderElector
from podmeter.runtime.logs import setup_logging
from podmeter.runtime.operator import Operator, ReflectorPodSource
from podmeter.runtime.settings import ElectionSettings, IdentitySettings, OperatorProcessSettings

log = logging.getLogger("podmeter.operator")

QUIET = ("aiohttp.access", "httpx", "httpx2", "httpcore")  # one line per request otherwise


def run(settings: OperatorProcessSettings) -> int:
    """The command: check, build, serve; its exit status."""
    setup_logging(settings.log.level, settings.log.format)
    for noisy in QUIET:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        check(settings)
        connection = load_connection(settings.kubeconfig)
    except (ValueError, ConnectionConfigError) as exc:  # an EtcdAccessError is a ValueError
        log.error("%s", exc)
        return 2
    return asyncio.run(_serve(settings, connection))


async def _serve(settings: OperatorProcessSettings, connection: Connection) -> int:
    """Built inside the event loop it runs in (the kube client, the backend)."""
    return await OperatorProcess(settings, connection).serve()


def check(settings: OperatorProcessSettings) -> None:
    """What can be wrong before anything starts, with the flag that says it (ValueError)."""
    identities, election = settings.identities, settings.election
    parse_range(identities.identity_range)
    parse_listen(settings.listen)
    label_filter(identities)
    if not election.retry_period < election.renew_deadline < election.lease_duration:
        raise ValueError("need --retry-period < --renew-deadline < --lease-duration")
    if identities.backend == "etcd":
        # The files are read again at every connection, so a rotated Secret is picked up.
        access = etcd_access(identities)
        access.endpoints(list(identities.etcd.endpoints))
        access.load()


def parse_range(text: str) -> tuple[int, int]:
    """``--identity-range`` FIRST-LAST (inclusive, 0 < FIRST <= LAST); ValueError otherwise."""
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        lo = hi = 0
    if not sep or not 0 < lo <= hi:
        raise ValueError(f"--identity-range {text!r}: expected FIRST-LAST, 0 < FIRST <= LAST")
    return lo, hi


def label_filter(identities: IdentitySettings) -> LabelFilter:
    return LabelFilter.configure(add=identities.exclude_labels, remove=identities.include_labels)


def etcd_access(identities: IdentitySettings) -> EtcdAccess:
    etcd = identities.etcd
    return EtcdAccess(cacert=etcd.cacert, cert=etcd.cert, key=etcd.key, username=etcd.username,
                      password_file=etcd.password_file)


def holder_identity(election: ElectionSettings) -> str:
    """This replica's name in the Lease and in etcd references: the one given, or HOSTNAME-PID."""
    return election.holder_identity or f"{socket.gethostname()}-{os.getpid()}"


def make_backend(identities: IdentitySettings, owner: str | None = None) -> IdentityBackend:
    first, last = parse_range(identities.identity_range)
    if identities.backend == "memory":
        return MemoryIdentityBackend(first, last)
    return EtcdIdentityBackend(list(identities.etcd.endpoints), lease_ttl=identities.etcd.lease_ttl, first=first,
                               last=last, owner=owner, access=etcd_access(identities))


def kube_client(connection: Connection) -> Any:
    """A lightkube client for the Lease, the MetricsConfiguration status and the PodSlices (same credentials)."""
    from lightkube import AsyncClient

    return AsyncClient(config=connection.config, trust_env=False)


def metrics_registry(operator: Operator) -> CollectorRegistry:
    """The operator's metrics: its state, read at scrape time (``adapters.metrics.operator_state``), and the
    process's (process_start_time_seconds among them: a restart is what the PodmeterTaskFailed alert sees)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(OperatorStateCollector(operator.snapshot))
    return registry


def http_app(operator: Operator, debug_remote: bool = False,
             registry: CollectorRegistry | None = None) -> web.Application:
    """The operator's endpoints: /metrics (``registry``, by default :func:`metrics_registry`'s), /healthz,
    /readyz and /debug/identities (loopback clients only unless ``debug_remote``)."""
    return build_app(registry or metrics_registry(operator), operator.ready.is_set,
                     {"/debug/identities": operator.debug_identities}, debug_remote,
                     healthy=lambda: operator.supervisor.healthy)


class OperatorProcess:
    """Everything one ``podmeter operator`` runs (checked settings: :func:`check`)."""

    def __init__(self, settings: OperatorProcessSettings, connection: Connection) -> None:
        self.settings = settings
        election, holder = settings.election, holder_identity(settings.election)
        self.client = kube_client(connection)
        elector = LeaderElector(KubeLeaseStore(self.client, election.lease_namespace, election.lease_name), holder,
                                lease_duration=election.lease_duration, renew_deadline=election.renew_deadline,
                                retry_period=election.retry_period)
        publisher = (EndpointPublisher(KubeSliceApi(self.client), interval=settings.operator.publish_period,
                                       max_writes=settings.publish_max_writes)
                     if settings.publish_endpoints else None)
        # The etcd references carry the given name, or the backend's own (HOSTNAME-PID, as the Lease's).
        owner = election.holder_identity or None
        self.operator = Operator(ReflectorPodSource(connection), make_backend(settings.identities, owner),
                                 label_filter=label_filter(settings.identities), elector=elector,
                                 config=KubeConfigApi(self.client), settings=settings.operator,
                                 publisher=publisher, connection=connection)
        self.registry = metrics_registry(self.operator)
        self.app = http_app(self.operator, settings.debug_remote, self.registry)

    async def serve(self) -> int:
        runner, port = await serve(self.app, self.settings.listen)
        log.info("podmeter operator: %s backend, HTTP on %s (port %d)", self.operator.backend.name,
                 self.settings.listen, port)
        task = asyncio.create_task(self.operator.run())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        failed = False
        try:
            await task
        except asyncio.CancelledError:
            log.info("podmeter operator: stopping")
        except Exception:  # a supervised task died (logged with its traceback): exit non-zero to be restarted
            failed = True
        finally:
            await runner.cleanup()
            with contextlib.suppress(Exception):
                await self.client.close()
        return 1 if failed else 0
