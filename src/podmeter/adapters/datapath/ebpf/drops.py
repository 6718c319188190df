"""Drops and TCP health from the kernel's BTF tracepoints: loading, attaching, draining ``podmeter_drops.bpf.o``.

:meth:`DropTracer.open` takes the agent's ``filter`` map (the one the TC programs read, pinned under
``--bpffs``) and loads the tracing object against it (``bpf_map__reuse_fd``), so the drop programs observe
exactly the IPs the agent observes. Its own maps are not pinned: they live as long as the agent holds
them, like the tracepoint links, and the agent drains them every flow interval.

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

import ctypes
import logging
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podmeter.adapters.datapath.ebpf import btf, layout, preflight
from podmeter.adapters.datapath.ebpf.errors import DatapathSetupError
from podmeter.adapters.datapath.ebpf.libbpf import BpfCallError, Libbpf, libbpf
from podmeter.adapters.datapath.ebpf.loader import BpfObject, Program
from podmeter.adapters.datapath.ebpf.maps import BATCH_UNSUPPORTED, BpfMap
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
    ):
        function = getattr(lib.lib, name)
        function.restype, function.argtypes = restype, argtypes


class DropTracer:
    """The loaded drop and TCP programs, their links and maps: the agent's ``DropSource``.

    Calls may come from the writer task (:meth:`drain_drops`) and a scrape (:meth:`drops_lost`,
    :attr:`hooks`) on other threads: each is a self-contained sequence of map syscalls. :meth:`close`
    comes last and detaches everything.
    """

    def __init__(self, maps: dict[str, BpfMap], programs: dict[str, Program], links: dict[str, int],
                 reasons: DropReasons, notices: list[str]) -> None:
        self.maps = maps
        self.programs = programs  # by hook
        self.links = links  # hook -> link fd (closing it detaches)
        self.reasons = reasons
        self.notices = notices

    @classmethod
    def open(
        cls,
        filter_map: BpfMap | None,
        size: int = DEFAULT_DROP_SIZE,
        *,
        btf_path: str | os.PathLike[str] = btf.VMLINUX,
        tracepoints: Mapping[str, str] | None = None,
        object_path: Path | None = None,
    ) -> DropTracer:
        """Load and attach against ``filter_map``; ``size`` is ``max_entries`` of each drained map.
        ``filter_map`` None: the object's own empty filter of ``size`` entries, in ``maps["filter"]``
        (benchmarks).

        ``tracepoints`` renames hooks (tests: a tracepoint this kernel lacks). Raises
        :class:`DropsUnavailable` when nothing can be traced (no BTF, no hook, the verifier refused);
        a hook that is missing alone is left out and named in :attr:`notices`.
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
        try:
            maps, programs = _load(path, filter_map, size, chosen)
        except DropsUnavailable:
            raise
        except (DatapathSetupError, BpfCallError) as error:
            raise DropsUnavailable(f"loading {path.name} failed, drops and TCP health are off: {error}") from error
        links: dict[str, int] = {}
        notices = list(chosen.notices)
        lib = libbpf()
        for hook, program in programs.items():
            fd = lib.lib.bpf_raw_tracepoint_open(None, program.fd)
            if fd < 0:
                notices.append(f"attaching {program.name} to {chosen.tracepoints[hook]} failed "
                               f"({os.strerror(-fd)}): {hook} is not traced")
                continue
            links[hook] = fd
        tracer = cls(maps, programs, links, DropReasons.from_btf(kernel), notices)
        if not links:
            tracer.close()
            raise DropsUnavailable("; ".join(notices))
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
        """Events that found each drained map full, since the maps were created (summed over CPUs)."""
        lost_map = self.maps[LOST_MAP]
        out = {}
        for slot, name in enumerate(LOST_SLOTS):
            raw = lost_map.lookup(struct.pack("=I", slot))
            out[name] = 0 if raw is None else sum(memoryview(raw).cast("Q"))
        return out

    # --- reading without draining (tests, inspection) -------------------------------------------

    def entries(self, name: str) -> list[tuple[bytes, bytes]]:
        """The raw entries of one map, left in place."""
        return self.maps[name].collect_items()

    def close(self) -> None:
        """Detach (close the links), then close programs and maps."""
        for fd in self.links.values():
            os.close(fd)
        self.links = {}
        for program in self.programs.values():
            program.close()
        for bpf_map in self.maps.values():
            bpf_map.close()

    def __enter__(self) -> DropTracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------------

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


def _load(path: Path, filter_map: BpfMap | None, size: int,
          chosen: Plan) -> tuple[dict[str, BpfMap], dict[str, Program]]:
    obj = _TracingObject(path)
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
        obj.load()
        maps: dict[str, BpfMap] = {}
        programs: dict[str, Program] = {}
        try:
            for name in (*DRAINED_MAPS, LOST_MAP, *(() if filter_map is not None else (FILTER_MAP,))):
                maps[name] = obj.take_map(name)
            for hook, program in chosen.programs.items():
                programs[hook] = obj.take_program(program)
        except BaseException:
            for bpf_map in maps.values():
                bpf_map.close()
            for taken in programs.values():
                taken.close()
            raise
        return maps, programs
    finally:
        obj.close()



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
