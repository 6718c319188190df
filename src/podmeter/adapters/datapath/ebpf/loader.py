"""Loading the BPF object against the pinned maps: reuse, create, or resize-and-migrate each map.

For each map the object declares, the loader finds one of three cases:
* a pin with the same layout and size: the program is loaded against it (counters continue);
* no pin: libbpf creates the map at the configured size and it is pinned after the load;
* a pin with the same layout and another ``max_entries`` (``--filter-map-size`` changed): a new map is
  created at the new size, every entry is copied across, then the pin is swapped atomically (the
  kernel refuses to load against a pin of another size, and losing the filter would be worse).
A pin with another layout (type, key or value size, flags) is refused with :class:`PinMismatch`.
Maps named ``transient`` (the flows maps: entries that live until the next drain) are simpler: a pin of
another size or layout is replaced by a new empty map, and the entries it held are lost (logged). So is
a pin the caller names in ``replace`` (one whose layout matches but that cannot be reused: the
``flows`` slot map when the kernel cannot tell which inner maps it accepts).

Before an object is opened its maps' key and value structs, as its BTF lays them out, are compared with
the Python side's struct formats (:func:`check_layouts`): an object built from C that moved a field is
refused with :class:`LayoutMismatch`, naming the map, the struct and the member, instead of being read
wrongly.

After loading, the loader keeps duplicates of the program and map descriptors and closes the libbpf
object, so their lifetimes are independent of libbpf's.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from podmeter.adapters.datapath.ebpf import btf, layout
from podmeter.adapters.datapath.ebpf.errors import LoadFailed, PinMismatch
from podmeter.adapters.datapath.ebpf.libbpf import BpfCallError, Libbpf, TestRunOpts, libbpf
from podmeter.adapters.datapath.ebpf.maps import BPF_MAP_TYPE_ARRAY_OF_MAPS, BpfMap, MapShape
from podmeter.adapters.datapath.ebpf.pins import PinDir

log = logging.getLogger("podmeter.datapath.ebpf")


# struct __sk_buff (uapi) as far as BPF_PROG_TEST_RUN reads it: ifindex is at byte 40.
_SKB_IFINDEX, _SKB_CTX_SIZE = 40, 48
_IFINDEX = struct.Struct("=I")


@dataclass(frozen=True, slots=True)
class TestRun:
    """Result of BPF_PROG_TEST_RUN: the program's return value and the mean ns per repetition."""

    __test__ = False  # not a pytest class
    retval: int
    duration_ns: int


