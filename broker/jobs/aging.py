"""The book's finished jobs in the order they age out of the hot store, kept as they finish:
what `retiring` reads each pass, in O(what it retires) instead of a pass over every finished
job the book holds (an hour of them at the default retention).

Two heaps of entries: every finished job by when it finished; those with a
`ttlSecondsAfterFinished` also by when it passes. An entry stands while the book holds the
job finished at that time; the others (retired, re-queued, a copy with another time) are
skipped where a walk meets them and dropped once they reach a root. A walk reads a heap from
its root without popping it (a pass that fails leaves everything as it was), down to the
first entry not yet due: nothing below it is.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta

from broker.api import status
from broker.state.history import query as queries

Lookup = Callable[[str], status.JobRecord | None]  # the book's record of a job
Entry = tuple[datetime, str, datetime]  # (key: finished or expiry, job id, finished)


class Aging:
    def __init__(self, lookup: Lookup, count: Callable[[], int]) -> None:
        self._lookup = lookup
        self._count = count  # finished jobs the book holds: stale entries past twice that go
        self._finished: list[Entry] = []  # by finished time
        self._ttl: list[Entry] = []  # by finished + ttlSecondsAfterFinished

    def note(self, before: status.JobRecord | None, after: status.JobRecord) -> None:
        """A committed change: a job that finished (or finished at another time) is filed."""
        if not after.status.state.terminal:
            return
        finished = queries.finished_at(after)
        ttl = after.job.spec.ttl_seconds_after_finished
        if (
            before is not None
            and before.status.state.terminal
            and queries.finished_at(before) == finished
            and before.job.spec.ttl_seconds_after_finished == ttl
        ):
            return  # a late report after the end: its entries stand
        self._push(self._finished, (finished, after.id, finished))
        if ttl is not None:
            self._push(self._ttl, (finished + timedelta(seconds=ttl), after.id, finished))

    def due(self, *, now: datetime, retain: float | None, batch: int) -> list[status.JobRecord]:
        """The finished jobs to retire at `now`, oldest finished first, at most `batch`:
        those finished more than `retain` seconds ago (None: none by age), and those whose
        own TTL has passed (each kept for the shorter of the two)."""
        found: dict[str, tuple[datetime, status.JobRecord]] = {}
        if retain is not None:
            cut = now - timedelta(seconds=retain)
            for finished, record in self._walk(self._finished, before=cut):
                found[record.id] = (finished, record)
                if len(found) >= batch:
                    break
        for finished, record in self._walk(self._ttl, before=now):
            found.setdefault(record.id, (finished, record))
        ordered = sorted(found.values(), key=lambda item: (item[0], item[1].id))
        return [record for _, record in ordered[:batch]]

    def next_due(self) -> datetime | None:
        """When the next job's own TTL passes (None: no finished job has one)."""
        self._trim(self._ttl)
        return self._ttl[0][0] if self._ttl else None

    def _push(self, heap: list[Entry], entry: Entry) -> None:
        heapq.heappush(heap, entry)
        if len(heap) > 2 * self._count() + 64:  # mostly stale: once in a while
            timed = heap is self._ttl
            heap[:] = list({e for e in heap if self._stands(e, timed=timed) is not None})
            heapq.heapify(heap)

    def _stands(self, entry: Entry, *, timed: bool) -> status.JobRecord | None:
        """The record the entry stands for: finished at its time (and, `timed`, an entry
        keyed by when its TTL passes, with that TTL); None: it stands for nothing now."""
        key, job_id, finished = entry
        record = self._lookup(job_id)
        if record is None or not record.status.state.terminal:
            return None
        if queries.finished_at(record) != finished:
            return None
        if not timed:
            return record
        ttl = record.job.spec.ttl_seconds_after_finished
        return record if ttl is not None and finished + timedelta(seconds=ttl) == key else None

    def _trim(self, heap: list[Entry]) -> None:
        while heap and self._stands(heap[0], timed=heap is self._ttl) is None:
            heapq.heappop(heap)

    def _walk(
        self, heap: list[Entry], *, before: datetime
    ) -> Iterator[tuple[datetime, status.JobRecord]]:
        """(finished, record) of the standing entries keyed before `before`, in key order."""
        self._trim(heap)
        seen: set[str] = set()
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            entry, at = heapq.heappop(frontier)
            if entry[0] >= before:
                continue  # nor is anything below it due
            for child in (2 * at + 1, 2 * at + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            record = self._stands(entry, timed=heap is self._ttl)
            if record is not None and entry[1] not in seen:
                seen.add(entry[1])
                yield entry[2], record
