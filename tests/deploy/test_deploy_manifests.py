"""deploy/: every overlay renders with the real ``kubectl kustomize``, validates offline against the Kubernetes
schemas, grants exactly the RBAC the agent and operator need, and uses only flags the CLI really has."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deploy_support import (
    FIELD_VALUES,
    OVERLAYS,
    ROOT,
    Grant,
    Obj,
    container,
    env_map,
    find,
    grants,
    kustomize,
    needs_kubectl,
    parse_as_the_container,
    pod_containers,
    render,
    render_with,
    resolved_env,
    runtime_refusal,
)

pytestmark = needs_kubectl

# Oldest and newest Kubernetes this install supports (CRD validation rules are GA from 1.29 on).
K8S_VERSIONS = ("1.29", "1.32")
# Kinds that are not part of Kubernetes itself: checked by the tests below instead of by schema.
NOT_KUBERNETES = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
COMPOSITIONS = {
    "base+sys-admin+perfmon": (["base"], ["components/sys-admin", "components/perfmon"]),
    "base+etcd+servicemonitor": (["base"], ["components/etcd", "components/servicemonitor"]),
    "base+alerts+dashboards": (["base"], ["components/alerts", "dashboards"]),
    "base+mount-bpffs+sys-admin": (["base"], ["components/mount-bpffs", "components/sys-admin"]),
}


def test_the_required_overlays_exist() -> None:
    assert {"overlays/default", "overlays/etcd"} <= set(OVERLAYS)


def all_renders(tmp_path: Path) -> dict[str, list[Obj]]:
    out = {name: render(name) for name in OVERLAYS}
    for name, (resources, components) in COMPOSITIONS.items():
        work = tmp_path / name
        work.mkdir()
        out[name] = render_with(work, resources, components)
    return out


def validate(obj: Obj, version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_validates_offline(tmp_path: Path, version: str) -> None:
    for name, objects in all_renders(tmp_path).items():
        assert objects, name
        kinds = set()
        for obj in objects:
            kinds.add(obj["kind"])
            if (obj["apiVersion"], obj["kind"]) in NOT_KUBERNETES:
                continue
            try:
                validate(obj, version)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                where = f"{obj['kind']}/{obj['metadata']['name']}"
                raise AssertionError(f"{name}: {where}: {path}: {exc.message}") from None
        assert {"Namespace", "CustomResourceDefinition", "DaemonSet", "Deployment", "Service",
                "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} <= kinds, name


@pytest.mark.parametrize(
    ("where", "mutation"),
    [
        ("DaemonSet", lambda o: o["spec"]["template"]["spec"].__setitem__("hostNetwrk", True)),
        ("DaemonSet", lambda o: o["spec"]["template"]["spec"]["containers"][0].__setitem__("args", "agent")),
        ("Deployment", lambda o: o["spec"].__setitem__("replicas", "two")),
        ("ClusterRole", lambda o: o["rules"][0].__setitem__("verb", ["get"])),
    ],
)
def test_the_offline_validator_rejects_broken_objects(where: str, mutation: Any) -> None:
    """Control: the validation above would notice a typo, a wrong type or an unknown field."""
    obj = copy.deepcopy(next(o for o in render("overlays/default") if o["kind"] == where))
    validate(obj, K8S_VERSIONS[-1])
    mutation(obj)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(obj, K8S_VERSIONS[-1])


# --- RBAC ------------------------------------------------------------------------------------------------

AGENT_GRANTS: set[Grant] = {
    ("cluster", group, resource, verb, "*")
    for group, resource in (("", "pods"), ("", "namespaces"), ("podmeter.io", "metricsconfigurations"),
                            ("podmeter.io", "podslices"))
    for verb in ("get", "list", "watch")
} | {("cluster", "", "nodes", verb, "*") for verb in ("list", "watch")} | {  # the Hubble API's peers
    ("cluster", group, resource, verb, "*")  # Services' names of flows (docs/services.md)
    for group, resource in (("", "services"), ("discovery.k8s.io", "endpointslices")) for verb in ("list", "watch")
}
OPERATOR_GRANTS: set[Grant] = {
    *(("cluster", "", "pods", verb, "*") for verb in ("get", "list", "watch")),
    *(("cluster", "podmeter.io", "metricsconfigurations", verb, "*") for verb in ("get", "list", "watch")),
    ("cluster", "podmeter.io", "metricsconfigurations/status", "patch", "default"),
    *(("cluster", "podmeter.io", "podslices", verb, "*")
      for verb in ("get", "list", "watch", "create", "update", "delete")),
    ("podmeter", "coordination.k8s.io", "leases", "create", "*"),
    ("podmeter", "coordination.k8s.io", "leases", "get", "podmeter-operator"),
    ("podmeter", "coordination.k8s.io", "leases", "update", "podmeter-operator"),
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_grants_nothing_beyond_what_each_component_uses(overlay: str) -> None:
    objects = render(overlay)
    assert grants(objects, "podmeter", "podmeter-agent") == AGENT_GRANTS
    assert grants(objects, "podmeter", "podmeter-operator") == OPERATOR_GRANTS
    accounts = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objects if o["kind"] == "ServiceAccount"}
    assert accounts == {("podmeter", "podmeter-agent"), ("podmeter", "podmeter-operator")}
    for obj in objects:  # every binding names one of podmeter's accounts, nothing else
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            assert {(s.get("namespace"), s["name"]) for s in obj["subjects"]} <= accounts, obj["metadata"]["name"]


def test_the_lease_rule_names_the_lease_the_operator_uses() -> None:
    objects = render("overlays/default")
    env = env_map(container(find(objects, "Deployment", "podmeter-operator")))
    assert env["PODMETER_LEASE_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    role = find(objects, "Role", "podmeter-operator-leader-election")
    assert role["metadata"]["namespace"] == "podmeter"
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert named and all(r["resourceNames"] == [env["PODMETER_LEASE_NAME"]["value"]] for r in named)


def test_workloads_run_under_their_own_accounts() -> None:
    objects = render("overlays/default")
    assert find(objects, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"] == "podmeter-agent"
    operator = find(objects, "Deployment", "podmeter-operator")
    assert operator["spec"]["template"]["spec"]["serviceAccountName"] == "podmeter-operator"


# --- flags and env against the real CLI ------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_workload_parses_with_the_real_cli(overlay: str) -> None:
    objects = render(overlay)
    seen = set()
    for workload in (o for o in objects if o["kind"] in ("DaemonSet", "Deployment")):
        cont = container(workload)
        args, env = parse_as_the_container(objects, cont)
        seen.add(args.command)
        for name, value in env.items():
            if not name.startswith("PODMETER_"):
                continue
            parsed = getattr(args, name.removeprefix("PODMETER_").lower())
            assert str(parsed) == value or parsed == type(parsed)(value), (name, value, parsed)
    assert seen == {"agent", "operator"}


def test_the_agent_is_configured_for_a_real_node() -> None:
    objects = render("overlays/default")
    ds = find(objects, "DaemonSet", "podmeter-agent")
    spec = ds["spec"]["template"]["spec"]
    cont = container(ds)
    args, _ = parse_as_the_container(objects, cont)
    assert args.command == "agent" and args.datapath == "ebpf" and args.node_name == "node-a"
    env = env_map(cont)
    assert env["PODMETER_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # the host netns (veths), DNS that still reaches the API server, every node
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert {"operator": "Exists"} in spec["tolerations"]
    # the host's bpffs, and the pin directory inside it
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in cont["volumeMounts"]}
    bpffs = mounts["/sys/fs/bpf"]
    assert volumes[bpffs["name"]]["hostPath"]["path"] == "/sys/fs/bpf"
    # no propagation: nothing asked of the node's mount (below), and the bpffs mounted when the container starts
    assert "mountPropagation" not in bpffs and not bpffs.get("readOnly")
    assert Path(args.bpffs).is_relative_to("/sys/fs/bpf")
    # probes on the port the agent listens on
    port = int(args.listen.rpartition(":")[2])
    ports = {p["name"]: p["containerPort"] for p in cont["ports"]}
    assert cont["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert cont["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert ports[cont[probe]["httpGet"]["port"]] == port
    # requests and limits for both resources
    for part in ("requests", "limits"):
        assert {"cpu", "memory"} <= cont["resources"][part].keys()
    # root, but with only the capabilities the datapath needs
    security = cont["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["BPF", "NET_ADMIN"]}
    assert security["readOnlyRootFilesystem"] is True
    assert not spec.get("hostPID") and not spec.get("hostIPC") and not security.get("privileged")
    # the critical priority class is covered by a quota in the namespace (some clusters require one)
    quota = find(objects, "ResourceQuota", "podmeter-critical-pods")
    (scope,) = quota["spec"]["scopeSelector"]["matchExpressions"]
    assert scope["scopeName"] == "PriorityClass" and spec["priorityClassName"] in scope["values"]
    namespace = find(objects, "Namespace", "podmeter")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


# What the mounts of a node look like (/proc/1/mountinfo) where init is not systemd: every mount private,
# bpffs mounted at /sys/fs/bpf or not at all; and where it is systemd: every mount shared.
PRIVATE_NODE = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
45 23 0:40 / /sys/fs/bpf rw,relatime - bpf bpf rw
"""
PRIVATE_NODE_WITHOUT_BPFFS = "".join(line + "\n" for line in PRIVATE_NODE.splitlines() if "bpf" not in line)
SYSTEMD_NODE = """\
22 27 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:13 - proc proc rw
23 27 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:2 - sysfs sysfs rw
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
45 23 0:40 / /sys/fs/bpf rw,nosuid,nodev,noexec,relatime shared:7 - bpf bpf rw,mode=700
"""


