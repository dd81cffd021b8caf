"""What a job list asks for, in what order it comes, and where a page ends.

The order of every job list, live jobs and history alike, newest first:

1. live jobs (not finished), the most recently created first;
2. then finished jobs, the most recently finished first (`finished_at`: the time of the last
   event into a final state).

Ties are broken by job id (descending), so the order is total and a page ends at a key: the
`Cursor`, the sort key of the last job returned. The next page is every job after that key,
which is why a page is stable while jobs are added (keyset paging, no offsets): a job added
behind the cursor is listed when the reader gets there, one added before it is not listed in
this pass, and none is listed twice or skipped because another came. A job retired from the
hot store into history keeps its key (its finished time), so a reader paging across the move
sees it once (`listing.py` drops the copy seen in both). A job that finishes while a reader is
still in the live section moves to the finished section, ahead of the reader: it is listed
again there.

`JobQuery.order` may ask for the reverse (`Order.OLDEST`): finished jobs the earliest finished
first, then live jobs the earliest created first: the same keys read the other way, so the same
indexes serve it (a job that finishes while such a reader is in the live section has moved
behind it: it is not listed in that pass). No other order is offered: a page of history in any
order must be a range scan of an index ending in that order's key, under every filter, and
history's indexes end in (finished, id) (`sql.py`).

`JobQuery.text` selects jobs whose name (`metadata.name`) or id holds it, ignoring ASCII case
(names and ids are DNS labels: ASCII). Queue and cluster are not searched: they have filters
of their own, exact and indexed.

The continue token is opaque to clients: the cursor and a digest of the query it belongs to,
as URL-safe base64 of a small JSON object. A token that does not decode, or that belongs to
another query (a filter changed between pages), is refused as `Malformed` naming `continue`.
Tokens do not expire: a job pruned meanwhile is simply no longer there.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import NoReturn

from broker.api import errors, selectors, status

FIELD = "continue"
TOKEN_VERSION = 1
MAX_TOKEN_LENGTH = 1024
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MAX_TEXT = 200  # the longest `JobQuery.text`
ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


class Order(enum.Enum):
    """The order of a list (the API's `sort`): newest first (the default) or oldest first."""

    NEWEST = "newest"
    OLDEST = "oldest"


def fold(text: str) -> str:
    """`text` with ASCII capitals made small: the case the text search ignores (SQLite's LIKE
    and PostgreSQL's ILIKE under the "C" collation fold ASCII only, as this does)."""
    return text.translate(ASCII_LOWER)


def to_us(moment: datetime) -> int:
    """Microseconds since the epoch (a naive time is taken as UTC)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - EPOCH) // timedelta(microseconds=1)


def from_us(us: int) -> datetime:
    return EPOCH + timedelta(microseconds=us)


def finished_at(record: status.JobRecord) -> datetime:
    """When a finished job finished: its last event into a final state (else its last event,
    else its creation: a record that lost its events still sorts)."""
    events = record.status.events
    for event in reversed(events):
        if event.state.terminal:
            return event.time
    return events[-1].time if events else record.created


@dataclass(frozen=True, order=True, slots=True)
class Cursor:
    """A job's place in the order; lists run from the greatest key down.

    `live` comes first (True sorts above False); `time_us` is the creation time of a live job,
    the finished time of a finished one.
    """

    live: bool
    time_us: int
    job_id: str

    @classmethod
    def of(cls, record: status.JobRecord) -> Cursor:
        if record.status.state.terminal:
            return cls(False, to_us(finished_at(record)), record.id)
        return cls(True, to_us(record.created), record.id)


@dataclass(frozen=True, slots=True)
class JobQuery:
    """The jobs a list selects; every filter given must hold (None: any).

    `tenant` None lists every tenant's jobs (an admin's list). `labels` is a parsed label
    selector (`broker.api.selectors.parse`) on the job's `metadata.labels`. The finished-time
    window is `[finished_after, finished_before)`; a window selects finished jobs only.
    `text` (None: any) is a substring of the name or the id, ASCII case ignored; `order` the
    order the pages come in.
    """

    tenant: str | None = None
    queue: str | None = None
    state: status.JobState | None = None
    cluster: str | None = None
    labels: selectors.Selector = ()
    finished_after: datetime | None = None
    finished_before: datetime | None = None
    text: str | None = None
    order: Order = Order.NEWEST

    @property
    def newest_first(self) -> bool:
        return self.order is Order.NEWEST

    @property
    def finished_only(self) -> bool:
        """Whether no live job can match (a final state or a finished-time window asked)."""
        return (
            (self.state is not None and self.state.terminal)
            or self.finished_after is not None
            or self.finished_before is not None
        )

    def matches(self, record: status.JobRecord) -> bool:
        """Whether `record` is one this query lists (the same test the stores make in SQL)."""
        if self.tenant is not None and record.tenant != self.tenant:
            return False
        if self.queue is not None and record.job.spec.queue != self.queue:
            return False
        if self.state is not None and record.status.state != self.state:
            return False
        if self.cluster is not None and record.status.cluster != self.cluster:
            return False
        if self.labels and not selectors.matches(self.labels, record.job.metadata.labels):
            return False
        if self.text is not None and not self.matches_text(record):
            return False
        if self.finished_after is None and self.finished_before is None:
            return True
        if not record.status.state.terminal:
            return False
        finished = to_us(finished_at(record))
        if self.finished_after is not None and finished < to_us(self.finished_after):
            return False
        return self.finished_before is None or finished < to_us(self.finished_before)

    def matches_text(self, record: status.JobRecord) -> bool:
        wanted = fold(self.text or "")
        return wanted in fold(record.job.metadata.name) or wanted in fold(record.id)

    def digest(self) -> str:
        """A short digest of the filters: a continue token is good for this query only."""
        window = [
            None if moment is None else to_us(moment)
            for moment in (self.finished_after, self.finished_before)
        ]
        state = None if self.state is None else self.state.value
        described = [self.tenant, self.queue, state, self.cluster, *window]
        described.append(selectors.describe(sorted(self.labels, key=selectors.describe_one)))
        if self.text is not None or self.order is not Order.NEWEST:  # older tokens stay good
            described += [None if self.text is None else fold(self.text), self.order.value]
        text = json.dumps(described, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def encode(cursor: Cursor, query: JobQuery) -> str:
    """The continue token of a page that ended at `cursor`."""
    payload = {
        "v": TOKEN_VERSION,
        "s": "live" if cursor.live else "finished",
        "t": cursor.time_us,
        "i": cursor.job_id,
        "q": query.digest(),
    }
    text = json.dumps(payload, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(text).decode().rstrip("=")


def decode(token: str, query: JobQuery) -> Cursor:
    """The cursor `token` carries; `Malformed` (field `continue`) if it is not one of ours or
    belongs to another query."""
    if not token or len(token) > MAX_TOKEN_LENGTH:
        _refuse("not a continue token of this broker")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        payload = json.loads(raw)
    except (binascii.Error, ValueError):
        _refuse("not a continue token of this broker")
    if not isinstance(payload, dict) or payload.get("v") != TOKEN_VERSION:
        _refuse("not a continue token of this broker (or of another version)")
    section, time_us, job_id = payload.get("s"), payload.get("t"), payload.get("i")
    if (
        section not in ("live", "finished")
        or not isinstance(time_us, int)
        or isinstance(time_us, bool)
        or not isinstance(job_id, str)
    ):
        _refuse("not a continue token of this broker")
    try:
        from_us(time_us)  # a time the stores can hold
    except OverflowError:
        _refuse("not a continue token of this broker")
    if payload.get("q") != query.digest():
        _refuse("the token belongs to another query: list again with the same filters")
    return Cursor(section == "live", time_us, job_id)


def _refuse(problem: str) -> NoReturn:
    raise errors.Malformed(f"{FIELD}: {problem}", field=FIELD, title="Bad query")
