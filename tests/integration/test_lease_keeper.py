"""The leader's lease kept alive from a thread of its own (`state.renewing`), on a real etcd:
a main event loop busy for longer than the lease's TTL no longer costs the term, while a
keeper that cannot get through, or a lease the store dropped, still ends it in time."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from broker.state import electing, errors, etcd, opening, renewing, store
from tests import etcdserver

pytestmark = pytest.mark.etcd

TTL = 2


@pytest.fixture
def etcd_url() -> AsyncIterator[str] | Any:
    """An etcd of the test's own: the leader key is one for the whole server."""
    try:
        server = etcdserver.EtcdServer.start()
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start etcd: {exc}", pytrace=False)
    try:
        yield server.url
    finally:
        server.cleanup()


class CutOff:
    """A store whose keep-alives hang once `cut` is set (a member that stopped answering),
    while everything else works."""

    def __init__(self, inner: etcd.EtcdStore) -> None:
        self.inner = inner
        self.cut = threading.Event()  # set from the test's loop, read on the keeper's

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def keep_alive(self, lease: int) -> int:
        if self.cut.is_set():
            await asyncio.sleep(10)
        return await self.inner.keep_alive(lease)


def busy(seconds: float) -> None:
    """Hold the event loop with bytecode for `seconds` (not a sleep: the interpreter lock
    changes hands as it does under real work)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        sum(range(200))


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


def keeper_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lease-keeper-")]


async def test_a_leader_whose_loop_is_busy_past_the_ttl_keeps_its_term(etcd_url: str) -> None:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    election, task = await lead(backing, backing.connector())
    try:
        term, renewals = election.term, election._renewal
        assert renewals is not None and len(keeper_threads()) == 1
        busy(TTL * 2.0)  # twice the lease's TTL without yielding once
        await asyncio.sleep(0.2)  # the election looks at its lease
        assert election.is_leader and election.term == term, election.reason
        assert renewals.renewals >= 4  # ttl/3 apart while the loop was held
        entry = await backing.get(electing.LEADER_KEY)
        assert election.leader is not None and entry is not None
        assert entry.mod_revision == election.leader.revision  # the same term's key
    finally:
        await stop(task)
        await backing.close()
    assert keeper_threads() == []  # the term's end stopped the keeper's thread


async def test_on_the_main_loop_the_same_busy_loop_costs_the_term(etcd_url: str) -> None:
    """What the thread is for: the keeper of the main loop cannot renew while it is held."""
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    election, task = await lead(backing, None)
    try:
        busy(TTL * 2.0)
        await asyncio.wait_for(election.following.wait(), 2)
        assert "not renewed" in election.reason
    finally:
        await stop(task)
        await backing.close()


@pytest.mark.parametrize("thread", [True, False], ids=["thread", "loop"])
async def test_a_keeper_that_cannot_get_through_ends_the_term_before_the_lease_can(
    etcd_url: str, thread: bool
) -> None:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    own = await backing.connector()()
    cut = CutOff(own)

    async def connect() -> store.DurableStore:
        return cut  # type: ignore[return-value]

    election, task = await lead(backing if thread else cut, connect if thread else None)  # type: ignore[arg-type]
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


async def test_a_keeper_stopped_before_its_thread_ran_ends_at_once(etcd_url: str) -> None:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    try:
        lease = await backing.grant_lease(TTL)
        renewal = renewing.Renewal(lease, renewed_at=time.monotonic())
        woken: list[int] = []
        keeper = renewing.ThreadKeeper(
            backing.connector(),
            renewal,
            ttl=TTL,
            safety=0.4,
            notify=lambda: woken.append(1),
        )
        keeper.start()
        started = time.monotonic()
        await keeper.stop()
        assert time.monotonic() - started < 1.0
        assert keeper_threads() == [] and woken == []
    finally:
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
