"""The broker's decision for one job, as the service makes it: `planning.plan_cycle` over a
fleet snapshot built from the agents' summaries.

    .venv/bin/python -m e2e.bench_scheduling [--clusters 20] [--nodes 1000] [--decisions 2000]

Fleet: `--clusters` clusters × `--nodes` nodes × 8 GPUs, two GPU models each, 10 racks per
model, nodes partly used at random. Jobs: a mix of 1-GPU, 8-GPU, 4×8 rack-preferred and 16×8
NVLink-required gangs. Printed: p50/p99 of building the snapshot and of one decision, with
no queues and with `config/queues.yaml` (quotas, fair share). Figures only, no assertions.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml

from broker.api import inventory, jobs, queues
from broker.planning import planning, snapshot
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
        request=jobs.gang_request(f"j{n}", job),
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run(args: argparse.Namespace, config: queues.QueuesConfig | None, label: str) -> None:
    rng = random.Random(42)
    summaries = [make_summary(f"c{i:02d}", args.nodes, rng) for i in range(args.clusters)]
    gc.collect()
    gc.freeze()  # as the broker does after start-up (BrokerSettings.freeze_gc)
    build_ms: list[float] = []
    decide_ms: list[float] = []
    placed = 0
    now = datetime(2026, 1, 1, 1, tzinfo=UTC)
    for n in range(args.decisions):
        job = job_mix(rng, n)
        started = time.perf_counter()
        fleet = snapshot.FleetSnapshot.build(
            [snapshot.ClusterCapacity.from_summary(s, healthy=True) for s in summaries]
        )
        built = time.perf_counter()
        plan = planning.plan_cycle(fleet, [job], queues=config, now=now)
        done = time.perf_counter()
        build_ms.append((built - started) * 1000)
        decide_ms.append((done - built) * 1000)
        placed += len(plan.assignments)
    print(
        f"{label:>12}: decision p50 {pct(decide_ms, 50):.3f} ms  p99 {pct(decide_ms, 99):.3f}"
        f" ms  mean {statistics.fmean(decide_ms):.3f} ms | snapshot build p50 "
        f"{pct(build_ms, 50):.3f} ms p99 {pct(build_ms, 99):.3f} ms | "
        f"{placed}/{args.decisions} placed"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clusters", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--decisions", type=int, default=2000)
    args = parser.parse_args()
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
