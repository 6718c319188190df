"""The three PATCH flavours a real server accepts for JSON clients.

- JSON merge patch (RFC 7386): maps merge, ``null`` deletes, lists replace.
- JSON patch (RFC 6902): add, remove, replace, move, copy, test.
- Strategic merge patch (built-in kinds only): a merge patch whose lists of objects merge by a key
  (containers by ``name``, conditions by ``type``, podIPs by ``ip``...), whose primitive lists with a merge
  strategy (``finalizers``) take a union, and which honours the directives kubectl emits: ``$patch``
  (replace/delete/merge), ``$retainKeys``, ``$deleteFromPrimitiveList/<f>`` and ``$setElementOrder/<f>``.

Every function returns a new document and never mutates its input; a malformed patch raises
:class:`PatchError`, which the caller answers with the real server's status for it.
"""

from __future__ import annotations

import copy
from typing import Any

# Field name -> merge key, for lists of objects in the kinds served here.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "ports": "containerPort",
    "env": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "conditions": "type",
    "podIPs": "ip",
    "hostIPs": "ip",
    "ownerReferences": "uid",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "resourceClaims": "name",
    "readinessGates": "conditionType",
}
# Primitive lists whose strategy is "merge" (a union) rather than "replace".
MERGE_PRIMITIVE = {"finalizers"}


class PatchError(Exception):
    """The patch cannot be applied. ``code`` is 400 for a malformed patch, 422 for a failed ``test``."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


# --- JSON merge patch ----------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# --- JSON patch ----------------------------------------------------------------------------------------


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"json patch: invalid pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _container(doc: Any, parts: list[str]) -> Any:
    cur = doc
    for part in parts:
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise PatchError(f"jsonpatch: path /{'/'.join(parts)} does not exist")
    return cur


def _index(lst: list[Any], part: str, allow_end: bool) -> int:
    if part == "-" and allow_end:
        return len(lst)
    if not part.isdigit():
        raise PatchError(f"json patch: invalid array index {part!r}")
    index = int(part)
    if index > len(lst) or (index == len(lst) and not allow_end):
        raise PatchError(f"json patch: index {index} out of range")
    return index


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    return _container(doc, parts) if parts else doc


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    parent = _container(doc, parts[:-1])
    if isinstance(parent, dict):
        parent[parts[-1]] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, parts[-1], True), value)
    else:
        raise PatchError(f"json patch: cannot add at {path}")
    return doc


def _remove(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        raise PatchError("json patch: cannot remove the whole document")
    parent = _container(doc, parts[:-1])
    if isinstance(parent, dict):
        if parts[-1] not in parent:
            raise PatchError(f'jsonpatch remove operation does not apply: doc is missing path: "{path}"')
        del parent[parts[-1]]
    elif isinstance(parent, list):
        del parent[_index(parent, parts[-1], False)]
    else:
        raise PatchError(f"json patch: cannot remove {path}")
    return doc


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902. ``ops`` must be a list of operation objects."""
    if not isinstance(ops, list):
        raise PatchError("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or not isinstance(op.get("path"), str):
            raise PatchError("json patch: each operation needs an op and a path")
        name, path = op.get("op"), op["path"]
        if name in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f"json patch: {name} operation needs a value")
        if name == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif name == "remove":
            doc = _remove(doc, path)
        elif name == "replace":
            _get(doc, path)
            doc = _add(_remove(doc, path), path, copy.deepcopy(op["value"])) if _pointer(path) else op["value"]
        elif name in ("move", "copy"):
            source = op.get("from")
            if not isinstance(source, str):
                raise PatchError(f"json patch: {name} operation needs from")
            value = copy.deepcopy(_get(doc, source))
            if name == "move":
                doc = _remove(doc, source)
            doc = _add(doc, path, value)
        elif name == "test":
            if _get(doc, path) != op["value"]:
                raise PatchError(f"testing value {path} failed: test failed", code=422)
        else:
            raise PatchError(f"Unexpected kind: {name}")
    return doc


# --- strategic merge patch -----------------------------------------------------------------------------


def strategic_merge_patch(target: Any, patch: Any, keys: dict[str, str | None] | None = None) -> Any:
    """Strategic merge for the built-in kinds' known list semantics (see MERGE_KEYS). ``keys``: the
    kind's own list keys where they differ (a Service's ``ports`` merge by ``port``; None: atomic)."""
    if not isinstance(patch, dict):
        raise PatchError("strategic merge patch must be a JSON object")
    return _smp_map(target if isinstance(target, dict) else {}, patch, {**MERGE_KEYS, **(keys or {})})


def _smp_map(original: dict[str, Any], patch: dict[str, Any], keys: dict[str, str | None]) -> dict[str, Any]:
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return {}
    result = copy.deepcopy(original)
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list) and isinstance(value, list):
                result[field] = [v for v in result[field] if v not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            if isinstance(value.get("$patch"), str) and value["$patch"] == "delete":
                result.pop(key, None)
            else:
                base = result.get(key)
                result[key] = _smp_map(base if isinstance(base, dict) else {}, value, keys)
        elif isinstance(value, list):
            result[key] = _smp_list(key, result.get(key), value, keys)
        else:
            result[key] = copy.deepcopy(value)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _smp_list(field: str, original: Any, patch: list[Any], keys: dict[str, str | None]) -> list[Any]:
    base = original if isinstance(original, list) else []
    if field in MERGE_PRIMITIVE:
        return [*copy.deepcopy(base), *[v for v in patch if v not in base]]
    merge_key = keys.get(field)
    if merge_key is None or not all(isinstance(item, dict) for item in patch):
        if any(isinstance(i, dict) and i.get("$patch") == "replace" for i in patch):
            return [copy.deepcopy(i) for i in patch if not (isinstance(i, dict) and "$patch" in i)]
        return copy.deepcopy(patch)
    if any(item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(i) for i in patch if "$patch" not in i]
    result = copy.deepcopy(base)
    for item in patch:
        if merge_key not in item:
            raise PatchError(f"map: {item} does not contain declared merge key: {merge_key}")
        index = next(
            (i for i, o in enumerate(result) if isinstance(o, dict) and o.get(merge_key) == item[merge_key]),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(_smp_map({}, item, keys))
        else:
            result[index] = _smp_map(result[index], item, keys)
    return result