def test_the_runtime_rule_refuses_propagation_from_a_private_node_mount() -> None:
    """Control of the rule below: the issue's node (private mounts, systemd absent) refuses the agent's former
    HostToContainer, and Cilium's Bidirectional alike; a systemd node accepts both."""
    assert runtime_refusal("HostToContainer", "/sys/fs/bpf", PRIVATE_NODE) == \
        "path '/sys/fs/bpf' is mounted on '/sys/fs/bpf' but it is not a shared or slave mount"
    assert runtime_refusal("Bidirectional", "/sys/fs/bpf", PRIVATE_NODE_WITHOUT_BPFFS) == \
        "path '/sys/fs/bpf' is mounted on '/sys' but it is not a shared mount"
    for propagation in ("HostToContainer", "Bidirectional"):
        assert runtime_refusal(propagation, "/sys/fs/bpf", SYSTEMD_NODE) is None
    for node in (PRIVATE_NODE, PRIVATE_NODE_WITHOUT_BPFFS):
        assert runtime_refusal(None, "/sys/fs/bpf", node) is None


def test_no_container_of_the_daemonset_needs_shared_node_mounts(tmp_path: Path) -> None:
    """Every render: no container of the agent's pod asks for mount propagation, so the runtime creates them on
    a node whose mounts are private (tests/deploy/test_deploy_agent.py runs them on such a node)."""
    for name, objects in all_renders(tmp_path).items():
        spec = find(objects, "DaemonSet", "podmeter-agent")["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for cont in pod_containers(find(objects, "DaemonSet", "podmeter-agent")):
            for mount in cont.get("volumeMounts", []):
                host = volumes[mount["name"]].get("hostPath")
                if host is None:
                    continue
                for node in (PRIVATE_NODE, PRIVATE_NODE_WITHOUT_BPFFS, SYSTEMD_NODE):
                    refusal = runtime_refusal(mount.get("mountPropagation"), host["path"], node)
                    assert refusal is None, f"{name}: {cont['name']}: {refusal}"


def test_the_mount_bpffs_component_mounts_the_agents_bpffs_before_the_agent(tmp_path: Path) -> None:
    (tmp_path / "component").mkdir()
    objects = render_with(tmp_path / "component", ["base"], ["components/mount-bpffs"])
    daemonset = find(objects, "DaemonSet", "podmeter-agent")
    spec = daemonset["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]  # every init container has exited before the agent's container starts
    agent = container(daemonset)
    assert init["name"] == "mount-bpffs" and init["image"] == agent["image"]
    args, env = parse_as_the_container(objects, init)
    assert args.command == "bpffs" and env["PODMETER_LOG_FORMAT"] == "json"
    volumes = {v["name"]: v for v in spec["volumes"]}
    # it mounts, in the node's mount namespace, the very path the agent's hostPath names
    agent_bpffs = next(volumes[m["name"]]["hostPath"]["path"] for m in agent["volumeMounts"]
                       if m["mountPath"] == "/sys/fs/bpf")
    assert args.mount_point == agent_bpffs
    agent_args, _ = parse_as_the_container(objects, agent)
    assert Path(agent_args.bpffs).is_relative_to(args.mount_point)
    # and finds that namespace through the node's /proc, read-only, with no propagation
    (mount,) = init["volumeMounts"]
    assert volumes[mount["name"]]["hostPath"] == {"path": "/proc", "type": "Directory"}
    assert mount["mountPath"] == args.host_proc and mount["readOnly"] is True and "mountPropagation" not in mount
    # privileged (mount and setns in the node's namespaces), as root: the image's user is 65532
    security = init["securityContext"]
    assert security["privileged"] is True and security["runAsUser"] == 0 and security["readOnlyRootFilesystem"]
    assert {"cpu", "memory"} <= init["resources"]["limits"].keys()
    # the agent itself is unchanged by the component
    assert agent == container(find(render("overlays/default"), "DaemonSet", "podmeter-agent"))
    assert not container(find(render("overlays/default"), "DaemonSet", "podmeter-agent"))["securityContext"].get(
        "privileged")
    # an overlay's image applies to the init container too (it is copied from the agent's before)
    images = tmp_path / "images"
    images.mkdir()
    (images / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": ["../component"],
        "images": [{"name": "ghcr.io/podmeter/podmeter", "newName": "registry.example.com/podmeter",
                    "newTag": "9.9.9"}]}))
    moved = find(kustomize(images), "DaemonSet", "podmeter-agent")
    assert {c["image"] for c in pod_containers(moved)} == {"registry.example.com/podmeter:9.9.9"}


