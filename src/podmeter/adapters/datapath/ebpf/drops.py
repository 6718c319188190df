"""Drops and TCP health from the kernel's BTF tracepoints: loading, attaching, draining ``podmeter_drops.bpf.o``.

:meth:`DropTracer.open` takes the agent's ``filter`` map (the one the TC programs read, pinned under
``--bpffs``) and loads the tracing object against it (``bpf_map__reuse_fd``), so the drop programs observe
exactly the IPs the agent observes. The agent drains its maps every flow interval.

With ``pins`` (the agent: ``<--bpffs>/drops``) the maps and the tracepoint links are pinned, so they outlive
the process, SIGKILL included, and the programs go on counting while no agent runs. A successor reuses each
pinned map whose layout and size match (else a new one, said in the log), and **adopts** each pinned link
that runs the very program it would attach (same name, instructions and maps: ``link_pins.TracingPins``),
else replaces it: no gap, and never two links of one hook counting into the same maps. What the maps held
when it started is a predecessor's: :attr:`DropTracer.inherited`, credited to pods by the agent only where
the pinned ``owners`` record (:class:`OwnerRecord`) shows that the IP kept its owner. Without ``pins``
(tests, benchmarks) maps and links live as long as the process holds them.

Hooks (``tp_btf``: BTF-typed raw tracepoints, see docs/drops.md for why these):

==========================  =============================================  ==========================
tracepoint                  program                                        counts
==========================  =============================================  ==========================
``skb:kfree_skb``           ``pm_kfree_skb``                               drops (address, direction,
                                                                           reason) and dropped flows
``tcp:tcp_retransmit_skb``  ``pm_tcp_retransmit`` (``_noerr`` if the        retransmits (local address;
                            tracepoint has no ``err`` argument)            per connection too)
``tcp:tcp_send_reset``      ``pm_tcp_send_reset``                          resets sent
``tcp:tcp_receive_reset``   ``pm_tcp_receive_reset``                       resets received
==========================  =============================================  ==========================

Each hook is checked in the running kernel's BTF first (``btf_trace_<name>``, what libbpf resolves the
program against) and left out, with a notice, if it is missing; drop reasons are named from BTF
(``enum skb_drop_reason``), never from a table in this source. Without readable BTF nothing is loaded:
:class:`DropsUnavailable` says why, and the agent runs without drop metrics.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podmeter.adapters.datapath.ebpf import btf, layout, preflight
from podmeter.adapters.datapath.ebpf.errors import DatapathSetupError
from podmeter.adapters.datapath.ebpf.libbpf import BpfCallError, Libbpf, libbpf
from podmeter.adapters.datapath.ebpf.link_pins import PinnedTracing, TracingPins, program_identity
from podmeter.adapters.datapath.ebpf.loader import BpfObject, Program
from podmeter.adapters.datapath.ebpf.maps import BATCH_UNSUPPORTED, BpfMap, MapShape
from podmeter.adapters.datapath.ebpf.pins import PinDir
from podmeter.model.datapath import Direction
from podmeter.model.drops import (
    HOOK_DROPS,
    HOOK_RESETS_RECEIVED,
    HOOK_RESETS_SENT,
    HOOK_RETRANSMITS,
    HOOKS,
    ConnectionKey,
    DropDrain,
    DropFlowKey,
    DropKey,
    TcpEvent,
)
from podmeter.model.flows import FlowCounts

log = logging.getLogger("podmeter.datapath.drops")

OBJECT_NAME = "podmeter_drops.bpf.o"
FILTER_MAP = "filter"
DROPS_MAP, DROP_FLOWS_MAP, TCP_MAP, TCP_FLOWS_MAP, LOST_MAP = "drops", "drop_flows", "tcp", "tcp_flows", "drops_lost"
DRAINED_MAPS = (DROPS_MAP, DROP_FLOWS_MAP, TCP_MAP, TCP_FLOWS_MAP)
LOST_SLOTS = DRAINED_MAPS  # drops_lost slot i counts events that found DRAINED_MAPS[i] full
PINNED_MAPS = (*DRAINED_MAPS, LOST_MAP)  # the object's own maps (the filter is the agent's, pinned apart)
PIN_DIR = "drops"  # inside the agent's pin directory: the maps, links/<hook>, programs/<hook>, owners
OWNERS_MAP = "owners"  # not the object's: written by the agent (OwnerRecord)
DEFAULT_DROP_SIZE = 16384
MAX_DROP_SIZE = 1 << 22

REASON_ENUM = "skb_drop_reason"
SUBSYSTEM_ENUM = "skb_drop_reason_subsys"
REASON_PREFIX = "SKB_DROP_REASON_"
SUBSYSTEM_PREFIX = "SKB_DROP_REASON_SUBSYS_"
SUBSYSTEM_SHIFT = 16  # a reason's high 16 bits name its subsystem (0: the core enum)
CAP_PERFMON = 38

# hook -> (tracepoint group, programs by the least number of tracepoint arguments they read)
_PROGRAMS: dict[str, tuple[str, tuple[tuple[int, str], ...]]] = {
    HOOK_DROPS: ("skb", ((3, "pm_kfree_skb"),)),
    HOOK_RETRANSMITS: ("tcp", ((3, "pm_tcp_retransmit"), (1, "pm_tcp_retransmit_noerr"))),
    HOOK_RESETS_SENT: ("tcp", ((2, "pm_tcp_send_reset"),)),
    HOOK_RESETS_RECEIVED: ("tcp", ((1, "pm_tcp_receive_reset"),)),
}
ALL_PROGRAMS = tuple(name for _, programs in _PROGRAMS.values() for _, name in programs)

# Layouts (bpf/podmeter_drops.bpf.c; docs/drops.md).
DROP_KEY = struct.Struct(f"={layout.ADDRESS_BYTES}sIB3x")  # addr, reason, direction: 24 bytes
DROP_VALUE = struct.Struct("=QQ")  # packets, bytes
DROP_FLOW_KEY = struct.Struct(f"={layout.ADDRESS_BYTES}s{layout.ADDRESS_BYTES}sHHBB2xI")  # 44 bytes
DROP_FLOW_VALUE = layout.FLOW_VALUE  # packets, bytes, first_ns, last_ns, tcp_flags: 40 bytes
TCP_KEY = struct.Struct(f"={layout.ADDRESS_BYTES}sI")  # local addr, event: 20 bytes
TCP_FLOW_KEY = struct.Struct(f"={layout.ADDRESS_BYTES}s{layout.ADDRESS_BYTES}sHH")  # 36 bytes
COUNT = struct.Struct("=Q")
OBSERVED_SRC, OBSERVED_DST = 1, 2
DIRECTION_CODES = {Direction.INGRESS: 0, Direction.EGRESS: 1}
_DIRECTIONS = {code: direction for direction, code in DIRECTION_CODES.items()}
TCP_EVENT_CODES = {TcpEvent.RETRANSMIT: 0, TcpEvent.RESET_SENT: 1, TcpEvent.RESET_RECEIVED: 2}
_TCP_EVENTS = {code: event for event, code in TCP_EVENT_CODES.items()}


class DropsUnavailable(DatapathSetupError):
    """Drop and TCP tracing cannot run on this kernel; ``str(error)`` says why. Not fatal to the agent."""


def check_tracing_privileges(caps: int | None = None) -> None:
    """Tracing programs load only with CAP_PERFMON (or CAP_SYS_ADMIN) besides CAP_BPF: say so, rather
    than let the load fail with a bare EPERM."""
    mask = preflight.effective_capabilities() if caps is None else caps
    if not mask & (1 << CAP_PERFMON | 1 << preflight.CAP_SYS_ADMIN):
        raise DropsUnavailable(
            "tracing programs need CAP_PERFMON (or CAP_SYS_ADMIN) besides CAP_BPF, and this process has "
            "neither: drops and TCP health are off (in the DaemonSet: add the deploy/components/perfmon "
            "component)")


class DropReasons:
    """Drop reason numbers -> names, as the running kernel's BTF has them: ``SKB_DROP_REASON_NETFILTER_DROP``
    is ``NETFILTER_DROP``. A reason of another subsystem (high 16 bits) is ``<SUBSYSTEM>_<code>``
    (``OPENVSWITCH_3``); a number BTF does not have is ``UNKNOWN_<number>``."""

    def __init__(self, reasons: Mapping[str, int], subsystems: Mapping[str, int] | None = None) -> None:
        self.names: dict[int, str] = {}
        for name, value in reasons.items():
            short = name.removeprefix(REASON_PREFIX) if name.startswith(REASON_PREFIX) else name.removeprefix("SKB_")
            self.names.setdefault(value, short)
        self.subsystems = {value: name.removeprefix(SUBSYSTEM_PREFIX) for name, value in (subsystems or {}).items()}

    def __len__(self) -> int:
        return len(self.names)

    def name(self, code: int) -> str:
        found = self.names.get(code)
        if found is not None:
            return found
        subsystem = code >> SUBSYSTEM_SHIFT
        if subsystem and subsystem in self.subsystems:
            return f"{self.subsystems[subsystem]}_{code & 0xFFFF}"
        return f"UNKNOWN_{code}"

    @classmethod
    def from_btf(cls, kernel: btf.KernelBtf) -> DropReasons:
        return cls(kernel.enum(REASON_ENUM), kernel.enum(SUBSYSTEM_ENUM))


def read_reasons(path: str | os.PathLike[str] = btf.VMLINUX) -> DropReasons:
    """The running kernel's drop reasons (raises OSError / BtfError)."""
    return DropReasons.from_btf(btf.read_kernel_btf(path, enums=(REASON_ENUM, SUBSYSTEM_ENUM)))


