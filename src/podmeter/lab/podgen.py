"""Realistic pod objects for benchmarks and lab scenarios.

``realistic_pod(i)`` returns the JSON dict of a Deployment-managed pod as a real API server stores it:
labels with a ``pod-template-hash``, an owner reference to its ReplicaSet, annotations, two managed-field
entries (controller and kubelet), two containers with env, ports, probes and resources, a projected token
volume and a Running status with conditions and container statuses. Encoded compactly it is about 7 KiB,
the pod podmeter's memory figures are measured on (bench/README.md). The output is deterministic in its
arguments (uids derive from ``i``), so two runs of a benchmark see identical input.
"""

from __future__ import annotations

import uuid
from typing import Any

from podmeter.lab.apiserver.defaults import TOLERATIONS

_TS = "2026-11-29T15:09:08Z"
_IMAGES = ("registry.example.com/shop/web:1.27.3", "registry.example.com/shop/sidecar-proxy:0.9.1")


def _uid(kind: str, i: int) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"podmeter/{kind}/{i}"))


def _digest(image: str) -> str:
    return uuid.uuid5(uuid.NAMESPACE_DNS, image).hex * 2


def _ip(i: int) -> str:
    return f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"


def _container_fields(name: str) -> dict[str, Any]:
    return {
        f'k:{{"name":"{name}"}}': {
            ".": {},
            "f:env": {".": {}, 'k:{"name":"LOG_LEVEL"}': {".": {}, "f:name": {}, "f:value": {}}},
            "f:image": {},
            "f:imagePullPolicy": {},
            "f:name": {},
            "f:ports": {
                ".": {},
                'k:{"containerPort":8080,"protocol":"TCP"}': {".": {}, "f:containerPort": {}},
            },
            "f:readinessProbe": {".": {}, "f:httpGet": {".": {}, "f:path": {}, "f:port": {}}},
            "f:resources": {".": {}, "f:limits": {".": {}, "f:memory": {}}, "f:requests": {".": {}}},
            "f:terminationMessagePath": {},
            "f:terminationMessagePolicy": {},
        }
    }


def _managed_fields(app: str) -> list[dict[str, Any]]:
    spec_fields: dict[str, Any] = {"f:containers": {}, "f:dnsPolicy": {}, "f:enableServiceLinks": {}}
    for name in (app, "proxy"):
        spec_fields["f:containers"].update(_container_fields(name))
    spec_fields.update({"f:restartPolicy": {}, "f:schedulerName": {}, "f:securityContext": {}})
    controller = {
        "manager": "kube-controller-manager",
        "operation": "Update",
        "apiVersion": "v1",
        "time": _TS,
        "fieldsType": "FieldsV1",
        "fieldsV1": {
            "f:metadata": {
                "f:generateName": {},
                "f:labels": {".": {}, "f:app": {}, "f:pod-template-hash": {}, "f:tier": {}},
                "f:ownerReferences": {".": {}, 'k:{"uid":"owner"}': {}},
            },
            "f:spec": spec_fields,
        },
    }
    kubelet = {
        "manager": "kubelet",
        "operation": "Update",
        "apiVersion": "v1",
        "time": _TS,
        "fieldsType": "FieldsV1",
        "fieldsV1": {
            "f:status": {
                "f:conditions": {
                    f'k:{{"type":"{t}"}}': {
                        ".": {},
                        "f:lastProbeTime": {},
                        "f:lastTransitionTime": {},
                        "f:status": {},
                        "f:type": {},
                    }
                    for t in ("ContainersReady", "Initialized", "PodReadyToStartContainers", "Ready")
                },
                "f:containerStatuses": {},
                "f:hostIP": {},
                "f:hostIPs": {},
                "f:phase": {},
                "f:podIP": {},
                "f:podIPs": {".": {}, 'k:{"ip":"x"}': {".": {}, "f:ip": {}}},
                "f:startTime": {},
            }
        },
        "subresource": "status",
    }
    return [controller, kubelet]


