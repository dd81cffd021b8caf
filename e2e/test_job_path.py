"""A job's whole path through real processes: broker (etcd or SQLite) and two agents.

Submit through the HTTP API, see the jobs go Queued → Dispatched → Running → Succeeded with
pods on nodes that had room, and cancel a running job: it ends Cancelled and its GPUs are
free again in the agent's own report.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from typing import Any

import pytest

from e2e.helpers import FINAL, wait_for
from gpufed.local import processes
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"
L4 = "NVIDIA-L4"


def states_of(job: dict[str, Any]) -> list[str]:
    seen: list[str] = []
    for event in job["status"]["events"]:
        if not seen or seen[-1] != event["state"]:
            seen.append(event["state"])
    return seen


async def start(fleet: processes.LocalFleet, store: str) -> None:
    fleet.store = store
    if store:  # etcd: a failover (lease 5 s) must reach the agents before they fence
        fleet.lost_after = 9.0
    await fleet.start_simulated(["h100", "inference"])


async def free_gpus(fleet: processes.LocalFleet, cluster: str) -> tuple[int, int]:
    async with fleet.client("admin") as admin:
        for item in await admin.clusters():
            if item["name"] == cluster:
                return (
                    sum(m["free"] for m in item["models"]),
                    sum(m["total"] for m in item["models"]),
                )
    raise AssertionError(f"no cluster {cluster}")


@pytest.mark.parametrize("store", ["etcd", "sqlite"])
async def test_gang_and_single_gpu_jobs_run_and_a_running_job_is_cancelled(
    fleet: processes.LocalFleet, store: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("etcd_url") if store == "etcd" else ""
    await start(fleet, url)
    async with fleet.client("team-a") as api:
        gang = make_job("gang", gpus=8).model(H100).gang(2).duration(1.5)
        single = make_job("single", gpus=1).model(L4).duration(1.5)
        long = make_job("long", gpus=4).model(H100)
        ids = {}
        for name, builder in [("gang", gang), ("single", single), ("long", long)]:
            ids[name] = (await api.submit(json.dumps(builder.document())))["id"]

        running_long = await wait_for(api, ids["long"], {"Running"})
        done = {n: await wait_for(api, ids[n], FINAL) for n in ("gang", "single")}

        for name, job in done.items():
            assert states_of(job) == ["Queued", "Dispatched", "Running", "Succeeded"], name
        assert done["gang"]["status"]["cluster"] == "h100"
        assert done["single"]["status"]["cluster"] == "inference"
        gang_pods = done["gang"]["status"]["pods"]
        assert len(gang_pods) == 2
        assert all(len(p["gpus"]) == 8 for p in gang_pods)
        assert len({p["node"] for p in gang_pods}) == 2, "two 8-GPU pods need two nodes"
        assert done["single"]["status"]["pods"][0]["node"].startswith("l4-")

        # pods that ran at the same time never share a GPU
        taken: dict[str, set[int]] = defaultdict(set)
        for job in (done["gang"], running_long):
            for pod in job["status"]["pods"]:
                indices = {g["index"] for g in pod["gpus"]}
                assert not taken[pod["node"]] & indices, f"GPU shared on {pod['node']}"
                taken[pod["node"]] |= indices

        free_before, total = await free_gpus(fleet, "h100")
        assert free_before == total - 4
        await api.cancel(ids["long"])
        cancelled = await wait_for(api, ids["long"], FINAL)
        assert cancelled["status"]["state"] == "Cancelled"
        assert states_of(cancelled)[:3] == ["Queued", "Dispatched", "Running"]
        deadline = time.monotonic() + 10
        while (await free_gpus(fleet, "h100"))[0] != total and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert (await free_gpus(fleet, "h100"))[0] == total, "cancelled pods still hold GPUs"
