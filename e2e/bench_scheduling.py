"""The broker's decision for one job, as the service makes it: `planning.plan_cycle` over a
fleet snapshot built from the agents' summaries; and with `--backlog N`, whole scheduling
cycles of the real shell with N queued jobs that do not fit.

    .venv/bin/python -m e2e.bench_scheduling [--clusters 20] [--nodes 1000] [--decisions 2000]
    .venv/bin/python -m e2e.bench_scheduling --backlog 100000 [--clusters 3] [--cycles 200]
        [--queues config/queues.yaml] [--full-replan] [--plan-limit 2000]

Fleet: `--clusters` clusters × `--nodes` nodes × 8 GPUs, two GPU models each, 10 racks per
model, nodes partly used at random, each summary applied once to the broker's `fleet.Fleet`.
Jobs: a mix of 1-GPU, 8-GPU, 4×8 rack-preferred and 16×8 NVLink-required gangs, each decided
on its own (no offer is sent: every decision sees the same fleet). Printed: p50/p99 of taking
the snapshot (`Fleet.snapshot`, as each cycle of the broker does) and of one decision, with
no queues and with `config/queues.yaml` (quotas, fair share). Figures only, no assertions.

`--backlog N` (`backlog_scenario`): a broker's job book on SQLite in memory, its
`jobs.scheduling.Scheduler`, the fleet's clusters attached (offers go nowhere) with nodes
mostly in use (a few with 8 GPUs free), N gangs of 12–24 pods × 8 GPUs that fit nowhere
(some rack-required, some NVLink-required) and `--cycles` + 20 1-GPU jobs that fit. After
the first pass (every job planned once, `--plan-limit` a cycle: `planning.backlog.budget`; the
agents then accept its offers, so none stays in flight) and the cycles that plan again the
jobs it told that others took their room (so that `why` tells them what they wait for now),
`--cycles` cycles with nothing new, then `--cycles` cycles each after one running job
finished (its Succeeded committed, its cluster's next summary showing the GPU free).
Every cycle exports the queue gauges, as a broker idling at one cycle a second does.
Printed: p50/p99/max of `run_cycle` in each case, and how many jobs each planned.
`--full-replan` runs the shell as before parking: every pending job planned every cycle
(set `--cycles` low: each such cycle plans the whole backlog).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml

from broker.api import gangs, inventory, jobs, messages, queues, status
from broker.api.status import JobState
from broker.jobs import fleet, scheduling, service
from broker.planning import planning, snapshot
from broker.planning.backlog import budget
from broker.state import records, registry, sqlite
from broker.telemetry import metrics
from tests.builders import make_job

MODELS = ("NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB")
REPO = Path(__file__).resolve().parents[1]


def make_summary(name: str, nodes: int, rng: random.Random) -> inventory.ClusterSummary:
    models = []
    for model in MODELS:
        racks: dict[str, list[int]] = {}
        total = [0] * 9
        for rack in range(10):
            hist = [0] * 9
            for _ in range(nodes // (2 * 10)):
                hist[rng.choice([0, 0, 1, 2, 4, 6, 8, 8])] += 1
            racks[f"r{rack}"] = hist
            total = [a + b for a, b in zip(total, hist, strict=True)]
        count = sum(total)
        free = sum(k * n for k, n in enumerate(total))
        models.append(
            inventory.ModelSummary(
                model=model,
                gpu_memory_mib=81920,
                nodes=count,
                total_gpus=8 * count,
                free_gpus=free,
                nodes_by_free=total,
                largest_free_nvlink_block=8,
                racks=racks,
                shared_free_milli=rng.randrange(0, 20_000),
            )
        )
    return inventory.ClusterSummary(cluster=name, seq=1, models=models)


def job_mix(rng: random.Random, n: int) -> snapshot.PendingJob:
    kind = rng.choice(["one", "eight", "gang4", "gang16"])
    if kind == "one":
        builder = make_job(f"j{n}", gpus=1)
    elif kind == "eight":
        builder = make_job(f"j{n}", gpus=8).model(MODELS[0])
    elif kind == "gang4":
        builder = make_job(f"j{n}", gpus=8).gang(4).topology(rack="preferred")
    else:
        builder = make_job(f"j{n}", gpus=8).gang(16).topology(nvlink="required")
    job = builder.build()
    return snapshot.PendingJob(
        job_id=f"j{n}",
        queue="training",
        priority=0,
        created=datetime(2026, 1, 1, tzinfo=UTC),
        request=gangs.gang_request(f"j{n}", job),
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run(args: argparse.Namespace, config: queues.QueuesConfig | None, label: str) -> None:
    rng = random.Random(42)
    summaries = [make_summary(f"c{i:02d}", args.nodes, rng) for i in range(args.clusters)]
    clusters = fleet.Fleet(stale_after=1e9)  # the broker's view, each summary applied once
    for summary in summaries:
        cluster = clusters.get(summary.cluster)
        cluster.link, cluster.last_seen = Link(), time.monotonic()
        cluster.apply_summary(messages.Summary(summary=summary, full=True))
    gc.collect()
    gc.freeze()  # as the broker does after start-up (BrokerSettings.freeze_gc)
    build_ms: list[float] = []
    decide_ms: list[float] = []
    placed = 0
    now = datetime(2026, 1, 1, 1, tzinfo=UTC)
    for n in range(args.decisions):
        job = job_mix(rng, n)
        started = time.perf_counter()
        view = clusters.snapshot(now=time.monotonic())
        built = time.perf_counter()
        plan = planning.plan_cycle(view, [job], queues=config, now=now)
        done = time.perf_counter()
        build_ms.append((built - started) * 1000)
        decide_ms.append((done - built) * 1000)
        placed += len(plan.assignments)
    print(
        f"{label:>12}: decision p50 {pct(decide_ms, 50):.3f} ms  p99 {pct(decide_ms, 99):.3f}"
        f" ms  mean {statistics.fmean(decide_ms):.3f} ms | snapshot p50 "
        f"{pct(build_ms, 50):.3f} ms p99 {pct(build_ms, 99):.3f} ms | "
        f"{placed}/{args.decisions} placed"
    )


# ---- the backlog scenario: the real shell, N queued jobs that do not fit -----------------


class Link:
    """An agent session that keeps nothing: offers go nowhere (no agent answers)."""

    async def send(self, message: messages._Msg) -> None:
        del message

    async def close(self, *, reason: str) -> None:
        del reason


def busy_summary(name: str, nodes: int, rng: random.Random) -> inventory.ClusterSummary:
    """Nodes mostly in use: a few with all 8 GPUs free, the rest with 0–4 free."""
    models = []
    for model in MODELS:
        racks: dict[str, list[int]] = {}
        total = [0] * 9
        for rack in range(10):
            hist = [0] * 9
            for _ in range(nodes // (2 * 10)):
                hist[rng.choice([0, 0, 0, 1, 2, 3, 4])] += 1
            hist[8] += rng.randrange(0, 2)  # at most one whole node free per rack
            racks[f"r{rack}"] = hist
            total = [a + b for a, b in zip(total, hist, strict=True)]
        count = sum(total)
        models.append(
            inventory.ModelSummary(
                model=model,
                gpu_memory_mib=81920,
                nodes=count,
                total_gpus=8 * count,
                free_gpus=sum(k * n for k, n in enumerate(total)),
                nodes_by_free=total,
                largest_free_nvlink_block=8 if total[8] else 4,
                racks=racks,
            )
        )
    return inventory.ClusterSummary(cluster=name, seq=1, models=models)


def freed(summary: inventory.ClusterSummary, model: str, gpus: int) -> inventory.ClusterSummary:
    """The cluster's next summary: `gpus` more free on one node of `model` (a job ended)."""
    changed = []
    for item in summary.models:
        hist = list(item.nodes_by_free)
        # a node the job's pods left: one of the fullest (1-GPU jobs are placed best fit)
        used = next((f for f in range(len(hist) - gpus) if hist[f]), None)
        if item.model != model or used is None:
            changed.append(item)
            continue
        hist[used] -= 1
        hist[used + gpus] += 1
        racks = {rack: list(counts) for rack, counts in item.racks.items()}
        for counts in racks.values():
            if counts[used]:
                counts[used] -= 1
                counts[used + gpus] += 1
                break
        update = {"nodes_by_free": hist, "racks": racks, "free_gpus": item.free_gpus + gpus}
        changed.append(item.model_copy(update=update))
    return summary.model_copy(update={"models": changed, "seq": summary.seq + 1})


