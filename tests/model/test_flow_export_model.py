"""The flow export's pure rules (``model.flow_export``): the field mask against a recompute path by path, the
rotation plan against a line-by-line writer, the rotated files' names and which of them stay, the allow and
deny lists."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flow_support import sample_records
from podmeter.model.flow_export import (
    ExportSelector,
    apply_mask,
    backup_name,
    expired,
    is_backup,
    mask_paths,
    mask_tree,
    plan_writes,
)
from podmeter.model.flow_records import FlowFilter

pytestmark = pytest.mark.fast

NAMES = st.sampled_from(["time", "source", "destination", "namespace", "pod_name", "verdict", "l4", "TCP"])
MESSAGES: st.SearchStrategy[dict[str, Any]] = st.recursive(
    st.dictionaries(NAMES, st.integers(0, 9), max_size=3),
    lambda inner: st.dictionaries(NAMES, inner | st.integers(0, 9), max_size=3), max_leaves=8)
PATHS = st.lists(st.lists(NAMES, min_size=1, max_size=3).map(".".join), max_size=6)


def value_at(message: Any, path: str) -> Any:
    """The value at ``path`` or a marker where the message has no such field."""
    for name in path.split("."):
        if not isinstance(message, dict) or name not in message:
            return MISSING
        message = message[name]
    return message


MISSING = object()


def covered(path: str, paths: list[str]) -> bool:
    """Whether a mask of ``paths`` keeps the field at ``path`` whole (a path it names or one under it)."""
    return any(path == p or path.startswith(p + ".") for p in paths)


@given(MESSAGES, PATHS)
def test_a_mask_keeps_exactly_the_named_fields_and_what_leads_to_them(message: dict[str, Any],
                                                                      paths: list[str]) -> None:
    masked = apply_mask(mask_tree(paths), message)
    for path in paths:  # every named field that the message has is kept whole
        found = value_at(message, path)
        if found is not MISSING and (not isinstance(found, dict) or covered(path, paths)):
            assert value_at(masked, path) == found
    if not paths:
        assert masked == message

    def check(node: Any, prefix: str) -> None:  # nothing else is kept
        for name, value in node.items():
            path = f"{prefix}{name}"
            original = value_at(message, path)
            assert original is not MISSING
            if covered(path, paths) or not isinstance(original, dict):  # a value without fields: whole
                assert value == original
            else:
                assert any(p.startswith(path + ".") for p in paths)
                check(value, path + ".")

    if paths:
        check(masked, "")


@given(MESSAGES, PATHS)
def test_masking_twice_is_masking_once(message: dict[str, Any], paths: list[str]) -> None:
    tree = mask_tree(paths)
    assert apply_mask(tree, apply_mask(tree, message)) == apply_mask(tree, message)


def test_mask_paths_are_comma_separated_and_need_every_part() -> None:
    assert mask_paths(" time, source.namespace ,,verdict") == ("time", "source.namespace", "verdict")
    assert mask_tree(["source.namespace", "source", "time"]) == {"source": {}, "time": {}}
    with pytest.raises(ValueError, match=r"source\."):
        mask_paths("time,source.")


def write_line_by_line(size: int, lengths: list[int], max_bytes: int) -> list[tuple[int, list[int]]]:
    """The reference: each line on its own, a new file when it would not fit in a non-empty one."""
    files: list[tuple[int, list[int]]] = [(size, [])]
    for index, length in enumerate(lengths):
        current, lines = files[-1]
        if current > 0 and current + length > max_bytes:
            files.append((0, []))
            current, lines = files[-1]
        files[-1] = (current + length, [*lines, index])
    return files


@given(st.integers(0, 500), st.lists(st.integers(1, 300), max_size=40), st.integers(1, 400))
def test_a_plan_writes_every_line_once_in_order_and_rotates_only_before_a_line_that_does_not_fit(
        size: int, lengths: list[int], max_bytes: int) -> None:
    chunks = plan_writes(size, lengths, max_bytes)
    assert [i for c in chunks for i in range(c.start, c.stop)] == list(range(len(lengths)))
    assert all(c.start < c.stop for c in chunks)
    files = [[i for i in range(c.start, c.stop)] for c in chunks]
    reference = [lines for _, lines in write_line_by_line(size, lengths, max_bytes) if lines]
    assert files == reference  # the same files as writing the lines one by one
    for chunk in chunks[1:]:
        assert chunk.rotate_first
    total = size
    for chunk in chunks:
        total = (0 if chunk.rotate_first else total) + sum(lengths[chunk.start:chunk.stop])
        assert total <= max_bytes or chunk.stop - chunk.start == 1 or (not chunk.rotate_first and size > max_bytes)


def test_rotated_files_are_named_by_their_time_and_the_oldest_go() -> None:
    name = backup_name("events.log", 1767322800.5)
    assert name == "events-2026-01-02T03-00-00.500.log"
    assert is_backup(name, "events.log")
    assert backup_name("flows", 0.0) == "flows-1970-01-01T00-00-00.000"
    for other in ("events.log", "events-2026-01-02.log", "other-2026-01-02T03-00-00.500.log",
                  "events-2026-13-02T03-00-00.500.log", "events-2026-01-02T03-00-00.5xx.log"):
        assert not is_backup(other, "events.log")
    backups = [backup_name("events.log", t) for t in (30.0, 10.0, 20.0, 40.0)]
    assert expired([*backups, "events.log", "notes.txt"], "events.log", 2) == [backups[1], backups[2]]
    assert expired(backups, "events.log", 0) == sorted(backups)
    assert expired(backups, "events.log", 9) == []


@given(st.lists(st.floats(0, 4e9), max_size=12), st.integers(0, 6))
def test_the_kept_backups_are_the_newest(times: list[float], keep: int) -> None:
    names = {backup_name("events.log", t): t for t in times}
    gone = set(expired(names, "events.log", keep))
    kept = set(names) - gone
    assert len(kept) == min(keep, len(names))
    assert all(names[k] >= names[g] for k in kept for g in gone)


def test_the_allow_and_deny_lists_are_hubbles() -> None:
    records = sample_records(6)  # odd ones to shop/db, even ones to the world; TCP, UDP, ICMP in turn
    def ports(selector: ExportSelector) -> list[int]:
        return [r.source.port - 40000 for r in records if selector.matches(r)]

    assert ExportSelector().everything and ports(ExportSelector()) == [0, 1, 2, 3, 4, 5]
    to_db = FlowFilter(to_pod="shop/db")
    assert ports(ExportSelector(allow=(to_db,))) == [1, 3, 5]
    assert ports(ExportSelector(allow=(to_db, FlowFilter(protocol="tcp")))) == [0, 1, 3, 5]  # any of them
    assert ports(ExportSelector(allow=(to_db,), deny=(FlowFilter(protocol="udp"),))) == [3, 5]
    assert ports(ExportSelector(deny=(to_db, FlowFilter(protocol="icmp")))) == [0, 4]
    assert not ExportSelector(allow=(to_db,)).everything and not ExportSelector(deny=(to_db,)).everything