class Program:
    """A loaded BPF program (owns its fd)."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name

    def test_run(self, frame: bytes, repeat: int = 1, *, ifindex: int = 0) -> TestRun:
        """Run the program on ``frame`` with the live maps (BPF_PROG_TEST_RUN); it counts like a packet.

        ``ifindex``: the interface the packet is on (``skb->ifindex``: the pod link the fairness rule
        charges), an interface of the calling thread's network namespace; 0 is the loopback device.
        """
        data = ctypes.create_string_buffer(frame, len(frame))
        opts = TestRunOpts(sz=ctypes.sizeof(TestRunOpts))
        opts.data_in = ctypes.cast(data, ctypes.c_void_p)
        opts.data_size_in = len(frame)
        opts.repeat = repeat
        if ifindex:
            ctx = ctypes.create_string_buffer(_SKB_CTX_SIZE)
            _IFINDEX.pack_into(ctx, _SKB_IFINDEX, ifindex)  # every other field 0, as the kernel requires
            opts.ctx_in = ctypes.cast(ctx, ctypes.c_void_p)
            opts.ctx_size_in = _SKB_CTX_SIZE
        libbpf().call("bpf_prog_test_run_opts", self.fd, ctypes.byref(opts))
        return TestRun(ctypes.c_int32(opts.retval).value, opts.duration)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LayoutMismatch(LoadFailed):
    """The object's map structs are not laid out as the Python side reads them; ``str(error)`` names each
    map, struct and member that differs."""


@functools.lru_cache(maxsize=16)
def _drift(path: str, modified_ns: int, size: int) -> tuple[str, ...]:
    return tuple(layout.drift(btf.read_object_btf(path).maps(), layout.all_mirrors()))


def check_layouts(path: Path) -> None:
    """Compare the key and value types of every map the object at ``path`` defines (its ``.BTF``) with the
    struct formats of ``layout.py`` and ``drops.py``; raise :class:`LayoutMismatch` if any differs, and
    :class:`~.errors.LoadFailed` if the object has no readable BTF. (A missing file is left to libbpf.)"""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return
    try:
        problems = _drift(str(path), stat.st_mtime_ns, stat.st_size)
    except (OSError, btf.BtfError) as error:
        raise LoadFailed(f"cannot read the BTF of {path} ({error}): rebuild it with `make bpf`") from error
    if problems:
        raise LayoutMismatch(
            f"{path} does not lay out its maps as podmeter reads them (a struct in bpf/ changed without its "
            "mirror in podmeter/adapters/datapath/ebpf/layout.py or drops.py, or the object is stale: "
            "`make bpf`): " + "; ".join(problems))


class BpfObject:
    """An opened (then loaded) libbpf ``bpf_object``; close it once the fds you need are duplicated.
    Opening checks the object's map layouts first (:func:`check_layouts`)."""

    def __init__(self, path: Path) -> None:
        check_layouts(path)
        self._lib = libbpf()
        self.path = path
        self._obj = self._lib.pointer(
            "bpf_object__open_file", self._lib.lib.bpf_object__open_file(os.fsencode(path), None)
        )

    def _map(self, name: str) -> int:
        handle = self._lib.lib.bpf_object__find_map_by_name(self._obj, name.encode())
        if not handle:
            raise LoadFailed(f"{self.path} declares no map {name!r}: rebuild it with `make bpf`")
        return int(handle)

    def map_shape(self, name: str) -> MapShape:
        """The layout the object declares for map ``name`` (max_entries as currently set)."""
        lib, handle = self._lib.lib, self._map(name)
        return MapShape(
            lib.bpf_map__type(handle),
            lib.bpf_map__key_size(handle),
            lib.bpf_map__value_size(handle),
            lib.bpf_map__map_flags(handle),
            lib.bpf_map__max_entries(handle),
        )

    def set_max_entries(self, name: str, entries: int) -> None:
        self._lib.call("bpf_map__set_max_entries", self._map(name), entries)

    def reuse(self, name: str, bpf_map: BpfMap) -> None:
        """Load against an existing map instead of creating one (libbpf dups the fd)."""
        self._lib.call("bpf_map__reuse_fd", self._map(name), bpf_map.fd)

    def load(self) -> None:
        self._lib.recent_warnings.clear()
        ret = self._lib.lib.bpf_object__load(self._obj)
        if ret < 0:
            raise LoadFailed(_load_failure(self.path, -ret, self._lib))

    def take_map(self, name: str) -> BpfMap:
        """A map of the loaded object, on a duplicated fd that outlives the object."""
        fd = self._lib.call("bpf_map__fd", self._map(name))
        return BpfMap(os.dup(fd), name, self._lib)

    def take_program(self, name: str) -> Program:
        handle = self._lib.lib.bpf_object__find_program_by_name(self._obj, name.encode())
        if not handle:
            raise LoadFailed(f"{self.path} has no program {name!r}: rebuild it with `make bpf`")
        fd = self._lib.call("bpf_program__fd", handle)
        return Program(os.dup(fd), name)

    def close(self) -> None:
        if self._obj:
            self._lib.lib.bpf_object__close(self._obj)
            self._obj = 0


@dataclass
class Loaded:
    """What a load produced: every map (pinned) and every program asked for, each owning its fd."""

    maps: dict[str, BpfMap]
    programs: dict[str, Program]

    def close(self) -> None:
        for bpf_map in self.maps.values():
            bpf_map.close()
        for program in self.programs.values():
            program.close()


def load(
    path: Path,
    pins: PinDir | None,
    sizes: dict[str, int],
    programs: list[str],
    transient: frozenset[str] = frozenset(),
    *,
    replace: frozenset[str] = frozenset(),
    convert: frozenset[str] = frozenset(),
) -> Loaded:
    """Load the object at ``path`` with each map in ``sizes`` at that size, pinned in ``pins``.

    With ``pins=None`` nothing is reused or pinned (benchmarks, the parse-only program). A pinned map
    named in ``transient`` that does not match is replaced, not migrated or refused; one named in
    ``replace`` (transient too) is replaced even when it matches; one named in ``convert`` whose pin is
    of another map type with the same key and value layout (an older release's) is migrated into a map
    of the type this object declares, as a resize is.
    """
    obj = BpfObject(path)
    old: dict[str, BpfMap] = {}
    try:
        try:
            migrate, replaced = _plan(obj, pins, sizes, old, transient, always=replace, convert=convert)
            obj.load()
            loaded = _take(obj, list(sizes), programs)
        finally:
            obj.close()
        if pins is not None:
            try:
                _pin_new_maps(pins, loaded.maps, old, migrate, replaced)
            except BaseException:
                loaded.close()
                raise
        return loaded
    finally:
        for bpf_map in old.values():
            bpf_map.close()


