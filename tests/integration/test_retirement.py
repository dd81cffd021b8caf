"""Finished jobs leave the hot store for history, through real broker apps (an SQLite store
with its SQLite history; two replicas on a real etcd sharing one history): still found by id
with their events, listed and paged with `continue` across live jobs and history, replayed by
their Idempotency-Key; a restart loads only what is live; history is pruned after its TTL."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.http import keys
from tests import etcdserver
from tests.builders import make_job

TEAM_A = {"Authorization": "Bearer dev-team-a"}
TEAM_B = {"Authorization": "Bearer dev-team-b"}
ADMIN = {"Authorization": "Bearer dev-admin"}
REPO = Path(__file__).resolve().parents[2]
Client = TestClient[Any, Any]


def settings_for(store: str, **extra: Any) -> broker_app.BrokerSettings:
    return broker_app.BrokerSettings(
        store=store, tokens_file=REPO / "config" / "tokens.yaml", **extra
    )


@contextlib.asynccontextmanager
async def running(settings: broker_app.BrokerSettings) -> AsyncIterator[Client]:
    client = TestClient(TestServer(broker_app.create_app(settings)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def submit(api: Client, name: str, key: str) -> str:
    body = io.BytesIO(json.dumps(make_job(name).document()).encode())
    response = await api.post("/v1/jobs", data=body, headers={**TEAM_A, "Idempotency-Key": key})
    assert response.status in (200, 202), await response.text()
    return str((await response.json())["id"])


async def until(check: Callable[[], bool], *, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def held(api: Client) -> set[str]:
    """The jobs the replica holds in its book (memory; the hot store's copy)."""
    return {record.id for record in api.app[keys.JOBS]}


async def pages(api: Client, query: str, limit: int) -> list[list[str]]:
    out: list[list[str]] = []
    cont = ""
    while True:
        url = f"/v1/jobs?limit={limit}{query}" + (f"&continue={cont}" if cont else "")
        body = await (await api.get(url, headers=ADMIN)).json()
        out.append([item["id"] for item in body["items"]])
        cont = body["metadata"].get("continue") or ""
        if not cont:
            return out


async def test_a_finished_job_moves_to_history_and_is_found_listed_and_replayed(
    tmp_path: Path,
) -> None:
    settings = settings_for(f"sqlite:///{tmp_path / 'broker.db'}", retain_finished_seconds=0.2)
    async with running(settings) as api:
        live = await submit(api, "live", "k-live")
        done = [await submit(api, f"done-{i}", f"k-done-{i}") for i in range(3)]
        for job_id in done:
            assert (await api.delete(f"/v1/jobs/{job_id}", headers=TEAM_A)).status == 202
        await until(lambda: held(api) == {live})  # retired: out of memory and the store

        got = await api.get(f"/v1/jobs/{done[0]}", headers=TEAM_A)
        assert got.status == 200
        record = await got.json()
        assert record["status"]["state"] == "Cancelled"
        assert [e["state"] for e in record["status"]["events"]][-1] == "Cancelled"
        assert (await api.get(f"/v1/jobs/{done[0]}", headers=TEAM_B)).status == 404

        # a list over both, a page at a time: live first, then the newest finished
        paged = await pages(api, "", limit=1)
        assert [ids for page in paged for ids in page] == [live, *reversed(done)]
        assert all(len(page) == 1 for page in paged)
        cancelled = await pages(api, "&state=Cancelled", limit=2)
        assert sorted(i for page in cancelled for i in page) == sorted(done)
        bad = await api.get("/v1/jobs?limit=1&continue=not-a-token", headers=ADMIN)
        assert bad.status == 400 and "continue" in (await bad.json())["detail"]

        # the key still replays its job, from history
        assert await submit(api, "done-1", "k-done-1") == done[1]

    async with running(settings) as again:  # a restart lists only what is live
        assert held(again) == {live}
        assert len(await pages(again, "", limit=1000)) == 1
        listed = (await pages(again, "", limit=1000))[0]
        assert listed == [live, *reversed(done)]


async def test_a_list_searches_and_sorts_over_live_jobs_and_history(tmp_path: Path) -> None:
    settings = settings_for(f"sqlite:///{tmp_path / 'broker.db'}", retain_finished_seconds=0.2)
    async with running(settings) as api:
        live = [await submit(api, name, f"k-{name}") for name in ("sweep-live", "other-live")]
        done = [await submit(api, f"sweep-{i}", f"k-done-{i}") for i in range(3)]
        for job_id in done:
            assert (await api.delete(f"/v1/jobs/{job_id}", headers=TEAM_A)).status == 202
        await until(lambda: held(api) == set(live))

        found = await pages(api, "&q=SWEEP", limit=1)
        assert [i for page in found for i in page] == [live[0], *reversed(done)]
        oldest = await pages(api, "&q=sweep&sort=oldest", limit=2)
        assert [i for page in oldest for i in page] == [*done, live[0]]
        assert await pages(api, "&q=nothing-like-it", limit=5) == [[]]
        first = await (await api.get("/v1/jobs?limit=1&q=sweep", headers=ADMIN)).json()
        other = await api.get(  # a token is good for its own text and order only
            f"/v1/jobs?limit=1&q=sweep&sort=oldest&continue={first['metadata']['continue']}",
            headers=ADMIN,
        )
        assert other.status == 400 and "continue" in (await other.json())["detail"]
        for query, field in [("sort=gpus", "sort"), ("q=" + "x" * 201, "q")]:
            bad = await api.get(f"/v1/jobs?{query}", headers=ADMIN)
            assert bad.status == 400
            assert (await bad.json())["detail"].startswith(f"{field}: ")


async def test_history_is_pruned_after_its_ttl(tmp_path: Path) -> None:
    settings = settings_for(
        f"sqlite:///{tmp_path / 'broker.db'}",
        retain_finished_seconds=0.1,
        history_ttl_seconds=1.0,
    )
    async with running(settings) as api:
        job_id = await submit(api, "short-lived", "k-1")
        await api.delete(f"/v1/jobs/{job_id}", headers=TEAM_A)
        await until(lambda: not held(api))
        assert (await api.get(f"/v1/jobs/{job_id}", headers=TEAM_A)).status == 200
        deadline = time.monotonic() + 10
        while (await api.get(f"/v1/jobs/{job_id}", headers=TEAM_A)).status == 200:
            assert time.monotonic() < deadline, "never pruned"
            await asyncio.sleep(0.1)
        assert (await api.get(f"/v1/jobs/{job_id}", headers=TEAM_A)).status == 404


async def test_without_a_history_finished_jobs_stay(tmp_path: Path) -> None:
    settings = settings_for(
        f"sqlite:///{tmp_path / 'broker.db'}", history="none", retain_finished_seconds=0.0
    )
    async with running(settings) as api:
        job_id = await submit(api, "stays", "k-1")
        await api.delete(f"/v1/jobs/{job_id}", headers=TEAM_A)
        await asyncio.sleep(1.0)  # two passes of retirement, had there been a history
        assert held(api) == {job_id}
        assert not (tmp_path / "history.db").exists()


@pytest.mark.etcd
async def test_replicas_on_etcd_share_one_history_and_forget_what_the_leader_retired(
    tmp_path: Path,
) -> None:
    try:
        server = etcdserver.EtcdServer.start()
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start etcd: {exc}", pytrace=False)
    shared = f"sqlite:///{tmp_path / 'history.db'}"
    try:
        replicas = [
            settings_for(
                server.url,
                history=shared,
                retain_finished_seconds=0.2,
                replica_id=f"r{i}",
                advertise_url=f"http://r{i}.test",
                leader_lease_seconds=2,
            )
            for i in range(2)
        ]
        async with running(replicas[0]) as first, running(replicas[1]) as second:
            job_id = await submit(second, "on-a-follower", "k-1")
            await until(lambda: job_id in held(first) and job_id in held(second))
            assert (await second.delete(f"/v1/jobs/{job_id}", headers=TEAM_A)).status == 202
            await until(lambda: job_id not in held(first) and job_id not in held(second))
            for api in (first, second):
                got = await api.get(f"/v1/jobs/{job_id}", headers=TEAM_A)
                assert got.status == 200
                assert (await got.json())["status"]["state"] == "Cancelled"
    finally:
        server.cleanup()
