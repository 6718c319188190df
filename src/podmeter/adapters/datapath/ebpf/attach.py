"""Attaching the counting programs to the host side of every pod veth, as interfaces come and go.

The rule (:class:`InterfaceRule`): an interface is a pod's host-side veth when its link kind is ``veth``
and its name matches one of the glob patterns (default ``pm*`` for the lab node, and the common CNI
prefixes ``veth*``, ``lxc*``, ``cali*``); interfaces named explicitly (``--interface``) are attached
whatever their kind. ``pm_from_pod`` goes on tc ingress (packets leaving the pod), ``pm_to_pod`` on tc
egress (packets entering it).

The manager converges the attachments towards the links that exist: for an interface, attached iff it
exists and the rule selects it. It keeps its own table of links (ifindex -> name, kind), read whole by a
dump at start, on :meth:`AttachManager.sync`, every ``resync_interval`` seconds and whenever the kernel
reports lost notifications (ENOBUFS); between dumps, each link notification updates the table and only
the interfaces it names are converged. So a lost or misread event delays an attach until the next dump,
never loses it, and a busy node costs one small parse per change instead of a dump per change
(:mod:`.links` explains why that matters for the agent's latency).

Mechanisms:
* TCX (kernel >= 6.6): a BPF link per hook, placed before other programs of the hook; the link lives as
  long as this process holds its fd, so a dead agent leaves nothing attached.
* clsact + cls_bpf (older kernels): a direct-action filter with podmeter's own handle and priority,
  replaced in place on restart (a filter outlives the process). The clsact qdisc is created if missing
  and never deleted, and only podmeter's own filter is ever removed: other tools' filters stay.
Both run our programs, which return TC_ACT_UNSPEC, so the verdicts of other tools are unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import fnmatch
import logging
import os
import select
import socket
import threading
from dataclasses import dataclass, field

from pyroute2 import IPRoute

from podmeter.adapters.datapath.ebpf import preflight
from podmeter.adapters.datapath.ebpf.datapath import Programs
from podmeter.adapters.datapath.ebpf.errors import AttachError
from podmeter.adapters.datapath.ebpf.libbpf import (
    BPF_F_BEFORE,
    BPF_TC_EGRESS,
    BPF_TC_F_REPLACE,
    BPF_TC_INGRESS,
    BPF_TCX_EGRESS,
    BPF_TCX_INGRESS,
    BpfCallError,
    LinkCreateOpts,
    TcHook,
    TcOpts,
    libbpf,
)
from podmeter.adapters.datapath.ebpf.links import Link, dump_links, link_events, read_changes
from podmeter.adapters.datapath.ebpf.loader import Program
from podmeter.adapters.datapath.ebpf.netns import enter_netns

log = logging.getLogger("podmeter.attach")

DEFAULT_PATTERNS = ("pm*", "veth*", "lxc*", "cali*")
TC_HANDLE = 0x706D  # "pm": podmeter's cls_bpf filter handle
TC_PRIORITY = 1  # first in line, so filters of other tools that end processing cannot hide packets


class AttachMode(enum.Enum):
    AUTO = "auto"  # TCX when the kernel has it, else clsact
    TCX = "tcx"
    TC = "tc"


@dataclass(frozen=True, slots=True)
class InterfaceRule:
    """Which interfaces are the host side of a pod veth."""

    patterns: tuple[str, ...] = DEFAULT_PATTERNS
    explicit: tuple[str, ...] = ()

    def matches(self, name: str, kind: str | None) -> bool:
        if name in self.explicit:
            return True
        return kind == "veth" and any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns)


@dataclass
class Attachment:
    """Programs attached to one interface; for TCX the link fds (closing them detaches)."""

    ifindex: int
    ifname: str
    mode: AttachMode
    link_fds: list[int] = field(default_factory=list)


def resolve_mode(mode: AttachMode) -> AttachMode:
    if mode is not AttachMode.AUTO:
        return mode
    return AttachMode.TCX if preflight.kernel_version() >= preflight.TCX_KERNEL else AttachMode.TC


class Attacher:
    """Attaches and detaches the two programs on one interface with one mechanism."""

    def __init__(self, programs: Programs, mode: AttachMode) -> None:
        self.programs = programs
        self.mode = resolve_mode(mode)

    def attach(self, ifindex: int, ifname: str) -> Attachment:
        try:
            if self.mode is AttachMode.TCX:
                return Attachment(ifindex, ifname, self.mode, self._tcx_attach(ifindex))
            self._tc_attach(ifindex)
            return Attachment(ifindex, ifname, self.mode)
        except AttachError as error:
            raise AttachError(f"cannot attach podmeter to {ifname}: {error}") from error
        except BpfCallError as error:
            raise AttachError(f"cannot attach podmeter to {ifname} ({self.mode.value}): {error}") from error

    def detach(self, attachment: Attachment, exists: bool) -> None:
        """Detach from an interface; ``exists=False`` when it is gone (the kernel detached already)."""
        for fd in attachment.link_fds:
            os.close(fd)
        attachment.link_fds.clear()
        if attachment.mode is AttachMode.TC and exists:
            for point in (BPF_TC_INGRESS, BPF_TC_EGRESS):
                self._tc_detach(attachment.ifindex, point)

    def _hooks(self, ingress: int, egress: int) -> list[tuple[Program, int]]:
        """Which program goes on which hook of the host-side veth."""
        return [(self.programs.from_pod, ingress), (self.programs.to_pod, egress)]

    def _tcx_attach(self, ifindex: int) -> list[int]:
        lib = libbpf()
        opts = LinkCreateOpts(ctypes.sizeof(LinkCreateOpts), BPF_F_BEFORE, 0)
        fds: list[int] = []
        try:
            for program, hook in self._hooks(BPF_TCX_INGRESS, BPF_TCX_EGRESS):
                fds.append(lib.call("bpf_link_create", program.fd, ifindex, hook, ctypes.byref(opts)))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def _tc_attach(self, ifindex: int) -> None:
        if _has_legacy_ingress_qdisc(ifindex):
            # clsact and ingress share the handle ffff:, so the egress program would land on the ingress
            # qdisc and silently count packets leaving the pod as entering it.
            raise AttachError(
                f"ifindex {ifindex} has a legacy `ingress` qdisc, which cannot coexist with clsact: "
                "remove it (`tc qdisc del dev DEV ingress`) or use TCX (kernel >= 6.6)"
            )
        lib = libbpf()
        hook = TcHook(ctypes.sizeof(TcHook), ifindex, BPF_TC_INGRESS, 0)
        ret = lib.lib.bpf_tc_hook_create(ctypes.byref(hook))
        if ret != -errno.EEXIST:  # an existing clsact (ours or another tool's) is used as it is
            lib.check("bpf_tc_hook_create", ret)
        for program, point in self._hooks(BPF_TC_INGRESS, BPF_TC_EGRESS):
            hook.attach_point = point
            opts = TcOpts(ctypes.sizeof(TcOpts), program.fd, BPF_TC_F_REPLACE, 0, TC_HANDLE, TC_PRIORITY)
            lib.call("bpf_tc_attach", ctypes.byref(hook), ctypes.byref(opts))

    def _tc_detach(self, ifindex: int, point: int) -> None:
        hook = TcHook(ctypes.sizeof(TcHook), ifindex, point, 0)
        opts = TcOpts(ctypes.sizeof(TcOpts), 0, 0, 0, TC_HANDLE, TC_PRIORITY)
        ret = libbpf().lib.bpf_tc_detach(ctypes.byref(hook), ctypes.byref(opts))
        if ret < 0 and -ret not in (errno.ENOENT, errno.ENODEV, errno.EINVAL):
            log.warning("detaching podmeter from ifindex %d: %s", ifindex, os.strerror(-ret))


class AttachManager:
    """Keeps the programs attached to exactly the interfaces the rule selects, in one netns.

    All netlink and attach work happens on one worker thread (entered into ``netns`` if given, a path
    like ``/run/netns/NAME``). Invariant after each pass: ``attached()`` holds one entry per existing
    selected interface whose attach succeeded, and nothing else; failures are in ``errors``.
    """

    def __init__(
        self,
        programs: Programs,
        rule: InterfaceRule | None = None,
        mode: AttachMode = AttachMode.AUTO,
        netns: str | None = None,
        resync_interval: float = 30.0,
    ) -> None:
        self.rule = rule or InterfaceRule()
        self.attacher = Attacher(programs, mode)
        self.netns = netns
        self.resync_interval = resync_interval
        self._errors: dict[str, str] = {}
        self._attached: dict[int, Attachment] = {}
        self._lock = threading.Condition()
        self._passes = 0  # full passes (dumps) done
        self._links: dict[int, Link] = {}  # the worker's table: ifindex -> (name, kind)
        self._stopping = False
        self._failure: BaseException | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def mode(self) -> AttachMode:
        return self.attacher.mode

    def start(self, timeout: float = 10.0) -> None:
        """Start following link events; returns after the first pass (raises if the worker failed)."""
        self._thread = threading.Thread(target=self._run, name="podmeter-attach", daemon=True)
        self._thread.start()
        self._wait_for_pass(1, timeout)

    def sync(self, timeout: float = 10.0) -> None:
        """Run a pass now (after whatever changed) and wait for it."""
        with self._lock:
            target = self._passes + 1
        os.write(self._wake_w, b"s")
        self._wait_for_pass(target, timeout)

    def attached(self) -> dict[str, Attachment]:
        """Interfaces the programs are attached to now, by name."""
        with self._lock:
            return {a.ifname: a for a in self._attached.values()}

    @property
    def errors(self) -> dict[str, str]:
        """Selected interfaces whose last attach failed (name -> reason); retried when the interface
        changes, on sync() and on every dump."""
        with self._lock:
            return dict(self._errors)

    def stop(self, timeout: float = 10.0) -> None:
        """Detach from every interface and stop the worker (idempotent)."""
        if self._closed:
            return
        with self._lock:
            self._stopping = True
        os.write(self._wake_w, b"q")
        if self._thread is not None:
            self._thread.join(timeout)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._closed = True

    def __enter__(self) -> AttachManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- worker ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.netns is not None:
                enter_netns(self.netns)
            with link_events() as events:
                self._full_pass()
                while not self._stopping:
                    self._wait(events)
                self._detach_all()
        except BaseException as error:  # reported to start()/sync() callers
            log.exception("attach manager stopped")
            self._abandon()
            with self._lock:
                self._failure = error
                self._lock.notify_all()

    def _abandon(self) -> None:
        """After a failure: close TCX links (a tc filter left behind is replaced by the next start)."""
        for index, attachment in list(self._attached.items()):
            with contextlib.suppress(OSError):
                self.attacher.detach(attachment, exists=False)
            self._forget(index)

    def _detach_all(self) -> None:
        present = dump_links()
        for index, attachment in list(self._attached.items()):
            self.attacher.detach(attachment, exists=index in present)
            self._forget(index)

    def _wait(self, events: socket.socket) -> None:
        """Sleep until a link changes, a sync is asked for or the resync period ends; then converge."""
        readable, _, _ = select.select([events.fileno(), self._wake_r], [], [], self.resync_interval)
        woken = self._wake_r in readable
        if woken:
            os.read(self._wake_r, 4096)
        found = read_changes(events) if events.fileno() in readable else []
        if woken or not readable or found is None:
            self._full_pass()
            return
        for change in found:
            if change.link is None:
                self._links.pop(change.index, None)
            else:
                self._links[change.index] = change.link
        self._converge({change.index for change in found})

    def _full_pass(self) -> None:
        self._links = dump_links()
        self._converge(set(self._links) | set(self._attached))
        wanted = {name for name, kind in self._links.values() if self.rule.matches(name, kind)}
        with self._lock:
            self._errors = {name: e for name, e in self._errors.items() if name in wanted}
            self._passes += 1
            self._lock.notify_all()

    def _converge(self, indexes: set[int]) -> None:
        """Attached iff the link exists and the rule selects it, for each of ``indexes``."""
        for index in sorted(indexes):
            link = self._links.get(index)
            selected = link[0] if link is not None and self.rule.matches(*link) else None  # its name
            attachment = self._attached.get(index)
            if attachment is not None and attachment.ifname != selected:  # gone, renamed or unselected
                self.attacher.detach(attachment, exists=link is not None)
                self._forget(index)
                attachment = None
            if selected is not None and attachment is None:
                self._attach(index, selected)

    def _attach(self, index: int, name: str) -> None:
        try:
            attachment = self.attacher.attach(index, name)
        except AttachError as error:
            with self._lock:
                self._errors[name] = str(error)
            log.warning("%s", error)
            return
        log.info("attached to %s (ifindex %d, %s)", name, index, attachment.mode.value)
        with self._lock:
            self._errors.pop(name, None)
            self._attached[index] = attachment

    def _forget(self, index: int) -> None:
        with self._lock:
            attachment = self._attached.pop(index)
        log.info("detached from %s (ifindex %d)", attachment.ifname, index)

    def _wait_for_pass(self, target: int, timeout: float) -> None:
        with self._lock:
            done = self._lock.wait_for(lambda: self._passes >= target or self._failure is not None, timeout)
            if self._failure is not None:
                raise AttachError(f"the attach manager failed: {self._failure}") from self._failure
            if not done:
                raise AttachError(f"the attach manager did not complete a pass within {timeout} s")


def _has_legacy_ingress_qdisc(ifindex: int) -> bool:
    with IPRoute() as ipr:  # in the calling thread's netns: the worker's
        return any(q.get_attr("TCA_KIND") == "ingress" for q in ipr.get_qdiscs(index=ifindex))