@dataclass(frozen=True)
class Plan:
    """What to load: the program of each hook this kernel has, and a notice for each it has not."""

    programs: dict[str, str]  # hook -> program
    tracepoints: dict[str, str]  # hook -> the tracepoint it attaches to
    notices: list[str]


def plan(kernel: btf.KernelBtf, tracepoints: Mapping[str, str]) -> Plan:
    """Choose a program per hook from the tracepoints (and their arguments) the kernel's BTF has."""
    programs: dict[str, str] = {}
    names: dict[str, str] = {}
    notices: list[str] = []
    for hook in HOOKS:
        group, choices = _PROGRAMS[hook]
        name = tracepoints.get(hook, hook)
        what = "drops" if hook == HOOK_DROPS else _WHAT[hook]
        arguments = kernel.tracepoints.get(name)
        if arguments is None:
            notices.append(f"tracepoint {group}:{name} is not in this kernel (no btf_trace_{name} in its BTF): "
                           f"{what} are not counted")
            continue
        if hook == HOOK_DROPS and not kernel.enum(REASON_ENUM):
            notices.append(f"this kernel's BTF has no enum {REASON_ENUM} (drop reasons came with Linux 5.17): "
                           "drops are not counted")
            continue
        program = next((program for least, program in choices if arguments >= least), None)
        if program is None:
            notices.append(f"tracepoint {group}:{name} has {arguments} arguments, fewer than podmeter reads: "
                           f"{what} are not counted")
            continue
        programs[hook], names[hook] = program, name
    return Plan(programs, names, notices)