@pytest.mark.parametrize(("kind", "name"), [("DaemonSet", "podmeter-agent"), ("Deployment", "podmeter-operator")])
def test_probes_wait_for_the_process_to_listen(kind: str, name: str) -> None:
    """A startup probe on /healthz whose first try comes after the process listens (the agent listens 1-2 s
    after its start: tests/deploy/test_deploy_agent.py probes it on this schedule) gates the others, so a
    start logs no "connection refused" Unhealthy event; then a minute before the container is restarted."""
    cont = container(find(render("overlays/default"), kind, name))
    startup = cont["startupProbe"]
    assert startup["httpGet"] == cont["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert startup["initialDelaySeconds"] >= 5
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60
    for gated in ("readinessProbe", "livenessProbe"):  # they start once the startup probe has succeeded
        assert "initialDelaySeconds" not in cont[gated], gated


def test_both_workloads_log_json() -> None:
    objects = render("overlays/default")
    formats = {name: resolved_env(objects, container(find(objects, kind, name)))["PODMETER_LOG_FORMAT"]
               for kind, name in (("DaemonSet", "podmeter-agent"), ("Deployment", "podmeter-operator"))}
    assert formats == {"podmeter-agent": "json", "podmeter-operator": "json"}


def test_the_operator_runs_two_unprivileged_replicas_with_leader_election() -> None:
    objects = render("overlays/default")
    deployment = find(objects, "Deployment", "podmeter-operator")
    assert deployment["spec"]["replicas"] == 2
    cont = container(deployment)
    args, _ = parse_as_the_container(objects, cont)
    assert args.command == "operator" and args.identity_backend == "memory"
    assert args.holder_identity == FIELD_VALUES["metadata.name"]  # distinct per replica
    pod_security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] != 0
    security = cont["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {"drop": ["ALL"]}
    port = int(args.listen.rpartition(":")[2])
    assert {p["containerPort"] for p in cont["ports"]} == {port}
    assert find(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()


def test_the_etcd_overlay_points_the_operators_at_etcd() -> None:
    objects = render("overlays/etcd")
    cont = container(find(objects, "Deployment", "podmeter-operator"))
    names = [e["name"] for e in cont["env"]]
    assert len(names) == len(set(names)), "the patch must replace env entries, not duplicate them"
    args, _ = parse_as_the_container(objects, cont)
    assert args.identity_backend == "etcd"
    service = find(objects, "Service", "podmeter-etcd")
    host = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert args.etcd_endpoints == f"http://{host}:{service['spec']['ports'][0]['port']}"
    etcd = find(objects, "StatefulSet", "podmeter-etcd")
    assert etcd["spec"]["selector"]["matchLabels"].items() <= service["spec"]["selector"].items()
    agent = container(find(objects, "DaemonSet", "podmeter-agent"))
    assert agent == container(find(render("overlays/default"), "DaemonSet", "podmeter-agent"))


@pytest.mark.parametrize(("component", "added"), [("sys-admin", "SYS_ADMIN"), ("perfmon", "PERFMON")])
def test_a_capability_component_adds_only_its_capability(tmp_path: Path, component: str, added: str) -> None:
    objects = render_with(tmp_path, ["base"], [f"components/{component}"])
    cont = container(find(objects, "DaemonSet", "podmeter-agent"))
    assert cont["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["BPF", "NET_ADMIN", added]}
    # the API server refuses allowPrivilegeEscalation: false next to CAP_SYS_ADMIN
    assert "allowPrivilegeEscalation" not in cont["securityContext"]


# --- Services, ServiceMonitor, image ---------------------------------------------------------------------


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_services_and_the_servicemonitor_reach_both_metrics_ports() -> None:
    objects = render("overlays/prometheus-operator")
    workloads = [o for o in objects if o["kind"] in ("DaemonSet", "Deployment")]
    services = [o for o in objects if o["kind"] == "Service"]
    monitor = find(objects, "ServiceMonitor", "podmeter")
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["podmeter"]
    scraped = [s for s in services if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert {s["metadata"]["name"] for s in scraped} == {"podmeter-agent", "podmeter-operator"}
    endpoint_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    for service in scraped:
        selector = service["spec"]["selector"]
        backends = [w for w in workloads if selects(selector, w["spec"]["template"]["metadata"]["labels"])]
        assert len(backends) == 1, service["metadata"]["name"]
        container_ports = {p["name"]: p["containerPort"] for p in container(backends[0])["ports"]}
        for port in service["spec"]["ports"]:
            assert container_ports[port["targetPort"]] == port["port"]
        assert endpoint_ports <= {p["name"] for p in service["spec"]["ports"]}
    # selectors of workloads match their own pod labels (the API server refuses otherwise)
    for workload in workloads:
        assert selects(workload["spec"]["selector"]["matchLabels"], workload["spec"]["template"]["metadata"]["labels"])


def test_the_image_is_the_package_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for overlay in OVERLAYS:
        images = {c["image"] for o in render(overlay) if o["kind"] in ("DaemonSet", "Deployment")
                  and o["metadata"]["name"].startswith("podmeter-") and "etcd" not in o["metadata"]["name"]
                  for c in o["spec"]["template"]["spec"]["containers"]}
        assert images == {f"ghcr.io/podmeter/podmeter:{version}"}, overlay
