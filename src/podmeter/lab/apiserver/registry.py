"""The verbs: get, list, create, update, patch, delete, with the real server's semantics.

Every write is all-or-nothing: the new object is computed and validated completely before the single
``Store.commit`` that makes it visible, so a rejected request leaves no trace (no RV consumed, no event).
Server-owned metadata (uid, creationTimestamp, generation, resourceVersion, deletionTimestamp) is never
taken from the client. An update that changes nothing is a no-op: same RV, no event, like the real server.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import random
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from podmeter.lab.apiserver import errors, patching, validation
from podmeter.lab.apiserver.defaults import record_manager, sync_pod_ips
from podmeter.lab.apiserver.errors import ApiError, Cause
from podmeter.lab.apiserver.options import EXACT, ListOptions, encode_continue
from podmeter.lab.apiserver.resources import (
    ALL,
    ENDPOINTSLICES,
    META_FIELDS,
    NAMESPACES,
    PODS,
    SERVICES,
    ResourceType,
    drop_fields,
    unknown_fields,
)
from podmeter.lab.apiserver.services import ServiceAllocator, default_service_status
from podmeter.lab.apiserver.store import ADDED, DELETED, MODIFIED, Store, Stored, object_bytes

_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"
CONTINUE_EXPIRED = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new "
    "list without the continue parameter, or use the continue token in this response to retrieve the "
    "remainder of the results. Continuing with the provided token results in an inconsistent list - objects "
    "that were created, modified, or deleted between the time the first chunk was returned and now may show "
    "up in the list."
)
_PROTECTED_NAMESPACES = ("default", "kube-system", "kube-public")
PATCH_TYPES = (
    "application/merge-patch+json",
    "application/json-patch+json",
    "application/strategic-merge-patch+json",
)


def now_text() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class WriteContext:
    """Per-request write settings: field manager, ``fieldValidation``, ``dryRun``; collects warnings."""

    manager: str = "unknown"
    field_validation: str = "Warn"
    dry_run: bool = False
    warnings: list[str] = field(default_factory=list)


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        raise errors.bad_request("metadata must be an object")
    return meta


def _kind_check(resource: ResourceType, obj: Any) -> dict[str, Any]:
    """The decode step: a JSON object of this kind and group/version (400 otherwise)."""
    if not isinstance(obj, dict):
        raise errors.bad_request(
            f"the object provided is unrecognized (must be of type {resource.kind}): "
            "couldn't get version/kind; json parse error: expected an object"
        )
    kind, api_version = obj.get("kind", resource.kind), obj.get("apiVersion", resource.api_version)
    if api_version != resource.api_version:
        raise errors.bad_request(
            f"the API version in the data ({api_version}) does not match the expected API "
            f"version ({resource.api_version})"
        )
    if kind != resource.kind:
        raise errors.bad_request(
            f'{kind} in version "{resource.version}" cannot be handled as a {resource.kind}: '
            f"converting ({resource.version}.{kind}) to ({resource.kind}): unknown conversion"
        )
    obj.setdefault("metadata", {})
    for path, want, go in (
        ("metadata", dict, "ObjectMeta"),
        ("spec", dict, f"{resource.kind}Spec"),
        ("status", dict, f"{resource.kind}Status"),
    ):
        if path in obj and obj[path] is not None and not isinstance(obj[path], want):
            raise _type_error(resource, obj[path], f"{resource.kind}.{path}", go)
    meta = obj["metadata"]
    for mapping in ("labels", "annotations"):
        value = meta.get(mapping)
        if value is not None and (not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values())):
            bad = value if not isinstance(value, dict) else next(v for v in value.values() if not isinstance(v, str))
            raise _type_error(
                resource,
                bad,
                f"ObjectMeta.metadata.{mapping}",
                "map[string]string" if not isinstance(value, dict) else "string",
            )
    spec = obj.get("spec")
    if (
        resource is PODS
        and isinstance(spec, dict)
        and "containers" in spec
        and not isinstance(spec["containers"], list | type(None))
    ):
        raise _type_error(resource, spec["containers"], "PodSpec.spec.containers", "[]v1.Container")
    return obj


def _type_error(resource: ResourceType, value: Any, where: str, go_type: str) -> ApiError:
    json_type = {
        str: "string",
        int: "number",
        float: "number",
        bool: "bool",
        list: "array",
        dict: "object",
    }.get(type(value), "value")
    return errors.bad_request(
        f'{resource.kind} in version "{resource.version}" cannot be handled as a '
        f"{resource.kind}: json: cannot unmarshal {json_type} into Go struct field {where} "
        f"of type {go_type}"
    )


class Registry:
    """The API semantics over one :class:`Store`."""

    def __init__(self, store: Store, too_large_wait: float = 3.0, services: ServiceAllocator | None = None) -> None:
        self.store = store
        self.too_large_wait = too_large_wait
        # ClusterIPs and NodePorts: what the stored Services hold (a restored store is re-read).
        self.services = services or ServiceAllocator()
        self.services.rebuild((s.key, s.decode()) for s in store.items(SERVICES))

    # --- helpers ---------------------------------------------------------------------------------------
    def _key(self, resource: ResourceType, namespace: str | None, name: str) -> str:
        return f"{namespace}/{name}" if resource.namespaced else name

    def _existing(self, resource: ResourceType, namespace: str | None, name: str) -> Stored:
        stored = self.store.get(resource, self._key(resource, namespace, name))
        if stored is None:
            raise errors.not_found(resource.plural, name, resource.group)
        return stored

    def full(self, resource: ResourceType, stored: Stored) -> bytes:
        return object_bytes(resource, stored.body)

    def _check_fields(self, resource: ResourceType, obj: dict[str, Any], ctx: WriteContext) -> None:
        unknown = unknown_fields(obj, resource.schema)
        if not unknown:
            return
        if ctx.field_validation == "Strict":
            detail = ", ".join(f'unknown field "{p.lstrip(".")}"' for p in unknown)
            raise errors.bad_request(
                f'{resource.kind} in version "{resource.version}" cannot be handled as a '
                f"{resource.kind}: strict decoding error: {detail}"
            )
        if ctx.field_validation != "Ignore":
            ctx.warnings += [f'unknown field "{p.lstrip(".")}"' for p in unknown]
        drop_fields(obj, unknown)

    def _decode_check(self, resource: ResourceType, obj: dict[str, Any]) -> None:
        """What the real server's typed decoder refuses (a 400 before defaults and validation)."""
        if resource.decode_check is not None:
            problem = resource.decode_check(obj)
            if problem is not None:
                raise errors.bad_request(problem)

    def _validate(
        self, resource: ResourceType, obj: dict[str, Any], name: str, old: dict[str, Any] | None = None
    ) -> None:
        self._decode_check(resource, obj)
        meta = obj["metadata"]
        if old is not None and resource.validate_update is not None:
            causes = validation.validate_metadata(meta) + resource.validate_update(old, obj)
        else:
            causes = validation.validate_metadata(meta) + resource.validate(obj)
        if causes:
            raise errors.invalid(resource.kind, name, causes, resource.group)

    # --- reads -----------------------------------------------------------------------------------------
    def get(self, resource: ResourceType, namespace: str | None, name: str) -> bytes:
        return self.full(resource, self._existing(resource, namespace, name))

    async def wait_for_rv(self, rv: int) -> None:
        """A read at an RV newer than the server's waits ~3 s for it, then 504 (list-too-large-rv-504)."""
        if rv <= self.store.rv:
            return
        deadline = time.monotonic() + self.too_large_wait
        while self.store.rv < rv and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.store.rv < rv:
            raise errors.rv_too_large(rv, self.store.rv)

    async def list(self, resource: ResourceType, namespace: str | None, opts: ListOptions) -> bytes:
        """One page: the snapshot at the list RV, in key order, filtered, cut at ``limit``."""
        if opts.resource_version not in ("", "0"):
            await self.wait_for_rv(int(opts.resource_version))
        rv = self._list_rv(opts)
        table = self.store.snapshot(resource, rv)
        keys = sorted(table)
        if opts.continue_key is not None:
            keys = keys[bisect.bisect_right(keys, opts.continue_key) :]
        items, last_key, scanned = _page(table, keys, namespace, opts)
        meta = b'"resourceVersion":"' + str(rv).encode() + b'"'
        remaining = 0
        if opts.limit:
            remaining = sum(1 for k in keys[scanned:] if namespace is None or table[k].namespace == namespace)
        if remaining and last_key is not None:
            meta += b',"continue":"' + encode_continue(rv, last_key).encode() + b'"'
            if opts.labels.empty and opts.fields.empty:  # the real server omits it with selectors
                meta += b',"remainingItemCount":' + str(remaining).encode()
        head = (
            b'{"kind":"'
            + resource.list_kind.encode()
            + b'","apiVersion":"'
            + resource.api_version.encode()
            + b'","metadata":{'
            + meta
            + b'},"items":['
        )
        # One copy of the (possibly 70 MB) body: glue head and tail onto the end items, then join once.
        if not items:
            return head + b"]}"
        items[0] = head + items[0]
        items[-1] = items[-1] + b"]}"
        return b",".join(items)

    def _list_rv(self, opts: ListOptions) -> int:
        """The snapshot a list reads: the continue token's, the Exact RV, or now."""
        if opts.continue_rv is not None:
            if opts.continue_rv < self.store.floor:
                raise errors.expired(CONTINUE_EXPIRED)
            return opts.continue_rv
        if opts.match == EXACT:
            return int(opts.resource_version)
        return self.store.rv

    # --- create ----------------------------------------------------------------------------------------
    def create(self, resource: ResourceType, namespace: str | None, body: Any, ctx: WriteContext) -> bytes:
        obj = _kind_check(resource, body)
        self._check_fields(resource, obj, ctx)
        self._decode_check(resource, obj)
        meta = _meta(obj)
        _place(resource, meta, namespace)
        name = self._check_new_name(resource, meta)
        now = now_text()
        requested = copy.deepcopy(obj)
        obj = {
            "metadata": _fresh_metadata(resource, meta, name, now),
            **{k: v for k, v in obj.items() if k not in ("metadata", "kind", "apiVersion")},
        }
        if resource.has_status and resource is not NAMESPACES:
            obj.pop("status", None)  # set through the status subresource, as on a real server
        resource.default(obj)
        if resource is SERVICES:  # ClusterIPs and NodePorts, before validation (as beginCreate does)
            self.services.allocate_create(obj, ctx.dry_run)
        record_manager(obj, manager=ctx.manager, api_version=resource.api_version, now=now, touched=requested)
        if resource is NAMESPACES:
            labels = {"metadata": {"labels": obj["metadata"]["labels"]}}
            record_manager(obj, manager=ctx.manager, api_version=resource.api_version, now=now, touched=labels)
        self._validate(resource, obj, name)
        if ctx.dry_run:
            obj["metadata"]["resourceVersion"] = str(self.store.rv)
            return object_bytes(resource, _encode(obj))
        stored = self.store.commit(resource, ADDED, obj)
        if resource is SERVICES:
            self.services.record(stored.key, obj)
        return self.full(resource, stored)

    def _check_new_name(self, resource: ResourceType, meta: dict[str, Any]) -> str:
        """A valid, free name (generated from ``generateName`` if needed) in an existing namespace."""
        if not meta.get("name") and isinstance(meta.get("generateName"), str) and meta["generateName"]:
            meta["name"] = meta["generateName"] + "".join(random.choice(_NAME_CHARS) for _ in range(5))
        name = meta.get("name")
        name_causes = validation.validate_name(name, resource.dns_label_names, resource.dns1035_names)
        if name_causes or not isinstance(name, str):
            causes = name_causes + validation.validate_metadata(meta)
            raise errors.invalid(resource.kind, str(name or ""), causes, resource.group)
        if resource.namespaced:
            self._require_namespace(resource, str(meta["namespace"]), name)
        if self.store.get(resource, self._key(resource, meta.get("namespace"), name)) is not None:
            raise errors.already_exists(resource.plural, name, resource.group)
        return name

    def _require_namespace(self, resource: ResourceType, namespace: str, name: str) -> None:
        ns = self.store.get(NAMESPACES, namespace)
        if ns is None:
            raise errors.not_found("namespaces", namespace)
        if ns.fields.get("status.phase") == "Terminating":
            raise errors.forbidden(
                f'{resource.plural} "{name}" is forbidden: unable to create new content in '
                f"namespace {namespace} because it is being terminated",
                resource.plural,
                name,
                resource.group,
            )

    # --- update and patch ------------------------------------------------------------------------------
    def update(
        self,
        resource: ResourceType,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        subresource: str | None,
        ctx: WriteContext,
    ) -> bytes:
        obj = _kind_check(resource, body)
        self._check_fields(resource, obj, ctx)
        self._decode_check(resource, obj)
        meta = _meta(obj)
        if meta.get("name") not in (None, name):
            raise errors.bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})"
            )
        if resource.namespaced and meta.get("namespace") not in (None, "", namespace):
            raise errors.bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        current = self._existing(resource, namespace, name)
        rv = meta.get("resourceVersion")
        if not rv and not resource.unconditional_update and subresource is None:
            raise errors.invalid(
                resource.kind,
                name,
                [
                    Cause(
                        "FieldValueInvalid",
                        "Invalid value: 0x0: must be specified for an update",
                        "metadata.resourceVersion",
                    )
                ],
                resource.group,
            )
        if rv and str(rv) != str(current.rv):
            raise errors.conflict(resource.plural, name, resource.group)
        return self._replace(resource, current, obj, subresource=subresource, ctx=ctx, touched=obj)

    def patch(
        self,
        resource: ResourceType,
        namespace: str | None,
        name: str,
        *,
        patch_type: str,
        patch: Any,
        subresource: str | None,
        ctx: WriteContext,
    ) -> bytes:
        current = self._existing(resource, namespace, name)
        base = {"kind": resource.kind, "apiVersion": resource.api_version, **current.decode()}
        try:
            if patch_type == "application/json-patch+json":
                patched = patching.json_patch(base, patch)
            elif patch_type == "application/merge-patch+json":
                if not isinstance(patch, dict):
                    raise patching.PatchError("merge patch must be a JSON object")
                patched = patching.merge_patch(base, patch)
            else:
                if resource.group == "podmeter.io":
                    raise errors.unsupported_media_type(patch_type)
                patched = patching.strategic_merge_patch(base, patch, resource.merge_keys)
        except patching.PatchError as exc:
            if exc.code == 422:
                raise errors.invalid(
                    resource.kind, name, [Cause("FieldValueInvalid", str(exc))], resource.group
                ) from exc
            raise errors.bad_request(str(exc)) from exc
        obj = _kind_check(resource, patched)
        self._check_fields(resource, obj, ctx)
        self._decode_check(resource, obj)
        meta = _meta(obj)
        if meta.get("name") != name:
            raise errors.bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})"
            )
        rv = meta.get("resourceVersion")
        if rv and str(rv) != str(current.rv):
            raise errors.conflict(resource.plural, name, resource.group)
        touched = patch if isinstance(patch, dict) else obj
        return self._replace(resource, current, obj, subresource=subresource, ctx=ctx, touched=touched)

    def _replace(
        self,
        resource: ResourceType,
        current: Stored,
        requested: dict[str, Any],
        *,
        subresource: str | None,
        ctx: WriteContext,
        touched: Any,
    ) -> bytes:
        """The shared tail of update and patch: merge with server-owned state, validate, commit."""
        old = current.decode()
        old_meta = old["metadata"]
        if subresource == "status":
            new = _status_update(resource, current, requested)
            if resource is SERVICES:
                default_service_status(new)
        else:
            new = _main_update(resource, old, requested)
            if resource is SERVICES:  # allocation for the new spec, then PrepareForUpdate's cleanup
                self.services.prepare_update(new, old, ctx.dry_run)
        new["metadata"]["resourceVersion"] = old_meta.get("resourceVersion")
        if _same(new, old):
            return self.full(resource, current)
        section = (
            {"status": touched.get("status")} if subresource == "status" and isinstance(touched, dict) else touched
        )
        record_manager(
            new,
            manager=ctx.manager,
            api_version=resource.api_version,
            now=now_text(),
            touched=section if isinstance(section, dict) else {},
            subresource=subresource,
        )
        self._validate(resource, new, current.name, old if subresource is None else None)
        if ctx.dry_run:
            return object_bytes(resource, _encode(new))
        stored = self.store.commit(resource, MODIFIED, new)
        if resource is SERVICES:
            self.services.record(stored.key, new)
        return self.full(resource, stored)

    def bind(self, namespace: str | None, name: str, body: Any, ctx: WriteContext) -> bytes:
        """``pods/binding`` (what a scheduler posts): set ``spec.nodeName`` once, mark PodScheduled."""
        target = body.get("target") if isinstance(body, dict) else None
        node = target.get("name") if isinstance(target, dict) else None
        if not isinstance(node, str) or not node:
            raise errors.invalid("Binding", name, [Cause("FieldValueRequired", "Required value", "target.name")])
        current = self._existing(PODS, namespace, name)
        pod = current.decode()
        spec = pod.get("spec")
        if not isinstance(spec, dict):
            raise errors.internal(f"pod {name} has no spec")
        if spec.get("nodeName"):
            raise errors.conflict("pods", name, why=f'pod {name} is already assigned to node "{spec["nodeName"]}"')
        spec["nodeName"] = node
        status = pod.setdefault("status", {})
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
        conditions.append(
            {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now_text()}
        )
        status["conditions"] = conditions
        record_manager(
            pod,
            manager=ctx.manager,
            api_version="v1",
            now=now_text(),
            touched={"spec": {"nodeName": node}},
            subresource=None,
        )
        if not ctx.dry_run:
            self.store.commit(PODS, MODIFIED, pod)
        return b'{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Success","code":201}'

    # --- delete ----------------------------------------------------------------------------------------
    def delete(
        self,
        resource: ResourceType,
        namespace: str | None,
        name: str,
        *,
        options: dict[str, Any],
        graceful_pods: bool,
        ctx: WriteContext,
    ) -> bytes:
        current = self._existing(resource, namespace, name)
        raw_pre = options.get("preconditions")
        pre: dict[str, Any] = raw_pre if isinstance(raw_pre, dict) else {}
        if pre.get("uid") and pre["uid"] != current.uid:
            raise errors.conflict(
                resource.plural,
                name,
                resource.group,
                f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {current.uid}",
            )
        if pre.get("resourceVersion") and str(pre["resourceVersion"]) != str(current.rv):
            raise errors.conflict(
                resource.plural,
                name,
                resource.group,
                f"Precondition failed: ResourceVersion in precondition: "
                f"{pre['resourceVersion']}, ResourceVersion in object meta: {current.rv}",
            )
        if ctx.dry_run or options.get("dryRun"):  # kubectl puts it in the DeleteOptions body
            return self.full(resource, current)
        if resource is NAMESPACES:
            return self._delete_namespace(current)
        if resource is PODS:
            return self._delete_pod(current, options, graceful_pods)
        final = current.decode()
        stored = self.store.commit(resource, DELETED, final)
        if resource is SERVICES:  # its ClusterIPs and NodePorts are free again
            self.services.forget(stored.key)
        return self.full(resource, stored)

    def delete_collection(
        self,
        resource: ResourceType,
        namespace: str | None,
        opts: ListOptions,
        *,
        options: dict[str, Any],
        graceful_pods: bool,
        ctx: WriteContext,
    ) -> bytes:
        """Delete every object the selectors match (one by one, each its own events); the deleted list."""
        matching = [
            s
            for s in self.store.items(resource, namespace)
            if opts.labels.matches(s.labels) and opts.fields.matches(s.fields)
        ]
        full = [
            self.delete(resource, s.namespace or None, s.name, options=options, graceful_pods=graceful_pods, ctx=ctx)
            for s in matching
        ]
        items = b",".join(b"{" + f[len(resource.prefix) :] for f in full)  # list items lack kind/apiVersion
        return (
            b'{"kind":"'
            + resource.list_kind.encode()
            + b'","apiVersion":"'
            + resource.api_version.encode()
            + b'","metadata":{"resourceVersion":"'
            + str(self.store.rv).encode()
            + b'"},"items":['
            + items
            + b"]}"
        )

    def _delete_pod(self, current: Stored, options: dict[str, Any], graceful: bool) -> bytes:
        """Unbound pods go at once; bound ones get MODIFIED (deletionTimestamp) then DELETED, unless the
        server runs with graceful deletion and the grace period is positive: then only the MODIFIED, and a
        later delete with grace 0 (what a kubelet sends) finishes it."""
        pod = current.decode()
        if not current.fields.get("spec.nodeName"):
            return self.full(PODS, self.store.commit(PODS, DELETED, pod))
        grace = options.get("gracePeriodSeconds")
        if not isinstance(grace, int):
            raw_spec = pod.get("spec")
            spec: dict[str, Any] = raw_spec if isinstance(raw_spec, dict) else {}
            grace = int(spec.get("terminationGracePeriodSeconds", 30) or 0) if graceful else 0
        meta = pod["metadata"]
        if meta.get("deletionTimestamp") is None or grace < int(meta.get("deletionGracePeriodSeconds", 0) or 0):
            if meta.get("deletionTimestamp") is None:
                meta["generation"] = int(meta.get("generation", 1)) + 1
            meta["deletionTimestamp"] = now_text()
            meta["deletionGracePeriodSeconds"] = grace
            meta_order = {k: meta[k] for k in _meta_order(meta)}
            pod["metadata"] = meta_order
            current = self.store.commit(PODS, MODIFIED, pod)
            pod = current.decode()
        if graceful and grace > 0:
            return self.full(PODS, current)
        self.store.commit(PODS, DELETED, pod)
        return self.full(PODS, current)

    def _delete_namespace(self, current: Stored) -> bytes:
        """Terminating (MODIFIED), then its contents go, then the namespace itself (DELETED)."""
        name = current.name
        if name in _PROTECTED_NAMESPACES:
            raise errors.forbidden(
                f'namespaces "{name}" is forbidden: this namespace may not be deleted', "namespaces", name
            )
        ns = current.decode()
        if ns["metadata"].get("deletionTimestamp") is None:
            ns["metadata"]["deletionTimestamp"] = now_text()
            ns["metadata"] = {k: ns["metadata"][k] for k in _meta_order(ns["metadata"])}
            ns["status"] = {"phase": "Terminating"}
            current = self.store.commit(NAMESPACES, MODIFIED, ns)
        response = self.full(NAMESPACES, current)
        for resource in (r for r in ALL if r.namespaced):
            for stored in list(self.store.items(resource, name)):
                final = stored.decode()
                self.store.commit(resource, DELETED, final)
                if resource is SERVICES:
                    self.services.forget(stored.key)
        self.store.commit(NAMESPACES, DELETED, current.decode())
        return response


