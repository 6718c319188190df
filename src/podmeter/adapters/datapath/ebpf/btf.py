"""Reading BTF: the running kernel's (``/sys/kernel/btf/vmlinux``), for the few facts the drop programs
need, and a built BPF object's (its ``.BTF`` section), for the layouts of its maps (:func:`read_object_btf`,
what ``layout.drift`` compares with the Python side's struct formats).

The kernel's:

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


# --- the BTF of a built BPF object: the layouts of its maps' keys and values ----------------------------------
#
# clang -g writes the object's types into its ELF section ``.BTF``, in the same format as vmlinux's. The
# maps of a libbpf object are the variables of the data section ``.maps``: each is a struct whose members
# say what the map is (``__uint(type, ...)`` is a pointer to an array of that many elements,
# ``__type(key, struct filter_key)`` a pointer to the key's type). So the object itself says which struct
# each map's key and value is, with every member's offset and size: what the Python side's struct formats
# must match (Cilium's alignchecker does the same for its Go mirrors).

_ELF_MAGIC = b"\x7fELF"
_ELF64_HEADER = "HHIQQQIHHHHHH"  # e_type ... e_shstrndx, after the 16 bytes of e_ident
_ELF64_SECTION = "IIQQQQIIQQ"  # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, ...


def elf_section(data: bytes, name: str) -> bytes | None:
    """The contents of the ELF section ``name`` of a 64-bit ELF file (None when it has no such section).
    Raises :class:`BtfError` when the data is not a 64-bit ELF file."""
    if len(data) < 64 or data[:4] != _ELF_MAGIC:
        raise BtfError("not an ELF file")
    if data[4] != 2:
        raise BtfError("not a 64-bit ELF file (BPF objects are)")
    order = "<" if data[5] == 1 else ">"
    header = struct.unpack_from(order + _ELF64_HEADER, data, 16)
    shoff, shentsize, shnum, shstrndx = header[5], header[10], header[11], header[12]
    section = struct.Struct(order + _ELF64_SECTION)
    if shoff == 0 or shentsize < section.size or shoff + shentsize * max(shnum, 1) > len(data):
        raise BtfError("the ELF section headers run past the end of the file")
    if shnum == 0:  # more than 0xff00 sections: the count is in section 0's sh_size (never for BPF objects)
        shnum = section.unpack_from(data, shoff)[5]
    if shstrndx == 0xFFFF:
        shstrndx = section.unpack_from(data, shoff)[6]
    headers = [section.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    if not 0 <= shstrndx < shnum:
        raise BtfError("the ELF section name table is missing")
    names_at, names_size = headers[shstrndx][4], headers[shstrndx][5]
    names = data[names_at : names_at + names_size]
    wanted = name.encode() + b"\x00"
    for sh_name, sh_type, _flags, _addr, offset, size, *_ in headers:
        if names[sh_name : sh_name + len(wanted)] == wanted:
            if sh_type == 8:  # SHT_NOBITS: no bytes in the file
                return b""
            if offset + size > len(data):
                raise BtfError(f"ELF section {name} runs past the end of the file")
            return data[offset : offset + size]
    return None


@dataclass(frozen=True)
class Member:
    """One member of a struct as BTF places it: name, offset (in bits, as BTF has it) and size in bytes;
    ``bits`` is a bitfield's width (0: not a bitfield)."""

    name: str
    bit_offset: int
    size: int
    bits: int = 0

    @property
    def offset(self) -> int:
        """The byte offset (of the byte holding a bitfield's first bit)."""
        return self.bit_offset // 8

    @property
    def whole_bytes(self) -> bool:
        """Whether the member starts on a byte and fills whole bytes (every member a struct format can mirror)."""
        return not self.bits and not self.bit_offset % 8


@dataclass(frozen=True)
class TypeLayout:
    """A type as the object lays it out: its C name (``struct flow_key``, ``__u32``), its size, and for a
    struct or union its members in declaration order (empty for a scalar or an array)."""

    name: str
    size: int
    members: tuple[Member, ...] = ()
    is_struct: bool = False


@dataclass(frozen=True)
class MapTypes:
    """What a map definition in ``.maps`` names: its key and value types (None when it names none, as a
    map-in-map's ``__array(values, ...)``)."""

    key: TypeLayout | None
    value: TypeLayout | None


@dataclass(frozen=True)
class _Type:
    kind: int
    name: str
    size_or_type: int
    kflag: bool
    members: tuple[tuple[str, int, int], ...] = ()  # (name, type id, offset word) of structs and unions;
    # ('', variable's type id, offset) of a datasec
    array: tuple[int, int] = (0, 0)  # (element type id, number of elements) for arrays