_WHAT = {HOOK_RETRANSMITS: "TCP retransmits", HOOK_RESETS_SENT: "TCP resets sent",
         HOOK_RESETS_RECEIVED: "TCP resets received"}


class _TracingObject(BpfObject):
    """The libbpf object, with the calls tracing programs need that the TC loader does not."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        _bind_tracing(self._lib)

    def _program(self, name: str) -> int:
        handle = self._lib.lib.bpf_object__find_program_by_name(self._obj, name.encode())
        if not handle:
            raise DropsUnavailable(f"{self.path} has no program {name!r}: rebuild it with `make bpf`")
        return int(handle)

    def set_autoload(self, name: str, autoload: bool) -> None:
        self._lib.call("bpf_program__set_autoload", self._program(name), autoload)

    def set_attach_target(self, name: str, tracepoint: str) -> None:
        self._lib.call("bpf_program__set_attach_target", self._program(name), 0, tracepoint.encode())


def _bind_tracing(lib: Libbpf) -> None:
    """Signatures of the libbpf calls used here only (libbpf.py binds the datapath's)."""
    for name, restype, argtypes in (
        ("bpf_program__set_autoload", ctypes.c_int, [ctypes.c_void_p, ctypes.c_bool]),
        ("bpf_program__set_attach_target", ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p]),
        ("bpf_raw_tracepoint_open", ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]),
        ("bpf_map_create", ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32,
                                          ctypes.c_uint32, ctypes.c_void_p]),
    ):
        function = getattr(lib.lib, name)
        function.restype, function.argtypes = restype, argtypes


# --- the owners record ---------------------------------------------------------------------------------------

