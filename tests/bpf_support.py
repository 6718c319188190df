"""Shared fixtures of the eBPF datapath tests (no tests here): pin directories and netns topologies.

Everything a fixture creates (pins, namespaces, veths, attachments) is removed in ``finally`` blocks, so
a failing test leaves nothing behind. Names carry the pid and a counter: tests never collide with each
other, with a second test run, or with a lab running on the same machine.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lab_server import LabServer
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.adapters.datapath.ebpf.netns import netns

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (bpf, netns)")
BPFFS = Path("/sys/fs/bpf")
_serial = itertools.count()


def unique(prefix: str) -> str:
    """A short name unique to this process and call (fits an interface name: 15 chars)."""
    name = f"{prefix}{os.getpid() % 100000}x{next(_serial)}"
    assert len(name) <= 15, name
    return name


def remove_pin_dir(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


@pytest.fixture
def pin_dir() -> Iterator[Path]:
    """A fresh pin directory path (not created) inside bpffs; removed with its pins afterwards."""
    path = BPFFS / unique("pmtest")
    try:
        yield path
    finally:
        remove_pin_dir(path)


@pytest.fixture
def open_datapath(pin_dir: Path) -> Iterator[Callable[..., EbpfDatapath]]:
    """Open (load) datapaths on ``pin_dir``; every one opened is closed afterwards."""
    opened: list[EbpfDatapath] = []

    def opener(filter_size: int = 64, **options: Any) -> EbpfDatapath:
        datapath = EbpfDatapath.open(pin_dir, filter_size=filter_size, **options)
        opened.append(datapath)
        return datapath

    try:
        yield opener
    finally:
        for datapath in opened:
            datapath.close()


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


@dataclass
class Pod:
    """A pod: its own netns, ``eth0`` inside, the host side of its veth in the host netns."""

    netns: str
    host_veth: str
    ip: str
    host_ip: str
    ip6: str | None = None  # set when the pod has IPv6 too
    host_ip6: str | None = None

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"


@dataclass
class Topology:
    """A host netns (standing in for the node's root netns) with pods wired to it by veth pairs.

    Working in a private host netns keeps the tests away from interfaces of the real host (and of a
    lab running on it), and vice versa. IPv6 is disabled everywhere so the only traffic is the test's.
    """

    host: str = field(default_factory=lambda: unique("pmh"))
    pods: list[Pod] = field(default_factory=list)
    _subnets: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def host_path(self) -> str:
        return f"/run/netns/{self.host}"

    def create(self) -> None:
        run("ip", "netns", "add", self.host)
        self._disable_ipv6(self.host, "default")
        run("ip", "-n", self.host, "link", "set", "lo", "up")

    def add_pod(self, ipv6: bool = False, host_veth: str | None = None) -> Pod:
        """A pod with IPv4; with ``ipv6`` also IPv6 (and then the kernel's own ND/MLD traffic).
        ``host_veth``: the name of the host side (default ``pm...``, as the lab's node names them)."""
        n = next(self._subnets)
        pod = Pod(unique("pmp"), host_veth or unique("pm"), f"10.231.{n}.2", f"10.231.{n}.1")
        if ipv6:
            pod.ip6, pod.host_ip6 = f"fd00:231:{n}::2", f"fd00:231:{n}::1"
        run("ip", "netns", "add", pod.netns)
        self.pods.append(pod)
        self._disable_ipv6(pod.netns, "default")
        run("ip", "-n", self.host, "link", "add", pod.host_veth, "type", "veth", "peer", "name", "eth0",
            "netns", pod.netns)
        self._disable_ipv6(self.host, pod.host_veth, not ipv6)
        self._disable_ipv6(pod.netns, "eth0", not ipv6)
        if pod.ip6 is not None:
            run("ip", "-n", self.host, "addr", "add", f"{pod.host_ip6}/64", "dev", pod.host_veth, "nodad")
            run("ip", "-n", pod.netns, "addr", "add", f"{pod.ip6}/64", "dev", "eth0", "nodad")
        run("ip", "-n", self.host, "addr", "add", f"{pod.host_ip}/24", "dev", pod.host_veth)
        run("ip", "-n", self.host, "link", "set", pod.host_veth, "up")
        run("ip", "-n", pod.netns, "addr", "add", f"{pod.ip}/24", "dev", "eth0")
        run("ip", "-n", pod.netns, "link", "set", "eth0", "up")
        run("ip", "-n", pod.netns, "link", "set", "lo", "up")
        return pod

    def destroy(self) -> None:
        for name in [self.host, *(pod.netns for pod in self.pods)]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)

    def in_host(self) -> contextlib.AbstractContextManager[None]:
        return netns(self.host_path)

    @staticmethod
    def _disable_ipv6(namespace: str, device: str, disable: bool = True) -> None:
        setting = f"net.ipv6.conf.{device}.disable_ipv6={int(disable)}"
        run("ip", "netns", "exec", namespace, "sysctl", "-qw", setting)


@pytest.fixture
def topology() -> Iterator[Topology]:
    topo = Topology()
    try:
        topo.create()
        yield topo
    finally:
        topo.destroy()


@pytest.fixture
def server(topology: Topology) -> Iterator[LabServer]:
    """The lab API server on a thread that lives in the test's host netns (agents started in that netns
    reach it on its loopback)."""
    with topology.in_host():
        lab = LabServer(process=False)
        lab.start()
    try:
        yield lab
    finally:
        lab.stop()
