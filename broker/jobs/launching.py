"""The dispatch's commit: drafted under the book's lock, written without it.

`Launches` writes a set of drafts while the lock is free: `launch` (the caller holds the
lock) shows the drafts through the book's `latest` and registers them as writes in flight,
`land` writes them. Whatever a collaborator drafts of those jobs meanwhile builds on them,
and its commit waits for their write (`writes.Writes.wait_for`); a draft that does not land
is marked lost, and what was drafted on it is refused (ConflictError): it never lands on a
record that is not the one it was built on. It owns the drafts in flight and the lost ones;
it is given the book's writes in flight, its `get` and its commit (`write`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from broker.api import status
from broker.jobs import writes
from kits import tables


@dataclass(frozen=True)
class Launch:
    """A commit started under the lock and written without it (`Launches.launch`): its
    drafts, and per job a future set once its write has landed or failed."""

    drafts: dict[str, status.JobRecord]
    done: dict[str, asyncio.Future[None]]


class Launches:
    """Commits written without the lock: the drafts in flight, and those that did not land."""

    def __init__(
        self,
        in_flight: writes.Writes,
        *,
        get: Callable[[str], status.JobRecord | None],
        write: Callable[[Launch], Awaitable[None]],
    ) -> None:
        self._writes = in_flight
        self._get = get  # the job as committed
        self._write = write  # the book's fenced commit of a launch's drafts
        self._flying: dict[str, status.JobRecord] = {}  # drafts of a `launch` being written
        # per job, the last event of a launched draft that did not land: what was drafted on
        # it (what `latest` showed meanwhile) must not land either (`built_on_lost`)
        self._lost: dict[str, status.JobEvent] = {}

    def flying(self, job_id: str) -> status.JobRecord | None:
        """The job's draft being written, if any."""
        return self._flying.get(job_id)

    def launch(self, drafts: Sequence[status.JobRecord]) -> Launch:
        """Start a fenced commit of `drafts` that goes on once the caller lets the lock go
        (`land`): the caller holds the lock, and every job drafted is settled (the book's
        `settled`). Until a job's write has landed `latest` shows its draft, and any commit
        of it waits; a draft that does not land takes down what was drafted on it meanwhile
        (ConflictError)."""
        loop = asyncio.get_running_loop()
        launch = Launch({}, {})
        for draft in drafts:
            self._flying[draft.id] = launch.drafts[draft.id] = draft
            launch.done[draft.id] = future = loop.create_future()
            self._writes.add(draft.id, future)
        return launch

    async def land(self, launch: Launch) -> None:
        """Write what `launch` started, without the lock; as the book's `commit` (fenced),
        errors and all. A draft that did not land leaves its job as the store has it."""
        try:
            await self._write(launch)
        finally:
            self.settle(launch, list(launch.done))

    def settle(self, launch: Launch | None, job_ids: Iterable[str]) -> None:
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
            self._writes.over(job_id, future)
            if self._get(job_id) is not draft and draft.status.events:
                self._lost[job_id] = draft.status.events[-1]
            future.set_result(None)

    def any_lost(self) -> bool:
        return bool(self._lost)

    def built_on_lost(self, record: status.JobRecord) -> bool:
        """Whether `record` was drafted on a launched draft that did not land."""
        lost = self._lost.get(record.id)
        return lost is not None and any(event is lost for event in record.status.events)

    def forget(self, job_id: str) -> None:
        """The job left the book."""
        self._lost.pop(job_id, None)
        tables.shrink(self._lost)