BPF_MAP_TYPE_HASH = 1
BPF_F_NO_PREALLOC = 1
OWNER_DIGEST_BYTES = 16


class _MapCreateOpts(ctypes.Structure):
    """``struct bpf_map_create_opts`` as libbpf 1.x has it (only ``sz`` and ``map_flags`` are set)."""

    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("btf_fd", ctypes.c_uint32),
        ("btf_key_type_id", ctypes.c_uint32),
        ("btf_value_type_id", ctypes.c_uint32),
        ("btf_vmlinux_value_type_id", ctypes.c_uint32),
        ("inner_map_fd", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("map_extra", ctypes.c_uint64),
        ("numa_node", ctypes.c_uint32),
        ("map_ifindex", ctypes.c_uint32),
    ]


def owner_digest(uid: str) -> bytes:
    """16 bytes naming a pod by its UID (a pod's IPs never change while it lives, so one UID holding an IP
    at two moments held it all along)."""
    return hashlib.blake2b(uid.encode(), digest_size=OWNER_DIGEST_BYTES).digest()


def owners_shape(capacity: int) -> MapShape:
    return MapShape(BPF_MAP_TYPE_HASH, layout.ADDRESS_BYTES, OWNER_DIGEST_BYTES, BPF_F_NO_PREALLOC, capacity)


class OwnerRecord:
    """Who owned each observed IP at the agent's last drain, pinned as ``drops/owners`` for its successor.

    A map no program reads: key the IP (16 bytes, as in ``filter``), value :func:`owner_digest` of the
    owning pod's UID. The agent drains at every change of hands, so what the drop maps hold for an IP
    since the last drain was counted while the recorded owner held it. A successor credits what it
    inherited for an IP only if the pod that holds the IP now is the one recorded
    (:meth:`held_throughout`): that pod held the IP all along, the gap included. An IP without a record,
    or with another owner's, was given to someone else meanwhile (or nobody knows): node totals only.
    ``HASH`` without preallocation: memory follows the IPs recorded.
    """

    def __init__(self, bpf_map: BpfMap) -> None:
        self.map = bpf_map
        self.recorded: dict[bytes, bytes] = dict(bpf_map.collect_items())  # what the map holds
        self._written: dict[str, str] = {}  # the owners last written, IP -> UID (digests cost ~1 us each)

    @classmethod
    def open(cls, pins: PinDir, capacity: int) -> OwnerRecord:
        """The pinned record, or a new one (pinned) when there is none or it has another layout or size
        (then what fits is copied)."""
        wanted = owners_shape(capacity)
        items: list[tuple[bytes, bytes]] = []
        if pins.has(OWNERS_MAP):
            pinned = pins.open(OWNERS_MAP)
            if pinned.shape == wanted:
                return cls(pinned)
            with contextlib.closing(pinned):
                if pinned.shape.compatible(wanted):
                    items = pinned.collect_items()
                else:
                    log.warning("pinned map %s/%s (%s) is not an owners record: replaced by a new one",
                                pins.path.name, OWNERS_MAP, _shape_text(pinned.shape))
        created = create_map(OWNERS_MAP, wanted)
        try:
            if items:
                copied = created.update_batch([k for k, _ in items], [v for _, v in items]).applied
                if copied < len(items):
                    log.warning("owners record resized to %d entries: %d of %d records kept", capacity,
                                copied, len(items))
            pins.install(created, OWNERS_MAP)
        except BaseException:
            created.close()
            raise
        return cls(created)

    def held_throughout(self, owners: Mapping[str, str]) -> frozenset[str]:
        """The IPs of ``owners`` (IP -> UID) whose recorded owner is that pod."""
        recorded = self.recorded
        return frozenset(ip for ip, uid in owners.items()
                         if recorded.get(layout.address_bytes(ip)) == owner_digest(uid))

    def write(self, owners: Mapping[str, str]) -> None:
        """Make the record ``owners`` (IP -> UID): only what changed is written. A failed write leaves the
        record as the kernel has it (re-read): never more than was true."""
        if owners == self._written:
            return
        old, recorded = self._written, self.recorded
        failure: Exception | None
        try:
            keep = {layout.address_bytes(ip) for ip in owners}
            gone = [key for key in recorded if key not in keep]
            changed = [(key, digest) for key, digest in (
                (layout.address_bytes(ip), owner_digest(uid)) for ip, uid in owners.items() if old.get(ip) != uid)
                if recorded.get(key) != digest]
            deleted = self.map.delete_batch(gone)
            written = self.map.update_batch([k for k, _ in changed], [v for _, v in changed])
            failure = deleted.error or written.error
        except (BpfCallError, ValueError) as error:
            failure = error
        if failure is not None:
            log.warning("writing the owners record failed (%s): a successor credits the IPs it lacks to no pod",
                        failure)
            self.recorded = dict(self.map.collect_items())
            self._written = {}
            return
        for key in gone:
            del self.recorded[key]
        self.recorded.update(changed)
        self._written = dict(owners)

    def close(self) -> None:
        self.map.close()


