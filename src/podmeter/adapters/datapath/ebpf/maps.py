"""A BPF map seen through a file descriptor: raw byte keys and values, batch operations with counts.

Keys and values here are ``bytes`` in the kernel's layout; :mod:`.layout` encodes and decodes them.
For per-CPU maps a value is the kernel's whole per-CPU array: ``stride * possible_cpus`` bytes, where
``stride = round_up(value_size, 8)``; a lookup writes that many bytes, so buffers are always that size.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from podmeter.adapters.datapath.ebpf.libbpf import (
    BPF_ANY,
    BPF_MAP_TYPE_PERCPU_HASH,
    BpfCallError,
    Libbpf,
    MapBatchOpts,
    MapInfo,
    libbpf,
)

_BATCH_CHUNK = 4096  # elements per BPF_MAP_LOOKUP_BATCH call
TAKE_CHUNK = 8192  # elements per BPF_MAP_LOOKUP_AND_DELETE_BATCH call (640 KiB of 40-byte keys and values)
ENOTSUPP = 524  # what the bpf() syscall returns for a batch operation the map type lacks
# Errors of a batch call that mean "this kernel or map type has no such batch operation".
BATCH_UNSUPPORTED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, ENOTSUPP})

# Map types whose values are per-CPU arrays (hash, array, LRU hash, cgroup storage).
_PER_CPU_TYPES = frozenset({BPF_MAP_TYPE_PERCPU_HASH, 6, 10, 21})
BPF_MAP_TYPE_ARRAY_OF_MAPS = 12  # uapi; a value written is an inner map's fd, a value read its map id


@dataclass(frozen=True, slots=True)
class MapShape:
    """What makes two maps interchangeable: type, sizes, flags; and how many entries fit."""

    type: int
    key_size: int
    value_size: int
    map_flags: int
    max_entries: int

    def compatible(self, other: MapShape) -> bool:
        """Same layout (a resize changes only ``max_entries``)."""
        return (self.type, self.key_size, self.value_size, self.map_flags) == (
            other.type,
            other.key_size,
            other.value_size,
            other.map_flags,
        )

    def same_entries(self, other: MapShape) -> bool:
        """Same key and value layout, whatever the map type: the entries of one can be copied into the other."""
        return (self.key_size, self.value_size, self.map_flags) == (other.key_size, other.value_size, other.map_flags)


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """The first ``applied`` elements took effect; ``error`` (an errno) stopped the rest, if any."""

    applied: int
    error: BpfCallError | None = None


class BpfMap:
    """Owns one map file descriptor (closed by :meth:`close`, which must come last).

    Calls from several threads may overlap: after construction nothing but the kernel's map changes.
    """

    def __init__(self, fd: int, name: str, lib: Libbpf | None = None) -> None:
        self.fd = fd
        self.name = name
        self._lib = lib or libbpf()
        self.id = 0  # the kernel's map id (what a map-in-map slot reads back)
        self.shape = self._read_shape()
        per_cpu = self.shape.type in _PER_CPU_TYPES
        stride = (self.shape.value_size + 7) // 8 * 8
        self.value_bytes = stride * self._lib.possible_cpus if per_cpu else self.shape.value_size
        self.per_cpu = per_cpu

    @classmethod
    def open_pinned(cls, path: str) -> BpfMap:
        """Open a map pinned at ``path`` (raises BpfCallError, e.g. ENOENT)."""
        lib = libbpf()
        fd = lib.call("bpf_obj_get", os.fsencode(path))
        try:
            return cls(fd, os.path.basename(path), lib)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def pin(self, path: str) -> None:
        self._lib.call("bpf_obj_pin", self.fd, os.fsencode(path))

    # --- single elements -----------------------------------------------------------------------

    def lookup(self, key: bytes) -> bytes | None:
        value = ctypes.create_string_buffer(self.value_bytes)
        ret = self._lib.lib.bpf_map_lookup_elem(self.fd, self._key(key), value)
        if ret == -errno.ENOENT:
            return None
        self._lib.check("bpf_map_lookup_elem", ret)
        return value.raw

    def update(self, key: bytes, value: bytes, flags: int = BPF_ANY) -> None:
        self._check_value(value)
        self._lib.call("bpf_map_update_elem", self.fd, self._key(key), value, flags)

    def delete(self, key: bytes) -> bool:
        """Delete one key; False if it was absent."""
        ret = self._lib.lib.bpf_map_delete_elem(self.fd, self._key(key))
        if ret == -errno.ENOENT:
            return False
        self._lib.check("bpf_map_delete_elem", ret)
        return True

    def take(self, key: bytes) -> bytes | None:
        """Read and delete one key atomically (no increment lands between the read and the delete)."""
        value = ctypes.create_string_buffer(self.value_bytes)
        ret = self._lib.lib.bpf_map_lookup_and_delete_elem(self.fd, self._key(key), value)
        if ret == -errno.ENOENT:
            return None
        self._lib.check("bpf_map_lookup_and_delete_elem", ret)
        return value.raw

    # --- whole map ------------------------------------------------------------------------------

    def collect_keys(self) -> list[bytes]:
        """Every key, collected before anyone acts on them.

        ``get_next_key`` restarts from the first key when the current one was deleted meanwhile, so
        callers that delete must do it after this returns; duplicates from concurrent changes are
        dropped here.
        """
        size = self.shape.key_size
        current = ctypes.create_string_buffer(size)
        following = ctypes.create_string_buffer(size)
        seen: dict[bytes, None] = {}
        previous = None  # NULL: start from the first key
        for _ in range(4 * self.shape.max_entries + 16):  # bounded: restarts under heavy churn end
            ret = self._lib.lib.bpf_map_get_next_key(self.fd, previous, following)
            if ret == -errno.ENOENT:
                break
            self._lib.check("bpf_map_get_next_key", ret)
            ctypes.memmove(current, following, size)
            seen[current.raw] = None
            previous = current
        return list(seen)

    def is_empty(self) -> bool:
        """Whether the map holds no key now (one ``get_next_key`` from the start)."""
        first = ctypes.create_string_buffer(self.shape.key_size)
        ret = self._lib.lib.bpf_map_get_next_key(self.fd, None, first)
        if ret == -errno.ENOENT:
            return True
        self._lib.check("bpf_map_get_next_key", ret)
        return False

    def collect_items(self) -> list[tuple[bytes, bytes]]:
        """Every (key, value), read in chunks with BPF_MAP_LOOKUP_BATCH (two syscalls per entry
        otherwise: 40,000 counters took 0.85 s one by one). Falls back to key-by-key reading on kernels
        or map types without batch lookup."""
        try:
            return self._lookup_batches()
        except BpfCallError as error:
            if error.errno not in BATCH_UNSUPPORTED:
                raise
        return self.collect_items_one_by_one()

    def collect_items_one_by_one(self) -> list[tuple[bytes, bytes]]:
        """Every (key, value) present at the time of its lookup, one key at a time."""
        out = []
        for key in self.collect_keys():
            value = self.lookup(key)
            if value is not None:
                out.append((key, value))
        return out

    def take_batches(self, chunk: int = TAKE_CHUNK) -> Iterator[tuple[memoryview, memoryview, int]]:
        """Read and delete every entry with BPF_MAP_LOOKUP_AND_DELETE_BATCH, a chunk at a time.

        Yields ``(keys, values, count)``: the packed key and value arrays of one chunk and how many
        entries they hold. The buffers are reused for the next chunk: decode them before asking for it.
        Each entry is read and deleted at once (under its hash bucket's lock), so an entry is yielded at
        most once, and one created meanwhile is in this pass or left for the next. A BpfCallError after
        some chunks leaves the rest in the map; one in :data:`BATCH_UNSUPPORTED` on the first call means
        the kernel lacks the operation for this map (see :meth:`take_each`).
        """
        chunk = max(1, min(self.shape.max_entries, chunk))
        token = max(self.shape.key_size, 8)  # hash maps use a bucket index
        position, following = ctypes.create_string_buffer(token), ctypes.create_string_buffer(token)
        opts = MapBatchOpts(ctypes.sizeof(MapBatchOpts), 0, 0)
        keys, values = self._batch_buffers(chunk)
        start = None  # NULL: from the beginning
        while True:
            count = ctypes.c_uint32(chunk)
            ret = self._lib.lib.bpf_map_lookup_and_delete_batch(
                self.fd, start, following, keys, values, ctypes.byref(count), ctypes.byref(opts)
            )
            if ret == -errno.ENOSPC and count.value == 0:  # one bucket holds more than a chunk: nothing taken
                chunk *= 2
                keys, values = self._batch_buffers(chunk)
                continue
            # The count is the kernel's only on success or ENOENT (the end, with the last chunk); an error
            # found before any work (EINVAL, ENOTSUPP) leaves the count we passed in.
            self._lib.check("bpf_map_lookup_and_delete_batch", 0 if ret == -errno.ENOENT else ret)
            if count.value:
                yield memoryview(keys), memoryview(values), min(count.value, chunk)
            if ret == -errno.ENOENT:
                return
            ctypes.memmove(position, following, token)
            start = position

    def take_each(self) -> list[tuple[bytes, bytes]]:
        """:meth:`take_batches` one key at a time: keys collected first (so no key is seen twice), then
        each read and deleted at once; a key gone meanwhile is skipped."""
        out = []
        for key in self.collect_keys():
            value = self.take(key)
            if value is not None:
                out.append((key, value))
        return out

    def _batch_buffers(self, chunk: int) -> tuple[ctypes.Array[ctypes.c_char], ctypes.Array[ctypes.c_char]]:
        return (
            ctypes.create_string_buffer(chunk * self.shape.key_size),
            ctypes.create_string_buffer(chunk * self.value_bytes),
        )

    def _lookup_batches(self) -> list[tuple[bytes, bytes]]:
        chunk = max(1, min(self.shape.max_entries, _BATCH_CHUNK))
        token = max(self.shape.key_size, 8)  # hash maps use a bucket index, others the last key
        position, following = ctypes.create_string_buffer(token), ctypes.create_string_buffer(token)
        opts = MapBatchOpts(ctypes.sizeof(MapBatchOpts), 0, 0)
        items: list[tuple[bytes, bytes]] = []
        start = None  # NULL: from the beginning
        while True:
            keys = ctypes.create_string_buffer(chunk * self.shape.key_size)
            values = ctypes.create_string_buffer(chunk * self.value_bytes)
            count = ctypes.c_uint32(chunk)
            ret = self._lib.lib.bpf_map_lookup_batch(
                self.fd, start, following, keys, values, ctypes.byref(count), ctypes.byref(opts)
            )
            if ret == -errno.ENOSPC and count.value == 0:  # one hash bucket holds more than a chunk
                chunk *= 2
                continue
            if ret < 0 and ret != -errno.ENOENT:
                self._lib.check("bpf_map_lookup_batch", ret)
            items.extend(self._split(keys.raw, values.raw, count.value))
            if ret == -errno.ENOENT:  # the end; the last chunk's count is valid
                return items
            ctypes.memmove(position, following, token)
            start = position

    def _split(self, keys: bytes, values: bytes, count: int) -> list[tuple[bytes, bytes]]:
        k, v = self.shape.key_size, self.value_bytes
        return [(keys[i * k : (i + 1) * k], values[i * v : (i + 1) * v]) for i in range(count)]

    # --- batches --------------------------------------------------------------------------------

    def update_batch(
        self, keys: Sequence[bytes], values: Sequence[bytes], flags: int = BPF_ANY
    ) -> BatchOutcome:
        """Write elements in order; the kernel stops at the first error and says how many it wrote."""
        if len(keys) != len(values):
            raise ValueError("update_batch needs one value per key")
        if not keys:
            return BatchOutcome(0)
        for value in values:
            self._check_value(value)
        count = ctypes.c_uint32(len(keys))
        opts = MapBatchOpts(ctypes.sizeof(MapBatchOpts), flags, 0)
        ret = self._lib.lib.bpf_map_update_batch(
            self.fd, self._keys(keys), b"".join(values), ctypes.byref(count), ctypes.byref(opts)
        )
        if ret == -ENOTSUPP:  # a kernel without batch writes for this map type
            return self.update_each(keys, values, flags)
        return self._outcome("bpf_map_update_batch", ret, count.value, len(keys))

    def update_each(self, keys: Sequence[bytes], values: Sequence[bytes], flags: int = BPF_ANY) -> BatchOutcome:
        """:meth:`update_batch` one element per syscall, with the same stop-at-first-error result."""
        for applied, (key, value) in enumerate(zip(keys, values, strict=True)):
            try:
                self.update(key, value, flags)
            except BpfCallError as error:
                return BatchOutcome(applied, error)
        return BatchOutcome(len(keys))

    def delete_batch(self, keys: Sequence[bytes]) -> BatchOutcome:
        """Delete elements in order; an absent key stops the batch with ENOENT."""
        if not keys:
            return BatchOutcome(0)
        count = ctypes.c_uint32(len(keys))
        opts = MapBatchOpts(ctypes.sizeof(MapBatchOpts), 0, 0)
        ret = self._lib.lib.bpf_map_delete_batch(
            self.fd, self._keys(keys), ctypes.byref(count), ctypes.byref(opts)
        )
        if ret == -ENOTSUPP:
            return self.delete_each(keys)
        return self._outcome("bpf_map_delete_batch", ret, count.value, len(keys))

    def delete_each(self, keys: Sequence[bytes]) -> BatchOutcome:
        """:meth:`delete_batch` one element per syscall (an absent key stops it with ENOENT)."""
        for applied, key in enumerate(keys):
            ret = self._lib.lib.bpf_map_delete_elem(self.fd, self._key(key))
            if ret < 0:
                return BatchOutcome(applied, BpfCallError("bpf_map_delete_elem", -ret))
        return BatchOutcome(len(keys))

    # --- internals ------------------------------------------------------------------------------

    def _outcome(self, function: str, ret: int, applied: int, asked: int) -> BatchOutcome:
        if ret >= 0:
            return BatchOutcome(asked)
        # On error the kernel reports the elements processed before the failing one.
        return BatchOutcome(min(applied, asked), BpfCallError(function, -ret))

    def _key(self, key: bytes) -> bytes:
        if len(key) != self.shape.key_size:
            raise ValueError(f"map {self.name}: key of {len(key)} bytes, expected {self.shape.key_size}")
        return key

    def _keys(self, keys: Sequence[bytes]) -> bytes:
        for key in keys:
            self._key(key)
        return b"".join(keys)

    def _check_value(self, value: bytes) -> None:
        if len(value) != self.value_bytes:
            raise ValueError(f"map {self.name}: value of {len(value)} bytes, expected {self.value_bytes}")

    def _read_shape(self) -> MapShape:
        info = MapInfo()
        length = ctypes.c_uint32(ctypes.sizeof(info))
        self._lib.call("bpf_obj_get_info_by_fd", self.fd, ctypes.byref(info), ctypes.byref(length))
        self.id = info.id
        return MapShape(info.type, info.key_size, info.value_size, info.map_flags, info.max_entries)
