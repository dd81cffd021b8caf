"""People's tokens from an OpenID Connect provider: JWTs verified against its keys, their
claims read as a tenant and a role.

`Verifier.identify` takes a bearer token that looks like a JWT (and is not in the tokens
file: `auth.Authenticator.authenticate` asks the file first) and returns the `auth.Principal`
it names, or raises `Unauthenticated` (401) for a token that does not verify — bad signature,
another issuer or audience, expired or not yet valid (a leeway of `leeway_seconds` either
side), an algorithm other than RS256 or ES256 — and `Forbidden` (403) for a verified token
that grants no gpufed role, or roles in several tenants. PyJWT checks the signature and the
registered claims; nothing here does cryptography.

The keys (a JWKS) come from a file, an http(s) URL, or the issuer's discovery document
(`/.well-known/openid-configuration`, its `jwks_uri`) when neither is given. A URL is
fetched at start and every `refresh_seconds`; a token whose `kid` is not known fetches
again at once (a provider rotating its keys), at most every `MIN_REFETCH_SECONDS`, and
tokens arriving during that fetch wait for it rather than start their own. A file is read at
start (a bad one stops the broker) and again when it changes (device, inode, size, mtime):
a token of an unknown kid reads it only if it changed, so tokens of made-up kids cost a
`stat`, not a parse.

The claims grant roles as `broker.http.claims` says: fleet roles only from the fleet groups
(`--oidc-fleet-group ROLE=GROUP`; by default `gpufed:admin`, `gpufed:viewer`,
`gpufed:metrics`), tenant roles from `gpufed:TENANT:ROLE` groups or a plain role and the
tenant claim, every tenant a DNS label (and one of `--oidc-tenant` when given). A claim
refused there is logged and counted (`gpufed_oidc_rejected_claims_total{reason}`, every
reason exported from the start). The strongest grant wins; grants in several tenants are
refused (one identity acts for one tenant). Agents never come from OIDC: their tokens (or
certificates) name their cluster.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jwt
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, Field, field_validator

from broker.api import errors
from broker.http import auth, claims, roles, tokens
from kits import tasks

logger = logging.getLogger(__name__)

ALGORITHMS = ("RS256", "ES256")
MIN_REFETCH_SECONDS = 30.0
FETCH_TIMEOUT_SECONDS = 5.0
MAX_JWKS_BYTES = 1024 * 1024
INVALID = {"WWW-Authenticate": 'Bearer error="invalid_token"'}
# how much of a person's name (the username claim) a principal's label keeps
MAX_LABEL_CHARACTERS = 200


class OidcError(Exception):
    """The OIDC keys cannot be used at start (a JWKS file that does not read)."""


class OidcSettings(BaseModel):
    """`--oidc-*`: the provider whose tokens people bring, and how their claims read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    issuer: str = Field(min_length=1)
    audience: str = Field(min_length=1)
    # a JWKS file, or an http(s) URL; None: the issuer's discovery document names it
    jwks: str | None = None
    groups_claim: str = "groups"
    group_prefix: str = "gpufed:"
    role_claim: str | None = None
    tenant_claim: str | None = None
    # what names the person in logs, audit lines and job events
    username_claim: str = "sub"
    leeway_seconds: float = Field(30.0, ge=0, le=300)
    refresh_seconds: float = Field(600.0, gt=0)
    # a token of an unknown kid fetches the keys again, at most this often
    min_refetch_seconds: float = Field(MIN_REFETCH_SECONDS, ge=0)
    # group -> fleet role (admin, viewer, metrics); None: gpufed:admin, :viewer, :metrics
    fleet_groups: dict[str, roles.Role] | None = None
    # the tenants a token may name; None: any DNS label
    tenants: frozenset[str] | None = None

    @field_validator("fleet_groups")
    @classmethod
    def _fleet_roles(cls, value: dict[str, roles.Role] | None) -> dict[str, roles.Role] | None:
        for group, role in (value or {}).items():
            if not group:
                raise ValueError("a fleet group needs a name")
            if role not in claims.FLEET_ROLES:
                raise ValueError(
                    f"group {group!r}: {role.value} is no fleet role (admin, viewer, metrics)"
                )
        return value

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, value: frozenset[str] | None) -> frozenset[str] | None:
        for name in sorted(value or ()):
            if claims.tenant_problem(name, claims.ClaimRules()) is not None:
                raise ValueError(f"tenant {claims.shown(name)} is not a DNS label")
        return value

    @property
    def jwks_is_url(self) -> bool:
        return self.jwks is None or self.jwks.startswith(("http://", "https://"))

    @property
    def rules(self) -> claims.ClaimRules:
        return claims.ClaimRules(
            groups_claim=self.groups_claim,
            group_prefix=self.group_prefix,
            role_claim=self.role_claim,
            tenant_claim=self.tenant_claim,
            fleet_groups=self.fleet_groups,
            tenants=self.tenants,
        )


