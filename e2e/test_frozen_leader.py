"""A frozen leader (SIGSTOP, as a long GC pause, a stuck disk or a paused VM does) costs about
what a dead one does: three brokers on a real etcd, two simulated agents. A frozen process
still completes TCP handshakes and never answers, so an agent that went back to it first
waited out a connect timeout while its fence came closer; now an agent that lost a silent
session tries the other replicas, and no agent fences while a healthy replica leads.

Prints the time from the freeze to the first new pod, beside a kill -9's (`-s` shows it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from e2e import helpers
from gpufed import client
from gpufed.local import processes
from tests.builders import make_job

pytestmark = [pytest.mark.e2e, pytest.mark.etcd, pytest.mark.chaos]

CLUSTERS = ["h100", "a100"]
FROZEN = 20.0  # seconds the leader stays stopped: past the agents' fence (11.25 s)


async def start(fleet: processes.LocalFleet, etcd_url: str) -> None:
    fleet.store = etcd_url
    fleet.heartbeat = 1.0
    fleet.lost_after = 15.0  # agents fence after 11.25 s without the broker
    fleet.write_tokens(tenants=["team-a"], clusters=CLUSTERS)
    await fleet.start_brokers(3)
    for cluster in CLUSTERS:
        await fleet.start_agent(cluster, processes.config_dir() / "clusters" / f"{cluster}.yaml")
    await fleet.wait_clusters_ready(CLUSTERS)


async def first_pod_after(api: client.BrokerClient, name: str, since: float) -> float:
    """Submit a short job now; seconds from `since` until it runs."""
    job = json.dumps(make_job(name, gpus=1).duration(0.2).document())
    job_id = (await api.submit(job))["id"]
    await helpers.wait_for(api, job_id, {"Running", "Succeeded"}, timeout=60)
    return time.monotonic() - since


async def follower_client(fleet: processes.LocalFleet, leader: processes.Service) -> str:
    return next(b.url for b in fleet.brokers if b is not leader and b.alive)


async def test_a_frozen_leader_fails_over_like_a_dead_one_and_no_agent_fences(
    fleet: processes.LocalFleet, etcd_url: str
) -> None:
    await start(fleet, etcd_url)
    leader = await fleet.leader()
    async with fleet.client("team-a", url=await follower_client(fleet, leader)) as api:
        running = await helpers.long_jobs(api, 6)

    # the reference: a leader killed with -9
    killed_at = time.monotonic()
    await leader.stop(sig=signal.SIGKILL)
    async with fleet.client("team-a", url=await follower_client(fleet, leader)) as api:
        after_kill = await first_pod_after(api, "after-kill", killed_at)
    await fleet.restart_broker(fleet.brokers.index(leader))

    leader = await fleet.leader()
    await fleet.wait_clusters_ready(CLUSTERS)
    url = await follower_client(fleet, leader)
    frozen_at = time.monotonic()
    os.kill(leader.process.pid, signal.SIGSTOP)
    try:
        async with fleet.client("team-a", url=url) as api:
            after_freeze = await first_pod_after(api, "after-freeze", frozen_at)
            await asyncio.sleep(max(0.0, FROZEN - (time.monotonic() - frozen_at)))
            states = {job_id: (await api.get(job_id))["status"] for job_id in running}
    finally:
        os.kill(leader.process.pid, signal.SIGCONT)
    print(
        f"\nfirst pod after the leader was killed: {after_kill:.1f} s; "
        f"after it froze: {after_freeze:.1f} s"
    )
    moved = {
        job_id: (status["state"], status.get("cluster"), status.get("reason"))
        for job_id, status in states.items()
        if status["state"] != "Running" or status.get("cluster") != running[job_id]
    }
    assert moved == {}, f"agents fenced during the freeze: {moved}"
    assert after_freeze <= 2 * max(after_kill, 3.0), (after_freeze, after_kill)

    # the woken leader finds itself replaced and follows
    new_leader = await fleet.leader(timeout=20)
    assert new_leader is not leader
