"""`POST /v1/jobs:batch` through the broker's HTTP API on real stores (SQLite, and etcd where
the store matters): one answer per item in request order, the valid items stored and the
others refused with the field named, keys replayed (across batches, within one, and with the
single route), whole-body problems storing nothing, the tenancy and queue checks per item, and
the accepted jobs written in as few store transactions as the bounds allow."""

from __future__ import annotations

import io
import json
import math
import re
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.api import submits
from broker.http import keys
from broker.state import records
from gpufed import client
from tests import conftest_etcd
from tests.builders import make_job

TEAM_A = {"Authorization": "Bearer dev-team-a"}
TEAM_B = {"Authorization": "Bearer dev-team-b"}
ADMIN = {"Authorization": "Bearer dev-admin"}
AGENT = {"Authorization": "Bearer dev-agent-h100"}
REPO = Path(__file__).resolve().parents[2]
GPUS = "spec.tasks[0].template.spec.containers[0].resources.limits[nvidia.com/gpu]"

Client = TestClient[Any, Any]
Start = Callable[..., Coroutine[Any, Any, Client]]


@pytest.fixture(params=["sqlite", pytest.param("etcd", marks=pytest.mark.etcd)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str] | Any:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'broker.db'}"
        return
    with conftest_etcd.own_etcd() as url:  # an etcd of its own: the broker's keys are fixed
        yield url


async def _started(settings: broker_app.BrokerSettings, into: list[Client]) -> Client:
    api = TestClient(TestServer(broker_app.create_app(settings)))
    await api.start_server()
    into.append(api)
    return api


@pytest.fixture
async def start_on(store_url: str) -> AsyncIterator[Start]:
    """A broker on each store (the test runs once per store)."""
    started: list[Client] = []

    async def start(**settings: Any) -> Client:
        tokens = REPO / "config" / "tokens.yaml"
        config = broker_app.BrokerSettings(store=store_url, tokens_file=tokens, **settings)
        return await _started(config, started)

    yield start
    for api in started:
        await api.close()


@pytest.fixture
async def start_api(tmp_path: Path) -> AsyncIterator[Start]:
    """A broker on SQLite (what the test checks does not depend on the store)."""
    started: list[Client] = []

    async def start(**settings: Any) -> Client:
        config = broker_app.BrokerSettings(
            store=f"sqlite:///{tmp_path / 'broker.db'}",
            tokens_file=settings.pop("tokens_file", REPO / "config" / "tokens.yaml"),
            **settings,
        )
        return await _started(config, started)

    yield start
    for api in started:
        await api.close()


@pytest.fixture
async def api(start_api: Start) -> Client:
    return await start_api()


async def batch(
    api: Client, body: Any, *, headers: dict[str, str] | None = None, as_yaml: bool = False
) -> Any:
    if isinstance(body, str | bytes):
        data = body.encode() if isinstance(body, str) else body
    else:
        data = (yaml.safe_dump(body) if as_yaml else json.dumps(body)).encode()
    sent = {**TEAM_A, **(headers or {})}
    if as_yaml:
        sent["Content-Type"] = "application/yaml"
    return await api.post("/v1/jobs:batch", data=io.BytesIO(data), headers=sent)


async def answered(api: Client, items: list[Any], **kw: Any) -> dict[str, Any]:
    response = await batch(api, {"items": items}, **kw)
    assert response.status == 200, await response.text()
    body: dict[str, Any] = await response.json()
    assert [a["index"] for a in body["items"]] == list(range(len(items))), "in request order"
    return body


def item(name: str, *, key: str | None = None, **job: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"job": make_job(name, **job).document()}
    if key is not None:
        entry["idempotencyKey"] = key
    return entry


async def stored_ids(api: Client) -> set[str]:
    listed = await (await api.get("/v1/jobs?limit=1000", headers=ADMIN)).json()
    return {job["id"] for job in listed["items"]}