def accept_offers(clusters: fleet.Fleet, summaries: dict[str, inventory.ClusterSummary]) -> None:
    """The agents accept the offers in flight and send summaries with those GPUs taken."""
    taken = clusters.snapshot(now=time.monotonic())
    for name, cluster in clusters.clusters.items():
        models = []
        for item in summaries[name].models:
            left = taken.clusters[name].models[item.model]
            update = {
                "nodes_by_free": list(left.nodes_by_free),
                "racks": {rack: list(hist) for rack, hist in left.racks.items()},
                "free_gpus": left.free_gpus,
            }
            models.append(item.model_copy(update=update))
        summary = summaries[name].model_copy(update={"models": models})
        summaries[name] = summary.model_copy(update={"seq": summary.seq + 1})
        for flight in cluster.inflight.values():
            flight.accepted = True
        cluster.apply_summary(messages.Summary(summary=summaries[name], full=True))


def backlog_jobs(rng: random.Random) -> list[jobs.GPUJob]:
    """The backlog's gang shapes (a job's spec never changes, so records share them)."""
    out = []
    for pods in (12, 16, 20, 24):
        out.append(make_job("big", gpus=8, queue="training").gang(pods).build())
        out.append(
            make_job("big", gpus=8, queue="training").gang(pods).topology(rack="required").build()
        )
        out.append(
            make_job("big", gpus=8, queue="training").gang(pods).topology(nvlink="required").build()
        )
    rng.shuffle(out)
    return out


