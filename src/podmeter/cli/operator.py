"""`podmeter operator`: cluster-wide label-set identities (memory or etcd), leader-elected housekeeping.

See docs/operator.md. Every long option can also come from ``PODMETER_<NAME>``.
"""

from __future__ import annotations

import argparse
from typing import Any

from podmeter.runtime import operator_process
from podmeter.runtime.settings import (
    ElectionSettings,
    EtcdSettings,
    IdentitySettings,
    LogSettings,
    OperatorProcessSettings,
    OperatorSettings,
)

# Every default below is read from the settings (runtime.settings), the one place they are written; a list
# as the option takes it, comma-separated (settings_from splits it).


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "operator", help="allocate label-set identities for the cluster's pods", description=__doc__
    )
    p.add_argument("--kubeconfig", default=OperatorProcessSettings.kubeconfig,
                   help="kubeconfig file (default: $KUBECONFIG, then in-cluster)")
    p.add_argument("--identity-backend", choices=("memory", "etcd"), default=IdentitySettings.backend,
                   help="where identities live: memory (each replica numbers on its own) or etcd (shared)")
    p.add_argument("--etcd-endpoints", default=",".join(EtcdSettings.endpoints),
                   help="comma-separated URLs")
    p.add_argument("--etcd-lease-ttl", type=int, default=EtcdSettings.lease_ttl,
                   help="seconds a dead operator's references live")
    p.add_argument("--etcd-cacert", default=EtcdSettings.cacert, metavar="FILE",
                   help="CA bundle that signed the etcd servers' certificates (default: the system's CAs)")
    p.add_argument("--etcd-cert", default=EtcdSettings.cert, metavar="FILE",
                   help="client certificate for etcd (PEM)")
    p.add_argument("--etcd-key", default=EtcdSettings.key, metavar="FILE",
                   help="the client certificate's private key (PEM)")
    p.add_argument("--etcd-username", default=EtcdSettings.username, help="etcd user (needs https endpoints)")
    p.add_argument("--etcd-password-file", default=EtcdSettings.password_file, metavar="FILE",
                   help="file holding the etcd user's password")
    p.add_argument("--identity-range", default=IdentitySettings.identity_range, help="FIRST-LAST (inclusive)")
    p.add_argument("--exclude-labels", default=",".join(IdentitySettings.exclude_labels),
                   help="comma-separated label keys (or prefixes ending in *) left out of identities, "
                        "besides the defaults")
    p.add_argument("--include-labels", default=",".join(IdentitySettings.include_labels),
                   help="comma-separated label keys to take out of the default exclusions")
    p.add_argument("--listen", default=OperatorProcessSettings.listen,
                   help="HOST:PORT for /metrics, /healthz, /debug")
    p.add_argument("--debug-remote", action="store_true", default=OperatorProcessSettings.debug_remote,
                   help="let /debug/identities answer clients that are not on loopback too (default: loopback only)")
    p.add_argument("--lease-namespace", default=ElectionSettings.lease_namespace,
                   help="namespace of the leader-election Lease")
    p.add_argument("--lease-name", default=ElectionSettings.lease_name, help="name of the leader-election Lease")
    p.add_argument("--holder-identity", default=ElectionSettings.holder_identity,
                   help="this replica's name in the Lease and in etcd references (default: HOSTNAME-PID)")
    p.add_argument("--lease-duration", type=float, default=ElectionSettings.lease_duration,
                   help="seconds after which a candidate takes over a Lease that has not changed")
    p.add_argument("--renew-deadline", type=float, default=ElectionSettings.renew_deadline,
                   help="seconds a leader that cannot renew keeps leading before it steps down")
    p.add_argument("--retry-period", type=float, default=ElectionSettings.retry_period,
                   help="seconds between Lease reads and renewals")
    p.add_argument("--sweep-period", type=float, default=OperatorSettings.sweep_period,
                   help="seconds between full recomputations of identities from the pod store")
    p.add_argument("--gc-period", type=float, default=OperatorSettings.gc_period,
                   help="seconds between the leader's garbage collections of the identity store")
    p.add_argument("--config-period", type=float, default=OperatorSettings.config_period,
                   help="seconds between the leader's checks of the default MetricsConfiguration")
    p.add_argument("--publish-endpoints", action=argparse.BooleanOptionalAction,
                   default=OperatorProcessSettings.publish_endpoints,
                   help="publish the cluster's endpoints as PodSlices for the agents (leader only)")
    p.add_argument("--publish-period", type=float, default=OperatorSettings.publish_period,
                   help="seconds between two syncs of the PodSlices at most (changes are coalesced)")
    p.add_argument("--publish-max-writes", type=int, default=OperatorProcessSettings.publish_max_writes,
                   help="PodSlice writes per sync at most (the rest waits for the next sync)")
    p.add_argument("--log-format", choices=("text", "json"), default=LogSettings.format,
                   help="text for people, json: one object per line (ts, level, logger, msg)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=LogSettings.level,
                   type=str.lower, help="the least severe messages logged")
    p.set_defaults(func=run)


def comma_list(text: str) -> tuple[str, ...]:
    """A comma-separated option (``a, b``): its entries, blanks left out."""
    return tuple(entry.strip() for entry in text.split(",") if entry.strip())


def settings_from(args: argparse.Namespace) -> OperatorProcessSettings:
    """The parsed arguments as the operator process's settings (checked when it starts)."""
    return OperatorProcessSettings(
        kubeconfig=args.kubeconfig,
        operator=OperatorSettings(sweep_period=args.sweep_period, gc_period=args.gc_period,
                                  config_period=args.config_period, publish_period=args.publish_period),
        election=ElectionSettings(lease_namespace=args.lease_namespace, lease_name=args.lease_name,
                                  holder_identity=args.holder_identity, lease_duration=args.lease_duration,
                                  renew_deadline=args.renew_deadline, retry_period=args.retry_period),
        identities=IdentitySettings(
            backend=args.identity_backend, identity_range=args.identity_range,
            exclude_labels=comma_list(args.exclude_labels), include_labels=comma_list(args.include_labels),
            etcd=EtcdSettings(endpoints=comma_list(args.etcd_endpoints), lease_ttl=args.etcd_lease_ttl,
                              cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key,
                              username=args.etcd_username, password_file=args.etcd_password_file)),
        publish_endpoints=args.publish_endpoints, publish_max_writes=args.publish_max_writes,
        listen=args.listen, debug_remote=args.debug_remote,
        log=LogSettings(args.log_format, args.log_level),
    )


def run(args: argparse.Namespace) -> int:
    return operator_process.run(settings_from(args))
