"""The sweep of expired idempotency keys: a background task of the broker (`broker.app`).

A key replays its job for the book's `idempotency_window` (24 h by default); a submit that
finds it expired forgets it on the spot, and this sweep deletes the others so the store does
not keep every key ever used. The keys are read a shard at a time (`SHARDS`: the first two hex
digits of their digest, 1/256 of the keys each), so no pass reads them all; a pass lists one
shard, deletes at most `batch` of its expired keys (compare-and-delete: a key used again
meanwhile is kept) and stays on it while it left some, else goes on to the next shard; a
round over every shard takes `interval`. A store error is logged and counted
(`gpufed_background_errors{task="idempotency-sweep"}`) and the passes back off while it lasts
(up to `interval`): the task never dies of one.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

from broker.api import status
from broker.jobs import book
from broker.state import errors
from broker.telemetry import metrics

logger = logging.getLogger(__name__)

TASK = "idempotency-sweep"
SWEEP_BATCH = 500  # keys deleted per pass, at most
SHARDS = tuple(f"{i:02x}" for i in range(256))
MIN_PAUSE_SECONDS = 0.01  # between passes, at least


def sweep_interval(window: float) -> float:
    """How long a round over every shard takes for a window: a quarter of it, between 1 s and
    10 min."""
    return min(600.0, max(1.0, window / 4))


async def sweep_keys(
    jobs: book.JobBook,
    *,
    shard: str = "",
    batch: int = SWEEP_BATCH,
    now: datetime | None = None,
) -> tuple[int, bool]:
    """One pass over the keys of `shard` ("": every key): delete up to `batch` expired ones,
    expired at `now` (None: the wall clock's now); returns how many and whether expired ones
    are left."""
    now = now if now is not None else status.utcnow()
    entries = await jobs.store.list_idempotent(shard)
    expired = [e for e in entries if jobs.idempotency_expired(e, now=now)]
    deleted = await jobs.store.forget_idempotent(expired[:batch]) if expired else 0
    return deleted, len(expired) > batch


async def run_sweeper(
    jobs: book.JobBook,
    *,
    meters: metrics.BrokerMetrics | None = None,
    interval: float | None = None,
    batch: int = SWEEP_BATCH,
) -> None:
    """Sweep expired keys, a round over every shard each `interval` seconds (default:
    `sweep_interval` of the window), until cancelled."""
    every = interval if interval is not None else sweep_interval(jobs.idempotency_window)
    failures = 0
    position = 0
    while True:
        pause = max(MIN_PAUSE_SECONDS, every / len(SHARDS))
        more = False
        try:
            deleted, more = await sweep_keys(jobs, shard=SHARDS[position], batch=batch)
        except errors.StoreError as exc:
            failures += 1
            logger.warning("sweeping idempotency keys failed (%d in a row): %s", failures, exc)
        except Exception:  # a bug here must not end the sweeps for the broker's lifetime
            failures += 1
            logger.exception("sweeping idempotency keys failed (%d in a row)", failures)
        else:
            failures = 0
            if deleted:
                logger.info("forgot %d expired idempotency keys", deleted)
        if not more:  # else the same shard again: it has expired keys left
            position = (position + 1) % len(SHARDS)
        if failures:
            pause = max(pause, min(every, 2.0**failures))
            if meters is not None:
                meters.background_errors.labels(task=TASK).inc()
        await asyncio.sleep(pause)
