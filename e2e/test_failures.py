"""Failure scenarios with real processes: a broker restart loses nothing, a lost cluster's
jobs run elsewhere, and an agent that comes back after its jobs moved does not run them twice."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from e2e.helpers import wait_for
from gpufed.local import processes
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"


async def test_broker_restart_loses_no_job_and_running_work_survives(
    fleet: processes.LocalFleet,
) -> None:
    await fleet.start_simulated(["h100"])
    async with fleet.client("team-a") as api:
        running_id = (
            await api.submit(
                json.dumps(make_job("survivor", gpus=8).model(H100).gang(2).duration(3).document())
            )
        )["id"]
        await wait_for(api, running_id, {"Running"})
        queued_id = (
            await api.submit(json.dumps(make_job("waiter", gpus=8).model(H100).gang(64).document()))
        )["id"]

    assert fleet.broker is not None
    await fleet.broker.stop(sig=signal.SIGKILL)
    await asyncio.sleep(0.5)
    await fleet.start_broker()
    await fleet.wait_clusters_ready(["h100"])

    async with fleet.client("team-a") as api:
        # the job kept running in the cluster while the broker was away, and finishes
        done = await wait_for(api, running_id, {"Succeeded", "Failed", "Cancelled"})
        assert done["status"]["state"] == "Succeeded"
        assert len(done["status"]["pods"]) == 2
        # the queued job is still there, still queued (it cannot fit)
        assert (await api.get(queued_id))["status"]["state"] == "Queued"
        fresh = await api.submit(json.dumps(make_job("after", gpus=1).duration(0.2).document()))
        assert (await wait_for(api, fresh["id"], {"Succeeded"}))["status"]["state"] == "Succeeded"


async def test_lost_cluster_jobs_move_and_the_stale_copy_is_fenced(
    fleet: processes.LocalFleet,
) -> None:
    nodes = processes.config_dir() / "clusters" / "h100.yaml"
    fleet.write_tokens(tenants=["team-a"], clusters=["east", "west"])
    await fleet.start_broker()
    await fleet.start_agent("east", nodes)
    await fleet.wait_clusters_ready(["east"])
    async with fleet.client("team-a") as api:
        job_id = (
            await api.submit(
                json.dumps(make_job("mover", gpus=8).model(H100).gang(2).duration(60).document())
            )
        )["id"]
        first = await wait_for(api, job_id, {"Running"})
        assert first["status"]["cluster"] == "east"

        await fleet.start_agent("west", nodes)
        await fleet.wait_clusters_ready(["west"])
        east = fleet.agents["east"]
        east.process.send_signal(signal.SIGSTOP)  # hangs: no heartbeat, socket stays open
        try:
            moved = await wait_for(api, job_id, {"Running"}, timeout=1)
            deadline = time.monotonic() + 30
            while moved["status"]["cluster"] != "west" and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                moved = await api.get(job_id)
        finally:
            east.process.send_signal(signal.SIGCONT)
        assert moved["status"]["cluster"] == "west"
        reasons = [e["reason"] for e in moved["status"]["events"]]
        assert "ClusterLost" in reasons

        # east comes back holding the old copy: the broker fences it (its pods are deleted)
        await fleet.wait_clusters_ready(["east", "west"])
        deadline = time.monotonic() + 15
        east_free = 0
        while time.monotonic() < deadline:
            clusters = {c["name"]: c for c in await api.clusters()}
            east_free = sum(m["free"] for m in clusters["east"]["models"])
            if east_free == sum(m["total"] for m in clusters["east"]["models"]):
                break
            await asyncio.sleep(0.1)
        assert east_free == 128, "the stale copy on east still holds GPUs"
        assert (await api.get(job_id))["status"]["cluster"] == "west"
