"""The lab's cluster DNS and its ``dns`` step: real lookups by real resolvers, counted by the real server.

As in a real cluster, a Service named ``kube-dns`` at the service CIDR's tenth address (``10.96.0.10`` with
the lab's API server) is backed by a DNS server pod: Debian's ``dnsmasq`` in the pod's network namespace,
answering every Service's ``<name>.<namespace>.svc.cluster.local`` from a hosts file made from the Services
listed, NXDOMAIN for any other name under ``cluster.local``, and REFUSED for the rest (it has no upstream).
The client pods' resolver points at it: ``/etc/netns/<pod's netns>/resolv.conf`` (which ``ip netns exec``
puts over ``/etc/resolv.conf``) with the usual search list and ``ndots:5``, and glibc's resolver
(``getent ahostsv4``) looks the step's names up, making the real search-path storm (a short name that does
not exist costs three NXDOMAINs before the absolute query).

The truth is the server's own log (``--log-queries=extra``: every query with its client address, its type
and the answer). The agent's per-pod DNS series must have counted, per client pod, exactly those queries
by type and those answers by return code, and its flow records must name every query name the server saw.
Next stage: the run's verdict (a failed check is a failed run).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podmeter.lab.apiserver.services import SERVICE_CIDR
from podmeter.lab.checks import Samples
from podmeter.lab.kube import KubeClient, KubeError
from podmeter.lab.scenario import DnsLookups
from podmeter.lab.traffic import Endpoint

log = logging.getLogger("podmeter.lab.dns")

CLUSTER_DOMAIN = "cluster.local"
SERVICE_NAME = "kube-dns"
NETNS_ETC = Path("/etc/netns")
READY_S = 20.0  # the Service's slice, the proxy's rule and the server, at most
LOOKUP_TIMEOUT_S = 15.0  # glibc: 5 s per try, and the server answers at once
QUERIES = "podmeter_pod_dns_queries_total"
RESPONSES = "podmeter_pod_dns_responses_total"
LATENCY = "podmeter_pod_dns_response_seconds_count"

# dnsmasq --log-queries=extra: "<serial> <client>/<port> query[A] name from <client>" and, for its answer,
# "<serial> <client>/<port> <source> <name> is <answer>" (one line per record of the answer).
_QUERY = re.compile(r"dnsmasq\[\d+\]: (\d+) ([0-9a-fA-F.:]+)/\d+ query\[([A-Za-z0-9]+)\] (\S+) from ")
_ANSWER = re.compile(r"dnsmasq\[\d+\]: (\d+) ([0-9a-fA-F.:]+)/\d+ \S+ (\S+) is (\S+)")
_RCODES_SAID = {"NXDOMAIN": "NXDOMAIN", "REFUSED": "REFUSED", "SERVFAIL": "SERVFAIL"}


def kube_dns_address(service_cidr: str) -> str:
    """The service CIDR's tenth address, where kubeadm puts cluster DNS."""
    return str(ipaddress.ip_network(service_cidr, strict=False)[10])


def resolv_conf(namespace: str, nameserver: str, domain: str = CLUSTER_DOMAIN) -> str:
    """A pod's resolv.conf as the kubelet writes it for ``dnsPolicy: ClusterFirst``."""
    return (f"search {namespace}.svc.{domain} svc.{domain} {domain}\n"
            f"nameserver {nameserver}\noptions ndots:5\n")


def hosts_file(services: Sequence[dict[str, Any]], domain: str = CLUSTER_DOMAIN) -> str:
    """``<ClusterIP> <name>.<namespace>.svc.<domain>`` for every Service with a ClusterIP."""
    lines = []
    for service in services:
        meta, spec = service.get("metadata") or {}, service.get("spec") or {}
        ip = spec.get("clusterIP")
        if meta.get("name") and meta.get("namespace") and ip and ip != "None":
            lines.append(f"{ip} {meta['name']}.{meta['namespace']}.svc.{domain}")
    return "".join(f"{line}\n" for line in sorted(lines))


@dataclass
class ServerLog:
    """What the server saw, per client address: queries by type, answers by return code, query names."""

    queries: dict[str, Counter[str]] = field(default_factory=dict)
    responses: dict[str, Counter[str]] = field(default_factory=dict)
    names: dict[str, set[str]] = field(default_factory=dict)


def parse_server_log(text: str) -> ServerLog:
    """The server's account from its log; an answer counts once whatever the number of its records."""
    seen = ServerLog()
    answered: set[tuple[str, str]] = set()
    for line in text.splitlines():
        if query := _QUERY.search(line):
            _serial, client, qtype, name = query.groups()
            seen.queries.setdefault(client, Counter())[qtype.upper()] += 1
            seen.names.setdefault(client, set()).add(name.rstrip(".").lower())
        elif (answer := _ANSWER.search(line)) and (answer[1], answer[2]) not in answered:
            answered.add((answer[1], answer[2]))
            seen.responses.setdefault(answer[2], Counter())[_RCODES_SAID.get(answer[4], "NOERROR")] += 1
    return seen


