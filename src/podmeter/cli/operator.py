"""`podmeter operator`: cluster-wide label-set identities (memory or etcd), leader-elected housekeeping.

See docs/operator.md. Every long option can also come from ``PODMETER_<NAME>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
from typing import Any

from podmeter.adapters.http import parse_listen
from podmeter.adapters.http import serve as serve_http
from podmeter.adapters.identity.base import IdentityBackend
from podmeter.adapters.identity.etcd import EtcdIdentityBackend
from podmeter.adapters.identity.etcd_access import EtcdAccess
from podmeter.adapters.identity.memory import MemoryIdentityBackend
from podmeter.adapters.kube.connection import Connection, ConnectionConfigError, load_connection
from podmeter.adapters.kube.lease import KubeLeaseStore
from podmeter.adapters.kube.slices import KubeSliceApi
from podmeter.adapters.kube.status import KubeConfigApi
from podmeter.model.identity import LabelFilter
from podmeter.runtime.endpoint_publisher import EndpointPublisher
from podmeter.runtime.leadership import LeaderElector
from podmeter.runtime.logs import setup_logging
from podmeter.runtime.operator import Operator, OperatorSettings, ReflectorPodSource

log = logging.getLogger("podmeter.operator")


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "operator", help="allocate label-set identities for the cluster's pods", description=__doc__
    )
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, then in-cluster)")
    p.add_argument("--identity-backend", choices=("memory", "etcd"), default="memory",
                   help="where identities live: memory (each replica numbers on its own) or etcd (shared)")
    p.add_argument("--etcd-endpoints", default="http://127.0.0.1:2379", help="comma-separated URLs")
    p.add_argument("--etcd-lease-ttl", type=int, default=10, help="seconds a dead operator's references live")
    p.add_argument("--etcd-cacert", default="", metavar="FILE",
                   help="CA bundle that signed the etcd servers' certificates (default: the system's CAs)")
    p.add_argument("--etcd-cert", default="", metavar="FILE", help="client certificate for etcd (PEM)")
    p.add_argument("--etcd-key", default="", metavar="FILE", help="the client certificate's private key (PEM)")
    p.add_argument("--etcd-username", default="", help="etcd user (needs https endpoints)")
    p.add_argument("--etcd-password-file", default="", metavar="FILE", help="file holding the etcd user's password")
    p.add_argument("--identity-range", default="256-65535", help="FIRST-LAST (inclusive)")
    p.add_argument("--exclude-labels", default="",
                   help="comma-separated label keys (or prefixes ending in *) left out of identities, "
                        "besides the defaults")
    p.add_argument("--include-labels", default="",
                   help="comma-separated label keys to take out of the default exclusions")
    p.add_argument("--listen", default="127.0.0.1:9979", help="HOST:PORT for /metrics, /healthz, /debug")
    p.add_argument("--debug-remote", action="store_true",
                   help="let /debug/identities answer clients that are not on loopback too (default: loopback only)")
    p.add_argument("--lease-namespace", default="kube-system", help="namespace of the leader-election Lease")
    p.add_argument("--lease-name", default="podmeter-operator", help="name of the leader-election Lease")
    p.add_argument("--holder-identity", default="",
                   help="this replica's name in the Lease and in etcd references (default: HOSTNAME-PID)")
    p.add_argument("--lease-duration", type=float, default=15.0,
                   help="seconds after which a candidate takes over a Lease that has not changed")
    p.add_argument("--renew-deadline", type=float, default=10.0,
                   help="seconds a leader that cannot renew keeps leading before it steps down")
    p.add_argument("--retry-period", type=float, default=2.0, help="seconds between Lease reads and renewals")
    p.add_argument("--sweep-period", type=float, default=30.0,
                   help="seconds between full recomputations of identities from the pod store")
    p.add_argument("--gc-period", type=float, default=30.0,
                   help="seconds between the leader's garbage collections of the identity store")
    p.add_argument("--config-period", type=float, default=5.0,
                   help="seconds between the leader's checks of the default MetricsConfiguration")
    p.add_argument("--publish-endpoints", action=argparse.BooleanOptionalAction, default=True,
                   help="publish the cluster's endpoints as PodSlices for the agents (leader only)")
    p.add_argument("--publish-period", type=float, default=0.5,
                   help="seconds between two syncs of the PodSlices at most (changes are coalesced)")
    p.add_argument("--publish-max-writes", type=int, default=100,
                   help="PodSlice writes per sync at most (the rest waits for the next sync)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="text for people, json: one object per line (ts, level, logger, msg)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info", type=str.lower,
                   help="the least severe messages logged")
    p.set_defaults(func=_run)


def parse_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        lo = hi = 0
    if not sep or not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"--identity-range {text!r}: expected FIRST-LAST, 0 < FIRST <= LAST")
    return lo, hi


def debug_remote(args: argparse.Namespace) -> bool:
    return bool(args.debug_remote)


def label_filter(args: argparse.Namespace) -> LabelFilter:
    def keys(text: str) -> list[str]:
        return [k.strip() for k in text.split(",") if k.strip()]

    return LabelFilter.configure(add=keys(args.exclude_labels), remove=keys(args.include_labels))


def make_backend(args: argparse.Namespace) -> IdentityBackend:
    first, last = parse_range(args.identity_range)
    if args.identity_backend == "memory":
        return MemoryIdentityBackend(first, last)
    return EtcdIdentityBackend(etcd_endpoints(args), lease_ttl=args.etcd_lease_ttl, first=first, last=last,
                               owner=args.holder_identity or None, access=etcd_access(args))


def etcd_endpoints(args: argparse.Namespace) -> list[str]:
    return [e.strip() for e in args.etcd_endpoints.split(",") if e.strip()]


def etcd_access(args: argparse.Namespace) -> EtcdAccess:
    return EtcdAccess(cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key,
                      username=args.etcd_username, password_file=args.etcd_password_file)


def check_etcd(args: argparse.Namespace) -> None:
    """The etcd options agree with each other and their files are readable: EtcdAccessError otherwise.
    (The files are read again at every connection, so a rotated Secret is picked up.)"""
    access = etcd_access(args)
    access.endpoints(etcd_endpoints(args))
    access.load()


def kube_client(connection: Connection) -> Any:
    """A lightkube client for the Lease and the MetricsConfiguration status (same credentials)."""
    from lightkube import AsyncClient

    return AsyncClient(config=connection.config, trust_env=False)


def build(args: argparse.Namespace) -> tuple[Operator, Any]:
    holder = args.holder_identity or f"{socket.gethostname()}-{os.getpid()}"
    connection = load_connection(args.kubeconfig)
    client = kube_client(connection)
    elector = LeaderElector(
        KubeLeaseStore(client, args.lease_namespace, args.lease_name), holder,
        lease_duration=args.lease_duration, renew_deadline=args.renew_deadline,
        retry_period=args.retry_period,
    )
    settings = OperatorSettings(sweep_period=args.sweep_period, gc_period=args.gc_period,
                                config_period=args.config_period, debug_remote=debug_remote(args),
                                publish_period=args.publish_period)
    publisher = (EndpointPublisher(KubeSliceApi(client), interval=args.publish_period,
                                   max_writes=args.publish_max_writes) if args.publish_endpoints else None)
    operator = Operator(ReflectorPodSource(connection), make_backend(args), label_filter=label_filter(args),
                        elector=elector, config=KubeConfigApi(client), settings=settings,
                        publisher=publisher, connection=connection)
    return operator, client


async def serve(args: argparse.Namespace) -> int:
    try:
        operator, client = build(args)
    except ConnectionConfigError as exc:
        log.error("%s", exc)
        return 2
    runner, port = await serve_http(operator.http_app(), args.listen)
    log.info("podmeter operator: %s backend, HTTP on %s (port %d)", operator.backend.name, args.listen, port)
    task = asyncio.create_task(operator.run())
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
            await client.close()
    return 1 if failed else 0


def _run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    for noisy in ("aiohttp.access", "httpx", "httpx2", "httpcore"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        parse_range(args.identity_range)
        parse_listen(args.listen)
        label_filter(args)
        if not args.retry_period < args.renew_deadline < args.lease_duration:
            raise ValueError("need --retry-period < --renew-deadline < --lease-duration")
        if args.identity_backend == "etcd":
            check_etcd(args)  # an EtcdAccessError is a ValueError
    except (argparse.ArgumentTypeError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    return asyncio.run(serve(args))