def parse_fleet_group(text: str) -> tuple[str, roles.Role]:
    """`--oidc-fleet-group ROLE=GROUP` as (group, role); ValueError naming what is wrong."""
    name, equals, group = text.partition("=")
    if not equals or not group:
        raise ValueError(f"{text!r}: give ROLE=GROUP, e.g. admin=platform-admins")
    try:
        role = roles.Role(name)
    except ValueError:
        role = None
    if role is None or role not in claims.FLEET_ROLES:
        raise ValueError(f"{text!r}: {name!r} is no fleet role (admin, viewer, metrics)")
    return group, role


def looks_like_jwt(token: str) -> bool:
    """A compact JWS: three dot-separated parts, the header a JSON object (`eyJ`)."""
    return token.startswith("eyJ") and token.count(".") == 2


class Verifier:
    """The provider's keys, and tokens checked against them (`auth.TokenVerifier`)."""

    def __init__(
        self, settings: OidcSettings, *, registry: CollectorRegistry | None = None
    ) -> None:
        self.settings = settings
        self.rules = settings.rules
        self._keys: dict[str, jwt.PyJWK] = {}  # by kid ("" for a key without one)
        self._fetched_at = -float("inf")
        self._file_signature: tokens.Signature = None  # the file as last read, or tried
        self._fetching = asyncio.Lock()
        self.rejected = Counter(
            "gpufed_oidc_rejected_claims",
            "Claims of verified OIDC tokens that granted nothing, by reason (a tenant not a "
            "DNS label or not accepted, a fleet role outside the fleet groups)",
            ["reason"],
            registry=registry or CollectorRegistry(),
        )
        for reason in claims.REASONS:
            self.rejected.labels(reason=reason)
        if not settings.jwks_is_url:
            self._read_file()

    def recognizes(self, token: str) -> bool:
        return looks_like_jwt(token)

    async def identify(self, token: str) -> auth.Principal:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise errors.Unauthenticated("not a readable JWT", headers=INVALID) from None
        algorithm = header.get("alg")
        if algorithm not in ALGORITHMS:
            raise errors.Unauthenticated(
                f"JWT algorithm {algorithm!r} is not accepted (RS256, ES256)", headers=INVALID
            )
        key = await self._key(str(header.get("kid") or ""))
        verified = self._decode(token, key, algorithm)
        who = _label(verified.get(self.settings.username_claim) or verified.get("sub"))
        mapped = claims.grants_of(verified, self.rules)
        for refusal in mapped.refused:
            self.rejected.labels(reason=refusal.reason).inc()
            logger.warning("OIDC token of %s: %s: it grants nothing", who, refusal.describe())
        grant = claims.choose(mapped, who=who)
        return auth.Principal(grant.role, tenant=grant.tenant, label=who, via="oidc")

    def _decode(self, token: str, key: jwt.PyJWK, algorithm: str) -> dict[str, Any]:
        try:
            return jwt.decode(
                token,
                key=key,
                algorithms=[algorithm],
                audience=self.settings.audience,
                issuer=self.settings.issuer,
                leeway=self.settings.leeway_seconds,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise auth.TokenExpired(
                "this OIDC token has expired: sign in again",
                headers={"WWW-Authenticate": auth.EXPIRED["WWW-Authenticate"]},
            ) from None
        except jwt.InvalidAudienceError:
            raise errors.Unauthenticated(
                f"this OIDC token is not for this broker (audience {self.settings.audience})",
                headers=INVALID,
            ) from None
        except jwt.InvalidIssuerError:
            raise errors.Unauthenticated(
                f"this OIDC token is not from {self.settings.issuer}", headers=INVALID
            ) from None
        except jwt.ImmatureSignatureError:
            raise errors.Unauthenticated(
                "this OIDC token is not valid yet (nbf)", headers=INVALID
            ) from None
        except jwt.PyJWTError as exc:
            # signature, missing claims, a key of another type: named, never the token
            raise errors.Unauthenticated(
                f"this OIDC token does not verify: {type(exc).__name__}", headers=INVALID
            ) from None

    async def _key(self, kid: str) -> jwt.PyJWK:
        key = self._pick(kid)
        if key is None:
            key = await self._reread_for(kid)
        if key is None:
            if not self._keys:
                raise errors.Unavailable(
                    "the OIDC provider's keys could not be fetched yet; retry",
                    title="OIDC keys unavailable",
                    headers={"Retry-After": "5"},
                )
            raise errors.Unauthenticated(
                "this OIDC token is signed with a key the provider does not publish",
                headers=INVALID,
            )
        return key

    def _pick(self, kid: str) -> jwt.PyJWK | None:
        if kid:
            return self._keys.get(kid)
        return next(iter(self._keys.values())) if len(self._keys) == 1 else None

    # ---- the keys --------------------------------------------------------------------------

    async def _reread_for(self, kid: str) -> jwt.PyJWK | None:
        """The key of a kid not known, after reading the keys again if that may find it: a
        file only if it changed, a URL at most every `min_refetch_seconds`. A token arriving
        while the keys are being read waits for that read and looks again."""
        async with self._fetching:
            key = self._pick(kid)  # what the read it waited for found
            if key is not None:
                return key
            if self.settings.jwks_is_url:
                since = time.monotonic() - self._fetched_at
                if since < self.settings.min_refetch_seconds:
                    return None
            elif not self.file_changed():
                return None
            await self._reread(why=f"unknown kid {claims.shown(kid)}" if kid else "no key yet")
            return self._pick(kid)

    async def refresh(self, *, why: str) -> bool:
        """Read the keys again (URL or file); True if they now apply. A failure keeps the
        keys there were, logged."""
        async with self._fetching:
            return await self._reread(why=why)

    async def _reread(self, *, why: str) -> bool:
        self._fetched_at = time.monotonic()
        try:
            if self.settings.jwks_is_url:
                document = await self._fetch_jwks()
                self._keys = parse_jwks(document, where="the OIDC JWKS")
            else:
                self._read_file()
        except OidcError as exc:
            logger.error("%s (%s): keeping the %d keys there were", exc, why, len(self._keys))
            return False
        logger.info("OIDC keys read (%s): %d keys", why, len(self._keys))
        return True

    def _read_file(self) -> None:
        path = Path(self.settings.jwks or "")
        # taken before reading, so a change meanwhile shows; kept whether the read works or
        # not, so a file that does not read is tried again once it changes, not per token
        signature = tokens.file_signature(path)
        self._file_signature = signature
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise OidcError(f"OIDC JWKS file {path}: cannot read it: {exc.strerror}") from None
        self._keys = parse_jwks(_json(raw, where=f"OIDC JWKS file {path}"), where=str(path))

    def file_changed(self) -> bool:
        if self.settings.jwks_is_url:
            return False
        now = tokens.file_signature(Path(self.settings.jwks or ""))
        return now is not None and now != self._file_signature

    async def _fetch_jwks(self) -> Any:
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_SECONDS)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            url = self.settings.jwks
            if url is None:
                discovery = self.settings.issuer.rstrip("/") + "/.well-known/openid-configuration"
                found = await _get_json(session, discovery)
                url = found.get("jwks_uri") if isinstance(found, dict) else None
                if not isinstance(url, str):
                    raise OidcError(f"OIDC discovery {discovery}: no jwks_uri")
            return await _get_json(session, url)

    async def run(self) -> None:
        """Keep the keys fresh: a URL at start and every `refresh_seconds`, a file when it
        changes (looked at every second). One failure does not stop it."""
        url = self.settings.jwks_is_url
        due = time.monotonic() if url else float("inf")
        while True:
            try:
                if url and time.monotonic() >= due:
                    due = time.monotonic() + self.settings.refresh_seconds
                    await self.refresh(why="periodic" if self._keys else "start")
                elif not url and self.file_changed():
                    await self.refresh(why="file changed")
            except Exception:
                logger.exception("refreshing the OIDC keys failed")
            await asyncio.sleep(min(1.0, max(0.0, due - time.monotonic())) if url else 1.0)


