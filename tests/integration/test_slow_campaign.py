"""A campaign on a slow store (every call a round trip of 1.2 s, on a real etcd) keeps the term
it wins: the term counter is read and the keeper's connection opened before the lease is
granted, and the first renewal goes with the campaign's transaction, so the lease's budget
pays two round trips, not three plus a connection. A replica that loses its lease soon after
it won backs off before campaigning again, longer each time."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from broker.state import electing, etcd, opening, store

pytestmark = pytest.mark.etcd

ROUND_TRIP = 1.2
TTL = 5


class Slow:
    """A store whose every call takes `ROUND_TRIP` longer (a distant etcd); `stuck` makes its
    keep-alives hang (a keeper that cannot get through)."""

    def __init__(self, inner: etcd.EtcdStore) -> None:
        self.inner = inner
        self.stuck = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get(self, key: str) -> store.Entry | None:
        await asyncio.sleep(ROUND_TRIP)
        return await self.inner.get(key)

    async def commit(self, txn: store.Txn) -> int:
        await asyncio.sleep(ROUND_TRIP)
        return await self.inner.commit(txn)

    async def grant_lease(self, ttl: int) -> int:
        await asyncio.sleep(ROUND_TRIP)
        return await self.inner.grant_lease(ttl)

    async def keep_alive(self, lease: int) -> int:
        await asyncio.sleep(ROUND_TRIP)
        if self.stuck:
            await asyncio.sleep(60)
        return await self.inner.keep_alive(lease)


async def elect(url: str) -> tuple[electing.Election, asyncio.Task[None], Slow]:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(url))
    slow = Slow(backing)

    async def connect() -> store.DurableStore:
        await asyncio.sleep(2 * ROUND_TRIP)  # a connection and its first read
        return slow

    election = electing.Election(
        slow,
        replica="a",
        url="http://a",
        ttl=TTL,
        connect=connect,
    )
    return election, asyncio.create_task(election.run()), slow


async def stop(election: electing.Election, task: asyncio.Task[None], slow: Slow) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await slow.inner.close()


async def test_a_leader_elected_on_a_slow_store_keeps_its_term(etcd_url: str) -> None:
    election, task, slow = await elect(etcd_url)
    try:
        await asyncio.wait_for(election.leading.wait(), 10 * ROUND_TRIP)
        won = time.monotonic()
        await asyncio.wait_for(election.following.wait(), 2 * TTL)
        pytest.fail(f"stepped down {time.monotonic() - won:.1f} s in: {election.reason}")
    except TimeoutError:
        assert election.is_leader and election.term == 1
    finally:
        await stop(election, task, slow)


async def test_a_replica_that_loses_its_lease_soon_after_winning_backs_off(
    etcd_url: str,
) -> None:
    election, task, slow = await elect(etcd_url)
    try:
        for factor in (1, 2):
            await asyncio.wait_for(election.leading.wait(), 4 * TTL)
            slow.stuck = True
            await asyncio.wait_for(election.following.wait(), TTL)
            assert "lease" in election.reason
            assert election.holding_off > factor * TTL - 1.0
            slow.stuck = False
    finally:
        await stop(election, task, slow)
