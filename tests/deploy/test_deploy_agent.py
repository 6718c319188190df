"""The agent exactly as the rendered DaemonSet runs it, against the lab API server, with the eBPF datapath.

What the kubelet and the container runtime would provide is provided the same way, nothing more:
- the container's command is the image's entrypoint (``podmeter``) followed by the manifest's ``args``;
- its environment is the manifest's ``env`` (the downward-API node name resolved) plus ``KUBECONFIG``
  pointing at the lab API server (standing in for the in-cluster service account);
- its capabilities are the manifest's: the bounding set is cut to ``capabilities.add`` (``drop: [ALL]``),
  so a root process gets those and no others (``setpriv``);
- ``hostNetwork`` is a private network namespace standing in for the node's (so the agent attaches only to
  this test's veth), and the ``/sys/fs/bpf`` hostPath is a fresh directory inside the host's bpffs.
Then: the first startup probe (at its initial delay) already answers, so a start logs no Unhealthy event;
``/readyz`` (the readiness probe's path and port) answers 200, an annotated pod's IP reaches
``/debug/state`` and the pinned filter map, an unannotated one does not, SIGTERM ends it cleanly and
leaves the pins, and the next agent (an upgrade) adopts them and converges to the pods of that moment.

And on a node like the issue's, whose init is not systemd: every mount private, no bpffs mounted. The
node is a mount namespace of its own; the runtime's rule on mount propagation is checked against its real
mountinfo, the ``mount-bpffs`` component's init container runs there as its manifest says, and the agent's
container, created from that node's namespace after it, runs on the bpffs the init container mounted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_harness import Cluster, wait_for
from bpf_support import BPFFS, Topology, needs_root, remove_pin_dir, unique
from deploy_support import (
    Obj,
    authorized,
    container,
    container_filesystem,
    find,
    grants,
    needs_kubectl,
    pod_containers,
    render,
    render_with,
    request_attributes,
    runtime_refusal,
    service_account_dir,
)
from lab_server import LabServer
from podmeter.adapters.datapath.ebpf import EbpfDatapath

pytestmark = [needs_kubectl, needs_root]

NODE = "node-a"
NEWCOMER = "10.231.201.5"  # a pod without an interface: only the filter sees it
ENTRYPOINT = [sys.executable, "-m", "podmeter"]  # the image's ENTRYPOINT ["podmeter"]
CAPABILITY_BITS = {"NET_ADMIN": 12, "SYS_ADMIN": 21, "PERFMON": 38, "BPF": 39}


def capability_mask(names: list[str]) -> int:
    return sum(1 << CAPABILITY_BITS[name] for name in names)


class Container:
    """The DaemonSet's agent container, translated to a process on this machine."""

    def __init__(self, daemonset: Obj, host_dirs: dict[str, Path], kubeconfig: Path,
                 without: str | None = None, node_mounts: str | None = None) -> None:
        """``node_mounts``: the node's mount namespace (a /proc/PID/ns/mnt), which the container's is made
        from; default this process's."""
        spec = daemonset["spec"]["template"]["spec"]
        self.node_mounts = node_mounts
        self.spec = spec
        self.container = container(daemonset)
        self.host_dirs = host_dirs
        security = self.container["securityContext"]
        assert security["capabilities"]["drop"] == ["ALL"] and security.get("runAsUser") == 0
        self.capabilities: list[str] = [c for c in security["capabilities"]["add"] if c != without]
        volumes = {v["name"]: v for v in spec["volumes"]}
        # container path -> path on this machine, for every hostPath mount
        self.mounts = {m["mountPath"]: host_dirs[volumes[m["name"]]["hostPath"]["path"]]
                       for m in self.container["volumeMounts"] if "hostPath" in volumes[m["name"]]}
        # the pod's mounted credentials: outside /tmp, which the container gets as an emptyDir
        self.secrets = service_account_dir()
        shutil.copy(kubeconfig, self.secrets / "kubeconfig")
        self.filesystem = container_filesystem(daemonset)
        # The manifest's environment, plus one thing a cluster never needs: the test API server speaks plain
        # HTTP (a real one speaks TLS), over which podmeter otherwise refuses to send its token.
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "KUBECONFIG": str(self.secrets / "kubeconfig"),
                    "PODMETER_ALLOW_PLAIN_HTTP_CREDENTIALS": "1"}
        for entry in self.container["env"]:
            if "value" in entry:
                self.env[entry["name"]] = self.translate(entry["value"])
            else:
                assert entry["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", entry
                self.env[entry["name"]] = NODE
        self.argv = [*ENTRYPOINT, *(self.translate(a) for a in self.container["args"])]

    def translate(self, value: str) -> str:
        """A container path under a hostPath mount -> the same path under its stand-in."""
        for inside, outside in self.mounts.items():
            if value == inside or value.startswith(inside.rstrip("/") + "/"):
                return str(outside) + value[len(inside.rstrip("/")):]
        return value

    def probe(self, name: str) -> tuple[str, int]:
        get = self.container[name]["httpGet"]
        ports = {p["name"]: p["containerPort"] for p in self.container["ports"]}
        port = get["port"]
        return get["path"], ports[port] if isinstance(port, str) else int(port)

    def _inside(self, netns: str) -> list[str]:
        """The container's file system view, the "node" netns, root limited to the container's capabilities."""
        bounding = ",".join(["-all", *(f"+{c.lower()}" for c in self.capabilities)])
        node = ["nsenter", f"--mount={self.node_mounts}", "--"] if self.node_mounts else []
        return [*node, *self.filesystem, "nsenter", f"--net={netns}", "--", "setpriv", f"--bounding-set={bounding}",
                "--"]

    def remove(self) -> None:
        shutil.rmtree(self.secrets, ignore_errors=True)

    def start(self, netns: str, log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            return subprocess.Popen([*self._inside(netns), *self.argv], env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, cwd="/")

    def exec(self, netns: str, args: list[str]) -> subprocess.CompletedProcess[str]:
        """``kubectl exec`` into the container: its environment and capabilities, another command."""
        return subprocess.run([*self._inside(netns), *ENTRYPOINT, *args], env=self.env, capture_output=True,
                              text=True, timeout=60, cwd="/")


def get(topology: Topology, port: int, path: str, host: str = "127.0.0.1") -> tuple[int, str]:
    """An HTTP GET in the "node" netns: from loopback (``kubectl exec``) or to a node address (kubelet, Prometheus)."""
    with topology.in_host():
        try:
            with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except OSError:
            return 0, ""




@pytest.fixture
def bpffs_dir() -> Iterator[Path]:
    """The stand-in for the node's /sys/fs/bpf: a directory of the host's bpffs (pins may go in it)."""
    path = BPFFS / unique("pmdep")
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        remove_pin_dir(path)


# ``server``: the lab API server in the test's "node" netns (tests/bpf_support.py).


def test_the_agent_runs_as_the_daemonset_says(topology: Topology, bpffs_dir: Path, server: LabServer,
                                              tmp_path: Path) -> None:
    objects = render("overlays/default")
    daemonset = find(objects, "DaemonSet", "podmeter-agent")
    assert daemonset["spec"]["template"]["spec"]["hostNetwork"] is True  # hence the node netns below
    agent = Container(daemonset, {"/sys/fs/bpf": bpffs_dir}, server.kubeconfig)
    assert agent.env["PODMETER_DATAPATH"] == "ebpf"
    pins = Path(agent.env["PODMETER_BPFFS"])
    assert pins.parent == bpffs_dir  # the pin directory moved with its hostPath

    pod = topology.add_pod()
    cluster = Cluster(server)
    with topology.in_host():  # the API server answers in the "node" netns only
        cluster.namespace("shop")
        cluster.pod("shop", "web", pod.ip, node=NODE, observe=True)
        cluster.pod("shop", "quiet", "10.231.200.9", node=NODE)
        cluster.pod("shop", "elsewhere", "10.231.200.10", node="node-b", observe=True)

    with topology.in_host():
        server.admin.reset_requests()  # from here on, only the agent (and doctor, with its identity) ask
    proc = agent.start(topology.host_path, tmp_path / "agent.log")
    started = time.monotonic()
    try:
        ready_path, port = agent.probe("readinessProbe")
        live_path, live_port = agent.probe("livenessProbe")
        log = lambda: (tmp_path / "agent.log").read_text(errors="replace")[-3000:]  # noqa: E731
        # the kubelet probes a host-network pod at the node's address: first the startup probe, after its
        # initial delay; a failure there would be an Unhealthy event, so the first one must answer
        node_ip = pod.host_ip
        first_probe(agent, topology, node_ip, started, proc, log)
        wait_for(lambda: proc.poll() is not None or get(topology, port, ready_path, node_ip)[0] == 200, timeout=30,
                 what="readiness probe", describe=log)
        assert proc.poll() is None, log()
        assert get(topology, live_port, live_path, node_ip)[0] == 200
        assert get(topology, port, "/metrics", node_ip)[0] == 200  # what Prometheus scrapes
        assert get(topology, port, "/debug/state", node_ip)[0] == 403  # debug: loopback only

        def state() -> dict[str, Any]:
            status, body = get(topology, port, "/debug/state")
            assert status == 200, body
            parsed: dict[str, Any] = json.loads(body)
            return parsed

        wait_for(lambda: pod.ip in state()["filter"]["actual"], timeout=15, what="the annotated pod's IP",
                 describe=lambda: json.dumps(state()["filter"]))
        view = state()["filter"]
        assert view["desired"] == {pod.ip: ["shop/web"]}
        assert view["leaked"] == [] and view["missing"] == []
        # the kernel holds it, pinned where the manifest says (under the hostPath)
        assert pinned_filter(pins) == {pod.ip}
        # the process has the manifest's capabilities and no others
        status = Path(f"/proc/{proc.pid}/status").read_text()
        effective = int(next(line for line in status.splitlines() if line.startswith("CapEff:")).split()[1], 16)
        assert effective == capability_mask(agent.capabilities)
        # and the container's file system: a read-only root, the emptyDir at /tmp
        mounts = {fields[4]: [*fields[5].split(","), fields[fields.index("-") + 1]] for fields in
                  (line.split() for line in Path(f"/proc/{proc.pid}/mountinfo").read_text().splitlines())}
        assert "ro" in mounts["/"] and "tmpfs" in mounts["/tmp"]
        # `kubectl exec <agent pod> -- podmeter doctor` (docs/troubleshooting.md): the pod's env and
        # capabilities are all it needs
        audit = agent.exec(topology.host_path, ["doctor", "--json", "--recheck", "0"])
        assert audit.returncode == 0, audit.stdout + audit.stderr
        report = json.loads(audit.stdout)
        assert report["clean"] and report["node"] == NODE and report["desired"] == report["kernel"] == 1
        # the service account's RBAC allows every request the agent and doctor made
        with topology.in_host():
            made = [request_attributes(r["method"], r["path"], r["query"]) for r in server.admin.requests()]
        resource_requests = {a for a in made if a is not None}
        allowed = grants(objects, "podmeter", daemonset["spec"]["template"]["spec"]["serviceAccountName"])
        assert {a for a in resource_requests if not authorized(allowed, a)} == set()
        assert {("", "", "pods", "watch", ""), ("", "", "namespaces", "list", ""),
                ("", "podmeter.io", "metricsconfigurations", "watch", "")} <= resource_requests

        # an upgrade: the old agent stops within the grace period, its pinned state stays; while no agent
        # runs the pod goes and another comes; the new agent adopts the pins and converges
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(agent.spec["terminationGracePeriodSeconds"]) == 0, log()
        assert pinned_filter(pins) == {pod.ip}
        with topology.in_host():
            cluster.delete_pod("shop", "web")
            cluster.pod("shop", "api", NEWCOMER, node=NODE, observe=True)
        proc = agent.start(topology.host_path, tmp_path / "agent.log")
        wait_for(lambda: proc.poll() is not None or get(topology, port, ready_path)[0] == 200, timeout=30,
                 what="readiness of the new agent", describe=log)
        wait_for(lambda: pinned_filter(pins) == {NEWCOMER}, timeout=15, what="the new agent's filter",
                 describe=lambda: str(pinned_filter(pins)))
        assert state()["filter"]["desired"] == {NEWCOMER: ["shop/api"]}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(agent.spec["terminationGracePeriodSeconds"]) == 0, log()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        agent.remove()


def first_probe(agent: Container, topology: Topology, node_ip: str, started: float,
                proc: subprocess.Popen[bytes], log: Any) -> None:
    """The kubelet's first probe of a new container: the startup probe, once its initial delay is over."""
    path, port = agent.probe("startupProbe")
    time.sleep(max(0.0, agent.container["startupProbe"]["initialDelaySeconds"] - (time.monotonic() - started)))
    assert proc.poll() is None, log()
    status = get(topology, port, path, node_ip)[0]
    assert status == 200, f"the first startup probe got {status or 'connection refused'}: an Unhealthy event"


def pinned_filter(pins: Path) -> set[str]:
    """The filter map as the kernel holds it, read from this (separate) process."""
    with EbpfDatapath.open_pinned(pins) as pinned:
        return pinned.contents()


@pytest.mark.parametrize("capability", ["BPF", "NET_ADMIN"])
def test_each_capability_of_the_manifest_is_needed(topology: Topology, bpffs_dir: Path, server: LabServer,
                                                   tmp_path: Path, capability: str) -> None:
    daemonset = find(render("overlays/default"), "DaemonSet", "podmeter-agent")
    assert capability in container(daemonset)["securityContext"]["capabilities"]["add"]
    agent = Container(daemonset, {"/sys/fs/bpf": bpffs_dir}, server.kubeconfig, without=capability)
    proc = agent.start(topology.host_path, tmp_path / "agent.log")
    try:
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        agent.remove()
    assert "cannot open the ebpf datapath" in (tmp_path / "agent.log").read_text()


# --- a node whose init is not systemd: private mounts, no bpffs ----------------------------------------------


class PrivateNode:
    """A node's mount namespace where every mount is private and nothing is mounted at its /sys/fs/bpf (a
    stand-in directory): held by a process of its own, which is PID 1 of the node's /proc (a stand-in too,
    whose ``1`` is that process). What is mounted there is seen by the processes started in it, not here."""

    def __init__(self) -> None:
        self.root = service_account_dir()  # outside /tmp, which the containers get as an emptyDir
        self.bpffs = self.root / "sys-fs-bpf"
        self.bpffs.mkdir(mode=0o700)
        self.holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "infinity"])
        self.mounts = f"/proc/{self.holder.pid}/ns/mnt"
        wait_for(lambda: os.stat(self.mounts).st_ino != os.stat("/proc/self/ns/mnt").st_ino, timeout=10,
                 what="the node's mount namespace")
        self.proc = self.root / "proc"
        self.proc.mkdir()
        (self.proc / "1").symlink_to(f"/proc/{self.holder.pid}")
        self.paths = {"/sys/fs/bpf": self.bpffs, "/proc": self.proc}  # node path -> its stand-in here

    def mountinfo(self) -> str:
        return Path(f"/proc/{self.holder.pid}/mountinfo").read_text()

    def mounted_at(self, path: Path, mountinfo: str | None = None) -> list[str]:
        """The file system types mounted at ``path`` in the node, in mount order."""
        text = self.mountinfo() if mountinfo is None else mountinfo
        return [fields[fields.index("-", 6) + 1] for fields in (line.split() for line in text.splitlines())
                if fields[4] == str(path)]

    def stop(self) -> None:
        self.holder.kill()
        self.holder.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def private_node() -> Iterator[PrivateNode]:
    node = PrivateNode()
    try:
        yield node
    finally:
        node.stop()


