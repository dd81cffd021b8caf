"""The replicated path without faults: a three-member etcd cluster, three brokers and three
simulated agents (the chaos suite's fleet, `e2e.test_chaos_ha`), a flood of 1-pod jobs and
gangs from clients that pick a random replica per request.

    .venv/bin/python -m e2e.bench_replicas [--jobs 3000]

Printed (no assertions; these machines are shared and noisy): how long the flood took and
how long until every job was final, the phases of a sample of jobs from the broker's own
event times (Queued → Dispatched → Running → Succeeded), and the CPU seconds each process
spent: on two cores the whole fleet shares them, so CPU per job is what bounds the chaos
suite's 10,000 jobs in five minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import random
import statistics
import time
from datetime import datetime
from pathlib import Path

import aiohttp

from e2e import helpers
from e2e import test_chaos_ha as chaos
from gpufed.local import processes
from tests import etcdcluster

PHASES = ["Queued", "Dispatched", "Running", "Succeeded"]
SAMPLE = 300


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def phases(flood: chaos.Flood) -> dict[str, list[float]]:
    out: dict[str, list[float]] = collections.defaultdict(list)
    ids = sorted(flood.accepted.values())
    async with aiohttp.ClientSession() as session:
        for job_id in random.Random(1).sample(ids, min(SAMPLE, len(ids))):
            job = await flood.get(session, f"/v1/jobs/{job_id}")
            first: dict[str, float] = {}
            for event in job["status"].get("events", []):
                first.setdefault(event["state"], datetime.fromisoformat(event["time"]).timestamp())
            for before, after in itertools.pairwise(PHASES):
                if before in first and after in first:
                    out[f"{before} -> {after}"].append(first[after] - first[before])
    return out


async def main(args: argparse.Namespace, workdir: Path) -> None:
    etcd = await asyncio.to_thread(etcdcluster.EtcdCluster.start, 3)
    fleet = processes.LocalFleet(workdir=workdir, heartbeat=0.5, lost_after=chaos.GRACE)
    fleet.store = etcd.url
    try:
        fleet.write_tokens(tenants=["team-a"], clusters=chaos.CLUSTERS)
        await fleet.start_brokers(3)
        for cluster in chaos.CLUSTERS:
            nodes = chaos.write_nodes(workdir / f"{cluster}.yaml", cluster)
            await fleet.start_agent(cluster, nodes)
        await fleet.wait_clusters_ready(chaos.CLUSTERS)
        leader = await fleet.leader(timeout=60)
        flood = chaos.Flood(fleet.urls, fleet.tokens["team-a"])
        started = time.monotonic()
        await flood.run(chaos.workload(args.jobs, random.Random(7)))
        flooded = time.monotonic() - started
        states = await chaos.wait_all_final(flood, timeout=900)
        final = time.monotonic() - started
        print(
            f"{args.jobs} jobs from {chaos.WORKERS} clients: flood {flooded:.1f} s "
            f"({args.jobs / flooded:.0f} submits/s), every job final after {final:.1f} s "
            f"({args.jobs / final:.0f} jobs/s): {dict(collections.Counter(states.values()))}"
        )
        for name, values in (await phases(flood)).items():
            values.sort()
            print(
                f"  {name}: p50 {statistics.median(values):.2f} s, "
                f"p90 {values[int(0.9 * len(values))]:.2f} s, max {values[-1]:.2f} s"
            )
        spent = {
            f"{b.name}{' (leader)' if b is leader else ''}": cpu_seconds(b.process.pid)
            for b in fleet.brokers
        }
        spent |= {f"agent {n}": cpu_seconds(a.process.pid) for n, a in fleet.agents.items()}
        spent |= {
            f"etcd m{i}": cpu_seconds(p.pid) for i, p in enumerate(etcd.processes) if p is not None
        }
        print("CPU seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in spent.items()))
        print(f"  {1000 * sum(spent.values()) / args.jobs:.1f} ms of CPU a job, all processes")
    finally:
        await fleet.stop()
        etcd.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000)
    arguments = parser.parse_args()
    with helpers.workdir("gpufed-replicas-") as workdir:
        asyncio.run(main(arguments, workdir))
