"""A soak: many short 1-pod jobs through real processes — etcd, one broker with a history
store, 3 simulated clusters of 1,000 nodes — submitted with the batch route, finished jobs
retired to history as they age.

    .venv/bin/python -m e2e.bench_soak [--jobs 100000] [--nodes 1000] [--batch 1000]
                                       [--retain 30s] [--clients 4]
                                       [--max-offers-in-flight 1000]
                                       [--broker-arg=--FLAG=VALUE ...]

Printed (no assertions; these machines are shared and noisy): sustained pods/s (first
Running to last Succeeded), submits/s, submit → Running p50/p99 (the broker's own event times,
read back through the paged list, history included), broker RSS at start, peak and at the end
once `--retain` has passed (then the history's idle time and a minute: the collector's trim),
each agent's RSS at start, peak and end (its finished pods deleted `--retain` after their
report, `--finished-pods-ttl`),
CPU per job from the first submit to the last job finished (the broker, of it the
garbage collector's pauses, the agents together, etcd, this client: less noisy than pods/s
on a shared machine), the broker's scheduling cycles and store writes per job (its
/metrics), etcd's database size (compacted, in use) and key count, the history's size and
rows, and how long the whole run took.
The job durations are 0.5–5 s (uniform).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from broker.state import records
from broker.state.history import sqlite as sqlite_history
from e2e import bench_throughput, helpers
from gpufed import client
from gpufed.daemons import duration
from gpufed.local import processes
from kits import garbage
from tests import etcdserver

CLUSTERS = bench_throughput.CLUSTERS


def job_item(n: int, rand: random.Random) -> dict[str, Any]:
    body = bench_throughput.job_body(n, 1)
    template = body["spec"]["tasks"][0]["template"]
    template["metadata"]["annotations"]["gpufed.io/sim-duration"] = f"{rand.uniform(0.5, 5):.2f}"
    return {"idempotencyKey": f"soak-{n}", "job": body}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def event_time(job: dict[str, Any], state: str) -> datetime | None:
    for event in job["status"]["events"]:
        if event["state"] == state:
            return datetime.fromisoformat(event["time"])
    return None


class Sampler:
    """A process's RSS every half second: start, peak, latest."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = bench_throughput.rss_mib(pid)
        self.peak = self.start
        self.latest = self.start

    async def run(self) -> None:
        while True:
            self.latest = bench_throughput.rss_mib(self.pid)
            self.peak = max(self.peak, self.latest)
            await asyncio.sleep(0.5)


async def submit_all(api: client.BrokerClient, items: list[dict[str, Any]], *, batch: int,
                     clients: int) -> int:  # fmt: skip
    chunks = [items[i : i + batch] for i in range(0, len(items), batch)]
    queue: asyncio.Queue[list[dict[str, Any]]] = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)
    refused = 0

    async def worker() -> None:
        nonlocal refused
        while not queue.empty():
            chunk = queue.get_nowait()
            while True:
                try:
                    answer = await api.submit_batch(chunk)
                    break
                except (client.BrokerError, aiohttp.ClientError, TimeoutError) as exc:
                    print(f"  batch refused, again: {exc}")
                    await asyncio.sleep(0.5)
            refused += sum(1 for item in answer["items"] if item["status"] >= 400)

    await asyncio.gather(*(worker() for _ in range(clients)))
    return refused


