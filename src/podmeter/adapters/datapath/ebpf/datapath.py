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
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from podmeter.adapters.datapath.ebpf import layout, preflight
from podmeter.adapters.datapath.ebpf.libbpf import BPF_ANY, BpfCallError, libbpf
from podmeter.adapters.datapath.ebpf.loader import Loaded, Program, load
from podmeter.adapters.datapath.ebpf.maps import BatchOutcome, BpfMap
from podmeter.adapters.datapath.ebpf.pins import DEFAULT_BPFFS, PinDir
from podmeter.model.datapath import BatchResult, DatapathError, Direction, FilterFull, Traffic

log = logging.getLogger("podmeter.datapath.ebpf")

FILTER_MAP = "filter"
COUNTERS_MAP = "counters"
MAP_NAMES = [FILTER_MAP, COUNTERS_MAP]
FROM_POD = "pm_from_pod"  # attach at tc ingress of the host-side veth: counts direction egress
TO_POD = "pm_to_pod"  # attach at tc egress of the host-side veth: counts direction ingress
DEFAULT_FILTER_SIZE = 65536
MAX_FILTER_SIZE = 1 << 24


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


def _load_owned(pins: PinDir, path: Path, filter_size: int) -> Loaded:
    """Load with the maps of a pin directory this process owns (cleaning a crashed resize first)."""
    for name in pins.remove_leftovers():
        log.warning("removed %s left by an interrupted map resize", name)
    sizes = {FILTER_MAP: filter_size, COUNTERS_MAP: counters_size(filter_size)}
    return load(path, pins, sizes, [FROM_POD, TO_POD])


class EbpfDatapath:
    """The filter and counters maps, and (when opened by the agent) the programs that use them.

    Calls may come from several threads (a writer and a metrics reader): each is a self-contained
    sequence of map syscalls and keeps no Python state between calls. Only :meth:`close` must come
    last. The writer should stay the only caller of insert/delete/take_counters.
    """

    def __init__(
        self,
        filter_map: BpfMap,
        counters_map: BpfMap,
        programs: Programs | None = None,
        pins: PinDir | None = None,
    ) -> None:
        self.filter_map = filter_map
        self.counters_map = counters_map
        self.programs = programs
        self.pins = pins

    @classmethod
    def open(
        cls,
        bpffs: str | os.PathLike[str] = DEFAULT_BPFFS,
        filter_size: int = DEFAULT_FILTER_SIZE,
        object_path: Path | None = None,
    ) -> EbpfDatapath:
        """Check prerequisites, take the pin directory, load the programs against its maps.

        Raises a :class:`~.errors.DatapathSetupError` subclass with an actionable message when the
        datapath cannot run; the caller should refuse to start.
        """
        if not 1 <= filter_size <= MAX_FILTER_SIZE:
            raise ValueError(f"--filter-map-size must be between 1 and {MAX_FILTER_SIZE}, not {filter_size}")
        path = _check_prerequisites(bpffs, object_path)
        pins = PinDir(bpffs)
        pins.ensure()
        pins.lock()
        try:
            loaded = _load_owned(pins, path, filter_size)
        except BaseException:
            pins.unlock()
            raise
        programs = Programs(loaded.programs[FROM_POD], loaded.programs[TO_POD])
        return cls(loaded.maps[FILTER_MAP], loaded.maps[COUNTERS_MAP], programs, pins)

    @classmethod
    def open_pinned(cls, bpffs: str | os.PathLike[str] = DEFAULT_BPFFS) -> EbpfDatapath:
        """Open the maps another process pinned (read and write, no programs, no ownership)."""
        pins = PinDir(bpffs)
        filter_map = pins.open(FILTER_MAP)
        try:
            counters_map = pins.open(COUNTERS_MAP)
        except BaseException:
            filter_map.close()
            raise
        return cls(filter_map, counters_map)

    def close(self) -> None:
        """Close descriptors and release the pin directory; pinned maps stay for the next process."""
        self.filter_map.close()
        self.counters_map.close()
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
