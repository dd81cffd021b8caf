"""A dispatch whose commit the store refuses changes nothing in the broker's memory, and the
same jobs dispatch once the store is back: on SQLite (a failure injected under the real store)
and on a real etcd that is stopped and started again."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from broker.api import errors as errors_api
from broker.api import messages, status
from broker.jobs import fleet, scheduling, service
from broker.state import errors, opening, records, sqlite, store
from broker.telemetry import metrics
from tests import etcdserver, fakes
from tests.builders import make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"
JOBS = 6
State = status.JobState


class FailingStore:
    """A real SQLite store whose writes and reads fail while `failing` (the disk went away)."""

    def __init__(self, inner: sqlite.SqliteStore) -> None:
        self.inner = inner
        self.failing = False

    def _check(self) -> None:
        if self.failing:
            raise errors.TemporaryStoreError("injected: the store does not answer")

    async def get(self, key: str) -> store.Entry | None:
        self._check()
        return await self.inner.get(key)

    async def list(self, prefix: str) -> tuple[list[store.Entry], int]:
        self._check()
        return await self.inner.list(prefix)

    async def commit(self, txn: store.Txn) -> int:
        self._check()
        return await self.inner.commit(txn)

    async def put(self, key: str, value: bytes) -> int:
        return await self.commit(store.Txn(puts=[(key, value)]))

    async def delete(self, key: str) -> int:
        return await self.commit(store.Txn(deletes=[key]))

    def watch(self, prefix: str, *, start_revision: int) -> AsyncIterator[store.WatchEvent]:
        return self.inner.watch(prefix, start_revision=start_revision)

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class Backend:
    store: store.Store
    outage: Callable[[], contextlib.AbstractAsyncContextManager[None]]


@pytest.fixture(params=["sqlite", pytest.param("etcd", marks=pytest.mark.etcd)])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "sqlite":
        failing = FailingStore(await sqlite.SqliteStore.open(":memory:"))

        @contextlib.asynccontextmanager
        async def injected() -> AsyncIterator[None]:
            failing.failing = True
            try:
                yield
            finally:
                failing.failing = False

        yield Backend(failing, injected)
        await failing.close()
        return
    server: etcdserver.EtcdServer = request.getfixturevalue("etcd_server")
    kv = await opening.open_store(server.url)

    @contextlib.asynccontextmanager
    async def stopped() -> AsyncIterator[None]:
        await asyncio.to_thread(server.stop)
        try:
            yield
        finally:
            await asyncio.to_thread(server.launch)
            for _ in range(100):  # the client reconnects on its own backoff: wait for it
                try:
                    await kv.get("/probe")
                    break
                except errors.TemporaryStoreError:
                    await asyncio.sleep(0.1)

    try:
        yield Backend(kv, stopped)
    finally:
        await kv.close()


@dataclass
class Broker:
    jobs: service.Jobs
    job_store: records.JobStore
    scheduler: scheduling.Scheduler
    cluster: fleet.Cluster
    link: fakes.RecordingLink
    ids: list[str]


@pytest.fixture
async def broker(backend: Backend) -> Broker:
    job_store = records.JobStore(backend.store)
    clusters = fleet.Fleet()
    meters = metrics.BrokerMetrics()
    jobs = service.Jobs(job_store, clusters, meters=meters)
    scheduler = scheduling.Scheduler(
        jobs.book,
        clusters,
        dispatcher=jobs.dispatcher,
        accounts=jobs.accounts,
        victims=jobs.victims,
        meters=meters,
    )
    link = fakes.RecordingLink()
    cluster = await clusters.attach("east", link, epoch=1)
    summary = make_summary("east", make_model_summary(H100, nodes_by_free=[0] * 8 + [JOBS]))
    cluster.apply_summary(messages.Summary(summary=summary, full=True))
    run = secrets.token_hex(4)  # the etcd server is shared by the session: ids of our own
    ids = []
    for i in range(JOBS):
        job = make_job(f"gang{i}", gpus=8).model(H100).build()
        stored = await jobs.submit(status.JobRecord(id=f"{run}-{i}", tenant="team-a", job=job))
        ids.append(stored.id)
    return Broker(jobs, job_store, scheduler, cluster, link, ids)


def record_of(b: Broker, job_id: str) -> status.JobRecord:
    record = b.jobs.get(job_id)
    assert record is not None
    return record


async def assert_memory_is_the_store(b: Broker) -> None:
    for job_id in b.ids:
        stored = await b.job_store.get(job_id)
        assert stored is not None
        assert b.jobs.get(job_id) == stored.record, job_id


async def test_a_failed_dispatch_commit_leaves_memory_as_the_store_has_it(
    backend: Backend, broker: Broker
) -> None:
    async with backend.outage():
        assert await broker.scheduler.run_cycle() == 0
        # nothing is believed dispatched: no state, no GPUs taken, no offer in flight or sent
        assert [record_of(broker, i).status.state for i in broker.ids] == [State.QUEUED] * JOBS
        assert all(record_of(broker, i).status.attempts == 0 for i in broker.ids)
        assert broker.cluster.inflight == {}
        assert broker.link.offers == []
        assert not any(broker.jobs.usage().gpus.get("default", {}).values())
        assert {p.job_id for p in broker.jobs.pending()} >= set(broker.ids)
        assert broker.scheduler.commit_failures == 1

    await assert_memory_is_the_store(broker)
    # the store is back: the same jobs are planned again and dispatched, once each
    for _ in range(50):
        await broker.scheduler.run_cycle()
        if len(broker.link.offers) >= JOBS:
            break
        await asyncio.sleep(0.1)
    assert sorted(o.job_id for o in broker.link.offers) == sorted(broker.ids)
    assert [o.attempt for o in broker.link.offers] == [1] * JOBS
    assert [record_of(broker, i).status.state for i in broker.ids] == [State.DISPATCHED] * JOBS
    assert broker.scheduler.commit_failures == 0
    assert set(broker.cluster.inflight) == set(broker.ids)
    await assert_memory_is_the_store(broker)


async def test_a_queued_job_with_a_write_pending_is_dispatched_once_it_is_written(
    broker: Broker,
) -> None:
    """The dispatch drafts only jobs as the store has them (`JobBook.settled`): a job with a
    change waiting for the group commit waits for the next cycle, the others go now."""
    book = broker.jobs.book
    waiting = broker.ids[0]
    draft = book.draft(waiting)
    assert draft is not None
    draft.record(State.QUEUED, "Noted", "a change waiting for the group commit")
    book.commit_soon(draft)
    assert not book.settled(waiting)
    await broker.scheduler.run_cycle()
    offered = {o.job_id for o in broker.link.offers}
    assert offered == set(broker.ids[1:])
    assert record_of(broker, waiting).status.state == State.QUEUED
    await book.flush()
    assert book.settled(waiting)
    for _ in range(20):
        await broker.scheduler.run_cycle()
        if len(broker.link.offers) >= JOBS:
            break
    assert sorted(o.job_id for o in broker.link.offers) == sorted(broker.ids)
    dispatched = record_of(broker, waiting)
    assert dispatched.status.state == State.DISPATCHED
    # the dispatch built on the change once written
    assert [e.reason for e in dispatched.status.events][-2:] == ["Noted", "Dispatched"]
    await assert_memory_is_the_store(broker)


@pytest.mark.parametrize(
    ("jobs", "annotation_kib"),
    [
        pytest.param(4, 900, id="4 jobs of 900 KiB"),
        pytest.param(100, 24, id="100 jobs of 24 KiB"),
    ],
)
async def test_dispatch_commits_are_split_to_fit_the_store_request_limit(
    backend: Backend, jobs: int, annotation_kib: int
) -> None:
    """Together far over etcd's default 1.5 MiB request limit, each within it: every job is
    stored and dispatched, and what the store holds is what the broker believes."""
    job_store = records.JobStore(backend.store)
    clusters = fleet.Fleet()
    meters = metrics.BrokerMetrics()
    book = service.Jobs(job_store, clusters, meters=meters)
    scheduler = scheduling.Scheduler(
        book.book,
        clusters,
        dispatcher=book.dispatcher,
        accounts=book.accounts,
        victims=book.victims,
        meters=meters,
    )
    link = fakes.RecordingLink()
    cluster = await clusters.attach("east", link, epoch=1)
    summary = make_summary("east", make_model_summary(H100, nodes_by_free=[0] * 8 + [jobs]))
    cluster.apply_summary(messages.Summary(summary=summary, full=True))
    run = secrets.token_hex(4)
    payload = "x" * (annotation_kib * 1024)
    ids = []
    for i in range(jobs):
        job = make_job(f"big{i}", gpus=8).model(H100).annotate("notes", payload).build()
        stored = await book.submit(status.JobRecord(id=f"{run}-big-{i}", tenant="team-a", job=job))
        ids.append(stored.id)
    for _ in range(20):
        await scheduler.run_cycle()
        if len(link.offers) >= jobs:
            break
    assert sorted(o.job_id for o in link.offers) == sorted(ids)
    assert scheduler.commit_failures == 0
    for job_id in ids:
        stored_now = await job_store.get(job_id)
        assert stored_now is not None
        assert stored_now.record.status.state == State.DISPATCHED
        assert book.get(job_id) == stored_now.record


async def test_a_job_no_transaction_could_carry_is_refused_before_it_is_stored(
    backend: Backend,
) -> None:
    job_store = records.JobStore(backend.store, max_request_bytes=256 * 1024)
    book = service.Jobs(job_store, fleet.Fleet(), meters=metrics.BrokerMetrics())
    job = make_job("huge", gpus=1).annotate("notes", "x" * 300 * 1024).build()
    job_id = f"{secrets.token_hex(4)}-huge"
    with pytest.raises(errors_api.TooLarge, match="max-request-bytes"):
        await book.submit(status.JobRecord(id=job_id, tenant="team-a", job=job))
    assert await job_store.get(job_id) is None
    assert book.get(job_id) is None
