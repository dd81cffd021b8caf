"""The broker's store goes away (a real etcd, killed and started again), with real broker and
agent processes: `/readyz` says so, background work lives on, nothing acknowledged is lost
and no job is left stuck once the store is back."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from e2e.helpers import FINAL, eventually, wait_for
from gpufed import client
from gpufed.local import processes
from tests import etcdserver
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[etcdserver.EtcdServer]:
    try:
        server = etcdserver.EtcdServer.start()
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start etcd: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.cleanup()


async def ready_status(fleet: processes.LocalFleet) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{fleet.url}/readyz") as answer:
        return answer.status


async def test_the_watchdog_outlives_a_store_outage_and_lost_clusters_are_requeued(
    fleet: processes.LocalFleet, etcd: etcdserver.EtcdServer
) -> None:
    """A cluster lost while etcd is down is requeued once etcd is back, and a second cluster
    lost afterwards is requeued too (the watchdog did not die of the store's errors)."""
    fleet.store = etcd.url
    fleet.lost_after = 9.0  # a failover (lease 5 s) reaches agents before they fence
    nodes = processes.config_dir() / "clusters" / "h100.yaml"
    fleet.write_tokens(tenants=["team-a"], clusters=["east", "west"])
    await fleet.start_broker()
    await fleet.start_agent("east", nodes)
    await fleet.start_agent("west", nodes)
    await fleet.wait_clusters_ready(["east", "west"])
    async with fleet.client("team-a") as api:
        ids = []
        for i in range(24):  # 16 nodes a cluster: both clusters get some
            job = make_job(f"long{i}", gpus=8).model(H100).duration(600).document()
            ids.append((await api.submit(json.dumps(job)))["id"])
        placed = {}
        for job_id in ids:
            placed[job_id] = (await wait_for(api, job_id, {"Running"}))["status"]["cluster"]
    assert set(placed.values()) == {"east", "west"}

    await asyncio.to_thread(etcd.kill)
    assert await eventually(
        lambda: _not_ready(fleet), timeout=10, what="503 on /readyz while etcd is down"
    )
    await fleet.agents["east"].stop(sig=signal.SIGKILL)
    await asyncio.sleep(fleet.lost_after + 3)  # east is lost while the store is away
    await asyncio.to_thread(etcd.launch)
    assert await eventually(lambda: _ready(fleet), timeout=15, what="ready once etcd is back")

    async with fleet.client("admin") as api:
        east = [j for j, c in placed.items() if c == "east"]

        async def east_moved() -> bool:
            states = [(await api.get(j))["status"] for j in east]
            return all(s["cluster"] != "east" for s in states)

        await eventually(east_moved, timeout=20, what="east's jobs requeued")
        await fleet.agents["west"].stop(sig=signal.SIGKILL)
        west = [j for j, c in placed.items() if c == "west"]

        async def west_moved() -> bool:
            states = [(await api.get(j))["status"] for j in west]
            return all(s["cluster"] != "west" for s in states)

        await eventually(west_moved, timeout=20, what="west's jobs requeued after east's")
        clusters = {c["name"]: c["health"] for c in await api.clusters()}
        assert clusters == {"east": "Lost", "west": "Lost"}


async def _not_ready(fleet: processes.LocalFleet) -> bool:
    return await ready_status(fleet) == 503


async def _ready(fleet: processes.LocalFleet) -> bool:
    return await ready_status(fleet) == 200


async def submit_until_accepted(
    api: client.BrokerClient, document: str, key: str, *, deadline: float
) -> str:
    """Submit as a careful client does: on 503 or no answer, the same key again."""
    while time.monotonic() < deadline:
        try:
            return str((await api.submit(document, idempotency_key=key))["id"])
        except client.BrokerError as exc:
            if exc.status not in (0, 503):
                raise
            await asyncio.sleep(0.2)
    raise AssertionError(f"{key} never accepted")


@pytest.mark.chaos
async def test_etcd_killed_for_20s_mid_flood_loses_nothing_and_strands_nothing(
    fleet: processes.LocalFleet, etcd: etcdserver.EtcdServer
) -> None:
    fleet.store = etcd.url
    fleet.lost_after = 9.0  # a failover (lease 5 s) reaches agents before they fence
    await fleet.start_simulated(["h100", "a100"])
    run = secrets.token_hex(3)
    deadline = time.monotonic() + 240
    accepted: dict[str, str] = {}
    acked_at: list[float] = []
    workers, per_worker = 16, 150
    window: list[float] = []

    async def flood(worker: int) -> None:
        async with fleet.client("team-a") as api:
            for i in range(per_worker):
                key = f"{run}-{worker}-{i}"
                job = make_job(f"flood-{worker}-{i}", gpus=1).duration(0.5).document()
                accepted[key] = await submit_until_accepted(
                    api, json.dumps(job), key, deadline=deadline
                )
                acked_at.append(time.monotonic())

    async def outage() -> None:
        await asyncio.sleep(1.5)
        window.append(time.monotonic())
        await asyncio.to_thread(etcd.kill)
        await asyncio.sleep(20)
        await asyncio.to_thread(etcd.launch)
        window.append(time.monotonic())

    await asyncio.gather(*(flood(w) for w in range(workers)), outage())
    before = sum(1 for t in acked_at if t < window[0])
    after = sum(1 for t in acked_at if t > window[1])
    print(
        f"\n{len(accepted)} submits acknowledged: {before} before etcd was killed, "
        f"{len(accepted) - before - after} while it was down, {after} after it was back"
    )
    assert before > 0 and after > 0  # the outage fell in the middle of the flood
    async with fleet.client("admin") as api:

        async def idle() -> bool:
            jobs = await api.jobs(limit=100_000)
            return all(j["status"]["state"] in FINAL for j in jobs) and len(jobs) >= len(
                set(accepted.values())
            )

        await eventually(idle, timeout=120, what="every job final")
        jobs = {j["id"]: j for j in await api.jobs(limit=100_000)}
    assert len(set(accepted.values())) == len(accepted) == workers * per_worker  # a job a key
    missing = [job_id for job_id in accepted.values() if job_id not in jobs]
    stuck = [j for j in jobs.values() if j["status"]["state"] not in FINAL]
    failed = [j["id"] for j in jobs.values() if j["status"]["state"] != "Succeeded"]
    print(f"lost {len(missing)}, stuck {len(stuck)}, not succeeded {len(failed)}")
    assert missing == [] and stuck == [] and failed == []
