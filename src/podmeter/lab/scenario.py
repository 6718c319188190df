"""Lab scenarios: seeded YAML files that say what happens to the node and when.

A scenario is decoded into the structs below; anything unknown, mistyped or out of range is a
:class:`ScenarioError` naming the file, the field (``$.steps[3].count``) and the reason, before anything
starts. The same file with the same seed makes the same choices (which pods are deleted, flipped, paired
for traffic), so a failing run can be replayed. The format is documented in docs/lab.md.
"""

from __future__ import annotations

import ipaddress
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from podmeter.lab.netns import HOST_PREFIX, link_prefix_problem

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

Seconds = Annotated[float, msgspec.Meta(ge=0)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
Count = Annotated[int, msgspec.Meta(ge=1, le=100_000)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=63)]


class ScenarioError(ValueError):
    """A scenario file is unusable; the message names the file, the field and why."""


class _Step(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, tag_field="do"):
    at: Seconds  # seconds after the start of the run


class CreatePods(_Step, tag="pods"):
    """Create ``count`` long-running pods (labels ``app: <prefix>``). ``deployment``: the pods are a
    Deployment's named ``<prefix>`` (a controller reference to ReplicaSet ``<prefix>-<hash>`` and the
    ``pod-template-hash`` label), so flows name the workload ``Deployment <namespace>/<prefix>``; without,
    each pod is its own workload (kind ``Pod``)."""

    namespace: Name
    count: Count
    observe: bool = True
    host_network: bool = False
    prefix: Name = "app"
    deployment: bool = False
    node: Name | None = None  # a multi-node scenario's node (default: the nodes in turn)


class DeletePods(_Step, tag="delete"):
    """Delete ``count`` pods of the namespace chosen by the seed (``all: true``: every one)."""

    namespace: Name
    count: Count = 1
    all: bool = False


class Churn(_Step, tag="churn"):
    """For ``duration`` seconds, start ``rate`` pods per second; each lives ``lifetime`` seconds.

    ``complete``: the pod finishes (Succeeded, IP freed) at its lifetime and is deleted ``linger`` seconds
    later, like a Job's pod; otherwise it is deleted at its lifetime. ``unique_labels``: every pod gets
    unique ``job-name``/``controller-uid`` labels, as CronJob pods have (the operator's default filter
    drops them). ``label_sets``: the pods also carry ``lab.podmeter.io/set: s<n>`` with n the step's pod
    count modulo ``label_sets``, a label the filter keeps, so that many identities come and go (larger
    than the number of pods started: one identity per pod, allocated and released with it).
    """

    namespace: Name
    rate: Annotated[float, msgspec.Meta(gt=0, le=500)]
    duration: PositiveSeconds
    lifetime: PositiveSeconds = 2.0
    complete: bool = False
    linger: Seconds = 1.0
    unique_labels: bool = False
    label_sets: Annotated[int, msgspec.Meta(ge=0)] = 0
    observe: bool = True
    node: Name | None = None  # a multi-node scenario's node (default: the nodes in turn)


class Annotate(_Step, tag="annotate"):
    """Set ``podmeter.io/observe`` on ``count`` seeded pods of the namespace (or on the namespace)."""

    namespace: Name
    observe: bool
    count: Count = 1
    on_namespace: bool = False


class UnobserveThenDelete(_Step, tag="unobserve-delete"):
    """Failure modes F1-F4 (docs/design.md): remove the interest in ``count`` pods, then delete them ``gap``
    seconds later; the later delete must still take their IPs out of the kernel map."""

    namespace: Name
    count: Count = 1
    gap: Seconds = 0.0
    repeat: Count = 1
    every: PositiveSeconds = 1.0
    via: Literal["annotation", "configuration"] = "annotation"


class Configure(_Step, tag="configure"):
    """Create or replace the ``default`` MetricsConfiguration; ``remove: true`` deletes it."""

    include: list[Name] = msgspec.field(default_factory=list)
    exclude: list[Name] = msgspec.field(default_factory=list)
    annotations: bool = True
    remove: bool = False


