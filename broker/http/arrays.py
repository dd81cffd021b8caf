"""Array routes: `DELETE /v1/arrays/{array}` cancels an array's jobs (`api.arrays`).

`{array}` is an array's id, or its name: the caller's newest array of that name. Without
`index` every job of it not finished yet is cancelled, each as `DELETE /v1/jobs/{id}` would,
a slice at a time with turns of the event loop between (`service.Jobs.cancel_many`: other
tenants' requests are answered meanwhile); `?index=i` cancels the one job of index `i`. The
answer (202) comes once every job is cancelled (or its cancel asked of its agent) and lists
the array's jobs as committed, finished ones too: what `DELETE /v1/jobs/{id}` answers for
each, so that a caller that goes on after it (resubmits, lists) finds them cancelled.
Listing is `GET /v1/jobs?labelSelector=gpufed.io/array=<name>`
(with `,gpufed.io/array-index=<i>` for one index), over live and finished jobs alike.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from broker.api import errors
from broker.http import auth, keys, listing

JOBS_PER_TURN = 200  # jobs of the answer written between two turns of the event loop


def _index(request: web.Request, count: int) -> int | None:
    raw = request.query.get("index")
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) >= count:
        raise errors.Malformed(
            f"index: a whole number from 0 to {count - 1}, got {raw!r}",
            field="index",
            title="Bad index",
        )
    return int(raw)


async def cancel_array(request: web.Request) -> web.Response:
    principal = auth.caller(request)
    book = request.app[keys.JOBS]
    name = request.match_info["array"]
    members = book.array_jobs(principal.tenant, name)
    if not members:
        raise errors.NotFound(f"no array {name!r} with jobs not yet retired")
    count = members[0].array.count if members[0].array is not None else len(members)
    index = _index(request, count)
    chosen = [
        m for m in members if index is None or (m.array is not None and m.array.index == index)
    ]
    if not chosen:
        raise errors.NotFound(f"array {name!r} has no job of index {index} not yet retired")
    live = [m.id for m in chosen if not m.status.state.terminal]
    cancelled = {r.id: r for r in await book.cancel_many(live, by=principal.describe())}
    parts = []
    for at, member in enumerate(chosen):
        if at and at % JOBS_PER_TURN == 0:
            await asyncio.sleep(0)
        parts.append(listing.job_json(cancelled.get(member.id, member)))
    body = listing.list_body(parts, token=None)
    return web.Response(body=body, status=202, content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_delete("/v1/arrays/{array}", cancel_array)
