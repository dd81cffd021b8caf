"""The group commit: what agents report, written together.

`GroupCommit` holds the drafts given to `put` (the book's `commit_soon`) until the next
flush writes them, many jobs' updates in one transaction (`run`, or `flush` by a caller
holding the book's lock), and calls back once a job's draft is in the store (`after_commit`:
how a report is acknowledged only once committed). It owns the drafts waiting and the
callbacks; the write itself is the book's (`write`, given at construction), which takes
each draft out of `pending` and calls `committed` once it is applied.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

from broker.api import status
from broker.state import errors

logger = logging.getLogger(__name__)


class Write(Protocol):
    """The book's commit of grouped drafts (`locked`: the caller holds the book's lock)."""

    def __call__(self, drafts: Sequence[status.JobRecord], *, locked: bool) -> Awaitable[None]: ...


class GroupCommit:
    """Drafts waiting for the next group commit, and what to call once each is written."""

    def __init__(self, write: Write) -> None:
        self._write = write
        self.pending: dict[str, status.JobRecord] = {}  # per job, the draft to write
        self._after: dict[str, list[Callable[[], None]]] = {}  # see `after_commit`
        self.needed = asyncio.Event()  # something is pending: the flusher wakes

    def put(self, draft: status.JobRecord) -> None:
        """Write `draft` with the next flush (the book's `commit_soon`)."""
        self.pending[draft.id] = draft
        self.needed.set()

    def after_commit(self, job_id: str, callback: Callable[[], None]) -> None:
        """Call `callback` once the job as the book's `latest` shows it is in the store: now
        if nothing of it waits for the group commit, else after the commit that writes it;
        never if that write is dropped (a conflict: the record is read again)."""
        if job_id in self.pending:
            self._after.setdefault(job_id, []).append(callback)
        else:
            _call(job_id, [callback])

    def committed(self, job_id: str) -> None:
        """The job's pending draft is written and applied: its callbacks are due."""
        callbacks = self._after.pop(job_id, None)
        if callbacks:
            _call(job_id, callbacks)

    def drop(self, job_ids: Iterable[str]) -> None:
        """Forget what waits for the group commit of these jobs (never acknowledged: agents
        send final reports again)."""
        for job_id in job_ids:
            self.pending.pop(job_id, None)
            self._after.pop(job_id, None)

    async def flush(self, *, locked: bool = True) -> None:
        """Commit every pending draft, the caller holding the book's lock (`locked`), or not
        (the flusher's own: `run`). On a temporary store error they stay for the next flush;
        on a conflict they are dropped and the records read again.

        Without the lock the store's round trip holds up no collaborator (agents' reports,
        the scheduler): one waits for it only to write a job it writes. A draft given
        meanwhile builds on the one in flight (`latest` shows it until it is applied) and
        goes with the next flush."""
        if self.pending:
            await self._write(list(self.pending.values()), locked=locked)

    async def run(
        self, *, gather_seconds: float = 0.002, on_error: Callable[[], None] | None = None
    ) -> None:
        """Group commit of what agents report, until cancelled; store errors are retried
        (`on_error` counts each)."""
        while True:
            await self.needed.wait()
            self.needed.clear()
            await asyncio.sleep(gather_seconds)
            try:
                await self.flush(locked=False)
            except errors.ConflictError as exc:
                logger.warning("group commit conflicted, records read again: %s", exc)
                if self.pending:  # the drafts of the transactions not tried yet
                    self.needed.set()
            except Exception as exc:  # the store, or a bug: the drafts wait, retried
                logger.warning("group commit of %d jobs failed: %s", len(self.pending), exc)
                if on_error is not None:
                    on_error()
                self.needed.set()
                await asyncio.sleep(0.5)


def _call(job_id: str, callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:  # a callback's bug must not undo a commit
            logger.exception("after-commit callback of job %s failed", job_id)
