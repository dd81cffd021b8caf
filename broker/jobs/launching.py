"""The dispatch's commit: drafted under the book's lock, written without it.

`Launching` is the part of `book.JobBook` that writes a set of drafts while the lock is free:
`launch` (the caller holds the lock) shows the drafts through `latest` and registers them as
writes in flight, `land` writes them. Whatever a collaborator drafts of those jobs meanwhile
builds on them, and its commit waits for their write (`JobBook._after_writes_of`); a draft
that does not land is marked lost, and what was drafted on it is refused (ConflictError):
it never lands on a record that is not the one it was built on. Its methods use the book's
write tracking, `_commit` and `get` (`_Book`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from broker.api import status
from kits import tables


@dataclass(frozen=True)
class Launch:
    """A commit started under the lock and written without it (`JobBook.launch`): its
    drafts, and per job a future set once its write has landed or failed."""

    drafts: dict[str, status.JobRecord]
    done: dict[str, asyncio.Future[None]]


class Committing(Protocol):
    """The book's `_commit`, as the parts of the book that write through it see it."""

    _soon: dict[str, status.JobRecord]

    async def _commit(
        self,
        drafts: Sequence[status.JobRecord],
        *,
        fenced: bool,
        grouped: bool,
        locked: bool,
        own: Launch | None = None,
    ) -> None: ...


class _Book(Committing, Protocol):
    """What `Launching` uses of the book it is part of."""

    _flying: dict[str, status.JobRecord]
    _lost: dict[str, status.JobEvent]
    _writes: dict[str, set[asyncio.Future[None]]]

    def get(self, job_id: str) -> status.JobRecord | None: ...

    def _settle(self, launch: Launch | None, job_ids: Iterable[str]) -> None: ...

    def _write_over(self, job_id: str, done: asyncio.Future[None]) -> None: ...


class Launching:
    """Commits written without the lock (mixed into `book.JobBook`, which sets these up)."""

    def settled(self: _Book, job_id: str) -> bool:
        """Whether nothing of the job waits to be written or is being written: a draft of it
        now is built on what the store has (what `launch` takes)."""
        return job_id not in self._soon and job_id not in self._writes

    def launch(self: _Book, drafts: Sequence[status.JobRecord]) -> Launch:
        """Start a fenced commit of `drafts` that goes on once the caller lets the lock go
        (`land`): the caller holds the lock, and every job drafted is `settled`. Until a
        job's write has landed `latest` shows its draft, and any commit of it waits (its
        compare-and-swap is then against the revision that write made); a draft that does
        not land takes down what was drafted on it meanwhile (ConflictError). How the
        scheduler's dispatch writes without holding agents' reports and cancels up for the
        store's round trip."""
        loop = asyncio.get_running_loop()
        launch = Launch({}, {})
        for draft in drafts:
            self._flying[draft.id] = launch.drafts[draft.id] = draft
            launch.done[draft.id] = future = loop.create_future()
            self._writes.setdefault(draft.id, set()).add(future)
        return launch

    async def land(self: _Book, launch: Launch) -> None:
        """Write what `launch` started, without the lock; as `commit` (fenced), errors and
        all. A draft that did not land leaves its job as the store has it."""
        try:
            drafts = list(launch.drafts.values())
            await self._commit(drafts, fenced=True, grouped=False, locked=False, own=launch)
        finally:
            self._settle(launch, list(launch.done))

    def _settle(self: _Book, launch: Launch | None, job_ids: Iterable[str]) -> None:
        """The writes of these jobs of `launch` are over (landed, or not: then marked lost)."""
        if launch is None:
            return
        for job_id in job_ids:
            future = launch.done.get(job_id)
            if future is None or future.done():
                continue
            draft = launch.drafts[job_id]
            if self._flying.get(job_id) is draft:
                del self._flying[job_id]
                tables.shrink(self._flying)
            self._write_over(job_id, future)
            if self.get(job_id) is not draft and draft.status.events:
                self._lost[job_id] = draft.status.events[-1]
            future.set_result(None)

    def _built_on_lost(self: _Book, record: status.JobRecord) -> bool:
        """Whether `record` was drafted on a launched draft that did not land."""
        lost = self._lost.get(record.id)
        return lost is not None and any(event is lost for event in record.status.events)
