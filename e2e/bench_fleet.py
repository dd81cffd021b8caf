"""A fleet of many member clusters on one broker, real processes: what the broker spends on
each cluster connected, on each summary, and on each job.

    .venv/bin/python -m e2e.bench_fleet [--clusters 100] [--nodes 1000] [--rate 200]
        [--seconds 20] [--idle 20] [--store sqlite|etcd] [--broker-arg=--FLAG=VALUE ...]
    .venv/bin/python -m e2e.bench_fleet --quick     # 4 clusters of 200 nodes, a few seconds each

One broker (SQLite, or a real etcd) and `--clusters` agents, each a real `gpufed agent` process
on the simulated backend with `--nodes` nodes of 8 GPUs (the same cluster description as
`bench_throughput`), connected over the real protocol. The agents are started in waves and the
run waits until every cluster is Ready. Then:

1. idle: `--idle` seconds with every cluster connected and nothing submitted: the broker's CPU
   per second (heartbeats, watchdog, gauges, idle cycles), and its resident memory;
2. paced: 1-GPU jobs (one 8-GPU job in eight) submitted at `--rate` per second for
   `--seconds`, and the run goes on until every one is dispatched (a minute at most): the
   broker's CPU per job over it all, submit -> dispatched p50/p99 from the jobs' events,
   the scheduler's decision time per job and cycle time (read from the broker's histograms,
   interpolated within a bucket as Prometheus' `histogram_quantile` does, and their means,
   exact), and the summaries the agents sent up: how many a second the broker applied and
   what applying one took (`gpufed_agent_summary_duration_seconds`);
3. the broker's resident memory at the end, and the agents' together.

Figures only, no assertions. The agents and the client share the machine's cores with the
broker: the broker's CPU is its own (`/proc`), its latencies are not.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from e2e import bench_throughput, helpers
from gpufed.local import processes
from tests import etcdserver

PACED = bench_throughput.PACED
DECISION = "gpufed_scheduling_decision_duration_seconds"
CYCLE = "gpufed_scheduling_cycle_duration_seconds"
SUMMARY = "gpufed_agent_summary_duration_seconds"
DISPATCHED = "gpufed_job_submit_to_dispatch_seconds"


def job_doc(n: int) -> str:
    """The paced run's jobs: 1 GPU, one in eight a whole node of 8."""
    return bench_throughput.job_doc(PACED + n, 1, gpus=8 if n % 8 == 7 else 1)