async def metric(api: Client, name: str, **labels: str) -> float:
    text = await (await api.get("/metrics", headers=ADMIN)).text()
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(wanted)}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def creates(api: Client) -> float:
    """Store transactions that created jobs so far."""
    return await metric(api, "gpufed_store_operation_duration_seconds_count", op="create")


# ---- items answered one by one ----------------------------------------------------------------


def _unknown_field() -> dict[str, Any]:
    bad = item("bad")
    bad["job"]["spec"]["colour"] = "blue"
    return bad


async def test_a_mixed_batch_stores_the_valid_items_and_names_each_refusal(
    start_on: Start,
) -> None:
    api = await start_on()
    too_many_gpus = item("greedy", gpus=16)
    deep: Any = "x"
    for _ in range(40):
        deep = {"a": deep}
    too_deep = item("deep")
    too_deep["job"]["metadata"]["labels"] = deep
    items = [
        item("ok-0"),
        _unknown_field(),
        item("ok-2", key="k-2", gpus=2),
        "not an object",
        {"idempotencyKey": "k-4"},
        {"job": make_job("extra").document(), "priority": 3},
        item("bad-key", key=""),
        item("surrogate", key="k-\ud800"),
        too_many_gpus,
        too_deep,
        {"job": []},
        item("ok-11", key="k-11"),
    ]
    body = await answered(api, items)
    status = [a["status"] for a in body["items"]]
    assert status == [202, 422, 202, 422, 422, 422, 400, 400, 422, 400, 422, 202]
    fields = {a["index"]: a["problem"]["field"] for a in body["items"] if "problem" in a}
    assert fields == {
        1: "items[1].job.spec.colour",
        3: "items[3]",
        4: "items[4].job",
        5: "items[5].priority",
        6: "items[6].idempotencyKey",
        7: "items[7].idempotencyKey",
        8: f"items[8].job.{GPUS}",
        9: "items[9].job.metadata.labels" + ".a" * 31,
        10: "items[10].job",
    }
    first = body["items"][1]["problem"]
    assert first["detail"] == "items[1].job.spec.colour: unknown field"
    assert first["errors"] == [{"field": "items[1].job.spec.colour", "message": "unknown field"}]
    assert first["status"] == 422 and first["type"] == "about:blank"
    assert (body["accepted"], body["replayed"], body["failed"]) == (3, 0, 9)
    accepted = [a for a in body["items"] if a["status"] == 202]
    assert await stored_ids(api) == {a["id"] for a in accepted}, "nothing of the refused"
    for answer in accepted:
        assert answer["state"] == "Queued" and len(answer["traceId"]) == 32
        job = await (await api.get(f"/v1/jobs/{answer['id']}", headers=TEAM_A)).json()
        assert job["tenant"] == "team-a" and job["traceId"] == answer["traceId"]
    assert len({a["traceId"] for a in accepted}) == 3, "each job has a trace of its own"
    assert await metric(api, "gpufed_jobs_submitted_total", queue="default") == 3
    entries, _ = await api.app[keys.JOBS].book.store.backing.list(records.IDEMPOTENCY)
    assert len(entries) == 2, "the keys of the stored items only (k-2, k-11)"


async def test_yaml_bodies_are_read_as_json_ones(api: Client) -> None:
    body = await answered(api, [item("y-0"), item("y-1", key="k-y")], as_yaml=True)
    assert [a["status"] for a in body["items"]] == [202, 202]


# ---- idempotency keys -------------------------------------------------------------------------


