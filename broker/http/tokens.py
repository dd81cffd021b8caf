"""The tokens file: its format, reading it whole or not at all, and following its changes.

    tokens:
      - sha256: 9f86d081…           # the token's SHA-256 (hex), or `token: <the token>`
        tenant: team-a
        role: submitter              # optional (broker.http.roles); tenant-admin, viewer
        expires: 2026-07-01T00:00:00Z  # optional, RFC 3339 with its time zone
        name: ci-team-a              # optional: names the token in logs and problems
      - token: dev-admin
        admin: true                  # = role: admin
      - token: dev-agent-h100
        agent: h100                  # = role: agent:h100
      - sha256: 2c26b46b…
        role: metrics                # GET /metrics only
      - sha256: fcde2b2e…
        role: viewer                 # no tenant: read-only over the whole fleet

A token without a role keeps the meaning it had before roles: `tenant:` a submitter of that
tenant, `admin: true` the admin, `agent:` that cluster's agent. `gpufed token create` prints a
new token once and its entry, with only the digest.

A file that does not read is refused whole (`TokensFileError`, naming the entry, the field and
the problem, never a token): at start the broker does not start; later the broker keeps the
tokens it has. `Follower` reloads the file when it changes — its size, modification time or
inode (a Kubernetes Secret's volume swaps a symlink) polled every second, applied once it has
been still for one poll, so a revoked token is refused within about two seconds — and at
once on SIGHUP.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pydantic
import yaml
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints

from broker.http import roles

logger = logging.getLogger(__name__)

AGENT_PREFIX = "agent:"
Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")]
Name = Annotated[str, StringConstraints(min_length=1, max_length=253)]


class TokensFileError(Exception):
    """The tokens file cannot be used; the message names the file, the entry and the problem."""


class TokenEntry(BaseModel):
    """One token of the file: who it is (tenant, agent, admin or role) and until when."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token: Annotated[str, StringConstraints(min_length=1)] | None = None
    sha256: Digest | None = None
    tenant: Name | None = None
    agent: Name | None = None
    admin: bool = False
    role: str | None = None
    expires: AwareDatetime | None = None
    name: Name | None = Field(None, description="names the token in logs (never the token)")

    @pydantic.model_validator(mode="after")
    def _one_identity(self) -> TokenEntry:
        if (self.token is None) == (self.sha256 is None):
            raise ValueError("each entry needs exactly one of token or sha256")
        role, cluster = self.role_and_cluster()  # raises what does not add up
        if role in roles.TENANT_ROLES and self.tenant is None:
            raise ValueError(f"role {role.value} needs the tenant it belongs to (tenant: NAME)")
        if role not in (*roles.TENANT_ROLES, roles.Role.VIEWER) and self.tenant is not None:
            raise ValueError(f"role {_spelled(role, cluster)} belongs to no tenant: drop tenant")
        return self

    def role_and_cluster(self) -> tuple[roles.Role, str | None]:
        """The entry's role (given, or what tenant/agent/admin meant before roles) and the
        cluster of an agent; ValueError if they contradict each other."""
        if self.role is None:
            if sum([self.tenant is not None, self.agent is not None, self.admin]) != 1:
                raise ValueError(
                    "each entry names exactly one of tenant, agent, admin: true or role"
                )
            if self.agent is not None:
                return roles.Role.AGENT, self.agent
            return (roles.Role.ADMIN if self.admin else roles.Role.SUBMITTER), None
        role, cluster = parse_role(self.role)
        if self.admin and role != roles.Role.ADMIN:
            raise ValueError(f"admin: true contradicts role {self.role}")
        if role == roles.Role.AGENT:
            cluster = cluster or self.agent
            if cluster is None:
                raise ValueError("role agent needs its cluster: role: agent:NAME")
            if self.agent is not None and self.agent != cluster:
                raise ValueError(f"agent: {self.agent} contradicts role {self.role}")
        elif self.agent is not None:
            raise ValueError(f"agent: is for agent tokens, not role {self.role}")
        return role, cluster

    def digest(self) -> str:
        return self.sha256.lower() if self.sha256 is not None else digest(self.token or "")


class TokensFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[TokenEntry]


