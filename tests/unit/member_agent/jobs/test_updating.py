"""Final reports kept until the broker acknowledges them: sent again on every session and
while unanswered, for as long as the broker is away; the job handler driven straight, every
message it sends recorded (no socket)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from broker.api import messages, status
from member_agent.jobs import handling
from tests.unit.member_agent import harnesses

State = status.JobState


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[harnesses.Harness]:
    h = harnesses.Harness(tmp_path)
    yield h
    await h.close()


def finals(harness: harnesses.Harness, job_id: str) -> list[tuple[str, int | None]]:
    """The final reports of `job_id` sent so far: (state, seq)."""
    return [
        (m.state.value, m.seq)
        for m in harness.sent
        if isinstance(m, messages.JobUpdate) and m.job_id == job_id and m.state.terminal
    ]


async def finish(harness: harnesses.Harness, job_id: str, **job: object) -> None:
    await harness.offer(job_id, gpus=1, duration=0.01, **job)  # type: ignore[arg-type]
    await harness.pump(lambda: harness.handler.table.get(job_id).state.terminal)  # type: ignore[union-attr]


def listed(harness: harnesses.Harness) -> list[tuple[str, str]]:
    return sorted((j.job_id, j.state.value) for j in harness.handler.hello_jobs())


async def test_a_final_report_has_a_seq_and_is_sent_again_until_acknowledged(
    harness: harnesses.Harness,
) -> None:
    updates = harness.handler.updates
    await finish(harness, "a")
    await finish(harness, "b")
    assert finals(harness, "a") == [("Succeeded", 1)]
    assert finals(harness, "b") == [("Succeeded", 2)]
    assert sorted(updates.pending) == [1, 2]
    # not overdue yet: nothing sent again
    harness.now += updates.resend_seconds - 1
    assert updates.resend_overdue() == 0
    assert updates.acknowledge([2]) == 1
    harness.now += 1
    assert updates.resend_overdue() == 1  # only the one not acknowledged
    assert finals(harness, "a") == [("Succeeded", 1), ("Succeeded", 1)]
    assert finals(harness, "b") == [("Succeeded", 2)]
    # acknowledged (twice, and a seq it never sent): nothing pending, nothing sent again
    assert updates.acknowledge([1, 1, 99]) == 1
    harness.now += 3 * updates.resend_seconds
    assert updates.resend_overdue() == 0
    assert updates.pending == {}
    assert listed(harness) == []


async def test_reports_dropped_while_disconnected_go_out_on_the_next_session(
    harness: harnesses.Harness,
) -> None:
    updates = harness.handler.updates
    harness.connected = False  # the broker is down: the router drops what is sent
    await finish(harness, "a")
    await harness.offer("running", gpus=1)
    await finish(harness, "b", outcome="Failed:OOMKilled")
    assert finals(harness, "a") == finals(harness, "b") == []
    # an outage of any length: nothing is forgotten, nothing is sent while away
    harness.now += 24 * 3600
    assert updates.resend_overdue() == 0
    assert listed(harness) == [("a", "Succeeded"), ("b", "Failed"), ("running", "Running")]
    harness.connected = True
    assert updates.session_started(acks=True) == 2
    assert finals(harness, "a") == [("Succeeded", 1)]
    assert finals(harness, "b") == [("Failed", 2)]
    # the session drops before the ack: the next one sends them again, same seqs
    assert updates.session_started(acks=True) == 2
    assert finals(harness, "a") == [("Succeeded", 1)] * 2
    updates.acknowledge([1, 2])
    assert updates.session_started(acks=True) == 0
    assert listed(harness) == [("running", "Running")]


async def test_a_final_state_said_again_keeps_its_seq_until_acknowledged(
    harness: harnesses.Harness,
) -> None:
    updates = harness.handler.updates
    await finish(harness, "a")
    # the broker asks again (a cancel of the finished job): the same report, the same seq
    await harness.handler.handle_cancel(messages.Cancel(job_id="a", epoch=1, reason="Stale"))
    assert finals(harness, "a") == [("Succeeded", 1), ("Succeeded", 1)]
    assert list(updates.pending) == [1]
    updates.acknowledge([1])
    # said again after its ack: a new report, kept until acknowledged in turn
    await harness.handler.handle_cancel(messages.Cancel(job_id="a", epoch=1, reason="Stale"))
    assert finals(harness, "a")[-1] == ("Succeeded", 2)
    assert listed(harness) == [("a", "Succeeded")]


async def test_a_broker_of_protocol_1_counts_a_written_report_as_delivered(
    harness: harnesses.Harness,
) -> None:
    updates = harness.handler.updates
    harness.connected = False
    await finish(harness, "a")
    # the hello of the new session listed "a": an old broker has it from there
    harness.connected = True
    assert updates.session_started(acks=False) == 0
    assert updates.pending == {}
    await finish(harness, "b")
    assert updates.pending == {}  # delivered once written
    assert listed(harness) == []


async def test_a_job_found_finished_at_start_is_reported_with_the_next_session(
    harness: harnesses.Harness,
) -> None:
    await finish(harness, "a")
    # a restarted agent: an empty table, the pods of "a" still in the cluster, finished
    sent: list[messages.Message] = []

    def send(message: messages.Message, /, *, on_sent: Callable[[], None] | None = None) -> None:
        sent.append(message)
        if on_sent is not None:
            on_sent()

    restarted = handling.JobHandler(harness.backend, send=send, clock=lambda: harness.now)
    assert restarted.adopt(harness.backend.held_jobs()) == 1
    assert sent == []  # no session yet: kept
    assert [(j.job_id, j.state) for j in restarted.hello_jobs()] == [("a", State.SUCCEEDED)]
    assert restarted.updates.session_started(acks=True) == 1
    assert [(m.job_id, m.state, m.seq) for m in sent if isinstance(m, messages.JobUpdate)] == [
        ("a", State.SUCCEEDED, 1)
    ]
    restarted.updates.acknowledge([1])
    assert restarted.hello_jobs() == []
    await restarted.close()


async def test_an_idle_agent_forgets_acknowledged_jobs_without_another_offer(
    harness: harnesses.Harness,
) -> None:
    """The heartbeat's housekeeping prunes as an offer does: the jobs of a burst, finished
    and acknowledged, leave the table `keep_reported` seconds on, though no offer follows."""
    handler = harness.handler
    for job_id in ("a", "b"):
        await finish(harness, job_id)
    handler.updates.acknowledge([1, 2])
    acked = harness.now
    harness.now += handler.table.keep_reported / 2
    handler.housekeep()
    assert {"a", "b"} <= set(handler.table.records)  # kept: a re-sent offer stays idempotent
    harness.now = acked + handler.table.keep_reported + 1
    handler.housekeep()
    assert handler.table.get("a") is None and handler.table.get("b") is None


async def test_a_finished_jobs_pods_are_deleted_their_ttl_after_the_acknowledgement(
    harness: harnesses.Harness,
) -> None:
    handler = harness.handler
    handler.finished_pods_ttl = 300.0
    await finish(harness, "a")
    assert len(harness.backend.pods_of("a")) == 1  # a finished pod stays, for its logs
    handler.updates.acknowledge([1])
    acked = harness.now
    harness.now = acked + handler.table.keep_reported + 1
    handler.housekeep()
    assert handler.table.get("a") is None
    assert len(harness.backend.pods_of("a")) == 1  # forgotten, its pods kept for the TTL
    assert handler.deleter.finished_waiting == 1
    harness.now = acked + 299
    handler.housekeep()
    await handler.deleter.close()
    assert len(harness.backend.pods_of("a")) == 1
    harness.now = acked + 301
    handler.housekeep()
    await handler.deleter.close()  # the sweep's background deletion done
    assert harness.backend.pods_of("a") == []
    assert handler.deleter.finished_waiting == 0


async def test_with_no_ttl_a_finished_jobs_pods_are_never_deleted(
    harness: harnesses.Harness,
) -> None:
    handler = harness.handler
    handler.finished_pods_ttl = None  # --finished-pods-ttl never
    await finish(harness, "a")
    handler.updates.acknowledge([1])
    harness.now += 30 * 24 * 3600
    handler.housekeep()
    await handler.deleter.close()
    assert handler.table.get("a") is None  # the record forgotten all the same
    assert len(harness.backend.pods_of("a")) == 1