class Histogram:
    """One histogram of the broker's /metrics: cumulative bucket counts, sum and count."""

    def __init__(self, buckets: dict[float, float], total: float, count: float) -> None:
        self.buckets, self.total, self.count = buckets, total, count

    @classmethod
    def read(cls, page: str, name: str) -> Histogram:
        buckets: dict[float, float] = {}
        total = count = 0.0
        for family in text_string_to_metric_families(page):
            if family.name != name:
                continue
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    buckets[bound] = buckets.get(bound, 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
        return cls(buckets, total, count)

    def since(self, before: Histogram) -> Histogram:
        buckets = {b: n - before.buckets.get(b, 0.0) for b, n in self.buckets.items()}
        return Histogram(buckets, self.total - before.total, self.count - before.count)

    def quantile(self, q: float) -> float:
        """As Prometheus' `histogram_quantile`: linear within the bucket the rank falls in."""
        if not self.count:
            return math.nan
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound in sorted(self.buckets):
            count = self.buckets[bound]
            if count >= rank:
                if math.isinf(bound):
                    return lower
                share = (rank - below) / (count - below) if count > below else 1.0
                return lower + (bound - lower) * share
            lower, below = bound, count
        return lower

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


async def start_agents(
    fleet: processes.LocalFleet, names: list[str], *, nodes: int, wave: int
) -> None:
    """One agent process per cluster, `wave` at a time, each wave Ready before the next (a
    hundred Python processes starting at once on two cores starve the broker's sessions)."""
    for first in range(0, len(names), wave):
        batch = names[first : first + wave]
        for name in batch:
            bench_throughput.write_cluster(fleet.workdir / f"{name}.yaml", name, nodes)
            await fleet.start_agent(name, fleet.workdir / f"{name}.yaml")
        await fleet.wait_clusters_ready(batch, timeout=600)


async def idle(fleet: processes.LocalFleet, seconds: float, agents: dict[str, int]) -> None:
    assert fleet.broker is not None
    broker = fleet.broker.process.pid
    await asyncio.sleep(min(5.0, seconds / 2))  # the last summaries of the start applied
    before = bench_throughput.cpu_seconds(broker)
    agents_before = sum(bench_throughput.cpu_seconds(pid) for pid in agents.values())
    summaries_before = Histogram.read(await helpers.scrape(fleet), SUMMARY)
    await asyncio.sleep(seconds)
    spent = bench_throughput.cpu_seconds(broker) - before
    agents_spent = sum(bench_throughput.cpu_seconds(pid) for pid in agents.values())
    summaries = Histogram.read(await helpers.scrape(fleet), SUMMARY).since(summaries_before)
    print(
        f"idle, {len(agents)} clusters connected: broker CPU {spent * 1000 / seconds:.1f} ms a "
        f"second ({spent / seconds * 100:.1f}% of a core); agents together "
        f"{(agents_spent - agents_before) * 1000 / seconds:.1f} ms a second; "
        f"{summaries.count / seconds:.1f} summaries a second; broker RSS "
        f"{bench_throughput.rss_mib(broker):.0f} MiB"
    )


async def paced(fleet: processes.LocalFleet, rate: float, seconds: float) -> None:
    assert fleet.broker is not None
    broker = fleet.broker.process.pid
    total = int(rate * seconds)
    page = await helpers.scrape(fleet)
    before = {name: Histogram.read(page, name) for name in (DECISION, CYCLE, SUMMARY, DISPATCHED)}
    cpu_before = bench_throughput.cpu_seconds(broker)
    async with fleet.client("bench") as api:
        started = time.perf_counter()
        tasks = []
        for n in range(total):
            delay = started + n / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(api.submit(job_doc(n))))
        ids = {answer["id"] for answer in await asyncio.gather(*tasks)}
        elapsed = time.perf_counter() - started
        while True:  # until every job is dispatched (or a minute more), then its summary sent
            page = await helpers.scrape(fleet)
            sent = Histogram.read(page, DISPATCHED).since(before[DISPATCHED]).count
            if sent >= total or time.perf_counter() - started > elapsed + 60:
                break
            await asyncio.sleep(0.1)
        drained = time.perf_counter() - started
        await asyncio.sleep(0.5)
        spent = bench_throughput.cpu_seconds(broker) - cpu_before
        window = time.perf_counter() - started
        page = await helpers.scrape(fleet)
        items = [
            job
            for job in await api.jobs(selector="bench=paced", limit=1_000_000)
            if job["id"] in ids
        ]
    after = {name: Histogram.read(page, name).since(before[name]) for name in before}
    latency = []
    for job in items:
        queued = bench_throughput._time(job, "Queued")
        dispatched = bench_throughput._time(job, "Dispatched")
        if queued and dispatched:
            latency.append((dispatched - queued).total_seconds())
    decision, cycle, summary = after[DECISION], after[CYCLE], after[SUMMARY]
    print(
        f"paced: {total} jobs at {total / elapsed:.0f}/s (asked {rate:.0f}/s), "
        f"{len(latency)} dispatched {drained:.1f} s after the first was sent; broker CPU "
        f"{spent * 1000 / total:.2f} ms a job "
        f"({spent / window * 100:.0f}% of a core); submit->dispatched ms p50 "
        f"{ms(bench_throughput.pct(latency, 50))} p99 {ms(bench_throughput.pct(latency, 99))}"
    )
    print(
        f"paced: decision ms p50 {ms(decision.quantile(0.5))} p99 {ms(decision.quantile(0.99))}"
        f" mean {ms(decision.mean)} ({decision.count:.0f} cycles that decided); cycle ms p50 "
        f"{ms(cycle.quantile(0.5))} p99 {ms(cycle.quantile(0.99))} mean {ms(cycle.mean)} "
        f"({cycle.count:.0f} cycles)"
    )
    print(
        f"paced: summaries applied {summary.count / window:.0f} a second, each ms p50 "
        f"{ms(summary.quantile(0.5))} p99 {ms(summary.quantile(0.99))} mean {ms(summary.mean)}"
        f" ({summary.total / window * 100:.1f}% of a core)"
    )