def run_init_container(daemonset: Obj, name: str, node: PrivateNode,
                       unprivileged: bool = False) -> subprocess.CompletedProcess[str]:
    """An init container of the DaemonSet as the runtime starts it on ``node``: a mount namespace made from
    the node's (read-only root), its hostPath volumes at their stand-ins, the manifest's args and env; a
    privileged container is root with every capability, which is what this process has (``unprivileged``:
    root with none, as if a policy had taken ``privileged`` away)."""
    spec = daemonset["spec"]["template"]["spec"]
    init = next(c for c in spec["initContainers"] if c["name"] == name)
    assert init["securityContext"]["privileged"] is True and init["securityContext"]["runAsUser"] == 0
    volumes = {v["name"]: v for v in spec["volumes"]}
    in_container = {m["mountPath"]: volumes[m["name"]]["hostPath"]["path"]
                    for m in init.get("volumeMounts", []) if "hostPath" in volumes[m["name"]]}

    def translate(value: str) -> str:
        """A container path under a hostPath -> the node's path; a node path -> its stand-in."""
        for table in (in_container, {k: str(v) for k, v in node.paths.items()}):
            for inside, outside in table.items():
                if value == inside or value.startswith(inside.rstrip("/") + "/"):
                    value = outside + value[len(inside.rstrip("/")):]
                    break
        return value

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    for entry in init["env"]:
        env[entry["name"]] = translate(entry["value"])
    drop = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"] if unprivileged else []
    argv = ["nsenter", f"--mount={node.mounts}", "--", *container_filesystem(daemonset, init), *drop,
            *ENTRYPOINT, *init["args"]]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd="/")


