"""The cluster's GPU ResourceQuotas as the Kubernetes backend reads them for the limits check."""

from __future__ import annotations

from typing import Any

import pytest

from member_agent.cluster.kubernetes import quotas

REQ = "requests.nvidia.com/gpu"
LIM = "limits.nvidia.com/gpu"


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