def _take(obj: BpfObject, maps: list[str], programs: list[str]) -> Loaded:
    loaded = Loaded({}, {})
    try:
        loaded.maps.update((name, obj.take_map(name)) for name in maps)
        loaded.programs.update((name, obj.take_program(name)) for name in programs)
    except BaseException:
        loaded.close()
        raise
    return loaded


def _plan(
    obj: BpfObject,
    pins: PinDir | None,
    sizes: dict[str, int],
    old: dict[str, BpfMap],
    transient: frozenset[str],
    *,
    always: frozenset[str],
    convert: frozenset[str] = frozenset(),
) -> tuple[set[str], set[str]]:
    """Size every map, reuse matching pins; fill ``old`` with the pins found; return the maps to migrate
    and the (transient) maps to replace (``always``: whatever their layout)."""
    migrate: set[str] = set()
    replace: set[str] = set()
    for name, entries in sizes.items():
        obj.set_max_entries(name, entries)
        if pins is None or not pins.has(name):
            continue
        pinned = old[name] = pins.open(name)
        wanted = obj.map_shape(name)
        if name in transient or name in always:
            if name not in always and pinned.shape.compatible(wanted) and pinned.shape.max_entries == entries:
                obj.reuse(name, pinned)
            else:
                replace.add(name)
            continue
        if not pinned.shape.compatible(wanted):
            if name in convert and pinned.shape.same_entries(wanted):
                migrate.add(name)
                continue
            raise PinMismatch(
                f"pinned map {pins.pin_path(name)} has layout {pinned.shape} but this podmeter needs "
                f"{wanted}: it was left by another version. Remove it (`rm {pins.pin_path(name)}`, its "
                "entries are lost) and start again"
            )
        if pinned.shape.max_entries == entries:
            obj.reuse(name, pinned)
        else:
            migrate.add(name)
    return migrate, replace


def _pin_new_maps(
    pins: PinDir, maps: dict[str, BpfMap], old: dict[str, BpfMap], migrate: set[str], replace: set[str]
) -> None:
    for name, bpf_map in maps.items():
        if name in replace:
            if old[name].shape.type == BPF_MAP_TYPE_ARRAY_OF_MAPS:  # holds maps, not entries of its own
                log.warning("pinned map %s (%s) replaced by a new one (%s)", name, _describe(old[name].shape),
                            _describe(bpf_map.shape))
            else:
                log.warning(
                    "pinned map %s (%s) replaced by a new one (%s): its %d undrained entries are lost",
                    name,
                    _describe(old[name].shape),
                    _describe(bpf_map.shape),
                    _count_entries(old[name]),
                )
            pins.install(bpf_map, name)
        elif name in migrate:
            copied, dropped = copy_entries(old[name], bpf_map)
            log.warning(
                "map %s migrated from (%s) to (%s): %d entries migrated, %d did not fit",
                name,
                _describe(old[name].shape),
                _describe(bpf_map.shape),
                copied,
                dropped,
            )
            pins.install(bpf_map, name)
        elif name not in old:
            pins.install(bpf_map, name)


def _describe(shape: MapShape) -> str:
    return (
        f"type {shape.type}, key {shape.key_size} B, value {shape.value_size} B, flags {shape.map_flags:#x}, "
        f"{shape.max_entries} entries"
    )


def _count_entries(bpf_map: BpfMap) -> int:
    try:
        return len(bpf_map.collect_keys())
    except BpfCallError:  # counting is only for the log line
        return -1


def copy_entries(source: BpfMap, target: BpfMap) -> tuple[int, int]:
    """Copy every entry of ``source`` into ``target``; return (copied, did not fit)."""
    items = source.collect_items()
    outcome = target.update_batch([k for k, _ in items], [v for _, v in items])
    return outcome.applied, len(items) - outcome.applied


def _load_failure(path: Path, err: int, lib: Libbpf) -> str:
    reason = BpfCallError("bpf_object__load", err)
    detail = "\n".join(list(lib.recent_warnings)[-12:])
    hint = ""
    if err in (1, 13):  # EPERM, EACCES
        hint = " Run as root (CAP_BPF and CAP_NET_ADMIN)."
    return f"loading {path} failed: {reason}.{hint}" + (f"\nlibbpf said:\n{detail}" if detail else "")
