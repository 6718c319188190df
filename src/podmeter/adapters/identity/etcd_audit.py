"""The etcd identity store, read without trusting it: every entry is checked, a corrupt one is named.

Layout under a prefix (see :mod:`podmeter.adapters.identity.etcd`)::

    id/<N>                     -> <E>    master: ID N belongs to the key encoded E
    key/<E>                    -> <N>    reverse master
    ref/<E>/<owner>            -> <N>    one operator's reference, bound to its lease

A **pair** is ``id/N -> E`` together with ``key/E -> N``, where N is a canonical decimal (no sign, no
leading zero, no spaces) inside the identity range and E is the canonical encoding of a valid key
(``IdentityKey.decode(E).encode() == E``). podmeter creates and removes the two masters of a pair in one
transaction, so in any one revision of a store only podmeter wrote, every master is half of a pair. Any
other entry is corrupt, of exactly one kind:

- ``not_a_number``: an ID that is not a canonical decimal (the value of ``key/E``, the ``N`` of ``id/N``);
- ``out_of_range``: an ID outside the range (every operator of one store has the same ``--identity-range``);
- ``bad_key``: an ``E`` (in ``key/E``, or the value of ``id/N``) that is not the canonical encoding of a key;
- ``duplicate_id``: ``key/E -> N`` while ``id/N`` names another key: two keys claim one ID;
- ``unpaired``: a master whose partner is missing or points elsewhere (``key/E -> N`` without ``id/N``;
  ``id/N -> E`` while ``key/E`` names another ID or is absent);
- ``bad_reference``: a reference without a lease (podmeter's always have one) or under a ``bad_key``.

So at most one key owns an ID whatever the store holds: a pair needs ``id/N``, and ``id/N`` has one value.
Podmeter's own transactions never turn a pair into a corrupt entry or a corrupt entry into a pair (a claim
needs both masters absent; the GC removes both), so an entry found corrupt stays corrupt until removed,
and removing it guarded by its ``mod_revision`` cannot remove anything podmeter wrote since.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from podmeter.model.identity import BadIdentityKey, IdentityKey

KINDS = ("not_a_number", "out_of_range", "bad_key", "duplicate_id", "unpaired", "bad_reference")
MAX_ID_DIGITS = 19  # an int64; anything longer is not an ID of any range


@dataclass(frozen=True, slots=True)
class Entry:
    """One key-value of the store, as read."""

    key: bytes
    value: bytes
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Corrupt:
    kind: str
    entry: Entry
    why: str


@dataclass(frozen=True, slots=True)
class Pair:
    """A consistent pair; ``mod_revision`` is that of ``key/E`` (the GC compares it)."""

    ident: int
    key: IdentityKey
    mod_revision: int


@dataclass
class Audit:
    """One revision of the store, checked.

    ``pairs``: E -> its pair. ``taken``: every in-range N some ``id/N`` entry names, paired or not (a claim
    of N needs ``id/N`` absent, so these are never offered). ``references``: E -> owners of its valid
    references (only when references were read). ``corrupt``: everything else.
    """

    pairs: dict[bytes, Pair] = field(default_factory=dict)
    taken: set[int] = field(default_factory=set)
    references: dict[bytes, set[str]] = field(default_factory=dict)
    corrupt: list[Corrupt] = field(default_factory=list)


class Layout:
    """The store's key names under ``prefix``."""

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self.ids = prefix + b"id/"
        self.keys = prefix + b"key/"
        self.refs = prefix + b"ref/"

    def id_key(self, ident: int) -> bytes:
        return self.ids + str(ident).encode()

    def master_key(self, enc: bytes) -> bytes:
        return self.keys + enc

    def ref_prefix(self, enc: bytes) -> bytes:
        return self.refs + enc + b"/"

    def ref_key(self, enc: bytes, owner: str) -> bytes:
        return self.ref_prefix(enc) + owner.encode()


def parse_id(raw: bytes) -> int | None:
    """``raw`` as an ID if it is a canonical decimal (what podmeter writes: ``str(N)``), else None."""
    if not raw or len(raw) > MAX_ID_DIGITS or not raw.isdigit() or (raw[:1] == b"0" and len(raw) > 1):
        return None
    return int(raw)  # isdigit() on bytes is ASCII only


def parse_key(enc: bytes) -> IdentityKey | None:
    """``enc`` as a key if it is the canonical encoding of one, else None."""
    try:
        key = IdentityKey.decode(enc.decode())
    except (UnicodeDecodeError, BadIdentityKey):
        return None
    return key if key.encode().encode() == enc else None


def id_problem(raw: bytes, first: int, last: int) -> tuple[str, str] | None:
    """Why ``raw`` is no ID of ``[first, last]`` (kind, words), or None if it is one."""
    ident = parse_id(raw)
    if ident is None:
        return "not_a_number", f"{raw[:40]!r} is not an ID"
    if not first <= ident <= last:
        return "out_of_range", f"ID {ident} is outside {first}-{last}"
    return None


def audit(layout: Layout, ids: Iterable[Entry], keys: Iterable[Entry], refs: Iterable[Entry] | None,
          *, first: int, last: int) -> Audit:
    """Check one revision of the store (entries read in one transaction) against the rules above."""
    out = Audit()
    forward: dict[int, bytes] = {}  # N -> E of every well-formed id/N entry
    id_entries: list[tuple[int, bytes, Entry]] = []
    for entry in ids:
        raw = entry.key[len(layout.ids):]
        problem = id_problem(raw, first, last)
        if problem is not None:
            out.corrupt.append(Corrupt(problem[0], entry, problem[1]))
            continue
        ident = int(raw)
        out.taken.add(ident)
        if parse_key(entry.value) is None:
            out.corrupt.append(Corrupt("bad_key", entry, f"ID {ident} names {entry.value[:60]!r}, not a key"))
            continue
        forward[ident] = entry.value
        id_entries.append((ident, entry.value, entry))
    reverse: dict[bytes, int] = {}  # E -> N of every pair
    for entry in keys:
        enc = entry.key[len(layout.keys):]
        key = parse_key(enc)
        if key is None:
            out.corrupt.append(Corrupt("bad_key", entry, f"{enc[:60]!r} is not a key"))
            continue
        problem = id_problem(entry.value, first, last)
        if problem is not None:
            out.corrupt.append(Corrupt(problem[0], entry, f"the master of {key}: {problem[1]}"))
            continue
        ident = int(entry.value)
        named = forward.get(ident)
        if named == enc:
            out.pairs[enc] = Pair(ident, key, entry.mod_revision)
            reverse[enc] = ident
        elif named is not None:
            out.corrupt.append(Corrupt("duplicate_id", entry,
                                       f"{key} claims ID {ident}, which belongs to {parse_key(named)}"))
        else:
            out.corrupt.append(Corrupt("unpaired", entry, f"{key} claims ID {ident}, which has no id/{ident}"))
    for ident, enc, entry in id_entries:
        if reverse.get(enc) != ident:
            out.corrupt.append(Corrupt("unpaired", entry,
                                       f"id/{ident} names {parse_key(enc)}, whose master does not name {ident}"))
    for entry in refs or ():
        enc, _, owner = entry.key[len(layout.refs):].rpartition(b"/")
        if parse_key(enc) is None:
            out.corrupt.append(Corrupt("bad_reference", entry, f"a reference under {enc[:60]!r}, not a key"))
        elif not entry.lease:
            out.corrupt.append(Corrupt("bad_reference", entry, "a reference without a lease"))
        else:
            out.references.setdefault(enc, set()).add(owner.decode(errors="replace"))
    return out
