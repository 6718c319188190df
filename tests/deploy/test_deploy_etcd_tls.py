"""The etcd component with TLS and an etcd user, as docs/install.md shows it: the rendered operator mounts
the Secrets' files where its flags point, no secret is in its environment, and the operator run with that
environment and those files works against a real etcd with client certificates and users (made here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from deploy_support import (
    DOCS,
    ROOT,
    Obj,
    container,
    find,
    kustomize,
    needs_kubectl,
    parse_as_the_container,
    resolved_env,
    yaml_blocks,
)
from etcd_server import ETCD, EtcdServer, Pki, pki
from lab_server import LabServer
from waiting import free_port, http_get, stop_process, wait_for

__all__ = ["pki"]

pytestmark = needs_kubectl
PASSWORD = "password-from-the-secret"
MARKER = "my-secure-cluster/kustomization.yaml"


def render_example(tmp_path: Path) -> list[Obj]:
    (block,) = [b for b in yaml_blocks((DOCS / "install.md").read_text()) if MARKER in b]
    overlay = tmp_path / "my-secure-cluster"
    overlay.mkdir()
    (tmp_path / "podmeter").symlink_to(ROOT)  # the layout the example assumes: ../podmeter is this repository
    (overlay / "kustomization.yaml").write_text(block)
    return kustomize(overlay)


def secret_files(deployment: Obj) -> dict[str, tuple[str, str, bool]]:
    """Every file the pod gets from a Secret: path in the container -> (Secret, key, optional)."""
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    out = {}
    for mount in container(deployment).get("volumeMounts", []):
        volume = volumes[mount["name"]]
        sources = [s["secret"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s]
        if "secret" in volume:
            sources.append(volume["secret"])
        for source in sources:
            for item in source.get("items", []):
                name = source.get("name") or source.get("secretName")  # projected or plain Secret volume
                out[f"{mount['mountPath']}/{item['path']}"] = (name, item["key"], bool(source.get("optional")))
    return out


def test_the_tls_example_mounts_what_its_flags_name(tmp_path: Path) -> None:
    objects = render_example(tmp_path)
    for obj in objects:
        kubernetes_validate.validate(obj, "1.32", strict=True)
    deployment = find(objects, "Deployment", "podmeter-operator")
    cont = container(deployment)
    args, env = parse_as_the_container(objects, cont)
    files = secret_files(deployment)
    assert files[args.etcd_cacert][:2] == ("podmeter-etcd-tls", "ca.crt")
    assert files[args.etcd_cert][:2] == ("podmeter-etcd-tls", "tls.crt")
    assert files[args.etcd_key][:2] == ("podmeter-etcd-tls", "tls.key")
    assert files[args.etcd_password_file][:2] == ("podmeter-etcd-auth", "password")
    assert args.etcd_username == "podmeter"
    assert all(e.startswith("https://") for e in args.etcd_endpoints.split(","))
    # readable by the operator's group only; optional, so the component also runs without TLS
    spec = deployment["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if "projected" in v]
    assert volume["projected"]["defaultMode"] == 0o440 and spec["securityContext"]["fsGroup"] == \
        spec["securityContext"]["runAsGroup"]
    assert all(optional for _, _, optional in files.values())
    assert all(m.get("readOnly") for m in cont["volumeMounts"])
    # no secret in the environment: files only
    assert not [e for e in cont["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert PASSWORD not in json.dumps(env)


def test_without_a_patch_the_component_uses_no_tls(tmp_path: Path) -> None:
    from deploy_support import render

    objects = render("overlays/etcd")
    args, _ = parse_as_the_container(objects, container(find(objects, "Deployment", "podmeter-operator")))
    assert (args.etcd_cacert, args.etcd_cert, args.etcd_key, args.etcd_username, args.etcd_password_file) == \
        ("", "", "", "", "")


@pytest.mark.skipif(not Path(ETCD).exists(), reason="etcd is not installed (apt-get install etcd-server)")
def test_the_rendered_operator_runs_against_etcd_with_certificates_and_users(
    tmp_path: Path, pki: Pki, lab_apiserver: LabServer
) -> None:
    objects = render_example(tmp_path)
    deployment = find(objects, "Deployment", "podmeter-operator")
    cont = container(deployment)
    workdir = tmp_path / "etcd"
    workdir.mkdir()
    etcd = EtcdServer(workdir, pki=pki, client_cert_auth=True, users={"podmeter": PASSWORD})
    etcd.start()
    # the kubelet's part: the Secrets' keys as files under the mount (here a directory of the test)
    secrets: dict[str, dict[str, bytes]] = {
        "podmeter-etcd-tls": {"ca.crt": pki.ca.read_bytes(), "tls.crt": pki.client_cert.read_bytes(),
                              "tls.key": pki.client_key.read_bytes()},
        "podmeter-etcd-auth": {"password": PASSWORD.encode()},
    }
    (mount,) = {m["mountPath"] for m in cont["volumeMounts"]}
    mounted = tmp_path / "mounted"
    for path, (secret, item, _) in secret_files(deployment).items():
        target = mounted / Path(path).relative_to(mount)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(secrets[secret][item])
        target.chmod(0o440)
    env: dict[str, Any] = {name: value.replace(mount, str(mounted)) for name, value in
                           resolved_env(objects, cont).items()}
    port = free_port()
    env |= {"PODMETER_ETCD_ENDPOINTS": etcd.endpoint,  # the example's cluster is this etcd
            "PODMETER_LISTEN": f"127.0.0.1:{port}", "PODMETER_LEASE_NAMESPACE": "default",
            "KUBECONFIG": str(lab_apiserver.kubeconfig), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PODMETER_ALLOW_PLAIN_HTTP_CREDENTIALS": os.environ.get("PODMETER_ALLOW_PLAIN_HTTP_CREDENTIALS", "1")}
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "podmeter", *cont["args"]], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        lab_apiserver.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                            "metadata": {"name": "shop"}})
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-1", "labels": {"app": "web"}},
               "spec": {"nodeName": "node-a", "containers": [{"name": "c", "image": "busybox"}]}}
        assert lab_apiserver.request("POST", "/api/v1/namespaces/shop/pods", pod)[0] == 201

        def identities() -> list[Any]:
            status, body = http_get(f"http://127.0.0.1:{port}/debug/identities")
            return list(json.loads(body)["identities"]) if status == 200 else []

        wait_for(lambda: proc.poll() is not None or [d["id"] for d in identities()] == [256], timeout=20,
                 what="web's identity, over TLS as user podmeter", describe=lambda: log.read_text()[-3000:])
        assert proc.poll() is None, log.read_text()[-3000:]
        assert etcd.get(b"/podmeter/identities/id/256") == b'["shop",["app","web"]]'
    finally:
        stop_process(proc)
        etcd.stop()