class ObjectBtf:
    """The types of one BTF blob, by id, and what they say about the ``.maps`` of a BPF object."""

    def __init__(self, types: list[_Type]) -> None:
        self._types = types  # index = type id; 0 is void

    @classmethod
    def parse(cls, data: bytes) -> ObjectBtf:
        """Every type of a BTF blob (the whole type section: objects have a few hundred)."""
        if len(data) < _HEADER.size:
            raise BtfError("too short for a BTF header")
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise BtfError(f"bad BTF magic {magic:#x} (another byte order, or not BTF)")
        position, end = hdr_len + type_off, hdr_len + type_off + type_len
        strings_start = hdr_len + str_off
        if end > len(data) or strings_start + str_len > len(data):
            raise BtfError("BTF sections run past the end of the data")
        strings = data[strings_start : strings_start + str_len]

        def text(offset: int) -> str:
            stop = strings.find(b"\x00", offset)
            return strings[offset : stop if stop >= 0 else len(strings)].decode(errors="replace")

        types = [_Type(0, "void", 0, False)]
        while position < end:
            name_off, info, size_or_type = _TYPE.unpack_from(data, position)
            kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, bool(info >> 31)
            body = position + _TYPE.size
            members: tuple[tuple[str, int, int], ...] = ()
            array = (0, 0)
            rows = struct.iter_unpack("=III", data[body : body + 12 * vlen]) if vlen and kind in (
                KIND_STRUCT, KIND_UNION, KIND_DATASEC) else ()
            if kind == KIND_DATASEC:  # struct btf_var_secinfo: type, offset, size
                members = tuple(("", var_type, offset) for var_type, offset, _size in rows)
            elif kind in (KIND_STRUCT, KIND_UNION):  # struct btf_member: name_off, type, offset
                members = tuple((text(m_name), m_type, m_offset) for m_name, m_type, m_offset in rows)
            elif kind == KIND_ARRAY:
                element, _index, count = struct.unpack_from("=III", data, body)
                array = (element, count)
            types.append(_Type(kind, text(name_off), size_or_type, kflag, members, array))
            position = body + _extra(kind, vlen)
        return cls(types)

    # --- types ------------------------------------------------------------------------------------------

    def _type(self, type_id: int) -> _Type:
        if not 0 <= type_id < len(self._types):
            raise BtfError(f"BTF type id {type_id} is out of range")
        return self._types[type_id]

    def _resolve(self, type_id: int) -> int:
        """Through typedefs and qualifiers to the type that has a layout."""
        for _ in range(32):
            found = self._type(type_id)
            if found.kind not in (KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_TYPE_TAG):
                return type_id
            type_id = found.size_or_type
        raise BtfError("a BTF typedef chain loops")

    def size(self, type_id: int) -> int:
        found = self._type(self._resolve(type_id))
        if found.kind in (KIND_INT, KIND_STRUCT, KIND_UNION, KIND_ENUM, KIND_ENUM64, KIND_FLOAT, KIND_DATASEC):
            return found.size_or_type
        if found.kind == KIND_PTR:
            return 8
        if found.kind == KIND_ARRAY:
            element, count = found.array
            return count * self.size(element)
        raise BtfError(f"BTF type {found.name or type_id} (kind {found.kind}) has no size")

    def type_name(self, type_id: int) -> str:
        """The C spelling of a type: ``struct flow_key``, ``__u32`` (a typedef's own name), ``__u8[16]``."""
        found = self._type(type_id)
        if found.kind == KIND_STRUCT:
            return f"struct {found.name or '(anonymous)'}"
        if found.kind == KIND_UNION:
            return f"union {found.name or '(anonymous)'}"
        if found.kind == KIND_ARRAY:
            return f"{self.type_name(found.array[0])}[{found.array[1]}]"
        if found.kind in (KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_TYPE_TAG):
            return self.type_name(found.size_or_type)
        return found.name or f"type {type_id}"

    def layout(self, type_id: int) -> TypeLayout:
        """The layout of a type: size, and members with their byte offsets for a struct or union."""
        resolved = self._type(self._resolve(type_id))
        members: list[Member] = []
        if resolved.kind in (KIND_STRUCT, KIND_UNION):
            for name, member_type, offset in resolved.members:
                # With kflag the offset word holds a bitfield's width in its top 8 bits.
                bits, bit_offset = (offset >> 24, offset & 0xFFFFFF) if resolved.kflag else (0, offset)
                size = (bits + 7) // 8 if bits else self.size(member_type)
                members.append(Member(name, bit_offset, size, bits))
        return TypeLayout(self.type_name(type_id), self.size(type_id), tuple(members),
                          resolved.kind in (KIND_STRUCT, KIND_UNION))

    def struct(self, name: str) -> TypeLayout | None:
        """The layout of ``struct name`` (None when the object has no such struct)."""
        for type_id, found in enumerate(self._types):
            if found.kind == KIND_STRUCT and found.name == name:
                return self.layout(type_id)
        return None

    # --- maps ---------------------------------------------------------------------------------------------

    def maps(self) -> dict[str, MapTypes]:
        """The maps the object defines (the variables of its ``.maps`` section) and their key and value
        types, from the ``key`` and ``value`` members of each definition (``__type(key, T)`` is a ``T *``)."""
        out: dict[str, MapTypes] = {}
        for found in self._types:
            if found.kind != KIND_DATASEC or found.name != ".maps":
                continue
            for _name, var_id, _offset in found.members:
                var = self._type(var_id)
                if var.kind != KIND_VAR:
                    continue
                definition = self._type(self._resolve(var.size_or_type))
                fields = {name: member_type for name, member_type, _ in definition.members}
                out[var.name] = MapTypes(self._pointee(fields.get("key")), self._pointee(fields.get("value")))
        return out

    def _pointee(self, type_id: int | None) -> TypeLayout | None:
        if type_id is None:
            return None
        pointer = self._type(self._resolve(type_id))
        if pointer.kind != KIND_PTR:
            return None
        return self.layout(pointer.size_or_type)


def read_object_btf(path: str | os.PathLike[str]) -> ObjectBtf:
    """The BTF of the BPF object file at ``path`` (its ``.BTF`` ELF section).

    Raises OSError when the file cannot be read, :class:`BtfError` when it is not an ELF file with BTF.
    """
    data = Path(path).read_bytes()
    section = elf_section(data, ".BTF")
    if section is None:
        raise BtfError(f"{path} has no .BTF section (built without clang -g?)")
    return ObjectBtf.parse(section)