class Fault(_Step, tag="fault"):
    """An API server fault knob: close-watches, compact, stall, fail or restart."""

    fault: Literal["close-watches", "compact", "stall", "fail", "restart"]
    seconds: PositiveSeconds = 2.0  # stall: how long; restart: how long the port stays closed
    count: Count = 3  # fail: how many requests
    code: Literal[500, 429] = 500
    verb: Literal["list", "watch", "get", "create", "update", "patch", "delete"] | None = None  # fail: only these
    repeat: Count = 1
    every: PositiveSeconds = 1.0


class CompactionGap(_Step, tag="compaction-gap"):
    """Stall every watch, delete ``deletes`` pods of the namespace, compact the history, release the
    watches: resuming watchers get 410 and must relist (their missed deletes come back as relist deletes)."""

    namespace: Name
    deletes: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 2
    seconds: PositiveSeconds = 2.0


class KillAgent(_Step, tag="kill-agent"):
    """SIGKILL the agent, delete ``deletes`` pods of the namespace while it is down, restart it after
    ``down`` seconds (failure mode F8 and invariant I6, docs/design.md)."""

    down: Seconds = 2.0
    namespace: Name | None = None
    deletes: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 0
    node: Name | None = None  # a multi-node scenario's node whose agent is killed (default: the first)


class KillOperator(_Step, tag="kill-operator"):
    """SIGKILL the operator (multi-node scenarios), delete ``deletes`` pods of the namespace while it is
    down, restart it after ``down`` seconds: the PodSlices it left hold stale endpoints until the new
    one republishes (invariant I7, docs/design.md)."""

    down: Seconds = 2.0
    namespace: Name | None = None
    deletes: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 0


class Traffic(_Step, tag="traffic"):
    """Known traffic between ``pairs`` pairs of observed, long-running pods, checked per pod IP (UDP:
    exact bytes and packets; TCP: at least the payload), against the agent's per-pod metrics, and against
    its flow records (:mod:`podmeter.lab.flowcheck`)."""

    namespace: Name
    protocol: Literal["udp", "tcp"] = "udp"
    pairs: Count = 2
    packets: Count = 50
    size: Annotated[int, msgspec.Meta(ge=1, le=1400)] = 200
    rate: Annotated[float, msgspec.Meta(gt=0, le=1_000_000)] | None = None  # packets (TCP: writes) per second
    # Multi-node scenarios: each pair's ends on two different nodes (the pairs go round the nodes), and
    # both agents' records checked (the source's from-pod, the destination's to-pod, identities).
    across_nodes: bool = False


class ReuseDuringFlow(_Step, tag="reuse-during-flow"):
    """A pod deleted and its IP reused during a flow: a fresh pod A sends ``packets`` UDP datagrams to a
    seeded long-running pod B, A is deleted, a new pod A' takes A's IP (the node hands out the lowest free
    IP; up to ``attempts`` pods are started until one gets it) and sends ``packets`` more from the same
    port to the same socket of B. The flow records named A must carry exactly A's packets, those named A'
    exactly its own, nothing else named; skipped in memory mode."""

    namespace: Name
    packets: Count = 30
    size: Annotated[int, msgspec.Meta(ge=1, le=1400)] = 300
    attempts: Annotated[int, msgspec.Meta(ge=1, le=20)] = 6
    rate: Annotated[float, msgspec.Meta(gt=0, le=1_000_000)] | None = None  # datagrams per second