_SERVER_OWNED = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "namespace",
    "name",
)


def _status_update(resource: ResourceType, current: Stored, requested: dict[str, Any]) -> dict[str, Any]:
    """Through ``/status`` only ``status`` changes (pod IPs synced as the v1 conversion does)."""
    new = current.decode()  # a second fresh copy: much cheaper than deepcopy
    if "status" in requested:
        new["status"] = requested["status"]
    if isinstance(new.get("status"), dict) and resource is PODS:
        sync_pod_ips(new["status"])
    return new


def _main_update(resource: ResourceType, old: dict[str, Any], requested: dict[str, Any]) -> dict[str, Any]:
    """Through the main resource: server-owned metadata and ``status`` stay as they were; pod spec rules."""
    old_meta = old["metadata"]
    new = {k: v for k, v in requested.items() if k not in ("kind", "apiVersion")}
    meta = dict(new["metadata"])
    for key in _SERVER_OWNED:
        if key in old_meta:
            meta[key] = old_meta[key]
        else:
            meta.pop(key, None)
    meta.setdefault("managedFields", old_meta.get("managedFields", []))
    new["metadata"] = {k: meta[k] for k in _meta_order(meta)}
    if resource.has_status:
        if "status" in old:
            new["status"] = old["status"]
        else:
            new.pop("status", None)
    if resource is NAMESPACES:
        new["spec"] = old.get("spec", {})
    if resource is PODS:
        causes = validation.validate_pod_spec_update(old.get("spec") or {}, new.get("spec") or {})
        if causes:
            raise errors.invalid(resource.kind, str(old_meta.get("name", "")), causes)
    if resource.default_on_update:
        resource.default(new)
    changed = any(new.get(f) != old.get(f) for f in resource.spec_fields)
    if resource is ENDPOINTSLICES:  # its strategy counts label changes too
        changed = changed or new["metadata"].get("labels") != old_meta.get("labels")
    if resource.keeps_generation and changed:
        new["metadata"]["generation"] = int(old_meta.get("generation", 1)) + 1
    return new


