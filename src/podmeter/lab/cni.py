"""A real CNI plugin wires the lab's pods: the bridge plugin with host-local IPAM, called as a container
runtime calls it (scenario key ``cni: bridge``).

The runner (:class:`LabCni`) writes one network configuration per node: the plugin ``bridge``, a bridge of
the node's own (``pmbr<hash of the node name>``) that carries the gateway (``isGateway``: the first address
of the node's pod CIDR), no masquerading, and host-local IPAM over the node's pod CIDR with a default
route, its state in a lab-owned ``dataDir`` (``<out>/cni/<node>/ipam``, never ``/var/lib/cni``). It hands
the file and the plugin directory to the node's ``podmeter node`` in its environment (:data:`CONF_ENV`,
:data:`PATH_ENV`), as a runtime reads ``/etc/cni/net.d`` and ``/opt/cni/bin``.

The node (:class:`CniSandbox`, used by :mod:`podmeter.lab.node`) does for each pod what a runtime does for a
pod sandbox: it makes the pod's network namespace (``/run/netns/pmpod-<id>``, the lab's own name, so the
runner finds it from the pod UID), brings ``lo`` up and runs ``<CNI_PATH>/bridge`` with the configuration
on stdin and ``CNI_COMMAND=ADD``, ``CNI_CONTAINERID`` (the pod UID), ``CNI_NETNS``, ``CNI_IFNAME=eth0``,
``CNI_PATH`` in its environment. The pod's IP is the one the result names, known only then (as for a
kubelet); the host side of its veth is the plugin's ``veth<hex>``, enslaved to the bridge. At the pod's
end ``CNI_COMMAND=DEL`` (the plugin removes the veth, IPAM frees the address), then the namespace goes.

After the nodes stopped, :meth:`LabCni.finish` checks that nothing leaked (no address still reserved in
the IPAM state, no veth left on the bridge), removes what did (DEL, for a node that could not), then the
bridge (the plugin never removes it, nor does a kubelet) and the state directory: the machine is as before.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from podmeter.lab.netns import NETNS_DIR, NETNS_PREFIX, create_netns, in_namespace, remove_netns, short_id
from podmeter.lab.scenario import Scenario

log = logging.getLogger("podmeter.cni")

CONF_ENV = "PODMETER_NODE_CNI_CONF"  # the network configuration file the node calls its plugin with
PATH_ENV = "PODMETER_NODE_CNI_PATH"  # the directory of the plugins (CNI_PATH)
PLUGIN_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))  # Debian's containernetworking-plugins; upstream's
IFNAME = "eth0"
CALL_TIMEOUT = 30.0
INSTALL_HINT = "apt-get install containernetworking-plugins"


class CniError(OSError):
    """A plugin call failed (its exit status and message, a bad answer, a timeout)."""


class PluginMissing(RuntimeError):
    """The scenario's plugin is not installed (``podmeter lab`` says so in one line, exit status 2)."""


# --- the node's side: a pod sandbox wired by the plugin -----------------------------------------------------


@dataclass(frozen=True)
class Added:
    """What an ADD gave the pod: its IPv4 address and the host side of its link (None if unnamed)."""

    ip: str
    host_device: str | None


class CniPlugin:
    """One network configuration and the plugin it names, called as a runtime calls it.

    One call at a time per node: host-local serialises its allocations with a lock file anyway, and the
    first ADDs of a node racing to create its bridge would be a flake of the plugin's making, not of what
    the lab checks (a call takes some 20 ms).
    """

    def __init__(self, conf: bytes, bin_dir: Path) -> None:
        network = json.loads(conf)
        self.conf = conf
        self.plugin = str(network["type"])
        self.bridge = str(network.get("bridge") or "")
        self.bin_dir = bin_dir
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {"ADD": 0, "DEL": 0}

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> CniPlugin | None:
        """The plugin the lab configured for this node (:data:`CONF_ENV`, :data:`PATH_ENV`), or None."""
        conf = environ.get(CONF_ENV)
        if not conf:
            return None
        bin_dir = Path(environ.get(PATH_ENV) or PLUGIN_DIRS[0])
        try:
            return cls(Path(conf).read_bytes(), bin_dir)
        except (OSError, ValueError, KeyError) as exc:
            raise CniError(f"{CONF_ENV}={conf}: not a network configuration: {exc}") from None

    def add(self, container_id: str, netns_path: str) -> Added:
        result = self._call("ADD", container_id, netns_path)
        try:
            ips = [entry["address"].split("/")[0] for entry in result.get("ips") or []]
            ip = next(a for a in ips if ipaddress.ip_address(a).version == 4)
        except (StopIteration, KeyError, AttributeError, ValueError):
            raise CniError(f"{self.plugin} ADD gave no IPv4 address: {json.dumps(result)[:500]}") from None
        host = next((i.get("name") for i in result.get("interfaces") or []
                     if not i.get("sandbox") and i.get("name") != self.bridge), None)
        return Added(ip, None if host is None else str(host))

    def delete(self, container_id: str, netns_path: str) -> None:
        """Idempotent (CNI: a DEL of what is gone succeeds); the namespace may be gone already."""
        self._call("DEL", container_id, netns_path)

    def _call(self, command: str, container_id: str, netns_path: str) -> dict[str, Any]:
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "CNI_COMMAND": command,
               "CNI_CONTAINERID": container_id, "CNI_NETNS": netns_path, "CNI_IFNAME": IFNAME,
               "CNI_PATH": str(self.bin_dir)}
        binary = self.bin_dir / self.plugin
        with self._lock:
            self.calls[command] = self.calls.get(command, 0) + 1
            try:
                done = subprocess.run([str(binary)], input=self.conf, env=env, capture_output=True,
                                      timeout=CALL_TIMEOUT, check=False)
            except subprocess.TimeoutExpired:
                raise CniError(f"{binary} {command} for {container_id}: no answer in {CALL_TIMEOUT:g} s") from None
            except OSError as exc:
                raise CniError(f"{binary} {command}: cannot run it: {exc.strerror}") from None
        output = done.stdout.decode(errors="replace").strip()
        if done.returncode != 0:
            # The CNI error format: {"code": N, "msg": "...", "details": "..."} on stdout.
            with contextlib.suppress(ValueError, AttributeError):
                error = json.loads(output)
                output = f"{error.get('msg')} {error.get('details') or ''}".strip()
            detail = output or done.stderr.decode(errors="replace").strip()
            raise CniError(f"{self.plugin} {command} for {container_id} failed (exit {done.returncode}): "
                           f"{detail[:500]}")
        try:
            result: dict[str, Any] = json.loads(output) if output else {}
        except ValueError:
            raise CniError(f"{self.plugin} {command}: not JSON: {output[:200]!r}") from None
        return result


