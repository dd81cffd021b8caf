"""Queue modes and the queues API made robust, through the broker's HTTP API on a real SQLite
store: open mode stays open after a PUT, declared mode refuses undeclared queues, DELETE of
empty, busy, unknown and file queues, a PUT that fails stores nothing, and a stored job whose
queue name is not a DNS label (accepted before names were checked) breaks no listing and is
still scheduled."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.api import status
from broker.state import records, sqlite
from gpufed import cli
from tests.builders import make_job
from tests.integration.test_queues_api import FakeAgent, clusters_ready, eventually, in_state

H100 = "NVIDIA-H100-80GB-HBM3"
ADMIN = {"Authorization": "Bearer admin-token"}
FILE_QUEUES = {
    "queues": [
        {"name": "a-q", "tenant": "team-a", "weight": 1, "quotas": {H100: {"limit": 16}}},
    ],
}

Start = Callable[..., Coroutine[Any, Any, TestClient[Any, Any]]]


def tenant(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}-token"}


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    tokens = [{"token": f"{t}-token", "tenant": t} for t in ("team-a", "team-b")]
    tokens += [{"token": "admin-token", "admin": True}, {"token": "agent-token", "agent": "c1"}]
    (tmp_path / "tokens.yaml").write_text(yaml.safe_dump({"tokens": tokens}))
    (tmp_path / "queues.yaml").write_text(yaml.safe_dump(FILE_QUEUES))
    started: list[TestClient[Any, Any]] = []

    async def start_broker(*, with_file: bool = False, **settings: Any) -> TestClient[Any, Any]:
        config = broker_app.BrokerSettings(
            store=f"sqlite:///{tmp_path / 'broker.db'}",
            tokens_file=tmp_path / "tokens.yaml",
            queues_file=tmp_path / "queues.yaml" if with_file else None,
            **settings,
        )
        client = TestClient(TestServer(broker_app.create_app(config)))
        await client.start_server()
        started.append(client)
        return client

    yield start_broker
    for client in started:
        await client.close()


async def submit(api: TestClient[Any, Any], team: str, queue: str, gpus: int = 1) -> Any:
    doc = make_job("j", gpus=gpus, queue=queue).document()
    return await api.post(
        "/v1/jobs", data=io.BytesIO(json.dumps(doc).encode()), headers=tenant(team)
    )


async def put(api: TestClient[Any, Any], name: str, spec: dict[str, Any]) -> Any:
    return await api.put(f"/v1/queues/{name}", data=json.dumps(spec), headers=ADMIN)


async def listing(api: TestClient[Any, Any]) -> dict[str, Any]:
    response = await api.get("/v1/queues", headers=ADMIN)
    assert response.status == 200, await response.text()
    return dict(await response.json())


def names(body: dict[str, Any]) -> list[str]:
    return [q["name"] for q in body["items"]]


async def store_job_in(path: Path, queue: str) -> str:
    """A Queued job of team-a in `queue`, written as brokers before queue names were checked
    did (the record's bytes, with the name swapped in after validation)."""
    record = status.JobRecord(
        id="legacy-job-0001", tenant="team-a", job=make_job("legacy", queue="x").build()
    )
    record.record(status.JobState.QUEUED, "Submitted", "accepted by the broker")
    value = records.encode(record).replace(b'"queue":"x"', f'"queue":"{queue}"'.encode())
    assert f'"queue":"{queue}"'.encode() in value
    backing = await sqlite.SqliteStore.open(str(path))
    try:
        await backing.put(records.job_key(record.id), value)
    finally:
        await backing.close()
    return record.id


# ---- open mode ----------------------------------------------------------------------------------


async def test_open_mode_a_put_declares_one_queue_and_locks_no_other(start: Start) -> None:
    api = await start()
    assert (await listing(api))["mode"] == "open"
    created = await put(api, "a-q", {"tenant": "team-a", "weight": 2})
    assert created.status == 201
    assert (await created.json())["source"] == "api"
    assert (await submit(api, "team-a", "anything")).status == 202, "undeclared: still open"
    assert (await submit(api, "team-b", "b-other")).status == 202
    assert (await submit(api, "team-a", "a-q")).status == 202
    foreign = await submit(api, "team-b", "a-q")
    assert foreign.status == 403 and (await foreign.json())["field"] == "spec.queue"
    body = await listing(api)
    assert names(body) == ["a-q", "anything", "b-other"]
    assert [q["declared"] for q in body["items"]] == [True, False, False]
    assert body["warnings"] == [], "undeclared queues are normal in open mode"


async def test_declared_mode_refuses_an_undeclared_queue_until_it_is_put(start: Start) -> None:
    api = await start(queue_mode="declared")  # no file: queues come from the API alone
    assert (await listing(api))["mode"] == "declared"
    refused = await submit(api, "team-a", "a-new")
    assert refused.status == 422 and (await refused.json())["field"] == "spec.queue"
    assert (await put(api, "a-new", {"tenant": "team-a"})).status == 201
    assert (await submit(api, "team-a", "a-new")).status == 202


async def test_a_queues_file_means_declared_unless_told_open(start: Start) -> None:
    declared = await start(with_file=True)
    assert (await submit(declared, "team-a", "elsewhere")).status == 422
    await declared.close()
    opened = await start(with_file=True, queue_mode="open")
    assert (await submit(opened, "team-a", "elsewhere")).status == 202
    assert (await submit(opened, "team-b", "a-q")).status == 403


# ---- DELETE -------------------------------------------------------------------------------------


async def test_delete_an_empty_queue_then_it_is_gone(start: Start) -> None:
    api = await start(queue_mode="declared")
    assert (await put(api, "a-tmp", {"tenant": "team-a"})).status == 201
    deleted = await api.delete("/v1/queues/a-tmp", headers=ADMIN)
    assert deleted.status == 204
    assert (await api.get("/v1/queues/a-tmp", headers=ADMIN)).status == 404
    assert "a-tmp" not in names(await listing(api))
    assert (await submit(api, "team-a", "a-tmp")).status == 422
    await api.close()
    restarted = await start(queue_mode="declared")
    assert "a-tmp" not in names(await listing(restarted)), "deleted in the store too"


async def test_delete_a_queue_with_jobs_is_409_naming_them(start: Start) -> None:
    api = await start()
    assert (await put(api, "a-busy", {"tenant": "team-a"})).status == 201
    ids = [(await (await submit(api, "team-a", "a-busy")).json())["id"] for _ in range(2)]
    refused = await api.delete("/v1/queues/a-busy", headers=ADMIN)
    assert refused.status == 409
    problem = await refused.json()
    assert "2 unfinished jobs (2 Queued)" in problem["detail"], problem
    assert "a-busy" in names(await listing(api))
    for job_id in ids:
        assert (await api.delete(f"/v1/jobs/{job_id}", headers=tenant("team-a"))).status == 202
    assert (await api.delete("/v1/queues/a-busy", headers=ADMIN)).status == 204


async def test_delete_unknown_or_file_queue(start: Start) -> None:
    api = await start(with_file=True)
    missing = await api.delete("/v1/queues/nope", headers=ADMIN)
    assert missing.status == 404
    from_file = await api.delete("/v1/queues/a-q", headers=ADMIN)
    assert from_file.status == 409 and "queues file" in (await from_file.json())["detail"]
    assert (await put(api, "a-q", {"tenant": "team-a", "weight": 5})).status == 200
    queue = await (await api.get("/v1/queues/a-q", headers=ADMIN)).json()
    assert queue["source"] == "file+api" and queue["spec"]["weight"] == 5
    reverted = await api.delete("/v1/queues/a-q", headers=ADMIN)
    assert reverted.status == 200
    body = await reverted.json()
    assert body["source"] == "file" and body["spec"]["weight"] == 1, "the file's queue again"
    assert (await api.delete("/v1/queues/a-q", headers=ADMIN)).status == 409
    denied = await api.delete("/v1/queues/a-q", headers=tenant("team-a"))
    assert denied.status == 403


# ---- a PUT that fails stores nothing; bad stored queue names break nothing ---------------------


@pytest.mark.parametrize(
    ("name", "spec", "field"),
    [
        pytest.param("Team_A", {"tenant": "team-a"}, "name", id="name not a DNS label"),
        pytest.param("q1", {"tenant": "team-a", "weight": -1}, "weight", id="bad weight"),
        pytest.param(
            "q1", {"tenant": "team-a", "priorityClass": "gold"}, "priorityClass", id="no class"
        ),
    ],
)
async def test_put_that_fails_stores_nothing(
    start: Start, tmp_path: Path, name: str, spec: dict[str, Any], field: str
) -> None:
    await store_job_in(tmp_path / "broker.db", "Team_A")
    api = await start()
    response = await put(api, name, spec)
    assert response.status == 422 and (await response.json())["field"] == field
    assert names(await listing(api)) == ["Team_A"], "only the queue of the stored job"
    await api.close()
    restarted = await start()
    assert names(await listing(restarted)) == ["Team_A"], "nothing in the store either"


async def test_a_stored_job_with_a_bad_queue_name_breaks_no_listing_nor_put(
    start: Start, tmp_path: Path
) -> None:
    await store_job_in(tmp_path / "broker.db", "Team_A")
    api = await start()
    body = await listing(api)
    [legacy] = body["items"]
    assert legacy["name"] == "Team_A" and legacy["declared"] is False
    assert legacy["status"]["pendingJobs"] == 1
    assert (await api.get("/v1/queues/Team_A", headers=ADMIN)).status == 200
    created = await put(api, "ok", {"tenant": "team-a"})
    assert created.status == 201, await created.text()
    assert names(await listing(api)) == ["Team_A", "ok"]


async def test_declared_mode_reports_and_still_schedules_jobs_of_undeclared_queues(
    start: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = await store_job_in(tmp_path / "broker.db", "Team_A")
    with caplog.at_level(logging.WARNING, logger="broker.state.registry"):
        api = await start(with_file=True)
    assert any(
        "1 unfinished jobs name 1 undeclared queues (Team_A: 1)" in m for m in caplog.messages
    )
    body = await listing(api)
    assert body["mode"] == "declared"
    legacy = next(q for q in body["items"] if q["name"] == "Team_A")
    [warning] = legacy["warnings"]
    assert "not declared" in warning and "not a DNS label" in warning
    assert warning in body["warnings"]
    agent = FakeAgent(api)
    await agent.start()
    try:
        await eventually(api, lambda: clusters_ready(api))
        await eventually(api, in_state(api, job_id, "Running"))
    finally:
        await agent.stop()


async def test_gpufed_queues_delete(start: Start, capsys: pytest.CaptureFixture[str]) -> None:
    api = await start()
    assert (await put(api, "a-tmp", {"tenant": "team-a"})).status == 201
    url = str(api.make_url("/")).rstrip("/")

    async def run(*argv: str) -> int:
        args = cli.build_parser().parse_args([*argv, "--broker", url, "--token", "admin-token"])
        return await cli._user_command(args)

    assert await run("queues", "delete", "a-tmp") == 0
    assert "queue a-tmp deleted" in capsys.readouterr().out
    assert await run("queues", "delete", "a-tmp") == 1
    assert "no queue 'a-tmp'" in capsys.readouterr().err
    assert await run("queues", "a-tmp", "delete") == 2, "NAME then delete: refused"