async def main(args: argparse.Namespace, workdir: Path) -> None:
    server = etcdserver.EtcdServer.start() if args.store == "etcd" else None
    fleet = processes.LocalFleet(
        workdir=workdir,
        store=server.url if server else "",
        heartbeat=args.heartbeat,
        lost_after=600.0,  # a starved agent is slow, not lost
    )
    # one token stands for a fleet's many users: not held to one principal's requests in progress
    fleet.broker_args = ["--max-requests-per-principal", "0", *args.broker_arg]
    names = [f"c{i:03d}" for i in range(args.clusters)]
    try:
        fleet.write_tokens(tenants=["bench"], clusters=names)
        started = time.perf_counter()
        broker = await fleet.start_broker()
        empty = bench_throughput.rss_mib(broker.process.pid)
        await start_agents(fleet, names, nodes=args.nodes, wave=args.wave)
        agents = {name: service.process.pid for name, service in fleet.agents.items()}
        print(
            f"{args.clusters} clusters x {args.nodes} nodes x 8 GPUs = "
            f"{args.clusters * args.nodes:,} nodes, one agent process each, store {args.store}, "
            f"heartbeat {args.heartbeat:g} s; all Ready {time.perf_counter() - started:.0f} s "
            f"after the broker started; broker RSS {empty:.0f} MiB empty, "
            f"{bench_throughput.rss_mib(broker.process.pid):.0f} MiB with every summary"
        )
        await idle(fleet, args.idle, agents)
        await paced(fleet, args.rate, args.seconds)
        agents_rss = sum(bench_throughput.rss_mib(pid) for pid in agents.values())
        print(
            f"end: broker RSS {bench_throughput.rss_mib(broker.process.pid):.0f} MiB; agents "
            f"together {agents_rss:.0f} MiB ({agents_rss / len(agents):.0f} each); whole run "
            f"{time.perf_counter() - started:.0f} s"
        )
    finally:
        await fleet.stop()
        if server is not None:
            server.cleanup()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clusters", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=1000, help="nodes of 8 GPUs per cluster")
    parser.add_argument("--rate", type=float, default=200, help="jobs a second, paced")
    parser.add_argument("--seconds", type=float, default=20, help="the paced run's length")
    parser.add_argument("--idle", type=float, default=20, help="seconds measured idle")
    parser.add_argument("--wave", type=int, default=10, help="agents started at once")
    parser.add_argument("--heartbeat", type=float, default=5.0, help="the broker's --heartbeat")
    parser.add_argument("--store", choices=["sqlite", "etcd"], default="sqlite")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="4 clusters of 200 nodes, 3 s idle and 3 s paced at 100 jobs/s",
    )
    parser.add_argument(
        "--broker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the broker, e.g. --broker-arg=--cycle-interval=0.02",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.clusters, args.nodes, args.idle, args.seconds, args.rate = 4, 200, 3.0, 3.0, 100.0
    return args


if __name__ == "__main__":
    arguments = parse()
    with helpers.workdir("gpufed-fleet-") as workdir:
        asyncio.run(main(arguments, workdir))
