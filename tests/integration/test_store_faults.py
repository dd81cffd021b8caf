"""Store faults get the right answer (issue 10, measured case 9), on real SQLite files.

A full disk (SQLite's own size cap, `PRAGMA max_page_count`, fails writes with SQLITE_FULL
exactly as a full disk does) answers 507 `store-full`; a store that refuses writes (`PRAGMA
query_only`, which stops root too) 503 `store-read-only`; in both nothing is half-written. etcd
down answers 503 with `Retry-After`. A damaged file is refused at open; a record that does not
parse is set aside in the quarantine, counted and listed, and the broker starts. A backup
taken while writes go on has every job committed before it began; a file copied without its
`-wal` after a crash is noticed.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.api import status
from broker.http import keys
from broker.state import errors, opening, quarantine, records, sqlite, sqlite_backup, store
from tests import etcdserver
from tests.builders import make_job

TEAM_A = {"Authorization": "Bearer dev-team-a"}
ADMIN = {"Authorization": "Bearer dev-admin"}
REPO = Path(__file__).resolve().parents[2]
NO_CAP = 1_073_741_823  # SQLite's largest max_page_count


async def start_broker(store_url: str) -> TestClient[Any, Any]:
    settings = broker_app.BrokerSettings(
        store=store_url, tokens_file=REPO / "config" / "tokens.yaml"
    )
    client = TestClient(TestServer(broker_app.create_app(settings)))
    await client.start_server()
    return client


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    client = await start_broker(f"sqlite:///{tmp_path / 'broker.db'}")
    try:
        yield client
    finally:
        await client.close()


def backing_of(api: TestClient[Any, Any]) -> sqlite.SqliteStore:
    backing = api.server.app[keys.JOBS].book.store.backing
    assert isinstance(backing, sqlite.SqliteStore)
    return backing


async def play_the_disk(backing: sqlite.SqliteStore, pragma: str) -> Any:
    """Run a pragma on the store's own connection, on the thread that owns it."""
    return await backing._run(lambda: backing._db.execute(f"PRAGMA {pragma}").fetchall())


async def submit(api: TestClient[Any, Any], doc: Any, **headers: str) -> Any:
    body = io.BytesIO(json.dumps(doc).encode())
    return await api.post("/v1/jobs", data=body, headers={**TEAM_A, **headers})


def big_job(name: str) -> dict[str, Any]:
    """A job of about 200 KiB: its record needs pages the capped file does not have."""
    return make_job(name, gpus=1).annotate("example.com/notes", "n" * 200_000).document()


async def stored_keys(backing: store.Store) -> list[str]:
    entries, _ = await backing.list("/gpufed/")
    return [e.key for e in entries if e.key.startswith((records.JOBS, records.IDEMPOTENCY))]


# -- full, read-only, unreachable -------------------------------------------------------------


async def test_a_full_disk_answers_507_store_full_and_writes_nothing(
    api: TestClient[Any, Any],
) -> None:
    backing = backing_of(api)
    assert (await submit(api, make_job("before", gpus=1).document())).status == 202
    before = await stored_keys(backing)
    [(pages,)] = await play_the_disk(backing, "page_count")
    await play_the_disk(backing, f"max_page_count = {pages}")

    response = await submit(api, big_job("full"), **{"Idempotency-Key": "k-full"})

    assert response.status == 507
    problem = await response.json()
    assert problem["type"] == "urn:gpufed:problem:store-full"
    assert problem["title"] == "Store full"
    assert "nothing was written" in problem["detail"]
    # nothing half-written: not the job, not its idempotency key, not in the book
    assert await stored_keys(backing) == before
    listed = await (await api.get("/v1/jobs", headers=ADMIN)).json()
    assert [j["job"]["metadata"]["name"] for j in listed["items"]] == ["before"]

    # space freed: the same request, same key, makes the job (it is not a replay)
    await play_the_disk(backing, f"max_page_count = {NO_CAP}")
    again = await submit(api, big_job("full"), **{"Idempotency-Key": "k-full"})
    assert again.status == 202
    assert "Idempotent-Replayed" not in again.headers
    assert len(await stored_keys(backing)) == len(before) + 2


