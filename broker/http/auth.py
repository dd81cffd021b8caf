"""Who is asking, and whether the route lets them: bearer tokens, principals, the middleware.

A bearer token names a principal (`Principal`: a role, the tenant or cluster it belongs to)
through the tokens file (`broker.http.tokens`: format, reloading). `middleware` runs before
every handler: the route's rule in `roles.ROUTES` says whether a token is needed and which
roles it allows (401 `Unauthenticated`: no token, an unknown one, an expired one; 403
`Forbidden` naming the role needed). Handlers read the caller with `caller` and keep to what
it may see (`Principal.sees`: its own tenant's).

Tokens are compared by SHA-256 digest in constant time, and no answer or log line repeats one.
"""

from __future__ import annotations

import asyncio
import hmac
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from aiohttp import web

from broker.api import errors
from broker.http import peers, roles, tokens
from kits import tasks

CHALLENGE = {"WWW-Authenticate": "Bearer"}
EXPIRED = {"WWW-Authenticate": 'Bearer error="invalid_token", error_description="expired"'}


class TokenExpired(errors.Unauthenticated):
    """A token the file knows, past its `expires`."""

    title = "Token expired"
    problem_type = "urn:gpufed:problem:token-expired"


@dataclass(frozen=True)
class Principal:
    """Who a token names: a role, and the tenant or cluster it belongs to."""

    role: roles.Role
    tenant: str | None = None  # a tenant-admin's, submitter's or viewer's (none: the fleet)
    cluster: str | None = None  # an agent's
    label: str | None = None  # the entry's `name` in the tokens file; an OIDC user's name
    via: str = "token"  # what vouched for it: token (the tokens file), oidc, certificate

    @property
    def name(self) -> str:
        """The tenant it acts for, the agent's cluster, or its role (admin, metrics)."""
        return self.tenant or self.cluster or self.role.value

    @property
    def is_admin(self) -> bool:
        return self.role == roles.Role.ADMIN

    def sees(self, tenant: str) -> bool:
        """Whether it may read what belongs to `tenant` (jobs, queues)."""
        if self.role in (roles.Role.AGENT, roles.Role.METRICS):
            return False
        return self.tenant is None or self.tenant == tenant

    def describe(self) -> str:
        """`submitter of tenant team-a (token ci-a)`: for problems and logs."""
        if self.role == roles.Role.AGENT:
            text = f"agent:{self.cluster}"
        elif self.tenant is not None:
            text = f"{self.role.value} of tenant {self.tenant}"
        elif self.role == roles.Role.VIEWER:
            text = "viewer of the whole fleet"
        else:
            text = self.role.value
        return f"{text} ({self.via} {self.label!r})" if self.label else text


class UnknownToken(errors.Unauthenticated):
    """A bearer token the tokens file does not hold."""


class TokenVerifier(Protocol):
    """Bearer tokens the tokens file does not hold but another authority vouches for
    (`broker.http.oidc.Verifier`: JWTs of an OIDC provider)."""

    def recognizes(self, token: str) -> bool: ...

    async def identify(self, token: str) -> Principal: ...


@dataclass(frozen=True)
class _Grant:
    principal: Principal
    expires: datetime | None


def principal_of_entry(entry: tokens.TokenEntry) -> Principal:
    role, cluster = entry.role_and_cluster()
    return Principal(role, tenant=entry.tenant, cluster=cluster, label=entry.name)


class Authenticator:
    """The tokens that apply now, by digest; `replace` swaps them all at once."""

    def __init__(self, entries: list[tokens.TokenEntry]) -> None:
        self._by_digest: dict[str, _Grant] = {}
        self.verifier: TokenVerifier | None = None  # --oidc-issuer: people's JWTs
        self.replace(entries)

    @classmethod
    def from_file(cls, path: Path) -> Authenticator:
        return cls(tokens.read_file(path))

    def replace(self, entries: list[tokens.TokenEntry]) -> None:
        self._by_digest = {
            entry.digest(): _Grant(principal_of_entry(entry), entry.expires) for entry in entries
        }

    def __len__(self) -> int:
        return len(self._by_digest)

    def identify(self, header: str | None, *, now: datetime | None = None) -> Principal:
        if not header:
            raise errors.Unauthenticated(
                "missing bearer token (Authorization: Bearer <token>)", headers=CHALLENGE
            )
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise errors.Unauthenticated(
                "the Authorization header must be 'Bearer <token>'", headers=CHALLENGE
            )
        digest = tokens.digest(token.strip())
        found: _Grant | None = None
        for known, grant in self._by_digest.items():  # every entry: no early exit to time
            if hmac.compare_digest(known, digest):
                found = grant
        if found is None:
            raise UnknownToken("unknown token", headers=CHALLENGE)
        if found.expires is not None and found.expires <= (now or datetime.now(UTC)):
            when = found.expires.astimezone(UTC).isoformat().replace("+00:00", "Z")
            raise TokenExpired(
                f"this token ({found.principal.describe()}) expired at {when}: "
                "ask for a new one (gpufed token create)",
                headers=EXPIRED,
            )
        return found.principal

    async def authenticate(self, header: str | None) -> Principal:
        """`identify`, and a token the file does not hold that the verifier recognizes (an
        OIDC JWT) checked by it."""
        try:
            return self.identify(header)
        except UnknownToken:
            token = (header or "").partition(" ")[2].strip()
            if self.verifier is None or not self.verifier.recognizes(token):
                raise
        return await self.verifier.identify(token)

    def still_names(self, header: str | None, principal: Principal) -> bool:
        """Whether `header` still names `principal` (not revoked, not expired): what a long
        session, authenticated once, checks again."""
        try:
            return self.identify(header) == principal
        except errors.Unauthenticated:
            return False