def _netns_name(endpoint: Endpoint) -> str:
    return Path(endpoint.netns_path).name


@contextlib.contextmanager
def dns_server(server: Endpoint, services: Sequence[dict[str, Any]], workdir: Path) -> Iterator[Path]:
    """dnsmasq in the server pod's namespace, on its pod IP, port 53; yields its log's path."""
    hosts, log_path = workdir / "hosts", workdir / "dnsmasq.log"
    hosts.write_text(hosts_file(services))
    log_path.touch()
    args = ["ip", "netns", "exec", _netns_name(server), "dnsmasq", "--keep-in-foreground", "--no-resolv",
            "--no-hosts", f"--addn-hosts={hosts}", f"--local=/{CLUSTER_DOMAIN}/", "--cache-size=0",
            "--log-queries=extra", f"--log-facility={log_path}", f"--pid-file={workdir / 'dnsmasq.pid'}",
            f"--listen-address={server.ip}", "--bind-interfaces", "--user=root"]
    process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    try:
        yield log_path
    finally:
        process.terminate()
        try:
            _, err = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
        if process.returncode not in (0, -15):
            log.warning("dnsmasq exited %s: %s", process.returncode, err.decode(errors="replace").strip())


@contextlib.contextmanager
def pointed_at(clients: Sequence[Endpoint], namespace: str, nameserver: str) -> Iterator[None]:
    """The clients' resolv.conf naming the cluster DNS, removed afterwards (with the directory it made)."""
    made: list[Path] = []
    try:
        for client in clients:
            directory = NETNS_ETC / _netns_name(client)
            if not directory.exists():
                directory.mkdir(parents=True)
                made.append(directory)
            (directory / "resolv.conf").write_text(resolv_conf(namespace, nameserver))
        yield
    finally:
        for client in clients:
            with contextlib.suppress(FileNotFoundError):
                (NETNS_ETC / _netns_name(client) / "resolv.conf").unlink()
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)


def lookup(client: Endpoint, name: str) -> bool:
    """glibc's resolver in the client pod (search list, ndots); True when the name resolved."""
    done = subprocess.run(["ip", "netns", "exec", _netns_name(client), "getent", "ahostsv4", name],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=LOOKUP_TIMEOUT_S, check=False)
    return done.returncode == 0


def create_service(kube: KubeClient, step: DnsLookups, address: str) -> tuple[str, str]:
    """The ``kube-dns`` Service (UDP and TCP 53) at ``address``, or wherever the server puts it when that
    address is taken (a real cluster's own DNS); (its namespace/name, its ClusterIP)."""
    ports = [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
             {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53}]
    spec: dict[str, Any] = {"selector": {"app": step.servers}, "ports": ports}
    path = f"/api/v1/namespaces/{step.server_namespace}/services"
    body = {"metadata": {"name": SERVICE_NAME, "labels": {"k8s-app": "kube-dns"}}, "spec": spec}
    try:
        made = kube.create(path, {**body, "spec": {**spec, "clusterIP": address}})
    except KubeError as exc:
        log.info("dns: %s is not free (%s); the API server picks the address", address, exc)
        made = kube.create(path, body)
    return f"{step.server_namespace}/{SERVICE_NAME}", str(made["spec"]["clusterIP"])


