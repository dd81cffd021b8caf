"""Finished jobs move to history; history is pruned: the hot store holds live jobs only.

A job that finished stays in the hot store (etcd or SQLite, and the book in memory) for
`retain` seconds (`--retain-finished`, 1 h by default), so `gpufed get` and the agents' late
reports find it where they always did. Then the leader (`dispatch.leading`) retires it, a
bounded pass at a time (`retire_once`):

1. the book's finished jobs (`book.finished`) that finished before the cut-off, oldest first,
   at most `batch`;
2. written to the history store (`HistoryStore.put_many`: by job id, so a pass cut short after
   this step writes the same rows again next time);
3. deleted from the hot store (`book.retire`: each compared with the revision the book has,
   fenced by the leader's term); the book forgets them once the delete committed, and the
   followers' books when their watch delivers it.

History first, the delete second: a crash between the two leaves a job in both (a list shows
it once: `state.history.listing`), never in neither. A job that changed meanwhile (a late
report, a copy another replica committed) fails its compare and is kept for the next pass.

Every `prune_every` seconds (an hour; a tenth of a TTL shorter than 10 h) the rows that
finished more than `ttl` ago (`--history-ttl`, 7 d) are pruned from history
(`HistoryStore.prune`, in bounded transactions). An Idempotency-Key keeps its own window
(`book.idempotency_window`): a retry of a retired job's key still finds it, in history.

A job's own `spec.ttlSecondsAfterFinished`, when shorter than `retain`, is its retention: it
goes to history that much sooner (`TTLs` wakes a pass when it is due). It still
goes to history rather than nowhere: the TTL is there to keep the live store small, as
Kubernetes' TTL controller keeps etcd small, and history is where gpufed keeps finished jobs
apart from it (`gpufed get`, lists and an Idempotency-Key's replay still find the job). Without
a history store, where finished jobs otherwise stay in the store, a job with a TTL is deleted
once it passes, as Kubernetes deletes a finished Job.

A store error is logged and counted (`gpufed_background_errors{task="retirement"}`) and the
passes back off while it lasts: the task never dies of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import datetime, timedelta

from broker.api import status
from broker.jobs import book
from broker.state import errors
from broker.state.history import protocol as history_store
from broker.telemetry import metrics

logger = logging.getLogger(__name__)

TASK = "retirement"
RETIRE_BATCH = 500  # jobs moved per pass, at most
PRUNE_EVERY_SECONDS = 3600.0
MAX_BACKOFF_SECONDS = 60.0
MIN_TTL_PAUSE_SECONDS = 0.5


def retire_interval(retain: float) -> float:
    """Seconds between passes: a tenth of the retention, between 0.5 s and 60 s."""
    return min(60.0, max(0.5, retain / 10))


def due(
    jobs: book.JobBook, *, now: datetime, retain: float | None, batch: int
) -> list[status.JobRecord]:
    """The finished jobs to retire now, oldest finished first, at most `batch` (`retain`
    None: only the jobs whose TTL has passed), read from the book's `aging` order: a pass
    costs what it retires, not the finished jobs the book holds."""
    return jobs.aging.due(now=now, retain=retain, batch=batch)


class TTLs:
    """A book observer: `added` is set when a job with a `ttlSecondsAfterFinished` finishes,
    so the retirer wakes for it (its time is in the book's `aging`)."""

    def __init__(self) -> None:
        self.added = asyncio.Event()

    def __call__(self, change: book.Change) -> None:
        record = change.after
        if record.job.spec.ttl_seconds_after_finished is not None and (
            record.status.state.terminal
        ):
            self.added.set()

    def next_due(self, jobs: book.JobBook) -> datetime | None:
        """When the next finished job's own TTL passes (None: no finished job has one)."""
        return jobs.aging.next_due()


async def retire_once(
    jobs: book.JobBook,
    history: history_store.HistoryStore | None,
    *,
    retain: float,
    batch: int = RETIRE_BATCH,
    now: datetime | None = None,
) -> tuple[int, bool]:
    """One pass: (jobs moved to history, whether more are due). Without a history, only the
    jobs past their `ttlSecondsAfterFinished` go, deleted (as Kubernetes deletes a Job)."""
    moment = now or status.utcnow()
    keep = retain if history is not None else None
    chosen = due(jobs, now=moment, retain=keep, batch=batch + 1)
    more = len(chosen) > batch
    chosen = chosen[:batch]
    if not chosen:
        return 0, False
    if history is not None:
        await history.put_many(chosen)
    return await jobs.retire(chosen), more


async def run_retirer(
    jobs: book.JobBook,
    history: history_store.HistoryStore | None,
    *,
    retain: float,
    ttl: float,
    meters: metrics.BrokerMetrics | None = None,
    interval: float | None = None,
    prune_every: float = PRUNE_EVERY_SECONDS,
    batch: int = RETIRE_BATCH,
    ttls: TTLs | None = None,
) -> None:
    """Retire finished jobs and prune history until cancelled (`ttls`: the jobs' own TTLs,
    which wake a pass when one passes; without them a TTL is honoured at the next pass)."""
    every = interval if interval is not None else retire_interval(retain)
    prune_every = min(prune_every, max(1.0, ttl / 10))  # a short TTL is kept to closely
    failures = 0
    pruned_at = float("-inf")
    while True:
        pause = every
        try:
            moved, more = await retire_once(jobs, history, retain=retain, batch=batch)
            if moved:
                where = "moved to history" if history is not None else "deleted (their TTL)"
                logger.info("%d finished jobs %s", moved, where)
            if more:
                pause = 0.0  # a backlog (after a long outage, an upgrade): keep going
            if ttls is not None:
                ttls.added.clear()
                ttl_due = ttls.next_due(jobs)
                if ttl_due is not None:  # a job's own TTL, due before the next pass
                    wait = (ttl_due - status.utcnow()).total_seconds()
                    pause = min(pause, max(MIN_TTL_PAUSE_SECONDS, wait))
            if history is not None and time.monotonic() - pruned_at >= prune_every:
                cutoff = status.utcnow() - timedelta(seconds=ttl)
                pruned = await history.prune(cutoff)
                pruned_at = time.monotonic()
                if pruned:
                    logger.info("pruned %d jobs that finished before %s", pruned, cutoff)
            failures = 0
        except errors.NotLeaderError:
            raise  # the term ended: the leader's work stops this task
        except (errors.StoreError, ValueError) as exc:
            failures += 1
            logger.warning("retiring finished jobs failed (%d in a row): %s", failures, exc)
        except Exception:  # a bug here must not end retirement for the broker's lifetime
            failures += 1
            logger.exception("retiring finished jobs failed (%d in a row)", failures)
        if failures:
            pause = max(pause, min(MAX_BACKOFF_SECONDS, 2.0**failures))
            if meters is not None:
                meters.background_errors.labels(task=TASK).inc()
        if ttls is None or failures:
            await asyncio.sleep(pause)
            continue
        with contextlib.suppress(TimeoutError):  # or sooner: a job with a TTL finished
            await asyncio.wait_for(ttls.added.wait(), timeout=pause)
            await asyncio.sleep(MIN_TTL_PAUSE_SECONDS)  # the jobs finishing with it, together
