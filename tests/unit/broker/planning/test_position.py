"""A queued job's position and ETA (`planning.position`): table-driven."""

from __future__ import annotations

from datetime import timedelta

import pytest

from broker.planning import position
from tests.builders import T0

H100 = frozenset({"H100"})
A100 = frozenset({"A100"})
BOTH = H100 | A100


def job(
    name: str,
    queue: str = "a",
    *,
    at: int = 0,
    priority: int = 0,
    gpus: int = 8,
    models: frozenset[str] = H100,
    seconds: float | None = None,
) -> position.Queued:
    return position.Queued(
        job_id=name,
        queue=queue,
        priority=priority,
        created=T0 + timedelta(seconds=at),
        gpus=gpus,
        models=models,
        seconds=seconds,
    )


def ending(name: str, gpus: dict[str, int], after: float | None) -> position.Ending:
    return position.Ending(name, gpus, None if after is None else T0 + timedelta(seconds=after))


@pytest.mark.parametrize(
    ("queued", "shares", "expected"),
    [
        pytest.param([job("me")], {}, (1, 1, 0), id="alone: next everywhere"),
        pytest.param(
            [job("x", at=0), job("y", at=1), job("me", at=2), job("z", at=3)],
            {},
            (3, 3, 16),
            id="same queue: submitted earlier go first",
        ),
        pytest.param(
            [job("x", at=0), job("hi", at=5, priority=10), job("me", at=2)],
            {},
            (3, 3, 16),
            id="same queue: a higher priority goes first, submitted later",
        ),
        pytest.param(
            [job("x", at=0, models=A100), job("me", at=2)],
            {},
            (2, 1, 0),
            id="same queue, other model: ahead in the queue, not competing",
        ),
        pytest.param(
            [job("b1", "b", at=0), job("b2", "b", at=9), job("me", at=5)],
            {"a": 0.5, "b": 0.5},
            (1, 2, 8),
            id="equal shares: other queue's earlier submission goes first",
        ),
        pytest.param(
            [job("b1", "b", at=0), job("b2", "b", at=9), job("me", at=5)],
            {"a": 0.5, "b": 0.1},
            (1, 3, 16),
            id="lower share: all its jobs of equal priority go first",
        ),
        pytest.param(
            [job("b1", "b", at=0), job("b2", "b", at=9, priority=1), job("me", at=5)],
            {"a": 0.1, "b": 0.5},
            (1, 2, 8),
            id="higher share: only its higher priority goes first",
        ),
        pytest.param(
            [job("b1", "b", at=0, priority=-1), job("me", at=5)],
            {"a": 0.5, "b": 0.0},
            (1, 1, 0),
            id="lower share, lower priority: behind",
        ),
        pytest.param(
            [job("b1", "b", at=0, models=A100), job("c1", "c", at=0, models=BOTH, gpus=4)],
            {},
            None,
            id="not queued: no position",
        ),
        pytest.param(
            [
                job("b1", "b", at=0, models=A100),
                job("c1", "c", at=0, models=BOTH, gpus=4),
                job("me", at=5),
            ],
            {},
            (1, 2, 4),
            id="competing: any model in common",
        ),
    ],
)
def test_position(
    queued: list[position.Queued],
    shares: dict[str, float],
    expected: tuple[int, int, int] | None,
) -> None:
    found = position.locate("me", queued, shares=shares)
    got = None if found is None else (found.in_queue, found.competing, found.gpus_ahead)
    assert got == expected


def test_position_shrinks_as_jobs_ahead_leave() -> None:
    queued = [job(f"j{i}", at=i) for i in range(5)] + [job("me", at=10)]
    seen = []
    while queued:
        found = position.locate("me", queued, shares={})
        assert found is not None
        seen.append(found.in_queue)
        if queued[0].job_id == "me":
            break
        queued = queued[1:]  # the head started
    assert seen == [6, 5, 4, 3, 2, 1]


LONG = job("long", at=1, seconds=None)


@pytest.mark.parametrize(
    ("me", "ahead", "free", "running", "eta", "reason"),
    [
        pytest.param(job("me"), [], {"H100": 8}, [], 0, None, id="free now: now"),
        pytest.param(
            job("me"),
            [job("x", seconds=100)],
            {"H100": 8},
            [ending("r1", {"H100": 8}, 60), ending("r2", {"H100": 8}, 30)],
            30,
            None,
            id="the job ahead takes the free GPUs: the earliest declared end",
        ),
        pytest.param(
            job("me", gpus=16),
            [],
            {},
            [ending("r1", {"H100": 8}, 60), ending("r2", {"H100": 8}, 30)],
            60,
            None,
            id="two ends needed: the later",
        ),
        pytest.param(
            job("me"),
            [job("x", seconds=20), job("y", seconds=5)],
            {},
            [ending("r1", {"H100": 8}, 10)],
            35,
            None,
            id="the jobs ahead run one after the other for their run time",
        ),
        pytest.param(
            job("me"),
            [],
            {},
            [ending("r1", {"H100": 8}, -5)],
            0,
            None,
            id="an end already past: now",
        ),
        pytest.param(
            job("me"),
            [],
            {"A100": 8},
            [ending("r1", {"A100": 8}, 10)],
            None,
            "no job runs on the GPU models it needs",
            id="ends and free GPUs of other models do not count",
        ),
        pytest.param(
            job("me"),
            [],
            {},
            [ending("r1", {"H100": 8}, None)],
            None,
            "no running job on the GPU models it needs declares when it ends",
            id="no declared end",
        ),
        pytest.param(
            job("me"),
            [LONG],
            {},
            [ending("r1", {"H100": 8}, 10)],
            None,
            "do not reach the 8 it needs",
            id="a job ahead declares no run time: it keeps the GPUs",
        ),
        pytest.param(
            job("me", gpus=16),
            [],
            {},
            [ending("r1", {"H100": 8}, 10), ending("r2", {"H100": 8}, None)],
            None,
            "do not reach the 16 it needs",
            id="declared ends not enough",
        ),
        pytest.param(
            job("me", models=frozenset()),
            [],
            {},
            [],
            None,
            "no GPU model of the fleet suits it",
            id="no model",
        ),
    ],
)
def test_estimate(
    me: position.Queued,
    ahead: list[position.Queued],
    *,
    free: dict[str, int],
    running: list[position.Ending],
    eta: float | None,
    reason: str | None,
) -> None:
    found = position.estimate_start(me, ahead=ahead, free=free, running=running, now=T0)
    assert found.eta == (None if eta is None else T0 + timedelta(seconds=eta))
    if reason is None:
        assert found.reason is None
    else:  # the reason's words, or their end
        assert found.reason is not None and found.reason.endswith(reason)


def test_jobs_ahead_in_the_order_they_would_go() -> None:
    queued = [
        job("b-late", "b", at=9),
        job("b-early", "b", at=1),
        job("c-high", "c", at=8, priority=5),
        job("a-first", at=0),
        job("other-model", "b", at=0, models=A100),
        job("me", at=5),
    ]
    index = position.PositionIndex(queued)
    ahead = index.ahead("me", shares={"a": 0.5, "b": 0.1, "c": 0.9})
    assert [j.job_id for j in ahead] == ["c-high", "b-early", "b-late", "a-first"]