async def test_keys_replay_across_batches_within_one_and_with_the_single_route(
    start_on: Start,
) -> None:
    api = await start_on()
    items = [item(f"r-{i}", key=f"k-{i}") for i in range(3)]
    first = await answered(api, items)
    assert [a["status"] for a in first["items"]] == [202, 202, 202]
    ids = [a["id"] for a in first["items"]]

    again = await answered(api, [items[2], items[0], items[1]])  # the batch retried, reordered
    assert [a["status"] for a in again["items"]] == [200, 200, 200]
    assert [a["id"] for a in again["items"]] == [ids[2], ids[0], ids[1]]
    assert (again["accepted"], again["replayed"]) == (0, 3)

    reused = await answered(api, [item("r-0", key="k-0", gpus=4), item("new", key="k-new")])
    problem = reused["items"][0]["problem"]
    assert reused["items"][0]["status"] == 422
    assert problem["type"] == "urn:gpufed:problem:idempotency-key-reused"
    assert problem["field"] == "items[0].idempotencyKey" and ids[0] in problem["detail"]
    assert reused["items"][1]["status"] == 202

    single = await api.post(
        "/v1/jobs",
        data=json.dumps(items[1]["job"]),
        headers={**TEAM_A, "Idempotency-Key": "k-1"},
    )
    assert single.status == 202 and single.headers["Idempotent-Replayed"] == "true"
    assert (await single.json())["id"] == ids[1], "a batch's key is the header's key"
    assert len(await stored_ids(api)) == 4
    assert await metric(api, "gpufed_jobs_submitted_total", queue="default") == 4


async def test_a_key_repeated_within_a_batch_is_decided_as_if_sent_after_the_first(
    start_on: Start,
) -> None:
    api = await start_on()
    body = await answered(
        api,
        [
            item("twin", key="k-twin"),
            item("twin", key="k-twin"),  # the same body: the first's job
            item("twin", key="k-twin", gpus=2),  # another body: refused
            item("huge", key="k-huge", gpus=16),  # refused: its key stays free
            item("fine", key="k-huge"),  # so this one makes a job
        ],
    )
    answers = body["items"]
    assert [a["status"] for a in answers] == [202, 200, 422, 422, 202]
    assert answers[1]["id"] == answers[0]["id"]
    assert answers[2]["problem"]["title"] == "idempotency-key-reused"
    assert answers[2]["problem"]["field"] == "items[2].idempotencyKey"
    assert await stored_ids(api) == {answers[0]["id"], answers[4]["id"]}


# ---- whole-body problems --------------------------------------------------------------------


def _items(count: int) -> dict[str, Any]:
    return {"items": [item(f"n-{i}") for i in range(count)]}


@pytest.mark.parametrize(
    ("body", "headers", "status", "field"),
    [
        pytest.param("{not json", {}, 400, None, id="not JSON"),
        pytest.param("", {}, 400, None, id="empty body"),
        pytest.param(b"\xff\xfe", {}, 400, None, id="not UTF-8"),
        pytest.param("[]", {}, 422, None, id="not an object"),
        pytest.param({}, {}, 422, "items", id="no items"),
        pytest.param({"items": {}}, {}, 422, "items", id="items not a list"),
        pytest.param({"items": []}, {}, 422, "items", id="no item"),
        pytest.param(_items(1001), {}, 422, "items", id="1001 items"),
        pytest.param({**_items(1), "dryRun": True}, {}, 422, "dryRun", id="unknown field"),
        pytest.param('{"items": [' + "9" * 30 + "]}", {}, 400, None, id="an integer of 30 digits"),
        pytest.param(
            {"items": [{"job": make_job("x").annotate("pad", "y" * 200_000).document()}] * 45},
            {},
            413,
            None,
            id="body over 8 MiB",
        ),
        pytest.param(_items(2), {"Idempotency-Key": "k"}, 400, "Idempotency-Key", id="header"),
    ],
)
async def test_a_body_that_is_not_a_batch_is_one_problem_and_stores_nothing(
    api: Client, body: Any, headers: dict[str, str], status: int, field: str | None
) -> None:
    response = await batch(api, body, headers=headers)
    assert response.status == status, await response.text()
    assert response.content_type == "application/problem+json"
    problem = await response.json()
    assert problem["status"] == status and problem["detail"]
    assert problem.get("field") == field
    assert await stored_ids(api) == set()


async def test_a_thousand_items_are_taken(api: Client) -> None:
    body = await answered(api, _items(submits.MAX_BATCH_ITEMS)["items"])
    assert body["accepted"] == 1000
    assert len(api.app[keys.JOBS]) == 1000


