"""Idempotency-Key through the broker's HTTP API on a real SQLite store, and the key entries
on both real stores (SQLite and etcd): same body replays, another body is 422
`idempotency-key-reused` and stores nothing, keys expire after their window and are swept, and
entries of the old format (the job id alone) still replay."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.api import errors as api_errors
from broker.api import jobs, status
from broker.http import keys
from broker.jobs import book, expiring
from broker.state import errors, opening, records, sqlite, store
from tests import etcdserver
from tests.builders import make_job

TEAM_A = {"Authorization": "Bearer dev-team-a"}
ADMIN = {"Authorization": "Bearer dev-admin"}
REPO = Path(__file__).resolve().parents[2]

Api = Callable[..., Coroutine[Any, Any, TestClient[Any, Any]]]


@pytest.fixture
async def start_api(tmp_path: Path) -> AsyncIterator[Api]:
    started: list[TestClient[Any, Any]] = []

    async def start(**settings: Any) -> TestClient[Any, Any]:
        client = TestClient(
            TestServer(
                broker_app.create_app(
                    broker_app.BrokerSettings(
                        store=f"sqlite:///{tmp_path / 'broker.db'}",
                        tokens_file=REPO / "config" / "tokens.yaml",
                        **settings,
                    )
                )
            )
        )
        await client.start_server()
        started.append(client)
        return client

    yield start
    for client in started:
        await client.close()


@pytest.fixture
async def api(start_api: Api) -> TestClient[Any, Any]:
    return await start_api()


async def submit(
    api: TestClient[Any, Any], doc: dict[str, Any], key: str, *, as_yaml: bool = False
) -> Any:
    text = yaml.safe_dump(doc) if as_yaml else json.dumps(doc)
    headers = {**TEAM_A, "Idempotency-Key": key}
    if as_yaml:
        headers["Content-Type"] = "application/yaml"
    return await api.post("/v1/jobs", data=io.BytesIO(text.encode()), headers=headers)


async def job_ids(api: TestClient[Any, Any]) -> set[str]:
    listed = await (await api.get("/v1/jobs", headers=ADMIN)).json()
    return {item["id"] for item in listed["items"]}


def backing_of(api: TestClient[Any, Any]) -> store.Store:
    return api.app[keys.JOBS].book.store.backing


# ---- through the HTTP API ---------------------------------------------------------------------


async def test_same_key_and_body_replays_the_job_even_as_yaml_in_another_order(
    api: TestClient[Any, Any],
) -> None:
    doc = make_job("once", gpus=2).document()
    first = await submit(api, doc, "k-same")
    assert first.status == 202 and "Idempotent-Replayed" not in first.headers
    reordered = dict(reversed(list(doc.items())))
    again = await submit(api, reordered, "k-same", as_yaml=True)
    assert again.status == 202 and again.headers["Idempotent-Replayed"] == "true"
    assert (await again.json())["id"] == (await first.json())["id"]
    assert len(await job_ids(api)) == 1


async def test_same_key_with_another_body_is_422_and_stores_nothing(
    api: TestClient[Any, Any],
) -> None:
    first = await submit(api, make_job("train", gpus=1).document(), "k-reused")
    first_id = (await first.json())["id"]
    other = await submit(api, make_job("train", gpus=8).document(), "k-reused")
    assert other.status == 422
    problem = await other.json()
    assert problem["title"] == "idempotency-key-reused"
    assert problem["type"] == "urn:gpufed:problem:idempotency-key-reused"
    assert problem["field"] == "Idempotency-Key" and first_id in problem["detail"]
    assert await job_ids(api) == {first_id}
    entries, _ = await backing_of(api).list(records.JOBS)
    assert len(entries) == 1
    same = await submit(api, make_job("train", gpus=1).document(), "k-reused")
    assert same.status == 202 and (await same.json())["id"] == first_id


async def test_racing_submits_of_two_bodies_with_one_key_make_one_job(
    api: TestClient[Any, Any],
) -> None:
    """Submits arriving together share a group commit: the lookup finds nothing for any of
    them, and the commit decides: one job, its body replayed, the other body refused."""
    small, large = make_job("race", gpus=1).document(), make_job("race", gpus=4).document()
    answers = await asyncio.gather(
        *[submit(api, small if i % 2 else large, "k-race") for i in range(8)]
    )
    [stored] = await job_ids(api)
    winner = await (await api.get(f"/v1/jobs/{stored}", headers=ADMIN)).json()
    won = small if winner["job"]["spec"]["tasks"] == small["spec"]["tasks"] else large
    for i, answer in enumerate(answers):
        body = await answer.json()
        if (small if i % 2 else large) is won:
            assert answer.status == 202 and body["id"] == stored
        else:
            assert answer.status == 422 and body["title"] == "idempotency-key-reused"


async def test_after_the_window_the_same_key_makes_a_new_job(start_api: Api) -> None:
    api = await start_api(idempotency_window_seconds=0.2)
    doc = make_job("daily", gpus=1).document()
    first = (await (await submit(api, doc, "k-daily")).json())["id"]
    await asyncio.sleep(0.3)
    later = await submit(api, make_job("daily", gpus=2).document(), "k-daily")
    assert later.status == 202 and "Idempotent-Replayed" not in later.headers
    second = (await later.json())["id"]
    assert second != first and await job_ids(api) == {first, second}
    replayed = await submit(api, make_job("daily", gpus=2).document(), "k-daily")
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert (await replayed.json())["id"] == second


async def test_an_entry_of_the_old_format_still_replays_whatever_the_body(
    start_api: Api,
) -> None:
    api = await start_api()
    first = (await (await submit(api, make_job("old", gpus=1).document(), "k-old")).json())["id"]
    key = records.idempotency_key("team-a", "k-old")
    await backing_of(api).put(key, first.encode())  # as brokers before digests wrote it
    await api.close()
    api = await start_api()  # and across a restart
    other = await submit(api, make_job("old", gpus=8).document(), "k-old")
    assert other.status == 202 and other.headers["Idempotent-Replayed"] == "true"
    assert (await other.json())["id"] == first
    assert await job_ids(api) == {first}


async def test_the_sweep_deletes_expired_keys_a_shard_and_a_batch_at_a_time() -> None:
    backing = await sqlite.SqliteStore.open(":memory:")
    job_book = book.JobBook(records.JobStore(backing), idempotency_window=0.2)
    try:
        made = [await job_book.create(new_record(f"k-{i}", tenant="team-a")) for i in range(3)]
        await backing.put(records.idempotency_key("team-a", "k-0"), made[0].id.encode())
        await backing.put(records.idempotency_key("team-a", "k-ghost"), b"no-such-job")
        assert await expiring.sweep_keys(job_book) == (0, False)  # nothing expired yet
        later = status.utcnow() + timedelta(seconds=0.3)  # the window (0.2 s) past
        shard_of = {
            i: records.idempotency_key("team-a", f"k-{i}").removeprefix(records.IDEMPOTENCY)[:2]
            for i in range(3)
        }
        other = next(s for s in expiring.SHARDS if s not in shard_of.values())
        assert await expiring.sweep_keys(job_book, shard=other, now=later) == (0, False), (
            "its own keys only"
        )
        one = [i for i in range(3) if shard_of[i] == shard_of[1]]
        swept = await expiring.sweep_keys(job_book, shard=shard_of[1], now=later)
        assert swept == (len(one), False)
        assert await job_book.store.find_idempotent("team-a", "k-1") is None
        again = await job_book.create(new_record("k-1", tenant="team-a"))  # the key anew
        later = status.utcnow() + timedelta(seconds=0.3)
        left = 4 - len(one)  # k-0 (old format), k-2 and the new k-1, less what went
        assert await expiring.sweep_keys(job_book, batch=left - 1, now=later) == (left - 1, True)
        assert await expiring.sweep_keys(job_book, batch=left - 1, now=later) == (1, False)
        entries = await job_book.store.list_idempotent()
        assert [e.job_id for e in entries] == ["no-such-job"], "a key of an unknown job is kept"
        assert {r.id for r in job_book} == {*(r.id for r in made), again.id}, "jobs untouched"
    finally:
        await backing.close()


class FlakyStore(store.Shortcuts):
    """A real store whose listings fail while `failing` (etcd down, as the sweep sees it)."""

    def __init__(self, inner: store.Store) -> None:
        self.inner = inner
        self.failing = 0

    async def get(self, key: str) -> store.Entry | None:
        return await self.inner.get(key)

    async def list(self, prefix: str) -> tuple[list[store.Entry], int]:
        if self.failing:
            self.failing -= 1
            raise errors.TemporaryStoreError("the store did not answer")
        return await self.inner.list(prefix)

    async def commit(self, txn: store.Txn) -> int:
        return await self.inner.commit(txn)

    def watch(self, prefix: str, *, start_revision: int) -> AsyncIterator[store.WatchEvent]:
        return self.inner.watch(prefix, start_revision=start_revision)

    async def close(self) -> None:
        await self.inner.close()


@pytest.mark.looptime  # its pauses and backoffs pass on the loop's fake time
async def test_the_sweeper_lives_through_store_errors() -> None:
    backing = FlakyStore(await sqlite.SqliteStore.open(":memory:"))
    job_book = book.JobBook(records.JobStore(backing), idempotency_window=0.05)
    record = new_record("k-flaky", tenant="team-a")
    await job_book.create(record)
    backing.failing = 3
    sweeping = asyncio.create_task(expiring.run_sweeper(job_book, interval=0.02))
    try:
        async with asyncio.timeout(10):  # a round over the 256 shards, at 10 ms a pass
            while (await backing.inner.list(records.IDEMPOTENCY))[0]:
                await asyncio.sleep(0.02)
        assert backing.failing == 0, "the key went only after the store answered again"
        assert not sweeping.done()
    finally:
        sweeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeping
        await backing.close()


def test_the_digest_is_of_the_job_not_of_its_spelling() -> None:
    minimal = make_job("d", gpus=2).build()
    spelt_out = jobs.GPUJob.model_validate(minimal.model_dump(mode="json", by_alias=True))
    assert records.body_digest(spelt_out) == records.body_digest(minimal)
    other = make_job("d", gpus=2).document()
    other["spec"]["priority"] = 1
    assert records.body_digest(jobs.GPUJob.model_validate(other)) != records.body_digest(minimal)


# ---- the key entries on both real stores --------------------------------------------------------


def new_record(
    key: str, *, tenant: str, gpus: int = 1, age: timedelta = timedelta()
) -> status.JobRecord:
    return status.JobRecord(
        id=f"idem-{uuid.uuid4().hex[:8]}",
        tenant=tenant,
        job=make_job("idem", gpus=gpus).build(),
        idempotency_key=key,
        created=status.utcnow() - age,
    )


@pytest.fixture(params=["sqlite", pytest.param("etcd", marks=pytest.mark.etcd)])
async def job_store(request: pytest.FixtureRequest) -> AsyncIterator[records.JobStore]:
    if request.param == "sqlite":
        backing: store.DurableStore = await sqlite.SqliteStore.open(":memory:")
    else:
        server: etcdserver.EtcdServer = request.getfixturevalue("etcd_server")
        backing = await opening.open_store(server.url)
    try:
        yield records.JobStore(backing)
    finally:
        await backing.close()


async def test_a_key_entry_holds_the_job_its_body_digest_and_when(
    job_store: records.JobStore,
) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"  # the etcd server is shared by the session
    record = new_record("k-1", tenant=tenant)
    await job_store.create([job_store.encode(record)])
    entry = await job_store.find_idempotent(tenant, "k-1")
    assert entry is not None and entry.job_id == record.id
    assert entry.digest == records.body_digest(record.job)
    assert entry.created == record.created
    assert await job_store.find_idempotent(tenant, "k-2") is None
    assert await job_store.find_idempotent(f"{tenant}-other", "k-1") is None
    with pytest.raises(errors.ConflictError):  # the key is taken: a second job is refused
        await job_store.create([job_store.encode(new_record("k-1", tenant=tenant))])


async def test_forgetting_a_key_keeps_one_used_again_meanwhile(
    job_store: records.JobStore,
) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    for key in ("k-a", "k-b"):
        await job_store.create([job_store.encode(new_record(key, tenant=tenant))])
    stale = [await job_store.find_idempotent(tenant, key) for key in ("k-a", "k-b")]
    assert None not in stale
    rewritten = records.idempotency_key(tenant, "k-b")
    await job_store.backing.put(rewritten, b"another-job")
    assert await job_store.forget_idempotent([e for e in stale if e is not None]) == 1
    assert await job_store.find_idempotent(tenant, "k-a") is None
    kept = await job_store.find_idempotent(tenant, "k-b")
    assert kept is not None and kept.job_id == "another-job" and kept.digest is None


async def test_the_book_refuses_another_body_and_replays_old_entries(
    job_store: records.JobStore,
) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    job_book = book.JobBook(job_store)
    first = await job_book.create(new_record("k", tenant=tenant, gpus=1))
    same = new_record("k", tenant=tenant, gpus=1)
    assert await job_book.find_idempotent(tenant, "k", same.job) is first
    assert await job_book.create(same) is first  # the commit's conflict answers the same
    other = new_record("k", tenant=tenant, gpus=4)
    with pytest.raises(api_errors.IdempotencyKeyReused):
        await job_book.find_idempotent(tenant, "k", other.job)
    with pytest.raises(api_errors.IdempotencyKeyReused):
        await job_book.create(other)
    assert await job_store.get(other.id) is None
    await job_store.backing.put(records.idempotency_key(tenant, "k"), first.id.encode())
    assert await job_book.find_idempotent(tenant, "k", other.job) is first  # body unknown: replay


async def test_a_key_counts_for_its_window_from_the_jobs_creation(
    job_store: records.JobStore,
) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    job_book = book.JobBook(job_store)
    two_days = timedelta(days=2)
    aged = await job_book.create(new_record("k-new", tenant=tenant, age=two_days))
    assert await job_book.find_idempotent(tenant, "k-new", aged.job) is None
    assert await job_store.find_idempotent(tenant, "k-new") is None, "forgotten on lookup"
    again = await job_book.create(new_record("k-new", tenant=tenant))
    assert again.id != aged.id
    old = await job_book.create(new_record("k-old", tenant=tenant, age=two_days))
    await job_store.backing.put(records.idempotency_key(tenant, "k-old"), old.id.encode())
    assert await job_book.find_idempotent(tenant, "k-old", old.job) is None, (
        "old format: by its job"
    )