class InduceDrops(_Step, tag="drops"):
    """Drops induced between a seeded pair of running observed pods A -> B, then checked exactly
    (:mod:`podmeter.lab.dropcheck`): ``netfilter-input`` an nftables rule in B's namespace drops UDP to
    ``port`` (A egress and B ingress, ``NETFILTER_DROP``), ``netfilter-output`` one in A's namespace (the
    same counts: a drop is credited to both observed ends), ``blackhole`` the node routes a TEST-NET
    address into a blackhole and A sends there (A egress, the kernel's reason: ``reason``, default
    ``NOT_SPECIFIED`` as 6.x kernels name it). A sends
    ``packets`` datagrams of ``size`` bytes; the rule or route goes at the end of the step; skipped in
    memory mode."""

    namespace: Name
    how: Literal["netfilter-input", "netfilter-output", "blackhole"] = "netfilter-input"
    packets: Count = 20
    size: Annotated[int, msgspec.Meta(ge=1, le=1400)] = 100
    port: Annotated[int, msgspec.Meta(ge=1024, le=65535)] = 5299
    reason: Annotated[str, msgspec.Meta(pattern=r"^[A-Z0-9_]+$")] | None = None


class InduceLoss(_Step, tag="loss"):
    """Random loss on a seeded pod A's link (nftables on the host side of its veth: ``numgen random mod
    every 0 drop`` of A's TCP data segments) while A uploads ``bytes`` to a seeded pod B: A's retransmits
    must grow, nobody else's (:mod:`podmeter.lab.dropcheck`); skipped in memory mode."""

    namespace: Name
    every: Annotated[int, msgspec.Meta(ge=2, le=1000)] = 5
    bytes: Annotated[int, msgspec.Meta(ge=10_000, le=100_000_000)] = 2_000_000
    port: Annotated[int, msgspec.Meta(ge=1024, le=65535)] = 5298


class ServiceCalls(_Step, tag="services"):
    """Connections through a Service (:mod:`podmeter.lab.servicecheck`): a ClusterIP Service selecting the
    running pods whose names start with ``backends`` (their ``app`` label), ``connections`` TCP connections
    from one pod starting with ``clients`` to the ClusterIP, each sending ``size`` bytes that the backend
    echoes. The node's Service proxy picks a backend per connection; each backend's server says which
    connections it served, and the agent's records must name each by the Service and that backend. The
    Service is deleted at the end; skipped in memory mode and with ``--no-service-proxy``."""

    namespace: Name
    backends: Name
    clients: Name
    connections: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 30
    size: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 2000
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 80
    target_port: Annotated[int, msgspec.Meta(ge=1024, le=65535)] = 8080


LookupName = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9.])?$")]


class DnsLookups(_Step, tag="dns"):
    """Cluster DNS (:mod:`podmeter.lab.dnscheck`): a ``kube-dns`` Service in ``server_namespace`` backed by
    dnsmasq in the running pod whose name starts with ``servers``, the resolver of the pods starting with
    ``clients`` pointed at it (search list, ``ndots:5``), and glibc looking each of ``names`` up ``rounds``
    times from each client: the agent's per-pod DNS counts must equal the server's log. Skipped in memory
    mode and with ``--no-service-proxy``."""

    namespace: Name
    clients: Name
    server_namespace: Name
    servers: Name
    names: Annotated[list[LookupName], msgspec.Meta(min_length=1, max_length=50)]
    rounds: Annotated[int, msgspec.Meta(ge=1, le=100)] = 2


class ServiceApps(_Step, tag="apps"):
    """Real programs through a Service (:mod:`podmeter.lab.appcheck`): ``program`` ``nginx`` (nginx in
    each running pod starting with ``backends``, curl in one starting with ``clients``: ``requests`` on one
    kept-alive connection, then as many connections of one request) or ``redis`` (redis-server in each,
    redis-benchmark: 50 x ``requests`` SET/GET pipelined on kept-alive connections, then ``requests`` SETs
    with a reconnect each). The bytes each server counted must be the payload of the agent's records of
    its connections, named by the Service and that backend. Skipped, saying so, without the programs, in
    memory mode and with ``--no-service-proxy``."""

    namespace: Name
    backends: Name
    clients: Name
    program: Literal["nginx", "redis"]
    requests: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 20