def test_the_daemonset_runs_on_a_node_without_systemd(topology: Topology, private_node: PrivateNode,
                                                      server: LabServer, tmp_path: Path) -> None:
    (tmp_path / "overlay").mkdir()
    objects = render_with(tmp_path / "overlay", ["base"], ["components/mount-bpffs"])
    daemonset = find(objects, "DaemonSet", "podmeter-agent")
    spec = daemonset["spec"]["template"]["spec"]
    node = private_node
    # the node as the issue found it: the runtime refuses HostToContainer (the agent's former mount) and
    # Bidirectional (an init container in Cilium's way) on its /sys/fs/bpf
    before = node.mountinfo()
    assert node.mounted_at(node.bpffs, before) == [] and "shared:" not in before and "master:" not in before
    assert runtime_refusal("HostToContainer", str(node.bpffs), before) is not None
    assert runtime_refusal("Bidirectional", str(node.bpffs), before) is not None
    # and accepts every container of this pod
    volumes = {v["name"]: v for v in spec["volumes"]}
    for cont in pod_containers(daemonset):
        for mount in cont.get("volumeMounts", []):
            if "hostPath" in volumes[mount["name"]]:
                host = str(node.paths[volumes[mount["name"]]["hostPath"]["path"]])
                assert runtime_refusal(mount.get("mountPropagation"), host, before) is None, cont["name"]

    agent = Container(daemonset, {"/sys/fs/bpf": node.bpffs}, server.kubeconfig, node_mounts=node.mounts)
    pod = topology.add_pod()
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop")
        cluster.pod("shop", "web", pod.ip, node=NODE, observe=True)
    log_path = tmp_path / "agent.log"
    log = lambda: log_path.read_text(errors="replace")[-3000:]  # noqa: E731
    proc: subprocess.Popen[bytes] | None = None
    try:
        # without the init container the agent has no bpffs to pin in: it says so and exits
        proc = agent.start(topology.host_path, log_path)
        assert proc.wait(30) == 1, log()
        assert "not on a bpf filesystem" in log_path.read_text()

        # the init container mounts it in the node's mount namespace: the node sees it, this process does not
        first = run_init_container(daemonset, "mount-bpffs", node)
        assert first.returncode == 0, first.stdout + first.stderr
        (line,) = first.stderr.splitlines()
        assert json.loads(line)["msg"] == f"mounted a bpf filesystem at {node.bpffs} on the node"
        assert node.mounted_at(node.bpffs) == ["bpf"]
        assert str(node.bpffs) not in Path("/proc/self/mountinfo").read_text()
        # the pod's next start (an update, a node reboot finds it mounted by then) leaves it alone
        again = run_init_container(daemonset, "mount-bpffs", node)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "nothing to do" in json.loads(again.stderr)["msg"]
        assert node.mounted_at(node.bpffs) == ["bpf"]

        # then the agent's container, made from the node's namespace, pins in that bpffs and counts
        proc = agent.start(topology.host_path, log_path)
        started = time.monotonic()
        first_probe(agent, topology, pod.host_ip, started, proc, log)
        ready_path, port = agent.probe("readinessProbe")
        wait_for(lambda: proc.poll() is not None or get(topology, port, ready_path, pod.host_ip)[0] == 200,
                 timeout=30, what="readiness on the node without systemd", describe=log)
        assert proc.poll() is None, log()
        pins = Path(f"/proc/{node.holder.pid}/root") / Path(agent.env["PODMETER_BPFFS"]).relative_to("/")
        wait_for(lambda: pinned_filter(pins) == {pod.ip}, timeout=15, what="the pod's IP in the node's bpffs",
                 describe=log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(agent.spec["terminationGracePeriodSeconds"]) == 0, log()
        assert pinned_filter(pins) == {pod.ip}  # the pins outlive the agent, in the node's bpffs
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        agent.remove()


def test_the_mount_bpffs_init_container_needs_its_privileges(private_node: PrivateNode, tmp_path: Path) -> None:
    daemonset = find(render_with(tmp_path, ["base"], ["components/mount-bpffs"]), "DaemonSet", "podmeter-agent")
    result = run_init_container(daemonset, "mount-bpffs", private_node, unprivileged=True)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    record = json.loads(line)
    assert record["level"] == "error" and "a privileged container" in record["msg"], record
    assert private_node.mounted_at(private_node.bpffs) == []  # the pod stays in Init: the agent never starts
