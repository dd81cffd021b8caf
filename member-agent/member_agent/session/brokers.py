"""The brokers an agent may connect to, and what a refused handshake means.

`gpufed agent --broker URL1,URL2,URL3` names the replicas of one broker (`parse_urls`). The
session (`connecting.Connector`) connects to `BrokerList.current`: after a connection failure
the next URL of the list (`failed`), with the session's backoff; after a session the broker
welcomed, the same one again first. Only the leader serves agents: a follower refuses the
session with HTTP 409, problem type `urn:gpufed:problem:not-leader`, the leader's URL (or null)
in the body's `leader` and `Retry-After: 1`. The agent connects to that leader next, at once,
even when it is not in the list (`not_leader`), or else to the next URL.

`check_handshake` reads the answer of a refused handshake (aiohttp's `WSServerHandshakeError`
carries no body: it runs as the client session's `raise_for_status`) into the errors below:
`NotLeader`, `AuthError` (401/403: a failover does not help, the token is wrong) or
`SessionError`; `check_close` does the same for a session closed before its welcome.
Neither a 409 nor an auth failure renews the agent's cluster lease.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp

NOT_LEADER = "urn:gpufed:problem:not-leader"
SCHEMES = ("http://", "https://", "ws://", "wss://")
MAX_PROBLEM_BYTES = 64 * 1024


class SessionError(Exception):
    """The broker did not hold up its side of the protocol; the session is opened again."""


class AuthError(SessionError):
    """The broker refused the token (HTTP 401/403, or a session closed with 4001/4003 before
    its welcome): retrying soon will not help."""


class TokenFileError(AuthError):
    """The agent's own token file cannot be read, or is empty: nothing was sent."""


# close codes of a session the broker upgraded and then refused for its credentials: 4001 not
# authenticated, 4003 forbidden (the token, or certificate, of another cluster)
AUTH_CLOSE_CODES = frozenset({4001, 4003})


def check_close(code: int | None, reason: str) -> None:
    """Raise AuthError for a session closed before its welcome for its credentials; else
    nothing (a broker that goes away, a 4009 not-leader, is retried)."""
    if code in AUTH_CLOSE_CODES:
        raise AuthError(f"closed the session with {code}: {reason or 'no reason given'}")


class NotLeader(SessionError):
    """A broker replica that is not the leader refused the session (HTTP 409)."""

    def __init__(self, message: str, *, leader: str | None, retry_after: float) -> None:
        super().__init__(message)
        self.leader = leader
        self.retry_after = retry_after


def parse_urls(text: str) -> tuple[str, ...]:
    """The broker URLs of `--broker` (comma-separated); raises ValueError naming the one that
    is not a URL."""
    urls = tuple(part.strip() for part in text.split(",") if part.strip())
    if not urls:
        raise ValueError("give at least one broker URL")
    for url in urls:
        if not url.startswith(SCHEMES):
            raise ValueError(f"{url!r} is not a broker URL (http://, https://, ws:// or wss://)")
    return urls


def _same(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


@dataclass
class BrokerList:
    """Which broker URL to connect to next."""

    urls: tuple[str, ...]
    index: int = 0
    leader: str | None = None  # named by a follower's 409; tried before the list
    hops: int = 0  # leaders followed since the last welcome or connection failure

    @property
    def current(self) -> str:
        return self.leader or self.urls[self.index]

    def failed(self) -> str:
        """A connection failure (or a session that broke): the next URL of the list. A leader
        named by a 409 that fails is forgotten: the list again, after the URL that named it."""
        if self.leader is not None:
            self.leader = None
        self.index = (self.index + 1) % len(self.urls)
        self.hops = 0
        return self.current

    def not_leader(self, leader: str | None) -> bool:
        """A follower's 409: its `leader` next, if it names one other than itself; else the
        next URL. True when a leader is followed."""
        if leader and not _same(leader, self.current) and leader.startswith(SCHEMES):
            self.leader = leader
            self.hops += 1
            return True
        self.failed()
        return False

    def welcomed(self) -> None:
        """A session the broker welcomed: the same URL first when it ends."""
        self.hops = 0


def _retry_after(response: aiohttp.ClientResponse) -> float:
    try:
        return max(0.0, min(float(response.headers.get("Retry-After", "1")), 60.0))
    except ValueError:
        return 1.0


async def _problem(response: aiohttp.ClientResponse) -> dict[str, object]:
    """The problem JSON of a refusal (bounded); empty when it is not one."""
    try:
        body = await response.content.read(MAX_PROBLEM_BYTES)
        parsed = json.loads(body) if body else {}
    except (aiohttp.ClientError, ValueError, TimeoutError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


async def check_handshake(response: aiohttp.ClientResponse) -> None:
    """Raise what a refused session means (the session's `raise_for_status`); nothing for a
    handshake that goes on."""
    if response.status < 400:
        return
    problem = await _problem(response)
    response.release()
    said = problem.get("detail") or problem.get("title") or response.reason or ""
    text = f"HTTP {response.status} {said}".strip()
    if response.status == 409 and problem.get("type") == NOT_LEADER:
        leader = problem.get("leader")
        raise NotLeader(
            f"{text} (leader: {leader or 'unknown'})",
            leader=leader if isinstance(leader, str) and leader else None,
            retry_after=_retry_after(response),
        )
    if response.status in (401, 403):
        raise AuthError(text)
    raise SessionError(f"{text} at {response.url}")
