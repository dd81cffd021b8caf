"""Array routes: `DELETE /v1/arrays/{array}` cancels an array's jobs (`api.arrays`).

`{array}` is an array's id, or its name: the caller's newest array of that name. Without
`index` every job of it not finished yet is cancelled, each as `DELETE /v1/jobs/{id}` would;
`?index=i` cancels the one job of index `i`. The answer (202) lists the array's jobs as
committed, finished ones too. Listing is `GET /v1/jobs?labelSelector=gpufed.io/array=<name>`
(with `,gpufed.io/array-index=<i>` for one index), over live and finished jobs alike.
"""

from __future__ import annotations

from aiohttp import web

from broker.api import errors, status
from broker.http import auth, keys


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
    out = []
    for member in chosen:
        if member.status.state.terminal:
            out.append(member)
            continue
        cancelled = await book.cancel(member.id, by=principal.describe())
        out.append(cancelled or member)
    body = status.JobList(items=out)
    return web.json_response(body.api_json(), status=202)


def add_routes(app: web.Application) -> None:
    app.router.add_delete("/v1/arrays/{array}", cancel_array)