def create_map(name: str, shape: MapShape) -> BpfMap:
    lib = libbpf()
    _bind_tracing(lib)
    opts = _MapCreateOpts(sz=ctypes.sizeof(_MapCreateOpts), map_flags=shape.map_flags)
    fd = lib.call("bpf_map_create", shape.type, name.encode(), shape.key_size, shape.value_size,
                  shape.max_entries, ctypes.byref(opts))
    try:
        return BpfMap(fd, name, lib)
    except BaseException:
        os.close(fd)
        raise


def remove_pins(path: str | os.PathLike[str]) -> bool:
    """Unpin every map, link and program of the drop tracer under ``path`` (``<--bpffs>/drops``): the links
    detach and the maps go once no process holds them. Whether there was anything."""
    if not os.path.lexists(path):
        return False
    shutil.rmtree(path)
    return True


# --- the tracer ------------------------------------------------------------------------------------------------


class DropTracer:
    """The loaded drop and TCP programs, their links and maps: the agent's ``DropSource``.

    Calls may come from the writer task (:meth:`drain_drops`, :meth:`record_owners`) and a scrape
    (:meth:`drops_lost`, :attr:`hooks`) on other threads: each is a self-contained sequence of map
    syscalls. :meth:`close` comes last; it detaches everything, except what is pinned (``pins``), which
    stays attached and counting for the next agent.
    """

    def __init__(self, maps: dict[str, BpfMap], programs: dict[str, Program], links: dict[str, int],
                 reasons: DropReasons, notices: list[str], *, owners: OwnerRecord | None = None,
                 inherited: bool = False, pinned: bool = False) -> None:
        self.maps = maps
        self.programs = programs  # by hook (an adopted link's: the program pinned beside it)
        self.links = links  # hook -> link fd (closing it detaches, unless pinned)
        self.reasons = reasons
        self.notices = notices
        self.owners = owners
        self.pinned = pinned
        # The drained maps were a predecessor's (reused from their pins): what they hold now was counted
        # before this agent knew who owned the IPs.
        self.inherited = inherited
        self.adopted: set[str] = set()  # hooks whose pinned link was adopted, not attached anew

    @classmethod
    def open(
        cls,
        filter_map: BpfMap | None,
        size: int = DEFAULT_DROP_SIZE,
        *,
        pins: str | os.PathLike[str] | None = None,
        btf_path: str | os.PathLike[str] = btf.VMLINUX,
        tracepoints: Mapping[str, str] | None = None,
        object_path: Path | None = None,
    ) -> DropTracer:
        """Load and attach against ``filter_map``; ``size`` is ``max_entries`` of each drained map.
        ``filter_map`` None: the object's own empty filter of ``size`` entries, in ``maps["filter"]``
        (benchmarks).

        ``pins``: a directory (in a bpffs, inside the pin directory whose lock the caller holds) where
        the maps, the links and their programs are pinned, reused and adopted (see the module's
        docstring); None: nothing is pinned. ``tracepoints`` renames hooks (tests: a tracepoint this
        kernel lacks). Raises :class:`DropsUnavailable` when nothing can be traced (no BTF, no hook, the
        verifier refused); a hook that is missing alone is left out and named in :attr:`notices`.
        """
        if not 1 <= size <= MAX_DROP_SIZE:
            raise ValueError(f"the drop map size must be between 1 and {MAX_DROP_SIZE}, not {size}")
        check_tracing_privileges()
        try:
            kernel = btf.read_kernel_btf(btf_path, enums=(REASON_ENUM, SUBSYSTEM_ENUM),
                                         tracepoints=[(tracepoints or {}).get(h, h) for h in HOOKS])
        except (OSError, btf.BtfError) as error:
            raise DropsUnavailable(
                f"cannot read the kernel's BTF at {btf_path} ({error}): the drop programs are typed and their "
                "reasons named from it, so drops and TCP health are off (a kernel built with "
                "CONFIG_DEBUG_INFO_BTF=y has it)") from error
        chosen = plan(kernel, tracepoints or {})
        if not chosen.programs:
            raise DropsUnavailable("; ".join(chosen.notices) or "no hook to attach")
        path = object_path or preflight.object_path(OBJECT_NAME)
        pin_dir = tracing = None
        try:
            if pins is not None:
                pin_dir, tracing = PinDir(pins), TracingPins(pins)
                pin_dir.ensure()
                tracing.ensure()
                for name in (*pin_dir.remove_leftovers(), *tracing.remove_leftovers()):
                    log.warning("removed %s/%s left by an interrupted pin", pin_dir.path.name, name)
            maps, programs, reused = _load(path, filter_map, size, chosen, pin_dir)
        except DropsUnavailable:
            raise
        except (DatapathSetupError, OSError) as error:  # BpfCallError is an OSError
            raise DropsUnavailable(f"loading {path.name} failed, drops and TCP health are off: {error}") from error
        tracer = cls(maps, programs, {}, DropReasons.from_btf(kernel), list(chosen.notices),
                     inherited=reused, pinned=pin_dir is not None)
        try:
            if pin_dir is not None:
                capacity = (filter_map or maps[FILTER_MAP]).shape.max_entries
                tracer.owners = OwnerRecord.open(pin_dir, capacity)
            tracer._attach(chosen.tracepoints, tracing)
            if tracing is not None:
                for hook in tracing.prune(set(tracer.links)):
                    log.info("pinned tracing link of %s removed: it is not traced any more", hook)
        except OSError as error:
            tracer.close()
            raise DropsUnavailable(f"attaching the drop programs failed, drops and TCP health are off: {error}") \
                from error
        except BaseException:
            tracer.close()
            raise
        if not tracer.links:
            tracer.close()
            raise DropsUnavailable("; ".join(tracer.notices))
        return tracer

    # --- the DropSource protocol ----------------------------------------------------------------

    @property
    def hooks(self) -> dict[str, bool]:
        return {hook: hook in self.links for hook in HOOKS}

    def drain_drops(self) -> DropDrain:
        """Read and delete every entry of the four drained maps (batched lookup-and-delete, else key by
        key). An error on one map leaves its rest for the next drain (logged); the others are drained."""
        reasons = self.reasons.name
        texts = layout.AddressTexts()
        taken = [
            (DropKey(texts[addr], _DIRECTIONS[direction], reasons(reason)), packets, size)
            for (addr, reason, direction), (packets, size) in self._take(DROPS_MAP, DROP_KEY, DROP_VALUE)
            if direction in _DIRECTIONS
        ]
        flows = [
            (DropFlowKey(texts[src], texts[dst], sport, dport, protocol, bool(observed & OBSERVED_SRC),
                         bool(observed & OBSERVED_DST), reasons(reason)), FlowCounts(*value))
            for (src, dst, sport, dport, protocol, observed, reason), value in self._take(
                DROP_FLOWS_MAP, DROP_FLOW_KEY, DROP_FLOW_VALUE)
        ]
        tcp = [((texts[addr], _TCP_EVENTS[event]), count)
               for (addr, event), (count,) in self._take(TCP_MAP, TCP_KEY, COUNT) if event in _TCP_EVENTS]
        retransmits = [(ConnectionKey(texts[src], texts[dst], sport, dport), count)
                       for (src, dst, sport, dport), (count,) in self._take(TCP_FLOWS_MAP, TCP_FLOW_KEY, COUNT)]
        return DropDrain([(key, packets) for key, packets, _ in taken], flows, tcp, retransmits,
                         [(key, size) for key, _, size in taken])

    def drops_lost(self) -> dict[str, int]:
        """Events that found each drained map full, since the maps were created (summed over CPUs; pinned
        maps: since the first agent that created them)."""
        lost_map = self.maps[LOST_MAP]
        out = {}
        for slot, name in enumerate(LOST_SLOTS):
            raw = lost_map.lookup(struct.pack("=I", slot))
            out[name] = 0 if raw is None else sum(memoryview(raw).cast("Q"))
        return out

    # --- across restarts (runtime.drop_drain) ---------------------------------------------------

    def held_throughout(self, owners: Mapping[str, str]) -> frozenset[str]:
        """The IPs of ``owners`` (IP -> pod UID) that the predecessor recorded with that same owner: what
        it left in the maps for them is that pod's. None recorded (no pins): none."""
        return self.owners.held_throughout(owners) if self.owners is not None else frozenset()

    def record_owners(self, owners: Mapping[str, str]) -> None:
        """The owners as of the drain just made (IP -> pod UID), for a successor (no pins: nothing)."""
        if self.owners is not None:
            self.owners.write(owners)

    # --- reading without draining (tests, inspection) -------------------------------------------

    def entries(self, name: str) -> list[tuple[bytes, bytes]]:
        """The raw entries of one map, left in place."""
        return self.maps[name].collect_items()

    def close(self) -> None:
        """Close the links (detaching those not pinned), then programs and maps (pinned ones stay)."""
        for fd in self.links.values():
            os.close(fd)
        self.links = {}
        for program in self.programs.values():
            program.close()
        for bpf_map in self.maps.values():
            bpf_map.close()
        if self.owners is not None:
            self.owners.close()

    def __enter__(self) -> DropTracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------------

    def _attach(self, tracepoints: Mapping[str, str], pins: TracingPins | None) -> None:
        """Attach each loaded program to its tracepoint; with ``pins``, adopt the link pinned for its hook
        instead when it runs this very program on these maps, else replace it."""
        ours = frozenset(self.maps[name].id for name in PINNED_MAPS)
        for hook, program in list(self.programs.items()):
            old = pins.find(hook) if pins is not None else None
            if old is not None:
                identity = program_identity(program.fd)
                if old.tracepoint == tracepoints[hook] and old.program is not None \
                        and old.program.same_program(identity):
                    self.links[hook] = old.link_fd
                    self.programs[hook] = Program(old.program_fd, program.name)
                    program.close()
                    self.adopted.add(hook)
                    log.info("tracing link of %s adopted from its pin (program %s, id %d)", hook, program.name,
                             old.program.id)
                    continue
                # One that counts into these maps goes before ours comes (no drop counted twice); one that
                # counts elsewhere after (no drop missed).
                counts_here = old.program is None or bool(old.program.map_ids & ours)
                log.warning("pinned tracing link of %s replaced: %s", hook,
                            _mismatch(old, tracepoints[hook], identity))
                if counts_here:
                    assert pins is not None
                    pins.unpin(hook)
                    old.close()
            fd = libbpf().lib.bpf_raw_tracepoint_open(None, program.fd)
            if fd < 0:
                self.notices.append(f"attaching {program.name} to {tracepoints[hook]} failed "
                                    f"({os.strerror(-fd)}): {hook} is not traced")
                if old is not None:
                    old.close()
                continue
            self.links[hook] = fd
            try:
                if pins is not None:
                    pins.pin(hook, fd, program.fd)
            finally:
                if old is not None:
                    old.close()  # its pin was replaced: it detaches now

    def _take(self, name: str, key: struct.Struct,
              value: struct.Struct) -> Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]]:
        bpf_map = self.maps[name]
        try:
            chunks = [(bytes(k[: n * key.size]), bytes(v[: n * value.size])) for k, v, n in bpf_map.take_batches()]
        except BpfCallError as error:
            if error.errno not in BATCH_UNSUPPORTED:
                log.warning("draining %s stopped (%s); the rest waits for the next drain", name, error)
                return
            items = bpf_map.take_each()
            chunks = [(b"".join(k for k, _ in items), b"".join(v for _, v in items))]
        for keys, values in chunks:
            yield from zip(key.iter_unpack(keys), value.iter_unpack(values), strict=True)


