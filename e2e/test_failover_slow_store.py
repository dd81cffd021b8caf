"""A slow etcd slows the leader down rather than electing a new one every few seconds: three
brokers reach a real etcd through a TCP proxy that holds every chunk `DELAY` each way (a round
trip of 1.2 s), two simulated agents. The leader is killed (-9) early in the slow spell: one
replica wins the election and keeps the lead (a campaign once spent three round trips of its
lease before its first renewal, and each new leader stepped down within milliseconds), and
jobs keep starting.

Prints the terms begun and the jobs started during the spell (`-s` shows it).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator

import pytest

from e2e import helpers
from gpufed import client
from gpufed.local import processes
from tests import etcdserver, tcpproxy
from tests.builders import make_job

pytestmark = [pytest.mark.e2e, pytest.mark.etcd, pytest.mark.chaos]

CLUSTERS = ["h100", "a100"]
DELAY = 0.6  # seconds each way: a 1.2 s round trip to etcd
SPELL = 40.0  # seconds of slow store
JOBS = 8  # submitted during the spell, one every SPELL / 2 / JOBS seconds


@pytest.fixture
async def slow_etcd() -> AsyncIterator[tcpproxy.TcpProxy]:
    try:
        server = etcdserver.EtcdServer.start()
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start etcd: {exc}", pytrace=False)
    proxy = await tcpproxy.TcpProxy(server.client_port).start()
    try:
        yield proxy
    finally:
        await proxy.close()
        server.cleanup()


async def terms(fleet: processes.LocalFleet) -> set[int]:
    return {int(a["term"]) for a in await fleet.statuses() if a and a.get("term")}  # type: ignore[call-overload]


async def test_a_slow_store_slows_the_leader_and_elects_no_new_one(
    fleet: processes.LocalFleet, slow_etcd: tcpproxy.TcpProxy
) -> None:
    fleet.store = f"etcd://127.0.0.1:{slow_etcd.port}"
    fleet.heartbeat = 1.0
    fleet.lost_after = 15.0
    fleet.write_tokens(tenants=["team-a"], clusters=CLUSTERS)
    await fleet.start_brokers(3)
    for cluster in CLUSTERS:
        await fleet.start_agent(cluster, processes.config_dir() / "clusters" / f"{cluster}.yaml")
    await fleet.wait_clusters_ready(CLUSTERS)
    await fleet.leader()
    before = max(await terms(fleet))

    slow_etcd.delay = DELAY
    await asyncio.sleep(2 * DELAY)
    await (await fleet.leader()).stop(sig=signal.SIGKILL)  # a failover on the slow store
    began = time.monotonic()
    seen: set[int] = set()
    submitted: list[str] = []
    async with fleet.client("team-a") as api:

        async def submit_some() -> None:
            for i in range(JOBS):
                job = json.dumps(make_job(f"slow-{i}", gpus=1).duration(0.5).document())
                with_retries = time.monotonic() + SPELL / 2
                while time.monotonic() < with_retries:
                    try:
                        submitted.append((await api.submit(job))["id"])
                        break
                    except client.BrokerError as exc:  # 503 while a write is slow: again
                        assert exc.status in (0, 503), exc
                        await asyncio.sleep(1)
                await asyncio.sleep(SPELL / 2 / JOBS)

        submitting = asyncio.create_task(submit_some())
        while time.monotonic() - began < SPELL:
            seen |= await terms(fleet)
            await asyncio.sleep(0.5)
        await submitting
        started = 0
        for job_id in submitted:
            state = (await api.get(job_id))["status"]["state"]
            started += state in {"Running", "Succeeded"}
        slow_etcd.delay = 0.0
        print(
            f"\nround trip {2 * DELAY:g} s for {SPELL:g} s, the leader killed: "
            f"{len(seen - {before})} terms begun, "
            f"{started} of {len(submitted)} jobs started"
        )
        assert len(seen - {before}) == 1, f"terms begun on a slow store: {sorted(seen)}"
        assert started >= JOBS // 2, (started, len(submitted))
        for job_id in submitted:  # every job runs once the store is fast again
            await helpers.wait_for(api, job_id, {"Running", "Succeeded"}, timeout=30)
