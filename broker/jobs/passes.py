"""A leader's periodic task: one pass, then a pause, until the term ends.

The start timeouts (`starting`) and the job deadlines (`deadlines`) each run on the leader as a
loop of passes; a pass says how long to pause before the next. A pass that fails is logged and
counted (`gpufed_background_errors{task}`) and the loop backs off, doubling up to a ceiling,
until one passes again: a store outage or a bug in one pass never ends the task for the term.
Only `NotLeaderError` ends it (the term is over; the leader's work stops its tasks).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from broker.state import errors

logger = logging.getLogger(__name__)

MAX_BACKOFF_SECONDS = 30.0


async def run_passes(
    step: Callable[[], Awaitable[float]],
    *,
    what: str,
    on_error: Callable[[], None],
    pause_after_error: float = 1.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Run `step` (one pass; it returns the pause before the next) until cancelled; `what`
    names the work in log lines ("withdrawing late starts")."""
    failures = 0
    while True:
        pause = pause_after_error
        try:
            pause = await step()
            failures = 0
        except errors.NotLeaderError:
            raise  # the term ended: the leader's work stops this task
        except errors.StoreError as exc:
            failures += 1
            logger.warning("%s (%d in a row): %s", what, failures, exc)
        except Exception:  # a bug here must not end the task for the term
            failures += 1
            logger.exception("%s (%d in a row)", what, failures)
        if failures:
            pause = min(MAX_BACKOFF_SECONDS, 2.0**failures / 4)
            on_error()
        await sleep(pause)