Step = (CreatePods | DeletePods | Churn | Annotate | UnobserveThenDelete | Configure | Fault | CompactionGap
        | KillAgent | KillOperator | Traffic | ReuseDuringFlow | InduceDrops | InduceLoss | ServiceCalls | ServiceApps
        | DnsLookups)


class NamespaceSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: Name
    observe: bool = False


class NodeSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pod_cidr: str = "10.244.0.0/25"
    filter_map_size: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1024
    ip_reuse: Literal["lowest", "oldest"] = "lowest"  # podmeter node --ip-reuse
    # The host side of each pod's link is <link_prefix><11 characters of the pod UID>, as a CNI names it
    # (podmeter node --link-prefix): "eni" as AWS VPC CNI, "azv" as Azure CNI, "cali" as Calico. The agent
    # must find the links by what they are whatever this is (scenario other-cni).
    link_prefix: str = HOST_PREFIX


class ClusterNodeSpec(NodeSpec, kw_only=True):
    """One node of a multi-node scenario: its name (``spec.nodeName`` of its pods) and, test only, a fault
    planted in its agent alone."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=40)]
    agent_fault: Literal["drop-deletes", "stale-endpoints"] | None = None


class AgentSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    resync_interval: PositiveSeconds = 10.0
    series_grace: PositiveSeconds = 3.0  # how long a gone pod's series stay (the agent's --series-grace)
    # Test only: an agent that loses watch deletes, or one whose endpoint cache keeps what slices drop.
    fault: Literal["drop-deletes", "stale-endpoints"] | None = None
    # The agent's --flow-interval and --flow-buffer: the flow checks wait for two drains after each
    # exchange, and read every record of it from the ring.
    flow_interval: Annotated[float, msgspec.Meta(gt=0, le=60)] = 0.5
    flow_buffer: Annotated[int, msgspec.Meta(ge=16, le=10_000_000)] = 65536
    # The agent also serves Hubble's Observer API (--hubble-listen) on a loopback port of its own, so a
    # client speaking Hubble's protocol reads the run's flows live; ``podmeter lab --hubble`` overrides.
    hubble: bool = False


class OperatorSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    sweep_period: PositiveSeconds = 10.0


class ApiServerSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    history: Annotated[int, msgspec.Meta(ge=10, le=10_000_000)] = 10_000


class Scenario(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A whole scenario. Times are seconds from the start; after ``duration`` (or, if set, as soon as
    ``lifecycles`` pods have been created and deleted, whichever comes first) every pod is deleted and the
    run ends once the node is empty and ``settle`` seconds have passed (the memory check)."""

    name: Name
    description: str = ""
    seed: int = 1
    datapath: Literal["ebpf", "memory", "auto"] = "auto"
    duration: PositiveSeconds
    lifecycles: Annotated[int, msgspec.Meta(ge=1)] | None = None  # end the steps early after this many
    settle: PositiveSeconds = 5.0  # how long a violation may last before it fails the run
    sample_interval: PositiveSeconds = 0.5
    memory_tolerance_mib: Annotated[float, msgspec.Meta(ge=0)] = 16.0
    node: NodeSpec = msgspec.field(default_factory=NodeSpec)
    # Several nodes (a network namespace each, linked: docs/lab.md "Several nodes"); replaces ``node``.
    nodes: list[ClusterNodeSpec] = msgspec.field(default_factory=list)
    agent: AgentSpec = msgspec.field(default_factory=AgentSpec)
    operator: OperatorSpec = msgspec.field(default_factory=OperatorSpec)
    apiserver: ApiServerSpec = msgspec.field(default_factory=ApiServerSpec)
    # How pods are wired: ``lab`` the node's own veth and /32 route per pod (netns.Sandbox, Calico's layout);
    # ``bridge`` the real bridge CNI plugin with host-local IPAM, called by each node as a container runtime
    # calls it (lab/cni.py): veths named by the plugin on a bridge per node, IPs known only after ADD.
    cni: Literal["lab", "bridge"] = "lab"
    namespaces: list[NamespaceSpec] = msgspec.field(default_factory=list)
    steps: list[Step] = msgspec.field(default_factory=list)


