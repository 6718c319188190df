"""``podmeter lab``: one scenario, the whole system, continuous checks, a verdict.

The run, in order:

1. In eBPF mode, a fresh network namespace stands for the node's root namespace: the API server, node,
   agent and operator all run inside it (they inherit it from the runner's thread), so the lab never
   touches the machine's own interfaces; the pins go to ``/sys/fs/bpf/pmlab<pid>``.
2. The processes start; the steps run on their timeline while a sampler checks the invariants every
   ``sample_interval`` (:mod:`podmeter.lab.checks`) and records the time series of the report.
3. After ``duration`` every pod is deleted; the run waits until the node is empty and the checks are
   clean, then ``settle`` seconds more, and measures memory against the baselines.
4. Everything is stopped and removed (processes, sandboxes, pins, the node namespace), also on failure.

The verdict is ``passed`` only if no violation outlived the settle time, every traffic check held, and
the agent's and operator's RSS came back within ``memory_tolerance_mib`` of their baselines.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.adapters.datapath.ebpf.links import dump_links
from podmeter.adapters.kube.connection import ALLOW_PLAIN_HTTP
from podmeter.lab import appcheck, dnscheck, runinfo, servicecheck
from podmeter.lab import scenario as sc
from podmeter.lab.apiserver.client import AdminClient
from podmeter.lab.checks import Checker, Observation, Samples, Truth, metric_sum, parse_metrics, read_truth
from podmeter.lab.cni import LabCni
from podmeter.lab.driver import Driver, Hooks
from podmeter.lab.dropcheck import DropSteps
from podmeter.lab.endpointslices import EndpointSliceController
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
    check_flow,
    check_series,
    misnamed,
    of_key,
    series_bytes,
    series_values,
)
from podmeter.lab.kube import KubeClient, KubeError, pod_path
from podmeter.lab.netns import Sandbox, host_device_of, in_namespace, is_root, node_namespace
from podmeter.lab.processes import (
    FAULTY_AGENT,
    PODMETER,
    LabProcess,
    ProcessSet,
    free_port,
    http_text,
    rss_mib,
    wait_for_file,
    wait_ready,
)
from podmeter.lab.runinfo import Mark, RunInfo
from podmeter.lab.traffic import UDP_OVERHEAD, Endpoint, UdpSink, send_datagrams, send_tcp, send_udp
from podmeter.model.datapath import Direction
from podmeter.model.identity import IdentityKey, LabelFilter

log = logging.getLogger("podmeter.lab")
NODE_NAME = "lab-node"
BPFFS = Path("/sys/fs/bpf")
REUSE_PORT = 5202  # the reuse-during-flow step's destination port (traffic steps use traffic.PORT)
POD_WAIT = 15.0  # seconds a lab pod of a reuse step may take to run, or the agent to learn of it


@dataclass
class LabOptions:
    out_dir: Path
    datapath: str | None = None  # override the scenario's choice
    progress: bool = True
    duration: float | None = None  # override the scenario's duration (benchmarks)
    lifecycles: int | None = None  # override the scenario's lifecycles (end after this many)
    kubeconfig: Path | None = None  # an existing API server instead of the embedded one (lab.cluster)
    hubble: bool | None = None  # override the scenario's agent.hubble (podmeter lab --hubble/--no-hubble)
    service_proxy: bool = True  # the nodes rewrite Services' frontends (False: a real kube-proxy does)


@dataclass(frozen=True)
class WatchPoint:
    """Where one node's agent serves its flows, and the commands that follow them live from a shell of the
    machine (the start banner, the live panel)."""

    node: str
    flows: str  # HOST:PORT of the agent's HTTP endpoints (/debug/flows)
    observe: str  # podmeter observe --server HOST:PORT -f, with its netns prefix where one is needed
    hubble: str | None = None  # HOST:PORT of the agent's Hubble API (--hubble), else None
    hubble_observe: str | None = None  # hubble observe --server HOST:PORT -f, the same prefix
    netns: str | None = None  # the network namespace both commands enter (eBPF single-node runs)


@dataclass
class Sample:
    t: float
    pods: int
    desired: int
    kernel: int | None
    agent_rss: float | None
    operator_rss: float | None
    identities: float | None
    events: float | None
    relists: float | None
    repairs: float | None
    open_violations: int
    filter_drift: int  # open I2/I3 violations: IPs leaked or missing in the kernel map right now


@dataclass
class LabResult:
    """Everything the report shows; ``passed`` is the verdict (the exit status of ``podmeter lab``)."""

    scenario: str
    datapath: str
    seed: int
    passed: bool = False
    failures: list[dict[str, Any]] = field(default_factory=list)
    traffic: list[dict[str, Any]] = field(default_factory=list)
    flows: list[dict[str, Any]] = field(default_factory=list)  # the checked exchanges' flows (flowcheck.aggregate)
    memory: dict[str, Any] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    counts: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    report_files: list[str] = field(default_factory=list)
    steps_s: float | None = None  # how long the steps ran (the duration, or less when lifecycles ended them)
    nodes: list[dict[str, Any]] = field(default_factory=list)  # multi-node runs: one summary per node
    cross_node: dict[str, Any] = field(default_factory=dict)  # multi-node runs: source node -> destination
    info: RunInfo | None = None  # version, commit, kernel, date, duration, ... (the report's run table)
    marks: list[Mark] = field(default_factory=list)  # faults, agent kills, holds: lines on the time plots
    transients: dict[str, dict[str, Any]] = field(default_factory=dict)  # invariant -> count, the longest
    checked: list[str] = field(default_factory=list)  # invariants the samples could check (I1-I5, ...)
    hubble: dict[str, str] = field(default_factory=dict)  # node -> its agent's Hubble API (--hubble), else empty


def choose_datapath(requested: str) -> tuple[str, str | None]:
    """(datapath, notice): ``auto`` is eBPF as root with bpffs mounted, else memory with a notice."""
    if requested == "memory":
        return "memory", None
    usable = is_root() and BPFFS.is_dir() and os.path.ismount(BPFFS)
    if requested == "ebpf" and not usable:
        raise RuntimeError("the eBPF lab needs root and bpffs at /sys/fs/bpf; use --datapath memory")
    if usable:
        return "ebpf", None
    return "memory", ("not root (or no bpffs): the lab runs in memory mode: IPs only, no namespaces, no "
                      "kernel map; the filter is read from the agent's /debug/state")


class LabRun(Hooks):
    def __init__(self, scenario: sc.Scenario, options: LabOptions) -> None:
        self.scenario = scenario
        self.options = options
        requested = options.datapath or scenario.datapath
        self.datapath, notice = choose_datapath(requested)
        self.result = LabResult(scenario.name, self.datapath, scenario.seed)
        if notice:
            self.result.notes.append(notice)
        self.out = options.out_dir.resolve()  # the servers of its steps are handed paths under it
        self.tag = f"pmlab{os.getpid()}"
        self.endpointslices: EndpointSliceController | None = None
        self.bpffs = BPFFS / self.tag
        # The embedded API server speaks HTTPS (its kubeconfig names its CA): no process of such a run may
        # need the plain-HTTP credentials allowance, so none inherits it (the test suite sets it for its own
        # plain servers), and a regression to plain HTTP fails the run. Against --kubeconfig the runner's
        # environment passes through: the allowance there is the user's explicit choice for a test server.
        self.processes = ProcessSet(withheld=frozenset({ALLOW_PLAIN_HTTP}) if options.kubeconfig is None
                                    else frozenset())
        # I5's allowance: the agent's series grace plus one sample (the scrape that sees the final value).
        self.checker = Checker(settle=scenario.settle,
                               metrics_grace=scenario.agent.series_grace + scenario.sample_interval)
        self.agent_port = free_port()
        self.operator_port = free_port()
        # Loopback, like the HTTP port: the Hubble API's default access rule lets local clients in without TLS.
        self.hubble_port = free_port() if hubble_wanted(scenario, options) else None
        if self.hubble_port is not None:
            self.result.hubble[NODE_NAME] = f"127.0.0.1:{self.hubble_port}"
        self.flow_client = FlowClient(f"http://127.0.0.1:{self.agent_port}")
        self.flow_records: list[Record] = []  # every record a flow check read (the report's matrix, top flows)
        self.held: dict[str, set[str]] = {}  # ip -> "ns/name" of every pod the lab saw hold it (I8)
        self.started_wall = time.time()
        self.client: KubeClient | None = None
        self.admin: AdminClient | None = None
        self.driver: Driver | None = None
        self.baselines: dict[str, float] = {}
        self.latencies_ms: list[float] = []
        self.latency_unseen = 0  # deletes whose IP was never seen leaving the map (reused first)
        self.started = time.monotonic()
        self._stop_sampling = threading.Event()
        self.interrupted = threading.Event()  # Ctrl-C or SIGTERM (interrupt): the run unwinds at its next pause
        self._last: Sample | None = None
        self._agent_restarting = False
        self._restarted_at: float | None = None
        self._held_since: float | None = None  # the checks are held since (a mark once released)
        self.convergence_s: list[float] = []  # I6: restart -> first sample with the kernel map == truth
        self._label_filter = LabelFilter()
        # How the nodes wire their pods (scenario key cni); a RuntimeError naming the package if its plugin is
        # not installed, as for a missing bpffs: before anything starts.
        self.cni = LabCni.for_run(scenario, self.datapath, self.out)
        if self.cni.note:
            self.result.notes.append(self.cni.note)

    # --- the whole run -----------------------------------------------------------------------------

    def interrupt(self) -> None:
        """Ctrl-C or SIGTERM (``podmeter lab``'s handler): the main thread raises KeyboardInterrupt at its next
        pause and unwinds through the teardown, never from the middle of a call (a lock held, a process
        half started), where an exception raised by the signal itself could leave the teardown waiting on
        what the interrupted call held."""
        self.interrupted.set()

    def _pause(self, seconds: float) -> None:
        if self.interrupted.wait(seconds):
            raise KeyboardInterrupt

    def run(self) -> LabResult:
        self.out.mkdir(parents=True, exist_ok=True)
        self.result.info = info = runinfo.collect(self.scenario, self.datapath, self.out,
                                                  self.options.duration or self.scenario.duration)
        try:
            with self._node_namespace():
                self._run_processes()
        except Exception as exc:
            log.exception("lab run failed")
            self.result.error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.client is not None:
                self.client.close()
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(self.bpffs)
            info.duration_s = round(time.time() - info.started_unix, 1)
        self.result.passed = self._verdict()
        return self.result

    @contextlib.contextmanager
    def _node_namespace(self) -> Iterator[None]:
        if self.datapath != "ebpf":
            yield
            return
        with node_namespace(self.tag) as path, in_namespace(path):
            yield

    def _run_processes(self) -> None:
        try:
            self._start_apiserver()
            assert self.client is not None and self.admin is not None
            self.driver = Driver(self.scenario, self.client, self.admin, NODE_NAME, self)
            self.driver.create_namespaces()
            self._start_node()
            self.start_agent()
            self._start_operator()
            self._timeline()
        finally:
            if self.driver is not None:
                self.driver.stop.set()
            self._stop_sampling.set()
            self._stop_endpointslices()
            self.processes.stop_all()
            self._remove_leftover_sandboxes()
            self._finish_cni(lambda node: contextlib.nullcontext())  # the runner is in the node's namespace

    def _finish_cni(self, inside: Callable[[str], contextlib.AbstractContextManager[None]]) -> None:
        """A CNI plugin's run: what the nodes left of its state is a failure, then all of it goes."""
        if not self.cni.active:
            return
        failures, counts = self.cni.finish(inside)
        self.result.failures += failures
        self.result.counts["cni"] = counts

    def _timeline(self) -> None:
        assert self.driver is not None
        sampler = threading.Thread(target=self._sample_loop, name="lab-sampler", daemon=True)
        probe = threading.Thread(target=self._latency_probe, name="lab-latency", daemon=True)
        self._pause(0)  # interrupted while the processes started: no timeline
        self.started, self.started_wall = time.monotonic(), time.time()
        self._announce()
        sampler.start()
        if self.datapath == "ebpf":
            probe.start()
        with self._progress():
            duration = self.options.duration or self.scenario.duration
            steps = threading.Thread(target=self.driver.run_steps, args=(self.started,), daemon=True)
            steps.start()
            self._wait_for_end(self.started + duration, self.options.lifecycles or self.scenario.lifecycles)
            self._end_steps(steps, duration)
            self.driver.stats.step = "teardown: deleting every pod"
            self.driver.delete_everything()
            self._settle_at_end()
        self._stop_sampling.set()
        sampler.join(timeout=10)
        self._collect()

    def _end_steps(self, steps: threading.Thread, duration: float) -> None:
        """No step starts after the duration; the one in flight runs to its end before the teardown deletes
        a pod. A traffic or drops step measures its pods' kernel counters before and after its exchange: a
        pod deleted in between takes its IP out of the filter, its counters reset, and the exact check
        would compare against another pod's (or no) traffic. Churn threads stop at once (their pods are
        theirs, never a step's traffic ends)."""
        assert self.driver is not None
        self.driver.stop.set()
        steps.join()
        self.driver.join()
        self.result.steps_s = round(time.monotonic() - self.started, 1)
        self.result.marks.append(Mark(self.result.steps_s, runinfo.TEARDOWN, "teardown"))
        if self.result.steps_s > duration + 0.5:  # stats.step: the last step started, "<at>s <kind>"
            self.result.notes.append(f"the step {self.driver.stats.step} ran until "
                                     f"{self.result.steps_s:g} s, past the {duration:g} s of steps: the "
                                     "teardown waited for it, so no check measured a pod it deleted")

    def _wait_for_end(self, deadline: float, lifecycles: int | None) -> None:
        """Until the duration is over, or the wanted number of lifecycles is done."""
        assert self.driver is not None
        while (left := deadline - time.monotonic()) > 0:
            if lifecycles is not None and self.driver.stats.lifecycles >= lifecycles:
                return
            self._pause(min(0.2, left))

    def _settle_at_end(self) -> None:
        """Wait for an empty node and clean checks (bounded), then ``settle`` more: memory baselines."""
        assert self.driver is not None
        # Bounded: a broken agent never converges, and its failures are already recorded by then.
        deadline = time.monotonic() + max(10.0, 3 * self.scenario.settle)
        while time.monotonic() < deadline and not self._settled():
            self._pause(0.2)
        self.driver.stats.step = "teardown: settling"
        self._pause(self.scenario.settle)
        # Two samples after the settle time, so every failure has been judged.
        self._pause(2 * self.scenario.sample_interval)
        self.result.memory = self._memory()

    def _settled(self) -> bool:
        """The node empty (its last sample) and no check open."""
        last = self._last
        return last is not None and last.pods == 0 and last.desired == 0 and not self.checker.open

    # --- processes ---------------------------------------------------------------------------------

    def _start_apiserver(self) -> None:
        """HTTPS, with a self-signed certificate in ``<out>/tls`` that the kubeconfig names as the CA: every
        process (node, agent, operator) and the lab's own clients verify the server by it."""
        kubeconfig = self.out / "kubeconfig"
        kubeconfig.unlink(missing_ok=True)
        argv = [*PODMETER, "apiserver", "--listen", "127.0.0.1:0", "--kubeconfig-out", str(kubeconfig),
                "--tls-dir", str(self.out / "tls"), "--history", str(self.scenario.apiserver.history)]
        process = self.processes.add("apiserver", argv, self.out / "logs")
        process.start()
        wait_for_file(kubeconfig, process)
        self.client = KubeClient.from_kubeconfig(str(kubeconfig))
        self.admin = AdminClient(self.client.server, self.client.token or "", self.client.ca_file)
        # The embedded server has no controller manager: the lab runs the EndpointSlice controller (a real
        # server's own does it with --kubeconfig).
        self.endpointslices = EndpointSliceController(KubeClient.from_kubeconfig(str(kubeconfig)))
        self.endpointslices.start()

    def _stop_endpointslices(self) -> None:
        if self.endpointslices is not None:
            self.endpointslices.stop()
            self.endpointslices = None

    def _service_proxy_args(self) -> list[str]:
        """The node's Service proxy: with the eBPF datapath (pods are real netns) unless a real kube-proxy
        does it (``--no-service-proxy``)."""
        return ["--service-proxy"] if self.options.service_proxy and self.datapath == "ebpf" else []

    def _start_node(self) -> None:
        argv = [*PODMETER, "node", "--kubeconfig", str(self.out / "kubeconfig"), "--node-name", NODE_NAME,
                "--pod-cidr", self.scenario.node.pod_cidr, "--datapath", self.datapath,
                "--ip-reuse", self.scenario.node.ip_reuse, "--link-prefix", self.scenario.node.link_prefix,
                *self._service_proxy_args()]
        env = self.cni.node_environment(NODE_NAME, self.scenario.node.pod_cidr)
        self.processes.add("node", argv, self.out / "logs").start(env)

    def _agent_argv(self) -> list[str]:
        args = ["agent", "--kubeconfig", str(self.out / "kubeconfig"), "--node-name", NODE_NAME,
                "--datapath", self.datapath, "--bpffs", str(self.bpffs),
                "--filter-map-size", str(self.scenario.node.filter_map_size),
                "--listen", f"127.0.0.1:{self.agent_port}",
                "--resync-interval", str(self.scenario.agent.resync_interval),
                "--series-grace", str(self.scenario.agent.series_grace),
                "--flow-interval", str(self.scenario.agent.flow_interval),
                "--flow-buffer", str(self.scenario.agent.flow_buffer),
                # Every scrape rendered afresh: the checks compare /metrics with the kernel read a moment
                # before, and wait on podmeter_flow_drains_total for a drain after each exchange.
                "--metrics-min-interval", "0"]
        if self.hubble_port is not None:
            args += ["--hubble-listen", f"127.0.0.1:{self.hubble_port}"]
        if self.scenario.agent.fault is not None:
            return [*FAULTY_AGENT, self.scenario.agent.fault, *args]
        return [*PODMETER, *args]

    def start_agent(self, node: str | None = None) -> None:
        process = self.processes.processes.get("agent")
        if process is None:
            process = self.processes.add("agent", self._agent_argv(), self.out / "logs")
        process.start()
        wait_ready(f"http://127.0.0.1:{self.agent_port}/readyz", process)
        if process.starts > 1:
            self._restarted_at = time.monotonic()
            for mark in reversed(self.result.marks):
                if mark.kind == runinfo.AGENT_KILL and mark.until is None:
                    mark.until = self._now()
                    break
        self._agent_restarting = False
        self.baselines.pop("agent", None)  # a new process: a new baseline

    def kill_agent(self, node: str | None = None) -> None:
        self._agent_restarting = True
        self.processes["agent"].kill()
        self.result.marks.append(Mark(self._now(), runinfo.AGENT_KILL, "agent SIGKILL"))

    def step_started(self, step: sc.Step) -> None:
        if runinfo.is_marked(step):
            self.result.marks.append(Mark(self._now(), runinfo.FAULT, runinfo.step_label(step)))

    def _now(self) -> float:
        """Seconds since the steps started: the samples' and the marks' time."""
        return round(time.monotonic() - self.started, 2)

    def _start_operator(self) -> None:
        if not self.scenario.operator.enabled:
            return
        argv = [*PODMETER, "operator", "--kubeconfig", str(self.out / "kubeconfig"),
                "--listen", f"127.0.0.1:{self.operator_port}",
                "--sweep-period", str(self.scenario.operator.sweep_period)]
        process = self.processes.add("operator", argv, self.out / "logs")
        process.start()
        wait_ready(f"http://127.0.0.1:{self.operator_port}/readyz", process)

    def hold(self) -> None:
        if not self.checker.held:
            self._held_since = self._now()
        self.checker.hold()

    def release(self) -> None:
        self.checker.release()
        if not self.checker.held and self._held_since is not None:
            self.result.marks.append(Mark(self._held_since, runinfo.HELD, "checks held", until=self._now()))
            self._held_since = None

    def _remove_leftover_sandboxes(self) -> None:
        """Sandboxes a killed node could not remove: every pod namespace of this run's node namespace."""
        if self.datapath != "ebpf" or self.client is None:
            return
        ours = {name for name, _ in dump_links().values()}  # the node namespace's (sysfs: the machine's)
        for path in list(Path("/run/netns").glob("pmpod-*")):
            host_device = host_device_of(path.name, ours)  # whatever the scenario's link_prefix
            if host_device is not None:
                with contextlib.suppress(OSError):
                    Sandbox(path.name, host_device, "").destroy(wait=True)

    # --- sampling ------------------------------------------------------------------------------------

    def _sample_loop(self) -> None:
        interval = self.scenario.sample_interval
        while not self._stop_sampling.wait(interval):
            try:
                self._sample_once()
            except Exception as exc:  # a sample that fails is retried at the next tick (API server restart)
                log.warning("sample skipped: %s", exc)

    def _sample_once(self) -> None:
        assert self.client is not None
        truth = read_truth(self.client, NODE_NAME, self._label_filter)
        for pod in truth.node_pods.values():
            for ip in pod.ips:
                self.held.setdefault(ip, set()).add(pod.key)
        agent_proc = self.processes["agent"]
        agent_up = agent_proc.alive() and not self._agent_restarting
        agent = parse_metrics(http_text(f"http://127.0.0.1:{self.agent_port}/metrics")) if agent_up else {}
        operator = None
        if "operator" in self.processes.processes:
            operator = parse_metrics(http_text(f"http://127.0.0.1:{self.operator_port}/metrics")) or None
        state = self._agent_state() if agent_up else None
        kernel, capacity = self._kernel_filter(state)
        obs = Observation(time.monotonic(), truth, kernel, capacity, agent, operator, agent_up and bool(agent),
                          agent_pods=None if state is None else set(state["pod_uids"]),
                          operator_keys=self._operator_keys() if operator is not None else None)
        violations = self.checker.observe(obs)
        drift = sum(v.invariant in ("I2", "I3") for v in violations)
        if self._restarted_at is not None and kernel is not None and drift == 0:
            self.convergence_s.append(round(time.monotonic() - self._restarted_at, 2))
            self._restarted_at = None
        self._record(truth, kernel, agent, operator, violations=len(violations), drift=drift)

    def _agent_state(self) -> dict[str, Any] | None:
        text = http_text(f"http://127.0.0.1:{self.agent_port}/debug/state")
        return json.loads(text) if text else None

    def _operator_keys(self) -> set[IdentityKey] | None:
        text = http_text(f"http://127.0.0.1:{self.operator_port}/debug/identities")
        return {IdentityKey.decode(key) for key in json.loads(text)["held"]} if text else None

    def _kernel_filter(self, state: dict[str, Any] | None) -> tuple[set[str] | None, int | None]:
        """The filter as the kernel has it (eBPF: the pinned map, read here), or in memory mode as the agent's
        in-memory datapath has it (there is nothing else to read)."""
        if self.datapath == "ebpf":
            try:
                with EbpfDatapath.open_pinned(self.bpffs) as datapath:
                    return datapath.contents(), datapath.capacity
            except Exception:  # no pins yet (the first agent is starting)
                return None, None
        if state is None:
            return None, None
        return set(state["filter"]["actual"]), int(state["filter"]["capacity"])

    def _record(self, truth: Truth, kernel: set[str] | None, agent: Any, operator: Any, *, violations: int,
                drift: int) -> None:
        agent_pid = self.processes["agent"].pid
        op = self.processes.processes.get("operator")
        agent_rss = rss_mib(agent_pid) if agent_pid else None
        operator_rss = rss_mib(op.pid) if op is not None and op.pid else None
        if agent_rss is not None and agent and "agent" not in self.baselines:
            self.baselines["agent"] = agent_rss
        if operator_rss is not None and operator and "operator" not in self.baselines:
            self.baselines["operator"] = operator_rss
        sample = Sample(
            t=round(time.monotonic() - self.started, 2), pods=len(truth.node_pods), desired=len(truth.desired),
            kernel=None if kernel is None else len(kernel), agent_rss=agent_rss, operator_rss=operator_rss,
            identities=metric_sum(operator or {}, "podmeter_identities"),
            events=metric_sum(agent, "podmeter_watch_events_total", resource="pods"),
            relists=metric_sum(agent, "podmeter_watch_relists_total"),
            repairs=metric_sum(agent, "podmeter_drift_repaired_total"),
            open_violations=violations, filter_drift=drift)
        self.result.samples.append(sample)
        self._last = sample

    def _latency_probe(self) -> None:
        """delete -> unmapped: how long after a running pod's delete returned its IP left the kernel map."""
        assert self.driver is not None
        pending = self.driver.stats.delete_times
        while not self._stop_sampling.wait(0.005):
            if not pending:
                continue
            try:
                with EbpfDatapath.open_pinned(self.bpffs) as datapath:
                    present = datapath.contents()
            except Exception:  # the agent is between a kill and a restart: try at the next tick
                log.debug("latency probe: pins not readable", exc_info=True)
                continue
            now = time.monotonic()
            for ip, since in list(pending.items()):
                if ip not in present:
                    self.latencies_ms.append((now - since) * 1000)
                    pending.pop(ip, None)
                elif now - since > 5.0:
                    pending.pop(ip, None)  # reused before it was seen unmapped (or leaked: the checks say)
                    self.latency_unseen += 1

    # --- traffic -------------------------------------------------------------------------------------

    def traffic(self, step: sc.Traffic, pods: list[tuple[str, str]], rng: random.Random) -> None:
        assert self.client is not None
        if self.datapath != "ebpf":
            self.result.traffic.append({"protocol": step.protocol, "skipped": "memory mode has no packets"})
            return
        endpoints = self._endpoints(pods)
        rng.shuffle(endpoints)
        for i in range(min(step.pairs, len(endpoints) // 2)):
            src, dst = endpoints[2 * i], endpoints[2 * i + 1]
            self._timed(functools.partial(self._one_exchange, step, src, dst))

    def service_calls(self, step: sc.ServiceCalls, pods: list[tuple[str, str]]) -> None:
        taking_part = self._through_a_service("service", step, pods)
        if taking_part is not None and self.client is not None:
            endpoints, drained = taking_part
            self._timed(functools.partial(servicecheck.run_step, step, self.client, self.flow_client, endpoints,
                                          drained))

    def service_apps(self, step: sc.ServiceApps, pods: list[tuple[str, str]]) -> None:
        """Real programs through a Service (``lab.appcheck``), their configs in the run's directory."""
        taking_part = self._through_a_service(f"apps-{step.program}", step, pods)
        if taking_part is not None and self.client is not None:
            endpoints, drained = taking_part
            directory = Path(tempfile.mkdtemp(prefix=f"apps-{step.program}-", dir=self.out))
            self._timed(functools.partial(appcheck.run_step, step, self.client, self.flow_client, endpoints,
                                          drained, directory=directory))

    def _through_a_service(self, kind: str, step: sc.ServiceCalls | sc.ServiceApps, pods: list[tuple[str, str]],
                           ) -> tuple[list[Endpoint], Callable[[float | None], bool]] | None:
        """A Service step's pods (their traffic the lab's: I5) and its wait for two drains; None, with the
        step recorded as skipped, where it cannot run."""
        assert self.client is not None
        if self._skipped_without_packets(kind, "tcp"):
            return None
        endpoints = self._endpoints(pods)
        backends, clients = servicecheck.taking_part(step, endpoints)
        self.checker.traffic_pods.update(e.pod for e in (*backends, *clients))  # I5: traffic the lab sent
        return endpoints, self._drained_twice

    def dns_lookups(self, step: sc.DnsLookups, pods: list[tuple[str, str]]) -> None:
        assert self.client is not None
        if self._skipped_without_packets("dns", "udp"):
            return
        if shutil.which("dnsmasq") is None:
            log.warning("dns step skipped: dnsmasq is not installed (scripts/setup.sh installs it)")
            self.result.traffic.append({"kind": "dns", "protocol": "udp", "skipped": "dnsmasq is not installed"})
            return
        endpoints = self._endpoints(pods)
        servers, clients = dnscheck.taking_part(step, endpoints)
        self.checker.traffic_pods.update(e.pod for e in (*servers, *clients))  # I5: traffic the lab sent
        flows = self.flow_client

        def records(since: float) -> list[dict[str, Any]] | None:
            return flows.records(since - WINDOW_SLACK, protocol="dns")

        parts = dnscheck.Parts(self.client, flows.metrics, records, self._drained_twice, flows.drains)
        self._timed(functools.partial(dnscheck.run_step, step, parts, endpoints))

    def _skipped_without_packets(self, kind: str, protocol: str) -> bool:
        """A step that needs packets through the node's Service proxy, recorded as skipped without them."""
        if self.datapath == "ebpf" and self.options.service_proxy:
            return False
        why = "memory mode has no packets" if self.datapath != "ebpf" else "--no-service-proxy"
        self.result.traffic.append({"kind": kind, "protocol": protocol, "skipped": why})
        return True

    def _drained_twice(self, before: float | None) -> bool:
        interval = self.scenario.agent.flow_interval
        return self.flow_client.wait_for_drains(before, 2, time.monotonic() + 3 * interval + 3)

    def _timed(self, check: Callable[[], dict[str, Any]]) -> None:
        """A check's record, with when it ran (``at_s``: seconds since the steps started, the samples' and
        marks' time): a failed check is read against the pods' events and the samples around it."""
        start = self._now()
        record = check()
        record["at_s"] = [start, self._now()]
        self.result.traffic.append(record)

    def _endpoints(self, pods: list[tuple[str, str]]) -> list[Endpoint]:
        assert self.client is not None
        found = []
        for ns, name in pods:
            pod = self.client.get(pod_path(ns, name))
            status = (pod or {}).get("status") or {}
            if pod and status.get("phase") == "Running" and status.get("podIP"):
                sandbox = Sandbox.for_pod(pod["metadata"]["uid"], status["podIP"])
                found.append(Endpoint(f"{ns}/{name}", status["podIP"], sandbox.netns_path))
        return found

    def _counters(self) -> dict[tuple[str, Direction], tuple[int, int]]:
        with EbpfDatapath.open_pinned(self.bpffs) as datapath:
            return {k: (v.packets, v.bytes) for k, v in datapath.read_counters().items()}

    def _agent_metrics(self) -> Samples:
        return parse_metrics(http_text(f"http://127.0.0.1:{self.agent_port}/metrics"))

    @staticmethod
    def _pod_bytes(samples: Samples) -> dict[tuple[str, str], float]:
        return {(f"{lab.get('namespace')}/{lab.get('pod')}", lab.get("direction", "")): value
                for lab, value in samples.get("podmeter_pod_bytes_total", [])}

    def _end(self, endpoint: Endpoint, port: int) -> PodEnd:
        assert self.driver is not None
        self.held.setdefault(endpoint.ip, set()).add(endpoint.pod)
        return PodEnd(endpoint.pod, endpoint.ip, port, self.driver.workload_of(endpoint.pod))

    def _one_exchange(self, step: sc.Traffic, src: Endpoint, dst: Endpoint) -> dict[str, Any]:
        self.checker.traffic_pods.update((src.pod, dst.pod))
        since = time.time()
        before, metrics_before = self._counters(), self._agent_metrics()
        if step.protocol == "udp":
            sent = send_udp(src, dst, step.packets, step.size, step.rate)
        else:
            sent = send_tcp(src, dst, step.packets, step.size, step.rate)
        sent_at, drains = time.time(), self.flow_client.drains()
        time.sleep(1.0)  # the agent's metrics are read at scrape time; give in-flight packets a moment
        after = self._counters()
        pods_before, pods_after = self._pod_bytes(metrics_before), self._pod_bytes(self._agent_metrics())

        def delta(ip: str, direction: Direction) -> tuple[int, int]:
            b, a = before.get((ip, direction), (0, 0)), after.get((ip, direction), (0, 0))
            return a[0] - b[0], a[1] - b[1]

        out, into = delta(src.ip, Direction.EGRESS), delta(dst.ip, Direction.INGRESS)
        back_out, back_in = delta(dst.ip, Direction.EGRESS), delta(src.ip, Direction.INGRESS)
        record: dict[str, Any] = {"protocol": step.protocol, "src": src.pod, "dst": dst.pod, "src_ip": src.ip,
                                  "dst_ip": dst.ip, "ports": [sent.source_port, sent.destination_port],
                                  "delivered": sent.delivered, "src_egress": out, "dst_ingress": into}
        if step.protocol == "udp":
            want = (step.packets, step.packets * (step.size + UDP_OVERHEAD))
            ok = sent.delivered == step.packets and out == want and into == want and back_out == back_in == (0, 0)
            record["expected"] = want
            forward = {FROM_POD: want, TO_POD: want}  # the exact truth (the counters must say the same, above)
            flags: frozenset[str] = frozenset()
        else:
            payload = step.packets * step.size
            ok = sent.delivered == payload and out == into and out[1] >= payload and back_out == back_in
            forward = {FROM_POD: out, TO_POD: into}
            flags = frozenset({"SYN", "FIN"})  # opened and closed within the exchange, both ways
        metric_out = pods_after.get((src.pod, "egress"), 0) - pods_before.get((src.pod, "egress"), 0)
        metric_in = pods_after.get((dst.pod, "ingress"), 0) - pods_before.get((dst.pod, "ingress"), 0)
        if pods_after:
            record["metrics"] = {"src_egress_bytes": metric_out, "dst_ingress_bytes": metric_in}
            ok = ok and metric_out == out[1] and metric_in == into[1]
        expect = Expectation(step.protocol.upper(), [Holder(self._end(src, sent.source_port), forward,
                                                            (since, sent_at))],
                             self._end(dst, sent.destination_port), {FROM_POD: back_out, TO_POD: back_in},
                             forward_flags=flags, reverse_flags=flags, node=NODE_NAME)
        record["flow"] = self._flow_check(expect, since, metrics_before, drains_before=drains)
        record["ok"] = ok and record["flow"]["ok"]
        return record

    def _flow_check(self, expect: Expectation, since: float, metrics_before: Samples, *,
                    drains_before: float | None = None, drained: bool | None = None) -> dict[str, Any]:
        """Wait until the agent drained the exchange (two drains after it, unless ``drained`` says
        already), read its records and check them (:func:`flowcheck.check_flow`), and the workload-pair
        series against them."""
        interval = self.scenario.agent.flow_interval
        if drained is None:
            drained = self.flow_client.wait_for_drains(drains_before, 2, time.monotonic() + 3 * interval + 3)
        records = self.flow_client.records(since - WINDOW_SLACK, protocol=expect.protocol.lower(),
                                           port=expect.destination.port, verdict="forwarded")
        if records is None:
            return {"ok": False, "problems": ["the agent's /debug/flows did not answer"]}
        mine = of_key(records, expect.key)
        self.flow_records.extend(mine)
        verdict = check_flow(expect, mine)
        grown = series_bytes(mine)
        series = check_series(grown, series_values(metrics_before, grown),
                              series_values(self.flow_client.metrics(), grown))
        if not drained:
            verdict["problems"].insert(0, f"the agent did not drain its flows twice within {3 * interval + 3:g} s")
        verdict["problems"] += series
        verdict["ok"] = not verdict["problems"]
        return verdict

    # --- drops and loss induced in chosen pods (podmeter.lab.dropcheck) ---------------------------------

    def induce_drops(self, step: sc.InduceDrops, pods: list[tuple[str, str]], rng: random.Random) -> None:
        self._timed(lambda: DropSteps(self).drops(step, pods, rng))

    def induce_loss(self, step: sc.InduceLoss, pods: list[tuple[str, str]], rng: random.Random) -> None:
        self._timed(lambda: DropSteps(self).loss(step, pods, rng))

    # --- a pod deleted and its IP reused during a flow --------------------------------------------------

    def reuse_during_flow(self, step: sc.ReuseDuringFlow, pods: list[tuple[str, str]], rng: random.Random) -> None:
        if self.datapath != "ebpf":
            self.result.traffic.append({"protocol": "udp", "kind": "reuse-during-flow",
                                        "skipped": "memory mode has no packets"})
            return
        try:
            with EbpfDatapath.open_pinned(self.bpffs) as datapath:
                observed = datapath.contents()
        except Exception:  # no pins (the agent down): no observed destination
            observed = set()
        targets = [e for e in self._endpoints(pods) if e.ip in observed]  # B's counters are checked too
        if not targets:
            self.result.traffic.append({"protocol": "udp", "kind": "reuse-during-flow",
                                        "skipped": "no running observed pod to send to"})
            return
        self._timed(lambda: self._reuse(step, rng.choice(targets)))

    def _reuse(self, step: sc.ReuseDuringFlow, dst: Endpoint) -> dict[str, Any]:
        """A sends, A is deleted, A' gets A's IP and sends from the same port to the same socket."""
        assert self.driver is not None
        since, metrics_before = time.time(), self._agent_metrics()
        want = (step.packets, step.packets * (step.size + UDP_OVERHEAD))
        record: dict[str, Any] = {"protocol": "udp", "kind": "reuse-during-flow", "src": "-", "dst": dst.pod,
                                  "dst_ip": dst.ip, "expected": want, "ok": False}
        first = self._start_reuse_pod(step.namespace)
        if first is None:
            record["problem"] = f"pod A never ran with an IP the agent knew within {POD_WAIT:g} s"
            return record
        a = first[0]
        self.checker.traffic_pods.update((a.pod, dst.pod))
        record.update(src=a.pod, src_ip=a.ip)
        sink = UdpSink(dst, REUSE_PORT)
        fillers: list[str] = []
        second: tuple[Endpoint, str] | None = None
        windows: list[tuple[float, float]] = []
        try:
            c0, a_start = self._counters(), time.time()
            port = send_datagrams(a, dst.ip, REUSE_PORT, step.packets, step.size, rate=step.rate)
            time.sleep(0.2)  # the last datagrams on their way through the veths
            c1, m1 = self._counters(), self._pod_bytes(self._agent_metrics())
            windows.append((a_start, time.time()))
            self.driver.delete_pod(*a.pod.split("/", 1))
            self._wait_released(a.netns_path)
            for _ in range(step.attempts):  # the lowest free IP: a gap below A's is filled first
                candidate = self._start_reuse_pod(step.namespace)
                if candidate is not None and candidate[0].ip == a.ip:
                    second = candidate
                    break
                if candidate is not None:
                    fillers.append(candidate[0].pod)
            # The IP left the filter with A and came back with A': its counters started again from 0.
            c2 = c3 = self._counters()
            m2 = m1
            if second is not None:
                b = second[0]
                self.checker.traffic_pods.add(b.pod)
                b_start = time.time()
                send_datagrams(b, dst.ip, REUSE_PORT, step.packets, step.size, rate=step.rate, source_port=port)
                time.sleep(0.2)
                windows.append((b_start, time.time()))
                c3, m2 = self._counters(), self._pod_bytes(self._agent_metrics())
            delivered = sink.receive(step.packets * len(windows), timeout=2.0)
        finally:
            sink.close()
        drains = self.flow_client.drains()
        for pod in [second[0].pod] if second else []:
            self.driver.delete_pod(*pod.split("/", 1))
        # The agent drains before it applies a delete: once it forgot A', every packet of A' is named.
        drained = self._agent_forgot(second[1]) if second else None
        if drained:  # and that drain's records published (a drain that reads conntrack finishes later)
            drained = self.flow_client.wait_for_drains(drains, 1, time.monotonic() + POD_WAIT)
        for pod in fillers:
            self.driver.delete_pod(*pod.split("/", 1))
        holders = [Holder(self._end(a, port), {FROM_POD: want, TO_POD: want}, windows[0])]
        if second is not None:
            holders.append(Holder(self._end(second[0], port), {FROM_POD: want, TO_POD: want}, windows[1]))
            record.update(src=f"{a.pod} then {second[0].pod}", reused=True)
        else:
            record.update(reused=False, held_by=self._holder_of(a.ip))
        expect = Expectation("UDP", holders, self._end(dst, REUSE_PORT), node=NODE_NAME)
        record["flow"] = self._flow_check(expect, since, metrics_before, drains_before=drains, drained=drained)

        def delta(x: dict[tuple[str, Direction], tuple[int, int]], y: dict[tuple[str, Direction], tuple[int, int]],
                  ip: str, direction: Direction) -> tuple[int, int]:
            b, e = x.get((ip, direction), (0, 0)), y.get((ip, direction), (0, 0))
            return e[0] - b[0], e[1] - b[1]

        egress = [delta(c0, c1, a.ip, Direction.EGRESS), delta(c2, c3, a.ip, Direction.EGRESS)]
        into = delta(c0, c3, dst.ip, Direction.INGRESS)  # B keeps its IP (and counters) throughout
        total = (want[0] * len(windows), want[1] * len(windows))
        record.update(ports=[port, REUSE_PORT], delivered=delivered, src_egress=egress[: len(windows)],
                      dst_ingress=into)
        counters_ok = (delivered == total[0] and egress[0] == want and into == total
                       and egress[1] == (want if second else (0, 0)))
        # The agent's per-pod series: A's and A''s each their own datagrams (A' starts from 0: F21).
        pods_before = self._pod_bytes(metrics_before)
        series_out = [m1.get((a.pod, "egress"), 0) - pods_before.get((a.pod, "egress"), 0)]
        if second is not None:
            series_out.append(m2.get((second[0].pod, "egress"), 0))
        series_in = m2.get((dst.pod, "ingress"), 0) - pods_before.get((dst.pod, "ingress"), 0)
        record["metrics"] = {"src_egress_bytes": series_out, "dst_ingress_bytes": series_in}
        metrics_ok = series_out == [want[1]] * len(windows) and series_in == total[1]
        record["ok"] = counters_ok and metrics_ok and record["flow"]["ok"]
        return record

    def _start_reuse_pod(self, namespace: str) -> tuple[Endpoint, str] | None:
        """A fresh observed pod, once it runs and the agent holds it as its IP's owner: (endpoint, uid)."""
        assert self.driver is not None and self.client is not None
        try:
            name = self.driver.new_pod(namespace, "reuse", True)
        except KubeError as exc:
            log.warning("reuse step: pod not created: %s", exc)
            return None
        deadline = time.monotonic() + POD_WAIT
        while time.monotonic() < deadline:
            pod = self.client.get(pod_path(namespace, name)) or {}
            status = pod.get("status") or {}
            if status.get("phase") == "Running" and status.get("podIP"):
                uid, ip = pod["metadata"]["uid"], status["podIP"]
                endpoint = Endpoint(f"{namespace}/{name}", ip, Sandbox.for_pod(uid, ip).netns_path)
                self.held.setdefault(ip, set()).add(endpoint.pod)
                if self._agent_knows(endpoint.pod, ip, deadline):
                    return endpoint, uid
                break
            time.sleep(0.05)
        log.warning("reuse step: %s/%s did not run, or the agent did not learn of it, within %g s", namespace,
                    name, POD_WAIT)
        with contextlib.suppress(KubeError):
            self.driver.delete_pod(namespace, name)
        return None

    def _agent_state_or_none(self) -> dict[str, Any] | None:
        try:
            return self._agent_state()
        except ValueError:
            return None

    def _agent_knows(self, pod: str, ip: str, deadline: float) -> bool:
        """Until the agent holds ``pod`` as the owner of ``ip``, has its programs on the pod's link (a new
        sandbox's link is attached when the agent sees it, apart from the filter) and the kernel filter has
        the IP: its packets are counted and named from then on."""
        while time.monotonic() < deadline:
            state = self._agent_state_or_none()
            if (state is not None and state["filter"]["desired"].get(ip) == [pod]
                    and pod not in (state.get("pods_without_link") or ())):
                with contextlib.suppress(Exception), EbpfDatapath.open_pinned(self.bpffs) as datapath:
                    if ip in datapath.contents():
                        return True
            time.sleep(0.05)
        return False

    def _agent_forgot(self, uid: str) -> bool:
        """Until the agent's store no longer has ``uid`` (it drained the flows before applying the delete)."""
        deadline = time.monotonic() + POD_WAIT
        while time.monotonic() < deadline:
            state = self._agent_state_or_none()
            if state is not None and uid not in state["pod_uids"]:
                return True
            time.sleep(0.05)
        return False

    @staticmethod
    def _wait_released(netns_path: str) -> None:
        """The node frees a pod's IP right after removing its namespace: wait for that, and a moment."""
        deadline = time.monotonic() + 5.0
        while Path(netns_path).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)

    def _holder_of(self, ip: str) -> str | None:
        assert self.client is not None
        for pod in self.client.list("/api/v1/pods").get("items") or []:
            status = pod.get("status") or {}
            if status.get("podIP") == ip and status.get("phase") == "Running":
                return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        return None

    # --- the end -------------------------------------------------------------------------------------

    def _memory(self) -> dict[str, Any]:
        memory: dict[str, Any] = {"tolerance_mib": self.scenario.memory_tolerance_mib}
        for name in ("agent", "operator"):
            process: LabProcess | None = self.processes.processes.get(name)
            end = rss_mib(process.pid) if process is not None and process.pid else None
            base = self.baselines.get(name)
            if end is None or base is None:
                continue
            growth = end - base
            memory[name] = {"baseline_mib": round(base, 1), "end_mib": round(end, 1),
                            "growth_mib": round(growth, 1),
                            "returned": growth <= self.scenario.memory_tolerance_mib}
        return memory

    def _collect(self) -> None:
        assert self.driver is not None
        stats = self.driver.stats
        summary = self.checker.summary()
        self.result.failures, self.result.transients = summary["failures"], summary["transients"]
        self.result.checked = summary["checked"]
        self.result.flows = aggregate(self.flow_records)
        checked = [t["flow"] for t in self.result.traffic if "flow" in t]
        flow_counts: dict[str, Any] = {"checked": len(checked), "exact": sum(bool(f["ok"]) for f in checked)}
        if self.datapath == "ebpf":
            # I8 over the whole run: no record the agent still has names a pod for an IP it never held.
            everything = self.flow_client.records(self.started_wall)
            flow_counts["records_at_end"] = None if everything is None else len(everything)
            for ip, detail in misnamed(everything or [], self.held):
                self.result.failures.append({"invariant": "I8", "subject": ip, "detail": detail, "lasted_s": 0})
        self.result.counts = {
            "pods_created": stats.created, "pods_deleted": stats.deleted, "lifecycles": stats.lifecycles,
            "deleted_in_phase": dict(stats.deleted_in_phase),
            "interest_flips": stats.flips, "faults": stats.faults, "agent_kills": stats.agent_kills,
            "driver_errors": stats.errors, "transient_violations": self.checker.transient,
            "overflow_max_waiting": self.checker.overflow_seen,
            "max_filter_drift": max((s.filter_drift for s in self.result.samples), default=0),
            "delete_to_unmapped_ms": {**_percentiles(self.latencies_ms), "unseen": self.latency_unseen},
            "restart_converged_after_s": self.convergence_s,
            "flow_checks": flow_counts,
        }

    def _verdict(self) -> bool:
        if self.result.error or self.result.failures:
            return False
        if any(not t.get("ok", True) for t in self.result.traffic):
            return False
        return all(v.get("returned", True) for v in self.result.memory.values() if isinstance(v, dict))

    # --- the live display ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _progress(self) -> Iterator[None]:
        if not self.options.progress:
            yield
            return
        from rich.live import Live

        with Live(self._render(), refresh_per_second=2, transient=False) as live:
            stop = threading.Event()

            def refresh() -> None:
                while not stop.wait(0.5):
                    live.update(self._render())

            thread = threading.Thread(target=refresh, daemon=True)
            thread.start()
            try:
                yield
            finally:
                stop.set()
                thread.join()
                live.update(self._render())

    def _netns_prefix(self) -> str:
        """The agent listens on the node's loopback, which is in the node's network namespace in eBPF mode
        (``/debug/flows`` and the Hubble API without TLS answer loopback clients only)."""
        return f"ip netns exec {self.tag} " if self.datapath == "ebpf" else ""

    def observe_command(self) -> str:
        """The command that shows this run's flows live."""
        return f"{self._netns_prefix()}podmeter observe --server 127.0.0.1:{self.agent_port} -f"

    def hubble_command(self) -> str | None:
        """``hubble observe`` following this run's flows over Hubble's protocol (None: the API is off)."""
        if self.hubble_port is None:
            return None
        return f"{self._netns_prefix()}hubble observe --server 127.0.0.1:{self.hubble_port} -f"

    def watch_points(self) -> list[WatchPoint]:
        """Per node (one here): where its agent's flows are and how to follow them."""
        hubble = None if self.hubble_port is None else f"127.0.0.1:{self.hubble_port}"
        return [WatchPoint(NODE_NAME, f"127.0.0.1:{self.agent_port}", self.observe_command(), hubble,
                           self.hubble_command(), self.tag if self.datapath == "ebpf" else None)]

    def _announce(self) -> None:
        """Once at the start: each agent's addresses and the commands to copy (also under the live panel)."""
        points = self.watch_points()
        for point in points:
            who = "the agent" if len(points) == 1 else f"the agent of {point.node}"
            print(f"podmeter lab: {who}'s flows at {point.flows}; watch them live with: {point.observe}", flush=True)
            if point.hubble_observe is not None:
                print(f"podmeter lab: {who}'s Hubble API at {point.hubble}; with Hubble's CLI: "
                      f"{point.hubble_observe}", flush=True)

    def _panel_rows(self) -> list[tuple[str, str]]:
        s, stats = self._last, self.driver.stats if self.driver else None
        duration = self.options.duration or self.scenario.duration
        target = self.options.lifecycles or self.scenario.lifecycles
        return [
            ("time", f"{time.monotonic() - self.started:.1f} of {duration:g} s"),
            ("step", stats.step if stats else "-"),
            ("lifecycles", f"{stats.lifecycles if stats else 0:,}" + (f" of {target:,}" if target else "")),
            ("pods / desired / kernel", "-" if s is None else f"{s.pods} / {s.desired} / {_fmt(s.kernel)}"),
            ("RSS agent / operator MiB", "-" if s is None else f"{_fmt(s.agent_rss)} / {_fmt(s.operator_rss)}"),
            ("identities", "-" if s is None else _fmt(s.identities)),
            ("violations open / failed", f"{len(self.checker.open)} / {len(self.checker.failures)}"),
        ]

    def _render(self) -> Any:
        """A compact key/value panel: it fits an 80-column terminal (and a log, when not a terminal). Under
        it, each agent's commands, one line each to copy."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"podmeter lab: {self.scenario.name} ({self.datapath}, seed {self.scenario.seed})",
                      show_header=False)
        table.add_column(style="bold")
        table.add_column()
        points = self.watch_points()
        rows = self._panel_rows()
        for point in points:
            who = "agent" if len(points) == 1 else f"{point.node} agent"
            where = f" (netns {point.netns})" if point.netns else ""
            rows.append((f"{who} flows at", point.flows + where))
            if point.hubble is not None:
                rows.append((f"{who} Hubble API at", point.hubble + where))
        for key, value in rows:
            table.add_row(key, value)
        commands = [c for p in points for c in (p.observe, p.hubble_observe) if c is not None]
        return Group(table, *(Text(c, no_wrap=True) for c in commands))


def hubble_wanted(scenario: sc.Scenario, options: LabOptions) -> bool:
    """The agents serve the Hubble API: the command line's choice, else the scenario's ``agent.hubble``."""
    return scenario.agent.hubble if options.hubble is None else options.hubble


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if isinstance(value, int) or value == int(value) else f"{value:.1f}"


def _percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"count": len(ordered), "p50": pick(0.5), "p99": pick(0.99), "max": round(ordered[-1], 2)}
