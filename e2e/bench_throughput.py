"""End-to-end throughput and latency with real processes: etcd, a broker, 3 simulated clusters.

    .venv/bin/python -m e2e.bench_throughput [--store etcd|sqlite] [--jobs 2000] [--rate 200]
                                             [--batch N] [--backlog N] [--replicas N]
                                             [--broker-arg=--FLAG=VALUE ...]
                                             [--traces] [--env=NAME=VALUE ...]

Two runs, figures printed (no assertions; these machines are shared and noisy):
1. burst: submit `--jobs` gang jobs (`--pods` pods of 1 GPU each) as fast as 64 clients can,
   and time until every pod is placed (job Dispatched→accepted by an agent): pods placed/s.
   With `--batch N`, a second burst of as many jobs follows on the same fleet, sent through
   `POST /v1/jobs:batch` in batches of N (8 clients), and both figures are printed side by
   side: submits/s and pods/s of the single route and of the batch route.
2. paced: submit at `--rate` jobs/s for `--seconds`, and report submit→dispatched latency
   percentiles from the broker's own event times, and the CPU time per job of the broker,
   each agent and the client over the paced run (Linux `/proc`).

With `--backlog N`, N gangs that fit in no cluster (1,001 pods of 8 GPUs; a cluster has 1,000
nodes of 8) are queued first, in batches of 1,000 in the same queue, and the scheduler is given
time to plan each of them once; then the paced run measures the jobs that fit with the
backlog waiting beside them (issue 12: submit->dispatched p99 <= 50 ms at 200 jobs/s with
100,000 queued). The broker's RSS is printed before and after the backlog.

With `--replicas N` (etcd), N brokers share the store: the clients send every submit to the
followers, round robin, which validate and store them (`POST /v1/jobs` on any replica); the
leader schedules, dispatches and applies the agents' reports (they follow it), and learns of
the followers' jobs from its watch. CPU per job is printed for each replica.

With `--traces`, the broker and agents export their spans over OTLP/HTTP to a receiver in
this process, which keeps the requests and counts their spans once the fleet has stopped; the
sampler is the SDK's default (every trace) unless `--env` sets the standard variables, e.g.
`--env=OTEL_TRACES_SAMPLER=parentbased_traceidratio --env=OTEL_TRACES_SAMPLER_ARG=0.1`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e import helpers
from gpufed import client
from gpufed.local import processes
from tests import etcdserver
from tests.otlp_receiver import OtlpReceiver

CLUSTERS = ["bench-a", "bench-b", "bench-c"]
PACED = 10_000_000  # paced jobs are numbered from here, backlog jobs from BACKLOG
BACKLOG = 20_000_000
ETCD: etcdserver.EtcdServer | None = None  # the run's store, for its CPU time
BURST_CPU: dict[str, float] = {}  # per process, CPU ms per job of the single route's burst


def write_cluster(path: Path, name: str, nodes: int) -> None:
    path.write_text(
        yaml.safe_dump(
            {
                "cluster": name,
                "pools": [
                    {
                        "name": "gpu",
                        "count": nodes,
                        "gpu_product": "NVIDIA-H100-80GB-HBM3",
                        "gpus_per_node": 8,
                        "gpu_memory_mib": 81559,
                        "cpu": 220,
                        "memory": "2000Gi",
                        "nvlink_island": 8,
                        "racks": 8,
                    }
                ],
            }
        )
    )


def job_doc(n: int, pods: int, *, gpus: int = 1) -> str:
    return json.dumps(job_body(n, pods, gpus=gpus))


def job_body(n: int, pods: int, *, gpus: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "gpufed.io/v1",
        "kind": "GPUJob",
        "metadata": {"name": f"bench-{n}", "labels": {"bench": "paced" if n >= PACED else "burst"}},
        "spec": {
            "queue": "bench",
            "tasks": [
                {
                    "name": "w",
                    "replicas": pods,
                    "template": {
                        "metadata": {"annotations": {"gpufed.io/sim-duration": "3600"}},
                        "spec": {
                            "containers": [
                                {
                                    "name": "c",
                                    "resources": {
                                        "limits": {
                                            "nvidia.com/gpu": gpus,
                                            "cpu": "1",
                                            "memory": "1Gi",
                                        }
                                    },
                                }
                            ]
                        },
                    },
                }
            ],
        },
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else 0.0


def _time(job: dict[str, Any], state: str) -> datetime | None:
    for event in job["status"]["events"]:
        if event["state"] == state:
            return datetime.fromisoformat(event["time"])
    return None


async def accepted_offers(fleet: processes.LocalFleet) -> int:
    """Offers the agents accepted, from the broker's /metrics (cheap to poll); or, if more,
    jobs that reached Running: an agent whose session closed before it answered (silent
    under load, or the broker lost and took the lead again) has its jobs reconciled at its
    next hello, Running without an accepted offer."""
    text = await helpers.scrape(fleet)
    accepted = running = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "gpufed_placements":
            accepted = sum(
                s.value
                for s in family.samples
                if s.name.endswith("_total") and s.labels.get("result") == "accepted"
            )
        elif family.name == "gpufed_job_submit_to_running_seconds":
            running = sum(s.value for s in family.samples if s.name.endswith("_count"))
    return int(max(accepted, running))


def submit_urls(fleet: processes.LocalFleet) -> list[str]:
    """Where the clients send their submits: the followers, if there are any (`fleet.url`
    is the leader's), else the broker."""
    return [url for url in fleet.urls if url != fleet.url] or [fleet.url]


async def burst(
    fleet: processes.LocalFleet, jobs: int, pods: int, *, batch: int = 0, first: int = 0
) -> tuple[float, float]:
    """Submit `jobs` jobs (numbered from `first`): through the single route from 64 clients,
    or (`batch` N) in batches of N from 8, spread over `submit_urls`; returns (submits/s,
    pods placed/s)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    numbers = list(range(first, first + jobs))
    size = batch or 1
    for start in range(0, jobs, size):
        queue.put_nowait(numbers[start : start + size])
    refused = 0
    placed_before = await accepted_offers(fleet)
    pids = processes_of(fleet)
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    counts_before = await helpers.broker_counts(fleet)
    requests_before = etcd_requests()
    async with contextlib.AsyncExitStack() as stack:
        apis = [
            await stack.enter_async_context(fleet.client("bench", url=url))
            for url in submit_urls(fleet)
        ]

        async def worker(api: client.BrokerClient) -> None:
            nonlocal refused
            while not queue.empty():
                chunk = queue.get_nowait()
                if not batch:
                    await api.submit(job_doc(chunk[0], pods))
                    continue
                answer = await api.submit_batch([{"job": job_body(n, pods)} for n in chunk])
                refused += answer["failed"]

        started = time.perf_counter()
        await asyncio.gather(*[worker(apis[n % len(apis)]) for n in range(8 if batch else 64)])
        submitted = time.perf_counter() - started
        while True:
            placed = await accepted_offers(fleet) - placed_before
            if placed >= jobs - refused:
                break
            if time.perf_counter() - started > 600:
                print(f"burst: only {placed}/{jobs} placed after 600 s")
                break
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - started
    spent = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    counts = helpers.counts_since(await helpers.broker_counts(fleet), counts_before)
    requests = etcd_requests() - requests_before
    route = f"batches of {batch}" if batch else "single route"
    print(
        f"burst ({route}): {jobs} jobs x {pods} pods submitted in {submitted:.2f}s "
        f"({jobs / submitted:.0f} jobs/s{f', {refused} refused' if refused else ''}); "
        f"all {jobs * pods} pods placed in {elapsed:.2f}s = {jobs * pods / elapsed:.0f} pods/s"
    )
    print(
        f"burst ({route}): CPU ms per job, submit to last placed: "
        + ", ".join(f"{name} {s * 1000 / jobs:.2f}" for name, s in sorted(spent.items()))
        + f" (all {sum(spent.values()) * 1000 / jobs:.2f}; {sum(spent.values()) / elapsed:.2f}"
        " cores busy)"
    )
    print(
        f"burst ({route}): per job, the {'leader' if len(fleet.urls) > 1 else 'broker'}'s "
        f"scheduling cycles {counts.get('cycles', 0) / jobs:.3f} "
        f"({counts.get('cycle_seconds', 0) * 1000 / max(1.0, counts.get('cycles', 0)):.2f} ms "
        "each), store writes "
        f"{helpers.writes_per_job(counts, jobs)}"
        + (f"; etcd transaction requests {requests / jobs:.3f}" if ETCD is not None else "")
    )
    if not batch:
        BURST_CPU.update({name: s * 1000 / jobs for name, s in spent.items()})
    return jobs / submitted, jobs * pods / elapsed


def etcd_requests() -> float:
    """Transaction requests the run's etcd has handled so far (its own /metrics: what the
    brokers sent, however many commits each carried); 0 without etcd."""
    if ETCD is None:
        return 0.0
    with urllib.request.urlopen(f"http://{ETCD.endpoint}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "grpc_server_handled"
        for s in family.samples
        if s.labels.get("grpc_method") == "Txn" and s.name.endswith("_total")
    )


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` (Linux `/proc`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def gauge(fleet: processes.LocalFleet, name: str) -> float:
    """The sum of a broker gauge's samples, from /metrics."""
    text = await helpers.scrape(fleet)
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for s in family.samples
        if s.name == name
    )