def _label(name: object) -> str:
    """What names the person in problems, logs and job events: the claim's text, at most
    `MAX_LABEL_CHARACTERS` of it."""
    text = str(name) if name else "?"
    if len(text) <= MAX_LABEL_CHARACTERS:
        return text
    return text[: MAX_LABEL_CHARACTERS - 1] + "…"


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    try:
        async with session.get(url) as answer:
            if answer.status != 200:
                raise OidcError(f"OIDC {url}: HTTP {answer.status}")
            raw = await answer.content.read(MAX_JWKS_BYTES + 1)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise OidcError(f"OIDC {url}: {type(exc).__name__}: {exc}") from None
    if len(raw) > MAX_JWKS_BYTES:
        raise OidcError(f"OIDC {url}: larger than {MAX_JWKS_BYTES} bytes")
    return _json(raw, where=f"OIDC {url}")


def _json(raw: bytes, *, where: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise OidcError(f"{where}: not JSON") from None


def parse_jwks(document: Any, *, where: str) -> dict[str, jwt.PyJWK]:
    """The signing keys of a JWKS document by kid; OidcError if it has none usable."""
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise OidcError(f"{where}: not a JWKS (a JSON object with a `keys` list)")
    keys: dict[str, jwt.PyJWK] = {}
    for index, data in enumerate(document["keys"]):
        if not isinstance(data, dict) or data.get("use", "sig") != "sig":
            continue
        try:
            key = jwt.PyJWK(data)
        except jwt.PyJWTError as exc:
            logger.warning("%s: keys[%d] skipped: %s", where, index, exc)
            continue
        keys[str(data.get("kid") or "")] = key
    if not keys:
        raise OidcError(f"{where}: no signing key it could use")
    return keys


def install(
    app: web.Application, settings: OidcSettings, *, registry: CollectorRegistry | None = None
) -> Verifier:
    """People's OIDC tokens on `app` (OidcError if a JWKS file does not read): the verifier
    the authenticator asks, its keys kept fresh while the app runs, its counter of refused
    claims on `registry` (the broker's /metrics)."""
    verifier = Verifier(settings, registry=registry)
    app[auth.AUTHENTICATOR].verifier = verifier

    async def refreshing(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(verifier.run(), name="oidc-keys")
        yield
        await tasks.stop_task(task)

    app.cleanup_ctx.append(refreshing)
    return verifier