def pct_ms(values: list[float], q: float) -> str:
    return f"{pct(values, q) * 1000:.2f}"


async def backlog_scenario(args: argparse.Namespace) -> None:
    rng = random.Random(7)
    store = await sqlite.SqliteStore.open(":memory:")
    clusters = fleet.Fleet(stale_after=1e9)
    meters = metrics.BrokerMetrics()
    book = service.Jobs(records.JobStore(store), clusters, meters=meters)
    queue_registry = registry.QueueRegistry()
    if args.queues:
        config = queues.QueuesConfig.model_validate(yaml.safe_load(Path(args.queues).read_text()))
        queue_registry.config = config
    scheduler = scheduling.Scheduler(
        book.book,
        clusters,
        dispatcher=book.dispatcher,
        accounts=book.accounts,
        victims=book.victims,
        meters=meters,
        queues=queue_registry,
        full_replan=args.full_replan,
        plan_limit=args.plan_limit or None,
        queue_gauges_every=0.0,  # an idle broker cycles once a second: each one exports them
    )
    summaries = {}
    for i in range(args.clusters):
        name = f"c{i:02d}"
        cluster = await clusters.attach(name, Link(), epoch=1)
        summaries[name] = busy_summary(name, args.nodes, rng)
        cluster.apply_summary(messages.Summary(summary=summaries[name], full=True))
    started = time.perf_counter()
    batch = []
    shapes = backlog_jobs(rng)
    small = make_job(gpus=1, queue="training").build()
    fitting = args.cycles + 20  # a few that fit: one finishes per cycle of the second case
    for n in range(args.backlog + fitting):
        job = shapes[n % len(shapes)] if n < args.backlog else small
        batch.append(status.JobRecord(id=f"j{n:06d}", tenant="team-a", job=job))
        if len(batch) >= 1000:
            await asyncio.gather(*(book.submit(r) for r in batch))
            batch = []
    await asyncio.gather(*(book.submit(r) for r in batch))
    print(
        f"backlog: {args.backlog} gangs that fit nowhere + {fitting} 1-GPU jobs on "
        f"{args.clusters} clusters x {args.nodes} nodes, queues {args.queues or 'none'}, "
        f"{'full re-plan' if args.full_replan else 'parking'}; submitted in "
        f"{time.perf_counter() - started:.1f} s"
    )
    gc.collect()
    gc.freeze()  # as the broker does after loading (BrokerSettings.freeze_gc)
    first = time.perf_counter()
    slices: list[float] = []
    while True:  # the first cycles: every job planned once, in slices of --plan-limit
        began = time.perf_counter()
        await scheduler.run_cycle()
        slices.append(time.perf_counter() - began)
        if scheduler.last_cycle is None or not scheduler.last_cycle.deferred:
            break
    print(
        f"  first pass (every job planned once, at most {args.plan_limit or 'all'} a cycle): "
        f"{len(slices)} cycle(s), {time.perf_counter() - first:.2f} s in all, the longest "
        f"cycle {max(slices):.2f} s (cycle {slices.index(max(slices)) + 1}), median "
        f"{statistics.median(slices):.2f} s; {len(scheduler.backlog.parked())} parked, "
        f"{len(book.book.holding())} dispatched"
    )
    if args.verbose:
        print("  cycle seconds:", " ".join(f"{x:.2f}" for x in slices))
    accept_offers(clusters, summaries)
    settling = time.perf_counter()
    settled = 0
    while settled < 10:  # jobs told this cycle that others took their room: planned again
        settled += 1
        await scheduler.run_cycle()
        if scheduler.last_cycle is None or not scheduler.last_cycle.planned:
            break
    print(
        f"  settling: {settled} cycle(s), {time.perf_counter() - settling:.2f} s, "
        f"{len(scheduler.backlog.parked())} parked"
    )
    idle: list[float] = []
    planned: list[int] = []
    for _ in range(args.cycles):
        began = time.perf_counter()
        await scheduler.run_cycle()
        idle.append(time.perf_counter() - began)
        planned.append(len(scheduler.last_cycle.planned) if scheduler.last_cycle else 0)
    report("nothing changes", idle, planned)
    finishing: list[float] = []
    planned = []
    for _ in range(args.cycles):
        holders = sorted(book.book.holding())
        if not holders:
            break
        job_id = holders[0]
        draft = book.book.draft(job_id)
        assert draft is not None
        name = draft.status.cluster or ""
        draft.record(JobState.SUCCEEDED, "Succeeded", "bench: finished")
        await book.book.commit([draft])
        summaries[name] = freed(summaries[name], MODELS[0], 1)
        clusters.clusters[name].apply_summary(messages.Summary(summary=summaries[name], full=True))
        began = time.perf_counter()
        await scheduler.run_cycle()
        finishing.append(time.perf_counter() - began)
        planned.append(len(scheduler.last_cycle.planned) if scheduler.last_cycle else 0)
    report("one job finished", finishing, planned)
    await store.close()