class CniSandbox:
    """One pod's network made by the plugin: the namespace is the lab's, the rest the plugin's. Its IP is
    known after :meth:`create` (empty before)."""

    def __init__(self, uid: str, plugin: CniPlugin) -> None:
        self.netns = f"{NETNS_PREFIX}{short_id(uid)}"
        self.container_id = uid
        self.plugin = plugin
        self.ip = ""
        self.host_device: str | None = None
        self._added = False

    @property
    def netns_path(self) -> str:
        return str(NETNS_DIR / self.netns)

    def exists(self) -> bool:
        return Path(self.netns_path).exists()

    def create(self) -> None:
        """The namespace, ``lo`` up, then ADD; on failure undo what was made (DEL included)."""
        try:
            create_netns(self.netns_path)
            with in_namespace(self.netns_path), IPRoute() as ipr:
                ipr.link("set", index=socket.if_nametoindex("lo"), state="up")
            self._added = True  # from here on a DEL is owed, even for an ADD that failed half-way
            added = self.plugin.add(self.container_id, self.netns_path)
            self.ip, self.host_device = added.ip, added.host_device
        except BaseException:
            with contextlib.suppress(OSError):
                self.destroy()
            raise

    def destroy(self, wait: bool = False) -> None:
        """DEL (synchronous: the veth and the reservation go now), then the namespace. Idempotent; a DEL
        that fails still removes the namespace, then raises :class:`CniError`. ``wait``: for the
        interface of :class:`~podmeter.lab.netns.Sandbox` (everything here is synchronous)."""
        try:
            if self._added or self.exists():  # a new pod has nothing to remove: no call
                self.plugin.delete(self.container_id, self.netns_path)
            self._added = False
        finally:
            remove_netns(self.netns_path)


# --- the runner's side: a configuration per node, and the return to baseline ---------------------------------


def plugin_dir(plugin: str = "bridge", ipam: str = "host-local") -> Path | None:
    """The first directory holding both plugins, or None."""
    return next((d for d in PLUGIN_DIRS if (d / plugin).is_file() and (d / ipam).is_file()), None)


def missing_plugin(plugin: str = "bridge") -> str:
    where = ", ".join(str(d) for d in PLUGIN_DIRS)
    return (f"cni: {plugin} wires the pods with the {plugin} CNI plugin and host-local IPAM, but they are not in "
            f"{where}: {INSTALL_HINT}")


def bridge_name(node: str) -> str:
    """The node's bridge: ``pmbr`` and 8 hex digits of its name (12 characters, an interface name)."""
    return f"pmbr{zlib.crc32(node.encode()):08x}"


def network_name(node: str) -> str:
    return f"podmeter-lab-{node}"


def bridge_network(node: str, pod_cidr: str, data_dir: Path) -> dict[str, Any]:
    """The node's network configuration: a bridge of its own carrying the gateway, host-local IPAM over
    its pod CIDR (the gateway is its first address) with a default route, state under ``data_dir``."""
    return {
        "cniVersion": "1.0.0", "name": network_name(node), "type": "bridge", "bridge": bridge_name(node),
        "isGateway": True, "ipMasq": False, "hairpinMode": False,
        "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr}]], "routes": [{"dst": "0.0.0.0/0"}],
                 "dataDir": str(data_dir)},
    }