def parse_scenario(text: str | bytes, source: str = "<scenario>") -> Scenario:
    """Decode and validate a scenario; raises :class:`ScenarioError` with the field and the reason."""
    try:
        scenario = msgspec.yaml.decode(text, type=Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{source}: {_where(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise ScenarioError(f"{source}: not valid YAML: {exc}") from None
    problems = list(_semantic_problems(scenario))
    if problems:
        raise ScenarioError(f"{source}: " + "; ".join(problems))
    return scenario


def _where(message: str) -> str:
    reason, sep, where = message.rpartition(" - at ")
    if not sep:
        return message
    field = where.strip("`")
    if reason.startswith("Invalid value") and field.endswith(".do"):
        kinds = ", ".join(sorted(_step_kinds()))
        reason = f"{reason}; a step's `do` is one of: {kinds}"
    return f"{field}: {reason}"


def _step_kinds() -> list[str]:
    return [str(cls.__struct_config__.tag) for cls in Step.__args__]


def _semantic_problems(scenario: Scenario) -> list[str]:
    problems: list[str] = []
    problem = link_prefix_problem(scenario.node.link_prefix)
    if problem is not None:
        problems.append(f"$.node.link_prefix: {problem}")
    try:
        network = ipaddress.ip_network(scenario.node.pod_cidr)
        if network.version != 4 or network.num_addresses < 4:
            problems.append(f"$.node.pod_cidr: {scenario.node.pod_cidr} must be an IPv4 network of 4+ addresses")
    except ValueError as exc:
        problems.append(f"$.node.pod_cidr: {exc}")
    declared = {ns.name for ns in scenario.namespaces}
    for i, spec in enumerate(scenario.namespaces):
        if not _DNS_LABEL.match(spec.name):
            problems.append(f"$.namespaces[{i}].name: {spec.name!r} is not a DNS-1123 label")
    for i, step in enumerate(scenario.steps):
        for key in ("namespace", "server_namespace"):
            ns = getattr(step, key, None)
            if ns is not None and ns not in declared:
                problems.append(f"$.steps[{i}].{key}: {ns!r} is not declared under namespaces "
                                f"(declared: {', '.join(sorted(declared)) or 'none'})")
        if step.at > scenario.duration:
            problems.append(f"$.steps[{i}].at: {step.at} is after the duration ({scenario.duration})")
        if isinstance(step, Configure) and step.include and step.exclude:
            problems.append(f"$.steps[{i}]: include and exclude cannot both be non-empty")
        if isinstance(step, KillAgent | KillOperator) and step.deletes and step.namespace is None:
            problems.append(f"$.steps[{i}].namespace: needed when deletes > 0")
    return problems + _node_problems(scenario) + _cni_problems(scenario)


FABRIC = ipaddress.ip_network("192.168.255.0/24")  # the multi-node lab's node addresses (lab/fabric.py)
MAX_NODES = 16


def _node_problems(scenario: Scenario) -> list[str]:
    """Several nodes: names unique, CIDRs valid and apart; steps name declared nodes only; the steps that
    need several nodes have them."""
    problems: list[str] = []
    names = [n.name for n in scenario.nodes]
    if len(scenario.nodes) > MAX_NODES:
        problems.append(f"$.nodes: at most {MAX_NODES} nodes, not {len(scenario.nodes)}")
    networks: list[tuple[int, ipaddress.IPv4Network | ipaddress.IPv6Network]] = []
    for i, spec in enumerate(scenario.nodes):
        if not _DNS_LABEL.match(spec.name):
            problems.append(f"$.nodes[{i}].name: {spec.name!r} is not a DNS-1123 label")
        if names.index(spec.name) != i:
            problems.append(f"$.nodes[{i}].name: {spec.name!r} is declared twice")
        problem = link_prefix_problem(spec.link_prefix)
        if problem is not None:
            problems.append(f"$.nodes[{i}].link_prefix: {problem}")
        try:
            network = ipaddress.ip_network(spec.pod_cidr)
        except ValueError as exc:
            problems.append(f"$.nodes[{i}].pod_cidr: {exc}")
            continue
        if network.version != 4 or network.num_addresses < 4:
            problems.append(f"$.nodes[{i}].pod_cidr: {spec.pod_cidr} must be an IPv4 network of 4+ addresses")
            continue
        if network.overlaps(FABRIC):
            problems.append(f"$.nodes[{i}].pod_cidr: {spec.pod_cidr} overlaps the nodes' own network {FABRIC}")
        for j, other in networks:
            if network.overlaps(other):
                problems.append(f"$.nodes[{i}].pod_cidr: {spec.pod_cidr} overlaps $.nodes[{j}].pod_cidr {other}")
        networks.append((i, network))
    declared = ", ".join(names) or "none: the scenario has no nodes list"
    for i, step in enumerate(scenario.steps):
        node = getattr(step, "node", None)
        if node is not None and node not in names:
            problems.append(f"$.steps[{i}].node: {node!r} is not declared under nodes (declared: {declared})")
        if isinstance(step, KillOperator) and not scenario.nodes:
            problems.append(f"$.steps[{i}]: kill-operator needs a multi-node scenario (a nodes list)")
        if isinstance(step, Traffic) and step.across_nodes and len(scenario.nodes) < 2:
            problems.append(f"$.steps[{i}].across_nodes: needs at least two nodes under nodes")
    return problems


def _cni_problems(scenario: Scenario) -> list[str]:
    """A real CNI plugin names the links and hands out the IPs itself: what the lab's wiring decides
    cannot be asked of it."""
    if scenario.cni == "lab":
        return []
    problems: list[str] = []
    specs: list[tuple[str, NodeSpec]] = [(f"$.nodes[{i}]", spec) for i, spec in enumerate(scenario.nodes)]
    for where, spec in specs or [("$.node", scenario.node)]:
        if spec.link_prefix != HOST_PREFIX:
            problems.append(f"{where}.link_prefix: with cni: {scenario.cni} the plugin names the pods' links "
                            "itself (veth<hex>)")
        if spec.ip_reuse != "lowest":
            problems.append(f"{where}.ip_reuse: with cni: {scenario.cni} host-local IPAM chooses the IPs")
    for i, step in enumerate(scenario.steps):
        if isinstance(step, ReuseDuringFlow):
            problems.append(f"$.steps[{i}]: reuse-during-flow needs the lab's own IP allocation (the lowest free "
                            f"IP, to force a reuse); with cni: {scenario.cni} host-local IPAM hands IPs out in turn")
    return problems


def link_prefix_of(scenario: Scenario, node: str | None) -> str:
    """How the node ``node`` (a multi-node scenario's, by name; else the one node) names its pod links."""
    spec = next((n for n in scenario.nodes if n.name == node), scenario.node)
    return spec.link_prefix


def load_scenario(name_or_path: str) -> Scenario:
    """A file path, or the name of a scenario shipped with podmeter (``default``, ``soak``...)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        try:
            return parse_scenario(path.read_bytes(), str(path))
        except OSError as exc:
            raise ScenarioError(f"{path}: cannot read: {exc.strerror}") from None
    shipped = resources.files("podmeter.lab") / "scenarios" / f"{name_or_path}.yaml"
    if not shipped.is_file():
        raise ScenarioError(f"no scenario file {name_or_path!r} and no shipped scenario of that name "
                            f"(shipped: {', '.join(shipped_scenarios())})")
    return parse_scenario(shipped.read_bytes(), f"{name_or_path}.yaml")


def shipped_scenarios() -> list[str]:
    folder = resources.files("podmeter.lab") / "scenarios"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))
