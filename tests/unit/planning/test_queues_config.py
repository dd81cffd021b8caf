"""The queues configuration: what is refused, what is a warning, which jobs may use which
queue, and how queues PUT through the API are kept in the store and seen by every replica."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.api import queues as api
from broker.state import registry, sqlite
from tests.builders import make_job

REPO = Path(__file__).resolve().parents[3]
H100 = "NVIDIA-H100-80GB-HBM3"
DEMO_FLEET = {
    H100: 128,
    "NVIDIA-A100-SXM4-80GB": 128,
    "NVIDIA-A100-PCIE-40GB": 64,
    "NVIDIA-L4": 256,
    "Tesla-T4": 96,
}


def queue(name: str = "q", **fields: Any) -> dict[str, Any]:
    return {"name": name, "tenant": "team-a", **fields}


def test_the_example_file_loads_and_fits_the_demo_fleet() -> None:
    config = registry.read_file(REPO / "config" / "queues.yaml")
    assert {q.name for q in config.queues} == {"training", "dev", "research", "inference"}
    assert config.warnings(DEMO_FLEET) == []


@pytest.mark.parametrize(
    ("document", "where"),
    [
        pytest.param(
            {"queues": [queue(quotas={H100: {"guaranteed": 8, "limit": 4}})]},
            "queues.0.quotas",
            id="guaranteed above limit",
        ),
        pytest.param(
            {"queues": [queue(), queue()]}, "queues: declared more than once", id="same queue twice"
        ),
        pytest.param(
            {"queues": [queue(priorityClass="gold")]},
            "queues[0].priorityClass: no priority class 'gold'",
            id="unknown priority class",
        ),
        pytest.param(
            {"policy": {"defaultPriorityClass": "gold"}},
            "policy.defaultPriorityClass",
            id="unknown default class",
        ),
        pytest.param({"queues": [queue(weight=0)]}, "queues.0.weight", id="weight zero"),
        pytest.param({"queues": [queue("Not_A_Label")]}, "queues.0.name", id="bad queue name"),
        pytest.param({"queues": [{"name": "q"}]}, "queues.0.tenant", id="no tenant"),
        pytest.param({"colour": "blue"}, "colour", id="unknown key"),
    ],
)
def test_a_file_that_cannot_work_is_refused_naming_where(
    tmp_path: Path, document: dict[str, Any], where: str
) -> None:
    path = tmp_path / "queues.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(registry.QueuesFileError) as caught:
        registry.read_file(path)
    assert where in str(caught.value)


@pytest.mark.parametrize(
    ("cohorts", "guarantees", "fleet", "warned"),
    [
        pytest.param([], [16, 16], {H100: 32}, False, id="guarantees fill the fleet exactly"),
        pytest.param([], [16, 24], {H100: 32}, True, id="guarantees above the fleet"),
        pytest.param(
            [{"name": "default", "capacity": {H100: 16}}],
            [8, 16],
            {H100: 64},
            True,
            id="guarantees above the cohort's declared capacity",
        ),
        pytest.param([], [16, 16], {}, True, id="no GPU of the model at all"),
    ],
)
def test_over_guaranteed_cohort_is_a_warning(
    cohorts: list[dict[str, Any]], guarantees: list[int], fleet: dict[str, int], warned: bool
) -> None:
    config = api.QueuesConfig.model_validate(
        {
            "cohorts": cohorts,
            "queues": [
                queue(f"q{i}", quotas={H100: {"guaranteed": g}}) for i, g in enumerate(guarantees)
            ],
        }
    )
    warnings = config.warnings(fleet)
    assert bool(warnings) == warned
    if warned:
        assert f"guaranteed {sum(guarantees)} {H100} GPUs" in warnings[0]


@pytest.mark.parametrize(
    ("declared", "tenant", "edit", "error"),
    [
        pytest.param(False, "team-a", {"queue": "anything"}, None, id="no queues: any name"),
        pytest.param(True, "team-a", {"queue": "q"}, None, id="own queue"),
        pytest.param(
            True, "team-a", {"queue": "nope"}, registry.UnknownQueueError, id="undeclared"
        ),
        pytest.param(
            True, "team-b", {"queue": "q"}, registry.ForeignQueueError, id="another tenant's"
        ),
        pytest.param(
            False,
            "team-a",
            {"queue": "q", "priorityClass": "gold"},
            registry.UnknownPriorityClassError,
            id="unknown priority class",
        ),
    ],
)
def test_which_jobs_may_use_which_queue(
    declared: bool, tenant: str, edit: dict[str, str], error: type[Exception] | None
) -> None:
    config = api.QueuesConfig.model_validate({"queues": [queue("q")] if declared else []})
    builder = make_job(gpus=1)
    builder.doc["spec"].update(edit)
    queues = registry.QueueRegistry(config)
    if error is None:
        queues.check_job(tenant, builder.build())
    else:
        with pytest.raises(error):
            queues.check_job(tenant, builder.build())


async def test_put_queues_are_stored_win_over_the_file_and_reach_other_replicas() -> None:
    backing = await sqlite.SqliteStore.open(":memory:")
    try:
        base = api.QueuesConfig.model_validate({"queues": [queue("q", weight=1)]})
        first = registry.QueueRegistry(base)
        second = registry.QueueRegistry(base)
        await first.load(backing)
        await second.load(backing)
        following = asyncio.create_task(second.follow(backing))
        await first.put(api.Queue.model_validate(queue("q", weight=3)))
        await first.put(api.Queue.model_validate(queue("new")))
        async with asyncio.timeout(5):
            while second.config.queue("new") is None:
                await asyncio.sleep(0.01)
        assert second.config.queue("q").weight == 3  # type: ignore[union-attr]
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        restarted = registry.QueueRegistry(base)
        await restarted.load(backing)
        assert [(q.name, q.weight) for q in restarted.config.queues] == [("new", 1.0), ("q", 3.0)]
    finally:
        await backing.close()
