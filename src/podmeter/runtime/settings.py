"""The settings of podmeter's two long-running processes: the one place their defaults are written.

Each command's parser takes its defaults from these classes and parses its arguments into one value
(``cli.agent``, ``cli.operator``); the process object is built from that value alone
(``runtime.agent_process``, ``runtime.operator_process``). A test checks that parsing no argument gives
exactly these defaults (``tests/runtime/test_settings.py``), so a default cannot be written twice.

Groups, one meaning per name within a process:

* the agent: :class:`AgentProcessSettings` holds :class:`AgentSettings` (the writer task, its timers, its
  drains and series: ``runtime.agent``), :class:`DatapathSettings` (what is opened on the node:
  ``runtime.datapaths``), :class:`HubbleSettings`, :class:`LogSettings` and :class:`FlowExportSettings`, plus
  the HTTP endpoints;
* the operator: :class:`OperatorProcessSettings` holds :class:`OperatorSettings` (the periods of the
  operator's own jobs: ``runtime.operator``), :class:`ElectionSettings` (the Lease: ``runtime.leadership``),
  :class:`IdentitySettings` with :class:`EtcdSettings` (the identity backend), :class:`LogSettings`, the
  publisher's limits and the HTTP endpoints. ``ElectionSettings.retry_period`` is the Lease's;
  the identity operations' own retry is ``OperatorSettings.identity_retry_period``.

Defaults are class attributes (the dataclasses have no slots), so a parser reads them as
``AgentSettings.resync_interval``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podmeter.adapters.kube.reflector import ReflectorSettings
from podmeter.adapters.kube.resources import ResourceKind
from podmeter.model.flow_records import FlowFilter
from podmeter.runtime.drop_drain import DEFAULT_DROP_MAP_SIZE


def _reflector_defaults(kind: ResourceKind[Any]) -> ReflectorSettings:
    return ReflectorSettings()


@dataclass(frozen=True)
class LogSettings:
    format: str = "text"  # text, or json: one object per line (ts, level, logger, msg)
    level: str = "info"  # debug, info, warning, error


# --- the agent ---------------------------------------------------------------------------------------


@dataclass
class AgentSettings:
    """The agent's writer task (``runtime.agent.Agent``): its node, timers, drains and series."""

    node_name: str
    resync_interval: float = 60.0  # seconds between full comparisons of the filter with the kernel's
    retry_interval: float = 1.0  # pause before retrying a flush the datapath refused
    series_grace: float = 30.0  # a pod's traffic series outlives its observation by this much (2 scrapes)
    flow_interval: float = 5.0  # seconds between two drains of the datapath's flows
    flow_buffer: int = 8192  # recent flow records kept for `podmeter observe`
    flow_series_limit: int = 2000  # workload pairs with a series of their own (then: the overflow series)
    flow_series_idle: float = 300.0  # a workload pair's series goes after this long without traffic
    # Retina's series too (--retina-compat): None (off), "local" (per pod) or "remote" (per pair of flow ends,
    # built from the flow records: model.retina_flows)
    retina_compat: str | None = None
    retina_dns_names_limit: int = 1000  # query names with Retina DNS series of their own (then: `_other_`)
    retina_remote_addresses_limit: int = 100  # remote addresses with a tcp_connection_remote series (then: `_other_`)
    retina_interfaces_limit: int = 128  # interfaces with interface_stats series of their own (then: `_other_`)
    # Drops of a lifecycle reason (a socket's queues freed as it closes: model.drops.LIFECYCLE_REASONS) shown
    # as drops, in the drop series and records (--drops-include-lifecycle); off: counted apart
    drops_include_lifecycle: bool = False
    # The cluster's nodes, for the Hubble API's peer list: the agent process turns it on when its Hubble API
    # announces peers (an address other nodes reach), not a flag of its own.
    watch_nodes: bool = False
    # Hubble's metrics (--hubble-metrics: Cilium's hubble-metrics syntax, model.hubble_metrics_config); None: off
    hubble_metrics: str | None = None
    hubble_metrics_series_limit: int = 5000  # their series in all (then: each family's overflow series)
    reflector: Callable[[ResourceKind[Any]], ReflectorSettings] = field(default=_reflector_defaults)


@dataclass(frozen=True)
class DatapathSettings:
    """What the agent opens on its node (``runtime.datapaths.open_datapath``)."""

    kind: str = "ebpf"  # ebpf: the kernel (root); memory: no kernel (the lab, tests)
    bpffs: str = "/sys/fs/bpf/podmeter"  # the pin directory of the maps (and of the TCX links)
    filter_map_size: int = 65536  # max_entries of the filter (observed pod IPs)
    flow_map_size: int = 65536  # max_entries of each of the two flow maps (flows between two drains)
    drop_map_size: int = DEFAULT_DROP_MAP_SIZE  # max_entries of each drop and TCP map; 0: drops off
    interfaces: tuple[str, ...] = ()  # attached to as well, whatever they are and carry
    interface_patterns: tuple[str, ...] = ()  # attach to the links so named instead of finding pod links