@dataclass
class NodeCni:
    """One node's configuration, where it lives (``<out>/cni/<node>``) and its IPAM state."""

    node: str
    directory: Path
    network: dict[str, Any]

    @property
    def conf_path(self) -> Path:
        return self.directory / "10-podmeter-lab.conf"

    @property
    def data_dir(self) -> Path:
        return Path(self.network["ipam"]["dataDir"])

    @property
    def bridge(self) -> str:
        return str(self.network["bridge"])

    def reservations(self) -> dict[str, str]:
        """Addresses host-local still holds (a file per address, named by it): address -> container ID."""
        state = self.data_dir / str(self.network["name"])
        held: dict[str, str] = {}
        for path in state.glob("*") if state.is_dir() else []:
            with contextlib.suppress(ValueError, OSError):
                ipaddress.ip_address(path.name)
                held[path.name] = path.read_text().splitlines()[0].strip()
        return held


@dataclass
class LabCni:
    """The runner's side (see the module docstring). Inactive (no configuration, no check) for ``cni: lab``
    and in memory mode, which builds no sandboxes (:attr:`note` says so)."""

    kind: str
    active: bool
    out: Path
    bin_dir: Path | None = None
    note: str | None = None
    nodes: dict[str, NodeCni] = field(default_factory=dict)

    @classmethod
    def for_run(cls, scenario: Scenario, datapath: str, out: Path) -> LabCni:
        """Raises :class:`PluginMissing` when the scenario's plugin is not installed."""
        kind = scenario.cni
        if kind == "lab":
            return cls(kind, False, out)
        if datapath != "ebpf":
            return cls(kind, False, out, note=f"cni: {kind} wires sandboxes, and memory mode has none: the nodes "
                                              "assign the IPs themselves")
        bin_dir = plugin_dir(kind)
        if bin_dir is None:
            raise PluginMissing(f"scenario {scenario.name}: {missing_plugin(kind)}")
        return cls(kind, True, out, bin_dir)

    @property
    def root(self) -> Path:
        return self.out / "cni"

    def node_environment(self, node: str, pod_cidr: str) -> dict[str, str] | None:
        """Write the node's configuration; the environment its ``podmeter node`` needs (None: inactive)."""
        if not self.active:
            return None
        assert self.bin_dir is not None
        directory = self.root / node
        shutil.rmtree(directory, ignore_errors=True)  # a previous run's, in the same --out
        directory.mkdir(parents=True)
        wired = self.nodes[node] = NodeCni(node, directory, bridge_network(node, pod_cidr, directory / "ipam"))
        wired.conf_path.write_text(json.dumps(wired.network, indent=2) + "\n")
        return {CONF_ENV: str(wired.conf_path), PATH_ENV: str(self.bin_dir)}

    def finish(self, inside: Callable[[str], contextlib.AbstractContextManager[None]]
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Once the nodes stopped: what they left (failures: invariant ``CNI``), removed, then each node's
        bridge and the state. ``inside(node)``: the runner's thread in that node's namespace for a block.
        Returns (failures, the report's count)."""
        failures: list[dict[str, Any]] = []
        removed = 0
        for name, wired in self.nodes.items():
            with inside(name):
                for ip, container_id in sorted(wired.reservations().items()):
                    failures.append(_failure(name, ip, f"host-local still reserves {ip} for pod uid {container_id} "
                                                       "after the node stopped (no DEL)"))
                    self._delete_leftover(wired, container_id)
                for veth in _remove_bridge(wired.bridge):
                    failures.append(_failure(name, veth, f"veth {veth} was still on bridge {wired.bridge} after the "
                                                         "node stopped"))
                removed += 1
        shutil.rmtree(self.root, ignore_errors=True)
        counts = {"plugin": self.kind, "nodes": len(self.nodes), "bridges_removed": removed,
                  "leaks": len(failures)}
        return failures, counts

    def _delete_leftover(self, wired: NodeCni, container_id: str) -> None:
        """What a node left of a pod: DEL (its veth, its reservation), then its namespace."""
        assert self.bin_dir is not None
        netns_path = str(NETNS_DIR / f"{NETNS_PREFIX}{short_id(container_id)}")
        try:
            CniPlugin(wired.conf_path.read_bytes(), self.bin_dir).delete(container_id, netns_path)
        except OSError as exc:
            log.warning("leftover of pod uid %s: %s", container_id, exc)
        remove_netns(netns_path)


def _failure(node: str, subject: str, detail: str) -> dict[str, Any]:
    return {"invariant": "CNI", "subject": subject, "detail": f"{node}: {detail}", "lasted_s": 0, "node": node}


def _remove_bridge(bridge: str) -> list[str]:
    """Delete the bridge of the caller's namespace, and any veth still on it first: their names."""
    try:
        index = socket.if_nametoindex(bridge)
    except OSError:
        return []  # never made (no pod ran) or gone with its namespace
    left: list[str] = []
    with IPRoute() as ipr:
        for link in ipr.get_links():
            if link.get_attr("IFLA_MASTER") == index:
                left.append(str(link.get_attr("IFLA_IFNAME")))
                with contextlib.suppress(NetlinkError):
                    ipr.link("del", index=link["index"])
        with contextlib.suppress(NetlinkError):
            ipr.link("del", index=index)
    return left
