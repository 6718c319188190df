"""Label and field selectors: parsing (with the real server's 400 messages) and matching.

Label selectors follow apimachinery's grammar: ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a)``,
``k``, ``!k``, ``k>n``, ``k<n``, requirements joined by commas (AND). Field selectors are only ``k=v``,
``k==v``, ``k!=v``; which keys exist depends on the resource, anything else is a 400
"field label not supported". Matching works on the pre-extracted ``labels`` and ``fields`` of a stored
object, so a watch fan-out never decodes JSON.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from podmeter.lab.apiserver.errors import bad_request

_KEY_RE = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Requirement:
    """One clause. ``op`` is one of ``=``, ``!=``, ``in``, ``notin``, ``exists``, ``!``, ``>``, ``<``."""

    key: str
    op: str
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        has = self.key in labels
        value = labels.get(self.key)
        if self.op in ("=", "in"):
            return has and value in self.values
        if self.op in ("!=", "notin"):
            return not has or value not in self.values
        if self.op == "exists":
            return has
        if self.op == "!":
            return not has
        if not has or value is None:
            return False
        try:
            number = int(value)
        except ValueError:
            return False
        bound = int(self.values[0])
        return number > bound if self.op == ">" else number < bound


@dataclass(frozen=True)
class Selector:
    """A conjunction of requirements; the empty selector matches everything."""

    requirements: tuple[Requirement, ...] = ()

    def matches(self, values: Mapping[str, str]) -> bool:
        return all(r.matches(values) for r in self.requirements)

    @property
    def empty(self) -> bool:
        return not self.requirements


EVERYTHING = Selector()


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def _check_key(key: str) -> None:
    if not key or len(key) > 316 or not _KEY_RE.match(key):
        raise bad_request(
            f'unable to parse requirement: key: Invalid value: "{key}": name part must consist of '
            "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
            "character"
        )


def _check_value(value: str) -> None:
    if len(value) > 63 or not _VALUE_RE.match(value):
        raise bad_request(
            f'unable to parse requirement: values[0][key]: Invalid value: "{value}": a valid label '
            "must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
            "must start and end with an alphanumeric character"
        )


_SET_RE = re.compile(r"^\s*(\S+)\s+(in|notin)\s*\((.*)\)\s*$")
_CMP_RE = re.compile(r"^\s*([^=!<>\s]+)\s*(==|=|!=|>|<)\s*(.*?)\s*$")


def _parse_label_clause(clause: str) -> Requirement:
    text = clause.strip()
    if not text:
        raise bad_request(f"unable to parse requirement: found '', expected: identifier in '{clause}'")
    m = _SET_RE.match(text)
    if m:
        key, op, raw = m.group(1), m.group(2), m.group(3)
        values = tuple(v.strip() for v in raw.split(",")) if raw.strip() else ()
        _check_key(key)
        if op == "in" and not values:
            raise bad_request(
                "unable to parse requirement: values: Invalid value: []: for 'in', 'notin' "
                "operators, values set can't be empty"
            )
        for v in values:
            _check_value(v)
        return Requirement(key, op, values)
    m = _CMP_RE.match(text)
    if m:
        key, op, value = m.group(1), m.group(2), m.group(3)
        _check_key(key)
        if op in (">", "<"):
            if not re.fullmatch(r"-?\d+", value):
                raise bad_request(
                    f"unable to parse requirement: for 'Gt', 'Lt' operators, the value must be an integer: {value}"
                )
        else:
            _check_value(value)
        return Requirement(key, "=" if op == "==" else op, (value,))
    if text.startswith("!"):
        key = text[1:].strip()
        _check_key(key)
        return Requirement(key, "!")
    _check_key(text)
    return Requirement(text, "exists")


def parse_label_selector(text: str | None) -> Selector:
    """Parse ``labelSelector``; 400 BadRequest with apimachinery's wording on a syntax error."""
    if not text or not text.strip():
        return EVERYTHING
    return Selector(tuple(_parse_label_clause(c) for c in _split_top_level(text)))


def _unescape_field(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


def parse_field_selector(text: str | None, supported: Collection[str]) -> Selector:
    """Parse ``fieldSelector`` against the resource's ``supported`` keys (400 on anything else)."""
    if not text or not text.strip():
        return EVERYTHING
    reqs = []
    for clause in re.split(r"(?<!\\),", text):
        m = re.fullmatch(r"\s*([^=!\s]+)\s*(==|=|!=)\s*(.*?)\s*", clause)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{clause}'")
        key, op, value = m.group(1), m.group(2), _unescape_field(m.group(3))
        if key not in supported:
            raise bad_request(f"field label not supported: {key}")
        reqs.append(Requirement(key, "!=" if op == "!=" else "=", (value,)))
    return Selector(tuple(reqs))
