"""A tenant's allotment: whether a tenant-admin's queue fits it (the guarantees and limits of
all the tenant's queues added), what a lowering may always do, and what a tenant gets where
the queues file declares no allotment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from broker.api import allotments, queues
from broker.state import registry

REPO = Path(__file__).resolve().parents[4]
H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"
CLASSES = {"low": -10, "normal": 0, "high": 100}

ALLOTMENT = queues.Allotment.model_validate(
    {
        "tenant": "team-a",
        "quotas": {H100: {"guaranteed": 64, "limit": 128}},
        "maxWeight": 2,
        "maxPriorityClass": "normal",
        "cohorts": ["research"],
    }
)


def queue(name: str, h100: tuple[int, int | None] | None = None, **fields: Any) -> queues.Queue:
    quotas = fields.pop("quotas", {})
    if h100 is not None:
        quotas = {**quotas, H100: {"guaranteed": h100[0], "limit": h100[1]}}
    document = {"name": name, "tenant": "team-a", "cohort": "research", "quotas": quotas}
    return queues.Queue.model_validate({**document, **fields})


def fields_beyond(
    *,
    new: queues.Queue,
    previous: queues.Queue | None = None,
    others: list[queues.Queue] | None = None,
    allotment: queues.Allotment = ALLOTMENT,
) -> list[str]:
    excesses = allotments.check_put(
        allotment,
        queue=new,
        previous=previous,
        others=others or [],
        classes=CLASSES,
        default_class="normal",
    )
    return [e.field for e in excesses]


@pytest.mark.parametrize(
    ("new", "previous", "others", "beyond"),
    [
        pytest.param(
            queue("grab", (128, None)),
            None,
            [queue("training", (64, 128))],
            [f"quotas.{H100}.guaranteed", f"quotas.{H100}.limit"],
            id="a new queue guaranteeing the whole fleet",
        ),
        pytest.param(
            queue("small-3", (8, 8)),
            None,
            [queue("training", (48, 96)), queue("small-1", (8, 8)), queue("small-2", (4, 8))],
            [f"quotas.{H100}.guaranteed"],
            id="many small queues: the one past the sum",
        ),
        pytest.param(
            queue("small-2", (8, 8)),
            None,
            [queue("training", (48, 112)), queue("small-1", (8, 8))],
            [],
            id="many small queues within the sum fit",
        ),
        pytest.param(
            queue("training", (72, 128)),
            queue("training", (64, 128)),
            [],
            [f"quotas.{H100}.guaranteed"],
            id="raising a queue past the allotment",
        ),
        pytest.param(
            queue("training", (80, 128)),
            queue("training", (96, 128)),
            [],
            [],
            id="lowering a queue the admin put above the allotment",
        ),
        pytest.param(
            queue("training", (100, 128)),
            queue("training", (96, 128)),
            [],
            [f"quotas.{H100}.guaranteed"],
            id="raising a queue already above the allotment",
        ),
        pytest.param(
            queue("y", (40, 40)),
            queue("y", (48, 48)),
            [queue("x", (48, 48))],
            [],
            id="reshuffling below what it had while above",
        ),
        pytest.param(
            queue("open", (0, None)),
            None,
            [],
            [f"quotas.{H100}.limit"],
            id="no limit where the allotment bounds limits",
        ),
        pytest.param(
            queue("wide", quotas={"*": {"guaranteed": 4, "limit": 8}}),
            None,
            [],
            ["quotas.*.guaranteed", "quotas.*.limit"],
            id="a star quota claims every model not listed",
        ),
        pytest.param(
            queue("a100", quotas={A100: {"guaranteed": 0, "limit": 8}}),
            None,
            [],
            [f"quotas.{A100}.limit"],
            id="a model the allotment does not name",
        ),
        pytest.param(
            queue("a100", quotas={A100: {"guaranteed": 0, "limit": 0}}),
            None,
            [],
            [],
            id="a model not allotted, claimed at zero",
        ),
        pytest.param(queue("heavy", weight=3), None, [], ["weight"], id="weight above the most"),
        pytest.param(
            queue("heavy", weight=3),
            queue("heavy", weight=5),
            [],
            [],
            id="weight lowered while above the most",
        ),
        pytest.param(
            queue("urgent", priorityClass="high"),
            None,
            [],
            ["priorityClass"],
            id="priority class above the highest",
        ),
        pytest.param(
            queue("batch", priorityClass="low"), None, [], [], id="priority class below it"
        ),
        pytest.param(queue("plain"), None, [], [], id="no priority class: the policy's default"),
        pytest.param(
            queue("infer", cohort="serving"), None, [], ["cohort"], id="a cohort not allotted"
        ),
        pytest.param(
            queue("infer", cohort="serving", weight=1),
            queue("infer", cohort="serving", weight=2),
            [],
            [],
            id="a queue the admin put in another cohort keeps it",
        ),
    ],
)
def test_a_queue_fits_the_allotment_of_its_tenant_with_all_its_queues(
    new: queues.Queue,
    previous: queues.Queue | None,
    others: list[queues.Queue],
    beyond: list[str],
) -> None:
    assert fields_beyond(new=new, previous=previous, others=others) == beyond


def test_the_refusal_says_the_sum_and_the_allotment() -> None:
    [excess] = allotments.check_put(
        ALLOTMENT,
        queue=queue("small-3", (8, 8)),
        previous=None,
        others=[queue("training", (60, 112))],
        classes=CLASSES,
        default_class=None,
    )
    assert excess.message == (
        f"tenant team-a's queues would be guaranteed 68 {H100} GPUs together, "
        "above its allotment of 64"
    )


EXAMPLE = registry.read_file(REPO / "config" / "queues.yaml")


def test_a_tenant_without_a_declared_allotment_gets_what_the_file_gives_it() -> None:
    bare = EXAMPLE.model_copy(update={"allotments": []})
    allotment, declared = allotments.allotment_of("team-a", bare)
    assert not declared
    assert allotment.model_dump(by_alias=True) == {
        "tenant": "team-a",
        "quotas": {
            "*": {"guaranteed": 0, "limit": None},
            A100: {"guaranteed": 64, "limit": None},
            H100: {"guaranteed": 64, "limit": None},
        },
        "maxWeight": 2.0,
        "maxPriorityClass": "normal",  # training names none: the policy's default
        "cohorts": ["research"],
        "allowedImages": None,  # derived: any image
    }
    team_b = allotments.derive("team-b", bare)
    assert (team_b.max_priority_class, team_b.cohorts) == ("high", ["research", "serving"])


def test_a_tenant_with_no_queue_in_the_file_gets_what_an_open_queue_has() -> None:
    allotment = allotments.derive("team-c", EXAMPLE)
    assert allotment.quotas == {"*": queues.ModelQuota(guaranteed=0)}
    assert (allotment.max_weight, allotment.max_priority_class) == (1.0, None)
    assert allotment.cohorts == ["default"]
    assert (
        fields_beyond(
            new=queue("c", cohort="default").model_copy(update={"tenant": "team-c"}),
            allotment=allotment,
        )
        == []
    )


@pytest.mark.parametrize(
    ("new", "beyond"),
    [
        pytest.param(
            queue("grab", (128, 128)),
            [f"quotas.{H100}.guaranteed"],
            id="a queue guaranteeing the whole fleet",
        ),
        pytest.param(
            queue("training", (96, 128), weight=2),
            [f"quotas.{H100}.guaranteed"],
            id="the file's queue raised",
        ),
        pytest.param(queue("extra", (0, 64)), [], id="borrowing only: limits are not derived"),
        pytest.param(queue("training", (32, 128), weight=2), [], id="the file's queue lowered"),
    ],
)
def test_the_example_file_bounds_its_tenants_without_an_edit(
    new: queues.Queue, beyond: list[str]
) -> None:
    allotment = allotments.derive("team-a", EXAMPLE)
    mine = [q for q in EXAMPLE.queues if q.tenant == "team-a"]
    excesses = allotments.check_put(
        allotment,
        queue=new,
        previous=EXAMPLE.queue(new.name),
        others=[q for q in mine if q.name != new.name],
        classes=CLASSES,
        default_class="normal",
    )
    assert [e.field for e in excesses] == beyond


@pytest.mark.parametrize(
    ("document", "message"),
    [
        pytest.param(
            {"allotments": [{"tenant": "t"}, {"tenant": "t"}]},
            "allotments: declared more than once: t",
            id="a tenant twice",
        ),
        pytest.param(
            {"allotments": [{"tenant": "t", "maxPriorityClass": "gold"}]},
            "allotments[0].maxPriorityClass: no priority class 'gold'",
            id="unknown priority class",
        ),
        pytest.param(
            {"allotments": [{"tenant": "t", "quotas": {H100: {"guaranteed": 9, "limit": 8}}}]},
            "guaranteed: 9 is above the limit (8)",
            id="guaranteed above limit",
        ),
        pytest.param(
            {"allotments": [{"tenant": "t", "maxWeight": 0}]},
            "greater than 0",
            id="weight zero",
        ),
    ],
)
def test_an_allotment_that_cannot_work_is_refused(document: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        queues.QueuesConfig.model_validate(document)
    assert message in str(raised.value)
