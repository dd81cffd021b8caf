"""A job the broker runs again on the same cluster: offers and cancels that name an attempt."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from broker.api import gangs, messages, status
from tests import agentbuilders
from tests import builders as job_builders
from tests.unit.member_agent import harnesses

Phase = status.PodPhase


@pytest.fixture
async def harness(tmp_path: Path):  # type: ignore[no-untyped-def]
    h = harnesses.Harness(tmp_path)
    yield h
    await h.close()


def phases(h: harnesses.Harness, job_id: str) -> dict[str, str]:
    return {p.name: p.phase.value for p in h.backend.pods_of(job_id)}


def attempts_sent(h: harnesses.Harness, job_id: str) -> list[tuple[str, str, int]]:
    return [
        (m.state.value, m.reason, m.attempt)
        for m in h.sent
        if isinstance(m, messages.JobUpdate) and m.job_id == job_id
    ]


async def test_the_same_attempt_offered_again_is_a_resend(harness: harnesses.Harness) -> None:
    """An offer the broker sent again (a new session) gets the same pods and the final state
    again; nothing is created twice."""
    first = await harness.offer("j1", gpus=2, outcome="Failed:NodeLost")
    await harness.pump(lambda: ("Failed", "NodeLost", 1) in attempts_sent(harness, "j1"))
    again = await harness.offer("j1", gpus=2, outcome="Failed:NodeLost", epoch=2, session_epoch=2)
    assert isinstance(first, messages.Accepted) and isinstance(again, messages.Accepted)
    assert again.pods == first.pods and again.attempt == 1
    assert harness.backend.creates == 1
    assert attempts_sent(harness, "j1")[-1] == ("Failed", "NodeLost", 1)
    assert harness.handler.offers == {"accepted": 1, "resent": 1}


async def fail(h: harnesses.Harness) -> None:
    """Attempt 1's pods fail with NodeLost (the workload asked for it)."""
    await h.pump(lambda: ("Failed", "NodeLost", 1) in attempts_sent(h, "j1"))
    await h.handler.close()  # the failed gang's clean-up


async def keep_running(h: harnesses.Harness) -> None:
    """Attempt 1 runs on (the broker thought the cluster lost and moved on)."""
    await h.pump(lambda: attempts_sent(h, "j1") == [("Running", "PodsRunning", 1)])


async def cancel(h: harnesses.Harness) -> None:
    """Attempt 1 was preempted: reported Cancelled once its pods are gone."""
    await h.handler.handle_cancel(messages.Cancel(job_id="j1", epoch=1, reason="Preempted"))
    await h.pump(lambda: ("Cancelled", "Preempted", 1) in attempts_sent(h, "j1"))


@pytest.mark.parametrize(
    ("outcome", "before", "left"),
    [
        pytest.param(
            "Failed:NodeLost@1",
            fail,
            {"Failed"},
            id="after a failure the failed pods stay for their logs",
        ),
        pytest.param(None, keep_running, set(), id="a running earlier attempt is deleted"),
        pytest.param(None, cancel, set(), id="after a preemption"),
    ],
)
async def test_a_later_attempt_runs_again_under_new_pod_names(
    harness: harnesses.Harness,
    outcome: str | None,
    before: Callable[[harnesses.Harness], Awaitable[None]],
    left: set[str],
) -> None:
    # both H100 nodes, whole: attempt 2 fits only once attempt 1 has let go
    job: dict[str, Any] = {
        "gpus": 8,
        "replicas": 2,
        "model": agentbuilders.H100,
        "outcome": outcome,
    }
    assert isinstance(await harness.offer("j1", **job), messages.Accepted)
    await before(harness)
    reply = await harness.offer("j1", attempt=2, duration=0.02, **job)

    assert isinstance(reply, messages.Accepted), reply
    assert reply.attempt == 2
    assert sorted(p.name for p in reply.pods) == ["j1-worker-0-a2", "j1-worker-1-a2"]
    await harness.pump(lambda: attempts_sent(harness, "j1")[-1][0] == "Succeeded")
    second = [s for s in attempts_sent(harness, "j1") if s[2] == 2]
    assert second == [("Running", "PodsRunning", 2), ("Succeeded", "AllPodsSucceeded", 2)]
    await harness.pump(harness.backend._queue.empty)  # the earlier pods' events change nothing
    assert attempts_sent(harness, "j1")[-1] == ("Succeeded", "AllPodsSucceeded", 2)
    pods = phases(harness, "j1")
    assert {name: pods.pop(name) for name in list(pods) if name.endswith("-a2")} == {
        "j1-worker-0-a2": "Succeeded",
        "j1-worker-1-a2": "Succeeded",
    }
    assert set(pods.values()) == left  # what attempt 1 left in the cluster
    record = harness.handler.table.get("j1")
    assert record is not None and record.attempt == 2
    assert harness.handler.offers == {"accepted": 2}


