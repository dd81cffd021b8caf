"""etcd out of space (its space quota alarm, NOSPACE), with a real etcd, broker and agent: a
write gets 507 `store-full` at once, not a 503 that tells clients to retry a condition only an
operator clears; reads go on, the replica stays ready, a gauge names the alarm; once the
operator compacts, defragments and disarms, the same submit works."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd
import aiohttp
import pytest

from e2e.helpers import eventually, scrape, wait_for
from gpufed import client
from gpufed.local import processes
from tests import etcdserver
from tests.builders import make_job

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

QUOTA = 4 * 1024 * 1024  # etcd's space quota: small, so filling it takes a second
FILLER = b"/filler/"  # outside /gpufed/: another user of the same etcd fills it
NOSPACE = 'gpufed_store_alarm{alarm="NOSPACE"}'


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[etcdserver.EtcdServer]:
    try:
        server = etcdserver.EtcdServer.start(flags=[f"--quota-backend-bytes={QUOTA}"])
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start etcd: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.cleanup()


async def fill(server: etcdserver.EtcdServer) -> int:
    """Write 200 KB values beside gpufed's keys until etcd raises its space alarm."""
    value = secrets.token_bytes(200_000)
    async with aetcd.Client(host="127.0.0.1", port=server.client_port) as etcd:
        for i in range(200):
            try:
                await etcd.put(FILLER + str(i).encode(), value)
            except aetcd.ClientError as exc:
                assert "database space exceeded" in str(exc.__cause__ or exc)
                return i
    raise AssertionError("etcd never ran out of space")


async def clear(server: etcdserver.EtcdServer) -> None:
    """What the README tells the operator: free space, compact, defragment, disarm."""
    async with aetcd.Client(host="127.0.0.1", port=server.client_port) as etcd:
        deleted = await etcd.delete_prefix(FILLER)
        await etcd.compact(deleted.header.revision, physical=True)
        await etcd.defragment()
        for alarm in [a async for a in etcd.list_alarms()]:  # as `etcdctl alarm disarm` does
            await etcd.disarm_alarm(member_id=alarm.member_id)


async def gauge(fleet: processes.LocalFleet, name: str) -> float | None:
    for line in (await scrape(fleet)).splitlines():
        if line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    return None


async def status_of(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url) as answer:
        return answer.status


async def test_etcd_out_of_space_answers_507_keeps_reads_and_readiness_and_recovers(
    fleet: processes.LocalFleet, etcd: etcdserver.EtcdServer
) -> None:
    fleet.store = etcd.url
    fleet.lost_after = 9.0  # a failover (lease 5 s) reaches agents before they fence
    fleet.write_tokens(tenants=["team-a"], clusters=["h100"])
    await fleet.start_broker()
    await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    await fleet.wait_clusters_ready(["h100"])
    document = json.dumps(make_job("before", gpus=1).duration(600).document())
    async with fleet.client("team-a") as api:
        running = (await api.submit(document))["id"]
        await wait_for(api, running, {"Running"})
        assert await gauge(fleet, NOSPACE) == 0  # exported before anything happened

        await fill(etcd)
        started = time.monotonic()
        with pytest.raises(client.BrokerError) as refused:
            await api.submit(json.dumps(make_job("during", gpus=1).document()))
        assert time.monotonic() - started < 5  # answered, not retried until a timeout
        assert refused.value.status == 507, refused.value
        assert refused.value.body["type"] == "urn:gpufed:problem:store-full"
        assert "operator" in refused.value.detail  # not "retry"

        assert (await api.get(running))["status"]["state"] == "Running"  # reads go on

        async def alarm_shown() -> bool:
            return await gauge(fleet, NOSPACE) == 1

        await eventually(alarm_shown, what="NOSPACE shown by gpufed_store_alarm")
        # the sync barrier (a write) has been refused a few times by now: still ready
        await asyncio.sleep(3)
        assert await status_of(f"{fleet.url}/readyz") == 200

        await clear(etcd)

        async def accepted() -> bool:
            try:
                await api.submit(json.dumps(make_job("after", gpus=1).duration(0.2).document()))
            except client.BrokerError as exc:
                assert exc.status == 507, exc
                return False
            return True

        await eventually(accepted, what="a submit accepted once the alarm is disarmed")

        async def alarm_cleared() -> bool:
            return await gauge(fleet, NOSPACE) == 0

        await eventually(alarm_cleared, what="the gauge back at 0")