# ---- who may submit what --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        pytest.param({"Authorization": ""}, 401, id="missing token"),
        pytest.param({"Authorization": "Bearer nope"}, 401, id="unknown token"),
        pytest.param(AGENT, 403, id="agent token"),
        pytest.param(ADMIN, 403, id="admin does not submit as a tenant"),
    ],
)
async def test_tokens_are_checked_as_for_a_single_submit(
    api: Client, headers: dict[str, str], status: int
) -> None:
    response = await batch(api, _items(2), headers=headers)
    assert response.status == status
    assert await stored_ids(api) == set()


async def test_another_tenants_queue_is_refused_per_item(start_api: Start, tmp_path: Path) -> None:
    queues = {
        "queues": [
            {"name": "a-q", "tenant": "team-a", "weight": 1},
            {"name": "b-q", "tenant": "team-b", "weight": 1},
        ]
    }
    (tmp_path / "queues.yaml").write_text(yaml.safe_dump(queues))
    api = await start_api(queues_file=tmp_path / "queues.yaml")
    body = await answered(
        api,
        [
            item("mine", queue="a-q"),
            item("theirs", queue="b-q"),
            item("nobodys", queue="c-q"),
        ],
    )
    body_items = body["items"]
    assert [a["status"] for a in body_items] == [202, 403, 422]
    theirs = body_items[1]["problem"]
    assert theirs["field"] == "items[1].job.spec.queue"
    assert theirs["detail"] == "items[1].job.spec.queue: queue 'b-q' belongs to tenant team-b"
    assert body_items[2]["problem"]["field"] == "items[2].job.spec.queue"
    team_b = await batch(api, {"items": [item("theirs", queue="b-q")]}, headers=TEAM_B)
    assert (await team_b.json())["items"][0]["status"] == 202, "team-b's own queue"
    listed = await (await api.get("/v1/jobs", headers=TEAM_A)).json()
    assert {j["job"]["spec"]["queue"] for j in listed["items"]} == {"a-q"}


# ---- how it is stored -----------------------------------------------------------------------


async def test_a_batch_is_stored_in_as_few_transactions_as_a_transaction_carries(
    start_on: Start,
) -> None:
    api = await start_on()
    before = await creates(api)
    body = await answered(api, [item(f"small-{i}", key=f"k-{i}") for i in range(120)])
    assert body["accepted"] == 120
    made = await creates(api) - before
    assert made == math.ceil(120 / records.CREATE_BATCH), "one transaction per 50 jobs"
    assert len(await stored_ids(api)) == 120


async def test_a_batch_is_split_by_the_bytes_a_transaction_carries(start_on: Start) -> None:
    api = await start_on(max_request_bytes=80 * 1024)  # a transaction carries 64 KiB
    padded = [
        {"job": make_job(f"padded-{i}").annotate("pad", "p" * 20_000).document()} for i in range(9)
    ]
    too_large = {"job": make_job("too-large").annotate("pad", "p" * 100_000).document()}
    before = await creates(api)
    body = await answered(api, [*padded[:4], too_large, *padded[4:]])
    assert [a["status"] for a in body["items"]] == [202] * 4 + [413] + [202] * 5
    problem = body["items"][4]["problem"]
    assert problem["field"] == "items[4].job" and problem["title"] == "Job too large"
    assert await creates(api) - before == 3, "3 jobs of 20 KB per 64 KiB transaction"
    assert len(await stored_ids(api)) == 9


async def test_the_client_sends_a_batch(api: Client) -> None:
    url = str(api.make_url("")).rstrip("/")
    async with client.BrokerClient(url, "dev-team-a") as broker:
        answer = await broker.submit_batch([item("c-0"), item("c-1", key="k-c")])
    assert [a["status"] for a in answer["items"]] == [202, 202]
    assert client.BATCH_ITEMS == submits.MAX_BATCH_ITEMS
    assert client.BATCH_BYTES == submits.MAX_BATCH_BYTES
