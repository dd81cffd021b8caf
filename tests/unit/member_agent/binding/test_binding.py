"""Creating a gang's pods: all of them, or none left behind."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from broker.api import gangs, jobs
from member_agent.binding import binding
from member_agent.cluster import base, errors
from member_agent.cluster.simulated import backend as simulated
from member_agent.placement import gang
from tests import agentbuilders


async def prepare(
    tmp_path: Path, job: jobs.GPUJob, *, epoch: int | None = 7, attempt: int = 1
) -> tuple[simulated.SimulatedBackend, list[base.PodRequest]]:
    backend = agentbuilders.small_backend(tmp_path)
    request = gangs.gang_request("j1", job, attempt=attempt)
    placement = gang.place_gang(backend.inventory(), request)
    assert isinstance(placement, gang.GangPlacement)
    requests = binding.build_requests(
        "j1", job, placement, traceparent=agentbuilders.TRACEPARENT, epoch=epoch, attempt=attempt
    )
    return backend, requests


@pytest.mark.parametrize(
    ("attempt", "names"),
    [
        pytest.param(1, ["j1-worker-0", "j1-worker-1"], id="first attempt"),
        pytest.param(3, ["j1-worker-0-a3", "j1-worker-1-a3"], id="third attempt"),
    ],
)
async def test_the_pods_carry_gpufeds_labels_and_the_trace(
    tmp_path: Path, attempt: int, names: list[str]
) -> None:
    job = agentbuilders.make_job(gpus=4, replicas=2, namespace="team-a", duration=1)
    backend, requests = await prepare(tmp_path, job, attempt=attempt)
    await binding.create_gang(backend, requests)
    assert [(r.namespace, r.name) for r in requests] == [("team-a", name) for name in names]
    first = requests[0]
    assert first.labels == {
        "app": "train",
        "gpufed.io/job": "j1",
        "gpufed.io/gang": "j1",
        "gpufed.io/queue": "research",
        "gpufed.io/task": "worker",
    }
    assert first.annotations == {
        "gpufed.io/sim-duration": "1",
        "traceparent": agentbuilders.TRACEPARENT,
        "gpufed.io/epoch": "7",
        "gpufed.io/min-member": "2",
        "gpufed.io/gang-size": "2",
        "gpufed.io/attempt": str(attempt),
        "gpufed.io/cluster-lost": "requeue",  # the job's failurePolicy: what a fence does
    }
    assert first.template["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert sorted(p.name for p in backend.pods_of("j1")) == names
    assert backend.held_jobs()["j1"].attempt == attempt
    await backend.close()


@pytest.mark.parametrize(
    ("job", "epoch", "expected"),
    [
        pytest.param(
            agentbuilders.make_job(gpus=1, replicas=3, min_member=2),
            3,
            base.HeldJob("j1", "default", 3, 2, 3, 3, (), queue="research"),
            id="minMember below the gang size",
        ),
        pytest.param(
            agentbuilders.make_job(gpus=2, replicas=2, namespace="team-a"),
            None,
            base.HeldJob("j1", "team-a", 0, 2, 2, 4, (), queue="research"),
            id="no epoch given",
        ),
    ],
)
async def test_a_backend_rebuilds_the_job_from_its_pods(
    tmp_path: Path, job: jobs.GPUJob, epoch: int | None, expected: base.HeldJob
) -> None:
    backend, requests = await prepare(tmp_path, job, epoch=epoch)
    await binding.create_gang(backend, requests)
    held = backend.held_jobs()
    assert list(held) == ["j1"]
    found = held["j1"]
    assert found.traceparent == agentbuilders.TRACEPARENT
    assert [p.name for p in found.pods] == sorted(r.name for r in requests)
    assert dataclasses.replace(found, pods=(), traceparent=None) == expected
    await backend.close()


@pytest.mark.parametrize(
    ("succeed", "concurrency"),
    [
        pytest.param(0, 1, id="first create fails"),
        pytest.param(2, 1, id="third of four fails, one at a time"),
        pytest.param(3, 1, id="last of four fails"),
        pytest.param(2, 8, id="third of four fails, concurrently"),
    ],
)
async def test_a_failed_create_leaves_no_pod(
    tmp_path: Path, succeed: int, concurrency: int
) -> None:
    job = agentbuilders.make_job(gpus=4, replicas=4)
    backend, requests = await prepare(tmp_path, job)
    free_before = sum(n.whole_free for n in backend.inventory())
    backend.fail_creates_after(succeed)
    with pytest.raises(binding.BindingError, match="injected create failure") as caught:
        await binding.create_gang(backend, requests, concurrency=concurrency)
    assert isinstance(caught.value.__cause__, errors.TemporaryBackendError)
    assert len(caught.value.rolled_back) == succeed
    assert backend.pods_of("j1") == []
    assert sum(n.whole_free for n in backend.inventory()) == free_before
    await backend.close()


async def test_delete_pods_reports_what_it_could_not_delete(tmp_path: Path) -> None:
    job = agentbuilders.make_job(gpus=1, replicas=2)
    backend, requests = await prepare(tmp_path, job)
    await binding.create_gang(backend, requests)

    refuse = backend.delete_pod

    async def delete(namespace: str, name: str, *, grace_seconds: float) -> None:
        if name.endswith("-1"):
            raise errors.TemporaryBackendError("API server away")
        await refuse(namespace, name, grace_seconds=grace_seconds)

    backend.delete_pod = delete  # type: ignore[method-assign]
    failed = await binding.delete_pods(
        backend, [("default", r.name) for r in requests] + [("default", "missing")], grace_seconds=5
    )
    assert failed == ["j1-worker-1"]
    assert [p.name for p in backend.pods_of("j1")] == ["j1-worker-1"]
    await backend.close()
