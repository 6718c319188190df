"""Benchmark of the agent's Hubble API: flows streamed to a following client, and memory with 10 followers.

    python -m bench.observer [--records 50000] [--batch 1000] [--followers 10]

The agent's side runs in a child process, as in the agent: the flow feed (``adapters.flow_serving.FlowFeed``,
the default 8192-record ring) and the Hubble server (``adapters.hubble.server.HubbleServer``) in one
grpc.aio event loop, on a loopback port. It publishes named flow records into the feed in drains of
``--batch`` records, as fast as the followers read them (a drain waits until no follower's cursor would be
lapped by it: the ring would overwrite records it has not read otherwise), so the figure is what
the server can stream, not what the bench chose to send. Clients (this process) follow with GetFlows,
``follow: true``, as `hubble observe -f` does.

- ``observer_flows_per_s``: ``--records`` records published into the feed, divided by the time from the
  first publish until one following client has received them all.
- ``rss_mib_10_followers``: the child's RSS after ``--followers`` clients each received ``--records``
  records; ``rss_mib_0_followers``: its RSS with the ring full and nobody following (the reference).
- ``encode_flows_per_s``: records turned into ``GetFlowsResponse`` and serialized, without gRPC (the
  conversion's share of the cost).

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import msgspec
from grpc import aio

from bench.measure import json_line, rss_mib, table
from podmeter.adapters.flow_serving import FlowFeed
from podmeter.adapters.hubble.flows import FlowMessages, pod_labels
from podmeter.adapters.hubble.proto import observer_pb2, observer_pb2_grpc
from podmeter.adapters.hubble.server import HubbleServer, parse_listen
from podmeter.model.endpoints import AddressBook
from podmeter.model.flow_records import FlowRecord, name_flows
from podmeter.model.flows import TCP, UDP, FlowCounts, FlowKey, Observation
from podmeter.model.records import Pod, decode_pod

PODS = 200


def pods() -> list[Pod]:
    out = []
    for i in range(PODS):
        raw = {"kind": "Pod", "apiVersion": "v1",
               "metadata": {"name": f"web-{i // 10}-5d9f7-{i:05d}", "namespace": f"ns-{i % 7}", "uid": f"uid-{i}",
                            "resourceVersion": "1", "labels": {"app": f"web-{i // 10}", "pod-template-hash": "5d9f7"},
                            "ownerReferences": [{"kind": "ReplicaSet", "name": f"web-{i // 10}-5d9f7",
                                                 "controller": True, "apiVersion": "apps/v1", "uid": "rs"}]},
               "spec": {"nodeName": "node-a", "containers": [{"name": "c", "image": "x"}]},
               "status": {"phase": "Running", "podIP": f"10.1.{i // 250}.{i % 250 + 1}",
                          "podIPs": [{"ip": f"10.1.{i // 250}.{i % 250 + 1}"}]}}
        out.append(decode_pod(msgspec.json.encode(raw)))
    return out


def records(n: int, book: AddressBook) -> list[FlowRecord]:
    """``n`` records between the pods and the world: TCP and UDP, both observation points."""
    entries = []
    for i in range(n):
        a, b = f"10.1.{(i % PODS) // 250}.{(i % PODS) % 250 + 1}", f"10.1.0.{(i * 7) % 200 + 1}"
        if i % 5 == 4:
            b = f"93.184.{i % 256}.{(i // 256) % 256}"
        key = FlowKey(a, b, 30000 + i % 30000, 443 if i % 2 else 53, TCP if i % 2 else UDP,
                      Observation.FROM_POD if i % 3 else Observation.TO_POD)
        entries.append((key, FlowCounts(3, 400, i * 1000, i * 1000, 0b11010 if i % 2 else 0)))
    return name_flows(entries, book, "node-a", time.time())


# --- the agent's side (child process) ---------------------------------------------------------------------


async def serve(batch: int) -> None:
    all_pods = pods()
    by_uid = {p.uid: p for p in all_pods}
    book = AddressBook(all_pods)
    feed = FlowFeed(8192)
    server = HubbleServer(feed, "node-a", parse_listen("127.0.0.1:0"), labels=lambda e: pod_labels(by_uid, e))
    await server.start()
    feed.publish(records(8192, book))  # the ring full, as on a busy node
    drain = records(batch, book)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def say(**answer: Any) -> None:
        print(json.dumps(answer), flush=True)

    say(port=server.port)
    while line := (await reader.readline()).decode().split():
        if line[0] == "publish":
            total, started = int(line[1]), time.perf_counter()
            for _ in range(total // batch):
                while any(lagging(feed, batch)):
                    await asyncio.sleep(0.001)  # a drain waits until no follower would be lapped by it
                feed.publish(drain)
                await asyncio.sleep(0)
            say(published=total, seconds=time.perf_counter() - started)
        elif line[0] == "status":
            say(rss_mib=rss_mib(), followers=feed.followers, cut_off=feed.cut_off, gaps=feed.gaps)
    await server.stop(0)


def lagging(feed: FlowFeed, batch: int) -> list[bool]:
    """For each follower: whether one more drain of ``batch`` records would lap its cursor."""
    room = feed.ring.capacity - batch
    return [feed.ring.last_seq - r.cursor > room for r in feed._readers if r.following]


# --- the clients (this process) ---------------------------------------------------------------------------


class Child:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()
        answer: dict[str, Any] = json.loads(await self.proc.stdout.readline())
        return answer


async def follow(stub: observer_pb2_grpc.ObserverAsyncStub, count: int, started: asyncio.Event) -> float:
    """Follow until ``count`` flows arrived; the monotonic time of the last one."""
    call = stub.GetFlows(observer_pb2.GetFlowsRequest(follow=True))
    started.set()
    got = 0
    async for _ in call:
        got += 1
        if got == count:
            break
    call.cancel()
    return time.perf_counter()


async def wait_followers(child: Child, count: int) -> None:
    for _ in range(500):
        if (await child.ask("status"))["followers"] == count:
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"{count} followers never subscribed")


async def run(args: argparse.Namespace) -> dict[str, float]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.observer", "--serve", "--batch", str(args.batch),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    child = Child(proc)
    assert proc.stdout is not None
    port = json.loads(await proc.stdout.readline())["port"]
    figures: dict[str, float] = {}
    try:
        await asyncio.sleep(0.5)
        figures["rss_mib_0_followers"] = (await child.ask("status"))["rss_mib"]
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = observer_pb2_grpc.ObserverStub(channel)
            started = asyncio.Event()
            one = asyncio.create_task(follow(stub, args.records, started))
            await wait_followers(child, 1)
            t0 = time.perf_counter()
            published = await child.ask(f"publish {args.records}")
            done = await one
            figures["observer_flows_per_s"] = args.records / (done - t0)
            figures["publish_s"] = published["seconds"]
            await wait_followers(child, 0)
            many = [asyncio.create_task(follow(stub, args.records, asyncio.Event())) for _ in range(args.followers)]
            await wait_followers(child, args.followers)
            t0 = time.perf_counter()
            await child.ask(f"publish {args.records}")
            last = max(await asyncio.gather(*many))
            figures["flows_per_s_10_followers_each"] = args.records / (last - t0)
            status = await child.ask("status")
            figures["rss_mib_10_followers"] = status["rss_mib"]
            figures["cut_off"] = status["cut_off"]
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 30)
    return figures


def encode_rate(n: int = 20000) -> float:
    all_pods = pods()
    by_uid = {p.uid: p for p in all_pods}
    batch = records(n, AddressBook(all_pods))
    messages = FlowMessages(lambda e: pod_labels(by_uid, e))
    started = time.perf_counter()
    for record in batch:
        messages.response(record).SerializeToString()
    return n / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=1000, help="records per drain")
    parser.add_argument("--followers", type=int, default=10)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.batch))
        return
    args.records -= args.records % args.batch
    figures = asyncio.run(run(args))
    encode = encode_rate()
    table([
        ("observer_flows_per_s", figures["observer_flows_per_s"], encode,
         f"{args.records} records in drains of {args.batch}, one follower; reference: encoding alone"),
        ("flows_per_s_10_followers_each", figures["flows_per_s_10_followers_each"], None,
         f"each of {args.followers} followers received {args.records}"),
        ("rss_mib_10_followers", figures["rss_mib_10_followers"], figures["rss_mib_0_followers"],
         "the server process; reference: ring full, no follower"),
        ("followers cut off", figures["cut_off"], None, "a drain waits for room: none expected"),
    ])
    json_line({"observer_flows_per_s": round(figures["observer_flows_per_s"]),
               "flows_per_s_10_followers_each": round(figures["flows_per_s_10_followers_each"]),
               "encode_flows_per_s": round(encode), "rss_mib_10_followers": round(figures["rss_mib_10_followers"], 1),
               "rss_mib_0_followers": round(figures["rss_mib_0_followers"], 1), "records": args.records,
               "batch": args.batch, "followers": args.followers, "cut_off": figures["cut_off"]})


if __name__ == "__main__":
    main()