def _place(resource: ResourceType, meta: dict[str, Any], namespace: str | None) -> None:
    """Namespace from the URL; a different one in the body is a 400; cluster-scoped objects have none."""
    if not resource.namespaced:
        meta.pop("namespace", None)
        return
    ns = meta.get("namespace") or namespace
    if namespace is not None and ns != namespace:
        raise errors.bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
        )
    meta["namespace"] = ns


def _fresh_metadata(resource: ResourceType, meta: dict[str, Any], name: str, now: str) -> dict[str, Any]:
    """Server-owned fields set anew, client fields kept, in the real server's key order."""
    fresh: dict[str, Any] = {"name": name}
    for key in ("generateName", "namespace"):
        if key in meta:
            fresh[key] = meta[key]
    fresh["uid"] = str(uuid.uuid4())
    fresh["resourceVersion"] = ""
    if resource.keeps_generation:
        fresh["generation"] = 1
    fresh["creationTimestamp"] = now
    for key in ("labels", "annotations", "ownerReferences", "finalizers"):
        if meta.get(key):
            fresh[key] = meta[key]
    return fresh


def _page(
    table: dict[str, Stored], keys: list[str], namespace: str | None, opts: ListOptions
) -> tuple[list[bytes], str | None, int]:
    """Matching bodies from ``keys`` (up to ``limit``), the last returned key, and how many keys were read."""
    items: list[bytes] = []
    last_key, scanned = None, 0
    for key in keys:
        stored = table[key]
        scanned += 1
        if namespace is not None and stored.namespace != namespace:
            continue
        if opts.labels.matches(stored.labels) and opts.fields.matches(stored.fields):
            items.append(stored.body)
            last_key = key
            if opts.limit and len(items) >= opts.limit:
                break
    return items, last_key, scanned




def _meta_order(meta: dict[str, Any]) -> list[str]:
    known = [k for k in META_FIELDS if k in meta]
    return known + [k for k in meta if k not in META_FIELDS]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal apart from managedFields (a no-op write changes nothing a watcher could see)."""

    def strip(o: dict[str, Any]) -> dict[str, Any]:
        return {**o, "metadata": {k: v for k, v in o["metadata"].items() if k != "managedFields"}}

    return strip(a) == strip(b)


def _encode(obj: dict[str, Any]) -> bytes:
    from podmeter.lab.apiserver.store import encode

    body = {"metadata": obj["metadata"], **{k: v for k, v in obj.items() if k != "metadata"}}
    return encode(body)