def report(label: str, seconds: list[float], planned: list[int]) -> None:
    if not seconds:
        print(f"  {label}: no cycles")
        return
    print(
        f"  {label:>17}: cycle p50 {pct_ms(seconds, 50)} ms  p99 {pct_ms(seconds, 99)} ms  "
        f"max {max(seconds) * 1000:.2f} ms over {len(seconds)} cycles; jobs planned per "
        f"cycle: median {statistics.median(planned):g}, max {max(planned)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clusters", type=int, default=None)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--backlog", type=int, default=0, help="queued jobs that do not fit")
    parser.add_argument("--cycles", type=int, default=200, help="cycles timed per case")
    parser.add_argument("--queues", default=None, help="a queues file (--backlog)")
    parser.add_argument("--full-replan", action="store_true", help="plan every job every cycle")
    parser.add_argument("--verbose", action="store_true", help="print every cycle's time")
    parser.add_argument(
        "--plan-limit",
        type=int,
        default=budget.DEFAULT_LIMIT,
        help="pending jobs a cycle plans, at most (0: all, as before the limit)",
    )
    args = parser.parse_args()
    if args.backlog:
        args.clusters = args.clusters or 3
        asyncio.run(backlog_scenario(args))
        return
    args.clusters = args.clusters or 20
    print(
        f"broker decision: {args.clusters} clusters x {args.nodes} nodes x 8 GPUs, "
        f"{args.decisions} decisions"
    )
    run(args, None, "no queues")
    config = queues.QueuesConfig.model_validate(
        yaml.safe_load((REPO / "config" / "queues.yaml").read_text())
    )
    run(args, config, "with queues")


if __name__ == "__main__":
    main()
