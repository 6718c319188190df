"""The kernel datapath: podmeter's :class:`~podmeter.model.datapath.Datapath` over the pinned BPF maps.

Two ways in:
* :meth:`EbpfDatapath.open` (the agent): checks prerequisites, owns the pin directory, loads the
  programs against the pinned maps (creating, reusing or resizing them) and hands out the programs for
  the :class:`~.attach.AttachManager`;
* :meth:`EbpfDatapath.open_pinned` (``podmeter inspect``, ``doctor``, tests): opens the pins of a
  running agent from another process, without programs and without taking ownership.

Invariant kept with the C program: a ``counters`` entry exists only for an IP in ``filter``. The
program never creates an entry for an IP that has left the filter, and the writer takes (reads and
deletes) the counters of every IP it deletes. So ``counters`` needs two entries per filter slot.

It is also the :class:`~podmeter.model.flows.FlowSource` over the ``flows`` map (the program adds every
packet with an observed end to its flow entry; :meth:`EbpfDatapath.drain_flows` reads and deletes them)
and its loss counter ``flows_lost``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from podmeter.adapters.datapath.ebpf import layout, preflight
from podmeter.adapters.datapath.ebpf.libbpf import BPF_ANY, BpfCallError, libbpf
from podmeter.adapters.datapath.ebpf.loader import Loaded, Program, load
from podmeter.adapters.datapath.ebpf.maps import BATCH_UNSUPPORTED, TAKE_CHUNK, BatchOutcome, BpfMap
from podmeter.adapters.datapath.ebpf.pins import DEFAULT_BPFFS, PinDir
from podmeter.model.datapath import BatchResult, DatapathError, Direction, FilterFull, Traffic
from podmeter.model.flows import FlowEntry

log = logging.getLogger("podmeter.datapath.ebpf")

FILTER_MAP = "filter"
COUNTERS_MAP = "counters"
FLOWS_MAP = "flows"
FLOWS_LOST_MAP = "flows_lost"
MAP_NAMES = [FILTER_MAP, COUNTERS_MAP, FLOWS_MAP, FLOWS_LOST_MAP]
TRANSIENT_MAPS = frozenset({FLOWS_MAP})  # replaced, not migrated, when the pin does not match
FROM_POD = "pm_from_pod"  # attach at tc ingress of the host-side veth: counts direction egress
TO_POD = "pm_to_pod"  # attach at tc egress of the host-side veth: counts direction ingress
DEFAULT_FILTER_SIZE = 65536
MAX_FILTER_SIZE = 1 << 24
DEFAULT_FLOW_SIZE = 65536
MAX_FLOW_SIZE = 1 << 24


class Programs:
    """The two counting programs of a loaded datapath, by the tc hook they belong to."""

    def __init__(self, from_pod: Program, to_pod: Program) -> None:
        self.from_pod = from_pod  # tc ingress of the host-side veth
        self.to_pod = to_pod  # tc egress of the host-side veth

    def close(self) -> None:
        self.from_pod.close()
        self.to_pod.close()


def counters_size(filter_size: int) -> int:
    """Two directions per filter entry (see the module invariant)."""
    return 2 * filter_size


def _check_prerequisites(bpffs: str | os.PathLike[str], object_path: Path | None) -> Path:
    """Everything that can be checked before touching the kernel; returns the object to load."""
    preflight.check_privileges()
    preflight.check_kernel()
    path = object_path or preflight.object_path()
    libbpf()  # raises LibbpfMissing
    preflight.check_bpffs(str(bpffs))
    return path


def map_sizes(filter_size: int, flow_size: int) -> dict[str, int]:
    """max_entries of every map of the counting object."""
    return {
        FILTER_MAP: filter_size,
        COUNTERS_MAP: counters_size(filter_size),
        FLOWS_MAP: flow_size,
        FLOWS_LOST_MAP: 1,
    }


def _load_owned(pins: PinDir, path: Path, filter_size: int, flow_size: int) -> Loaded:
    """Load with the maps of a pin directory this process owns (cleaning a crashed resize first)."""
    for name in pins.remove_leftovers():
        log.warning("removed %s left by an interrupted map resize", name)
    return load(path, pins, map_sizes(filter_size, flow_size), [FROM_POD, TO_POD], TRANSIENT_MAPS)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Hold the cyclic garbage collector while a drain builds its entries.

    A drain of 100,000 flows allocates about 300,000 tuples, all referenced from the result and free of
    cycles, and a ``FlowKey`` holds an enum member, so the collector keeps them tracked and its older
    generations would walk the growing list again and again (more than the decoding itself). Paused, it
    makes one young-generation pass afterwards. Collection state is process-wide: the collector is
    re-enabled only if it was enabled, so nested or concurrent drains leave it as they found it.
    """
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class EbpfDatapath:
    """The filter and counters maps, the flows maps, and (when opened by the agent) the programs.

    Calls may come from several threads (a writer and a metrics reader): each is a self-contained
    sequence of map syscalls and keeps no Python state between calls. Only :meth:`close` must come
    last. The writer should stay the only caller of insert/delete/take_counters, and one task the only
    caller of :meth:`drain_flows`.

    A datapath built without flows maps (``flows_map=None``: the pins of an older agent, or a benchmark
    of the counting object alone) has a flow capacity of 0 and drains nothing.
    """

    def __init__(
        self,
        filter_map: BpfMap,
        counters_map: BpfMap,
        programs: Programs | None = None,
        pins: PinDir | None = None,
        *,
        flows_map: BpfMap | None = None,
        flows_lost_map: BpfMap | None = None,
    ) -> None:
        self.filter_map = filter_map
        self.counters_map = counters_map
        self.programs = programs
        self.pins = pins
        self.flows_map = flows_map
        self.flows_lost_map = flows_lost_map

    @classmethod
    def from_loaded(cls, loaded: Loaded, programs: Programs | None = None, pins: PinDir | None = None) -> EbpfDatapath:
        """The datapath over the maps of a load (the flows maps if the object has them)."""
        return cls(
            loaded.maps[FILTER_MAP],
            loaded.maps[COUNTERS_MAP],
            programs,
            pins,
            flows_map=loaded.maps.get(FLOWS_MAP),
            flows_lost_map=loaded.maps.get(FLOWS_LOST_MAP),
        )

    @classmethod
    def open(
        cls,
        bpffs: str | os.PathLike[str] = DEFAULT_BPFFS,
        filter_size: int = DEFAULT_FILTER_SIZE,
        object_path: Path | None = None,
        flow_size: int = DEFAULT_FLOW_SIZE,
    ) -> EbpfDatapath:
        """Check prerequisites, take the pin directory, load the programs against its maps.

        ``flow_size`` is the ``flows`` map's max_entries: the flows it can hold between two drains. A
        pinned ``flows`` map of another size or layout is replaced (its undrained entries are lost and
        logged): flows are transient, unlike the filter and counters.

        Raises a :class:`~.errors.DatapathSetupError` subclass with an actionable message when the
        datapath cannot run; the caller should refuse to start.
        """
        if not 1 <= filter_size <= MAX_FILTER_SIZE:
            raise ValueError(f"--filter-map-size must be between 1 and {MAX_FILTER_SIZE}, not {filter_size}")
        if not 1 <= flow_size <= MAX_FLOW_SIZE:
            raise ValueError(f"the flow map size must be between 1 and {MAX_FLOW_SIZE}, not {flow_size}")
        path = _check_prerequisites(bpffs, object_path)
        pins = PinDir(bpffs)
        pins.ensure()
        pins.lock()
        try:
            loaded = _load_owned(pins, path, filter_size, flow_size)
        except BaseException:
            pins.unlock()
            raise
        programs = Programs(loaded.programs[FROM_POD], loaded.programs[TO_POD])
        return cls.from_loaded(loaded, programs, pins)

    @classmethod
    def open_pinned(cls, bpffs: str | os.PathLike[str] = DEFAULT_BPFFS) -> EbpfDatapath:
        """Open the maps another process pinned (read and write, no programs, no ownership). The flows
        maps are opened when pinned (an agent older than flows pinned none)."""
        pins = PinDir(bpffs)
        opened: list[BpfMap] = []
        try:
            for name in MAP_NAMES:
                if name in (FILTER_MAP, COUNTERS_MAP) or pins.has(name):
                    opened.append(pins.open(name))
        except BaseException:
            for bpf_map in opened:
                bpf_map.close()
            raise
        maps = {bpf_map.name: bpf_map for bpf_map in opened}
        return cls(
            maps[FILTER_MAP], maps[COUNTERS_MAP], flows_map=maps.get(FLOWS_MAP), flows_lost_map=maps.get(FLOWS_LOST_MAP)
        )

    def close(self) -> None:
        """Close descriptors and release the pin directory; pinned maps stay for the next process."""
        self.filter_map.close()
        self.counters_map.close()
        for bpf_map in (self.flows_map, self.flows_lost_map):
            if bpf_map is not None:
                bpf_map.close()
        if self.programs is not None:
            self.programs.close()
        if self.pins is not None:
            self.pins.unlock()

    def __enter__(self) -> EbpfDatapath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the Datapath protocol ------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.filter_map.shape.max_entries

    def insert(self, ips: Sequence[str]) -> BatchResult:
        """Insert in order (idempotent per IP); a full trie stops the batch with FilterFull."""
        keys = [layout.filter_key(ip) for ip in ips]
        outcome = self.filter_map.update_batch(keys, [layout.FILTER_VALUE] * len(keys), BPF_ANY)
        return self._result(outcome, ips, "insert")

    def delete(self, ips: Sequence[str]) -> BatchResult:
        """Delete in order; an absent IP stops the batch with ENOENT."""
        outcome = self.filter_map.delete_batch([layout.filter_key(ip) for ip in ips])
        return self._result(outcome, ips, "delete")

    def contents(self) -> set[str]:
        """The IPs the kernel's filter holds now (keys collected first, then decoded)."""
        ips = set()
        for key, _ in self.filter_map.collect_items():
            try:
                ips.add(layout.decode_filter_key(key))
            except ValueError as error:  # a prefix entry someone else wrote: not an IP we manage
                log.warning("filter map: ignoring foreign entry: %s", error)
        return ips

    def read_counters(self) -> dict[tuple[str, Direction], Traffic]:
        """Every counter, summed over CPUs."""
        return {
            layout.decode_counter_key(key): layout.sum_per_cpu(value)
            for key, value in self.counters_map.collect_items()
        }

    def take_counters(self, ips: Iterable[str]) -> dict[tuple[str, Direction], Traffic]:
        """Read and delete the counters of ``ips`` (each key atomically: no increment is lost between)."""
        taken = {}
        for ip in ips:
            for direction in Direction:
                value = self.counters_map.take(layout.counter_key(ip, direction))
                if value is not None:
                    taken[(ip, direction)] = layout.sum_per_cpu(value)
        return taken

    # --- the FlowSource protocol ----------------------------------------------------------------

    @property
    def flow_capacity(self) -> int:
        return 0 if self.flows_map is None else self.flows_map.shape.max_entries

    def drain_flows(self, chunk: int = TAKE_CHUNK) -> list[FlowEntry]:
        """Read and delete every flow entry (BPF_MAP_LOOKUP_AND_DELETE_BATCH, ``chunk`` entries a call).

        Each entry is read and deleted at once, so it is returned by exactly one drain. On a kernel
        without the batch operation for hash maps (ENOTSUPP / EINVAL / EOPNOTSUPP), keys are collected
        first, then each is read and deleted (BPF_MAP_LOOKUP_AND_DELETE_ELEM): still never twice. Any
        other error ends the drain early with what was taken (logged); the rest waits for the next.
        """
        if self.flows_map is None:
            return []
        entries: list[FlowEntry] = []
        texts = layout.AddressTexts()
        with _gc_paused():
            try:
                for keys, values, count in self.flows_map.take_batches(chunk):
                    entries.extend(_decode(keys, values, count, texts))
            except BpfCallError as error:
                if error.errno not in BATCH_UNSUPPORTED:
                    log.warning("flows drain stopped after %d entries (%s); the rest waits for the next drain",
                                len(entries), error)
                    return entries
                log.debug("flows: no batch lookup-and-delete (%s), taking entries one by one", error)
                items = self.flows_map.take_each()
                entries.extend(_decode_items(items, texts))
        return entries

    def read_flows(self) -> list[FlowEntry]:
        """The flow entries now, left in place (``podmeter inspect flows``; the agent drains)."""
        if self.flows_map is None:
            return []
        with _gc_paused():
            return _decode_items(self.flows_map.collect_items(), layout.AddressTexts())

    def flows_lost(self) -> int:
        """Packets that found the flows map full, since it was created (summed over CPUs)."""
        return self.flows_lost_traffic().packets

    def flows_lost_traffic(self) -> Traffic:
        """Packets and bytes that found the flows map full, since it was created."""
        if self.flows_lost_map is None:
            return Traffic()
        raw = self.flows_lost_map.lookup(layout.FLOWS_LOST_KEY)
        return Traffic() if raw is None else Traffic(*layout.sum_lost(raw))

    # --- internals ------------------------------------------------------------------------------

    def _result(self, outcome: BatchOutcome, ips: Sequence[str], op: str) -> BatchResult:
        if outcome.error is None:
            return BatchResult(outcome.applied)
        return BatchResult(outcome.applied, self._error(outcome.error, ips, outcome.applied, op))

    def _error(self, error: BpfCallError, ips: Sequence[str], applied: int, op: str) -> DatapathError:
        failed = ips[applied] if applied < len(ips) else "?"
        if error.errno_name == "ENOSPC" and op == "insert":
            return FilterFull(f"filter map is full ({self.capacity} entries); {failed} was not inserted")
        return DatapathError(error.errno_name, f"filter {op} of {failed} failed: {os.strerror(error.errno or 0)}")


def _decode(keys: memoryview, values: memoryview, count: int, texts: layout.AddressTexts) -> list[FlowEntry]:
    """Decode one batch; an entry the program cannot have written (unknown observation code) is skipped
    and logged rather than losing the batch (its entries are already deleted from the kernel)."""
    try:
        return layout.decode_flows(keys, values, count, texts)
    except ValueError:
        pass
    size_k, size_v = layout.FLOW_KEY.size, layout.FLOW_VALUE.size
    out: list[FlowEntry] = []
    for i in range(count):
        try:
            out.extend(layout.decode_flows(keys[i * size_k :], values[i * size_v :], 1, texts))
        except ValueError as error:
            log.warning("flows map: skipping an entry podmeter did not write: %s", error)
    return out


def _decode_items(items: list[tuple[bytes, bytes]], texts: layout.AddressTexts) -> list[FlowEntry]:
    keys = b"".join(key for key, _ in items)
    values = b"".join(value for _, value in items)
    return _decode(memoryview(keys), memoryview(values), len(items), texts)
