"""`scheduling.stop_task`, which ends a leader's term: a task that swallows its cancellation
is left behind after the timeout (logged with where it is) instead of holding up the end of
the term and every term after it, and a task that had ended with an error has it logged,
not raised into the leader's work."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from broker.jobs import scheduling
from broker.state import errors


async def test_a_task_that_ends_on_its_cancel_is_awaited() -> None:
    task = asyncio.create_task(asyncio.sleep(60))
    await asyncio.sleep(0)
    assert await scheduling.stop_task(task, timeout=1.0) is True
    assert task.cancelled()


@pytest.mark.looptime  # the 0.1 s it waits for the task passes at once
async def test_a_task_that_swallows_its_cancel_is_left_behind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(60)

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="kits.tasks"):
        assert await scheduling.stop_task(task, timeout=0.1) is False
    assert not task.done()
    assert "task stubborn still runs 0.1 s after it was cancelled; cancelling it again" in (
        caplog.text
    )
    assert "task stubborn still runs after it was cancelled twice; left behind" in caplog.text
    assert "in stubborn" in caplog.text  # where it was
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)
    assert task.done()


@pytest.mark.looptime  # the 0.1 s it waits for the task passes at once
async def test_a_task_that_swallowed_one_cancel_ends_with_the_second() -> None:
    """As a library's `wait_for` does on Python 3.11 when its result and the cancellation
    arrive together: the task carries on to its next wait, where the second cancel ends it."""

    async def swallows_once() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(60)
        await asyncio.sleep(60)  # e.g. a watch resumed, waiting for events

    task = asyncio.create_task(swallows_once(), name="once")
    await asyncio.sleep(0)
    assert await scheduling.stop_task(task, timeout=0.1) is True
    assert task.cancelled()


async def test_an_error_the_task_ended_with_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Raised here, it would end the caller: the leader's work, for good."""

    async def deposed() -> None:
        raise errors.NotLeaderError("replica r0 is not the leader")

    async def failing() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RuntimeError("broke on the way out") from None

    ended = asyncio.create_task(deposed(), name="retirer")
    broken = asyncio.create_task(failing(), name="broken")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="broker.jobs.scheduling"):
        assert await scheduling.stop_task(ended, timeout=1.0) is True
        assert await scheduling.stop_task(broken, timeout=1.0) is True
    assert "task retirer had ended: replica r0 is not the leader" in caplog.text
    assert "task broken had ended with an error" in caplog.text
    assert "RuntimeError: broke on the way out" in caplog.text
