"""An agent partitioned from its broker (a TCP proxy the test cuts) for twice the broker's
grace, with real processes: the agent fences itself before the broker runs its jobs elsewhere,
so no job ever has two copies running at the same moment (the simulated clusters' journals say
when every pod ran); a job of `clusterLost: wait` keeps running on its cluster and is not
restarted elsewhere. And `gpufed agent --broker` with a dead first URL connects to the next."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e.helpers import wait_for
from gpufed import client
from gpufed.local import processes
from tests import journals, tcpproxy
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"
NODES = processes.config_dir() / "clusters" / "h100.yaml"  # 16 nodes x 8 H100


@dataclass
class Workload:
    singles: int  # 1-pod requeue jobs of `single_gpus` GPUs
    single_gpus: int
    gangs: int  # 2-pod gangs of 8 GPUs a pod (requeue)
    waiting: int  # 1-pod jobs of 8 GPUs with clusterLost: wait

    def documents(self) -> dict[str, dict[str, Any]]:
        """The whole-node jobs first: the workload nearly fills east (124 of 128 GPUs with 100
        singles), and singles placed before them, under a loaded machine's timing, could
        leave no node with 8 GPUs free (the waiting job then stayed Queued, once in `make
        chaos`)."""
        docs = {}
        for i in range(self.waiting):
            job = make_job(f"waits-{i}", gpus=8).model(H100).duration(300).cluster_lost("wait")
            docs[f"waits-{i}"] = job.document()
        for i in range(self.gangs):
            docs[f"gang-{i}"] = make_job(f"gang-{i}", gpus=8).model(H100).gang(2).document()
        for i in range(self.singles):
            job = make_job(f"single-{i}", gpus=self.single_gpus).model(H100).duration(300)
            docs[f"single-{i}"] = job.document()
        return docs


async def states(api: client.BrokerClient, ids: list[str]) -> dict[str, dict[str, Any]]:
    return {job_id: (await api.get(job_id))["status"] for job_id in ids}


async def partition_scenario(
    fleet: processes.LocalFleet,
    tmp_path: Path,
    workload: Workload,
    *,
    mode: tcpproxy.Mode,
    graces: float,
) -> None:
    fleet.write_tokens(tenants=["team-a"], clusters=["east", "west"])
    await fleet.start_broker()
    proxy = await tcpproxy.TcpProxy(fleet.port).start()
    east_journal, west_journal = tmp_path / "east.journal", tmp_path / "west.journal"
    try:
        # east reaches the broker only through the proxy (the last --broker wins)
        await fleet.start_agent(
            "east", NODES, "--broker", proxy.url, "--sim-journal", str(east_journal)
        )
        await fleet.wait_clusters_ready(["east"])
        async with fleet.client("team-a") as api:
            names = workload.documents()
            ids = {name: (await api.submit(json.dumps(doc)))["id"] for name, doc in names.items()}
            waiting = [job_id for name, job_id in ids.items() if name.startswith("waits-")]
            requeued = [job_id for job_id in ids.values() if job_id not in waiting]
            for job_id in ids.values():
                assert (await wait_for(api, job_id, {"Running"}))["status"]["cluster"] == "east"
            await fleet.start_agent("west", NODES, "--sim-journal", str(west_journal))
            await fleet.wait_clusters_ready(["west"])

            proxy.cut(mode=mode)
            cut = time.time()
            partition = graces * fleet.lost_after
            seen_waiting_on: set[str | None] = set()
            while time.time() - cut < partition:
                for status in (await states(api, waiting)).values():
                    seen_waiting_on.add(status["cluster"])
                await asyncio.sleep(0.5)
            proxy.heal()
            healed = time.time()

            await fleet.wait_clusters_ready(["east", "west"])
            deadline = time.monotonic() + 20
            moved = await states(api, requeued)
            while time.monotonic() < deadline and any(
                (s["state"], s["cluster"]) != ("Running", "west") for s in moved.values()
            ):
                await asyncio.sleep(0.2)
                moved = await states(api, requeued)
            await asyncio.sleep(1.0)  # east's hello reconciled, its final reports acked
            kept = await states(api, waiting)
            clusters = {c["name"]: c for c in await api.clusters()}

        copies = journals.read([east_journal, west_journal])
        overlaps = journals.overlap_seconds(copies)
        east_stops = [
            iv[-1][1] - cut for c, iv in copies.items() if c.cluster == "east" and c.job in requeued
        ]
        west_starts = [iv[0][0] - cut for c, iv in copies.items() if c.cluster == "west"]
        print(
            f"\npartition ({mode}) of {partition:g} s, grace {fleet.lost_after:g} s: "
            f"{len(ids)} jobs ({len(requeued)} requeue, {len(waiting)} wait), "
            f"{len(copies)} copies, overlap {sum(overlaps.values()):.3f} s in all; east fenced "
            f"{min(east_stops):.2f}-{max(east_stops):.2f} s after the cut, west started them "
            f"{min(west_starts):.2f}-{max(west_starts):.2f} s after it; healed at "
            f"{healed - cut:.1f} s"
        )

        # no job ever ran two copies at once, and every requeue job ran once on each cluster
        assert {job: seconds for job, seconds in overlaps.items() if seconds > 0} == {}
        for job_id in requeued:
            assert {(c.cluster, c.attempt) for c in copies if c.job == job_id} == {
                ("east", 1),
                ("west", 2),
            }, job_id
        assert max(east_stops) < min(west_starts)
        assert max(east_stops) < fleet.lost_after, "east fenced after the broker's grace"
        for status in moved.values():
            assert (status["state"], status["cluster"]) == ("Running", "west"), status
            assert "ClusterLost" in [e["reason"] for e in status["events"]]
        # the waiting jobs never left east, kept running there, and the broker said why
        assert seen_waiting_on == {"east"}
        for job_id, status in kept.items():
            assert (status["state"], status["cluster"], status["attempts"]) == (
                "Running",
                "east",
                1,
            )
            reasons = [e["reason"] for e in status["events"]]
            assert "WaitingForCluster" in reasons and reasons[-1] == "ClusterReturned"
            [(copy, intervals)] = [(c, iv) for c, iv in copies.items() if c.job == job_id]
            assert copy.cluster == "east" and len(intervals) == 1
            assert intervals[0][1] >= time.time() - 1, "the waiting job's pod stopped"
        assert clusters["east"]["health"] == "Ready"
        gpus = sum(m["total"] - m["free"] for m in clusters["east"]["models"])
        assert gpus == 8 * workload.waiting, "east still holds GPUs of fenced jobs"
    finally:
        await proxy.close()


async def test_a_partition_of_twice_the_grace_runs_no_job_twice(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    workload = Workload(singles=40, single_gpus=2, gangs=2, waiting=1)
    await partition_scenario(fleet, tmp_path, workload, mode="blackhole", graces=2)


@pytest.mark.chaos
async def test_many_jobs_through_a_reset_partition_of_three_graces_never_run_twice(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    workload = Workload(singles=100, single_gpus=1, gangs=1, waiting=1)
    await partition_scenario(fleet, tmp_path, workload, mode="reset", graces=3)


async def test_an_agent_given_a_dead_first_broker_url_connects_to_the_next(
    fleet: processes.LocalFleet,
) -> None:
    fleet.write_tokens(tenants=["team-a"], clusters=["east"])
    await fleet.start_broker()
    dead = f"http://127.0.0.1:{processes.free_port()}"
    await fleet.start_agent("east", NODES, "--broker", f"{dead},{fleet.url}")
    await fleet.wait_clusters_ready(["east"], timeout=10)
    async with fleet.client("team-a") as api:
        job = make_job("after-failover", gpus=1).duration(0.2).document()
        job_id = (await api.submit(json.dumps(job)))["id"]
        assert (await wait_for(api, job_id, {"Succeeded"}))["status"]["cluster"] == "east"
