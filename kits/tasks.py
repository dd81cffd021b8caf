"""Stopping a background task without trusting it to stop. Imports nothing of gpufed.

A task cancelled may swallow its cancellation: Python 3.11's `asyncio.wait_for` returns its
awaitable's result when the cancellation and the result arrive together, and a library
loop (a gRPC stream, a watch that resumes) then carries on. Awaiting such a task after
`cancel()` waits for ever: a term's end, a shutdown, a test's teardown would hang on it.
"""

from __future__ import annotations

import asyncio
import io
import logging
from typing import Any

logger = logging.getLogger(__name__)

STOP_SECONDS = 10.0  # a task cancelled and still running after this is left behind


async def stop_task(
    task: asyncio.Task[Any],
    *,
    timeout: float = STOP_SECONDS,
    expected: tuple[type[BaseException], ...] = (),
) -> bool:
    """Cancel `task` and wait for it to end, for at most `timeout` seconds; never raises.

    A task still running then is cancelled once more (the swallowed cancellation: the second
    one reaches wherever it waits now) and waited for as long again; if it still runs it is
    logged with where it is and left behind: False. An error the task had ended with is
    logged, a warning for the `expected` kinds, an error for any other; raised here, it would
    end the caller."""
    for attempt in range(2):
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if done:
            break
        if attempt == 0:
            logger.warning(
                "task %s still runs %g s after it was cancelled; cancelling it again",
                task.get_name(),
                timeout,
            )
    else:
        where = io.StringIO()
        task.print_stack(limit=12, file=where)
        logger.error(
            "task %s still runs after it was cancelled twice; left behind:\n%s",
            task.get_name(),
            where.getvalue(),
        )
        return False
    if not task.cancelled() and (error := task.exception()) is not None:
        if isinstance(error, expected):
            logger.warning("task %s had ended: %s", task.get_name(), error)
        else:
            logger.error("task %s had ended with an error", task.get_name(), exc_info=error)
    return True


def retrieve(future: asyncio.Future[Any]) -> None:
    """A done callback: the future's error is taken (it was answered, or no longer matters),
    so none is reported as never retrieved."""
    if not future.cancelled():
        future.exception()


def check_cancelled() -> None:
    """Raise CancelledError if the running task was asked to stop: after an `asyncio.wait_for`
    of Python 3.11, which returns its awaitable's result when the cancellation and the result
    arrive together, a loop would otherwise carry on as if never cancelled."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
