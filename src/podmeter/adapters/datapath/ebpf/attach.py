"""Attaching the counting programs to the host side of every pod's link, as links come and go.

The rule (:class:`InterfaceRule`) finds pod links by what they are, whatever the CNI names them: a link
of kind ``veth`` or ``netkit`` whose peer lives in **another network namespace** (the kernel reports the
peer's netns id, ``IFLA_LINK_NETNSID``), except the links that carry the node's default routes (a node
that is itself a container, as in kind, has such an uplink). A veth with both ends on the node, a
bridge, a tunnel or a physical NIC is not a pod link. Name patterns (``--interface-pattern GLOB``) are
the override: given, the links whose names match are attached instead, whatever their kind; links named
explicitly (``--interface``) are attached in every case. ``pm_from_pod`` goes on tc ingress (packets
leaving the pod), ``pm_to_pod`` on tc egress (packets entering it).

A link the rule finds is only a **candidate**: other programs' network namespaces (Docker's containers, test
veths) have the same links. With :attr:`LinkSelection.PODS` (the agent) a candidate is attached only while
it carries an IP of one of this node's pods, which the agent hands over (:meth:`AttachManager.set_pod_ips`):
its peer holds the IP (a pod's eth0 holds its own IP on routed and bridged CNIs alike), or the node routes
the IP through it (a routed CNI's /32 route to ``caliXXX``). Candidates that carry none are skipped and
counted (:meth:`AttachManager.link_counts`). :attr:`LinkSelection.CANDIDATES` attaches every candidate: a
caller that knows no pod IPs. Patterns and explicit names are attached whatever they carry.

The manager converges the attachments towards the links that exist: for a link, attached iff it
exists and the rule selects it. It keeps its own table of links (ifindex -> name, kind, peer), read
whole by a dump at start, on :meth:`AttachManager.sync`, every ``resync_interval`` seconds and whenever
the kernel reports lost notifications (ENOBUFS); between dumps, each link notification updates the table
and only the links it names are converged. So a lost or misread event delays an attach until the next
dump, never loses it, and a busy node costs one small parse per change instead of a dump per change
(:mod:`.links` explains why that matters for the agent's latency).

Which pod a link serves: the addresses of its peer, read in the pod's netns without entering it; for an
address no attached link's peer holds, the link the node routes it through. :meth:`AttachManager.unlinked`
tells the agent which of its pods' IPs reach no attached link (the pods it cannot count).

Mechanisms:
* TCX (kernel >= 6.6): a BPF link per hook, placed before other programs of the hook. Without link pins
  the link lives as long as this process holds its fd, so a dead process leaves nothing attached. With
  ``link_pins`` (the agent's) each link is pinned (:mod:`.link_pins`) and outlives the process, SIGKILL
  included: a successor adopts the pinned links of the links it attaches to, running its own programs in
  them, and unpins the others once it knows the node's pods; stop() leaves them pinned.
* clsact + cls_bpf (older kernels): a direct-action filter with podmeter's own handle and priority,
  replaced in place on restart (a filter outlives the process). The clsact qdisc is created if missing
  and never deleted, and only podmeter's own filter is ever removed: other tools' filters stay.
Both run our programs, which return TC_ACT_UNSPEC, so the verdicts of other tools are unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import errno
import fnmatch
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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
from podmeter.adapters.datapath.ebpf.link_pins import LinkPins, pin_name
from podmeter.adapters.datapath.ebpf.links import (
    NETKIT_L3,
    LinkChange,
    LinkInfo,
    NetlinkError,
    Rtnl,
    link_events,
    read_changes,
    read_links,
)
from podmeter.adapters.datapath.ebpf.loader import Program
from podmeter.adapters.datapath.ebpf.netns import enter_netns
from podmeter.model.datapath import LinkCounts

log = logging.getLogger("podmeter.attach")

TC_HANDLE = 0x706D  # "pm": podmeter's cls_bpf filter handle
TC_PRIORITY = 1  # first in line, so filters of other tools that end processing cannot hide packets
ADDRESS_REFRESH = 5.0  # seconds: an IP no peer holds rereads every attached link's peer at most this often
ASKED_FOR = 600.0  # seconds an IP asked about by unlinked() keeps being resolved on every full pass
RECHECK_FIRST = 0.25  # seconds: a pod IP on no link, a candidate carrying none: look again this soon, then
# twice as late each time up to ADDRESS_REFRESH (a pod's address or route may come after its link)
_UNKNOWN = object()

# Why a link seen (a veth or netkit whose peer is in another netns) is not attached: link_counts().skipped
SKIPPED_NO_POD = "no_pod"  # it carries no IP of this node's pods (LinkSelection.PODS)
SKIPPED_UPLINK = "uplink"  # it carries a default route of the node
SKIPPED_NO_MATCH = "no_match"  # name patterns are given and its name matches none
SKIPPED_FAILED = "attach_failed"  # selected, but the attach failed (in errors; retried)


class AttachMode(enum.Enum):
    AUTO = "auto"  # TCX when the kernel has it, else clsact
    TCX = "tcx"
    TC = "tc"


class LinkSelection(enum.Enum):
    """Which candidates (links the rule finds by what they are) the manager attaches to."""

    PODS = "pods"  # those that carry an IP of this node's pods (set_pod_ips): the agent's
    CANDIDATES = "candidates"  # every one: a caller that knows no pod IPs (tests, tools)


@dataclass(frozen=True, slots=True)
class InterfaceRule:
    """Which links are the host side of a pod's link.

    Without ``patterns``: a veth or netkit whose peer is in another netns, unless it is an ``uplink``
    (carries a default route of the node). With ``patterns`` (globs): the links whose names match one,
    whatever their kind or peer, instead. ``explicit`` names are selected in both cases. A link found
    without patterns is a candidate: with ``LinkSelection.PODS`` the manager also wants a pod IP on it."""

    patterns: tuple[str, ...] = ()
    explicit: tuple[str, ...] = ()

    @property
    def detects(self) -> bool:
        """Whether pod links are found by what they are (no patterns given)."""
        return not self.patterns

    def selects(self, link: LinkInfo, uplink: bool = False) -> bool:
        if link.name in self.explicit:
            return True
        if self.patterns:
            return any(fnmatch.fnmatchcase(link.name, pattern) for pattern in self.patterns)
        return link.peer_elsewhere and not uplink


@dataclass
class Attachment:
    """Programs attached to one interface; for TCX the link fds (closing them detaches)."""

    ifindex: int
    ifname: str
    mode: AttachMode
    link_fds: list[int] = field(default_factory=list)
    adopted: bool = False  # its TCX links were a predecessor's, pinned (a link that lived on: the same pod)


def resolve_mode(mode: AttachMode) -> AttachMode:
    if mode is not AttachMode.AUTO:
        return mode
    return AttachMode.TCX if preflight.kernel_version() >= preflight.TCX_KERNEL else AttachMode.TC


class Attacher:
    """Attaches and detaches the two programs on one interface with one mechanism."""

    def __init__(self, programs: Programs, mode: AttachMode, link_pins: LinkPins | None = None) -> None:
        self.programs = programs
        self.mode = resolve_mode(mode)
        self.link_pins = link_pins if self.mode is AttachMode.TCX else None  # a tc filter outlives us anyway

    def attach(self, ifindex: int, ifname: str) -> Attachment:
        try:
            if self.mode is AttachMode.TCX:
                fds, adopted = self._tcx_attach(ifindex)
                return Attachment(ifindex, ifname, self.mode, fds, adopted)
            self._tc_attach(ifindex)
            return Attachment(ifindex, ifname, self.mode)
        except AttachError as error:
            raise AttachError(f"cannot attach podmeter to {ifname}: {error}") from error
        except BpfCallError as error:
            raise AttachError(f"cannot attach podmeter to {ifname} ({self.mode.value}): {error}") from error

    def detach(self, attachment: Attachment, exists: bool) -> None:
        """Detach from an interface; ``exists=False`` when it is gone (the kernel detached already)."""
        self.release(attachment)
        if self.link_pins is not None:
            for _, hook in self._hooks(BPF_TCX_INGRESS, BPF_TCX_EGRESS):
                self.link_pins.unpin(attachment.ifindex, hook)
        if attachment.mode is AttachMode.TC and exists:
            for point in (BPF_TC_INGRESS, BPF_TC_EGRESS):
                self._tc_detach(attachment.ifindex, point)

    def release(self, attachment: Attachment) -> None:
        """Close our fds of an attachment: a pinned link stays attached (for a successor), others detach."""
        for fd in attachment.link_fds:
            os.close(fd)
        attachment.link_fds.clear()

    def pin_names(self, attachment: Attachment) -> set[str]:
        """The link pins an attachment holds (none without link pins)."""
        if self.link_pins is None:
            return set()
        return {pin_name(attachment.ifindex, hook) for _, hook in self._hooks(BPF_TCX_INGRESS, BPF_TCX_EGRESS)}

    def _hooks(self, ingress: int, egress: int) -> list[tuple[Program, int]]:
        """Which program goes on which hook of the host-side veth."""
        return [(self.programs.from_pod, ingress), (self.programs.to_pod, egress)]

    def _tcx_attach(self, ifindex: int) -> tuple[list[int], bool]:
        """The link fds, and whether both were adopted from pins."""
        lib = libbpf()
        opts = LinkCreateOpts(ctypes.sizeof(LinkCreateOpts), BPF_F_BEFORE, 0)
        fds: list[int] = []
        created = 0
        try:
            for program, hook in self._hooks(BPF_TCX_INGRESS, BPF_TCX_EGRESS):
                fd = self.link_pins.adopt(ifindex, hook, program.fd) if self.link_pins is not None else None
                if fd is None:
                    fd = lib.call("bpf_link_create", program.fd, ifindex, hook, ctypes.byref(opts))
                    fds.append(fd)
                    created += 1
                    if self.link_pins is not None:
                        self.link_pins.pin(fd, ifindex, hook)
                else:
                    fds.append(fd)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds, created == 0 and self.link_pins is not None

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
    """Keeps the programs attached to exactly the links the rule selects, in one netns.

    All netlink and attach work happens on one worker thread (entered into ``netns`` if given, a path
    like ``/run/netns/NAME``). Invariant after each pass: ``attached()`` holds one entry per existing
    selected link whose attach succeeded, and nothing else; failures are in ``errors``. With
    ``selection=LinkSelection.PODS`` a candidate is selected only while it carries one of the IPs last
    given to :meth:`set_pod_ips` (none before the first call).

    With ``link_pins`` (a directory in a bpffs; TCX only) the links are pinned there and outlive the
    manager; the pinned links that no attachment holds are unpinned once the node's pods are known (with
    ``PODS``: after the first :meth:`set_pod_ips`), so until then a predecessor's links keep counting.
    """

    def __init__(
        self,
        programs: Programs,
        rule: InterfaceRule | None = None,
        mode: AttachMode = AttachMode.AUTO,
        netns: str | None = None,
        resync_interval: float = 30.0,
        *,
        selection: LinkSelection = LinkSelection.CANDIDATES,
        link_pins: str | os.PathLike[str] | None = None,
    ) -> None:
        self.rule = rule or InterfaceRule()
        self.attacher = Attacher(programs, mode, LinkPins(link_pins) if link_pins is not None else None)
        self.netns = netns
        self.resync_interval = resync_interval
        self.selection = selection
        self._errors: dict[str, str] = {}
        self._attached: dict[int, Attachment] = {}
        self._lock = threading.Condition()
        self._passes = 0  # full passes (dumps) done
        self._links: dict[int, LinkInfo] = {}  # the worker's table
        self._uplinks: frozenset[int] = frozenset()  # the worker's: links with a default route
        self._peers: dict[int, frozenset[str]] = {}  # the worker's: attached link or candidate -> its peer's addresses
        self._peers_read = 0.0  # monotonic time the peers of every attached link were last read
        self._next_pass = 0.0
        # The worker's, LinkSelection.PODS: the node's pod IPs, which candidates carry one, and when to look again.
        self._pod_ips: frozenset[str] = frozenset()
        self._pod_routes: dict[str, int | None] = {}  # pod IP no candidate's peer holds -> the link it is routed to
        self._carrying: frozenset[int] = frozenset()
        self._recheck_at = math.inf
        self._recheck_delay = RECHECK_FIRST
        # Shared with callers of unlinked(), set_pod_ips() and link_counts(), under the lock:
        self._placed: dict[str, str] = {}  # IP -> name of the attached link whose peer holds it
        self._inherited: dict[int, set[str]] = {}  # attached link adopted from a predecessor's pins -> its pod IPs
        self._routed: dict[str, str | None] = {}  # IP no peer holds -> attached link it is routed to, or None
        self._asked: dict[str, float] = {}  # IP -> when unlinked() was last asked about it (unplaced)
        self._pending: set[str] = set()  # asked about, not resolved yet
        self._resolving = False  # a resolve request is on its way to the worker
        self._resolved_at = 0.0  # monotonic time of the last resolve
        self._offered: frozenset[str] | None = None  # pod IPs given to set_pod_ips, not taken by the worker yet
        self._given = 0  # set_pod_ips() calls so far
        self._taken = 0  # of them, the last the worker took (worker's) ...
        self._acted = 0  # ... and the last whose links it attached and detached (settled())
        self._counts = LinkCounts()
        self._stopping = False
        self._failure: BaseException | None = None
        self._on_failure: list[Callable[[BaseException], None]] = []  # watch()ers, told from the worker
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe already holds a wake: never block a caller on it
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def mode(self) -> AttachMode:
        return self.attacher.mode

    def start(self, timeout: float = 10.0) -> None:
        """Start following link events; returns after the first pass (raises if the worker failed)."""
        if self.attacher.link_pins is not None:
            self.attacher.link_pins.ensure()
        self._thread = threading.Thread(target=self._run, name="podmeter-attach", daemon=True)
        self._thread.start()
        self._wait_for_pass(1, timeout)

    def sync(self, timeout: float = 10.0) -> None:
        """Run a pass now (after whatever changed) and wait for it."""
        with self._lock:
            target = self._passes + 1
        os.write(self._wake_w, b"s")
        self._wait_for_pass(target, timeout)

    async def watch(self) -> None:
        """Wait while the worker runs; raise AttachError once it has died. The agent supervises this (a
        worker that dies after start-up attaches nothing more, and only start() and sync() raised it)."""
        loop = asyncio.get_running_loop()
        died: asyncio.Future[BaseException] = loop.create_future()

        def settle(error: BaseException) -> None:
            if not died.done():
                died.set_result(error)

        def tell(error: BaseException) -> None:  # on the worker thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(settle, error)

        with self._lock:
            failure = self._failure
            if failure is None:
                self._on_failure.append(tell)
        try:
            error = failure if failure is not None else await died
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._on_failure.remove(tell)
        raise AttachError(f"the attach worker died: {type(error).__name__}: {error}") from error

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

    def placed(self) -> dict[str, str]:
        """The addresses the peers of attached links hold: IP -> the attached link's name."""
        with self._lock:
            return dict(self._placed)

    def set_pod_ips(self, ips: Iterable[str]) -> None:
        """The IPs of every pod of this node, the whole set each time (thread-safe, no syscall but a wake).
        With ``LinkSelection.PODS`` the worker then attaches the candidates that carry one of them, and
        detaches those that carry none any more; with ``CANDIDATES`` or name patterns nothing changes."""
        offered = frozenset(ips)
        with self._lock:
            self._offered = offered
            self._given += 1
            if self._by_pods:
                self._wake(b"p")

    def inherited(self, ips: Iterable[str]) -> frozenset[str]:
        """The IPs among ``ips`` whose link was adopted from a predecessor's pins: the same pod's link
        (a pod keeps its sandbox's link for life), so what the predecessor counted for them is that pod's.
        An IP on a link created now may have been another pod's while no agent ran."""
        wanted = set(ips)
        with self._lock:
            return frozenset(ip for carried in self._inherited.values() for ip in carried & wanted)

    def settled(self) -> bool:
        """Whether the worker has acted on the pod IPs last given: the links that carry them attached (or
        their failures in ``errors``), the others detached. Always true when no pod IP is needed
        (``CANDIDATES``, or name patterns)."""
        with self._lock:
            return not self._by_pods or self._acted >= self._given

    def link_counts(self) -> LinkCounts:
        """The links seen (a veth or netkit whose peer is in another netns), how many links the programs
        are attached to, and the links seen that are not attached, by reason (``SKIPPED_*``), as of the
        worker's last pass or change."""
        with self._lock:
            return self._counts

    def unlinked(self, ips: Iterable[str]) -> frozenset[str]:
        """The IPs among ``ips`` that reach no attached link: no attached link's peer holds them, and the
        node does not route them through one. Cheap (no syscall; call it at every scrape): the answer is
        what the worker last found. An IP it has not looked at yet is not in the answer; the worker is
        woken to look (and, if no peer holds it, to read the peers again, at most every
        ``ADDRESS_REFRESH`` seconds), so from the next call on it is. An IP found unlinked is looked at
        again at most every ``ADDRESS_REFRESH`` seconds (its pod's address may have come late)."""
        out: set[str] = set()
        now = time.monotonic()
        with self._lock:
            new = False
            stale = now - self._resolved_at >= ADDRESS_REFRESH
            for ip in ips:
                if ip in self._placed:
                    continue
                self._asked[ip] = now
                verdict = self._routed.get(ip, _UNKNOWN)
                if verdict is None:
                    out.add(ip)
                if (verdict is _UNKNOWN or (verdict is None and stale)) and ip not in self._pending:
                    self._pending.add(ip)
                    new = True
            if new and not self._resolving and self._wake(b"r"):
                self._resolving = True
        return frozenset(out)

    def stop(self, timeout: float = 10.0) -> None:
        """Detach from every interface and stop the worker (idempotent)."""
        if self._closed:
            return
        with self._lock:
            self._stopping = True
        with contextlib.suppress(BlockingIOError):  # full: the worker has wakes to read, and sees _stopping
            os.write(self._wake_w, b"q")
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:  # no _wake() after this: it writes under the lock and checks _closed
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._closed = True

    def __enter__(self) -> AttachManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wake(self, reason: bytes) -> bool:
        """Wake the worker (the lock held): whether it runs to be woken."""
        if self._thread is None or self._stopping or self._closed:
            return False  # before start() the first pass takes what is asked; after stop() nobody will
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, reason)
        return True

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
        except BaseException as error:  # reported to start()/sync() callers and to watch()ers
            log.exception("attach manager stopped")
            self._abandon()
            with self._lock:
                self._failure = error
                self._lock.notify_all()
                told = list(self._on_failure)
            for tell in told:
                tell(error)

    def _abandon(self) -> None:
        """After a failure: close TCX links (a tc filter left behind is replaced by the next start; a pinned
        link is adopted by it)."""
        for index, attachment in list(self._attached.items()):
            with contextlib.suppress(OSError):
                self.attacher.release(attachment)
                if self.attacher.link_pins is None:
                    self.attacher.detach(attachment, exists=False)
            self._forget(index)

    def _detach_all(self) -> None:
        """On stop: detach, except pinned links, which stay attached for the next agent to adopt."""
        if self.attacher.link_pins is not None:
            for index, attachment in list(self._attached.items()):
                self.attacher.release(attachment)
                self._forget(index)
            return
        present = read_links()
        for index, attachment in list(self._attached.items()):
            self.attacher.detach(attachment, exists=index in present)
            self._forget(index)

    def _prune_pins(self) -> None:
        """Unpin (so detach) the pinned links no attachment holds: a predecessor's on links that carry no
        pod any more, or are gone. Not before the node's pods are known: they may be any link's."""
        pins = self.attacher.link_pins
        if pins is None or (self._by_pods and self._taken == 0):
            return
        keep = set().union(*(self.attacher.pin_names(a) for a in self._attached.values()))
        for name in pins.prune(keep):
            log.info("unpinned the link %s: no pod link of this node holds it", name)

    def _wait(self, events: socket.socket) -> None:
        """Sleep until a link changes, a caller wakes the worker, a recheck is due or the resync period
        ends; then converge."""
        timeout = max(0.0, min(self._next_pass, self._recheck_at) - time.monotonic())
        readable, _, _ = select.select([events.fileno(), self._wake_r], [], [], timeout)
        asked = os.read(self._wake_r, 4096) if self._wake_r in readable else b""
        found = read_changes(events) if events.fileno() in readable else []
        if self._stopping:
            return
        if b"s" in asked or found is None or time.monotonic() >= self._next_pass:
            self._full_pass()
            return
        changed = self._take_changes(found)
        read: set[int] = set()
        if self._by_pods:
            offered = b"p" in asked and self._take_offered()
            recheck = time.monotonic() >= self._recheck_at
            if recheck:
                self._pod_routes.clear()  # a route may have come too
            if changed or offered or recheck:
                flipped, read = self._place_pods(changed, widen=offered or recheck,
                                                 reset=offered or self._any_candidate(changed))
                changed |= flipped
        self._converge(changed)
        if b"p" in asked:  # the node's pods may be known now: a predecessor's links they do not need go
            self._prune_pins()
        self._reread_attached(changed & self._attached.keys() - read)
        if b"r" in asked:
            self._resolve(full=False)
        self._publish_counts()

    def _take_changes(self, found: list[LinkChange]) -> set[int]:
        """Apply link notifications to the table; the indexes they name."""
        for change in found:
            if change.link is None:
                self._links.pop(change.index, None)
                self._peers.pop(change.index, None)
            else:
                self._links[change.index] = change.link
        return {change.index for change in found}

    def _reread_attached(self, indexes: set[int]) -> None:
        """An attached link changed (up, renamed...): its peer may have too."""
        if not indexes:
            return
        try:
            with Rtnl() as rtnl:
                self._read_peers(rtnl, indexes)
        except OSError as error:  # placements only: the next pass reads them again
            log.warning("cannot read the peers of changed links: %s", error)
        self._publish_placements()

    def _full_pass(self) -> None:
        self._links = read_links()
        self._peers = {index: ips for index, ips in self._peers.items() if index in self._links}
        if self.rule.detects:
            self._uplinks = self._read_uplinks()
        read: set[int] = set()
        if self._by_pods:
            self._take_offered()
            self._pod_routes.clear()  # routes are not followed: looked up again on every dump
            _, read = self._place_pods(set(self._links), widen=True, reset=False)
        self._converge(set(self._links) | set(self._attached))
        self._prune_pins()
        self._resolve(full=True, fresh=read)
        self._publish_counts()
        wanted = {link.name for index, link in self._links.items() if self._selects(index, link)}
        self._next_pass = time.monotonic() + self.resync_interval
        with self._lock:
            self._errors = {name: e for name, e in self._errors.items() if name in wanted}
            self._passes += 1
            self._lock.notify_all()

    def _read_uplinks(self) -> frozenset[int]:
        try:
            with Rtnl() as rtnl:
                return rtnl.default_route_links()
        except OSError as error:  # keep the last known ones: a pod link is never an uplink
            log.warning("cannot read the default routes: %s", error)
            return self._uplinks

    @property
    def _by_pods(self) -> bool:
        """Whether candidates need a pod IP to be attached (patterns given: nothing is detected)."""
        return self.selection is LinkSelection.PODS and self.rule.detects

    def _gated(self, index: int, link: LinkInfo) -> bool:
        """A candidate that is attached only while it carries a pod IP: found by what it is, not named."""
        return (self._by_pods and link.name not in self.rule.explicit
                and self.rule.selects(link, uplink=index in self._uplinks))

    def _selects(self, index: int, link: LinkInfo) -> bool:
        if not self.rule.selects(link, uplink=index in self._uplinks):
            return False
        return index in self._carrying or not self._gated(index, link)

    def _converge(self, indexes: set[int]) -> None:
        """Attached iff the link exists and the rule selects it, for each of ``indexes``."""
        for index in sorted(indexes):
            link = self._links.get(index)
            selected = link if link is not None and self._selects(index, link) else None
            attachment = self._attached.get(index)
            if attachment is not None and (selected is None or attachment.ifname != selected.name):
                self.attacher.detach(attachment, exists=link is not None)  # gone, renamed or unselected
                self._forget(index)
                attachment = None
            if selected is not None and attachment is None:
                self._attach(index, selected)

    def _attach(self, index: int, link: LinkInfo) -> None:
        try:
            if link.kind == "netkit" and link.netkit_mode == NETKIT_L3:
                raise AttachError(
                    f"{link.name} is a netkit device in L3 mode: its packets carry no Ethernet header, which "
                    "podmeter's programs parse, so nothing would be counted; not attached (netkit in L2 mode "
                    "is supported)")
            attachment = self.attacher.attach(index, link.name)
        except AttachError as error:
            with self._lock:
                self._errors[link.name] = str(error)
            log.warning("%s", error)
            return
        log.info("attached to %s (ifindex %d, %s%s)", link.name, index, attachment.mode.value,
                 ", adopted" if attachment.adopted else "")
        with self._lock:
            if attachment.adopted:
                self._inherited[index] = self._carried(index)
            self._errors.pop(link.name, None)
            self._attached[index] = attachment

    def _carried(self, index: int) -> set[str]:
        """The pod IPs a link carries: its peer's, and those the node routes through it."""
        routed = {ip for ip, oif in self._pod_routes.items() if oif == index}
        return set(self._peers.get(index, frozenset()) & self._pod_ips) | routed

    def _forget(self, index: int) -> None:
        with self._lock:
            attachment = self._attached.pop(index)
            self._inherited.pop(index, None)
            self._routed = {ip: name for ip, name in self._routed.items() if name != attachment.ifname}
        if self._peers.get(index):  # kept: a candidate's peers say whether it carries a pod
            self._publish_placements()
        log.info("detached from %s (ifindex %d)", attachment.ifname, index)

    def _publish_counts(self) -> None:
        """What link_counts() and settled() answer (after each convergence)."""
        skipped: dict[str, int] = {}
        seen = 0
        for index, link in self._links.items():
            if link.peer_elsewhere:
                seen += 1
                reason = self._skipped(index, link)
                if reason is not None:
                    skipped[reason] = skipped.get(reason, 0) + 1
        counts = LinkCounts(seen, len(self._attached), skipped)
        with self._lock:
            self._counts = counts
            self._acted = self._taken

    def _skipped(self, index: int, link: LinkInfo) -> str | None:
        """Why a link seen is not attached (None: it is)."""
        if index in self._attached:
            return None
        if self._selects(index, link):
            return SKIPPED_FAILED
        if self.rule.patterns:
            return SKIPPED_NO_MATCH
        return SKIPPED_UPLINK if index in self._uplinks else SKIPPED_NO_POD

    # --- which candidates carry a pod (LinkSelection.PODS) -------------------------------------

    def _any_candidate(self, indexes: set[int]) -> bool:
        return any(self._gated(index, link) for index in indexes if (link := self._links.get(index)) is not None)

    def _take_offered(self) -> bool:
        """Take the pod IPs set_pod_ips() was last given; whether they differ from the ones in use."""
        with self._lock:
            offered, self._offered = self._offered, None
            self._taken = self._given
        if offered is None or offered == self._pod_ips:
            return False
        self._pod_ips = offered
        self._pod_routes = {ip: oif for ip, oif in self._pod_routes.items() if ip in offered}
        return True

    def _place_pods(self, changed: set[int], widen: bool, reset: bool) -> tuple[set[int], set[int]]:
        """Find the candidates that carry a pod IP (``_carrying``). The peers of the candidates among
        ``changed`` are read again, and with ``widen`` (new pod IPs, a recheck) those of every candidate
        that carries none: its pod's address may have come since. ``reset``: something changed, so a
        recheck, if one is needed, comes soon again. Returns (the candidates whose verdict changed, the
        links whose peers were read)."""
        candidates = {index for index, link in self._links.items() if self._gated(index, link)}
        idle = candidates - self._carrying if widen else set()
        read = {index for index in candidates if index in changed or index in idle or index not in self._peers}
        try:
            with Rtnl() as rtnl:
                self._read_peers(rtnl, read)
                carrying, unplaced = self._carriers(rtnl, candidates)
        except (OSError, ValueError) as error:  # keep the last verdicts; the next pass tries again
            log.warning("cannot tell which links carry this node's pods: %s", error)
            return set(), set()
        flipped = set(carrying ^ self._carrying)
        self._carrying = frozenset(carrying)
        self._schedule_recheck(bool(unplaced) and bool(candidates - carrying), reset)
        return flipped, read

    def _carriers(self, rtnl: Rtnl, candidates: set[int]) -> tuple[set[int], set[str]]:
        """(the candidates whose peer holds a pod IP or that the node routes one through, the pod IPs
        on no candidate)."""
        pods = self._pod_ips
        carrying = {index for index in candidates if not self._peers.get(index, frozenset()).isdisjoint(pods)}
        held = set().union(*(self._peers[index] for index in carrying))
        unplaced: set[str] = set()
        for ip in pods - held:
            if ip not in self._pod_routes:
                self._pod_routes[ip] = rtnl.route_link(ip)
            oif = self._pod_routes[ip]
            if oif in candidates:
                carrying.add(oif)
            else:
                unplaced.add(ip)
        return carrying, unplaced

    def _schedule_recheck(self, needed: bool, reset: bool) -> None:
        """While a pod IP is on no candidate and some candidate carries none, look again: its pod's
        address (or route) may come after its link, with no link event. Soon after a change, then twice
        as late each time, up to ADDRESS_REFRESH (cheap: only the idle candidates are read)."""
        if not needed:
            self._recheck_at, self._recheck_delay = math.inf, RECHECK_FIRST
            return
        now = time.monotonic()
        if reset:
            self._recheck_delay = RECHECK_FIRST
        if reset or self._recheck_at == math.inf or now >= self._recheck_at:
            self._recheck_at = now + self._recheck_delay
            self._recheck_delay = min(2 * self._recheck_delay, ADDRESS_REFRESH)

    # --- which pod a link serves ----------------------------------------------------------------

    def _read_peers(self, rtnl: Rtnl, indexes: Iterable[int]) -> None:
        """Read the addresses of the peers of these links (a pod's own IPs)."""
        for index in indexes:
            link = self._links.get(index)
            if link is None or link.peer_netnsid is None or link.peer_index is None or link.peer_netnsid < 0:
                self._peers[index] = frozenset()
                continue
            try:
                self._peers[index] = rtnl.peer_addresses(link.peer_netnsid, link.peer_index)
            except NetlinkError as error:  # the peer's netns is going away, or a kernel without the filter
                log.debug("reading the peer addresses of %s: %s", link.name, error)
                self._peers[index] = frozenset()

    def _publish_placements(self) -> None:
        placed = {ip: self._attached[index].ifname
                  for index, ips in self._peers.items() if index in self._attached for ip in ips}
        with self._lock:
            self._placed = placed

    def _resolve(self, full: bool, fresh: set[int] | None = None) -> None:
        """Place the IPs unlinked() was asked about: read the peers (on a full pass all but ``fresh``, read
        just now; else those never read or empty, and all if an asked IP is still unplaced and the last
        read is ADDRESS_REFRESH old), then look up the route of every IP still unplaced."""
        now = time.monotonic()
        with self._lock:
            self._resolving = False
            if full:
                self._asked = {ip: t for ip, t in self._asked.items() if now - t < ASKED_FOR}
                targets = set(self._asked) | self._pending
            else:
                targets = set(self._pending)
        try:
            with Rtnl() as rtnl:
                attached = set(self._attached)
                if full:
                    self._read_peers(rtnl, attached - (fresh or set()))
                    self._peers_read = now
                else:
                    self._read_peers(rtnl, {i for i in attached if not self._peers.get(i)})
                    held = {ip for i in attached for ip in self._peers.get(i, ())}
                    if targets - held and now - self._peers_read >= ADDRESS_REFRESH:
                        self._read_peers(rtnl, attached)
                        self._peers_read = now
                self._publish_placements()
                held = {ip for index, ips in self._peers.items() if index in self._attached for ip in ips}
                routed: dict[str, str | None] = {}
                for ip in targets - held:
                    oif = rtnl.route_link(ip)
                    attachment = self._attached.get(oif) if oif is not None else None
                    routed[ip] = attachment.ifname if attachment is not None else None
        except (OSError, ValueError) as error:  # report what is known; the next pass tries again
            log.warning("cannot tell which links the pods' IPs reach: %s", error)
            return
        with self._lock:
            if full:
                self._routed = routed
            else:
                self._routed.update(routed)
            self._pending -= targets
            self._resolved_at = time.monotonic()

    def _wait_for_pass(self, target: int, timeout: float) -> None:
        with self._lock:
            done = self._lock.wait_for(lambda: self._passes >= target or self._failure is not None, timeout)
            if self._failure is not None:
                raise AttachError(f"the attach manager failed: {self._failure}") from self._failure
            if not done:
                raise AttachError(f"the attach manager did not complete a pass within {timeout} s")


def _has_legacy_ingress_qdisc(ifindex: int) -> bool:
    with Rtnl() as rtnl:  # in the calling thread's netns: the worker's
        return "ingress" in rtnl.qdisc_kinds(ifindex)
