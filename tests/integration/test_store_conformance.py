"""One conformance suite for every Store: SQLite on a file and in memory, etcd on a real server.

What the broker relies on: versioned keys, compare-and-swap, all-or-nothing transactions,
ordered watches that resume, compaction, leases. etcd-only and sqlite-only behaviour (a server
restart under an open watch, durability across reopen) is at the end.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker.state import errors, opening, sqlite, store
from tests import etcdserver

PUT = store.EventType.PUT
DELETE = store.EventType.DELETE


@dataclass
class Backend:
    name: str
    url: str


@pytest.fixture(
    params=[
        pytest.param("sqlite-file", id="sqlite-file"),
        pytest.param("sqlite-memory", id="sqlite-memory"),
        pytest.param("etcd", id="etcd", marks=pytest.mark.etcd),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "etcd":
        server: etcdserver.EtcdServer = request.getfixturevalue("etcd_server")
        return Backend("etcd", server.url)
    if request.param == "sqlite-file":
        return Backend("sqlite", f"sqlite:///{tmp_path / 'store.db'}")
    return Backend("sqlite", "sqlite://:memory:")


@pytest.fixture
async def kv(backend: Backend) -> AsyncIterator[store.DurableStore]:
    opened = await opening.open_store(backend.url)
    yield opened
    await opened.close()


@pytest.fixture
def prefix() -> str:
    """Keys of this test only: the etcd server is shared by the session."""
    return f"/conformance/{uuid.uuid4().hex[:12]}/"


async def take(events: AsyncIterator[store.WatchEvent], count: int) -> list[store.WatchEvent]:
    """The next `count` events of a watch (failing after 10 s)."""
    taken: list[store.WatchEvent] = []
    async with asyncio.timeout(10):
        while len(taken) < count:
            taken.append(await anext(events))
    return taken


def describe(events: Sequence[store.WatchEvent], prefix: str) -> list[tuple[str, str, bytes]]:
    return [(event.type, event.key.removeprefix(prefix), event.value) for event in events]


async def test_put_get_delete_keep_create_and_mod_revisions(
    kv: store.DurableStore, prefix: str
) -> None:
    key = prefix + "job"
    assert await kv.get(key) is None

    created = await kv.put(key, b"v1")
    assert await kv.get(key) == store.Entry(key, b"v1", created, created)

    updated = await kv.put(key, b"v2")
    assert updated > created
    assert await kv.get(key) == store.Entry(key, b"v2", updated, created)

    deleted = await kv.delete(key)
    assert deleted > updated
    assert await kv.get(key) is None

    # Deleting what is not there changes nothing, not even the revision.
    assert await kv.delete(key) == deleted
    recreated = await kv.put(key, b"v3")
    assert await kv.get(key) == store.Entry(key, b"v3", recreated, recreated)


async def test_list_returns_only_the_prefix_sorted_with_its_revision(
    kv: store.DurableStore, prefix: str
) -> None:
    for name in ["jobs/b", "jobs/a/x", "jobsz", "jobs/a", "queues/a", "jobs/é"]:
        last = await kv.put(prefix + name, name.encode())

    entries, revision = await kv.list(prefix + "jobs/")

    assert [entry.key.removeprefix(prefix) for entry in entries] == [
        "jobs/a",
        "jobs/a/x",
        "jobs/b",
        "jobs/é",
    ]
    assert all(entry.value == entry.key.removeprefix(prefix).encode() for entry in entries)
    assert revision >= last
    assert await kv.list(prefix + "nothing/") == ([], revision)


@pytest.mark.parametrize(
    ("history", "compare_with", "conflict"),
    [
        pytest.param("written twice", "current", False, id="update at the current revision"),
        pytest.param("written twice", "stale", True, id="update at a stale revision"),
        pytest.param("never written", "absent", False, id="create what must not exist"),
        pytest.param("written twice", "absent", True, id="create what already exists"),
        pytest.param("deleted", "current", True, id="update a key deleted since it was read"),
        pytest.param("deleted", "absent", False, id="create again after a delete"),
    ],
)
async def test_compare_and_swap(
    kv: store.DurableStore, prefix: str, history: str, compare_with: str, conflict: bool
) -> None:
    key = prefix + "quota"
    stale = current = 0
    if history != "never written":
        stale = await kv.put(key, b"v1")
        current = await kv.put(key, b"v2")
    if history == "deleted":
        await kv.delete(key)
    before = await kv.get(key)
    expected = {"current": current, "stale": stale, "absent": 0}[compare_with]

    txn = store.Txn(compares=[store.Compare(key, expected)], puts=[(key, b"new")])
    if conflict:
        with pytest.raises(errors.ConflictError) as raised:
            await kv.commit(txn)
        assert raised.value.revisions == {key: before.mod_revision if before else 0}
        assert await kv.get(key) == before
    else:
        revision = await kv.commit(txn)
        entry = await kv.get(key)
        assert entry is not None
        assert (entry.value, entry.mod_revision) == (b"new", revision)


async def test_a_failing_compare_applies_nothing(kv: store.DurableStore, prefix: str) -> None:
    a, b, c = prefix + "a", prefix + "b", prefix + "c"
    rev_a = await kv.put(a, b"a0")
    await kv.put(c, b"c0")
    _, revision_before = await kv.list(prefix)

    txn = store.Txn(
        compares=[store.Compare(a, rev_a), store.Compare(b, 12345)],
        puts=[(a, b"a1"), (b, b"b1")],
        deletes=[c],
    )
    with pytest.raises(errors.ConflictError) as raised:
        await kv.commit(txn)

    assert raised.value.revisions == {b: 0}
    entries, revision_after = await kv.list(prefix)
    assert [(e.key, e.value) for e in entries] == [(a, b"a0"), (c, b"c0")]
    assert revision_after == revision_before


async def test_a_transaction_applies_everything_at_one_revision(
    kv: store.DurableStore, prefix: str
) -> None:
    a, b, c = prefix + "a", prefix + "b", prefix + "c"
    rev_a = await kv.put(a, b"a0")
    await kv.put(c, b"c0")

    revision = await kv.commit(
        store.Txn(
            compares=[store.Compare(a, rev_a), store.Compare(b, 0)],
            puts=[(a, b"a1"), (b, b"b1")],
            deletes=[c],
        )
    )

    entries, _ = await kv.list(prefix)
    assert [(e.key, e.value, e.mod_revision) for e in entries] == [
        (a, b"a1", revision),
        (b, b"b1", revision),
    ]


@pytest.mark.parametrize(
    "txn",
    [
        pytest.param(store.Txn(puts=[("k", b"1"), ("k", b"2")]), id="put twice"),
        pytest.param(store.Txn(puts=[("k", b"1")], deletes=["k"]), id="put and delete"),
        pytest.param(store.Txn(puts=[("", b"1")]), id="empty key"),
    ],
)
async def test_a_malformed_transaction_is_refused(
    kv: store.DurableStore, prefix: str, txn: store.Txn
) -> None:
    _, before = await kv.list(prefix)
    with pytest.raises(ValueError):
        await kv.commit(txn)
    assert (await kv.list(prefix))[1] == before


async def test_revisions_increase_under_concurrent_writers(
    kv: store.DurableStore, prefix: str
) -> None:
    revisions = await asyncio.gather(*(kv.put(f"{prefix}{i:02}", b"x") for i in range(32)))

    entries, listed_at = await kv.list(prefix)
    # each put is at the revision its commit answered; commits given together may share one
    # (etcd sends them in one request, `etcd_sharing`), as the puts of one transaction do
    assert {e.key: e.mod_revision for e in entries} == {
        f"{prefix}{i:02}": revision for i, revision in enumerate(revisions)
    }
    assert listed_at >= max(revisions)
    assert await kv.put(prefix + "later", b"x") > listed_at


async def test_watch_from_a_revision_sees_exactly_the_later_events_in_order(
    kv: store.DurableStore, prefix: str
) -> None:
    await kv.put(prefix + "w/early", b"0")
    start = await kv.put(prefix + "w/a", b"1")
    await kv.put(prefix + "elsewhere", b"x")
    await kv.commit(store.Txn(puts=[(prefix + "w/b", b"2"), (prefix + "w/c", b"3")]))
    await kv.delete(prefix + "w/a")

    events = kv.watch(prefix + "w/", start_revision=start)
    history = await take(events, 4)
    waiting = asyncio.ensure_future(take(events, 1))
    await asyncio.sleep(0.05)  # the watcher is now waiting for a commit to wake it
    await kv.put(prefix + "w/live", b"4")
    live = await waiting

    assert describe(history + live, prefix) == [
        (PUT, "w/a", b"1"),
        (PUT, "w/b", b"2"),
        (PUT, "w/c", b"3"),
        (DELETE, "w/a", b""),
        (PUT, "w/live", b"4"),
    ]
    revisions = [event.revision for event in history + live]
    assert revisions[0] == start
    assert revisions[1] == revisions[2]  # one transaction, one revision
    assert revisions == sorted(revisions)


async def test_watch_from_a_compacted_revision_raises(kv: store.DurableStore, prefix: str) -> None:
    old = await kv.put(prefix + "a", b"1")
    await kv.put(prefix + "a", b"2")
    kept = await kv.put(prefix + "a", b"3")
    await kv.compact(kept)

    with pytest.raises(errors.CompactedError):
        await take(kv.watch(prefix, start_revision=old), 1)
    assert describe(await take(kv.watch(prefix, start_revision=kept), 1), prefix) == [
        (PUT, "a", b"3")
    ]


async def test_revoking_a_lease_deletes_its_keys(kv: store.DurableStore, prefix: str) -> None:
    lease = await kv.grant_lease(30)
    start = await kv.commit(store.Txn(puts=[(prefix + "leader", b"me")], lease=lease))
    await kv.put(prefix + "plain", b"stays")
    assert 0 < await kv.keep_alive(lease) <= 30

    await kv.revoke_lease(lease)

    assert await kv.get(prefix + "leader") is None
    assert await kv.get(prefix + "plain") is not None
    events = await take(kv.watch(prefix, start_revision=start), 3)
    assert describe(events, prefix) == [
        (PUT, "leader", b"me"),
        (PUT, "plain", b"stays"),
        (DELETE, "leader", b""),
    ]
    with pytest.raises(errors.LeaseExpiredError):
        await kv.keep_alive(lease)
    await kv.revoke_lease(lease)  # twice is fine


async def test_a_transaction_may_attach_only_some_of_its_puts_to_the_lease(
    kv: store.DurableStore, prefix: str
) -> None:
    lease = await kv.grant_lease(30)
    await kv.commit(
        store.Txn(
            puts=[(prefix + "leader", b"me"), (prefix + "term", b"7")],
            lease=lease,
            lease_keys=frozenset({prefix + "leader"}),
        )
    )

    await kv.revoke_lease(lease)

    assert await kv.get(prefix + "leader") is None
    term = await kv.get(prefix + "term")
    assert term is not None and term.value == b"7"


async def test_closing_the_store_ends_its_watches(backend: Backend, prefix: str) -> None:
    kv = await opening.open_store(backend.url)
    start = await kv.put(prefix + "a", b"1")
    events = kv.watch(prefix, start_revision=start)
    await take(events, 1)
    waiting = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.05)

    await kv.close()

    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiting, 5)


# -- etcd only ---------------------------------------------------------------------------------


async def wait_until_answering(kv: store.Store) -> None:
    async with asyncio.timeout(10):
        while True:
            try:
                await kv.get("/conformance/ping")
                return
            except errors.TemporaryStoreError:
                await asyncio.sleep(0.05)


@pytest.mark.etcd
async def test_etcd_watch_resumes_across_a_server_restart_exactly_once(
    etcd_server: etcdserver.EtcdServer, prefix: str
) -> None:
    kv = await opening.open_store(etcd_server.url)
    try:
        start = await kv.put(prefix + "before", b"0")
        events = kv.watch(prefix, start_revision=start)
        assert describe(await take(events, 1), prefix) == [(PUT, "before", b"0")]

        # 1. The consumer is not reading while etcd restarts and two writes land.
        await asyncio.to_thread(etcd_server.restart)
        await wait_until_answering(kv)
        await kv.put(prefix + "gap1", b"1")
        await kv.delete(prefix + "before")

        # 2. The consumer is blocked in the watch while etcd restarts again.
        waiting = asyncio.ensure_future(take(events, 3))
        await asyncio.sleep(0.1)
        await asyncio.to_thread(etcd_server.restart)
        await wait_until_answering(kv)
        await kv.put(prefix + "after", b"2")
        resumed = await waiting
        await kv.put(prefix + "marker", b"3")
        resumed += await take(events, 1)

        assert describe(resumed, prefix) == [
            (PUT, "gap1", b"1"),
            (DELETE, "before", b""),
            (PUT, "after", b"2"),
            (PUT, "marker", b"3"),
        ]
    finally:
        await kv.close()


@pytest.mark.etcd
async def test_etcd_unreachable_is_a_temporary_error(
    etcd_server: etcdserver.EtcdServer, prefix: str
) -> None:
    kv = await opening.open_store(etcd_server.url)
    try:
        await asyncio.to_thread(etcd_server.stop)
        with pytest.raises(errors.TemporaryStoreError) as raised:
            await kv.put(prefix + "a", b"1")
        assert raised.value.__cause__ is not None
    finally:
        await kv.close()
        await asyncio.to_thread(etcd_server.launch)


@pytest.mark.etcd
async def test_etcd_url_opens_the_first_endpoint_that_answers(
    etcd_server: etcdserver.EtcdServer, prefix: str
) -> None:
    dead = f"127.0.0.1:{etcdserver.pick_free_ports(1)[0]}"
    with pytest.raises(errors.TemporaryStoreError, match=dead):
        await opening.open_store(f"etcd://{dead}")

    kv = await opening.open_store(f"etcd://{dead},{etcd_server.endpoint}")
    try:
        revision = await kv.put(prefix + "a", b"1")
        assert await kv.get(prefix + "a") == store.Entry(prefix + "a", b"1", revision, revision)
    finally:
        await kv.close()


# -- sqlite only -------------------------------------------------------------------------------


async def test_sqlite_keeps_every_commit_across_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "state" / "broker.db"
    kv = await sqlite.SqliteStore.open(path)
    first = await kv.put("/jobs/a", b"1")
    lease = await kv.grant_lease(10)
    await kv.commit(store.Txn(puts=[("/leader", b"me")], lease=lease))
    last = await kv.commit(store.Txn(puts=[("/jobs/b", b"2")], deletes=["/jobs/a"]))
    await kv.close()

    kv = await sqlite.SqliteStore.open(path)
    try:
        entries, revision = await kv.list("/")
        # The lease's holder is gone, so its key went with it (one more revision).
        assert [(e.key, e.value, e.mod_revision) for e in entries] == [("/jobs/b", b"2", last)]
        assert revision == last + 1
        assert await kv.put("/jobs/c", b"3") == last + 2
        history = await take(kv.watch("/jobs/", start_revision=first), 4)
        assert describe(history, "/jobs/") == [
            (PUT, "a", b"1"),
            (PUT, "b", b"2"),
            (DELETE, "a", b""),
            (PUT, "c", b"3"),
        ]
    finally:
        await kv.close()


CRASHING_WRITER = """
import asyncio, os, signal, sys
from broker.state import sqlite

