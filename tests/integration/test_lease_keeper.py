"""The leader's lease kept alive by a task over a connection of its own (`state.renewing`),
on a real etcd: renewals go on while the book's connection is busy; a keeper that cannot get
through, or a lease the store dropped, still ends the term in time; and the keeper's own
connection is closed with the term."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from broker.state import electing, errors, etcd, opening, store

pytestmark = pytest.mark.etcd

TTL = 2


class CutOff:
    """A store whose keep-alives hang once `cut` is set (a member that stopped answering),
    while everything else works."""

    def __init__(self, inner: etcd.EtcdStore) -> None:
        self.inner = inner
        self.cut = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def keep_alive(self, lease: int) -> int:
        if self.cut.is_set():
            await asyncio.sleep(10)
        return await self.inner.keep_alive(lease)


async def lead(
    backing: store.DurableStore,
    connect: Callable[[], Awaitable[store.DurableStore]] | None,
) -> tuple[electing.Election, asyncio.Task[None]]:
    election = electing.Election(backing, replica="a", url="http://a", ttl=TTL, connect=connect)
    task = asyncio.create_task(election.run())
    await asyncio.wait_for(election.leading.wait(), 5)
    return election, task


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("separate", [True, False], ids=["own-connection", "the-books"])
async def test_a_keeper_that_cannot_get_through_ends_the_term_before_the_lease_can(
    etcd_url: str, separate: bool
) -> None:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    own = await backing.connector()()
    cut = CutOff(own)

    async def connect() -> store.DurableStore:
        return cut

    election, task = await lead(backing if separate else cut, connect if separate else None)
    try:
        cut.cut.set()
        renewed = election._renewed_at
        await asyncio.wait_for(election.following.wait(), 5)
        # it stopped leading before the store could expire its lease (ttl after the renewal
        # sent last): no other replica could have led yet
        assert time.monotonic() < renewed + election.ttl
        assert "not renewed" in election.reason
        with pytest.raises(errors.NotLeaderError):
            election.fence()
    finally:
        await stop(task)
        await own.close()
        await backing.close()


async def test_a_lease_the_store_dropped_ends_the_term_at_the_next_renewal(etcd_url: str) -> None:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    election, task = await lead(backing, backing.connector())
    try:
        renewal = election._renewal
        assert renewal is not None
        # revoked under it (an operator, an etcd that lost it): the keeper hears "not found";
        # the revoke also deletes the leader key, which the next look at it sees, whichever
        # comes first
        await backing.revoke_lease(renewal.lease)
        await asyncio.wait_for(election.following.wait(), TTL)
        assert election.reason in {"its lease expired", "the leader key was deleted or taken"}
    finally:
        await stop(task)
        await backing.close()


async def test_the_pause_budget_is_the_leases_slack_while_leading(etcd_url: str) -> None:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    election, task = await lead(backing, backing.connector())
    try:
        budget = election.pause_budget()
        assert 0 < budget <= TTL - election.safety
        election.step_down("test")
        assert election.pause_budget() == float("inf")
    finally:
        await stop(task)
        await backing.close()


class Busy:
    """A store whose every call but the keep-alive waits `delay` first: the book's
    connection queued behind transactions of hundreds of jobs."""

    def __init__(self, inner: etcd.EtcdStore, delay: float) -> None:
        self.inner = inner
        self.delay = delay
        self.keep_alives = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def keep_alive(self, lease: int) -> int:
        self.keep_alives += 1
        await asyncio.sleep(self.delay)  # behind the transactions on the same connection
        return await self.inner.keep_alive(lease)


async def test_renewals_over_their_own_connection_do_not_wait_behind_the_books(
    etcd_url: str,
) -> None:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    busy = Busy(backing, delay=TTL)  # a renewal over it would come too late every time
    election, task = await lead(busy, backing.connector())
    try:
        term = election.term
        await asyncio.sleep(TTL * 2.5)
        assert election.is_leader and election.term == term, election.reason
        assert busy.keep_alives == 0  # every renewal went over the keeper's own connection
        renewal = election._renewal
        assert renewal is not None and renewal.renewals >= 4
    finally:
        await stop(task)
        await backing.close()


async def test_without_its_own_connection_a_busy_one_costs_the_term(etcd_url: str) -> None:
    """What the keeper's own connection is for: over the busy one, renewals come too late."""
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    busy = Busy(backing, delay=TTL)
    election, task = await lead(busy, None)
    try:
        await asyncio.wait_for(election.following.wait(), TTL * 2)
        assert "not renewed" in election.reason
    finally:
        await stop(task)
        await backing.close()
