"""Bearer-token authentication: a token names a tenant, the agent of one cluster, or an admin.

Tokens come from a YAML file (`config/tokens.yaml`):

    tokens:
      - token: "..."            # or sha256: "<hex digest of the token>"
        tenant: team-a
      - token: "..."
        agent: h100-cluster
      - token: "..."
        admin: true
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

import yaml
from aiohttp import web
from pydantic import BaseModel, ConfigDict, model_validator

from broker.api import errors

CHALLENGE = {"WWW-Authenticate": "Bearer"}


class TokenEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: str | None = None
    sha256: str | None = None
    tenant: str | None = None
    agent: str | None = None
    admin: bool = False

    @model_validator(mode="after")
    def _one_identity(self) -> TokenEntry:
        if (self.token is None) == (self.sha256 is None):
            raise ValueError("each entry needs exactly one of token or sha256")
        if sum([self.tenant is not None, self.agent is not None, self.admin]) != 1:
            raise ValueError("each entry names exactly one of tenant, agent or admin: true")
        return self


class TokensFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[TokenEntry]


@dataclass(frozen=True)
class Principal:
    kind: str  # "tenant" | "agent" | "admin"
    name: str

    @property
    def is_admin(self) -> bool:
        return self.kind == "admin"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Authenticator:
    def __init__(self, entries: list[TokenEntry]) -> None:
        self._by_digest: dict[str, Principal] = {}
        for entry in entries:
            digest = entry.sha256.lower() if entry.sha256 else _digest(entry.token or "")
            if entry.tenant is not None:
                principal = Principal("tenant", entry.tenant)
            elif entry.agent is not None:
                principal = Principal("agent", entry.agent)
            else:
                principal = Principal("admin", "admin")
            self._by_digest[digest] = principal

    @classmethod
    def from_file(cls, path: Path) -> Authenticator:
        data = yaml.safe_load(path.read_text())
        return cls(TokensFile.model_validate(data).tokens)

    def identify(self, header: str | None) -> Principal:
        if not header:
            raise errors.Unauthenticated(
                "missing bearer token (Authorization: Bearer <token>)", headers=CHALLENGE
            )
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise errors.Unauthenticated(
                "the Authorization header must be 'Bearer <token>'", headers=CHALLENGE
            )
        digest = _digest(token.strip())
        for known, principal in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return principal
        raise errors.Unauthenticated("unknown token", headers=CHALLENGE)


AUTHENTICATOR = web.AppKey("authenticator", Authenticator)


def principal_of(request: web.Request) -> Principal:
    return request.app[AUTHENTICATOR].identify(request.headers.get("Authorization"))


def require_user(request: web.Request) -> Principal:
    principal = principal_of(request)
    if principal.kind == "agent":
        raise errors.Forbidden("agent tokens cannot use the jobs API")
    return principal


def require_admin(request: web.Request, *, action: str) -> Principal:
    principal = require_user(request)
    if not principal.is_admin:
        raise errors.Forbidden(f"only the admin token {action}")
    return principal


def require_tenant(request: web.Request, *, action: str) -> Principal:
    principal = require_user(request)
    if principal.kind != "tenant":
        raise errors.Forbidden(f"only tenant tokens {action}")
    return principal
