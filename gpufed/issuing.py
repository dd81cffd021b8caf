"""`gpufed token create`: a new random token, shown once, and its entry for the tokens file.

The entry holds only the token's SHA-256 (`broker.http.tokens`), so the tokens file (a
Secret, a ConfigMap, a repository) never holds a token. The entry is checked by the broker's
own model before it is printed: what this prints, the broker reads.
"""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

import pydantic
import yaml

from broker.http import tokens

PREFIX = "gpufed_"  # lets secret scanners recognise a leaked token


class TokenRequestError(ValueError):
    """What was asked for cannot be a token (a role without its tenant, a bad expiry)."""


def new_token() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def expiry_of(text: str | None, *, seconds: float | None, now: datetime) -> datetime | None:
    """When a token given `--expires text` expires: `seconds` from `now` if the text was a
    duration (30d), else the RFC 3339 time it is, with its zone; None: never."""
    if text is None:
        return None
    if seconds is not None:
        if seconds <= 0:
            raise TokenRequestError(f"--expires {text!r}: a duration above 0")
        return now + timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise TokenRequestError(
            f"--expires {text!r}: a duration (90m, 30d) or an RFC 3339 time (2026-07-01T00:00:00Z)"
        ) from None
    if when.tzinfo is None:
        raise TokenRequestError(f"--expires {text!r}: give its time zone (Z, +02:00)")
    return when.astimezone(UTC)


def create(
    *, tenant: str | None, role: str | None, expires: datetime | None, name: str | None
) -> tuple[str, dict[str, Any]]:
    """A new token and its entry (digest only), checked as the broker checks the file."""
    token = new_token()
    entry: dict[str, Any] = {"sha256": tokens.digest(token)}
    if tenant is not None:
        entry["tenant"] = tenant
    if role is not None:
        entry["role"] = role
    if expires is not None:
        entry["expires"] = expires.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if name is not None:
        entry["name"] = name
    try:
        tokens.TokenEntry.model_validate(entry)
    except pydantic.ValidationError as exc:
        first = exc.errors(include_input=False)[0]
        raise TokenRequestError(str(first["msg"]).removeprefix("Value error, ")) from None
    return token, entry


def render(token: str, entry: dict[str, Any], *, output: str) -> str:
    if output == "json":
        return json.dumps({"token": token, "entry": entry}, indent=2)
    line = yaml.safe_dump(entry, default_flow_style=True, sort_keys=False, width=10_000).strip()
    return "\n".join(
        [
            token,
            "# the token above is shown once: only its digest is kept. Add this entry under",
            "# `tokens:` in the broker's tokens file (it is read again within seconds):",
            f"  - {line}",
        ]
    )
