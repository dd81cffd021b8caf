"""The jobs a book holds in the order lists show them (`query.Cursor`), kept as they change:
a page of `GET /v1/jobs` reads from its place in that order and stops once it is full,
instead of filtering and sorting every job held, a cost that grows with the book.

Sorted lists of keys (every job, and each state's jobs apart) in chunks of at most
`2 * LOAD` (a plain list of 100,000 would move 800 KB on each insert): an insert or a
removal costs a bisection over the chunks' last keys, one inside a chunk and a short move;
a walk from a key, one bisection and then each key in turn. Keys are plain tuples, which
compare in C; a walk hands them out as `Cursor`s.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator

from broker.api import status
from broker.state.history import query as queries
from kits import tables

Key = tuple[bool, int, str]  # a Cursor's fields: (live, time in µs, job id)
LOAD = 256


def key_of(record: status.JobRecord) -> Key:
    cursor = queries.Cursor.of(record)
    return (cursor.live, cursor.time_us, cursor.job_id)


class _Ordered:
    """Keys in order, in chunks."""

    def __init__(self) -> None:
        self.keys: dict[str, Key] = {}
        self.chunks: list[list[Key]] = []
        self.last: list[Key] = []  # each chunk's greatest key

    def put(self, job_id: str, key: Key) -> None:
        old = self.keys.get(job_id)
        if old == key:
            return
        if old is not None:
            self._remove(old)
        self.keys[job_id] = key
        self._insert(key)

    def drop(self, job_id: str) -> None:
        old = self.keys.pop(job_id, None)
        if old is not None:
            self._remove(old)
            tables.shrink(self.keys)

    def walk(self, *, newest: bool, after: queries.Cursor | None) -> Iterator[Key]:
        """The keys in order (`newest`: greatest first) after `after` (None: all)."""
        chunks, last = self.chunks, self.last
        mark = None if after is None else (after.live, after.time_us, after.job_id)
        if newest:
            at = len(chunks) - 1 if mark is None else bisect.bisect_left(last, mark)
            at = min(at, len(chunks) - 1)
            while at >= 0:
                chunk = chunks[at]
                end = len(chunk) if mark is None else bisect.bisect_left(chunk, mark)
                for index in range(end - 1, -1, -1):
                    yield chunk[index]
                mark = None
                at -= 1
        else:
            at = 0 if mark is None else bisect.bisect_right(last, mark)
            while at < len(chunks):
                chunk = chunks[at]
                begin = 0 if mark is None else bisect.bisect_right(chunk, mark)
                for index in range(begin, len(chunk)):
                    yield chunk[index]
                mark = None
                at += 1

    def _insert(self, key: Key) -> None:
        chunks, last = self.chunks, self.last
        if not chunks:
            chunks.append([key])
            last.append(key)
            return
        at = min(bisect.bisect_left(last, key), len(chunks) - 1)
        chunk = chunks[at]
        bisect.insort(chunk, key)
        last[at] = chunk[-1]
        if len(chunk) > 2 * LOAD:  # split in two
            chunks.insert(at + 1, chunk[LOAD:])
            del chunk[LOAD:]
            last[at] = chunk[-1]
            last.insert(at + 1, chunks[at + 1][-1])

    def _remove(self, key: Key) -> None:
        chunks, last = self.chunks, self.last
        at = bisect.bisect_left(last, key)
        chunk = chunks[at]
        del chunk[bisect.bisect_left(chunk, key)]
        if chunk:
            last[at] = chunk[-1]
        else:
            del chunks[at]
            del last[at]


class Held:
    """Every job held in list order, and each state's jobs apart (a list of one state's
    jobs reads only those: the running ones under 40,000 queued, say)."""

    def __init__(self, lookup: Callable[[str], status.JobRecord | None]) -> None:
        self._lookup = lookup
        self._all = _Ordered()
        self._states: dict[status.JobState, _Ordered] = {}
        self._state_of: dict[str, status.JobState] = {}

    @classmethod
    def of(cls, records: Iterable[status.JobRecord]) -> Held:
        """The records given, in order (a list not kept by a book: tests, a snapshot)."""
        by_id = {record.id: record for record in records}
        made = cls(by_id.get)
        for record in by_id.values():
            made.put(record)
        return made

    def __len__(self) -> int:
        return len(self._all.keys)

    def put(self, record: status.JobRecord) -> None:
        """The record as it is now (new, or its place changed: it finished)."""
        key = key_of(record)
        self._all.put(record.id, key)
        state = record.status.state
        was = self._state_of.get(record.id)
        if was is not None and was != state:
            self._states[was].drop(record.id)
        self._state_of[record.id] = state
        self._states.setdefault(state, _Ordered()).put(record.id, key)

    def drop(self, job_id: str) -> None:
        self._all.drop(job_id)
        was = self._state_of.pop(job_id, None)
        if was is not None:
            self._states[was].drop(job_id)
            tables.shrink(self._state_of)

    def walk(
        self,
        *,
        newest: bool,
        after: queries.Cursor | None,
        state: status.JobState | None = None,
    ) -> Iterator[tuple[queries.Cursor, status.JobRecord]]:
        """The records in list order (`newest`: greatest key first) after `after`
        (None: from the start), each with its place; `state`: of that state only."""
        ordered = self._all if state is None else self._states.get(state)
        if ordered is None:
            return
        for key in ordered.walk(newest=newest, after=after):
            record = self._lookup(key[2])
            if record is not None:
                yield queries.Cursor(*key), record
