"""Placement benchmarks: print p50/p99, assert nothing (`python -m e2e.bench_placement`).

1. agent: `place_gang` of a 64-GPU gang (8 pods × 8 GPUs) on a 5,000-node cluster, with the
   agent's kept index and with an index built per call;
2. broker: `planning.plan_cycle` for one job over 20 clusters × 1,000 nodes × 8 GPUs (summaries);
3. `gpufed simulate`: wall time of one protocol-A seed on the Alibaba trace (one pool, K=4).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from broker.api import gangs, jobs
from broker.planning import planning, snapshot
from gpufed.sim import runs, simulating
from member_agent.inventory import model, summary
from member_agent.placement import gang, indexing

DATA = Path(__file__).resolve().parent / "data"


def _cluster(name: str, nodes: int, *, rng: random.Random, idle: float) -> model.Inventory:
    """`nodes` 8-GPU nodes: a share `idle` untouched, a quarter full, the rest partly used."""
    inv = model.Inventory(cluster=name)
    for i in range(nodes):
        draw = rng.random()
        if draw < idle:
            free = [1000] * 8
        elif draw < idle + 0.25:
            free = [0] * 8
        else:
            free = [rng.choice((0, 0, 250, 500, 1000, 1000)) for _ in range(8)]
        inv.add(
            model.Node(
                name=f"{name}-n{i:05d}",
                model="H100",
                gpu_count=8,
                gpu_memory_mib=81_920,
                cpu_milli=128_000,
                memory_mib=1_048_576,
                rack=f"r{i // 32}",
                nvlink_island=8,
                gpu_free=free,
            )
        )
    return inv


def _timed(call: Callable[[], object], *, repeat: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))]


def bench_agent(repeat: int) -> None:
    rng = random.Random(1)
    inv = _cluster("agent", 5000, rng=rng, idle=0.2)
    whole = sum(1 for node in inv if node.whole_free == 8)
    shape = jobs.PodShape(gpus=8, cpu_milli=32_000, memory_mib=262_144)
    request = gangs.GangRequest(job_id="bench", tasks=(("worker", 8, shape),), min_member=8)
    index = indexing.FreeIndex.build(inv)
    gc.collect()
    gc.freeze()  # as the agent does after start-up (AgentSettings.freeze_gc)
    result = gang.place_gang(inv, request, index=index)
    assert isinstance(result, gang.GangPlacement), result
    kept = _timed(lambda: gang.place_gang(inv, request, index=index), repeat=repeat)
    fresh = _timed(lambda: gang.place_gang(inv, request), repeat=max(10, repeat // 10))
    small = jobs.PodShape(gpus=1, gpu_milli=500, cpu_milli=4000, memory_mib=16_384)
    sharing = gangs.GangRequest(job_id="share", tasks=(("w", 64, small),), min_member=64)
    shared = _timed(
        lambda: gang.place_gang(inv, sharing, index=index), repeat=max(10, repeat // 10)
    )
    print(f"agent place_gang 8×8 GPUs, 5,000 nodes ({whole} wholly free), default policy:")
    print(f"  kept index      p50 {kept[0]:7.2f} ms   p99 {kept[1]:7.2f} ms")
    print(f"  index per call  p50 {fresh[0]:7.2f} ms   p99 {fresh[1]:7.2f} ms")
    print(f"  64 × 500-milli sharing pods  p50 {shared[0]:7.2f} ms   p99 {shared[1]:7.2f} ms")


def bench_broker(repeat: int) -> None:
    rng = random.Random(2)
    summaries = [
        summary.summarise(_cluster(f"c{i:02d}", 1000, rng=rng, idle=0.1)) for i in range(20)
    ]
    shape = jobs.PodShape(gpus=8)
    request = gangs.GangRequest(job_id="bench", tasks=(("worker", 8, shape),), min_member=8)
    job = snapshot.PendingJob(
        job_id="bench",
        queue="q",
        priority=0,
        created=datetime(2026, 1, 1, tzinfo=UTC),
        request=request,
    )

    def decide() -> planning.CyclePlan:
        fleet = snapshot.FleetSnapshot.build(
            [snapshot.ClusterCapacity.from_summary(item, healthy=True) for item in summaries]
        )
        return planning.plan_cycle(fleet, [job])

    gc.collect()
    gc.freeze()  # as the broker does after start-up (BrokerSettings.freeze_gc)
    assert decide().assignments
    figures = _timed(decide, repeat=repeat)
    print(
        "broker plan_cycle for one 8×8-GPU gang (snapshot included), 20 clusters × 1,000 "
        "nodes × 8 GPUs (more shapes: e2e.bench_scheduling):"
    )
    print(f"  p50 {figures[0]:7.3f} ms   p99 {figures[1]:7.3f} ms")


def bench_simulate(policies: list[str], clusters: list[int]) -> None:
    for policy in policies:
        for count in clusters:
            job = runs.Job(
                nodes=DATA / "openb_node_list_gpu_node.csv",
                pods=DATA / "openb_pod_list_default.csv",
                policy=policy,
                seed=42,
                tune=1.3,
                clusters=count,
                split_seed=0,
                mode="a",
                compression=1.0,
                dump=False,
            )
            outcome = simulating.run_job(job)
            print(
                f"simulate one seed (protocol A, {outcome.pods} pods, 1,213 nodes), {policy}, "
                f"K={count}: {outcome.seconds:.1f} s, unallocated @100% "
                f"{100 - outcome.alloc[100]:.2f}%"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--skip-simulate", action="store_true")
    args = parser.parse_args(argv)
    bench_agent(args.repeat)
    bench_broker(args.repeat)
    if not args.skip_simulate:
        bench_simulate(["default", "fgd"], [1, 4])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
