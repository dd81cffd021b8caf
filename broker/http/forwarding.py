"""Asking the leader what only the leader knows.

Only the leader runs scheduling cycles, so only it holds why a queued job waits (the
cycle's reasons per cluster). A follower asked `GET /v1/jobs/{id}/why` for a queued job
forwards the request, with the caller's own `Authorization`, to the leader's advertised URL
and answers what the leader answers. The forwarded request is marked (`FORWARDED`) and never
forwarded again, so two replicas that each think the other leads cannot bounce it. When the
leader does not answer in time the follower answers from its own cache and says so.

With TLS (`--tls-cert`), replicas reach each other over HTTPS at their advertised URLs:
`configure` gives the CA their certificates are signed by (`--peer-ca-file`; default the
system's CAs) and the name those certificates hold (`--peer-server-name`; default each URL's
host), since a replica usually advertises its pod address, which no certificate names.
"""

from __future__ import annotations

import json
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

FORWARDED = "X-Gpufed-Forwarded"
TIMEOUT_SECONDS = 2.0
MAX_ANSWER_BYTES = 1 << 20
logger = logging.getLogger(__name__)


@dataclass
class Peers:
    """How a replica verifies another's certificate (the CA, the name it must hold), and the
    client session it asks with (made on first use)."""

    ca_file: Path | None = None
    server_name: str | None = None
    session: aiohttp.ClientSession | None = None


PEERS = web.AppKey("forwarding_peers", Peers)


def install(app: web.Application) -> None:
    """Before the app starts: where the session will be kept, closed at cleanup."""
    if PEERS not in app:
        app[PEERS] = Peers()
        app.on_cleanup.append(close)


def configure(app: web.Application, *, ca_file: Path | None, server_name: str | None) -> None:
    install(app)
    app[PEERS].ca_file = ca_file
    app[PEERS].server_name = server_name


async def _session(peers: Peers) -> aiohttp.ClientSession:
    if peers.session is None or peers.session.closed:
        verify: ssl.SSLContext | bool = True
        if peers.ca_file is not None:  # read when the session is made (a CA rotates rarely)
            verify = ssl.create_default_context(cafile=str(peers.ca_file))
        peers.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_SECONDS),
            connector=aiohttp.TCPConnector(ssl=verify),
        )
    return peers.session


async def close(app: web.Application) -> None:
    peers = app.get(PEERS)
    if peers is not None and peers.session is not None:
        await peers.session.close()


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
    peers = request.app[PEERS]
    session = await _session(peers)
    name = peers.server_name if url.startswith("https:") else None
    try:
        async with session.get(
            url, headers=headers, allow_redirects=False, server_hostname=name
        ) as response:
            if response.status != 200:
                logger.info("the leader %s answered %s to %s", leader, response.status, url)
                return None
            body = await response.content.read(MAX_ANSWER_BYTES + 1)
    except (aiohttp.ClientError, OSError, TimeoutError, ssl.SSLError) as exc:
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
