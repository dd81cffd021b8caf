"""Per-namespace GPU limits: the limits file and the cluster's ResourceQuotas, stricter wins."""

from __future__ import annotations

from typing import Any

import pytest

from member_agent.cluster import base
from member_agent.cluster import kubernetes_quotas as quotas
from member_agent.session import limits

REQ = "requests.nvidia.com/gpu"
LIM = "limits.nvidia.com/gpu"


def quota(hard: int, used: int, *, name: str = "gpus", resource: str = REQ) -> base.GPUQuota:
    return base.GPUQuota("team-a", name, resource, hard=hard, used=used)


@pytest.mark.parametrize(
    ("file_limit", "in_use", "found", "asked", "expected"),
    [
        pytest.param(None, 0, [], 64, None, id="no limit at all"),
        pytest.param(None, 0, [quota(16, 8)], 8, None, id="fits the quota exactly"),
        pytest.param(
            None,
            0,
            [quota(16, 10)],
            8,
            (
                "quota",
                "namespace team-a: ResourceQuota gpus allows 16 requests.nvidia.com/gpu, "
                "10 used, 6 left, the job asks for 8",
            ),
            id="over the quota",
        ),
        pytest.param(
            32,
            4,
            [quota(16, 12)],
            8,
            ("quota", "ResourceQuota gpus allows 16"),
            id="quota stricter than the file",
        ),
        pytest.param(
            6,
            4,
            [quota(16, 4)],
            8,
            ("limit", "namespace team-a: GPU limit 6 on this cluster, 4 in use"),
            id="file stricter than the quota",
        ),
        pytest.param(
            64,
            0,
            [quota(32, 0, name="big"), quota(8, 2, name="small", resource=LIM)],
            8,
            ("quota", "ResourceQuota small allows 8 limits.nvidia.com/gpu, 2 used, 6 left"),
            id="the strictest of two quotas",
        ),
        pytest.param(
            None,
            0,
            [quota(4, 9)],
            1,
            ("quota", "9 used, 0 left"),
            id="a quota already exceeded",
        ),
    ],
)
def test_the_stricter_of_the_file_and_the_quotas_wins(
    file_limit: int | None,
    in_use: int,
    found: list[base.GPUQuota],
    asked: int,
    expected: tuple[str, str] | None,
) -> None:
    agent_limits = limits.AgentLimits(
        namespace_gpus={"team-a": file_limit} if file_limit is not None else {}
    )
    over = limits.check_gpus(agent_limits, "team-a", in_use=in_use, asked=asked, quotas=found)
    if expected is None:
        assert over is None
        return
    assert over is not None
    assert over.source == expected[0]
    assert expected[1] in over.reason


@pytest.mark.parametrize(
    ("value", "hard", "used"),
    [
        pytest.param("4", 4, 4, id="a plain number"),
        pytest.param(8, 8, 8, id="a JSON number"),
        pytest.param("2k", 2000, 2000, id="decimal suffix"),
        pytest.param("1500m", 1, 2, id="milli: hard rounds down, use rounds up"),
        pytest.param("lots", None, None, id="not a quantity"),
        pytest.param("-1", None, None, id="negative"),
    ],
)
def test_quota_quantities_read_as_whole_gpus(
    value: Any, hard: int | None, used: int | None
) -> None:
    assert quotas.parse_count(value, round_up=False) == hard
    assert quotas.parse_count(value, round_up=True) == used


def resource_quota(
    name: str, hard: dict[str, str], used: dict[str, str], **spec: Any
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": {"hard": hard, **spec},
        "status": {"hard": hard, "used": used},
    }


@pytest.mark.parametrize(
    ("items", "in_use", "expected"),
    [
        pytest.param(
            [resource_quota("q", {REQ: "8", "pods": "10"}, {REQ: "3"})],
            1,
            [("q", REQ, 8, 3)],
            id="status.used when above the pods seen",
        ),
        pytest.param(
            [resource_quota("q", {REQ: "8"}, {REQ: "3"})],
            5,
            [("q", REQ, 8, 5)],
            id="the pods seen when the status lags",
        ),
        pytest.param(
            [resource_quota("q", {REQ: "8", LIM: "6"}, {})],
            0,
            [("q", LIM, 6, 0), ("q", REQ, 8, 0)],
            id="requests and limits",
        ),
        pytest.param(
            [resource_quota("cpu", {"requests.cpu": "100"}, {})], 0, [], id="no GPU in it"
        ),
        pytest.param(
            [resource_quota("q", {REQ: "8"}, {}, scopes=["NotTerminating"])],
            0,
            [],
            id="scoped quotas are left to the API server",
        ),
        pytest.param(
            [resource_quota("q", {REQ: "many"}, {})], 0, [], id="a hard value that is not one"
        ),
    ],
)
def test_the_gpu_quotas_of_a_namespace(
    items: list[dict[str, Any]], in_use: int, expected: list[tuple[str, str, int, int]]
) -> None:
    book = quotas.QuotaBook()
    book.replace(items, namespace="team-a")
    found = book.gpu_quotas("team-a", in_use=in_use)
    assert [(q.name, q.resource, q.hard, q.used) for q in found] == expected
    assert book.gpu_quotas("team-b", in_use=0) == []


def test_a_namespaces_relist_replaces_only_its_own_quotas() -> None:
    book = quotas.QuotaBook()
    other = resource_quota("q", {REQ: "4"}, {})
    other["metadata"]["namespace"] = "team-b"
    book.replace([resource_quota("q", {REQ: "8"}, {})], namespace="team-a")
    book.replace([other], namespace="team-b")
    book.replace([], namespace="team-a")  # team-a's quota deleted while nobody watched
    assert book.gpu_quotas("team-a", in_use=0) == []
    assert [q.hard for q in book.gpu_quotas("team-b", in_use=0)] == [4]
    book.apply("MODIFIED", {**other, "spec": {"hard": {REQ: "2"}}})
    assert [q.hard for q in book.gpu_quotas("team-b", in_use=0)] == [2]
    book.apply("DELETED", other)
    assert book.gpu_quotas("team-b", in_use=0) == []
