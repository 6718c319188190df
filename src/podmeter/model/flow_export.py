"""The pure rules of the flow export file (``podmeter agent --flow-export-file``): which records it keeps,
which fields of a flow it writes, where a file ends and which rotated files stay.

* :class:`ExportSelector`: Hubble's exporter's allow and deny lists, made of ``podmeter observe``'s
  filters (:class:`~podmeter.model.flow_records.FlowFilter`): a record is written when it matches one
  allow filter (or there is none) and no deny filter.
* :func:`mask_tree` / :func:`apply_mask`: a field mask (Flow field paths such as ``source.namespace``)
  applied to a flow as its protobuf-JSON object: the paths' values are kept, the rest is left out.
* :func:`plan_writes`: how a batch of lines goes into size-bounded files: a file is rotated before the
  line that would take it past ``max_bytes``, never in the middle of a line.
* :func:`backup_name`, :func:`is_backup`, :func:`expired`: rotated files are named by the time of their
  rotation, so their names sort as their age; those beyond the newest ``keep`` are removed.

Next stage: ``adapters.flow_export`` writes the lines in a worker thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from podmeter.model.flow_records import FlowFilter, FlowRecord

# --- which records ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportSelector:
    """Which records go into the export file: ``allow`` (any of them; none: every record), minus ``deny``
    (any of them)."""

    allow: tuple[FlowFilter, ...] = ()
    deny: tuple[FlowFilter, ...] = ()

    @property
    def everything(self) -> bool:
        """Whether every record is written (the flow feed's readers then skip matching)."""
        return not self.deny and (not self.allow or any(f.everything for f in self.allow))

    def matches(self, record: FlowRecord) -> bool:
        if self.allow and not any(f.matches(record) for f in self.allow):
            return False
        return not any(f.matches(record) for f in self.deny)


# --- which fields -------------------------------------------------------------------------------------

# A field mask as a tree: each key a field, its value the mask of its sub-fields ({}: the whole field).
MaskTree = dict[str, "MaskTree"]


def mask_paths(text: str) -> tuple[str, ...]:
    """``time, source.namespace`` -> ("time", "source.namespace"): comma-separated paths, blanks left out;
    ValueError for a path with an empty part (``source.``)."""
    paths = tuple(part.strip() for part in text.split(",") if part.strip())
    for path in paths:
        if any(not name for name in path.split(".")):
            raise ValueError(f"field mask path {path!r}: expected field names separated by dots")
    return paths


def mask_tree(paths: Iterable[str]) -> MaskTree:
    """The tree of ``paths``; a path under another one adds nothing (``source`` keeps all of ``source``)."""
    tree: MaskTree = {}
    for path in sorted(set(paths), key=lambda p: p.count(".")):  # shorter paths first: they cover longer ones
        node = tree
        names = path.split(".")
        for depth, name in enumerate(names):
            if name in node and not node[name]:
                break  # a shorter path keeps this whole field already
            node = node.setdefault(name, {}) if depth < len(names) - 1 else _leaf(node, name)
    return tree


def _leaf(node: MaskTree, name: str) -> MaskTree:
    node[name] = {}
    return node[name]


def apply_mask(tree: MaskTree, message: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``message`` (a protobuf-JSON object) that ``tree`` names; an empty tree keeps all. A field
    the message does not have (proto3 leaves out defaults) is absent from the result too; a value without
    fields (a scalar, a list) under a longer path is kept whole (``adapters.flow_export`` refuses such paths
    when the agent starts)."""
    if not tree:
        return dict(message)
    out: dict[str, Any] = {}
    for name, value in message.items():  # in the message's order (protobuf's: by field number)
        sub = tree.get(name)
        if sub is not None:
            out[name] = apply_mask(sub, value) if sub and isinstance(value, Mapping) else value
    return out


# --- where a file ends --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """Lines ``start`` to ``stop`` (exclusive) of a batch, written to one file, after a rotation if
    ``rotate_first``."""

    start: int
    stop: int
    rotate_first: bool


def plan_writes(size: int, lengths: Sequence[int], max_bytes: int) -> list[Chunk]:
    """How lines of these ``lengths`` go to a file holding ``size`` bytes: in order, each file at most
    ``max_bytes`` (a line longer than that alone in its file), a rotation only before a line that would not fit."""
    chunks: list[Chunk] = []
    start, rotate = 0, False
    for index, length in enumerate(lengths):
        if size > 0 and size + length > max_bytes:
            if index > start:
                chunks.append(Chunk(start, index, rotate))
            start, rotate, size = index, True, 0
        size += length
    if start < len(lengths):
        chunks.append(Chunk(start, len(lengths), rotate))
    return chunks


# --- which rotated files stay ---------------------------------------------------------------------------

_STAMP = "%Y-%m-%dT%H-%M-%S"
_STAMP_LENGTH = len("2006-01-02T15-04-05.000")


def _split(name: str) -> tuple[str, str]:
    """``events.log`` -> (``events``, ``.log``); a name without an extension has an empty one."""
    stem, dot, extension = name.rpartition(".")
    return (stem, dot + extension) if dot and stem else (name, "")


def backup_name(name: str, when: float) -> str:
    """The name a file ``name`` takes when it is rotated at ``when`` (epoch seconds): the UTC time to the
    millisecond between its stem and its extension (``events-2026-01-02T03-04-05.678.log``), so that the
    backups' names sort as their age."""
    stem, extension = _split(name)
    millis = int(when * 1000) % 1000
    return f"{stem}-{time.strftime(_STAMP, time.gmtime(int(when)))}.{millis:03d}{extension}"


def is_backup(candidate: str, name: str) -> bool:
    """Whether ``candidate`` is a name :func:`backup_name` gives to a rotated ``name``."""
    stem, extension = _split(name)
    prefix = stem + "-"
    if not (candidate.startswith(prefix) and candidate.endswith(extension)):
        return False
    stamp = candidate[len(prefix):len(candidate) - len(extension)]
    if len(stamp) != _STAMP_LENGTH or stamp[-4] != ".":
        return False
    try:
        time.strptime(stamp[:-4], _STAMP)
    except ValueError:
        return False
    return stamp[-3:].isdigit()


def expired(names: Iterable[str], name: str, keep: int) -> list[str]:
    """The backups of ``name`` among ``names`` beyond the newest ``keep``, oldest first."""
    backups = sorted(n for n in names if is_backup(n, name))
    return backups[:max(0, len(backups) - keep)]
