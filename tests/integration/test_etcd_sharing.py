"""Commits that share one request on a real etcd (`state.etcd_sharing`): the commits given
while a request is on its way go together in the next, each still its own transaction: its
own compares, its own conflict, one revision for all; a key written twice keeps its order; a
request etcd refuses for its shape is sent again one commit a request; a commit cancelled
while it waits is never sent."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest

from broker.state import errors, etcd, opening, store
from tests import etcdserver

pytestmark = pytest.mark.etcd
_prefixes = itertools.count()


@pytest.fixture
async def kv(etcd_server: etcdserver.EtcdServer) -> AsyncIterator[etcd.EtcdStore]:
    backing = await opening.open_store(etcd_server.url)
    assert isinstance(backing, etcd.EtcdStore)
    try:
        yield backing
    finally:
        await backing.close()


@pytest.fixture
def prefix() -> str:
    return f"/sharing/{next(_prefixes)}-{id(object())}/"


async def test_commits_given_together_share_requests_and_each_lands(
    kv: etcd.EtcdStore, prefix: str
) -> None:
    before = kv._sharing.requests
    revisions = await asyncio.gather(*(kv.put(f"{prefix}{n}", str(n).encode()) for n in range(40)))
    # given in one turn of the loop, they went together: one request, one revision
    assert kv._sharing.requests - before == 1
    assert len(set(revisions)) == 1
    entries, _ = await kv.list(prefix)
    assert {e.key: e.value for e in entries} == {f"{prefix}{n}": str(n).encode() for n in range(40)}
    assert {e.mod_revision for e in entries} == set(revisions)


async def test_a_conflict_is_its_own_commits_alone(kv: etcd.EtcdStore, prefix: str) -> None:
    old = await kv.put(f"{prefix}cas", b"0")
    await kv.put(f"{prefix}cas", b"1")  # the compare below is now stale
    blocker = asyncio.ensure_future(kv.put(f"{prefix}first", b"x"))  # on its way first
    await asyncio.sleep(0)
    stale = kv.commit(
        store.Txn(compares=[store.Compare(f"{prefix}cas", old)], puts=[(f"{prefix}cas", b"2")])
    )
    fresh = [kv.put(f"{prefix}other/{n}", b"y") for n in range(5)]
    results = await asyncio.gather(stale, *fresh, return_exceptions=True)
    await blocker
    conflict = results[0]
    assert isinstance(conflict, errors.ConflictError)
    current = await kv.get(f"{prefix}cas")
    assert current is not None and current.value == b"1"
    assert conflict.revisions == {f"{prefix}cas": current.mod_revision}
    assert all(isinstance(r, int) for r in results[1:])  # the others landed
    entries, _ = await kv.list(f"{prefix}other/")
    assert len(entries) == 5


async def test_a_key_written_twice_keeps_its_order(kv: etcd.EtcdStore, prefix: str) -> None:
    writes = [kv.put(f"{prefix}same", str(n).encode()) for n in range(10)]
    revisions = await asyncio.gather(*writes)
    assert revisions == sorted(revisions) and len(set(revisions)) == 10
    entry = await kv.get(f"{prefix}same")
    assert entry is not None and entry.value == b"9"


async def test_commits_given_while_a_request_is_on_its_way_go_in_the_next(
    kv: etcd.EtcdStore, prefix: str
) -> None:
    before = kv._sharing.requests
    first = asyncio.ensure_future(kv.put(f"{prefix}first", b"1"))
    while kv._sharing.requests == before:  # sent, alone: nothing waits for company
        await asyncio.sleep(0)
    before = kv._sharing.requests
    later = await asyncio.gather(*(kv.put(f"{prefix}{n}", b"2") for n in range(5)))
    assert kv._sharing.requests - before == 1 and len(set(later)) == 1
    assert await first < later[0]


async def test_a_lease_of_a_shared_commit_is_kept(kv: etcd.EtcdStore, prefix: str) -> None:
    lease = await kv.grant_lease(30)
    leased = store.Txn(puts=[(f"{prefix}leased", b"l")], lease=lease)
    await asyncio.gather(kv.put(f"{prefix}a", b"a"), kv.commit(leased), kv.put(f"{prefix}b", b"b"))
    await kv.revoke_lease(lease)
    assert await kv.get(f"{prefix}leased") is None  # went with its lease
    assert await kv.get(f"{prefix}a") is not None and await kv.get(f"{prefix}b") is not None


async def test_a_request_refused_for_its_shape_is_sent_again_one_commit_each(
    kv: etcd.EtcdStore, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd's --max-txn-ops (128) counts the nested transactions against each one's own
    operations: 31 of 100 each are refused as one request, and land one a request."""
    kv._sharing.max_ops = 10_000  # as if etcd's bound were higher than it is
    big = [store.Txn(puts=[(f"{prefix}{n}/{i}", b"v") for i in range(100)]) for n in range(31)]
    before = kv._sharing.requests
    revisions = await asyncio.gather(*(kv.commit(txn) for txn in big))
    assert len(set(revisions)) == 31  # each landed on its own
    assert kv._sharing.requests - before == 1 + 31  # refused together, then one each
    assert "etcd refused 31 transactions in one request" in caplog.text
    entries, _ = await kv.list(prefix)
    assert len(entries) == 3100


