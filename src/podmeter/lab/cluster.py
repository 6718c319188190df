"""The multi-node lab: several nodes, an agent on each, one operator; and the lab against any API server.

A scenario with a ``nodes`` list (the shipped ``cluster``: three), or any scenario run with ``podmeter lab
--kubeconfig FILE``, runs here (:class:`ClusterRun`, a :class:`~podmeter.lab.run.LabRun` with more than one
node). In eBPF mode each node is a network namespace standing for its host (:mod:`podmeter.lab.fabric`:
the nodes linked over a bridge, each pod CIDR routed to its node), with its own ``podmeter node``, its own
agent (own pin directory, own HTTP port) and its own pod CIDR; both processes are started inside it (they
inherit the namespace of the thread that forks them), so the agent's attach manager finds its node's pod
links by itself, as on a real host. The API server (the embedded one, or ``--kubeconfig``'s) and the
operator run in the runner's namespace, reached from the nodes through relays that listen on the server's
own address inside each node (:mod:`podmeter.lab.relay`); each agent's loopback-only HTTP endpoints are
relayed to the same port of the runner's loopback. Without root (memory mode) the nodes are just
processes: IPs, no packets, the checks read each agent's state.

The checks, every sample: I1-I3 and I5 per node (a :class:`~podmeter.lab.checks.Checker` each, against its
own pinned filter), I4 once (the operator), **I7 on every node** (the agent's endpoint cache against the
API server's pods and the operator's identities: :mod:`podmeter.lab.endpointcheck`), and I8 per agent at
the end. Traffic between pods of two nodes is checked against both agents' flow records (each named on
both ends by both agents, identities agreeing); the report gains per-node lines and the cross-node matrix.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import logging
import random
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.lab import runinfo, servicecheck
from podmeter.lab import scenario as sc
from podmeter.lab.apiserver.client import AdminClient
from podmeter.lab.checks import MCONF_PATH, Checker, Observation, Samples, Truth, metric_sum, parse_metrics
from podmeter.lab.driver import Driver
from podmeter.lab.endpointcheck import (
    Named,
    cache_of,
    check_cross_flow,
    endpoint_violations,
    expected_cache,
    identities_by_uid,
    node_matrix,
)
from podmeter.lab.external import ExternalCluster
from podmeter.lab.fabric import Fabric
from podmeter.lab.flowcheck import (
    FROM_POD,
    TO_POD,
    WINDOW_SLACK,
    Expectation,
    FlowClient,
    Holder,
    PodEnd,
    Record,
    aggregate,
    check_series,
    misnamed,
    of_key,
    series_bytes,
    series_values,
)
from podmeter.lab.kube import KubeClient, pod_path
from podmeter.lab.netns import Sandbox, in_namespace
from podmeter.lab.processes import FAULTY_AGENT, PODMETER, free_port, http_text, rss_mib, wait_ready
from podmeter.lab.relay import Relays
from podmeter.lab.run import NODE_NAME, LabOptions, LabRun, Sample, WatchPoint, _fmt, _percentiles
from podmeter.lab.runinfo import Mark
from podmeter.lab.traffic import UDP_OVERHEAD, Endpoint, send_tcp, send_udp
from podmeter.model.configuration import DEFAULT_NAME, decode_configuration
from podmeter.model.datapath import Direction
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Replace, Upsert
from podmeter.model.identity import IdentityKey, key_of_flat
from podmeter.model.interest import holds_identity
from podmeter.model.records import DecodeError, Pod, decode_namespace, decode_pod
from podmeter.model.view import NodeView

log = logging.getLogger("podmeter.lab")
NAMED_WAIT = 10.0  # seconds every agent of an exchange may take to name both its ends (after settle)

Counters = dict[tuple[str, Direction], tuple[int, int]]


def is_cluster(scenario: sc.Scenario, options: LabOptions) -> bool:
    """Whether a run is a :class:`ClusterRun`: a scenario with ``nodes``, or any against ``--kubeconfig``."""
    return bool(scenario.nodes) or options.kubeconfig is not None


def lab_run(scenario: sc.Scenario, options: LabOptions) -> LabRun:
    """The runner a scenario needs: several nodes or an existing API server (one node is a cluster of one)
    here, else :class:`~podmeter.lab.run.LabRun`."""
    return ClusterRun(scenario, options) if is_cluster(scenario, options) else LabRun(scenario, options)


# --- the checks of one node --------------------------------------------------------------------------


@dataclass
class NodeObservation(Observation):
    """A node's sample, with its agent's endpoint cache and what it must hold (None: not read now)."""

    endpoints: dict[str, Named] | None = None
    expected: dict[str, Named] | None = None


@dataclass
class NodeChecker(Checker):
    """I1-I3 and I5 for one node, and I7 for its agent's endpoint cache."""

    node: str = ""

    def _violations(self, obs: Observation) -> list[tuple[str, str, str]]:
        found = super()._violations(obs)
        if isinstance(obs, NodeObservation) and obs.agent_up and obs.endpoints is not None \
                and obs.expected is not None:
            self.checked.add("I7")  # the report's table: this run checked I7
            found += endpoint_violations(self.node, obs.expected, obs.endpoints)
        return found


@dataclass
class LabNode:
    """One node of the run: its spec, where its namespace and pins are, how the runner reaches its agent,
    and its checks."""

    name: str
    spec: sc.NodeSpec
    fault: str | None
    bpffs: Path
    port: int  # the agent's HTTP port: on its loopback, and relayed to the runner's (eBPF)
    checker: NodeChecker
    hubble_port: int | None = None  # the agent's Hubble API (--hubble): its loopback, relayed as ``port``
    netns: str | None = None  # /run/netns/<tag>-n<i> (eBPF)
    address: str = "192.168.255.1"  # the node's IP (the fabric's), given to its host-network pods
    restarting: bool = False
    restarted_at: float | None = None
    convergence_s: list[float] = field(default_factory=list)
    peaks: dict[str, int] = field(default_factory=dict)  # pods, desired, kernel, endpoints: the most seen
    last: dict[str, Any] = field(default_factory=dict)  # the last sample of this node

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def flows(self) -> FlowClient:
        return FlowClient(self.url)

    @property
    def agent(self) -> str:
        return f"agent-{self.name}"

    @property
    def hubble(self) -> str | None:
        return None if self.hubble_port is None else f"127.0.0.1:{self.hubble_port}"


