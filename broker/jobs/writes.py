"""This replica's writes of the book in flight, per job they write.

The book, its group commit, its creation of new jobs and its launches all write through the
store; each write is known here from its start until it has returned and been applied, so
that a commit of a job can wait for the writes of it before it (its compare-and-swap is then
against the revision they make), and the watch can tell this replica's own changes from
another replica's (`writes_in_flight`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


class Writes:
    """Futures of the writes in flight, per job; each is done once its write is over."""

    def __init__(self) -> None:
        self._of: dict[str, set[asyncio.Future[None]]] = {}

    async def run(self, job_ids: Iterable[str], write: Awaitable[T]) -> T:
        """Run one store write of these jobs, known as in flight until it returns (and the
        caller, without awaiting again, has applied it)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ids = list(job_ids)
        for job_id in ids:
            self.add(job_id, done)
        try:
            return await write
        finally:
            for job_id in ids:
                self.over(job_id, done)
            done.set_result(None)

    def add(self, job_id: str, done: asyncio.Future[None]) -> None:
        """A write of the job, known by `done`, is in flight (until `over`)."""
        self._of.setdefault(job_id, set()).add(done)

    def over(self, job_id: str, done: asyncio.Future[None]) -> None:
        """A write of the job (known by `done`) is no longer in flight."""
        waiting = self._of.get(job_id)
        if waiting is not None:
            waiting.discard(done)
            if not waiting:
                del self._of[job_id]

    def busy(self, job_id: str) -> bool:
        """Whether a write of the job is in flight."""
        return job_id in self._of

    def of(self, job_id: str) -> list[asyncio.Future[None]]:
        """The futures of the job's writes in flight now."""
        return list(self._of.get(job_id, ()))

    async def wait_for(
        self, job_ids: Iterable[str], *, but: frozenset[asyncio.Future[None]] = frozenset()
    ) -> None:
        """Until no write of these jobs is in flight (and each has been applied), but those
        of `but` (a launch's own)."""
        ids = list(job_ids)
        while True:
            pending = {done for job_id in ids for done in self._of.get(job_id, ())} - but
            if not pending:
                return
            await asyncio.wait(pending)