async def test_a_commit_cancelled_while_it_waits_is_never_sent(
    kv: etcd.EtcdStore, prefix: str
) -> None:
    first = asyncio.ensure_future(kv.put(f"{prefix}first", b"1"))
    await asyncio.sleep(0)  # on its way
    waiting = asyncio.ensure_future(kv.put(f"{prefix}cancelled", b"2"))
    after = asyncio.ensure_future(kv.put(f"{prefix}after", b"3"))
    await asyncio.sleep(0)  # both wait for the request on its way
    waiting.cancel()
    await first
    await after
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert await kv.get(f"{prefix}cancelled") is None
    assert await kv.get(f"{prefix}after") is not None


async def test_closing_answers_what_waits(etcd_server: etcdserver.EtcdServer) -> None:
    backing = await opening.open_store(etcd_server.url)
    assert isinstance(backing, etcd.EtcdStore)
    first = asyncio.ensure_future(backing.put("/sharing/closing/1", b"1"))
    while not backing._sharing.requests:  # on its way
        await asyncio.sleep(0)
    waiting = asyncio.ensure_future(backing.put("/sharing/closing/2", b"2"))
    await asyncio.sleep(0)
    await backing.close()
    sent, unsent = await asyncio.gather(first, waiting, return_exceptions=True)
    # the one on its way may have landed: a temporary error (or its answer, if it came first)
    assert isinstance(sent, (int, errors.TemporaryStoreError)), sent
    # the one that waited was never sent: refused, and not as something that may have landed
    assert isinstance(unsent, errors.StoreError), unsent
    assert not isinstance(unsent, errors.TemporaryStoreError) and "closed" in str(unsent)
    again = await opening.open_store(etcd_server.url)
    try:
        assert await again.get("/sharing/closing/2") is None
    finally:
        await again.close()


async def test_requests_stay_within_a_smaller_max_request_bytes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An etcd with --max-request-bytes of 128 KiB, told to the store: what goes together
    stays within half of it, and none is refused."""
    server = etcdserver.EtcdServer.start(flags=["--max-request-bytes=131072"])
    try:
        backing = await opening.open_store(server.url, max_request_bytes=131072)
        assert isinstance(backing, etcd.EtcdStore)
        try:
            writes = [backing.put(f"/small/{n}", b"x" * 10_000) for n in range(40)]
            revisions = await asyncio.gather(*writes)
            # 40 of 10 KB in requests of at most 64 KiB: six a request
            assert backing._sharing.requests == 7 and len(set(revisions)) == 7
            assert "refused" not in caplog.text
        finally:
            await backing.close()
    finally:
        server.cleanup()
