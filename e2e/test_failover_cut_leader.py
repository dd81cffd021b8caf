"""A leader cut off from its agents but not from etcd steps aside: three brokers on a real
etcd, each behind a TCP proxy that is its advertised address (what agents dial, and what a
follower's 409 names), two simulated agents. The leader's proxy is cut (blackhole): the
agents reach only the followers, which refuse them (409) and record their knocks; the leader
sees most of its clusters knocking elsewhere, resigns and holds off, a follower leads, and
no agent fences, no job is requeued.

Prints the time from the cut to the first new pod (`-s` shows it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest

from e2e import helpers
from gpufed.local import processes
from tests import tcpproxy
from tests.builders import make_job

pytestmark = [pytest.mark.e2e, pytest.mark.etcd, pytest.mark.chaos]

CLUSTERS = ["h100", "a100"]
CUT = 25.0  # seconds the leader stays cut off: past the agents' fence (11.25 s)
FIRST_POD_WITHIN = 12.0  # the cut noticed (3 heartbeats), judged (knocks held 2 s), handed over


@pytest.fixture
async def proxies() -> AsyncIterator[list[tcpproxy.TcpProxy]]:
    made: list[tcpproxy.TcpProxy] = []
    try:
        yield made
    finally:
        for proxy in made:
            await proxy.close()


async def start(
    fleet: processes.LocalFleet, etcd_url: str, proxies: list[tcpproxy.TcpProxy]
) -> None:
    """Three brokers, each advertising its proxy's address, and agents dialing the proxies."""
    fleet.store = etcd_url
    fleet.heartbeat = 1.0
    fleet.lost_after = 15.0  # agents fence after 11.25 s without the broker
    fleet.write_tokens(tenants=["team-a"], clusters=CLUSTERS)
    for index in range(3):
        port = processes.free_port()
        proxy = await tcpproxy.TcpProxy(port).start()
        proxies.append(proxy)
        args = fleet._broker_args(port)
        args[args.index("--advertise-url") + 1] = proxy.url
        service = await processes.spawn(f"broker-{index}", args, workdir=fleet.workdir)
        service.url = f"http://127.0.0.1:{port}"
        fleet.brokers.append(service)
        fleet.port = fleet.port or port
    for service in fleet.brokers:
        await fleet.wait_http("/readyz", service)
    dial = ",".join(proxy.url for proxy in proxies)
    for cluster in CLUSTERS:
        nodes = processes.config_dir() / "clusters" / f"{cluster}.yaml"
        await fleet.start_agent(cluster, nodes, "--broker", dial)
    await fleet.wait_clusters_ready(CLUSTERS, timeout=60)


async def leading(fleet: processes.LocalFleet, *, timeout: float = 30.0) -> tuple[int, int]:
    """(index of the broker whose leader work runs, its term), once one does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for index, answer in enumerate(await fleet.statuses()):
            if answer is not None and answer.get("active"):
                return index, int(answer["term"])  # type: ignore[call-overload]
        await asyncio.sleep(0.1)
    raise TimeoutError(f"no broker leads: {await fleet.statuses()}")


async def test_a_leader_cut_off_from_its_agents_steps_aside_and_none_fences(
    fleet: processes.LocalFleet, etcd_url: str, proxies: list[tcpproxy.TcpProxy]
) -> None:
    await start(fleet, etcd_url, proxies)
    old, term = await leading(fleet)
    follower = fleet.brokers[(old + 1) % 3].url
    async with fleet.client("team-a", url=follower) as api:
        running = await helpers.long_jobs(api, 6)

        cut_at = time.monotonic()
        proxies[old].cut()  # agents cannot reach the leader; it still reaches etcd
        job = json.dumps(make_job("after-cut", gpus=1).duration(0.2).document())
        job_id = (await api.submit(job))["id"]
        await helpers.wait_for(api, job_id, {"Running", "Succeeded"}, timeout=CUT)
        first_pod = time.monotonic() - cut_at
        await asyncio.sleep(max(0.0, CUT - (time.monotonic() - cut_at)))
        states = {job_id: (await api.get(job_id))["status"] for job_id in running}
        new, new_term = await leading(fleet)
        print(f"\nfirst pod after the leader was cut off from its agents: {first_pod:.1f} s")
        moved = {
            job_id: (status["state"], status.get("cluster"), status.get("reason"))
            for job_id, status in states.items()
            if status["state"] != "Running" or status.get("cluster") != running[job_id]
        }
        assert moved == {}, f"agents fenced or jobs requeued during the cut: {moved}"
        assert new != old and new_term > term
        assert first_pod <= FIRST_POD_WITHIN, first_pod

        # healed, the old leader does not take the lead back: one term, no flapping
        proxies[old].heal()
        await asyncio.sleep(5)
        assert await leading(fleet) == (new, new_term)
