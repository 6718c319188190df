"""The kernel datapath: podmeter's :class:`~podmeter.model.datapath.Datapath` over the pinned BPF maps.

Two ways in:
* :meth:`EbpfDatapath.open` (the agent): checks prerequisites, owns the pin directory, loads the
  programs against the pinned maps (creating, reusing or resizing them) and hands out the programs for
  the :class:`~.attach.AttachManager`;
* :meth:`EbpfDatapath.open_pinned` (``podmeter inspect``, ``doctor``, tests): opens the pins of a
  running agent from another process, without programs and without taking ownership.

Invariant kept for the C program: a ``counters`` entry exists for both directions of an IP exactly
while the IP is in ``filter``. :meth:`EbpfDatapath.insert` creates them (zero) before the filter entry,
the writer takes (reads and deletes) the counters of every IP it deletes, and the owner's start repairs
what a crash left (:meth:`EbpfDatapath.repair_counters`). The program never creates one: for it the
counters map *is* the filter of the counting path (one lookup decides and finds the slot). So
``counters`` needs two entries per filter slot. Entries no packet has reached yet (zero) are not
reported: readers see an IP's counters from its first packet, as before the entries were made ahead.

It is also the :class:`~podmeter.model.flows.FlowSource` over the double-buffered flows maps (the
program adds every packet with an observed end to its entry in the active one of ``flows_a`` and
``flows_b``, which the one-slot map-in-map ``flows`` points to; :meth:`EbpfDatapath.drain_flows` flips the
slot, lets the kernel wait for running programs, then reads and deletes the other map's entries: see
:class:`FlowMaps`) and its loss counter ``flows_lost``. The programs keep a full flows map fair between
pods (:class:`Fairness`: past 3/4 of its entries each pod link may create only a share more until the
next drain), in ``flows_fill`` and ``flows_share``, which the drain resets.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from podmeter.adapters.datapath.ebpf import layout, preflight
from podmeter.adapters.datapath.ebpf.dns import DNS_MAP_NAMES, DNS_MAPS, DnsMaps, dns_map_sizes
from podmeter.adapters.datapath.ebpf.libbpf import BPF_ANY, BPF_MAP_TYPE_HASH, BPF_NOEXIST, BpfCallError, libbpf
from podmeter.adapters.datapath.ebpf.loader import Loaded, Program, load
from podmeter.adapters.datapath.ebpf.maps import (
    BATCH_UNSUPPORTED,
    BPF_MAP_TYPE_ARRAY_OF_MAPS,
    TAKE_CHUNK,
    BatchOutcome,
    BpfMap,
    MapShape,
)
from podmeter.adapters.datapath.ebpf.pins import DEFAULT_BPFFS, PinDir
from podmeter.model.datapath import BatchResult, DatapathError, Direction, FilterFull, Traffic
from podmeter.model.flows import FlowEntry

log = logging.getLogger("podmeter.datapath.ebpf")

FILTER_MAP = "filter"
COUNTERS_MAP = "counters"
FLOWS_MAP = "flows"  # the slot: an ARRAY_OF_MAPS of one entry, the flows map the programs add to
FLOWS_A = "flows_a"  # the two flows maps, active in turn
FLOWS_B = "flows_b"
FLOWS_LOST_MAP = "flows_lost"
FLOWS_FILL_MAP = "flows_fill"  # the fairness rule's configuration and the active map's entry count
FLOWS_SHARE_MAP = "flows_share"  # entries each pod link created past the threshold
MAP_NAMES = [FILTER_MAP, COUNTERS_MAP, FLOWS_MAP, FLOWS_A, FLOWS_B, FLOWS_LOST_MAP, FLOWS_FILL_MAP, FLOWS_SHARE_MAP,
             *DNS_MAP_NAMES]
READER_MAPS = [FILTER_MAP, COUNTERS_MAP, FLOWS_MAP, FLOWS_A, FLOWS_B, FLOWS_LOST_MAP,
               *DNS_MAPS]  # what open_pinned opens
# The maps whose descriptors the datapath keeps (the others, only the programs use: the DNS scratch).
KEPT_MAPS = frozenset({FILTER_MAP, COUNTERS_MAP, FLOWS_MAP, FLOWS_A, FLOWS_B, FLOWS_FILL_MAP, FLOWS_SHARE_MAP,
                       FLOWS_LOST_MAP, *DNS_MAPS})
# Replaced, not migrated, when the pin does not match.
TRANSIENT_MAPS = frozenset({FLOWS_MAP, FLOWS_A, FLOWS_B, FLOWS_FILL_MAP, FLOWS_SHARE_MAP, *DNS_MAP_NAMES})
# Migrated entry by entry when the pin is of an older type with the same entries: the filter was an LPM
# trie of host entries until it became an exact-match hash of the same keys.
CONVERTED_MAPS = frozenset({FILTER_MAP})
FILTER_FULL_ERRNOS = frozenset({"E2BIG", "ENOSPC"})  # a full hash map, a full LPM trie
# The layout of flows_a and flows_b (max_entries aside): what the slot's inner map template accepts.
FLOW_MAP_SHAPE = MapShape(BPF_MAP_TYPE_HASH, layout.FLOW_KEY.size, layout.FLOW_VALUE.size, 0, 0)
FLOWS_SLOT_SHAPE = MapShape(BPF_MAP_TYPE_ARRAY_OF_MAPS, len(layout.FLOWS_SLOT_KEY), layout.MAP_REF.size, 0, 1)
FROM_POD = "pm_from_pod"  # attach at tc ingress of the host-side veth: counts direction egress
TO_POD = "pm_to_pod"  # attach at tc egress of the host-side veth: counts direction ingress
DEFAULT_FILTER_SIZE = 65536
MAX_FILTER_SIZE = 1 << 24
DEFAULT_FLOW_SIZE = 65536
MAX_FLOW_SIZE = 1 << 24
SHARE_LINKS = 4096  # pod links flows_share counts in one interval (more are not limited: fail open)
DEFAULT_DNS_SIZE = 8192  # DNS aggregates between two drains (about 500 B of kernel memory each)
DNS_PENDING_SIZE = 16384  # outstanding queries remembered for their latency (LRU)


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


def map_sizes(filter_size: int, flow_size: int, dns_size: int = DEFAULT_DNS_SIZE) -> dict[str, int]:
    """max_entries of every map of the counting object."""
    return {
        FILTER_MAP: filter_size,
        COUNTERS_MAP: counters_size(filter_size),
        FLOWS_MAP: 1,
        FLOWS_A: flow_size,
        FLOWS_B: flow_size,
        FLOWS_LOST_MAP: 1,
        FLOWS_FILL_MAP: 1,
        FLOWS_SHARE_MAP: SHARE_LINKS,
        **dns_map_sizes(dns_size, DNS_PENDING_SIZE),
    }


def _load_owned(pins: PinDir, path: Path, filter_size: int, flow_size: int) -> Loaded:
    """Load with the maps of a pin directory this process owns (cleaning a crashed resize first)."""
    for name in pins.remove_leftovers():
        log.warning("removed %s left by an interrupted map resize", name)
    replace = frozenset({FLOWS_MAP}) if _slot_unproven(pins) else frozenset()
    return load(path, pins, map_sizes(filter_size, flow_size), [FROM_POD, TO_POD], TRANSIENT_MAPS,
                replace=replace, convert=CONVERTED_MAPS)


def _slot_unproven(pins: PinDir) -> bool:
    """Whether a pinned ``flows`` slot map of the right layout must be replaced all the same: the kernel
    does not say which inner layout a map-in-map accepts, so only a slot holding a pinned map of the
    flows layout proves that it takes ``flows_a`` and ``flows_b``. (A slot map of another layout, or
    none, is the loader's business.)"""
    if not pins.has(FLOWS_MAP):
        return False
    with contextlib.closing(pins.open(FLOWS_MAP)) as slot:
        if not slot.shape.compatible(FLOWS_SLOT_SHAPE):
            return False
        held = _slot_id(slot)
    for name in (FLOWS_A, FLOWS_B):
        if held and pins.has(name):
            with contextlib.closing(pins.open(name)) as inner:
                if inner.id == held and FLOW_MAP_SHAPE.compatible(inner.shape):
                    return False
    return True


def _slot_id(slot: BpfMap) -> int:
    """The id of the map in the slot of ``flows`` (0: empty)."""
    raw = slot.lookup(layout.FLOWS_SLOT_KEY)
    return 0 if raw is None else int(layout.MAP_REF.unpack(raw)[0])


@dataclass(frozen=True)
class Fairness:
    """The rule that keeps a full flows map from being one pod's (issue 25), run by the programs.

    While the active map holds fewer than ``threshold`` entries (the programs count those they create,
    in ``flows_fill``), every new flow gets an entry. Past it, a packet may create one only if its pod
    link (the hook's interface: a pod cannot take more by sending from other addresses) created fewer
    than ``share`` entries since the threshold was passed (``flows_share``); otherwise the packet is lost
    (``flows_lost``), as it would be in a full map. So the last quarter of the map is kept for the pods
    that did not fill the rest: a pod that sprays new tuples fills 3/4 and then gets one share like
    anybody else, and a pod with fewer than ``share`` new flows per interval has all of them recorded
    unless more than ``capacity / 4 / share`` pods need theirs. Each drain that flips resets both counts.
    The per-pod counters are not affected by any of it.
    """

    threshold: int
    share: int

    FILL_NUMERATOR, FILL_DENOMINATOR = 3, 4  # the threshold: 3/4 of the map
    SHARES = 16  # the remaining quarter in shares: pods that can each take a whole one

    @classmethod
    def for_capacity(cls, capacity: int) -> Fairness:
        threshold = capacity * cls.FILL_NUMERATOR // cls.FILL_DENOMINATOR
        return cls(threshold, max(1, (capacity - threshold) // cls.SHARES))

    @classmethod
    def off(cls) -> Fairness:
        """No rule: every packet may create its entry while the map has room (before issue 25)."""
        return cls(0, 0)


class FlowMaps:
    """The double-buffered flows maps: ``flows_a`` and ``flows_b`` of one layout, and ``slot`` (pinned as
    ``flows``), an ARRAY_OF_MAPS whose one slot holds the map the programs add to, the *active* one.

    A drain (:meth:`EbpfDatapath.take_flow_batches`) points the slot to the other, the *standby*, and only
    then takes the entries of the previously active map. Writing a map-in-map slot through the bpf()
    syscall returns after an RCU grace period (the kernel's ``maybe_wait_bpf_programs()``: about 8 ms
    here), and each program run, one RCU read-side critical section, reads the slot once: so when the
    flip returns, no program can still be adding to the old map, and the take reads it whole. A packet
    is in exactly one drain, whatever runs on the other CPUs (a single map loses the packets added to an
    entry at the instant the drain deletes it).

    Invariant (owner): the slot holds one of the two maps; the standby is empty unless a drain was cut
    short (an error, a crash), which ``standby_dirty`` records: the next drain takes it first, while no
    program can reach it.
    """

    def __init__(self, slot: BpfMap, a: BpfMap, b: BpfMap, *, fill: BpfMap | None = None,
                 share: BpfMap | None = None) -> None:
        self.slot, self.a, self.b = slot, a, b
        self.fill, self.share = fill, share  # the fairness rule's maps (None: a reader, or an older object)
        self.fairness = Fairness.off()
        self.standby_dirty = True  # not known to be empty

    @property
    def capacity(self) -> int:
        """Flows one map holds: between two drains (each map is that size: twice the kernel memory)."""
        return self.a.shape.max_entries

    def roles(self) -> tuple[BpfMap, BpfMap] | None:
        """(active, standby) as the slot says now; None if it holds neither map."""
        held = _slot_id(self.slot)
        if held == self.a.id:
            return self.a, self.b
        if held == self.b.id:
            return self.b, self.a
        return None

    def activate(self, bpf_map: BpfMap) -> None:
        """Point the slot to ``bpf_map``. Returns once no program can still be adding to the map it held
        (the syscall waits for an RCU grace period)."""
        self.slot.update(layout.FLOWS_SLOT_KEY, layout.MAP_REF.pack(bpf_map.fd))

    def adopt(self) -> tuple[BpfMap, BpfMap]:
        """The owner's start: keep the active map a predecessor left (its entries are in the next drain),
        or make ``flows_a`` active if the slot holds neither map (new maps, a replaced one); note whether
        the standby holds entries (a drain cut short between its flip and the end of its take)."""
        roles = self.roles()
        if roles is None:
            self.activate(self.a)
            roles = self.a, self.b
        self.standby_dirty = not roles[1].is_empty()
        return roles

    def configure(self, fairness: Fairness) -> None:
        """Set the fairness rule the programs apply (the owner, at start). The count of entries in the
        active map is kept if it holds entries (a predecessor's, with the same pinned maps), else 0."""
        self.fairness = fairness
        if self.fill is None:
            return
        roles = self.roles()
        entries = 0
        if roles is not None and not roles[0].is_empty():
            raw = self.fill.lookup(layout.FLOWS_FILL_KEY)
            entries = 0 if raw is None else int(layout.FLOWS_FILL.unpack(raw)[0])
        self.fill.update(layout.FLOWS_FILL_KEY, layout.FLOWS_FILL.pack(entries, fairness.threshold, fairness.share))

    def reset_fairness(self) -> None:
        """Start the next interval's counts: no entry created in the map about to become active, no
        share used. Done just before the flip, so an entry a program creates in the old map meanwhile is
        counted in the new interval (the rule errs towards limiting a little early, never late)."""
        if self.fill is None:
            return
        try:
            self.fill.update(layout.FLOWS_FILL_KEY,
                             layout.FLOWS_FILL.pack(0, self.fairness.threshold, self.fairness.share))
            if self.share is not None and not self.share.is_empty():  # empty unless the threshold was passed
                _clear(self.share)
        except BpfCallError as error:  # the rule then counts on from where it was: limits sooner, not later
            log.warning("flows: the fairness counts were not reset (%s)", error)

    def fill_entries(self) -> int:
        """Entries the programs count as created in the active map since the last flip (0 without the map)."""
        raw = None if self.fill is None else self.fill.lookup(layout.FLOWS_FILL_KEY)
        return 0 if raw is None else int(layout.FLOWS_FILL.unpack(raw)[0])

    def close(self) -> None:
        for bpf_map in (self.slot, self.a, self.b, self.fill, self.share):
            if bpf_map is not None:
                bpf_map.close()


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
    sequence of map syscalls and keeps no Python state between calls (but the drain's note of a standby
    flows map left with entries, :attr:`FlowMaps.standby_dirty`). Only :meth:`close` must come last. The
    writer should stay the only caller of insert/delete/take_counters, and one task the only caller of
    :meth:`drain_flows` (it flips the flows slot, and waits for the kernel while it does).

    A datapath built without flows maps (``flows=None``: the pins of an older agent, or a benchmark of
    the counting object alone) has a flow capacity of 0 and drains nothing.
    """

    def __init__(
        self,
        filter_map: BpfMap,
        counters_map: BpfMap,
        programs: Programs | None = None,
        pins: PinDir | None = None,
        *,
        flows: FlowMaps | None = None,
        flows_lost_map: BpfMap | None = None,
        dns: DnsMaps | None = None,
    ) -> None:
        self.filter_map = filter_map
        self.counters_map = counters_map
        self.programs = programs
        self.pins = pins
        self.flows = flows
        self.flows_lost_map = flows_lost_map
        self.dns = dns  # None: an object or pins without the DNS maps

    @classmethod
    def from_loaded(cls, loaded: Loaded, programs: Programs | None = None, pins: PinDir | None = None) -> EbpfDatapath:
        """The datapath over the maps of a load (the flows maps if the object has them), as their owner:
        the flows slot is checked (:meth:`FlowMaps.adopt`) and the fairness rule set for the map's size."""
        maps = loaded.maps
        flows = None
        if all(name in maps for name in (FLOWS_MAP, FLOWS_A, FLOWS_B)):
            flows = FlowMaps(maps[FLOWS_MAP], maps[FLOWS_A], maps[FLOWS_B], fill=maps.get(FLOWS_FILL_MAP),
                             share=maps.get(FLOWS_SHARE_MAP))
            flows.adopt()
            flows.configure(Fairness.for_capacity(flows.capacity))
        datapath = cls(maps[FILTER_MAP], maps[COUNTERS_MAP], programs, pins, flows=flows,
                       flows_lost_map=maps.get(FLOWS_LOST_MAP), dns=DnsMaps.of(maps))
        for name in set(maps) - KEPT_MAPS:  # the programs hold them; no descriptor of ours stays open
            maps[name].close()
        return datapath

    @classmethod
    def open(
        cls,
        bpffs: str | os.PathLike[str] = DEFAULT_BPFFS,
        filter_size: int = DEFAULT_FILTER_SIZE,
        object_path: Path | None = None,
        flow_size: int = DEFAULT_FLOW_SIZE,
    ) -> EbpfDatapath:
        """Check prerequisites, take the pin directory, load the programs against its maps.

        ``flow_size`` is the max_entries of each flows map (``flows_a``, ``flows_b``): the flows it can
        hold between two drains. A pinned flows map of another size or layout is replaced (its undrained
        entries are lost and logged): flows are transient, unlike the filter and counters. Pinned maps
        of the same size and layout are reused, their undrained entries in the next drain.

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
        datapath = cls.from_loaded(loaded, programs, pins)
        datapath.repair_counters()
        return datapath

    @classmethod
    def open_pinned(cls, bpffs: str | os.PathLike[str] = DEFAULT_BPFFS) -> EbpfDatapath:
        """Open the maps another process pinned (read and write, no programs, no ownership). The flows
        maps are opened when pinned (a ``flows`` pin of another layout is ignored)."""
        pins = PinDir(bpffs)
        opened: list[BpfMap] = []
        try:
            for name in READER_MAPS:
                if name in (FILTER_MAP, COUNTERS_MAP) or pins.has(name):
                    opened.append(pins.open(name))
        except BaseException:
            for bpf_map in opened:
                bpf_map.close()
            raise
        maps = {bpf_map.name: bpf_map for bpf_map in opened}
        flows = None
        if all(name in maps for name in (FLOWS_MAP, FLOWS_A, FLOWS_B)) and maps[FLOWS_MAP].shape.compatible(
                FLOWS_SLOT_SHAPE):
            flows = FlowMaps(maps.pop(FLOWS_MAP), maps.pop(FLOWS_A), maps.pop(FLOWS_B))
        for name in (FLOWS_MAP, FLOWS_A, FLOWS_B):
            if name in maps:
                maps.pop(name).close()
        dns = DnsMaps.of(maps)
        for name in DNS_MAPS:
            if dns is None and name in maps:
                maps.pop(name).close()
        return cls(maps[FILTER_MAP], maps[COUNTERS_MAP], flows=flows, flows_lost_map=maps.get(FLOWS_LOST_MAP),
                   dns=dns)

    def close(self) -> None:
        """Close descriptors and release the pin directory; pinned maps stay for the next process."""
        self.filter_map.close()
        self.counters_map.close()
        if self.flows is not None:
            self.flows.close()
        if self.flows_lost_map is not None:
            self.flows_lost_map.close()
        if self.dns is not None:
            self.dns.close()
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
        """Insert in order (idempotent per IP); a full filter stops the batch with FilterFull. The IPs'
        counters are created first (kept if they exist), so the programs count an IP from the instant it
        is in the filter; those of IPs the filter did not take are removed again."""
        self._create_counters([(ip, direction) for ip in ips for direction in Direction])
        keys = [layout.filter_key(ip) for ip in ips]
        outcome = self.filter_map.update_batch(keys, [layout.FILTER_VALUE] * len(keys), BPF_ANY)
        if outcome.applied < len(ips):
            self._drop_counters([ip for ip in ips[outcome.applied:] if self.filter_map.lookup(layout.filter_key(ip))
                                 is None])
        return self._result(outcome, ips, "insert")

    def repair_counters(self) -> None:
        """Make the counters invariant hold again (the owner's start): zero counters for every filter IP
        that lacks them (a predecessor whose program created them at the first packet, a migrated
        filter, a resize that dropped some), and no counters for an IP outside the filter (a writer that
        died between its two removal steps, a shrink). Logged when it changed anything."""
        observed = self.contents()
        present = set(self._counter_keys())
        orphans = sorted({ip for ip, _ in present} - observed)
        self._drop_counters(orphans)
        created = self._create_counters(sorted((ip, direction) for ip in observed for direction in Direction
                                               if (ip, direction) not in present))
        if orphans or created:
            log.warning("counters repaired: %d IPs outside the filter removed, %d counters created",
                        len(orphans), created)

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
        """Every counter a packet reached, summed over CPUs."""
        found = {}
        for key, value in self.counters_map.collect_items():
            traffic = layout.sum_per_cpu(value)
            if traffic.packets:
                found[layout.decode_counter_key(key)] = traffic
        return found

    def take_counters(self, ips: Iterable[str]) -> dict[tuple[str, Direction], Traffic]:
        """Read and delete the counters of ``ips`` (each key atomically: no increment is lost between)."""
        taken = {}
        for ip in ips:
            for direction in Direction:
                value = self.counters_map.take(layout.counter_key(ip, direction))
                traffic = None if value is None else layout.sum_per_cpu(value)
                if traffic is not None and traffic.packets:
                    taken[(ip, direction)] = traffic
        return taken

    def _create_counters(self, keys: Sequence[tuple[str, Direction]]) -> int:
        """Create zero counters at ``keys`` (IP, direction), keeping those that exist; returns how many
        were created. One syscall per entry: batch writes take no BPF_NOEXIST, and only BPF_NOEXIST
        cannot overwrite what an older program (still attached during an upgrade) created meanwhile."""
        zero = bytes(self.counters_map.value_bytes)
        created = 0
        for ip, direction in keys:
            try:
                self.counters_map.update(layout.counter_key(ip, direction), zero, BPF_NOEXIST)
            except BpfCallError as error:
                if error.errno != errno.EEXIST:  # no room: cannot happen while the invariant holds
                    log.warning("counters: no entry for %s %s (%s)", ip, direction.value, error)
                continue
            created += 1
        return created

    def _drop_counters(self, ips: Iterable[str]) -> None:
        """Delete the counters of IPs that are not in the filter (what they hold belongs to no pod)."""
        for ip in ips:
            for direction in Direction:
                self.counters_map.delete(layout.counter_key(ip, direction))

    def _counter_keys(self) -> list[tuple[str, Direction]]:
        keys = []
        for raw in self.counters_map.collect_keys():
            try:
                keys.append(layout.decode_counter_key(raw))
            except ValueError as error:  # not podmeter's: left alone
                log.warning("counters map: ignoring foreign entry: %s", error)
        return keys

    # --- the FlowSource protocol ----------------------------------------------------------------

    @property
    def flow_capacity(self) -> int:
        return 0 if self.flows is None else self.flows.capacity

    @property
    def flows_map(self) -> BpfMap | None:
        """The flows map the programs add to now (None without flows maps, or if the slot holds neither)."""
        roles = None if self.flows is None else self.flows.roles()
        return None if roles is None else roles[0]

    def drain_flows(self, chunk: int = TAKE_CHUNK) -> list[FlowEntry]:
        """Read and delete every flow entry counted before the call (:meth:`take_flow_batches`), decoded.

        A packet is in exactly one drain: the drain takes a map no program can reach any more (see
        :class:`FlowMaps`). Any error but a missing batch operation ends the drain early with what was
        taken (logged); the rest is in the next drain.
        """
        entries: list[FlowEntry] = []
        texts = layout.AddressTexts()
        with _gc_paused():
            for keys, values, count in self.take_flow_batches(chunk):
                entries.extend(_decode(keys, values, count, texts))
        return entries

    def take_flow_batches(self, chunk: int = TAKE_CHUNK) -> Iterator[tuple[memoryview, memoryview, int]]:
        """The drain, undecoded: yields ``(keys, values, count)`` batches in the kernel's layout (decode
        each before asking for the next: the buffers are reused).

        1. The standby map first, if a drain was cut short (``FlowMaps.standby_dirty``): no program
           reaches it, so it is taken whole.
        2. If the active map holds nothing, that is all (no flip: a flow created now is in the next drain).
        3. Flip: the slot now holds the standby map; the syscall returns after an RCU grace period, when
           no program can still be adding to the old active map. Just before it, the fairness rule's
           counts start again (:meth:`FlowMaps.reset_fairness`).
        4. Take every entry of the old active map, now quiescent.

        Each map is taken with BPF_MAP_LOOKUP_AND_DELETE_BATCH, ``chunk`` entries a call; on a kernel
        without it for hash maps (ENOTSUPP / EINVAL / EOPNOTSUPP), key by key (keys collected first, then
        each taken with BPF_MAP_LOOKUP_AND_DELETE_ELEM). Another error stops the drain (logged) and leaves
        the rest in the standby map, for the next drain's step 1.
        """
        flows = self.flows
        if flows is None:
            return
        roles = flows.roles()
        if roles is None:  # the slot was changed behind the owner's back: take it back
            log.warning("flows: the %s slot held neither %s nor %s; %s is active again", FLOWS_MAP, FLOWS_A,
                        FLOWS_B, FLOWS_A)
            roles = flows.adopt()
        active, standby = roles
        if flows.standby_dirty:
            if not (yield from _take_whole(standby, chunk)):
                return
            flows.standby_dirty = False
        if active.is_empty():
            return
        flows.reset_fairness()
        flows.activate(standby)
        flows.standby_dirty = True  # until the old active map is taken whole
        if (yield from _take_whole(active, chunk)):
            flows.standby_dirty = False

    def read_flows(self) -> list[FlowEntry]:
        """The flow entries now, left in place, of both maps (``podmeter inspect flows``; the agent
        drains): what the next drain takes, if nothing is added meanwhile."""
        if self.flows is None:
            return []
        with _gc_paused():
            texts = layout.AddressTexts()
            return [entry for bpf_map in (self.flows.a, self.flows.b)
                    for entry in _decode_items(bpf_map.collect_items(), texts)]

    def flows_lost(self) -> int:
        """Packets the flows map did not take (it was full, or their pod had had its share of it: see
        :class:`Fairness`), each packet once, since the map was created (summed over CPUs)."""
        return self.flows_lost_traffic().packets

    def flows_lost_traffic(self) -> Traffic:
        """Packets and bytes the flows map did not take, since it was created (see :meth:`flows_lost`)."""
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
        if error.errno_name in FILTER_FULL_ERRNOS and op == "insert":
            return FilterFull(f"filter map is full ({self.capacity} entries); {failed} was not inserted")
        return DatapathError(error.errno_name, f"filter {op} of {failed} failed: {os.strerror(error.errno or 0)}")

    def read_counters_of(self, ips: Iterable[str]) -> dict[tuple[str, Direction], Traffic]:
        """The counters of ``ips`` only, summed over CPUs, left in place: one lookup per key (the Datapath
        protocol's narrow read, for the IPs that changed hands; :meth:`read_counters` reads every entry)."""
        found = {}
        for ip in ips:
            for direction in Direction:
                value = self.counters_map.lookup(layout.counter_key(ip, direction))
                traffic = None if value is None else layout.sum_per_cpu(value)
                if traffic is not None and traffic.packets:
                    found[(ip, direction)] = traffic
        return found


def _take_whole(bpf_map: BpfMap, chunk: int) -> Generator[tuple[memoryview, memoryview, int], None, bool]:
    """Yield every entry of ``bpf_map`` in batches, taking them (see :meth:`EbpfDatapath.take_flow_batches`);
    returns whether the map was taken whole (False: an error stopped it, logged)."""
    taken = 0
    try:
        for keys, values, count in bpf_map.take_batches(chunk):
            taken += count
            yield keys, values, count
    except BpfCallError as error:
        if error.errno not in BATCH_UNSUPPORTED:
            log.warning("flows drain of %s stopped after %d entries (%s); the rest waits for the next drain",
                        bpf_map.name, taken, error)
            return False
        log.debug("flows: no batch lookup-and-delete (%s), taking entries one by one", error)
        items = bpf_map.take_each()
        if items:
            keys_joined = b"".join(key for key, _ in items)
            values_joined = b"".join(value for _, value in items)
            yield memoryview(keys_joined), memoryview(values_joined), len(items)
    return True


def _clear(bpf_map: BpfMap) -> None:
    """Delete every entry (batched; key by key on a kernel without the batch operation)."""
    try:
        for _ in bpf_map.take_batches():
            pass
    except BpfCallError as error:
        if error.errno not in BATCH_UNSUPPORTED:
            raise
        bpf_map.take_each()


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