def _mismatch(old: PinnedTracing, tracepoint: str, ours: Any) -> str:
    if old.tracepoint != tracepoint:
        return f"it is attached to {old.tracepoint or 'another hook'}, not {tracepoint}"
    if old.program is None:
        return "the program it runs is not the one pinned beside it"
    if old.program.name != ours.name or old.program.tag != ours.tag:
        return (f"it runs another program ({old.program.name}, tag {old.program.tag.hex()}; this agent's: "
                f"{ours.name}, tag {ours.tag.hex()})")
    return "its program counts into other maps (they were replaced)"


def _load(path: Path, filter_map: BpfMap | None, size: int, chosen: Plan,
          pins: PinDir | None) -> tuple[dict[str, BpfMap], dict[str, Program], bool]:
    """Load the chosen programs; with ``pins``, against the pinned maps that match (layout and size),
    pinning the others (replacing a pin that does not match, said in the log). Returns the maps, the
    programs, and whether the drained maps were reused (a predecessor's entries are in them)."""
    obj = _TracingObject(path)
    old: dict[str, BpfMap] = {}
    try:
        wanted = set(chosen.programs.values())
        for name in ALL_PROGRAMS:
            obj.set_autoload(name, name in wanted)
        for hook, program in chosen.programs.items():
            obj.set_attach_target(program, chosen.tracepoints[hook])
        if filter_map is not None:
            obj.reuse(FILTER_MAP, filter_map)
        else:
            obj.set_max_entries(FILTER_MAP, size)
        for name in DRAINED_MAPS:
            obj.set_max_entries(name, size)
        reused = _reuse_pinned(obj, pins, old) if pins is not None else set()
        obj.load()
        maps: dict[str, BpfMap] = {}
        programs: dict[str, Program] = {}
        try:
            for name in (*PINNED_MAPS, *(() if filter_map is not None else (FILTER_MAP,))):
                maps[name] = obj.take_map(name)
            for hook, program in chosen.programs.items():
                programs[hook] = obj.take_program(program)
            if pins is not None:
                _pin_new(pins, maps, old, reused)
        except BaseException:
            for bpf_map in maps.values():
                bpf_map.close()
            for taken in programs.values():
                taken.close()
            raise
        return maps, programs, bool(reused & set(DRAINED_MAPS))
    finally:
        obj.close()
        for bpf_map in old.values():
            bpf_map.close()