def digest(token: str) -> str:
    """What the file keeps of a token: its SHA-256, in hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def parse_role(text: str) -> tuple[roles.Role, str | None]:
    """`submitter` → (SUBMITTER, None); `agent:h100` → (AGENT, "h100"); ValueError if unknown."""
    if text.startswith(AGENT_PREFIX):
        cluster = text.removeprefix(AGENT_PREFIX)
        if not cluster:
            raise ValueError("role agent: needs its cluster: agent:NAME")
        return roles.Role.AGENT, cluster
    try:
        return roles.Role(text), None
    except ValueError:
        known = ", ".join(r.value for r in roles.Role if r != roles.Role.AGENT)
        raise ValueError(f"no role {text!r} (roles: {known}, agent:CLUSTER)") from None


def _spelled(role: roles.Role, cluster: str | None) -> str:
    return f"{AGENT_PREFIX}{cluster}" if role == roles.Role.AGENT else role.value


# ---- reading ---------------------------------------------------------------------------------


def read_file(path: Path) -> list[TokenEntry]:
    """Every entry of the file, checked; TokensFileError (naming the problem) otherwise."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TokensFileError(
            f"tokens file {path}: cannot read it: {exc.strerror or exc}"
        ) from None
    return parse(raw, where=f"tokens file {path}")


def parse(raw: bytes, *, where: str) -> list[TokenEntry]:
    """The entries of a tokens document. No message quotes the document: a line of it may be
    a token."""
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise TokensFileError(f"{where}: not UTF-8 text") from None
    except yaml.YAMLError as exc:
        raise TokensFileError(f"{where}: not YAML: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise TokensFileError(f"{where}: needs a mapping with a `tokens:` list")
    try:
        entries = TokensFile.model_validate(data).tokens
    except pydantic.ValidationError as exc:
        raise TokensFileError(f"{where}: {_first_problem(exc)}") from None
    first: dict[str, int] = {}
    for index, entry in enumerate(entries):
        seen = first.setdefault(entry.digest(), index)
        if seen != index:
            raise TokensFileError(f"{where}: tokens[{index}]: the same token as tokens[{seen}]")
    return entries


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """The parser's problem and where, without the snippet of the line it would quote."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    if mark is None:
        return str(problem)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def _first_problem(exc: pydantic.ValidationError) -> str:
    """`tokens[3].expires: ...` for the first error (and how many more); never the input."""
    found = exc.errors(include_input=False, include_url=False)
    first = found[0]
    where = ""
    for part in first["loc"]:
        where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else str(part))
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "timezone_aware":
        message = "give its time zone (RFC 3339: 2026-07-01T00:00:00Z)"
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return f"{where}: {message}{more}" if where else f"{message}{more}"


# ---- following its changes -------------------------------------------------------------------

Signature = tuple[int, int, int, int] | None


def file_signature(path: Path) -> Signature:
    """What changes when the file does: device, inode, size, mtime (through symlinks)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


class Follower:
    """Reads the tokens file, hands its entries to `apply`, and again whenever it changes.

    A change is applied once the file has been the same for one poll (a file being written is
    not read half-way); a file that does not read is logged once, and the tokens applied last
    stay until the file changes again and reads."""

    def __init__(
        self,
        path: Path,
        apply: Callable[[list[TokenEntry]], Any],
        *,
        poll_seconds: float = 1.0,
    ) -> None:
        self.path = path
        self.poll_seconds = poll_seconds
        self._apply = apply
        self._applied: Signature = None
        self._failed: tuple[Signature] | None = None  # the file as it was when it did not read
        self._seen: Signature = None
        self._reading = asyncio.Lock()  # a SIGHUP and a poll: one read after the other

    def load(self) -> None:
        """The first read, at start: TokensFileError stops the broker."""
        signature = file_signature(self.path)
        entries = read_file(self.path)
        self._apply(entries)
        self._applied = self._seen = signature
        logger.debug("tokens file %s: %d tokens", self.path, len(entries))

    async def reload(self, *, why: str) -> bool:
        """Read the file again; True if its tokens now apply."""
        async with self._reading:
            signature = file_signature(self.path)
            try:
                entries = await asyncio.to_thread(read_file, self.path)
            except TokensFileError as exc:
                self._failed, self._seen = (signature,), signature
                logger.error("%s (%s): the broker keeps the tokens it had", exc, why)
                return False
            self._apply(entries)
            self._applied = self._seen = signature
            self._failed = None
        logger.info("tokens file %s reloaded (%s): %d tokens", self.path, why, len(entries))
        return True

    async def poll(self) -> None:
        """One look at the file; reloads it if it changed and has been still since."""
        signature = file_signature(self.path)
        if signature == self._applied or self._failed == (signature,) or signature != self._seen:
            self._seen = signature
            return
        await self.reload(why="changed")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                await self.poll()
            except Exception:  # the poll must go on: the next change may read
                logger.exception("following the tokens file %s failed", self.path)