async def write_then_die(path):
    kv = await sqlite.SqliteStore.open(path)
    for i in range(50):
        revision = await kv.put(f"/jobs/{i:02}", b"accepted")
    print(revision, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush: a crash

asyncio.run(write_then_die(sys.argv[1]))
"""


async def test_sqlite_loses_no_commit_when_the_process_is_killed(tmp_path: Path) -> None:
    path = tmp_path / "crash.db"
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CRASHING_WRITER, str(path), stdout=asyncio.subprocess.PIPE
    )
    stdout, _ = await child.communicate()
    assert child.returncode == -signal.SIGKILL
    last_acknowledged = int(stdout)

    kv = await sqlite.SqliteStore.open(path)
    try:
        entries, revision = await kv.list("/jobs/")
        assert len(entries) == 50
        assert revision == last_acknowledged
    finally:
        await kv.close()


async def test_sqlite_trims_its_change_log(tmp_path: Path) -> None:
    kv = await sqlite.SqliteStore.open(tmp_path / "trim.db", keep_revisions=10)
    try:
        first = await kv.put("/k", b"0")
        for i in range(sqlite.COMPACT_EVERY):
            last = await kv.put("/k", str(i).encode())
        with pytest.raises(errors.CompactedError):
            await take(kv.watch("/", start_revision=first), 1)
        assert [e.revision for e in await take(kv.watch("/", start_revision=last - 5), 6)] == [
            last - 5 + i for i in range(6)
        ]
    finally:
        await kv.close()


async def test_sqlite_file_is_one_process_only(tmp_path: Path) -> None:
    kv = await sqlite.SqliteStore.open(tmp_path / "one.db")
    try:
        with pytest.raises(errors.StoreError, match="in use"):
            await sqlite.SqliteStore.open(tmp_path / "one.db")
    finally:
        await kv.close()


# -- opening -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("postgres://db/x", id="unknown scheme"),
        pytest.param("sqlite://relative.db", id="sqlite without the third slash"),
        pytest.param("etcd://", id="etcd without endpoints"),
        pytest.param("etcd://host:port", id="etcd with a bad port"),
    ],
)
async def test_open_store_names_a_bad_url(url: str) -> None:
    with pytest.raises(ValueError, match=re.escape(url)):
        await opening.open_store(url)


async def test_open_store_takes_a_relative_sqlite_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    kv = await opening.open_store("sqlite:///data/broker.db")
    await kv.put("/a", b"1")
    await kv.close()
    assert (tmp_path / "data" / "broker.db").is_file()
