"""`spec.dependsOn` and `spec.array` through the broker's HTTP API (a real aiohttp server on
SQLite, its leader tasks running): jobs that wait and why, the cycle refused, an array's jobs,
its bound values refused, and cancel and list over a whole array or one index."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.api import status
from broker.api.dependencies import Resolved
from broker.http import keys
from tests.builders import make_job

TEAM_A = {"Authorization": "Bearer dev-team-a"}
TEAM_B = {"Authorization": "Bearer dev-team-b"}
ADMIN = {"Authorization": "Bearer dev-admin"}
REPO = Path(__file__).resolve().parents[2]

Client = TestClient[Any, Any]


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Client]:
    settings = broker_app.BrokerSettings(
        store=f"sqlite:///{tmp_path / 'broker.db'}",
        tokens_file=REPO / "config" / "tokens.yaml",
    )
    client = TestClient(TestServer(broker_app.create_app(settings)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


def job(name: str, **spec: Any) -> dict[str, Any]:
    document = make_job(name, gpus=1).document()
    document["spec"].update(spec)
    return document


async def submit(api: Client, doc: Any, headers: dict[str, str] | None = None) -> Any:
    body = io.BytesIO(json.dumps(doc).encode())
    return await api.post("/v1/jobs", data=body, headers={**TEAM_A, **(headers or {})})


async def submitted(api: Client, doc: Any, headers: dict[str, str] | None = None) -> Any:
    response = await submit(api, doc, headers)
    assert response.status == 202, await response.text()
    return await response.json()


async def get(api: Client, job_id: str) -> Any:
    response = await api.get(f"/v1/jobs/{job_id}", headers=TEAM_A)
    assert response.status == 200
    return await response.json()


async def until_state(api: Client, job_id: str, state: str) -> Any:
    for _ in range(200):
        record = await get(api, job_id)
        if record["status"]["state"] == state:
            return record
        await asyncio.sleep(0.02)
    raise AssertionError(f"{job_id} stayed {record['status']['state']}, not {state}")


async def all_jobs(api: Client, selector: str | None = None) -> list[Any]:
    query = f"?labelSelector={selector}" if selector else ""
    response = await api.get(f"/v1/jobs{query}", headers=ADMIN)
    return list((await response.json())["items"])


# ---- dependencies -------------------------------------------------------------------------


async def test_a_dependent_job_waits_and_why_names_its_dependency(api: Client) -> None:
    first = await submitted(api, job("prep"))
    second = await submitted(api, job("train", dependsOn=[{"job": "prep"}]))
    assert second["state"] == "Waiting"
    record = await get(api, second["id"])
    assert record["status"]["dependencies"] == [
        {"job": "prep", "condition": "Succeeded", "ids": [first["id"]]}
    ]
    why = await (await api.get(f"/v1/jobs/{second['id']}/why", headers=TEAM_A)).json()
    assert why["state"] == "Waiting" and why["placed"] is False
    assert [r["code"] for r in why["reasons"]] == ["Dependency"]
    assert f"job {first['id']} (Queued) to succeed" in why["message"]
    await asyncio.sleep(0.2)  # the leader's task has decided it by now: it still waits
    assert (await get(api, second["id"]))["status"]["state"] == "Waiting"
    registry = api.server.app[keys.JOBS].meters.registry
    assert registry.get_sample_value("gpufed_waiting_jobs") == 1
    await api.delete(f"/v1/jobs/{second['id']}", headers=TEAM_A)
    assert registry.get_sample_value("gpufed_waiting_jobs") == 0


async def test_a_dependency_cancelled_fails_the_dependent(api: Client) -> None:
    first = await submitted(api, job("prep"))
    second = await submitted(api, job("train", dependsOn=[{"job": first["id"]}]))
    third = await submitted(api, job("eval", dependsOn=[{"job": "train"}]))
    await api.delete(f"/v1/jobs/{first['id']}", headers=TEAM_A)
    failed = await until_state(api, second["id"], "Failed")
    last = failed["status"]["events"][-1]
    assert last["reason"] == "DependencyFailed" and "ended Cancelled" in last["message"]
    # and what waited for it fails in turn
    chained = await until_state(api, third["id"], "Failed")
    assert chained["status"]["events"][-1]["reason"] == "DependencyFailed"


async def test_condition_finished_queues_after_any_end(api: Client) -> None:
    first = await submitted(api, job("prep"))
    cleanup = job("cleanup", dependsOn=[{"job": "prep", "condition": "Finished"}])
    second = await submitted(api, cleanup)
    await api.delete(f"/v1/jobs/{first['id']}", headers=TEAM_A)
    queued = await until_state(api, second["id"], "Queued")
    assert queued["status"]["events"][-1]["reason"] == "DependenciesMet"


async def test_a_dependency_on_no_job_fails_at_once(api: Client) -> None:
    second = await submitted(api, job("train", dependsOn=[{"job": "nothing-by-this-name"}]))
    failed = await until_state(api, second["id"], "Failed")
    assert "no such job" in failed["status"]["events"][-1]["message"]


async def test_another_tenants_job_is_not_found(api: Client) -> None:
    body = io.BytesIO(json.dumps(job("theirs")).encode())
    theirs = await (await api.post("/v1/jobs", data=body, headers=TEAM_B)).json()
    mine = await submitted(api, job("mine", dependsOn=[{"job": theirs["id"]}]))
    record = await until_state(api, mine["id"], "Failed")
    assert record["status"]["dependencies"][0]["ids"] == []


async def test_cancel_of_a_waiting_job_ends_it_at_once(api: Client) -> None:
    await submitted(api, job("prep"))
    second = await submitted(api, job("train", dependsOn=[{"job": "prep"}]))
    response = await api.delete(f"/v1/jobs/{second['id']}", headers=TEAM_A)
    assert (await response.json())["status"]["state"] == "Cancelled"


async def test_a_job_depending_on_itself_is_a_cycle(api: Client) -> None:
    response = await submit(api, job("loop", dependsOn=[{"job": "loop"}]))
    assert response.status == 422
    problem = await response.json()
    assert problem["field"] == "spec.dependsOn[0].job"
    assert "cycle (loop → loop)" in problem["detail"]
    assert await all_jobs(api) == []


async def test_a_cycle_in_a_batch_refuses_its_items_and_stores_the_others(api: Client) -> None:
    items = [
        {"job": job("a", dependsOn=[{"job": "b"}])},
        {"job": job("b", dependsOn=[{"job": "a"}])},
        {"job": job("c", dependsOn=[{"job": "d"}])},
        {"job": job("d")},
    ]
    body = io.BytesIO(json.dumps({"items": items}).encode())
    answer = await (await api.post("/v1/jobs:batch", data=body, headers=TEAM_A)).json()
    statuses = [item["status"] for item in answer["items"]]
    assert statuses == [422, 422, 202, 202]
    fields = [answer["items"][i]["problem"]["field"] for i in (0, 1)]
    assert fields == ["items[0].job.spec.dependsOn[0].job", "items[1].job.spec.dependsOn[0].job"]
    # c names d of the same batch, which came after it
    record = await get(api, answer["items"][2]["id"])
    assert record["status"]["state"] == "Waiting"
    assert record["status"]["dependencies"][0]["ids"] == [answer["items"][3]["id"]]
    assert len(await all_jobs(api)) == 2


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        pytest.param({"dependsOn": [{"job": "Not_A_Name"}]}, "spec.dependsOn[0].job", id="name"),
        pytest.param(
            {"dependsOn": [{"job": "a", "condition": "Started"}]},
            "spec.dependsOn[0].condition",
            id="condition",
        ),
        pytest.param({"dependsOn": [{"job": "x"}] * 65}, "spec.dependsOn", id="too many"),
        pytest.param({"array": {"count": 0}}, "spec.array.count", id="count 0"),
        pytest.param({"array": {"count": 10_001}}, "spec.array.count", id="count too big"),
        pytest.param(
            {"array": {"count": 3, "parallelism": 0}}, "spec.array.parallelism", id="parallelism 0"
        ),
        pytest.param({"array": {"count": "3"}}, "spec.array.count", id="count a string"),
        pytest.param({"array": {"count": 2, "size": 1}}, "spec.array.size", id="unknown field"),
    ],
)
async def test_bad_values_name_the_field_and_store_nothing(
    api: Client, spec: dict[str, Any], field: str
) -> None:
    response = await submit(api, job("bad", **spec))
    assert response.status == 422
    assert (await response.json())["field"] == field
    assert await all_jobs(api) == []


async def test_an_arrays_labels_are_the_brokers(api: Client) -> None:
    doc = job("x")
    doc["metadata"]["labels"] = {"gpufed.io/array-index": "3"}
    response = await submit(api, doc)
    assert response.status == 422
    assert (await response.json())["field"] == "metadata.labels[gpufed.io/array-index]"


async def test_an_array_name_too_long_for_its_last_index(api: Client) -> None:
    response = await submit(api, job("n" * 60, array={"count": 1000}))
    assert response.status == 422
    assert (await response.json())["field"] == "metadata.name"


# ---- arrays -------------------------------------------------------------------------------


async def test_an_array_makes_indexed_jobs(api: Client) -> None:
    answer = await submitted(api, job("sweep", array={"count": 4, "parallelism": 2}))
    array = answer["array"]
    assert (array["name"], array["count"], array["parallelism"]) == ("sweep", 4, 2)
    assert answer["id"] == f"{array['id']}-0"
    members = await all_jobs(api, "gpufed.io/array=sweep")
    by_index = sorted(members, key=lambda r: r["array"]["index"])
    assert [r["id"] for r in by_index] == [f"{array['id']}-{i}" for i in range(4)]
    assert [r["job"]["metadata"]["name"] for r in by_index] == [f"sweep-{i}" for i in range(4)]
    assert [r["job"]["metadata"]["labels"]["gpufed.io/array-index"] for r in by_index] == [
        "0",
        "1",
        "2",
        "3",
    ]
    one = await all_jobs(api, "gpufed.io/array=sweep,gpufed.io/array-index=2")
    assert [r["id"] for r in one] == [f"{array['id']}-2"]


async def test_an_array_replayed_by_its_key_is_stored_once(api: Client) -> None:
    doc = job("sweep", array={"count": 3})
    first = await submitted(api, doc, {"Idempotency-Key": "sweep-1"})
    response = await submit(api, doc, {"Idempotency-Key": "sweep-1"})
    assert response.status == 202 and response.headers["Idempotent-Replayed"] == "true"
    assert (await response.json())["id"] == first["id"]
    assert len(await all_jobs(api)) == 3


async def test_cancel_one_index_then_the_whole_array(api: Client) -> None:
    answer = await submitted(api, job("sweep", array={"count": 3}))
    array_id = answer["array"]["id"]
    one = await api.delete("/v1/arrays/sweep?index=1", headers=TEAM_A)
    assert one.status == 202
    assert [j["id"] for j in (await one.json())["items"]] == [f"{array_id}-1"]
    states = {r["id"]: r["status"]["state"] for r in await all_jobs(api)}
    assert states == {
        f"{array_id}-0": "Queued",
        f"{array_id}-1": "Cancelled",
        f"{array_id}-2": "Queued",
    }
    everything = await api.delete(f"/v1/arrays/{array_id}", headers=TEAM_A)
    assert everything.status == 202
    assert {j["status"]["state"] for j in (await everything.json())["items"]} == {"Cancelled"}


async def test_array_cancel_refusals(api: Client) -> None:
    await submitted(api, job("sweep", array={"count": 3}))
    assert (await api.delete("/v1/arrays/nothing", headers=TEAM_A)).status == 404
    bad = await api.delete("/v1/arrays/sweep?index=3", headers=TEAM_A)
    assert bad.status == 400 and (await bad.json())["field"] == "index"
    assert (await api.delete("/v1/arrays/sweep", headers=TEAM_B)).status == 404


async def test_a_dependency_on_an_arrays_name_waits_for_all_its_jobs(api: Client) -> None:
    answer = await submitted(api, job("sweep", array={"count": 3}))
    report = await submitted(api, job("report", dependsOn=[{"job": "sweep"}]))
    record = await get(api, report["id"])
    array_id = answer["array"]["id"]
    # the array by reference, not its jobs one by one
    assert record["status"]["dependencies"] == [
        {"job": "sweep", "condition": "Succeeded", "ids": [], "array": array_id, "count": 3}
    ]
    why = await (await api.get(f"/v1/jobs/{report['id']}/why", headers=TEAM_A)).json()
    assert f"array 'sweep': 3 of its 3 jobs to succeed (job {array_id}-0: Queued)" in why["message"]
    await api.delete("/v1/arrays/sweep?index=2", headers=TEAM_A)
    failed = await until_state(api, report["id"], "Failed")
    assert (
        f"job {array_id}-2 of the array ended Cancelled"
        in failed["status"]["events"][-1]["message"]
    )


async def test_a_dependency_on_an_array_is_met_when_its_last_job_succeeds(api: Client) -> None:
    answer = await submitted(api, job("sweep", array={"count": 3}))
    report = await submitted(api, job("report", dependsOn=[{"job": "sweep"}]))
    array_id = answer["array"]["id"]
    jobs_ = api.server.app[keys.JOBS]
    for index in range(3):
        await asyncio.sleep(0.1)  # the leader's task decides between the ends
        assert (await get(api, report["id"]))["status"]["state"] == "Waiting"
        await end(jobs_, f"{array_id}-{index}", "Succeeded")
    queued = await until_state(api, report["id"], "Queued")
    assert queued["status"]["events"][-1]["reason"] == "DependenciesMet"


async def test_a_record_naming_an_arrays_jobs_one_by_one_still_waits_for_them(
    api: Client,
) -> None:
    """Earlier brokers stored an array dependency as its jobs' ids: such a record is read
    and decided as before."""
    answer = await submitted(api, job("sweep", array={"count": 2}))
    array_id = answer["array"]["id"]
    members = [f"{array_id}-0", f"{array_id}-1"]
    jobs_ = api.server.app[keys.JOBS]
    record = status.JobRecord(id="report-old", tenant="team-a", job=make_job("report").build())
    record.status.dependencies = [Resolved(job="sweep", ids=members)]
    record.record(status.JobState.WAITING, "Submitted", "stored by an earlier broker")
    await jobs_.book.commit([record], fenced=False)
    await end(jobs_, members[0], "Succeeded")
    await asyncio.sleep(0.1)
    assert (await get(api, "report-old"))["status"]["state"] == "Waiting"
    await end(jobs_, members[1], "Succeeded")
    await until_state(api, "report-old", "Queued")


async def end(jobs_: Any, job_id: str, state: str) -> None:
    """End a job as its agent's report would (no agent runs here)."""
    draft = jobs_.book.draft(job_id)
    draft.record(status.JobState(state), "Completed", "ended by the test")
    await jobs_.book.commit([draft], fenced=False)


