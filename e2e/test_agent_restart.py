"""An agent process killed and started again, on an emulated Kubernetes cluster (kmock over
HTTP): the jobs whose pods still run are picked up again (same pods, nothing created twice,
nothing requeued), and a job the broker moved elsewhere while the agent was down has its stale
pods deleted (fencing)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gpufed.local import processes
from tests import kubeemulator
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = kubeemulator.H100


@contextlib.asynccontextmanager
async def fleet_of(tmp_path: Path, *, lost_after: float) -> AsyncIterator[processes.LocalFleet]:
    fleet = processes.LocalFleet(workdir=tmp_path, heartbeat=0.5, lost_after=lost_after)
    try:
        yield fleet
    finally:
        await fleet.stop()
        for service in [fleet.broker, *fleet.agents.values()]:
            if service is not None and service.process.returncode not in (0, -15, -9, None):
                print(f"--- {service.name} exited {service.process.returncode}:\n{service.tail()}")


@contextlib.asynccontextmanager
async def gpu_cluster(
    tmp_path: Path, name: str, *, nodes: int = 2
) -> AsyncIterator[tuple[kubeemulator.Emulator, Path]]:
    async with kubeemulator.with_kubeconfig(tmp_path, name) as (emulator, kubeconfig):
        for n in range(nodes):
            await emulator.add_node(f"{name}-node-{n}", gpus=8, product=H100)
        yield emulator, kubeconfig


async def start_agent(fleet: processes.LocalFleet, name: str, kubeconfig: Path) -> None:
    await fleet.start_agent(
        name, None, "--kubeconfig", str(kubeconfig), "--namespace", "default", backend="kubernetes"
    )
    await fleet.wait_clusters_ready([name])


def job_pods(emulator: kubeemulator.Emulator, job_id: str) -> list[dict[str, Any]]:
    return [
        p for p in emulator.pods() if p["metadata"].get("labels", {}).get("gpufed.io/job") == job_id
    ]


async def pods_of(
    emulator: kubeemulator.Emulator, job_id: str, count: int, *, timeout: float = 20.0
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pods = job_pods(emulator, job_id)
        if len(pods) == count:
            return pods
        await asyncio.sleep(0.05)
    raise AssertionError(f"{job_id}: not {count} pods after {timeout}s: {len(pods)}")


async def set_phase(
    emulator: kubeemulator.Emulator, pods: list[dict[str, Any]], phase: str
) -> None:
    for pod in pods:
        await emulator.set_pod_phase(pod["metadata"]["namespace"], pod["metadata"]["name"], phase)


async def wait_for(
    api: Any, job_id: str, state: str, *, cluster: str | None = None, timeout: float = 20.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = await api.get(job_id)
        if job["status"]["state"] == state and cluster in (None, job["status"]["cluster"]):
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"{job_id} not {state} on {cluster} after {timeout}s: {job.get('status')}")


def creates(emulator: kubeemulator.Emulator) -> int:
    return len(emulator.requests_of("create", "pods"))


async def test_a_killed_agent_picks_its_running_gang_up_again(tmp_path: Path) -> None:
    # the fleet's processes stop before the emulator they watch (the inner context exits first)
    async with (
        gpu_cluster(tmp_path, "train") as (train, kubeconfig),
        fleet_of(tmp_path, lost_after=30.0) as fleet,
    ):
        fleet.write_tokens(tenants=["team-a"], clusters=["train"])
        await fleet.start_broker()
        await start_agent(fleet, "train", kubeconfig)
        async with fleet.client("team-a") as api:
            gang = make_job("gang", gpus=8).model(H100).gang(2).document()
            job_id = (await api.submit(json.dumps(gang)))["id"]
            pods = await pods_of(train, job_id, 2)
            await set_phase(train, pods, "Running")
            before = await wait_for(api, job_id, "Running")

            await fleet.agents["train"].stop(sig=signal.SIGKILL)
            created = creates(train)
            await start_agent(fleet, "train", kubeconfig)
            # let the restarted agent's hello be reconciled and a few heartbeats pass
            await asyncio.sleep(1.5)

            after = await api.get(job_id)
            assert after["status"]["state"] == "Running"
            assert after["status"]["cluster"] == "train"
            assert sorted((p["name"], p["node"]) for p in after["status"]["pods"]) == sorted(
                (p["name"], p["node"]) for p in before["status"]["pods"]
            )
            reasons = [e["reason"] for e in after["status"]["events"]]
            assert "LostByAgent" not in reasons and "ClusterLost" not in reasons
            assert [e["state"] for e in after["status"]["events"]].count("Running") == 1
            assert creates(train) == created == 2, "pods were created again"
            assert len(job_pods(train, job_id)) == 2

            await set_phase(train, pods, "Succeeded")
            done = await wait_for(api, job_id, "Succeeded")
            assert done["status"]["events"][-1]["state"] == "Succeeded"
            assert creates(train) == 2


async def test_a_job_moved_while_its_agent_was_down_is_fenced_when_it_comes_back(
    tmp_path: Path,
) -> None:
    async with (
        gpu_cluster(tmp_path, "east") as (east, east_config),
        gpu_cluster(tmp_path, "west") as (west, west_config),
        fleet_of(tmp_path, lost_after=4.0) as fleet,  # the least above 5 heartbeats + 1 s
    ):
        fleet.write_tokens(tenants=["team-a"], clusters=["east", "west"])
        await fleet.start_broker()
        await start_agent(fleet, "east", east_config)
        async with fleet.client("team-a") as api:
            gang = make_job("mover", gpus=8).model(H100).gang(2).document()
            job_id = (await api.submit(json.dumps(gang)))["id"]
            stale = await pods_of(east, job_id, 2)
            await set_phase(east, stale, "Running")
            await wait_for(api, job_id, "Running", cluster="east")
            await start_agent(fleet, "west", west_config)

            await fleet.agents["east"].stop(sig=signal.SIGKILL)
            # past lost_after the broker requeues the job, and west runs it
            moved = await pods_of(west, job_id, 2)
            await set_phase(west, moved, "Running")
            running = await wait_for(api, job_id, "Running", cluster="west")
            assert "ClusterLost" in [e["reason"] for e in running["status"]["events"]]
            assert len(job_pods(east, job_id)) == 2, "east's copy still runs, unknown to it"

            await start_agent(fleet, "east", east_config)
            await pods_of(east, job_id, 0)  # the stale copy is deleted
            deleted = {r.name for r in east.requests_of("delete", "pods")}
            assert deleted == {p["metadata"]["name"] for p in stale}
            job = await api.get(job_id)
            assert (job["status"]["state"], job["status"]["cluster"]) == ("Running", "west")
            assert len(job_pods(west, job_id)) == 2