async def backlog(fleet: processes.LocalFleet, jobs: int) -> None:
    """Queue `jobs` gangs that fit in no cluster, in batches of 1,000 from 4 clients, and
    wait until the broker has planned each once (`gpufed_parked_jobs` counts them all)."""
    assert fleet.broker is not None
    pid = fleet.broker.process.pid
    before = rss_mib(pid)
    started = time.perf_counter()
    numbers = iter(range(BACKLOG, BACKLOG + jobs))
    async with fleet.client("bench") as api:

        async def worker() -> None:
            while chunk := [n for _, n in zip(range(1000), numbers, strict=False)]:
                answer = await api.submit_batch([{"job": job_body(n, 1001, gpus=8)} for n in chunk])
                assert not answer["failed"], answer

        await asyncio.gather(*[worker() for _ in range(4)])
    submitted = time.perf_counter() - started
    while (told := await gauge(fleet, "gpufed_parked_jobs")) < jobs:
        if time.perf_counter() - started > 1200:
            print(f"backlog: only {told:.0f}/{jobs} planned after 1200 s")
            break
        await asyncio.sleep(1.0)
    print(
        f"backlog: {jobs} gangs of 1001 x 8 GPUs queued in {submitted:.1f}s "
        f"({jobs / submitted:.0f} jobs/s), each planned once after "
        f"{time.perf_counter() - started:.1f}s; broker RSS {before:.0f} -> "
        f"{rss_mib(pid):.0f} MiB"
    )


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far (Linux `/proc`; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes_of(fleet: processes.LocalFleet) -> dict[str, int]:
    """Name -> pid of the fleet's broker (or replicas: `leader`, `follower-N`) and agents,
    and of this process (the client)."""
    out = {"client": os.getpid()}
    if fleet.broker is not None:
        out["broker"] = fleet.broker.process.pid
    followers = 0
    for replica in fleet.brokers:
        if replica.url == fleet.url:
            out["leader"] = replica.process.pid
        else:
            followers += 1
            out[f"follower-{followers}"] = replica.process.pid
    if ETCD is not None and ETCD.process is not None:
        out["etcd"] = ETCD.process.pid
    out.update({name: agent.process.pid for name, agent in fleet.agents.items()})
    return out


async def paced(fleet: processes.LocalFleet, rate: float, seconds: float) -> None:
    total = int(rate * seconds)
    pids = processes_of(fleet)
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    counts_before = await helpers.broker_counts(fleet)
    requests_before = etcd_requests()
    urls = submit_urls(fleet)
    async with contextlib.AsyncExitStack() as stack:
        apis = [await stack.enter_async_context(fleet.client("bench", url=u)) for u in urls]
        api = apis[0]
        started = time.perf_counter()
        tasks = []
        for n in range(total):
            delay = started + n / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            submit = apis[n % len(apis)].submit(job_doc(PACED + n, 1))
            tasks.append(asyncio.create_task(submit))
        ids = {r["id"] for r in await asyncio.gather(*tasks)}
        achieved = total / (time.perf_counter() - started)
        await asyncio.sleep(1.0)  # the last offers placed
        per_job = {n: (cpu_seconds(pid) - cpu_before[n]) * 1000 / total for n, pid in pids.items()}
        counts = helpers.counts_since(await helpers.broker_counts(fleet), counts_before)
        requests = etcd_requests() - requests_before
        await asyncio.sleep(1.0)
        items = [
            j for j in await api.jobs(selector="bench=paced", limit=1_000_000) if j["id"] in ids
        ]
    lat = []
    for job in items:
        queued, dispatched = _time(job, "Queued"), _time(job, "Dispatched")
        if queued and dispatched:
            lat.append((dispatched - queued).total_seconds() * 1000)
    print(
        f"paced: {total} jobs at {achieved:.0f}/s (asked {rate:.0f}/s); "
        f"submit->dispatched ms p50 {pct(lat, 50):.1f} p90 {pct(lat, 90):.1f} "
        f"p99 {pct(lat, 99):.1f} max {max(lat, default=0):.1f} ({len(lat)} dispatched)"
    )
    print(
        "paced: CPU ms per job, "
        + ", ".join(f"{name} {value:.2f}" for name, value in sorted(per_job.items()))
    )
    # every process against its own burst: the broker's beside the client's, whose work is one
    # POST a job at any rate (what a moderate rate costs any process here, not the broker's)
    ratios = {n: v / BURST_CPU[n] for n, v in per_job.items() if BURST_CPU.get(n, 0) >= 0.05}
    print(
        "paced: CPU per job against the burst's, "
        + ", ".join(f"{name} {value:.2f}x" for name, value in sorted(ratios.items()))
    )
    print(
        f"paced: per job, the {'leader' if len(fleet.urls) > 1 else 'broker'}'s scheduling "
        f"cycles {counts.get('cycles', 0) / total:.3f} "
        f"({counts.get('cycle_seconds', 0) * 1000 / max(1.0, counts.get('cycles', 0)):.2f} ms "
        "each), store writes "
        f"{helpers.writes_per_job(counts, total)}"
        + (f"; etcd transaction requests {requests / total:.3f}" if ETCD is not None else "")
    )


async def main(args: argparse.Namespace, workdir: Path) -> None:
    global ETCD
    server = ETCD = etcdserver.EtcdServer.start() if args.store == "etcd" else None
    fleet = processes.LocalFleet(workdir=workdir, store=server.url if server else "")
    # one token stands for a fleet's many users: not held to one principal's requests in progress
    fleet.broker_args = ["--max-requests-per-principal", "0", *args.broker_arg]
    fleet.env = dict(item.split("=", 1) for item in args.env)
    receiver = OtlpReceiver(parse=False) if args.traces else None
    if receiver is not None:
        await receiver.start()
        fleet.env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **fleet.env}
    try:
        fleet.write_tokens(tenants=["bench"], clusters=CLUSTERS)
        if args.replicas > 1:
            await fleet.start_brokers(args.replicas)
            leader = await fleet.leader()
            fleet.port = int(leader.url.rsplit(":", 1)[1])  # fleet.url: the leader's /metrics
        else:
            await fleet.start_broker()
        for name in CLUSTERS:
            write_cluster(workdir / f"{name}.yaml", name, args.nodes)
            await fleet.start_agent(name, workdir / f"{name}.yaml")
        await fleet.wait_clusters_ready(CLUSTERS, timeout=120)
        print(
            f"store={args.store}, 3 clusters x {args.nodes} nodes x 8 GPUs, 2 cores shared by "
            f"client, {f'{args.replicas} brokers' if args.replicas > 1 else 'broker'}, "
            f"agents{' and etcd' if server else ''}"
        )
        if args.backlog:
            await backlog(fleet, args.backlog)
        single = await burst(fleet, args.jobs, args.pods)
        if args.batch:
            batched = await burst(fleet, args.jobs, args.pods, batch=args.batch, first=args.jobs)
            print(
                f"submits/s: single route {single[0]:.0f}, batches of {args.batch} "
                f"{batched[0]:.0f} ({batched[0] / single[0]:.1f}x); pods/s: single route "
                f"{single[1]:.0f}, batches {batched[1]:.0f}"
            )
        await paced(fleet, args.rate, args.seconds)
    finally:
        await fleet.stop()
        if server is not None:
            server.cleanup()
        if receiver is not None:  # each process exported what it held as it stopped
            jobs = args.jobs * (2 if args.batch else 1) + int(args.rate * args.seconds)
            spans = receiver.count_spans()
            print(f"traces: {spans} spans received, {spans / (jobs + args.backlog):.1f} per job")
            await receiver.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--store", choices=["etcd", "sqlite"], default="etcd")
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument(
        "--batch",
        type=int,
        default=0,
        metavar="N",
        help="then a second burst through POST /v1/jobs:batch in batches of N (at most 1000)",
    )
    parser.add_argument(
        "--backlog",
        type=int,
        default=0,
        metavar="N",
        help="first queue N gangs that fit nowhere, to measure the jobs that fit beside them",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="N brokers on the etcd store; submits go to the followers, the leader schedules",
    )
    parser.add_argument(
        "--broker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for every broker, e.g. --broker-arg=--cycle-interval=0.02 "
        "(repeatable)",
    )
    parser.add_argument(
        "--traces",
        action="store_true",
        help="broker and agents export spans over OTLP/HTTP to a receiver in this process",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="one more environment variable for the broker and agents, e.g. "
        "--env=OTEL_TRACES_SAMPLER=parentbased_traceidratio (repeatable)",
    )
    arguments = parser.parse_args()
    if arguments.replicas > 1 and arguments.store != "etcd":
        parser.error("--replicas needs --store etcd (SQLite is one replica)")
    if arguments.replicas > 1 and arguments.backlog:
        parser.error("--backlog measures one broker: leave out --replicas")
    with helpers.workdir("gpufed-bench-") as workdir:
        asyncio.run(main(arguments, workdir))