async def test_a_read_only_store_answers_503_store_read_only_and_writes_nothing(
    api: TestClient[Any, Any],
) -> None:
    backing = backing_of(api)
    job_id = (await (await submit(api, make_job("kept", gpus=1).document())).json())["id"]
    before = await stored_keys(backing)
    await play_the_disk(backing, "query_only = 1")

    response = await submit(api, make_job("refused", gpus=1).document())
    cancel = await api.delete(f"/v1/jobs/{job_id}", headers=TEAM_A)

    for answer in (response, cancel):
        assert answer.status == 503
        problem = await answer.json()
        assert problem["type"] == "urn:gpufed:problem:store-read-only"
        assert problem["title"] == "Store read-only"
    assert await stored_keys(backing) == before
    got = await (await api.get(f"/v1/jobs/{job_id}", headers=TEAM_A)).json()
    assert got["status"]["state"] == "Queued" and not got["status"]["cancelRequested"]
    await play_the_disk(backing, "query_only = 0")
    assert (await submit(api, make_job("later", gpus=1).document())).status == 202


async def test_a_read_only_file_is_refused_at_open(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("runs as root, which chmod does not stop (query_only covers read-only)")
    path = tmp_path / "ro" / "broker.db"
    kv = await sqlite.SqliteStore.open(path)
    await kv.close()
    path.chmod(0o444)
    path.parent.chmod(0o555)
    try:
        with pytest.raises(errors.StoreReadOnlyError, match=str(path)):
            await sqlite.SqliteStore.open(path)
    finally:
        path.parent.chmod(0o755)


@pytest.mark.etcd
async def test_etcd_down_answers_503_with_retry_after(tmp_path: Path) -> None:
    try:
        server = etcdserver.EtcdServer.start(root=tmp_path)
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start etcd: {exc}", pytrace=False)
    try:
        api = await start_broker(server.url)
        try:
            assert (await submit(api, make_job("up", gpus=1).document())).status == 202
            await asyncio.to_thread(server.stop)
            response = await submit(api, make_job("down", gpus=1).document())
            assert response.status == 503
            assert response.headers["Retry-After"] == "1"
            assert (await response.json())["title"] == "Store unavailable"
        finally:
            await api.close()
    finally:
        server.cleanup()


# -- a damaged file ----------------------------------------------------------------------------


async def make_store_with_data(path: Path, jobs: int = 200) -> None:
    """A store with jobs (kv), their history (changes) and meta, over many pages."""
    kv = await sqlite.SqliteStore.open(path)
    job = make_job("filler", gpus=1).annotate("example.com/notes", "x" * 2000).build()
    for start in range(0, jobs, 50):
        batch = [
            status.JobRecord(id=f"job-{i:04}", tenant="team-a", job=job)
            for i in range(start, start + 50)
        ]
        await put_records(kv, batch)
    await kv.close()


async def put_records(kv: store.Store, batch: list[status.JobRecord]) -> int:
    """New job records in one transaction, as the book creates them."""
    return await kv.commit(
        store.Txn(
            compares=[store.Compare(records.job_key(r.id), 0) for r in batch],
            puts=[(records.job_key(r.id), records.encode(r)) for r in batch],
        )
    )


def damage_page_of(path: Path, table: str) -> int:
    """Write garbage over the root page of `table` (a page the `kv` table does not use)."""
    with sqlite3.connect(path) as conn:
        [(root,)] = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,))
        [(size,)] = conn.execute("PRAGMA page_size")
        [(kv_root,)] = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'kv'")
    conn.close()
    assert root not in (1, kv_root)
    with path.open("r+b") as file:
        file.seek((root - 1) * size)
        file.write(bytes(range(256)) * (size // 256))
    return int(root)


async def test_a_file_damaged_outside_the_kv_table_is_refused_at_open(tmp_path: Path) -> None:
    path = tmp_path / "broker.db"
    await make_store_with_data(path)
    damage_page_of(path, "changes")

    with pytest.raises(errors.StoreDamagedError) as refused:
        await sqlite.SqliteStore.open(path)

    message = str(refused.value)
    assert "\n" not in message
    assert str(path) in message and "damaged" in message and "backup" in message
    # the refusal let go of the file: a store restored in its place opens
    for leftover in tmp_path.glob("broker.db*"):
        leftover.unlink()
    restored = await sqlite.SqliteStore.open(path)
    await restored.close()


async def test_a_file_that_is_not_a_database_is_refused_at_open(tmp_path: Path) -> None:
    path = tmp_path / "broker.db"
    path.write_bytes(b"not a database, " * 512)
    with pytest.raises(errors.StoreDamagedError, match=r"is damaged \(file is not a database\)"):
        await sqlite.SqliteStore.open(path)


# -- records that do not parse -----------------------------------------------------------------


async def test_an_unparsable_record_is_quarantined_counted_and_the_broker_starts(
    tmp_path: Path,
) -> None:
    path = tmp_path / "broker.db"
    url = f"sqlite:///{path}"
    api = await start_broker(url)
    try:
        good = (await (await submit(api, make_job("good", gpus=1).document())).json())["id"]
    finally:
        await api.close()
    garbage = b"\x00\xffnot json{"
    wrong_id = make_record("someone-else").model_dump_json(by_alias=True).encode()
    kv = await sqlite.SqliteStore.open(path)
    await kv.put("/gpufed/jobs/x", garbage)
    await kv.put("/gpufed/jobs/y", wrong_id)
    await kv.put("/gpufed/queues/broken", b'{"name": 7}')
    with pytest.raises(errors.RecordDamagedError, match="/gpufed/jobs/x"):
        await records.JobStore(kv).get("x")
    await kv.close()

    for _ in range(2):  # and a second start finds them set aside already, once each
        api = await start_broker(url)
        try:
            listed = await (await api.get("/v1/jobs", headers=ADMIN)).json()
            names = {j["id"]: j["job"]["metadata"]["name"] for j in listed["items"]}
            assert good in names and set(names.values()) <= {"good", "after"}
            metrics = await (await api.get("/metrics", headers=ADMIN)).text()
            assert 'gpufed_store_quarantined_records{kind="jobs"} 2.0' in metrics
            assert 'gpufed_store_quarantined_records{kind="queues"} 1.0' in metrics
            assert (await submit(api, make_job("after", gpus=1).document())).status == 202
        finally:
            await api.close()

    kv = await sqlite.SqliteStore.open(path, read_only=True)
    try:
        items = {item.key: item for item in await quarantine.list_quarantined(kv)}
        assert await kv.get("/gpufed/jobs/x") is None
    finally:
        await kv.close()
    assert sorted(items) == ["/gpufed/jobs/x", "/gpufed/jobs/y", "/gpufed/queues/broken"]
    x = items["/gpufed/jobs/x"]
    assert x.raw == garbage and x.size == len(garbage)
    assert x.stored_under == "/gpufed/quarantine/jobs/x"
    assert "Invalid JSON" in x.error
    assert "does not match its key" in items["/gpufed/jobs/y"].error
    assert "Field required" in items["/gpufed/queues/broken"].error


def make_record(job_id: str) -> status.JobRecord:
    return status.JobRecord(id=job_id, tenant="team-a", job=make_job(gpus=1).build())


async def test_a_record_changed_while_being_set_aside_stays_where_it_is(tmp_path: Path) -> None:
    kv = await sqlite.SqliteStore.open(tmp_path / "broker.db")
    try:
        await kv.put("/gpufed/jobs/x", b"garbage")
        entry = await kv.get("/gpufed/jobs/x")
        assert entry is not None
        await kv.put("/gpufed/jobs/x", b"repaired meanwhile")
        assert not await quarantine.set_aside(kv, entry, ValueError("bad"))
        assert await quarantine.list_quarantined(kv) == []
        kept = await kv.get("/gpufed/jobs/x")
        assert kept is not None and kept.value == b"repaired meanwhile"
    finally:
        await kv.close()


async def test_a_record_the_store_will_not_let_move_is_skipped_not_a_crash(
    tmp_path: Path,
) -> None:
    kv = await sqlite.SqliteStore.open(tmp_path / "broker.db")
    try:
        await put_records(kv, [make_record("good")])
        await kv.put("/gpufed/jobs/x", b"garbage")
        await play_the_disk(kv, "query_only = 1")  # the move into the quarantine is refused
        loaded, _ = await records.JobStore(kv).load()
        assert [s.record.id for s in loaded] == ["good"]
        await play_the_disk(kv, "query_only = 0")
        assert await kv.get("/gpufed/jobs/x") is not None  # left where it was
    finally:
        await kv.close()


@pytest.mark.etcd
async def test_etcd_sets_an_unparsable_record_aside_too(tmp_path: Path) -> None:
    try:
        server = etcdserver.EtcdServer.start(root=tmp_path)
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start etcd: {exc}", pytrace=False)
    try:
        kv = await opening.open_store(server.url)
        try:
            await put_records(kv, [make_record("good")])
            await kv.put("/gpufed/jobs/x", b"garbage")
            loaded, _ = await records.JobStore(kv).load()
            [item] = await quarantine.list_quarantined(kv)
            assert await kv.get("/gpufed/jobs/x") is None
        finally:
            await kv.close()
    finally:
        server.cleanup()
    assert [s.record.id for s in loaded] == ["good"]
    assert (item.key, item.raw, item.stored_under) == (
        "/gpufed/jobs/x",
        b"garbage",
        "/gpufed/quarantine/jobs/x",
    )


# -- backup, and a file copied alone -----------------------------------------------------------


async def test_a_backup_taken_while_writes_go_on_has_every_committed_job(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kv = await sqlite.SqliteStore.open(tmp_path / "broker.db")
    committed: list[str] = []
    stop = asyncio.Event()

    async def write() -> None:
        n = 0
        while not stop.is_set():
            batch = [make_record(f"job-{n + i:05}") for i in range(10)]
            await put_records(kv, batch)
            committed.extend(r.id for r in batch)
            n += 10

    writer = asyncio.create_task(write())
    try:
        while len(committed) < 500:
            await asyncio.sleep(0.01)
        before = list(committed)
        copied = await asyncio.to_thread(sqlite_backup.backup, kv.path, tmp_path / "copy.db")
        during = len(committed)
        await asyncio.sleep(0.05)  # writes go on after the copy, too
    finally:
        stop.set()
        await writer
        await kv.close()
    assert len(committed) > during > len(before)

    caplog.set_level(logging.WARNING, logger="broker.state.sqlite")
    copy = await sqlite.SqliteStore.open(tmp_path / "copy.db")
    try:
        loaded, revision = await records.JobStore(copy).load()
    finally:
        await copy.close()
    ids = {s.record.id for s in loaded}
    assert set(before) <= ids <= set(committed)
    assert revision == copied.revision
    assert not [r for r in caplog.records if "-wal" in r.getMessage()]  # restored: no alarm


CRASHING_WRITER = """
import asyncio, os, signal, sys
from broker.state import sqlite

async def write_then_die(path):
    kv = await sqlite.SqliteStore.open(path)
    for i in range(50):
        await kv.put(f"/jobs/{i:02}", b"accepted")
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(write_then_die(sys.argv[1]))
"""


async def crash_a_writer(path: Path) -> None:
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", CRASHING_WRITER, str(path))
    await child.wait()
    assert child.returncode == -signal.SIGKILL


def wal_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "-wal file is missing" in r.getMessage()]


async def test_a_file_copied_without_its_wal_after_a_crash_is_noticed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="broker.state.sqlite")
    path = tmp_path / "crash.db"
    await crash_a_writer(path)
    alone = tmp_path / "alone" / "crash.db"
    alone.parent.mkdir()
    shutil.copy(path, alone)  # the mistake: the file without its -wal

    kv = await sqlite.SqliteStore.open(alone)
    entries, _ = await kv.list("/jobs/")
    await kv.close()
    assert len(entries) < 50
    [warning] = wal_warnings(caplog)
    assert str(alone) in warning and "may be lost" in warning

    caplog.clear()
    kv = await sqlite.SqliteStore.open(path)  # the crashed file with its -wal: all there
    entries, _ = await kv.list("/jobs/")
    await kv.close()
    assert len(entries) == 50
    assert wal_warnings(caplog) == []

    caplog.clear()
    cleanly_closed = tmp_path / "clean" / "crash.db"
    cleanly_closed.parent.mkdir()
    shutil.copy(path, cleanly_closed)  # closed by its broker: the file alone is whole
    kv = await sqlite.SqliteStore.open(cleanly_closed)
    entries, _ = await kv.list("/jobs/")
    await kv.close()
    assert len(entries) == 50
    assert wal_warnings(caplog) == []
