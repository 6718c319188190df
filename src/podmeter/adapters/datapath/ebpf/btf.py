"""Reading the running kernel's BTF (``/sys/kernel/btf/vmlinux``): the few facts the drop programs need.

* the values of ``enum skb_drop_reason`` (and ``enum skb_drop_reason_subsys``), so drop reasons are named
  as the running kernel names them: names and numbers change between kernels, and a table typed into
  podmeter's source would silently mislabel drops on the next one;
* whether a BTF tracepoint exists (``typedef btf_trace_<name>``, what libbpf resolves a ``tp_btf/<name>``
  program against) and how many arguments it has (kernels add arguments to tracepoints).

The format (kernel Documentation/bpf/btf.rst): a header, a type section (each type a 12-byte
``struct btf_type`` followed by data whose size depends on its kind) and a string section. Type ids count
from 1 in file order. One pass over the type section finds everything; vmlinux has about 150,000 types
(tens of milliseconds).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

VMLINUX = "/sys/kernel/btf/vmlinux"
MAGIC = 0xEB9F
_HEADER = struct.Struct("=HBBIIIII")  # magic, version, flags, hdr_len, type_off, type_len, str_off, str_len
_TYPE = struct.Struct("=III")  # name_off, info, size_or_type

KIND_INT, KIND_PTR, KIND_ARRAY, KIND_STRUCT, KIND_UNION, KIND_ENUM = 1, 2, 3, 4, 5, 6
KIND_FWD, KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_FUNC = 7, 8, 9, 10, 11, 12
KIND_FUNC_PROTO, KIND_VAR, KIND_DATASEC, KIND_FLOAT, KIND_DECL_TAG, KIND_TYPE_TAG, KIND_ENUM64 = (
    13, 14, 15, 16, 17, 18, 19)


def _extra(kind: int, vlen: int) -> int:
    """Bytes of data after a ``struct btf_type`` of this kind."""
    if kind in (KIND_INT, KIND_VAR, KIND_DECL_TAG):
        return 4
    if kind == KIND_ARRAY:
        return 12
    if kind in (KIND_STRUCT, KIND_UNION, KIND_DATASEC, KIND_ENUM64):
        return 12 * vlen
    if kind in (KIND_ENUM, KIND_FUNC_PROTO):
        return 8 * vlen
    if kind in (KIND_PTR, KIND_FWD, KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_FUNC,
                KIND_FLOAT, KIND_TYPE_TAG):
        return 0
    raise BtfError(f"unknown BTF kind {kind}")


class BtfError(ValueError):
    """The data is not BTF podmeter can read."""


@dataclass(frozen=True)
class KernelBtf:
    """What podmeter reads from one BTF blob: enums by name (value by enumerator name) and BTF
    tracepoints by name (number of arguments, not counting the leading context pointer)."""

    enums: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    tracepoints: Mapping[str, int] = field(default_factory=dict)

    def enum(self, name: str) -> Mapping[str, int]:
        """The enumerators of ``enum name`` (empty when the kernel has no such enum)."""
        return self.enums.get(name, {})


def read_kernel_btf(path: str | os.PathLike[str] = VMLINUX, enums: Iterable[str] = (),
                    tracepoints: Iterable[str] = ()) -> KernelBtf:
    """Read ``path`` and return the named enums and tracepoints found in it.

    Raises OSError when the file cannot be read, :class:`BtfError` when it is not BTF.
    """
    return parse_btf(Path(path).read_bytes(), enums, tracepoints)


def parse_btf(data: bytes, enums: Iterable[str] = (), tracepoints: Iterable[str] = ()) -> KernelBtf:
    """:func:`read_kernel_btf` on bytes already read."""
    if len(data) < _HEADER.size:
        raise BtfError("too short for a BTF header")
    magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BtfError(f"bad BTF magic {magic:#x} (another byte order, or not BTF)")
    types_start, strings_start = hdr_len + type_off, hdr_len + str_off
    if types_start + type_len > len(data) or strings_start + str_len > len(data):
        raise BtfError("BTF sections run past the end of the data")
    strings = data[strings_start : strings_start + str_len]

    def text(offset: int) -> str:
        end = strings.find(b"\x00", offset)
        return strings[offset : end if end >= 0 else len(strings)].decode(errors="replace")

    wanted_enums = {_string_offset(strings, name): name for name in enums}
    wanted_tps = {_string_offset(strings, f"btf_trace_{name}"): name for name in tracepoints}
    wanted_enums.pop(-1, None)
    wanted_tps.pop(-1, None)

    offsets: list[int] = [0]  # by type id (id 0 is void)
    found_enums: dict[str, dict[str, int]] = {}
    typedefs: dict[str, int] = {}  # tracepoint name -> the typedef's target type id
    unpack, position, end = _TYPE.unpack_from, types_start, types_start + type_len
    while position < end:
        name_off, info, size_or_type = unpack(data, position)
        kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
        offsets.append(position)
        body = position + _TYPE.size
        if kind in (KIND_ENUM, KIND_ENUM64) and name_off in wanted_enums:
            found_enums[wanted_enums[name_off]] = _enumerators(data, body, kind, vlen, signed=bool(info >> 31),
                                                                  text=text)
        elif kind == KIND_TYPEDEF and name_off in wanted_tps:
            typedefs[wanted_tps[name_off]] = size_or_type
        position = body + _extra(kind, vlen)
    return KernelBtf(found_enums, {name: n for name, target in typedefs.items()
                                   if (n := _arguments(data, offsets, target)) is not None})


def _string_offset(strings: bytes, name: str) -> int:
    """The offset of ``name`` in the string section, or -1. (Each name is stored once in vmlinux.)"""
    raw = name.encode()
    if strings.startswith(raw + b"\x00"):
        return 0
    found = strings.find(b"\x00" + raw + b"\x00")
    return found + 1 if found >= 0 else -1


def _enumerators(data: bytes, body: int, kind: int, vlen: int, *, signed: bool,
                 text: Callable[[int], str]) -> dict[str, int]:
    out: dict[str, int] = {}
    if kind == KIND_ENUM:
        for name_off, value in struct.iter_unpack("=Ii" if signed else "=II", data[body : body + 8 * vlen]):
            out[text(name_off)] = value
    else:
        for name_off, low, high in struct.iter_unpack("=III", data[body : body + 12 * vlen]):
            value = high << 32 | low
            out[text(name_off)] = value - (1 << 64) if signed and high >> 31 else value
    return out


def _arguments(data: bytes, offsets: list[int], type_id: int) -> int | None:
    """Arguments of the function a ``btf_trace_*`` typedef points to, less the context pointer."""
    for _ in range(8):  # typedef -> (modifiers) -> ptr -> func_proto
        if not 0 < type_id < len(offsets):
            return None
        _name, info, size_or_type = _TYPE.unpack_from(data, offsets[type_id])
        kind = (info >> 24) & 0x1F
        if kind == KIND_FUNC_PROTO:
            return max(0, int(info & 0xFFFF) - 1)
        if kind not in (KIND_PTR, KIND_TYPEDEF, KIND_CONST, KIND_VOLATILE, KIND_RESTRICT, KIND_TYPE_TAG):
            return None
        type_id = size_or_type
    return None
