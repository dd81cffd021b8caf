"""etcd without quorum (2 of 3 members stopped), with a real broker and agent: a submit the
store cannot commit is answered 503 with `Retry-After` within the store's write deadline
(`state.etcd.DEFAULT_WRITE_TIMEOUT`, 5 s), never held until quorum returns, and submits queued
behind it are not each held that long again; once quorum is back, a submit is accepted.

Prints each refused submit's time to its answer (`-s` shows it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import aiohttp
import pytest

from e2e.helpers import wait_for
from gpufed.local import processes
from tests import etcdcluster, etcdserver
from tests.builders import make_job

pytestmark = [pytest.mark.e2e, pytest.mark.etcd, pytest.mark.chaos]

WRITE_DEADLINE = 5.0  # state.etcd.DEFAULT_WRITE_TIMEOUT
ANSWERED_WITHIN = WRITE_DEADLINE + 2.0  # the deadline, the HTTP round trip, a loaded machine
SUBMITS = 6  # while quorum is lost, one a second: some wait behind others' writes


@pytest.fixture
def members() -> Iterator[etcdcluster.EtcdCluster]:
    try:
        cluster = etcdcluster.EtcdCluster.start()
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start an etcd cluster: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.cleanup()


async def timed_submit(
    session: aiohttp.ClientSession, url: str, token: str, name: str
) -> tuple[float, int, str | None]:
    """POST one job; (seconds to the answer, status, Retry-After)."""
    document = json.dumps(make_job(name, gpus=1).duration(0.2).document())
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    started = time.monotonic()
    async with session.post(f"{url}/v1/jobs", data=document, headers=headers) as answer:
        await answer.read()
        return time.monotonic() - started, answer.status, answer.headers.get("Retry-After")


async def test_a_submit_without_quorum_is_answered_503_within_the_write_deadline(
    fleet: processes.LocalFleet, members: etcdcluster.EtcdCluster
) -> None:
    fleet.store = members.url
    fleet.lost_after = 9.0  # a failover (lease 5 s) reaches agents before they fence
    fleet.write_tokens(tenants=["team-a"], clusters=["h100"])
    await fleet.start_broker()
    await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    await fleet.wait_clusters_ready(["h100"])
    token = fleet.tokens["team-a"]
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        took, code, _ = await timed_submit(session, fleet.url, token, "before")
        assert code == 202

        await asyncio.to_thread(members.kill, 1)
        await asyncio.to_thread(members.kill, 2)
        try:

            async def later(i: int) -> tuple[float, int, str | None]:
                await asyncio.sleep(i)
                return await timed_submit(session, fleet.url, token, f"during-{i}")

            answers = await asyncio.gather(*(later(i) for i in range(SUBMITS)))
        finally:
            await asyncio.to_thread(members.launch, 1)
            await asyncio.to_thread(members.launch, 2)
        print("\nsubmits without quorum: " + ", ".join(f"{c} in {t:.1f} s" for t, c, _ in answers))
        for took, code, retry_after in answers:
            assert code == 503 and retry_after is not None, (code, took)
            assert took <= ANSWERED_WITHIN, answers

        # quorum is back: the next submit is accepted (within a few of its Retry-After)
        deadline = time.monotonic() + 30
        while True:
            took, code, _ = await timed_submit(session, fleet.url, token, "after")
            if code == 202 or time.monotonic() > deadline:
                break
            assert code == 503, code
            await asyncio.sleep(1)
        assert code == 202
    async with fleet.client("team-a") as api:
        jobs, _ = await api.job_page(search="after")
        assert jobs, "the accepted submit is stored"
        await wait_for(api, jobs[0]["id"], {"Running", "Succeeded"})
