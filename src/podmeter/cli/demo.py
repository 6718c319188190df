"""``podmeter demo``: a short in-memory run of the core that prints what it did.

It tells the story podmeter exists for: interest removed before a delete, an IP reused, a full map,
a restart against stale state. Everything runs through the real core (view + writer) and the in-memory
datapath with the kernel's semantics.
"""

from __future__ import annotations

import argparse
from typing import Any

from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.configuration import DEFAULT_NAME, Interest, MetricsConfiguration
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Delete, Upsert
from podmeter.model.records import Namespace, Pod
from podmeter.model.view import NodeView
from podmeter.runtime.writer import Writer


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo", help="run the level-triggered core in memory and print what it does"
    )
    parser.add_argument("--capacity", type=int, default=3, help="filter map size for the demo")
    parser.set_defaults(func=run)


def _pod(name: str, ns: str, ip: str, observe: bool = False) -> Pod:
    return Pod(uid=f"uid-{ns}-{name}-{ip}", namespace=ns, name=name, node_name="demo-node", ips=(ip,),
               host_network=False, phase="Running", deleting=False, observe=observe, labels=(),
               resource_version="1")


def _ns(name: str, observe: bool) -> Namespace:
    return Namespace(name=name, uid=f"ns-{name}", observe=observe, phase="Active", labels=(),
                     resource_version="1")


class _Story:
    def __init__(self, capacity: int) -> None:
        self.datapath = MemoryDatapath(capacity)
        self.view = NodeView("demo-node")
        self.writer = Writer(self.view.desired, self.datapath)
        self.step = 0

    def pod(self, pod: Pod) -> None:
        self.view.apply(Upsert(PODS, pod))

    def namespace(self, namespace: Namespace) -> None:
        self.view.apply(Upsert(NAMESPACES, namespace))

    def configuration(self, configuration: MetricsConfiguration) -> None:
        self.view.apply(Upsert(CONFIGURATIONS, configuration))

    def delete(self, pod: Pod) -> None:
        self.view.apply(Delete(PODS, pod.uid))

    def show(self, what: str) -> None:
        self.writer.flush()
        self.step += 1
        entries = ", ".join(sorted(self.datapath.contents())) or "(empty)"
        print(f"{self.step:2d}. {what}")
        print(f"    filter: {entries}   overflow: {self.writer.overflow}")


def run(args: argparse.Namespace) -> int:
    story = _Story(args.capacity)
    print(f"podmeter demo: in-memory core, filter capacity {args.capacity}\n")
    story.namespace(_ns("shop", observe=True))
    web = _pod("web", "shop", "10.0.0.1")
    story.pod(web)
    story.show("namespace shop annotated podmeter.io/observe=true; pod shop/web gets 10.0.0.1")
    story.namespace(_ns("shop", observe=False))
    story.show("annotation removed from namespace shop (interest gone before the delete)")
    story.delete(web)
    story.show("pod shop/web deleted: nothing left behind")
    old = _pod("job-1", "batch", "10.0.0.9", observe=True)
    story.pod(old)
    new = _pod("job-2", "batch", "10.0.0.9", observe=True)
    story.pod(new)
    story.delete(old)
    story.show("IP 10.0.0.9 passes from batch/job-1 to batch/job-2; the late delete of job-1 keeps it")
    story.configuration(MetricsConfiguration(DEFAULT_NAME, "1", 1, Interest(include=frozenset({"load"}))))
    for i in range(args.capacity + 2):
        story.pod(_pod(f"gen-{i}", "load", f"10.0.1.{i}"))
    story.show(f"MetricsConfiguration includes namespace load; {args.capacity + 2} pods there")
    story.datapath.entries.add("10.9.9.9")
    story.datapath.entries.discard("10.0.1.0")
    repairs = story.writer.resync()
    story.show(f"drift injected; resync removed {list(repairs.leaked)} and restored {list(repairs.missing)}")
    print("\nEvery state above is a function of the stored objects, never of the order events arrived in.")
    return 0