def wait_serving(client: Endpoint, server_log: Path, namespace: str) -> bool:
    """The first lookup that reaches the server through the Service (the slice and the rule are new)."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if lookup(client, f"{SERVICE_NAME}.{namespace}") or "query[" in server_log.read_text():
            return True
        time.sleep(0.3)
    return False


def _series(samples: Samples, name: str, pod: str, label: str) -> Counter[str]:
    namespace, _, short = pod.partition("/")
    counts: Counter[str] = Counter()
    for labels, value in samples.get(name, []):
        if labels.get("namespace") == namespace and labels.get("pod") == short:
            counts[labels.get(label, "")] += int(value)
    return counts


def _delta(after: Counter[str], before: Counter[str]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in sorted(set(after) | set(before)) if after[key] != before[key]}


@dataclass(frozen=True)
class Account:
    """The agent's series and flow records around the lookups, and the server's log."""

    before: Samples
    after: Samples
    records: list[dict[str, Any]] | None
    server: ServerLog


def check(clients: Sequence[Endpoint], account: Account) -> dict[str, Any]:
    """Per client pod: the agent's query and answer counts equal the server's, and its records name every
    query name the server saw from that pod."""
    problems: list[str] = []
    per_pod: dict[str, Any] = {}
    for client in clients:
        want_q = dict(sorted((account.server.queries.get(client.ip) or Counter()).items()))
        want_r = dict(sorted((account.server.responses.get(client.ip) or Counter()).items()))
        got_q = _delta(_series(account.after, QUERIES, client.pod, "qtype"),
                       _series(account.before, QUERIES, client.pod, "qtype"))
        got_r = _delta(_series(account.after, RESPONSES, client.pod, "rcode"),
                       _series(account.before, RESPONSES, client.pod, "rcode"))
        if got_q != want_q:
            problems.append(f"{client.pod}: queries by type {got_q}, the server saw {want_q}")
        if got_r != want_r:
            problems.append(f"{client.pod}: answers by return code {got_r}, the server sent {want_r}")
        timed = _delta(_series(account.after, LATENCY, client.pod, ""),
                       _series(account.before, LATENCY, client.pod, "")).get("", 0)
        if want_r and timed <= 0:
            problems.append(f"{client.pod}: no answer latency observed")
        missing = sorted((account.server.names.get(client.ip) or set()) - _names_in(account.records, client.ip))
        if missing:
            problems.append(f"{client.pod}: no flow record names {missing[:5]}")
        per_pod[client.pod] = {"queries": want_q, "responses": want_r,
                               "names": sorted(account.server.names.get(client.ip) or set())}
    if account.records is None:
        problems.append("the agent's /debug/flows did not answer")
    return {"ok": not problems, "problems": problems[:20], "per_pod": per_pod}


def _names_in(records: list[dict[str, Any]] | None, ip: str) -> set[str]:
    names = set()
    for record in records or []:
        dns = record.get("dns")
        if isinstance(dns, dict) and ip in ((record.get("source") or {}).get("ip"),
                                            (record.get("destination") or {}).get("ip")):
            names.add(str(dns.get("query", "")).rstrip(".").lower())
    return names


def taking_part(step: DnsLookups, endpoints: list[Endpoint]) -> tuple[list[Endpoint], list[Endpoint]]:
    """(the DNS servers, the clients) among the running pods."""
    def named(prefix: str, namespace: str) -> list[Endpoint]:
        return [e for e in endpoints if e.pod.startswith(f"{namespace}/{prefix}-")]
    return named(step.servers, step.server_namespace), named(step.clients, step.namespace)


@dataclass(frozen=True)
class Parts:
    """What the step needs from the run: the API, the agent's metrics and records, the drains."""

    kube: KubeClient
    metrics: Callable[[], Samples]
    records: Callable[[float], list[dict[str, Any]] | None]
    wait_drained: Callable[[float | None], bool]
    drains: Callable[[], float | None]
    service_cidr: str = SERVICE_CIDR


def run_step(step: DnsLookups, parts: Parts, endpoints: list[Endpoint]) -> dict[str, Any]:
    """The whole step; the record the run's report and verdict take."""
    record: dict[str, Any] = {"kind": "dns", "protocol": "udp", "namespace": step.namespace}
    servers, clients = taking_part(step, endpoints)
    if not servers or not clients:
        return {**record, "ok": False, "problems": [f"no running {step.servers} or {step.clients} pods"]}
    service, address = create_service(parts.kube, step, kube_dns_address(parts.service_cidr))
    record.update(service=service, cluster_ip=address, server=servers[0].pod, clients=[c.pod for c in clients])
    services = parts.kube.list("/api/v1/services").get("items") or []
    try:
        with tempfile.TemporaryDirectory(prefix="podmeter-lab-dns-") as tmp, \
                dns_server(servers[0], services, Path(tmp)) as server_log, \
                pointed_at(clients, step.namespace, address):
            if not wait_serving(clients[0], server_log, step.server_namespace):
                return {**record, "ok": False, "problems": [f"{address}:53 did not answer in {READY_S:g} s"]}
            return {**record, **_lookups_counted(step, parts, clients, server_log)}
    finally:
        with contextlib.suppress(KubeError):
            parts.kube.delete(f"/api/v1/namespaces/{step.server_namespace}/services/{SERVICE_NAME}")


def _lookups_counted(step: DnsLookups, parts: Parts, clients: list[Endpoint], server_log: Path) -> dict[str, Any]:
    """The step's lookups, and the agent's account of them against the server's."""
    parts.wait_drained(parts.drains())  # the warm-up lookups drained before the count starts
    start = server_log.stat().st_size
    since, before, drains = time.time(), parts.metrics(), parts.drains()
    resolved = {name: sum(lookup(client, name) for client in clients for _ in range(step.rounds))
                for name in step.names}
    time.sleep(0.3)  # the server's log lines of the last answers
    seen = parse_server_log(server_log.read_bytes()[start:].decode(errors="replace"))
    drained = parts.wait_drained(drains)
    verdict = check(clients, Account(before, parts.metrics(), parts.records(since), seen))
    if not drained:
        verdict["problems"].insert(0, "the agent did not drain its flows twice in time")
        verdict["ok"] = False
    return {**verdict, "resolved": resolved}