def _container(name: str, image: str, port: int) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "env": [
            {"name": "LOG_LEVEL", "value": "info"},
            {
                "name": "POD_NAME",
                "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
            },
        ],
        "resources": {"limits": {"memory": "256Mi"}, "requests": {"cpu": "100m", "memory": "128Mi"}},
        "volumeMounts": [
            {
                "name": "kube-api-access",
                "readOnly": True,
                "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            }
        ],
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": port, "scheme": "HTTP"},
            "timeoutSeconds": 1,
            "periodSeconds": 10,
            "successThreshold": 1,
            "failureThreshold": 3,
        },
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "imagePullPolicy": "IfNotPresent",
    }


def _container_status(name: str, image: str, i: int) -> dict[str, Any]:
    return {
        "name": name,
        "state": {"running": {"startedAt": _TS}},
        "lastState": {},
        "ready": True,
        "restartCount": 0,
        "image": image,
        "imageID": f"{image.split(':', maxsplit=1)[0]}@sha256:{_digest(image)}",
        "containerID": f"containerd://{_uid('container-' + name, i).replace('-', '')}",
        "started": True,
    }


def realistic_pod(
    i: int,
    node: str | None = "node-a",
    ip: str | None = None,
    namespace: str = "default",
    phase: str = "Running",
) -> dict[str, Any]:
    """Pod number ``i`` of a Deployment, bound to ``node`` (unbound if None), with ``ip`` (derived from i
    if None; no IP at all if ``phase`` is "Pending").

    The dict carries ``kind``/``apiVersion`` like a create request body; a list item drops them.
    """
    app = f"web-{i % 50}"
    rs_hash = f"{(i * 2654435761) % (16**10):010x}"[:10]
    name = f"{app}-{rs_hash}-{i:05d}"
    image, proxy_image = _IMAGES
    pod_ip = None if phase == "Pending" else (ip or _ip(i))
    spec: dict[str, Any] = {
        "volumes": [
            {
                "name": "kube-api-access",
                "projected": {
                    "defaultMode": 420,
                    "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {
                            "configMap": {
                                "name": "kube-root-ca.crt",
                                "items": [{"key": "ca.crt", "path": "ca.crt"}],
                            }
                        },
                        {
                            "downwardAPI": {
                                "items": [
                                    {
                                        "path": "namespace",
                                        "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                                    }
                                ]
                            }
                        },
                    ],
                },
            }
        ],
        "containers": [_container(app, image, 8080), _container("proxy", proxy_image, 15001)],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "serviceAccount": "default",
        "securityContext": {},
        "schedulerName": "default-scheduler",
        "tolerations": [dict(toleration) for toleration in TOLERATIONS],
        "priority": 0,
        "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
    }
    if node is not None:
        spec["nodeName"] = node
    status: dict[str, Any] = {"phase": phase, "qosClass": "Burstable"}
    if pod_ip is not None:
        status.update(
            {
                "conditions": [
                    {"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": _TS}
                    for t in (
                        "PodReadyToStartContainers",
                        "Initialized",
                        "Ready",
                        "ContainersReady",
                        "PodScheduled",
                    )
                ],
                "hostIP": "192.168.0.10",
                "hostIPs": [{"ip": "192.168.0.10"}],
                "podIP": pod_ip,
                "podIPs": [{"ip": pod_ip}],
                "startTime": _TS,
                "containerStatuses": [
                    _container_status(app, image, i),
                    _container_status("proxy", proxy_image, i),
                ],
            }
        )
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "generateName": f"{app}-{rs_hash}-",
            "namespace": namespace,
            "uid": _uid("pod", i),
            "resourceVersion": str(1000 + i),
            "generation": 1,
            "creationTimestamp": _TS,
            "labels": {"app": app, "pod-template-hash": rs_hash, "tier": "frontend"},
            "annotations": {
                "kubectl.kubernetes.io/restartedAt": _TS,
                "prometheus.io/scrape": "true",
                "prometheus.io/port": "8080",
                "checksum/config": uuid.uuid5(uuid.NAMESPACE_OID, app).hex * 2,
                "checksum/secrets": uuid.uuid5(uuid.NAMESPACE_X500, app).hex * 2,
                "sidecar.example.com/status": '{"initContainers":null,"containers":["proxy"],'
                '"volumes":["proxy-config","proxy-certs"],"imagePullSecrets":null,"revision":"3"}',
            },
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": f"{app}-{rs_hash}",
                    "uid": _uid("replicaset", i % 50),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
            "managedFields": _managed_fields(app),
        },
        "spec": spec,
        "status": status,
    }