async def etcd_size(url: str) -> tuple[int, int, dict[str, int]]:
    """(database bytes, bytes in use, keys per prefix: job records, idempotency entries, all,
    and the keys put and deleted and transactions so far: put, delete, txn) of the etcd
    server at `url` (etcd://host:port), once its history is compacted to now, as the chart's
    etcd compacts it every hour (`--auto-compaction-retention`): the test server keeps every
    revision of the soak otherwise. The file itself does not shrink without a
    defragmentation; what is in use does."""
    endpoint = url.removeprefix("etcd://")
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{endpoint}/v3/maintenance/status", json={}) as r:
            revision = int((await r.json())["header"]["revision"])
        compaction = {"revision": revision, "physical": True}
        async with session.post(f"http://{endpoint}/v3/kv/compaction", json=compaction) as r:
            await r.read()  # compacted already to there: an error body, nothing to do
        async with session.post(f"http://{endpoint}/v3/maintenance/status", json={}) as r:
            status = await r.json()
        counts = {}
        for name, prefix in (("jobs", records.JOBS), ("idempotency", records.IDEMPOTENCY)):
            start = prefix.encode()
            end = start[:-1] + bytes([start[-1] + 1])
            body = {"key": _b64(start), "range_end": _b64(end), "count_only": True}
            async with session.post(f"http://{endpoint}/v3/kv/range", json=body) as r:
                counts[name] = int((await r.json()).get("count", 0))
        every = {"key": "AA==", "range_end": "AA==", "count_only": True}
        async with session.post(f"http://{endpoint}/v3/kv/range", json=every) as r:
            counts["all"] = int((await r.json()).get("count", 0))
        async with session.get(f"http://{endpoint}/metrics") as r:
            for line in (await r.text()).splitlines():
                for name in ("put", "delete", "txn"):
                    if line.startswith(f"etcd_mvcc_{name}_total "):
                        counts[name] = int(float(line.split()[1]))
    return int(status.get("dbSize", 0)), int(status.get("dbSizeInUse", 0)), counts


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