async def test_a_cycle_through_an_array_of_the_same_batch_refuses_both(api: Client) -> None:
    items = [
        {"job": job("sweep", array={"count": 50}, dependsOn=[{"job": "setup"}])},
        {"job": job("setup", dependsOn=[{"job": "sweep"}])},
        {"job": job("plain")},
    ]
    body = io.BytesIO(json.dumps({"items": items}).encode())
    answer = await (await api.post("/v1/jobs:batch", data=body, headers=TEAM_A)).json()
    assert [item["status"] for item in answer["items"]] == [422, 422, 202]
    problem = answer["items"][1]["problem"]
    assert problem["field"] == "items[1].job.spec.dependsOn[0].job"
    assert "setup → sweep → setup" in problem["detail"]
    assert len(await all_jobs(api)) == 1


async def test_an_array_too_large_to_store_is_refused(api: Client) -> None:
    doc = job("big", array={"count": 10_000})
    doc["metadata"]["annotations"] = {"notes": "x" * 10_000}  # 10 kB a job: 100 MB in all
    response = await submit(api, doc)
    assert response.status == 422
    problem = await response.json()
    assert problem["field"] == "spec.array.count" and "at most 64 MiB" in problem["detail"]
    assert await all_jobs(api) == []


async def test_a_batch_stores_at_most_ten_thousand_jobs_of_arrays(api: Client) -> None:
    items = [
        {"job": job("first", array={"count": 2})},
        {"job": job("second", array={"count": 9_999})},  # 10,001 in all
        {"job": job("third")},
    ]
    body = io.BytesIO(json.dumps({"items": items}).encode())
    answer = await (await api.post("/v1/jobs:batch", data=body, headers=TEAM_A)).json()
    assert [item["status"] for item in answer["items"]] == [202, 422, 202]
    assert answer["items"][1]["problem"]["field"] == "items[1].job.spec.array.count"


async def test_a_keyed_array_in_batches_is_stored_once(api: Client) -> None:
    items = [
        {"job": job("sweep", array={"count": 3}), "idempotencyKey": "sweep-k"},
        {"job": job("report", dependsOn=[{"job": "plain"}])},
        {"job": job("plain")},
    ]
    for expected in (202, 200):
        body = io.BytesIO(json.dumps({"items": items[:1]}).encode())
        answer = await (await api.post("/v1/jobs:batch", data=body, headers=TEAM_A)).json()
        assert answer["items"][0]["status"] == expected
    body = io.BytesIO(json.dumps({"items": items[1:]}).encode())
    answer = await (await api.post("/v1/jobs:batch", data=body, headers=TEAM_A)).json()
    assert [item["status"] for item in answer["items"]] == [202, 202]
    assert len(await all_jobs(api, "gpufed.io/array=sweep")) == 3
    assert len(await all_jobs(api)) == 5
