"""`GET /v1/jobs`: one page of jobs, live and finished, with a continue token.

Query parameters (all optional; every one given must hold):

- `queue`, `state` (a job state), `cluster`;
- `labelSelector` — Kubernetes' label selector syntax on the job's `metadata.labels`
  (`team=vision,tier in (spot,batch),!debug`);
- `finishedAfter`, `finishedBefore` — RFC 3339 times: finished jobs in `[after, before)`;
- `q` — text (at most `queries.MAX_TEXT` characters) the job's name or id holds, ASCII case
  ignored (queue and cluster have their own filters);
- `sort` — `newest` (the default) or `oldest`, the same order reversed;
- `limit` — 1 to 1,000 jobs a page (default `DEFAULT_LIMIT`); a page also stops before its
  body would pass `--max-page-bytes` (`DEFAULT_PAGE_BYTES`), with a continue token, so that
  a page of large jobs costs the broker and the reader what a page of small ones does (it
  always holds one job, whatever its size: a job is bounded by the store's request size);
- `continue` — the token of the previous page (`metadata.continue`), with the same filters,
  `q` and `sort` (a token carries a digest of them, not them).

The page runs over the book (live jobs and the finished ones not yet retired) and the history
store together (`state.history.listing.page_jobs`), newest first: live jobs by creation, then
finished ones by finish time (`sort=oldest`: finished ones the earliest first, then live ones;
only these two orders, as history pages by indexes ending in the finish time: an order by
another key, GPUs or name, would need an index of its own under every filter). The text and the
order apply to both sides before paging. `metadata.continue` is absent on the last page. A
tenant sees its own jobs; an admin every tenant's. A bad parameter is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from aiohttp import web

from broker.api import errors, jobs, selectors, status
from broker.state.history import held as held_jobs
from broker.state.history import listing, protocol
from broker.state.history import query as queries

DEFAULT_LIMIT = 500
DEFAULT_PAGE_BYTES = 8 * 1024 * 1024  # --max-page-bytes
PAGE_BYTES = web.AppKey("page_bytes", int)  # a page's body stops before this
_HIDDEN = set(status.STORED_ONLY)  # what `JobRecord.api_json` leaves out


def _bad(field: str, problem: str) -> errors.Malformed:
    return errors.Malformed(f"{field}: {problem}", field=field, title="Bad query")


def _time(query: Mapping[str, str], field: str) -> datetime | None:
    text = query.get(field)
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise _bad(field, "an RFC 3339 time, e.g. 2026-12-01T10:00:00Z") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    try:
        queries.to_us(moment)
    except OverflowError:
        raise _bad(field, "a time the history can hold") from None
    return moment


def parse(request: web.Request, *, tenant: str | None) -> tuple[queries.JobQuery, int, str | None]:
    """The query, the page size and the continue token a request asks for."""
    query = request.query
    state = query.get("state")
    if state is not None and state not in {s.value for s in status.JobState}:
        raise _bad("state", f"one of {', '.join(s.value for s in status.JobState)}")
    try:
        limit = int(query.get("limit", str(DEFAULT_LIMIT)))
    except ValueError:
        raise _bad("limit", "a whole number") from None
    if not 1 <= limit <= protocol.MAX_PAGE:
        raise _bad("limit", f"1 to {protocol.MAX_PAGE}")
    text = query.get("q") or None
    if text is not None and len(text) > queries.MAX_TEXT:
        raise _bad("q", f"at most {queries.MAX_TEXT} characters")
    order = query.get("sort", queries.Order.NEWEST.value)
    if order not in {o.value for o in queries.Order}:
        raise _bad("sort", f"one of {', '.join(o.value for o in queries.Order)}")
    selector = query.get(selectors.FIELD)  # a bad one is a 400 naming labelSelector
    labels = selectors.parse(selector) if selector else ()
    job_query = queries.JobQuery(
        tenant=tenant,
        queue=query.get("queue"),
        state=status.JobState(state) if state is not None else None,
        cluster=query.get("cluster"),
        labels=labels,
        finished_after=_time(query, "finishedAfter"),
        finished_before=_time(query, "finishedBefore"),
        text=text,
        order=queries.Order(order),
    )
    return job_query, limit, query.get("continue")


async def page_body(
    held: held_jobs.Held,
    history: protocol.HistoryStore | None,
    job_query: queries.JobQuery,
    *,
    limit: int,
    cont: str | None,
    max_bytes: int = DEFAULT_PAGE_BYTES,
) -> bytes:
    """One page as the API's JSON (a `status.JobList`): up to `limit` jobs, fewer when the
    next would take the body past `max_bytes` (never none), `metadata.continue` unless it
    is the last."""
    found = await listing.page_jobs(held, history, job_query, limit=limit, cont=cont)
    parts: list[str] = []
    size = 64  # the envelope and a token
    token = found.next
    for index, record in enumerate(found.items):
        text = job_json(record)
        size += len(text) + 1
        if parts and size > max_bytes:
            token = queries.encode(queries.Cursor.of(found.items[index - 1]), job_query)
            break
        parts.append(text)
    return list_body(parts, token=token)


def job_json(record: status.JobRecord) -> str:
    """One job as the API shows it (`JobRecord.api_json`), as JSON text."""
    return record.model_dump_json(by_alias=True, exclude=_HIDDEN, context=jobs.AS_VALIDATED)


def list_body(items: list[str], *, token: str | None) -> bytes:
    """A `status.JobList` of jobs already written (`job_json`), `token` its
    `metadata.continue`."""
    meta = status.ListMeta(continue_=token).model_dump_json(by_alias=True)
    return f'{{"items":[{",".join(items)}],"metadata":{meta}}}'.encode()