async def run(args: argparse.Namespace, work: Path) -> None:
    began = time.perf_counter()
    server = etcdserver.EtcdServer.start()
    retain = duration(args.retain)
    fleet = processes.LocalFleet(workdir=work, heartbeat=1.0, lost_after=30.0)
    fleet.store = server.url
    history = work / "history.db"
    # one token stands for a fleet's many users: not held to one principal's requests in progress
    fleet.broker_args = ["--history", f"sqlite:///{history}", "--retain-finished",
                               args.retain, "--max-offers-in-flight",
                               str(args.max_offers_in_flight), "--max-requests-per-principal",
                               "0", *args.broker_arg]  # fmt: skip
    try:
        fleet.write_tokens(tenants=["team-a"], clusters=CLUSTERS)
        broker = await fleet.start_broker()
        for name in CLUSTERS:
            nodes = work / f"{name}.yaml"
            bench_throughput.write_cluster(nodes, name, args.nodes)
            await fleet.start_agent(name, nodes, "--finished-pods-ttl", args.retain)
        await fleet.wait_clusters_ready(CLUSTERS, timeout=120)
        _, etcd_start, keys_start = await etcd_size(server.url)
        sampler = Sampler(broker.process.pid)
        agent_samplers = {name: Sampler(fleet.agents[name].process.pid) for name in CLUSTERS}
        samplers = [sampler, *agent_samplers.values()]
        sampling = [asyncio.create_task(s.run()) for s in samplers]
        rand = random.Random(1)
        items = [job_item(n, rand) for n in range(args.jobs)]
        print(
            f"{args.jobs} jobs, {len(CLUSTERS)} clusters x {args.nodes} nodes, batches of "
            f"{args.batch} from {args.clients} clients; broker RSS {sampler.start:.0f} MiB"
        )
        pids = bench_throughput.processes_of(fleet)
        if server.process is not None:
            pids["etcd"] = server.process.pid
        cpu_before = {name: bench_throughput.cpu_seconds(pid) for name, pid in pids.items()}
        counts_before = await helpers.broker_counts(fleet)
        async with client.BrokerClient(fleet.url, fleet.tokens["team-a"], timeout=120) as api:
            started = time.perf_counter()
            refused = await submit_all(api, items, batch=args.batch, clients=args.clients)
            submitted = time.perf_counter() - started
            print(f"submitted in {submitted:.1f} s: {args.jobs / submitted:.0f} submits/s, "
                  f"{refused} refused")  # fmt: skip
            while True:
                waiting = [
                    state for state in ("Queued", "Dispatched", "Running")
                    if (await api.job_page(state=state, limit=1))[0]
                ]  # fmt: skip
                if not waiting:
                    break
                print(f"  {time.perf_counter() - started:6.0f} s: jobs still {', '.join(waiting)}"
                      f"; broker RSS {sampler.latest:.0f} MiB")  # fmt: skip
                await asyncio.sleep(5)
            finished = time.perf_counter() - started
            cpu = {n: bench_throughput.cpu_seconds(pid) - cpu_before[n] for n, pid in pids.items()}
            counts = helpers.counts_since(await helpers.broker_counts(fleet), counts_before)
            jobs = await api.jobs(limit=None)
            print(f"all finished after {finished:.1f} s; waiting {retain:g} s of retention")
            # the retention, two retirement passes, the history's caches given back once it
            # is idle, and one of the collector's trims after that
            passes = 2 * min(60.0, max(0.5, retain / 10))
            idle = sqlite_history.IDLE_SECONDS
            await asyncio.sleep(retain + passes + idle + garbage.TRIM_EVERY_SECONDS + 5)
        for task in sampling:
            task.cancel()

        count: int = args.jobs

        def per_job(seconds: float) -> float:
            return seconds * 1000 / count

        runs = [event_time(j, "Running") for j in jobs]
        ends = [event_time(j, "Succeeded") for j in jobs]
        waits = [
            (ran - datetime.fromisoformat(j["status"]["events"][0]["time"])).total_seconds()
            for j, ran in zip(jobs, runs, strict=True) if ran is not None
        ]  # fmt: skip
        first = min(r for r in runs if r is not None)
        last = max(e for e in ends if e is not None)
        span = (last - first).total_seconds()
        db_bytes, in_use, keys = await etcd_size(server.url)
        print(
            f"sustained {len(jobs) / span:.0f} pods/s over {span:.1f} s; submit -> Running "
            f"p50 {statistics.median(waits) * 1000:.0f} ms, p99 "
            f"{percentile(waits, 0.99) * 1000:.0f} ms\n"
            f"broker RSS start {sampler.start:.0f} MiB, peak {sampler.peak:.0f} MiB, end "
            f"{bench_throughput.rss_mib(broker.process.pid):.0f} MiB (after retention)\n"
            f"agents RSS start/peak/end: "
            + ", ".join(
                f"{name} {a.start:.0f}/{a.peak:.0f}/"
                f"{bench_throughput.rss_mib(fleet.agents[name].process.pid):.0f} MiB"
                for name, a in agent_samplers.items()
            )
            + "\n"
            f"CPU per job, submit to the last finished: broker {per_job(cpu['broker']):.2f} ms "
            f"(garbage collector pauses {per_job(counts.get('gc', 0.0)):.2f} ms; "
            f"{cpu['broker'] / finished:.0%} of one core), agents "
            f"{per_job(sum(v for n, v in cpu.items() if n in CLUSTERS)):.2f} ms, etcd "
            f"{per_job(cpu.get('etcd', 0.0)):.2f} ms, this client {per_job(cpu['client']):.2f} ms"
            f" ({sum(cpu.values()) / finished:.2f} of the {os.cpu_count()} cores busy)\n"
            f"broker's work per job: {counts.get('cycles', 0) / count:.3f} scheduling cycles "
            f"({counts.get('cycle_seconds', 0) * 1000 / max(1.0, counts.get('cycles', 0)):.1f}"
            f" ms each), store writes {helpers.writes_per_job(counts, count)}\n"
            f"etcd, compacted: {in_use / 2**20:.1f} MiB in use (start {etcd_start / 2**20:.1f}), "
            f"file {db_bytes / 2**20:.1f} MiB; {keys['all']} keys ({keys['jobs']} job records, "
            f"{keys['idempotency']} idempotency entries, kept for their window); history: "
            f"{history.stat().st_size / 2**20:.1f} MiB, {len(jobs)} jobs listed\n"
            f"etcd per job: {(keys.get('put', 0) - keys_start.get('put', 0)) / count:.2f} "
            f"keys put, {(keys.get('delete', 0) - keys_start.get('delete', 0)) / count:.2f} "
            f"deleted, {(keys.get('txn', 0) - keys_start.get('txn', 0)) / count:.3f} "
            "transactions\n"
            f"the whole run took {time.perf_counter() - began:.0f} s"
        )
    finally:
        await fleet.stop()
        server.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--retain", default="30s", help="--retain-finished of the broker")
    parser.add_argument(
        "--broker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the broker, e.g. --broker-arg=--cycle-interval=0.03 "
        "(repeatable)",
    )
    parser.add_argument(
        "--max-offers-in-flight", type=int, default=1000, help="the broker's (0: no limit)"
    )
    arguments = parser.parse_args()
    with helpers.workdir("gpufed-soak-") as work:
        asyncio.run(run(arguments, work))


if __name__ == "__main__":
    main()