AUTHENTICATOR = web.AppKey("authenticator", Authenticator)
ACCESS = web.AppKey("access", Mapping[tuple[str, str], roles.Rule])
PRINCIPAL = web.RequestKey("principal", Principal)


def caller(request: web.Request) -> Principal:
    """Who asks: the principal the middleware identified for the route."""
    return request[PRINCIPAL]


def check(rule: roles.Rule, principal: Principal, *, route: str) -> None:
    """Forbidden (naming the roles needed) unless `rule` lets `principal` call `route`."""
    if principal.role not in rule.roles:
        raise errors.Forbidden(
            f"{route} needs the role {roles.spell(rule.roles)}; "
            f"this token is {principal.describe()}"
        )
    if rule.fleet_wide and principal.tenant is not None:
        raise errors.Forbidden(
            f"{route} shows every tenant's: it needs the role admin, metrics, or viewer "
            f"without a tenant; this token is {principal.describe()}"
        )


@web.middleware
async def middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The route's rule before its handler: every route has one, or the request fails."""
    if request.match_info.http_exception is not None:  # no such route: its 404 or 405
        return await handler(request)
    path = request.match_info.route.resource.canonical if request.match_info.route.resource else ""
    rule = roles.rule_of(request.app[ACCESS], request.method, path)
    if rule is None:  # fails closed; tests/unit/broker/http/test_roles.py keeps it from happening
        raise RuntimeError(f"no access rule for {request.method} {path} in broker.http.roles")
    if not rule.public:
        principal = await _identify(request, rule)
        request[PRINCIPAL] = principal  # before the check: a refusal's audit line names it
        check(rule, principal, route=f"{request.method} {path}")
    return await handler(request)


async def _identify(request: web.Request, rule: roles.Rule) -> Principal:
    """The token's principal; on the agent route of a broker with --client-ca, the cluster of
    the client certificate (required), which a token sent too must name (`broker.http.peers`)."""
    header = request.headers.get("Authorization")
    authenticator = request.app[AUTHENTICATOR]
    if roles.Role.AGENT not in rule.roles or not request.app.get(peers.AGENT_CERTIFICATES):
        return await authenticator.authenticate(header)
    cluster = peers.agent_cluster(request)
    if not header:
        return Principal(roles.Role.AGENT, cluster=cluster, via="certificate")
    principal = authenticator.identify(header)
    if principal.role == roles.Role.AGENT and principal.cluster != cluster:
        raise errors.Forbidden(
            f"the client certificate names cluster {cluster}; this token is {principal.describe()}"
        )
    return principal


def install(
    app: web.Application,
    tokens_file: Path,
    *,
    poll_seconds: float = 1.0,
    sighup: bool = False,
    metrics_public: bool = False,
) -> None:
    """The tokens of `tokens_file` (TokensFileError if it does not read), followed while the
    app runs (every `poll_seconds`, and on SIGHUP if `sighup`), and the routes' rules."""
    authenticator = Authenticator([])
    follower = tokens.Follower(tokens_file, authenticator.replace, poll_seconds=poll_seconds)
    follower.load()
    app[AUTHENTICATOR] = authenticator
    app[ACCESS] = roles.table(metrics_public=metrics_public)

    async def following(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(follower.run(), name="tokens-follow")
        reloads: set[asyncio.Task[bool]] = set()

        def hangup() -> None:
            reload = asyncio.create_task(follower.reload(why="SIGHUP"), name="tokens-reload")
            reloads.add(reload)
            reload.add_done_callback(reloads.discard)

        loop = asyncio.get_running_loop()
        if sighup:
            loop.add_signal_handler(signal.SIGHUP, hangup)
        yield
        if sighup:
            loop.remove_signal_handler(signal.SIGHUP)
        for running in (task, *reloads):
            await tasks.stop_task(running)

    app.cleanup_ctx.append(following)
