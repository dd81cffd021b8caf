"""Asking the leader what only the leader knows.

Only the leader runs scheduling cycles, so only it holds why a queued job waits (the
cycle's reasons per cluster). A follower asked `GET /v1/jobs/{id}/why` for a queued job
forwards the request, with the caller's own `Authorization`, to the leader's advertised URL
and answers what the leader answers. The forwarded request is marked (`FORWARDED`) and never
forwarded again, so two replicas that each think the other leads cannot bounce it. When the
leader does not answer in time the follower answers from its own cache and says so.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

FORWARDED = "X-Gpufed-Forwarded"
TIMEOUT_SECONDS = 2.0
MAX_ANSWER_BYTES = 1 << 20
SESSION = web.AppKey("forwarding_session", aiohttp.ClientSession)

logger = logging.getLogger(__name__)


async def _session(app: web.Application) -> aiohttp.ClientSession:
    session = app.get(SESSION)
    if session is None or session.closed:
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_SECONDS))
        app[SESSION] = session
    return session


async def close(app: web.Application) -> None:
    session = app.get(SESSION)
    if session is not None:
        await session.close()


def forwardable(request: web.Request, leader: str | None, own: str | None) -> bool:
    """Whether `request` should go to `leader` (a follower's, not already forwarded)."""
    if not leader or request.headers.get(FORWARDED):
        return False
    return own is None or leader.rstrip("/") != own.rstrip("/")


async def ask_leader(request: web.Request, leader: str) -> dict[str, Any] | None:
    """The leader's JSON answer to the same GET, or None if it gave none (down, slow, not
    200): the caller answers from its own view."""
    headers = {FORWARDED: "1"}
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    url = leader.rstrip("/") + request.rel_url.path_qs
    session = await _session(request.app)
    try:
        async with session.get(url, headers=headers, allow_redirects=False) as response:
            if response.status != 200:
                logger.info("the leader %s answered %s to %s", leader, response.status, url)
                return None
            body = await response.content.read(MAX_ANSWER_BYTES + 1)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        logger.info(
            "the leader %s did not answer %s: %s", leader, url, str(exc) or type(exc).__name__
        )
        return None
    if len(body) > MAX_ANSWER_BYTES:
        return None
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None
