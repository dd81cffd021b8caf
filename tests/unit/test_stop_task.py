"""`scheduling.stop_task`, which ends a leader's term: a task that swallows its cancellation
is left behind after the timeout (logged with where it is) instead of holding up the end of
the term and every term after it."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from broker.jobs import scheduling


async def test_a_task_that_ends_on_its_cancel_is_awaited() -> None:
    task = asyncio.create_task(asyncio.sleep(60))
    await asyncio.sleep(0)
    assert await scheduling.stop_task(task, timeout=1.0) is True
    assert task.cancelled()


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
    with caplog.at_level(logging.ERROR, logger="broker.jobs.scheduling"):
        assert await scheduling.stop_task(task, timeout=0.1) is False
    assert not task.done()
    assert "task stubborn still runs 0.1 s after it was cancelled" in caplog.text
    assert "in stubborn" in caplog.text  # where it was
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)
    assert task.done()


async def test_an_error_the_task_ended_with_is_raised() -> None:
    async def failing() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RuntimeError("broke on the way out") from None

    task = asyncio.create_task(failing())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="broke on the way out"):
        await scheduling.stop_task(task, timeout=1.0)