@dataclass(frozen=True)
class Placed:
    """A running pod as a traffic end: its endpoint and the node it runs on."""

    endpoint: Endpoint
    node: str

    @property
    def pod(self) -> str:
        return self.endpoint.pod


class ClusterRun(LabRun):
    """A lab run with several nodes, or against an existing API server (see the module docstring)."""

    def __init__(self, scenario: sc.Scenario, options: LabOptions) -> None:
        super().__init__(scenario, options)
        self.external: ExternalCluster | None = None
        self.kubeconfig = options.kubeconfig or (self.out / "kubeconfig")
        specs: Sequence[sc.ClusterNodeSpec] = scenario.nodes or [
            sc.ClusterNodeSpec(name=NODE_NAME, **msgspec.structs.asdict(scenario.node))]
        self.nodes: list[LabNode] = []
        for spec in specs:
            checker = NodeChecker(settle=scenario.settle, metrics_grace=self.checker.metrics_grace, node=spec.name)
            checker.traffic_pods = self.checker.traffic_pods  # one set: LabRun's helpers add to self.checker's
            bpffs = self.bpffs / spec.name if scenario.nodes else self.bpffs
            self.nodes.append(LabNode(spec.name, spec, spec.agent_fault or scenario.agent.fault, bpffs,
                                      free_port(), checker,
                                      hubble_port=None if self.hubble_port is None else free_port()))
        self.result.hubble = {n.name: n.hubble for n in self.nodes if n.hubble is not None}
        self.fabric = Fabric(self.tag, [(n.name, n.spec.pod_cidr) for n in self.nodes]) \
            if self.datapath == "ebpf" else None
        if self.fabric is not None:
            for node, wired in zip(self.nodes, self.fabric.nodes, strict=True):
                node.netns, node.address = wired.netns, wired.address
        self.relays = Relays()
        self.api_addresses = _server_addresses(self._server_url())
        self.first = self.nodes[0]
        if len(self.nodes) == 1:  # LabRun's single-node helpers (reuse during a flow, drops) work as they are
            self.agent_port, self.flow_client = self.first.port, self.first.flows
        self._operator_down = False
        self._identities: dict[str, int] | None = None  # uid -> identity, as of the last sample

    def _server_url(self) -> str:
        if self.options.kubeconfig is None:
            return "https://127.0.0.1:0"  # the embedded server, on the runner's loopback (its port comes later)
        return KubeClient.from_kubeconfig(str(self.options.kubeconfig)).server

    def _node(self, name: str | None) -> LabNode:
        return self.first if name is None else next(n for n in self.nodes if n.name == name)

    @contextlib.contextmanager
    def _in_node(self, node: LabNode) -> Iterator[None]:
        """The calling thread inside the node's namespace for a block (processes forked there stay)."""
        if node.netns is None:
            yield
            return
        with in_namespace(node.netns):
            yield

    # --- the whole run -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _node_namespace(self) -> Iterator[None]:
        """The nodes' namespaces and their wire (eBPF); the runner itself stays where it is."""
        try:
            if self.fabric is not None:
                self.fabric.create(loopback_addresses=[host for host, _ in self.api_addresses])
            yield
        finally:
            self.relays.close()
            if self.fabric is not None:
                self.fabric.destroy()

    def _run_processes(self) -> None:
        try:
            if self.options.kubeconfig is None:
                self._start_apiserver()
                self.api_addresses = _server_addresses(self._client().server)
            else:
                self.client = KubeClient.from_kubeconfig(str(self.options.kubeconfig))
                self.admin = AdminClient(self.client.server, self.client.token or "",  # no fault knobs: unused
                                         self.client.ca_file)
                self.external = ExternalCluster(self.client, self.tag)
                self.external.prepare([ns.name for ns in self.scenario.namespaces],
                                      [(n.name, n.spec.pod_cidr, n.address) for n in self.nodes])
                self.result.notes += self.external.notes
            self._relay_api()
            assert self.client is not None and self.admin is not None
            self.driver = Driver(self._runnable(), self.client, self.admin, self.first.name, self)
            self.driver.nodes = [n.name for n in self.nodes]
            if self.external is not None:
                self.driver.namespace_labels = dict(self.external.labels)
            self.driver.create_namespaces()
            for node in self.nodes:
                self._start_node_process(node)
            for node in self.nodes:
                self.start_agent(node.name)
            self._start_operator()
            self._timeline()
        finally:
            if self.driver is not None:
                self.driver.stop.set()
            self._stop_sampling.set()
            self._stop_endpointslices()
            self.processes.stop_all()
            self._remove_leftover_sandboxes()
            self._finish_cni(lambda name: self._in_node(self._node(name)))
            self._cleanup_external()

    def _client(self) -> KubeClient:
        assert self.client is not None
        return self.client

    def _runnable(self) -> sc.Scenario:
        """The scenario's steps this API server can run (fault knobs exist on the embedded one only)."""
        if self.external is None:
            return self.scenario
        kept = [s for s in self.scenario.steps if self.external.allows(str(s.__struct_config__.tag))]
        skipped = len(self.scenario.steps) - len(kept)
        if skipped:
            self.result.notes.append(f"{skipped} steps skipped: fault knobs exist on the embedded API server only, "
                                     "and the cluster's own MetricsConfiguration is never changed")
        return msgspec.structs.replace(self.scenario, steps=kept)

    def _relay_api(self) -> None:
        """Every node reaches the API server at its own address, through a relay in its namespace."""
        for node in self.nodes:
            if node.netns is None:
                continue
            for address in self.api_addresses:
                try:
                    self.relays.add(address, address, listen_netns=node.netns)
                except OSError as exc:  # ::1 without IPv6 in the namespace: the IPv4 address serves
                    log.warning("no relay for the API server at %s in %s: %s", address, node.name, exc)

    def _cleanup_external(self) -> None:
        if self.external is None:
            return
        # A second Ctrl-C must not leave half of the cleanup undone.
        masked = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if masked else None
        try:
            problems = self.external.cleanup([ns.name for ns in self.scenario.namespaces])
        finally:
            if masked:
                signal.signal(signal.SIGINT, previous)
        for problem in problems:
            self.result.notes.append(f"not removed from the API server: {problem}")

    # --- processes ---------------------------------------------------------------------------------

    def _start_node_process(self, node: LabNode) -> None:
        argv = [*PODMETER, "node", "--kubeconfig", str(self.kubeconfig), "--node-name", node.name,
                "--pod-cidr", node.spec.pod_cidr, "--datapath", self.datapath, "--ip-reuse", node.spec.ip_reuse,
                "--link-prefix", node.spec.link_prefix, "--node-ip", node.address, *self._service_proxy_args()]
        process = self.processes.add(f"node-{node.name}", argv, self.out / "logs")
        env = self.cni.node_environment(node.name, node.spec.pod_cidr)
        with self._in_node(node):
            process.start(env)

    def _node_agent_argv(self, node: LabNode) -> list[str]:
        """LabRun's agent flags, for this node (its name, pins, filter size, port, fault)."""
        base = self._agent_argv()
        args = base[base.index("agent"):]  # before it: the interpreter, and the faulty agent's prefix
        for flag, value in (("--kubeconfig", str(self.kubeconfig)), ("--node-name", node.name),
                            ("--bpffs", str(node.bpffs)), ("--filter-map-size", str(node.spec.filter_map_size)),
                            ("--listen", f"127.0.0.1:{node.port}"),
                            *((("--hubble-listen", node.hubble),) if node.hubble is not None else ())):
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        return [*FAULTY_AGENT, node.fault, *args] if node.fault else [*PODMETER, *args]

    def start_agent(self, node: str | None = None) -> None:
        lab_node = self._node(node)
        process = self.processes.processes.get(lab_node.agent)
        if process is None:
            process = self.processes.add(lab_node.agent, self._node_agent_argv(lab_node), self.out / "logs")
            if lab_node.netns is not None:  # the agent's loopback ports, on the runner's loopback too
                for port in (lab_node.port, lab_node.hubble_port):
                    if port is not None:
                        self.relays.add(("127.0.0.1", port), ("127.0.0.1", port), target_netns=lab_node.netns)
        with self._in_node(lab_node):
            process.start()
        wait_ready(f"{lab_node.url}/readyz", process)
        if process.starts > 1:
            lab_node.restarted_at = time.monotonic()
            for mark in reversed(self.result.marks):
                if mark.kind == runinfo.AGENT_KILL and mark.until is None and lab_node.name in mark.label:
                    mark.until = self._now()
                    break
        lab_node.restarting = False
        self.baselines.pop(lab_node.agent, None)  # a new process: a new baseline

    def kill_agent(self, node: str | None = None) -> None:
        lab_node = self._node(node)
        lab_node.restarting = True
        self.processes[lab_node.agent].kill()
        self.result.marks.append(Mark(self._now(), runinfo.AGENT_KILL, f"agent SIGKILL ({lab_node.name})"))

    def _operator_argv(self) -> list[str]:
        # A fixed holder identity, as a crashed container restarted in the same pod keeps; the restarted
        # operator did not write the Lease it finds under that name, so it waits it out like any other
        # holder's: a short lease lets it lead again within the scenario's settle time.
        argv = [*PODMETER, "operator", "--kubeconfig", str(self.kubeconfig),
                "--listen", f"127.0.0.1:{self.operator_port}",
                "--sweep-period", str(self.scenario.operator.sweep_period),
                "--holder-identity", f"podmeter-lab-{self.tag}",
                "--lease-duration", "2", "--renew-deadline", "1.5", "--retry-period", "0.3"]
        if self.external is not None:
            argv += ["--lease-namespace", self.external.lease_namespace, "--lease-name", "podmeter-lab-operator"]
        return argv

    def _start_operator(self) -> None:
        if not self.scenario.operator.enabled:
            return
        process = self.processes.add("operator", self._operator_argv(), self.out / "logs")
        process.start()
        wait_ready(f"http://127.0.0.1:{self.operator_port}/readyz", process)

    def kill_operator(self) -> None:
        self._operator_down = True
        self.processes["operator"].kill()

    def start_operator(self) -> None:
        process = self.processes["operator"]
        process.start()
        wait_ready(f"http://127.0.0.1:{self.operator_port}/readyz", process)
        self.baselines.pop("operator", None)
        self._operator_down = False

    def hold(self) -> None:
        super().hold()
        for node in self.nodes:
            node.checker.hold()

    def release(self) -> None:
        for node in self.nodes:
            node.checker.release()
        super().release()

    def _remove_leftover_sandboxes(self) -> None:
        for node in self.nodes:
            if node.netns is not None and Path(node.netns).exists():
                with self._in_node(node):
                    super()._remove_leftover_sandboxes()

    # --- sampling ------------------------------------------------------------------------------------

    def _read_truths(self) -> tuple[dict[str, Truth], list[Pod]]:
        """One read of the API server (namespaces, the configuration, every pod), judged for each node with
        the model's rules, as :func:`podmeter.lab.checks.read_truth` does for one."""
        client = self._client()
        namespaces = [decode_namespace(ns) for ns in client.list("/api/v1/namespaces").get("items") or []]
        config = client.get(f"{MCONF_PATH}/{DEFAULT_NAME}")
        pods: list[Pod] = []
        for item in client.list("/api/v1/pods").get("items") or []:
            with contextlib.suppress(DecodeError):  # another's pod the model refuses (a real cluster's)
                pods.append(decode_pod(item))
        keys = {key_of_flat(p.namespace, p.labels, self._label_filter) for p in pods if holds_identity(p)}
        truths: dict[str, Truth] = {}
        for node in self.nodes:
            view = NodeView(node.name)
            view.apply(Replace(NAMESPACES, namespaces))
            if config is not None:
                with contextlib.suppress(DecodeError):
                    view.apply(Upsert(CONFIGURATIONS, decode_configuration(config)))
            node_pods = {p.uid: p for p in pods if p.node_name == node.name}
            view.apply(Replace(PODS, list(node_pods.values())))
            truths[node.name] = Truth(node_pods, view.recompute(), keys,
                                      {(p.namespace, p.name) for p in node_pods.values()})
        return truths, pods

    def _json(self, url: str) -> Any:
        text = http_text(url)
        return json.loads(text) if text else None

    def _operator_view(self) -> tuple[Samples | None, dict[str, Any] | None]:
        if "operator" not in self.processes.processes or self._operator_down:
            return None, None
        base = f"http://127.0.0.1:{self.operator_port}"
        return parse_metrics(http_text(f"{base}/metrics")) or None, self._json(f"{base}/debug/identities")

    def _sample_once(self) -> None:
        truths, pods = self._read_truths()
        for truth in truths.values():
            for pod in truth.node_pods.values():
                for ip in pod.ips:
                    self.held.setdefault(ip, set()).add(pod.key)
        operator, identities = self._operator_view()
        expected: dict[str, Named] | None = None
        if identities is not None:
            self._identities = identities_by_uid(pods, identities.get("identities") or [], self._label_filter)
            expected = expected_cache(pods, self._identities)
        now = time.monotonic()
        totals: dict[str, float] = {}
        kernels: list[int | None] = []
        open_violations = drift = 0
        for node in self.nodes:
            truth = truths[node.name]
            up = self.processes[node.agent].alive() and not node.restarting
            agent = parse_metrics(http_text(f"{node.url}/metrics")) if up else {}
            state = self._json(f"{node.url}/debug/state") if up else None
            cache = self._json(f"{node.url}/debug/endpoints") if up else None
            kernel, capacity = self._node_filter(node, state)
            obs = NodeObservation(now, truth, kernel, capacity, agent, None, up and bool(agent),
                                  agent_pods=None if state is None else set(state["pod_uids"]),
                                  endpoints=None if cache is None else cache_of(cache), expected=expected)
            violations = node.checker.observe(obs)
            node_drift = sum(v.invariant in ("I2", "I3") for v in violations)
            if node.restarted_at is not None and kernel is not None and node_drift == 0:
                node.convergence_s.append(round(now - node.restarted_at, 2))
                node.restarted_at = None
            pid = self.processes[node.agent].pid
            rss = rss_mib(pid) if pid else None
            if rss is not None and agent and node.agent not in self.baselines:
                self.baselines[node.agent] = rss
            node.last = {"pods": len(truth.node_pods), "desired": len(truth.desired),
                         "kernel": None if kernel is None else len(kernel),
                         "endpoints": None if cache is None else len(cache.get("endpoints") or {}), "rss": rss}
            for key, value in node.last.items():
                if key != "rss" and value is not None:
                    node.peaks[key] = max(node.peaks.get(key, 0), int(value))
            for name, metric, labels in (("events", "podmeter_watch_events_total", {"resource": "pods"}),
                                         ("relists", "podmeter_watch_relists_total", {}),
                                         ("repairs", "podmeter_drift_repaired_total", {})):
                value = metric_sum(agent, metric, **labels)
                totals[name] = totals.get(name, 0.0) + (value or 0.0)
            totals["agent_rss"] = totals.get("agent_rss", 0.0) + (rss or 0.0)
            kernels.append(node.last["kernel"])
            open_violations += len(violations)
            drift += node_drift
        keys = None if identities is None else {IdentityKey.decode(k) for k in identities.get("held") or []}
        cluster_truth = Truth({}, {}, next(iter(truths.values())).identity_keys, set())
        open_violations += len(self.checker.observe(Observation(now, cluster_truth, None, None, {}, operator, False,
                                                                operator_keys=keys)))
        op = self.processes.processes.get("operator")
        operator_rss = rss_mib(op.pid) if op is not None and op.pid else None
        if operator_rss is not None and operator and "operator" not in self.baselines:
            self.baselines["operator"] = operator_rss
        sample = Sample(
            t=round(now - self.started, 2), pods=sum(len(t.node_pods) for t in truths.values()),
            desired=sum(len(t.desired) for t in truths.values()),
            kernel=None if None in kernels else sum(k or 0 for k in kernels),
            agent_rss=round(totals["agent_rss"], 1) or None, operator_rss=operator_rss,
            identities=metric_sum(operator or {}, "podmeter_identities"), events=totals.get("events"),
            relists=totals.get("relists"), repairs=totals.get("repairs"), open_violations=open_violations,
            filter_drift=drift)
        self.result.samples.append(sample)
        self._last = sample

    def _node_filter(self, node: LabNode, state: dict[str, Any] | None) -> tuple[set[str] | None, int | None]:
        if self.datapath == "ebpf":
            try:
                with EbpfDatapath.open_pinned(node.bpffs) as datapath:
                    return datapath.contents(), datapath.capacity
            except Exception:  # no pins yet (the first agent is starting)
                return None, None
        if state is None:
            return None, None
        return set(state["filter"]["actual"]), int(state["filter"]["capacity"])

    def _latency_probe(self) -> None:
        """delete -> unmapped on every node: the IP's node is the one whose pod CIDR holds it."""
        pending = self._driver().stats.delete_times
        cidrs = [(ipaddress.ip_network(n.spec.pod_cidr), n) for n in self.nodes]
        while not self._stop_sampling.wait(0.01):
            if not pending:
                continue
            present: dict[str, set[str]] = {}
            for node in {n.name: n for ip in list(pending) for net, n in cidrs
                         if ipaddress.ip_address(ip) in net}.values():
                with contextlib.suppress(Exception), EbpfDatapath.open_pinned(node.bpffs) as datapath:
                    present[node.name] = datapath.contents()
            now = time.monotonic()
            for ip, since in list(pending.items()):
                owner = next((n.name for net, n in cidrs if ipaddress.ip_address(ip) in net), None)
                if owner is None or owner not in present:
                    continue
                if ip not in present[owner]:
                    self.latencies_ms.append((now - since) * 1000)
                    pending.pop(ip, None)
                elif now - since > 5.0:
                    pending.pop(ip, None)
                    self.latency_unseen += 1

    def _driver(self) -> Driver:
        assert self.driver is not None
        return self.driver

    def _settled(self) -> bool:
        """Every node empty and every check clean (:meth:`LabRun._settle_at_end` waits for it)."""
        return super()._settled() and not any(n.checker.open for n in self.nodes)

    def _memory(self) -> dict[str, Any]:
        memory: dict[str, Any] = {"tolerance_mib": self.scenario.memory_tolerance_mib}
        for name in [*(n.agent for n in self.nodes), "operator"]:
            process = self.processes.processes.get(name)
            end = rss_mib(process.pid) if process is not None and process.pid else None
            base = self.baselines.get(name)
            if end is None or base is None:
                continue
            growth = end - base
            memory[name] = {"baseline_mib": round(base, 1), "end_mib": round(end, 1), "growth_mib": round(growth, 1),
                            "returned": growth <= self.scenario.memory_tolerance_mib}
        return memory

    # --- traffic -------------------------------------------------------------------------------------

    def traffic(self, step: sc.Traffic, pods: list[tuple[str, str]], rng: random.Random) -> None:
        if self.datapath != "ebpf":
            self.result.traffic.append({"protocol": step.protocol, "skipped": "memory mode has no packets"})
            return
        for src, dst in _pairs(self._placed(pods), [n.name for n in self.nodes], step.pairs, step.across_nodes, rng):
            self._timed(functools.partial(self._exchange, step, src, dst))

    def service_calls(self, step: sc.ServiceCalls, pods: list[tuple[str, str]]) -> None:
        """With several nodes: the client's requests checked by its node's agent (each named by the Service
        and the backend that served it, on any node), and each connection a backend of another node served
        checked by that node's agent too: its record of the request entering the backend names the client
        and the backend pod (that node did not translate the connection: no Service, docs/services.md)."""
        if len(self.nodes) == 1 or self.datapath != "ebpf" or not self.options.service_proxy:
            super().service_calls(step, pods)
            return
        placed = self._placed(pods)
        endpoints = [p.endpoint for p in placed]
        backends, clients = servicecheck.taking_part(step, endpoints)
        if not clients:
            super().service_calls(step, pods)  # says which pods are missing
            return
        node_of = {p.pod: p.node for p in placed}
        client = clients[0]
        home = self._node(node_of[client.pod])
        self.checker.traffic_pods.update(e.pod for e in (*backends, *clients))
        interval = self.scenario.agent.flow_interval

        def drained(before: float | None) -> bool:
            return home.flows.wait_for_drains(before, 2, time.monotonic() + 3 * interval + 3)

        def far_side(calls: servicecheck.Calls, served: servicecheck.Served, since: float) -> dict[str, Any]:
            return self._far_backends(step, calls, served, since, node_of=node_of)

        self._timed(functools.partial(servicecheck.run_step, step, self._client(), home.flows, [client, *backends],
                                      drained, far_side=far_side))
        self.result.traffic[-1]["client_node"] = home.name

    def _far_backends(self, step: sc.ServiceCalls, calls: servicecheck.Calls, served: servicecheck.Served,
                      since: float, *, node_of: dict[str, str]) -> dict[str, Any]:
        """``node_of``: each pod's node. Each far node's agent is read after two drains from now (after the
        calls: the second began after their last packet)."""
        home = node_of[calls.client.pod]
        far: dict[str, dict[int, str]] = {}  # node -> client port -> the backend of that node that served it
        for port in calls.ports:
            pod = served.by_port.get(port)
            if pod is not None and node_of.get(pod, home) != home:
                far.setdefault(node_of[pod], {})[port] = pod
        problems = [] if far else ["no connection reached a backend on another node"]
        for name, ports in far.items():
            node = self._node(name)
            if not node.flows.wait_for_drains(None, 2, time.monotonic() + 3 * self.scenario.agent.flow_interval + 3):
                problems.append(f"the agent of {name} did not drain its flows twice in time")
            found = node.flows.records(since - WINDOW_SLACK, protocol="tcp", port=step.target_port) or []
            entering = {int(r["source"]["port"]): r for r in found if r.get("observation") == TO_POD
                        and r["source"]["ip"] == calls.client.ip and r["destination"]["port"] == step.target_port}
            for port, pod in sorted(ports.items()):
                record = entering.get(port)
                if record is None:
                    problems.append(f"{name}: no record of port {port} entering {pod}")
                    continue
                source, destination = record["source"], record["destination"]
                named = (f"{source.get('namespace')}/{source.get('pod')}",
                         f"{destination.get('namespace')}/{destination.get('pod')}")
                if named != (calls.client.pod, pod):
                    problems.append(f"{name}: port {port} named {named[0]} -> {named[1]}, "
                                    f"{calls.client.pod} -> {pod} expected")
        return {"problems": problems, "far_backends": {n: len(p) for n, p in far.items()}}

    def _placed(self, pods: list[tuple[str, str]]) -> list[Placed]:
        found = []
        for ns, name in pods:
            pod = self._client().get(pod_path(ns, name)) or {}
            status = pod.get("status") or {}
            if status.get("phase") == "Running" and status.get("podIP"):
                sandbox = Sandbox.for_pod(pod["metadata"]["uid"], status["podIP"])
                found.append(Placed(Endpoint(f"{ns}/{name}", status["podIP"], sandbox.netns_path),
                                    str(pod["spec"].get("nodeName"))))
        return found

    def _node_counters(self, node: LabNode) -> Counters:
        with EbpfDatapath.open_pinned(node.bpffs) as datapath:
            return {k: (v.packets, v.bytes) for k, v in datapath.read_counters().items()}

    def _wait_named(self, ends: Sequence[Placed], nodes: Sequence[LabNode]) -> tuple[dict[str, int | None], str | None]:
        """Until every agent of the exchange names both ends with the operator's identities (bounded: the
        checks after settle are I7's): pod -> identity, and a problem when that did not happen in time."""
        deadline = time.monotonic() + NAMED_WAIT
        client = self._client()
        while True:
            identities: dict[str, int | None] = {}
            want: dict[str, Named | None] = {}
            objects = [client.get(pod_path(*end.pod.split("/", 1))) for end in ends]
            _, held = self._operator_view()
            by_uid = identities_by_uid([decode_pod(o) for o in objects if o is not None],
                                       (held or {}).get("identities") or [], self._label_filter)
            for end, obj in zip(ends, objects, strict=True):
                ident = by_uid.get(obj["metadata"]["uid"]) if obj is not None else None
                identities[end.pod] = ident
                ns, name = end.pod.split("/", 1)
                want[end.endpoint.ip] = None if ident is None else (ns, name, ident)
            caches = [cache_of(self._json(f"{n.url}/debug/endpoints") or {}) for n in nodes]
            if all(w is not None and c.get(ip) == w for c in caches for ip, w in want.items()):
                return identities, None
            if time.monotonic() > deadline:
                lacking = sorted(f"{n.name}: {ip}" for n, c in zip(nodes, caches, strict=True)
                                 for ip, w in want.items() if w is None or c.get(ip) != w)
                return identities, (f"not every agent named both ends with the operator's identity within "
                                    f"{NAMED_WAIT:g} s ({', '.join(lacking)})")
            time.sleep(0.1)

    def _exchange(self, step: sc.Traffic, src: Placed, dst: Placed) -> dict[str, Any]:
        """One exchange between two pods (of two nodes, or one), checked against the kernel counters of both
        nodes, both agents' per-pod series and both agents' flow records."""
        src_node, dst_node = self._node(src.node), self._node(dst.node)
        involved = [src_node] if src_node is dst_node else [src_node, dst_node]
        self.checker.traffic_pods.update((src.pod, dst.pod))
        identities, unnamed = self._wait_named([src, dst], involved)
        since = time.time()
        before = {n.name: self._node_counters(n) for n in involved}
        metrics_before = {n.name: n.flows.metrics() for n in involved}
        if step.protocol == "udp":
            sent = send_udp(src.endpoint, dst.endpoint, step.packets, step.size, step.rate)
        else:
            sent = send_tcp(src.endpoint, dst.endpoint, step.packets, step.size, step.rate)
        sent_at = time.time()
        drains = {n.name: n.flows.drains() for n in involved}
        time.sleep(1.0)  # in-flight packets; the per-pod series are read at scrape time
        after = {n.name: self._node_counters(n) for n in involved}
        metrics_after = {n.name: n.flows.metrics() for n in involved}

        def delta(node: LabNode, ip: str, direction: Direction) -> tuple[int, int]:
            b, a = before[node.name].get((ip, direction), (0, 0)), after[node.name].get((ip, direction), (0, 0))
            return a[0] - b[0], a[1] - b[1]

        out = delta(src_node, src.endpoint.ip, Direction.EGRESS)
        into = delta(dst_node, dst.endpoint.ip, Direction.INGRESS)
        back_out = delta(dst_node, dst.endpoint.ip, Direction.EGRESS)
        back_in = delta(src_node, src.endpoint.ip, Direction.INGRESS)
        record: dict[str, Any] = {"protocol": step.protocol, "src": src.pod, "dst": dst.pod, "src_ip": src.endpoint.ip,
                                  "dst_ip": dst.endpoint.ip, "src_node": src.node, "dst_node": dst.node,
                                  "ports": [sent.source_port, sent.destination_port], "delivered": sent.delivered,
                                  "src_egress": out, "dst_ingress": into}
        if step.protocol == "udp":
            want = (step.packets, step.packets * (step.size + UDP_OVERHEAD))
            ok = sent.delivered == step.packets and out == want and into == want and back_out == back_in == (0, 0)
            record["expected"] = want
            forward = {FROM_POD: want, TO_POD: want}
            flags: frozenset[str] = frozenset()
        else:
            payload = step.packets * step.size
            ok = sent.delivered == payload and out == into and out[1] >= payload and back_out == back_in
            forward = {FROM_POD: out, TO_POD: into}
            flags = frozenset({"SYN", "FIN"})
        series_out = _pod_bytes(metrics_after[src_node.name], src.pod, "egress") - \
            _pod_bytes(metrics_before[src_node.name], src.pod, "egress")
        series_in = _pod_bytes(metrics_after[dst_node.name], dst.pod, "ingress") - \
            _pod_bytes(metrics_before[dst_node.name], dst.pod, "ingress")
        record["metrics"] = {"src_egress_bytes": series_out, "dst_ingress_bytes": series_in}
        ok = ok and series_out == out[1] and series_in == into[1]
        driver = self._driver()
        ends = {end.pod: PodEnd(end.pod, end.endpoint.ip, port, driver.workload_of(end.pod))
                for end, port in ((src, sent.source_port), (dst, sent.destination_port))}
        for end in ends.values():
            self.held.setdefault(end.ip, set()).add(end.pod)
        expect = Expectation(step.protocol.upper(), [Holder(ends[src.pod], forward, (since, sent_at))], ends[dst.pod],
                             {FROM_POD: back_out, TO_POD: back_in}, forward_flags=flags, reverse_flags=flags,
                             node=None)
        verdict = self._two_sided_check(expect, involved, since=since, drains=drains, metrics_before=metrics_before,
                                        pod_nodes={src.pod: src.node, dst.pod: dst.node}, identities=identities)
        if unnamed:
            verdict["problems"].insert(0, unnamed)
            verdict["ok"] = False
        record["flow"] = verdict
        record["ok"] = ok and verdict["ok"]
        return record

    def _two_sided_check(self, expect: Expectation, involved: Sequence[LabNode], *, since: float,
                         drains: dict[str, float | None], metrics_before: dict[str, Samples],
                         pod_nodes: dict[str, str], identities: dict[str, int | None]) -> dict[str, Any]:
        """Both agents drained twice after the exchange; their records of it, checked together
        (:func:`~podmeter.lab.endpointcheck.check_cross_flow`), and each agent's workload series against its
        own records (each packet counted once per node)."""
        interval = self.scenario.agent.flow_interval
        deadline = time.monotonic() + 3 * interval + 3
        drained = [n.name for n in involved if not n.flows.wait_for_drains(drains[n.name], 2, deadline)]
        by_node: dict[str, list[Record]] = {}
        silent = []
        for node in involved:
            records = node.flows.records(since - WINDOW_SLACK, protocol=expect.protocol.lower(),
                                         port=expect.destination.port, verdict="forwarded")
            if records is None:
                silent.append(node.name)
            by_node[node.name] = of_key(records or [], expect.key)
            self.flow_records.extend(by_node[node.name])
        verdict = check_cross_flow(expect, by_node, pod_nodes, identities)
        problems: list[str] = verdict["problems"]
        for node in involved:
            grown = series_bytes(by_node[node.name])
            before, now = series_values(metrics_before[node.name], grown), series_values(node.flows.metrics(), grown)
            problems += [f"{node.name}: {p}" for p in check_series(grown, before, now)]
        problems[:0] = [f"the agent of {n} did not drain its flows twice within {3 * interval + 3:g} s"
                        for n in drained]
        problems[:0] = [f"the agent of {n}'s /debug/flows did not answer" for n in silent]
        verdict["ok"] = not problems
        return verdict

    def reuse_during_flow(self, step: sc.ReuseDuringFlow, pods: list[tuple[str, str]], rng: random.Random) -> None:
        if len(self.nodes) == 1:
            super().reuse_during_flow(step, pods, rng)
            return
        self.result.traffic.append({"protocol": "udp", "kind": "reuse-during-flow",
                                    "skipped": "a single-node step: not in multi-node scenarios"})

    def induce_drops(self, step: sc.InduceDrops, pods: list[tuple[str, str]], rng: random.Random) -> None:
        if len(self.nodes) == 1:
            with self._in_node(self.first):  # its routes and rules go into the node, never the machine
                super().induce_drops(step, pods, rng)
            return
        self.result.traffic.append({"protocol": "udp", "kind": "drops",
                                    "skipped": "a single-node step: not in multi-node scenarios"})

    def induce_loss(self, step: sc.InduceLoss, pods: list[tuple[str, str]], rng: random.Random) -> None:
        if len(self.nodes) == 1:
            with self._in_node(self.first):
                super().induce_loss(step, pods, rng)
            return
        self.result.traffic.append({"protocol": "tcp", "kind": "loss",
                                    "skipped": "a single-node step: not in multi-node scenarios"})

    def service_apps(self, step: sc.ServiceApps, pods: list[tuple[str, str]]) -> None:
        if len(self.nodes) == 1:
            super().service_apps(step, pods)
            return
        self.result.traffic.append({"protocol": "tcp", "kind": f"apps-{step.program}",
                                    "skipped": "a single-node step: not in multi-node scenarios"})

    # --- the end -------------------------------------------------------------------------------------

    def _collect(self) -> None:
        stats = self._driver().stats
        failures: list[dict[str, Any]] = []
        transients: dict[str, dict[str, Any]] = {}
        transient_count = overflow = 0
        checked: set[str] = set()
        for node_name, checker in [(None, self.checker), *((n.name, n.checker) for n in self.nodes)]:
            summary = checker.summary()
            checked.update(summary.get("checked") or ())
            failures += [{**f, "node": node_name} for f in summary["failures"]]
            transient_count += summary["transient"]
            overflow = max(overflow, summary["overflow_max_waiting"])
            for invariant, t in (summary.get("transients") or {}).items():
                merged = transients.setdefault(invariant, {**t, "count": 0, "longest_s": -1.0})
                merged["count"] += t["count"]
                if t["longest_s"] > merged["longest_s"]:
                    merged.update({**t, "count": merged["count"], "node": node_name})
        records_at_end: dict[str, int | None] = {}
        if self.datapath == "ebpf":
            for node in self.nodes:  # I8 on every agent, over the whole run
                everything = node.flows.records(self.started_wall)
                records_at_end[node.name] = None if everything is None else len(everything)
                for ip, detail in misnamed(everything or [], self.held):
                    failures.append({"invariant": "I8", "subject": ip, "detail": f"{node.name}: {detail}",
                                     "lasted_s": 0, "node": node.name})
        self.result.failures, self.result.transients = failures, transients
        self.result.checked = sorted(checked)
        self.result.flows = aggregate(self.flow_records)
        exchanges = [t for t in self.result.traffic if "flow" in t]
        flow_counts: dict[str, Any] = {"checked": len(exchanges),
                                       "exact": sum(bool(t["flow"]["ok"]) for t in exchanges),
                                       "records_at_end": None if None in records_at_end.values() or not records_at_end
                                       else sum(n for n in records_at_end.values() if n is not None)}
        reused = sorted(ip for ip, holders in self.held.items() if len(holders) > 1)
        self.result.counts = {
            "nodes": len(self.nodes),
            "pods_created": stats.created, "pods_deleted": stats.deleted, "lifecycles": stats.lifecycles,
            "deleted_in_phase": dict(stats.deleted_in_phase),
            "interest_flips": stats.flips, "faults": stats.faults, "agent_kills": stats.agent_kills,
            "operator_kills": stats.operator_kills, "driver_errors": stats.errors,
            "transient_violations": transient_count, "overflow_max_waiting": overflow,
            "ips_reused": len(reused),
            "max_filter_drift": max((s.filter_drift for s in self.result.samples), default=0),
            "delete_to_unmapped_ms": {**_percentiles(self.latencies_ms), "unseen": self.latency_unseen},
            "restart_converged_after_s": [c for n in self.nodes for c in n.convergence_s],  # per node: nodes
            "flow_checks": flow_counts,
        }
        self.result.nodes = [self._node_summary(n, failures, records_at_end) for n in self.nodes]
        self.result.cross_node = self._cross_node()

    def _node_summary(self, node: LabNode, failures: list[dict[str, Any]],
                      records_at_end: dict[str, int | None]) -> dict[str, Any]:
        process = self.processes.processes.get(node.agent)
        mine = [f for f in failures if f.get("node") == node.name]
        return {
            "name": node.name, "pod_cidr": node.spec.pod_cidr, "address": node.address, "netns": node.netns,
            "bpffs": str(node.bpffs), "agent_port": node.port, "agent_fault": node.fault, "hubble": node.hubble,
            "agent_starts": process.starts if process is not None else 0,
            "peaks": dict(node.peaks), "last": dict(node.last),
            "memory": self.result.memory.get(node.agent),
            "failures": len(mine), "failed_invariants": sorted({f["invariant"] for f in mine}),
            "transient_violations": node.checker.transient,
            "restart_converged_after_s": node.convergence_s,
            "flow_records_at_end": records_at_end.get(node.name),
        }

    def _cross_node(self) -> dict[str, Any]:
        """Source node -> destination node: the checked exchanges (and how many were exact) and the bytes
        of their flows, each packet counted once (where it left a pod)."""
        names = [n.name for n in self.nodes]
        cells: dict[str, dict[str, dict[str, Any]]] = {s: {d: {"checks": 0, "exact": 0, "packets": 0, "bytes": 0,
                                                               "flows": 0} for d in names} for s in names}
        for check in self.result.traffic:
            s, d = check.get("src_node"), check.get("dst_node")
            if s in cells and d in cells[s] and "flow" in check:
                cells[s][d]["checks"] += 1
                cells[s][d]["exact"] += int(bool(check.get("ok")))
        for (s, d), (packets, size, flows) in node_matrix(self.flow_records).items():
            if s in cells and d in cells[s]:
                cells[s][d].update(packets=cells[s][d]["packets"] + packets, bytes=cells[s][d]["bytes"] + size,
                                   flows=cells[s][d]["flows"] + flows)
        return {"nodes": names, "cells": cells}

    # --- the live display ----------------------------------------------------------------------------

    def watch_points(self) -> list[WatchPoint]:
        """Per node: each agent's loopback ports are relayed to the same ports of the runner's loopback in
        eBPF mode (in memory mode the agents are there), so the commands need no namespace."""
        return [WatchPoint(node.name, f"127.0.0.1:{node.port}", f"podmeter observe --server 127.0.0.1:{node.port} -f",
                           node.hubble, None if node.hubble is None else f"hubble observe --server {node.hubble} -f")
                for node in self.nodes]

    def _panel_rows(self) -> list[tuple[str, str]]:
        rows = super()._panel_rows()
        for node in self.nodes:
            last = node.last
            text = "-" if not last else (f"{last['pods']} pods, {last['desired']} desired, kernel "
                                         f"{_fmt(last['kernel'])}, {_fmt(last['endpoints'])} endpoints")
            rows.append((node.name, text))
        return rows