async def test_an_earlier_attempt_is_rejected_and_the_later_one_runs_on(
    harness: harnesses.Harness,
) -> None:
    await harness.offer("j1", gpus=2, attempt=3)
    reply = await harness.offer("j1", gpus=2, attempt=2)
    assert isinstance(reply, messages.Rejected)
    assert reply.attempt == 2
    assert reply.reasons == ["stale attempt 2: this cluster holds attempt 3"]
    assert list(phases(harness, "j1")) == ["j1-worker-0-a3"]
    assert harness.handler.offers == {"accepted": 1, "stale": 1}


@pytest.mark.parametrize(
    ("cancelled", "left", "answer"),
    [
        pytest.param(1, {"j1-worker-0-a2": "Running"}, ("Cancelled", "Stale", 1), id="earlier"),
        pytest.param(2, {}, ("Cancelled", "Stale", 2), id="the same"),
        pytest.param(3, {}, ("Cancelled", "Stale", 3), id="later: the held one is stale too"),
    ],
)
async def test_a_cancel_stops_the_attempt_it_names_or_an_earlier_one(
    harness: harnesses.Harness, cancelled: int, left: dict[str, str], answer: tuple[str, str, int]
) -> None:
    await harness.offer("j1", gpus=2, attempt=2)
    await harness.pump(lambda: attempts_sent(harness, "j1") == [("Running", "PodsRunning", 2)])
    stop = messages.Cancel(job_id="j1", epoch=1, reason="Stale", attempt=cancelled)
    await harness.handler.handle_cancel(stop)
    assert attempts_sent(harness, "j1")[-1] == answer
    assert phases(harness, "j1") == left
    assert (harness.handler.table.get("j1") is not None) == (cancelled == 2 or bool(left))


@pytest.mark.parametrize(
    ("name", "attempt"),
    [
        pytest.param("j1-worker-0", 1, id="first attempt"),
        pytest.param("j1-worker-12-a7", 7, id="seventh attempt"),
        pytest.param("j1-a2-0", 1, id="a task named like an attempt"),
    ],
)
def test_a_pod_name_says_its_attempt(name: str, attempt: int) -> None:
    assert gangs.attempt_of_pod(name) == attempt


def test_pod_names_of_two_attempts_never_clash() -> None:
    """Tasks `worker` and `a2-worker` of one job: an attempt marker in front of the task would
    give `worker`'s pod of attempt 2 the name of `a2-worker`'s pod of attempt 1."""
    job = job_builders.make_job("j", gpus=1).gang(2).task("a2-worker", gpus=1, replicas=2).build()
    names = [
        name
        for attempt in (1, 2, 3)
        for name, _, _ in gangs.gang_request("j", job, attempt=attempt).pod_names()
    ]
    assert len(set(names)) == len(names) == 12
    assert "j-a2-worker-0" in names and "j-worker-0-a2" in names


def held_job(attempt: int) -> messages.AgentJob:
    return messages.AgentJob(job_id="j1", epoch=1, state=status.JobState.RUNNING, attempt=attempt)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda n: agentbuilders.make_offer("j1", agentbuilders.make_job(), attempt=n),
            id="offer",
        ),
        pytest.param(
            lambda n: messages.Accepted(job_id="j1", epoch=1, pods=[], attempt=n), id="accepted"
        ),
        pytest.param(
            lambda n: messages.JobUpdate(
                job_id="j1", epoch=1, state=status.JobState.RUNNING, attempt=n
            ),
            id="update",
        ),
        pytest.param(lambda n: messages.Cancel(job_id="j1", epoch=1, attempt=n), id="cancel"),
        pytest.param(lambda n: messages.Hello(cluster="c", jobs=[held_job(n)]), id="hello"),
    ],
)
def test_a_first_attempt_goes_on_the_wire_as_before_attempts_existed(
    make: Callable[[int], messages.Message],
) -> None:
    """Peers from before attempts forbid unknown fields: attempt 1 is left out for them."""
    assert '"attempt"' not in messages.encode(make(1))
    assert '"attempt":2' in messages.encode(make(2))
    assert messages.decode(messages.encode(make(2))) == make(2)
    assert messages.decode(messages.encode(make(1))) == make(1)
