"""One page of a job list over the live jobs and the history together (`GET /v1/jobs`).

The caller hands over the jobs it holds in memory (the book: live jobs and the finished ones
not yet retired) and the history store; the page follows the order of `query.py` (live jobs
newest created first, then finished ones newest finished first; or all of it reversed, oldest
first) across both, and its filters, the text search included, apply to both alike. A job found in
both (retired into history, not yet dropped from the book) is listed once, the book's copy.

Read the book before the history, as `page_jobs` does: a job retired between the two reads
is then found twice (and listed once), never missed. The book part reads the book's jobs in
the list's order from the page's place (`held.Held`), up to the `limit + 1` that match: a
page costs what it reads, not every job held (a filter few jobs match reads further); the
history part is one page query.
"""

from __future__ import annotations

from operator import itemgetter

from broker.state.history import held as held_jobs
from broker.state.history import protocol
from broker.state.history import query as queries

FIRST_LIVE = queries.Cursor(True, -(2**63), "")  # before every live job
LAST_FINISHED = queries.Cursor(False, 2**63, "")  # after every finished job


def needs_history(query: queries.JobQuery) -> bool:
    """Whether finished jobs can match (not when a live state is asked for)."""
    return query.state is None or query.state.terminal


async def page_jobs(
    held: held_jobs.Held,
    history: protocol.HistoryStore | None,
    query: queries.JobQuery,
    *,
    limit: int,
    cont: str | None = None,
) -> protocol.Page:
    """Up to `limit` jobs `query` selects after the position `cont` names, from `held` (the
    records in memory in their list order: the book's; `Held.of` puts others in order) and
    `history` (None: none configured)."""
    protocol.check_limit(limit)
    after = queries.decode(cont, query) if cont else None
    newest = query.newest_first

    def behind(key: queries.Cursor, mark: queries.Cursor) -> bool:
        """Whether `key` comes after `mark` in the list's order."""
        return key < mark if newest else key > mark

    live_only = query.state is not None and not query.state.terminal
    start = after  # where the book's part starts: past the section no job of it is in
    if query.finished_only and newest and (after is None or after.live):
        start = FIRST_LIVE
    elif live_only and not newest and (after is None or not after.live):
        start = LAST_FINISHED
    merged = []
    for key, record in held.walk(newest=newest, after=start, state=query.state):
        if (query.finished_only and key.live) or (live_only and not key.live):
            break  # the rest is the other section
        if query.matches(record):
            merged.append((key, record))
            if len(merged) > limit:
                break
    history_next: str | None = None
    if newest:  # live jobs come first: history only once they leave room on the page
        wanted = sum(1 for key, _ in merged if key.live) <= limit
    else:  # finished jobs come first: history until the reader is in the live section
        wanted = after is None or not after.live
    if history is not None and needs_history(query) and wanted:
        found = await history.page(query, limit=limit, cont=cont)
        history_next = found.next
        seen = {record.id for _, record in merged}
        merged += [
            (queries.Cursor.of(record), record) for record in found.items if record.id not in seen
        ]
        merged.sort(key=itemgetter(0), reverse=newest)
        if history_next is not None:  # past the last row history read, it is not yet known
            boundary = queries.decode(history_next, query)
            merged = [item for item in merged if not behind(item[0], boundary)]
    page = merged[:limit]
    if not page:  # history's rows were all unreadable: go on where it stopped
        return protocol.Page([], history_next)
    more = len(merged) > limit or history_next is not None
    token = queries.encode(page[-1][0], query) if more else None
    return protocol.Page([record for _, record in page], token)
