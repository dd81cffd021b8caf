"""The broker's HTTP API through a real aiohttp server: contract, auth and bad input."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from tests.builders import expr, make_job

TEAM_A = {"Authorization": "Bearer dev-team-a"}
TEAM_B = {"Authorization": "Bearer dev-team-b"}
ADMIN = {"Authorization": "Bearer dev-admin"}
AGENT = {"Authorization": "Bearer dev-agent-h100"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
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


async def submit(
    api: TestClient[Any, Any], doc: Any, headers: dict[str, str] | None = None, **kw: Any
) -> Any:
    body = io.BytesIO((doc if isinstance(doc, str) else json.dumps(doc)).encode())
    return await api.post("/v1/jobs", data=body, headers={**TEAM_A, **(headers or {})}, **kw)


async def count_jobs(api: TestClient[Any, Any]) -> int:
    response = await api.get("/v1/jobs", headers=ADMIN)
    return len((await response.json())["items"])


async def test_submit_json_then_get_and_list(api: TestClient[Any, Any]) -> None:
    response = await submit(api, make_job("train", gpus=8).gang(2).document())
    assert response.status == 202
    body = await response.json()
    assert body["state"] == "Queued" and len(body["traceId"]) == 32
    got = await (await api.get(f"/v1/jobs/{body['id']}", headers=TEAM_A)).json()
    assert got["tenant"] == "team-a"
    assert got["status"]["events"][0]["state"] == "Queued"
    listed = await (await api.get("/v1/jobs?state=Queued", headers=TEAM_A)).json()
    assert [j["id"] for j in listed["items"]] == [body["id"]]


async def test_submit_yaml(api: TestClient[Any, Any]) -> None:
    text = yaml.safe_dump(make_job("yaml-job", gpus=1).document())
    response = await submit(api, text, headers={"Content-Type": "application/yaml"})
    assert response.status == 202


async def test_idempotency_key_never_makes_a_second_job(api: TestClient[Any, Any]) -> None:
    doc = make_job("once", gpus=1).document()
    first = await submit(api, doc, headers={"Idempotency-Key": "k-1"})
    second = await submit(api, doc, headers={"Idempotency-Key": "k-1"})
    assert (await first.json())["id"] == (await second.json())["id"]
    assert second.headers["Idempotent-Replayed"] == "true"
    assert await count_jobs(api) == 1


async def test_tenant_sees_and_cancels_only_its_own_jobs(api: TestClient[Any, Any]) -> None:
    job_id = (await (await submit(api, make_job(gpus=1).document())).json())["id"]
    assert (await api.get(f"/v1/jobs/{job_id}", headers=TEAM_B)).status == 404
    assert (await api.delete(f"/v1/jobs/{job_id}", headers=TEAM_B)).status == 404
    listed = await (await api.get("/v1/jobs", headers=TEAM_B)).json()
    assert listed["items"] == []
    cancelled = await api.delete(f"/v1/jobs/{job_id}", headers=TEAM_A)
    assert cancelled.status == 202
    assert (await cancelled.json())["status"]["state"] == "Cancelled"


def _with(path: str, value: Any) -> dict[str, Any]:
    doc = make_job("bad", gpus=1).document()
    target: Any = doc
    keys = path.split(".")
    for key in keys[:-1]:
        target = target[int(key)] if key.isdigit() else target[key]
    last = keys[-1]
    if value is _DELETE:
        del target[last]
    else:
        target[int(last) if last.isdigit() else last] = value
    return doc


_DELETE = object()
GPU_PATH = "spec.tasks.0.template.spec.containers.0.resources.limits.nvidia.com/gpu"


def _gpus(value: Any) -> dict[str, Any]:
    doc = make_job("bad", gpus=1).document()
    doc["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["resources"]["limits"] = {
        "nvidia.com/gpu": value
    }
    return doc


@pytest.mark.parametrize(
    ("body", "headers", "status", "field"),
    [
        pytest.param("{not json", {}, 400, None, id="malformed JSON"),
        pytest.param("a: [b", {"Content-Type": "application/yaml"}, 400, None, id="malformed YAML"),
        pytest.param("[]", {}, 422, None, id="not an object"),
        pytest.param(_with("spec.colour", "blue"), {}, 422, "spec.colour", id="unknown field"),
        pytest.param(_with("spec.queue", _DELETE), {}, 422, "spec.queue", id="missing queue"),
        pytest.param(_gpus(0), {}, 422, "limits[nvidia.com/gpu]", id="zero GPUs"),
        pytest.param(_gpus(-2), {}, 422, "limits[nvidia.com/gpu]", id="negative GPUs"),
        pytest.param(_gpus(1.5), {}, 422, "limits[nvidia.com/gpu]", id="fractional GPUs"),
        pytest.param(_gpus("two"), {}, 422, "limits[nvidia.com/gpu]", id="non-integer GPUs"),
        pytest.param(_gpus(16), {}, 422, "limits[nvidia.com/gpu]", id="more GPUs than a node"),
        pytest.param(
            _with("spec.gang", {"minMember": 5}),
            {},
            422,
            "gang.minMember",
            id="minMember above replicas",
        ),
        pytest.param(
            _with("metadata.name", "x" * 64), {}, 422, "metadata.name", id="name over 63 characters"
        ),
        pytest.param(
            _with("metadata.name", "Not_A_Label"),
            {},
            422,
            "metadata.name",
            id="name not a DNS label",
        ),
        pytest.param(_with("spec.tasks", []), {}, 422, "spec.tasks", id="no tasks"),
        pytest.param(
            _with(
                "spec.clusters",
                {"selector": {"matchExpressions": [{"key": "region", "operator": "Near"}]}},
            ),
            {},
            422,
            "spec.clusters.selector.matchExpressions[0].operator",
            id="spec.clusters: an unknown operator",
        ),
        pytest.param(_with("apiVersion", "batch/v1"), {}, 422, "apiVersion", id="wrong apiVersion"),
        pytest.param("x" * (1024 * 1024 + 10), {}, 413, None, id="body over 1 MiB"),
        pytest.param("", {}, 400, None, id="empty body"),
    ],
)
async def test_bad_input_is_a_4xx_naming_the_field_and_stores_nothing(
    api: TestClient[Any, Any], body: Any, headers: dict[str, str], status: int, field: str | None
) -> None:
    response = await submit(api, body, headers=headers)
    assert response.status == status
    assert response.content_type == "application/problem+json"
    problem = await response.json()
    assert problem["status"] == status and problem["detail"]
    if field is not None:
        assert field in problem["field"], problem
    assert await count_jobs(api) == 0


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        pytest.param({}, 401, id="missing token"),
        pytest.param({"Authorization": "Bearer nope"}, 401, id="unknown token"),
        pytest.param({"Authorization": "Basic dXNlcg=="}, 401, id="not a bearer token"),
        pytest.param(AGENT, 403, id="agent token on the jobs API"),
        pytest.param(ADMIN, 403, id="admin does not submit as a tenant"),
    ],
)
async def test_wrong_or_missing_token(
    api: TestClient[Any, Any], headers: dict[str, str], status: int
) -> None:
    response = await api.post("/v1/jobs", data=json.dumps(make_job().document()), headers=headers)
    assert response.status == status
    assert (await response.json())["detail"]
    assert await count_jobs(api) == 0


async def test_unknown_job_and_bad_query(api: TestClient[Any, Any]) -> None:
    missing = await api.get("/v1/jobs/nope", headers=TEAM_A)
    assert missing.status == 404
    bad = await api.get("/v1/jobs?state=Sleeping", headers=TEAM_A)
    assert bad.status == 400 and (await bad.json())["field"] == "state"


async def test_openapi_health_and_metrics(api: TestClient[Any, Any]) -> None:
    spec = await (await api.get("/openapi.json")).json()
    assert "/v1/jobs" in spec["paths"] and "GPUJob" in spec["components"]["schemas"]
    schemas = spec["components"]["schemas"]
    assert {"ClusterChoice", "LabelSelector", "PreferredClusters"} <= schemas.keys()
    assert (await api.get("/healthz")).status == 200
    assert (await api.get("/readyz")).status == 200
    await submit(api, make_job("m", gpus=1).document())
    text = await (await api.get("/metrics", headers=ADMIN)).text()
    assert 'gpufed_jobs_submitted_total{queue="default"} 1.0' in text


async def test_openapi_describes_every_route(api: TestClient[Any, Any]) -> None:
    spec = await (await api.get("/openapi.json")).json()
    for route in api.app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if route.method == "HEAD" or path is None:
            continue
        assert path in spec["paths"], f"{path} missing from /openapi.json"
        assert route.method.lower() in spec["paths"][path], f"{route.method} {path} missing"
    for name, schema in spec["components"]["schemas"].items():
        assert "type" in schema or "enum" in schema or "anyOf" in schema, name


async def test_concurrent_submits_share_commits_and_keep_their_answers(
    api: TestClient[Any, Any],
) -> None:
    """Submits arriving together are committed together; each still gets its own job, and
    one idempotency key used by many concurrent submits still makes exactly one job."""
    docs = [make_job(f"many-{i}", gpus=1).document() for i in range(30)]
    answers = await asyncio.gather(*[submit(api, doc) for doc in docs])
    ids = {(await a.json())["id"] for a in answers}
    assert len(ids) == 30 and all(a.status == 202 for a in answers)
    same = make_job("same", gpus=1).document()
    answers = await asyncio.gather(
        *[submit(api, same, headers={"Idempotency-Key": "k-many"}) for _ in range(10)]
    )
    assert len({(await a.json())["id"] for a in answers}) == 1
    assert await count_jobs(api) == 31


def _affinity(*expressions: dict[str, Any]) -> dict[str, Any]:
    return make_job("aff", gpus=1).node_affinity(list(expressions)).document()


def _limits(**limits: Any) -> dict[str, Any]:
    doc = make_job("res", gpus=1).document()
    doc["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["resources"]["limits"].update(
        limits
    )
    return doc


PRODUCT = "nvidia.com/gpu.product"
EXPRESSION = "nodeSelectorTerms[0].matchExpressions[0]"


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        pytest.param(_with("spec.queue", "Team_A"), "spec.queue", "DNS label", id="queue Team_A"),
        pytest.param(_with("spec.priority", 2**31), "spec.priority", "1000000000", id="int32"),
        pytest.param(
            _with("spec.priority", 10**19), "spec.priority", "", id="priority of 20 digits"
        ),
        pytest.param(
            _affinity(expr(PRODUCT, "In")), f"{EXPRESSION}.values", "In", id="In without values"
        ),
        pytest.param(
            _affinity(expr("example.com/gen", "Gt", "eight")),
            f"{EXPRESSION}.values[0]",
            "integers",
            id="Gt with a non-integer",
        ),
        pytest.param(
            _affinity(expr(PRODUCT, "Near", "x")),
            f"{EXPRESSION}.operator",
            "'Near' is not supported",
            id="unknown operator",
        ),
        pytest.param(_limits(cpu="inf"), "resources", "quantity", id="cpu infinite"),
        pytest.param(_limits(memory=-1), "limits[memory]", "at least 0", id="memory negative"),
        pytest.param(
            _with("spec.tasks.0.template.metadata.annotations", {"a b": "x"}),
            "annotations",
            "label key",
            id="annotation key",
        ),
    ],
)
async def test_a_submit_breaking_a_rule_is_a_422_naming_the_field(
    api: TestClient[Any, Any], body: Any, field: str, says: str
) -> None:
    response = await submit(api, body)
    assert response.status == 422, await response.text()
    problem = await response.json()
    assert field in problem["field"], problem
    assert says in problem["detail"], problem
    assert await count_jobs(api) == 0


async def test_every_node_affinity_operator_is_accepted(api: TestClient[Any, Any]) -> None:
    doc = _affinity(
        expr(PRODUCT, "NotIn", "NVIDIA-H100-80GB-HBM3"),
        expr(PRODUCT, "Exists"),
        expr("example.com/legacy", "DoesNotExist"),
        expr("example.com/gen", "Gt", "7"),
        expr("example.com/gen", "Lt", "10"),
        expr("topology.kubernetes.io/zone", "In", "a", "b"),
    )
    response = await submit(api, doc)
    assert response.status == 202, await response.text()


async def test_a_method_a_route_does_not_take_is_405_with_allow(
    api: TestClient[Any, Any],
) -> None:
    response = await api.put("/v1/jobs", headers=TEAM_A)
    assert response.status == 405
    assert set(response.headers["Allow"].split(",")) >= {"GET", "POST"}
    problem = await response.json(content_type=None)
    assert problem["status"] == 405 and problem["title"]