def _pod_bytes(samples: Samples, pod: str, direction: str) -> float:
    namespace, _, name = pod.partition("/")
    return metric_sum(samples, "podmeter_pod_bytes_total", namespace=namespace, pod=name, direction=direction) or 0.0


def _pairs(ends: list[Placed], nodes: list[str], pairs: int, across: bool,
           rng: random.Random) -> list[tuple[Placed, Placed]]:
    """Seeded pairs of running pods. ``across``: going round the nodes (the k-th pair from the k-th node to
    the next one, then two further...), so three pairs on three nodes cover a ring; else within a node."""
    by_node = {name: [e for e in ends if e.node == name] for name in nodes}
    for group in by_node.values():
        rng.shuffle(group)
    names = [n for n in nodes if by_node[n]]
    chosen: list[tuple[Placed, Placed]] = []
    if across:
        if len(names) < 2:
            return []
        for k in range(pairs):
            a = names[k % len(names)]
            b = names[(k + 1 + (k // len(names)) % (len(names) - 1)) % len(names)]
            src, dst = by_node[a], by_node[b]
            chosen.append((src[k // len(names) % len(src)], dst[k // len(names) % len(dst)]))
        return chosen
    for k in range(max((len(g) // 2 for g in by_node.values()), default=0)):
        for name in names:
            group = by_node[name]
            if len(group) >= 2 * (k + 1) and len(chosen) < pairs:
                chosen.append((group[2 * k], group[2 * k + 1]))
    return chosen


def _server_addresses(url: str) -> list[tuple[str, int]]:
    """The IP addresses and port of an API server URL, as the runner resolves its host (a relay listens on
    each inside every node namespace, so the node's processes reach it by the same URL)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    found = {str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    return [(ip, port) for ip in sorted(found)]
