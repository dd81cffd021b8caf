"""A failed gang's rollback covers every pod whose create may have been applied: the ones
that returned, and the ones whose create failed without saying whether the server stored the
pod (a temporary error, a cancellation in flight), deleted by name. A pod whose create was
refused is not the gang's to delete: its name may be another pod's."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from broker.api import status
from member_agent.binding import binding
from member_agent.cluster import base, errors


def request(name: str) -> base.PodRequest:
    return base.PodRequest(
        namespace="team-a",
        name=name,
        job_id="j1",
        task="worker",
        queue="research",
        node="n1",
        gpus=(status.GPUSlot(index=0),),
        cpu_milli=1000,
        memory_mib=0,
        template={},
    )


class Cluster:
    """Creates as told per pod name: "ok", an error to raise, or "hang" (never answers)."""

    def __init__(self, outcomes: dict[str, str | errors.BackendError]) -> None:
        self.outcomes = outcomes
        self.deleted: list[str] = []
        self.hanging = asyncio.Event()

    async def create_pod(self, req: base.PodRequest) -> None:
        outcome = self.outcomes.get(req.name, "ok")
        await asyncio.sleep(0)  # every worker has its pod in flight before any answers
        if outcome == "hang":
            self.hanging.set()
            await asyncio.Event().wait()
        if isinstance(outcome, errors.BackendError):
            raise outcome

    async def delete_pod(self, namespace: str, name: str, *, grace_seconds: float) -> None:
        self.deleted.append(name)


def backend(cluster: Cluster) -> base.ClusterBackend:
    return cast(base.ClusterBackend, cluster)


@pytest.mark.parametrize(
    ("failure", "deleted"),
    [
        pytest.param(
            errors.TemporaryBackendError("connection reset"),
            ["p0", "p1", "p2"],
            id="a lost answer: the pod may exist, deleted by name",
        ),
        pytest.param(
            errors.PermanentBackendError("pods p1 exists: it belongs to job j9"),
            ["p0", "p2"],
            id="a refusal: that name is left alone",
        ),
    ],
)
async def test_the_rollback_deletes_what_may_exist(
    failure: errors.BackendError, deleted: list[str]
) -> None:
    cluster = Cluster({"p1": failure})
    gang = [request(f"p{i}") for i in range(3)]
    with pytest.raises(binding.BindingError) as caught:
        await binding.create_gang(backend(cluster), gang, concurrency=3)
    assert sorted(cluster.deleted) == deleted
    assert caught.value.rolled_back == ("p0", "p2")
    assert caught.value.unsure == (("p1",) if "p1" in deleted else ())


async def test_a_create_in_flight_when_the_gang_is_cancelled_is_deleted_too() -> None:
    cluster = Cluster({"p1": "hang"})
    gang = [request(f"p{i}") for i in range(2)]
    task = asyncio.create_task(binding.create_gang(backend(cluster), gang, concurrency=2))
    await cluster.hanging.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cluster.deleted) == ["p0", "p1"]


async def test_a_refusal_names_the_pod_and_what_the_server_said() -> None:
    denial = 'admission webhook "gpu-policy" denied the request: no cost-center label'
    cluster = Cluster({"p0": errors.RefusedError(f"HTTP 403: {denial}", detail=denial)})
    with pytest.raises(binding.BindingError) as caught:
        await binding.create_gang(backend(cluster), [request("p0")])
    assert str(caught.value) == f"pod team-a/p0 refused: {denial}"