def _reuse_pinned(obj: BpfObject, pins: PinDir, old: dict[str, BpfMap]) -> set[str]:
    """Load against each pinned map of the layout and size the object declares; fill ``old`` with the
    pins found. The names reused."""
    reused = set()
    for name in PINNED_MAPS:
        if not pins.has(name):
            continue
        try:
            pinned = old[name] = pins.open(name)
        except BpfCallError as error:  # not a map: replaced below
            log.warning("pinned %s/%s cannot be opened as a map (%s): replaced", pins.path.name, name, error)
            continue
        if pinned.shape == obj.map_shape(name):
            obj.reuse(name, pinned)
            reused.add(name)
    return reused


def _pin_new(pins: PinDir, maps: dict[str, BpfMap], old: dict[str, BpfMap], reused: set[str]) -> None:
    for name in PINNED_MAPS:
        if name in reused:
            continue
        if name in old:
            log.warning("pinned map %s/%s (%s) does not match this agent's (%s): replaced by a new one, its %s "
                        "undrained entries are lost", pins.path.name, name, _shape_text(old[name].shape),
                        _shape_text(maps[name].shape), _count(old[name]))
        elif pins.has(name):
            log.warning("pinned %s/%s is not a map: replaced by a new one", pins.path.name, name)
        pins.install(maps[name], name)


def _shape_text(shape: MapShape) -> str:
    return (f"type {shape.type}, key {shape.key_size} B, value {shape.value_size} B, flags {shape.map_flags:#x}, "
            f"{shape.max_entries} entries")


def _count(bpf_map: BpfMap) -> str:
    try:
        return str(len(bpf_map.collect_keys()))
    except BpfCallError:  # counting is only for the log line
        return "undrained"


def attach_program(path: Path, program: str, tracepoint: str) -> tuple[Program, int]:
    """Load one tracing program of the object at ``path`` (every other one left out) and attach it to the
    BTF tracepoint ``tracepoint``: (the program, its link fd; closing both detaches). For benchmarks."""
    obj = _TracingObject(path)
    try:
        obj.set_attach_target(program, tracepoint)
        obj.load()
        taken = obj.take_program(program)
    finally:
        obj.close()
    fd = libbpf().lib.bpf_raw_tracepoint_open(None, taken.fd)
    if fd < 0:
        taken.close()
        raise BpfCallError("bpf_raw_tracepoint_open", -fd)
    return taken, fd
