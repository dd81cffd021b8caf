"""The group commit: what agents report, written together.

`Grouping` is the part of `book.JobBook` that writes the drafts given to `commit_soon` with the
next flush, many jobs' updates in one transaction (`run_flusher`, or `flush` by a caller
holding the lock), and calls back once a job's draft is in the store (`after_commit`: how a
report is acknowledged only once committed). Its methods use the book's pending drafts and
`_commit` (`_Book`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from broker.api import status
from broker.jobs import launching
from broker.state import errors

logger = logging.getLogger(__name__)


class _Book(launching.Committing, Protocol):
    """What `Grouping` uses of the book it is part of."""

    flush_needed: asyncio.Event
    _after: dict[str, list[Callable[[], None]]]

    def _call(self, job_id: str, callbacks: list[Callable[[], None]]) -> None: ...

    async def flush(self, *, locked: bool = True) -> None: ...


class Grouping:
    """The group commit (mixed into `book.JobBook`, which sets up what `_Book` names)."""

    def commit_soon(self: _Book, draft: status.JobRecord) -> None:
        """Write `draft` with the next group commit (`flush`): for what agents report, many
        updates share one transaction. Until then `latest` shows it and `get` does not; a
        broker that crashes first learns it again from the agent's hello."""
        self._soon[draft.id] = draft
        self.flush_needed.set()

    def after_commit(self: _Book, job_id: str, callback: Callable[[], None]) -> None:
        """Call `callback` once the job as `latest` shows it is in the store: now if nothing of
        it waits for the group commit, else after the commit that writes it; never if that
        write is dropped (a conflict: the record is read again). How agents' reports are
        acknowledged only once committed."""
        if job_id in self._soon:
            self._after.setdefault(job_id, []).append(callback)
        else:
            self._call(job_id, [callback])

    def _committed(self: _Book, job_id: str) -> None:
        callbacks = self._after.pop(job_id, None)
        if callbacks:
            self._call(job_id, callbacks)

    @staticmethod
    def _call(job_id: str, callbacks: list[Callable[[], None]]) -> None:
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a callback's bug must not undo a commit
                logger.exception("after-commit callback of job %s failed", job_id)

    async def flush(self: _Book, *, locked: bool = True) -> None:
        """Commit every draft of `commit_soon`, the caller holding the lock (`locked`), or
        not (the flusher's own: `run_flusher`). On a temporary store error they stay for the
        next flush; on a conflict they are dropped and the records read again.

        Without the lock the store's round trip holds up no collaborator (agents' reports,
        the scheduler): one waits for it only to write a job it writes. A draft given
        meanwhile builds on the one in flight (`latest` shows it until it is applied) and
        goes with the next flush."""
        if self._soon:
            await self._commit(list(self._soon.values()), fenced=True, grouped=True, locked=locked)

    async def run_flusher(
        self: _Book, *, gather_seconds: float = 0.002, on_error: Callable[[], None] | None = None
    ) -> None:
        """Group commit of what agents report, until cancelled; store errors are retried
        (`on_error` counts each)."""
        while True:
            await self.flush_needed.wait()
            self.flush_needed.clear()
            await asyncio.sleep(gather_seconds)
            try:
                await self.flush(locked=False)
            except errors.ConflictError as exc:
                logger.warning("group commit conflicted, records read again: %s", exc)
                if self._soon:  # the drafts of the transactions not tried yet
                    self.flush_needed.set()
            except Exception as exc:  # the store, or a bug: the drafts wait, retried
                logger.warning("group commit of %d jobs failed: %s", len(self._soon), exc)
                if on_error is not None:
                    on_error()
                self.flush_needed.set()
                await asyncio.sleep(0.5)
