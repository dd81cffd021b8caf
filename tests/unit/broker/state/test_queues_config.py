"""The queues configuration: what is refused, what is a warning, which jobs may use which
queue, and how queues PUT through the API are kept in the store and seen by every replica."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.api import errors as api_errors
from broker.api import queues as api
from broker.state import registry, sqlite
from tests.builders import make_job

REPO = Path(__file__).resolve().parents[4]
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


OPEN, DECLARED = api.QueueMode.OPEN, api.QueueMode.DECLARED


@pytest.mark.parametrize(
    ("mode", "declared", "tenant", "edit", "error"),
    [
        pytest.param(OPEN, False, "team-a", {"queue": "anything"}, None, id="open: any name"),
        pytest.param(
            OPEN, True, "team-a", {"queue": "other"}, None, id="open: a declared queue locks none"
        ),
        pytest.param(OPEN, True, "team-a", {"queue": "q"}, None, id="open: own declared queue"),
        pytest.param(
            OPEN,
            True,
            "team-b",
            {"queue": "q"},
            registry.ForeignQueueError,
            id="open: another tenant's declared queue",
        ),
        pytest.param(DECLARED, True, "team-a", {"queue": "q"}, None, id="declared: own queue"),
        pytest.param(
            DECLARED,
            True,
            "team-a",
            {"queue": "nope"},
            registry.UnknownQueueError,
            id="declared: undeclared",
        ),
        pytest.param(
            DECLARED,
            False,
            "team-a",
            {"queue": "anything"},
            registry.UnknownQueueError,
            id="declared: no queue yet",
        ),
        pytest.param(
            DECLARED,
            True,
            "team-b",
            {"queue": "q"},
            registry.ForeignQueueError,
            id="declared: another tenant's",
        ),
        pytest.param(
            OPEN,
            False,
            "team-a",
            {"queue": "q", "priorityClass": "gold"},
            registry.UnknownPriorityClassError,
            id="unknown priority class",
        ),
    ],
)
def test_which_jobs_may_use_which_queue(
    mode: api.QueueMode,
    declared: bool,
    tenant: str,
    edit: dict[str, str],
    error: type[Exception] | None,
) -> None:
    config = api.QueuesConfig.model_validate({"queues": [queue("q")] if declared else []})
    builder = make_job(gpus=1)
    builder.doc["spec"].update(edit)
    queues = registry.QueueRegistry(config, mode=mode)
    if error is None:
        queues.check_job(tenant, builder.build())
    else:
        with pytest.raises(error):
            queues.check_job(tenant, builder.build())


@pytest.mark.parametrize(
    ("path", "mode", "expected"),
    [
        pytest.param(None, None, OPEN, id="no file: open"),
        pytest.param("config/queues.yaml", None, DECLARED, id="a file: declared"),
        pytest.param(None, DECLARED, DECLARED, id="declared without a file"),
        pytest.param("config/queues.yaml", OPEN, OPEN, id="open with a file"),
    ],
)
def test_queue_mode_defaults_to_declared_with_a_file(
    path: str | None, mode: api.QueueMode | None, expected: api.QueueMode
) -> None:
    queues = registry.QueueRegistry.from_file(REPO / path if path else None, mode=mode)
    assert queues.mode == expected


def test_undeclared_queues_with_jobs_are_reported_in_declared_mode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = api.QueuesConfig.model_validate({"queues": [queue("q")]})
    unfinished = {"q": 2, "Team_A": 3, "gone": 1, "empty": 0}
    assert registry.QueueRegistry(config, mode=OPEN).report_undeclared(unfinished) == {}
    declared = registry.QueueRegistry(config, mode=DECLARED)
    with caplog.at_level("WARNING", logger="broker.state.registry"):
        assert declared.report_undeclared(unfinished) == {"Team_A": 3, "gone": 1}
    [line] = caplog.messages
    assert "4 unfinished jobs name 2 undeclared queues (Team_A: 3, gone: 1)" in line


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


async def test_delete_removes_what_the_api_stored_on_every_replica() -> None:
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
        assert [first.source(n) for n in ("q", "new", "nope")] == ["file+api", "api", None]
        with pytest.raises(api_errors.NotFound):
            await first.delete("nope")
        await first.delete("new")
        await first.delete("q")
        assert first.source("q") == "file" and first.config.queue("new") is None
        assert first.config.queue("q").weight == 1  # type: ignore[union-attr]
        with pytest.raises(api_errors.NotFound):  # the file's queue is not the API's to delete
            await first.delete("q")
        async with asyncio.timeout(5):
            while second.config.queue("new") is not None or second.source("q") != "file":
                await asyncio.sleep(0.01)
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        restarted = registry.QueueRegistry(base)
        await restarted.load(backing)
        assert [(q.name, q.weight) for q in restarted.config.queues] == [("q", 1.0)]
    finally:
        await backing.close()
