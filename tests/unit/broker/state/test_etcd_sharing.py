"""What one etcd request carries of the commits waiting (`etcd_sharing.take`): in order, at
least the first, then as many as keep it within the bounds and write no key twice."""

from __future__ import annotations

import asyncio

import pytest

from broker.state import etcd, etcd_sharing, store


def waiting(*keys: str, compares: int = 0, value: bytes = b"v") -> etcd_sharing.Waiting:
    txn = store.Txn(
        compares=[store.Compare(f"/c/{n}", 1) for n in range(compares)],
        puts=[(key, value) for key in keys],
    )
    future = asyncio.get_running_loop().create_future()
    return etcd_sharing.waiting_of(etcd.build_txn_request(txn), future)


async def test_the_keys_a_commit_writes_and_its_largest_branch() -> None:
    txn = store.Txn(
        compares=[store.Compare("/a", 3), store.Compare("/fence", 9)],
        puts=[("/a", b"1")],
        deletes=["/b"],
    )
    future = asyncio.get_running_loop().create_future()
    item = etcd_sharing.waiting_of(etcd.build_txn_request(txn), future)
    assert item.keys == {b"/a", b"/b"}  # the compared-only fence is no write
    assert item.ops == 2
    assert item.size == etcd.build_txn_request(txn).ByteSize()


async def test_commits_that_fit_go_together_in_order() -> None:
    items = [waiting(f"/k/{n}") for n in range(5)]
    assert etcd_sharing.take(items, max_ops=100, max_bytes=1 << 20) == 5


async def test_a_key_written_twice_waits_for_the_next_request() -> None:
    items = [waiting("/a"), waiting("/b"), waiting("/a"), waiting("/c")]
    # the second write of /a, and what follows it, goes next: order is kept
    assert etcd_sharing.take(items, max_ops=100, max_bytes=1 << 20) == 2
    assert etcd_sharing.take(items[2:], max_ops=100, max_bytes=1 << 20) == 2


async def test_nested_transactions_and_the_largest_one_stay_within_the_operations() -> None:
    items = [waiting(*[f"/k/{n}/{i}" for i in range(10)]) for n in range(20)]
    # n nested and the largest of 10 operations: n + 10 <= 15 takes 5
    assert etcd_sharing.take(items, max_ops=15, max_bytes=1 << 20) == 5
    big = waiting(*[f"/big/{i}" for i in range(14)])
    assert etcd_sharing.take([items[0], big], max_ops=15, max_bytes=1 << 20) == 1


async def test_bytes_bound_what_goes_together_but_never_the_first() -> None:
    items = [waiting(f"/k/{n}", value=b"x" * 1000) for n in range(10)]
    each = items[0].size + etcd_sharing.NESTING_BYTES
    assert etcd_sharing.take(items, max_ops=100, max_bytes=3 * each) == 3
    assert etcd_sharing.take(items, max_ops=100, max_bytes=10) == 1  # alone, as it came


async def test_a_sender_that_breaks_answers_what_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the sender (here in `take`) is every waiting commit's answer: none is left
    waiting for ever."""

    async def send(request: object) -> object:
        raise AssertionError("never sent")

    def broken(*args: object, **kwargs: object) -> int:
        raise RuntimeError("take broke")

    monkeypatch.setattr(etcd_sharing, "take", broken)
    sharing = etcd_sharing.Sharing(send, max_ops=100, max_bytes=1 << 20)
    request = etcd.build_txn_request(store.Txn(puts=[("/a", b"1")]))
    with pytest.raises(RuntimeError, match="take broke"):
        await asyncio.wait_for(sharing.commit(request), timeout=5)
