"""The etcd store on a real three-member cluster: losing the member it talks to is not an
outage — it moves to another member, reads and commits go on, a watch resumes there."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from broker.state import errors, etcd, opening, store
from tests import etcdcluster, etcdserver

pytestmark = pytest.mark.etcd


@pytest.fixture(scope="module")
def members() -> Iterator[etcdcluster.EtcdCluster]:
    try:
        cluster = etcdcluster.EtcdCluster.start()
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start an etcd cluster: {exc}", pytrace=False)
    yield cluster
    cluster.cleanup()


@pytest.fixture
async def kv(members: etcdcluster.EtcdCluster) -> AsyncIterator[store.DurableStore]:
    for index in range(3):
        members.launch(index)
    backing = await opening.open_store(members.url)
    try:
        yield backing
    finally:
        await backing.close()


def member_of(backing: store.DurableStore, members: etcdcluster.EtcdCluster) -> int:
    assert isinstance(backing, etcd.EtcdStore)
    return [members.endpoint(i) for i in range(3)].index(backing.endpoint)


async def test_losing_the_member_in_use_moves_to_another(
    kv: store.DurableStore, members: etcdcluster.EtcdCluster
) -> None:
    first = member_of(kv, members)
    revision = await kv.put("/failover/a", b"1")
    await asyncio.to_thread(members.kill, first)
    # the read that finds the member gone moves on and is answered by another member
    entry = await kv.get("/failover/a")
    assert entry is not None and entry.mod_revision == revision
    assert member_of(kv, members) != first
    # commits go on there, compare-and-swap included
    await kv.commit(
        store.Txn(compares=[store.Compare("/failover/a", revision)], puts=[("/failover/a", b"2")])
    )
    assert (await kv.get("/failover/a")).value == b"2"  # type: ignore[union-attr]


async def test_a_commit_on_a_lost_member_is_not_retried_blindly(
    kv: store.DurableStore, members: etcdcluster.EtcdCluster
) -> None:
    """A transaction in the air when its member dies may have landed: it fails with a
    temporary error (the caller decides again), and the next call works on another member."""
    await asyncio.to_thread(members.kill, member_of(kv, members))
    try:
        await kv.put("/failover/b", b"1")
    except errors.TemporaryStoreError:
        await kv.put("/failover/b", b"1")
    assert (await kv.get("/failover/b")).value == b"1"  # type: ignore[union-attr]


async def test_a_watch_resumes_on_another_member_without_losing_events(
    kv: store.DurableStore, members: etcdcluster.EtcdCluster
) -> None:
    start = await kv.put("/failover/w/0", b"0")
    seen: list[str] = []

    async def follow() -> None:
        async for event in kv.watch("/failover/w/", start_revision=start):
            seen.append(event.key)
            if len(seen) == 4:
                return

    watching = asyncio.create_task(follow())
    await kv.put("/failover/w/1", b"1")
    await asyncio.to_thread(members.kill, member_of(kv, members))
    for index in (2, 3):
        for _ in range(3):
            try:
                await kv.put(f"/failover/w/{index}", b"x")
                break
            except errors.TemporaryStoreError:
                await asyncio.sleep(0.2)
    await asyncio.wait_for(watching, 20)
    assert seen == [f"/failover/w/{i}" for i in range(4)]


async def test_a_watch_alone_finds_another_member(
    kv: store.DurableStore, members: etcdcluster.EtcdCluster
) -> None:
    """No other call runs: the watch itself moves on when its member is gone."""
    start = await kv.put("/failover/v/0", b"0")
    lost = member_of(kv, members)
    seen: list[str] = []

    async def follow() -> None:
        async for event in kv.watch("/failover/v/", start_revision=start):
            seen.append(event.key)
            if len(seen) == 2:
                return

    watching = asyncio.create_task(follow())
    await asyncio.sleep(0.2)
    await asyncio.to_thread(members.kill, lost)
    await asyncio.sleep(3)  # the watch notices and moves on by itself
    assert member_of(kv, members) != lost
    await kv.put("/failover/v/1", b"1")
    await asyncio.wait_for(watching, 20)
    assert seen == ["/failover/v/0", "/failover/v/1"]


async def test_every_member_down_is_a_temporary_error_quickly(
    kv: store.DurableStore, members: etcdcluster.EtcdCluster
) -> None:
    await kv.put("/failover/c", b"1")
    for index in range(3):
        await asyncio.to_thread(members.kill, index)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(errors.TemporaryStoreError):
        await kv.get("/failover/c")
    assert loop.time() - started < 3 * etcd.DEFAULT_TIMEOUT