@dataclass(frozen=True)
class HubbleSettings:
    """The Hubble API (off unless ``listen``); checked by ``adapters.hubble.access.hubble_config``."""

    listen: str | None = None  # unix:///PATH or HOST:PORT
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    @property
    def asked(self) -> bool:
        """Whether any Hubble option is given (then gRPC is imported; it costs the idle agent ~20 MiB)."""
        return any((self.listen, self.tls_cert, self.tls_key, self.tls_client_ca))


@dataclass(frozen=True)
class FlowExportSettings:
    """The flow export file (off unless ``file``): ``adapters.flow_export``, docs/flow-export.md."""

    file: str | None = None  # PATH: every flow record as one line of Hubble's exporter's JSON
    max_size_mb: float = 10.0  # the file is rotated before it grows past this many MiB (Hubble's default)
    max_backups: int = 5  # rotated files kept, the newest (Hubble's default); 0: none
    allow: tuple[FlowFilter, ...] = ()  # a record is written if it matches one of these (none: every record)
    deny: tuple[FlowFilter, ...] = ()  # ... and none of these
    field_mask: tuple[str, ...] = ()  # the Flow fields written (paths: source.namespace); none: every field
    queue_records: int = 16384  # records waiting for the writer at most; beyond, dropped and counted
    retry_interval: float = 2.0  # seconds between two attempts to write to a failing file


@dataclass(frozen=True)
class AgentProcessSettings:
    """Everything ``podmeter agent`` runs with (``runtime.agent_process``)."""

    agent: AgentSettings
    kubeconfig: str | None = None  # None: $KUBECONFIG, then the in-cluster service account
    context: str | None = None  # None: the kubeconfig's current context
    datapath: DatapathSettings = field(default_factory=DatapathSettings)
    listen: str = "127.0.0.1:9978"  # /metrics, /healthz, /readyz, /debug/*
    metrics_min_interval: float = 1.0  # /metrics is rendered at most this often; scrapers within get the last
    debug_remote: bool = False  # /debug/* answers clients that are not on loopback too
    hubble: HubbleSettings = field(default_factory=HubbleSettings)
    log: LogSettings = field(default_factory=LogSettings)
    hubble_metrics_server: str | None = None  # HOST:PORT of Hubble's metrics (":9965": loopback); None: off
    flow_export: FlowExportSettings = field(default_factory=FlowExportSettings)


# --- the operator ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OperatorSettings:
    """The periods of the operator's own jobs (``runtime.operator.Operator``)."""

    sweep_period: float = 30.0  # full recompute of the identities against the pod store
    gc_period: float = 30.0  # backend GC (leader only); etcd removes after two rounds
    config_period: float = 5.0  # MetricsConfiguration status (leader only)
    identity_retry_period: float = 2.0  # identity operations that failed are tried again this often
    publish_period: float = 0.5  # endpoint slices (leader only): at most one sync this often


@dataclass(frozen=True)
class ElectionSettings:
    """The leader election on a Lease (``runtime.leadership.LeaderElector``)."""

    lease_namespace: str = "kube-system"
    lease_name: str = "podmeter-operator"
    holder_identity: str = ""  # this replica's name in the Lease and in etcd references; "": HOSTNAME-PID
    lease_duration: float = 15.0  # a candidate takes over after the Lease has not changed for this long
    renew_deadline: float = 10.0  # a leader that cannot renew for this long steps down
    retry_period: float = 2.0  # seconds between Lease reads and renewals


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: tuple[str, ...] = ("http://127.0.0.1:2379",)
    lease_ttl: int = 10  # seconds a dead operator's references live
    cacert: str = ""  # "": the system's CAs
    cert: str = ""
    key: str = ""
    username: str = ""
    password_file: str = ""


@dataclass(frozen=True)
class IdentitySettings:
    """Where identities live and which labels make them."""

    backend: str = "memory"  # memory (each replica numbers on its own) or etcd (shared)
    identity_range: str = "256-65535"  # FIRST-LAST, inclusive (checked when the process starts)
    exclude_labels: tuple[str, ...] = ()  # label keys (or prefixes ending in *) left out, besides the defaults
    include_labels: tuple[str, ...] = ()  # label keys taken out of the default exclusions
    etcd: EtcdSettings = field(default_factory=EtcdSettings)


@dataclass(frozen=True)
class OperatorProcessSettings:
    """Everything ``podmeter operator`` runs with (``runtime.operator_process``)."""

    kubeconfig: str | None = None  # None: $KUBECONFIG, then the in-cluster service account
    operator: OperatorSettings = field(default_factory=OperatorSettings)
    election: ElectionSettings = field(default_factory=ElectionSettings)
    identities: IdentitySettings = field(default_factory=IdentitySettings)
    publish_endpoints: bool = True  # the leader publishes the cluster's endpoints as PodSlices
    publish_max_writes: int = 100  # PodSlice writes per sync at most
    listen: str = "127.0.0.1:9979"  # /metrics, /healthz, /readyz, /debug/identities
    debug_remote: bool = False  # /debug/identities answers clients that are not on loopback too
    log: LogSettings = field(default_factory=LogSettings)
