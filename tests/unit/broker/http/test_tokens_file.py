"""The tokens file read as the broker reads it: who each entry is, and every refusal naming the
entry and the problem without quoting a token."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from broker.api import errors
from broker.http import auth, roles, tokens
from gpufed import issuing

SECRET = "s3cret-do-not-print"
DIGEST = tokens.digest(SECRET)


def read(*entries: dict[str, Any]) -> list[tokens.TokenEntry]:
    return tokens.parse(yaml.safe_dump({"tokens": list(entries)}).encode(), where="tokens.yaml")


@pytest.mark.parametrize(
    ("entry", "principal"),
    [
        pytest.param(
            {"tenant": "team-a"}, auth.Principal(roles.Role.SUBMITTER, "team-a"), id="tenant"
        ),
        pytest.param({"admin": True}, auth.Principal(roles.Role.ADMIN), id="admin: true"),
        pytest.param(
            {"agent": "h100"}, auth.Principal(roles.Role.AGENT, cluster="h100"), id="agent"
        ),
        pytest.param(
            {"tenant": "team-a", "role": "tenant-admin"},
            auth.Principal(roles.Role.TENANT_ADMIN, "team-a"),
            id="tenant-admin",
        ),
        pytest.param(
            {"tenant": "team-a", "role": "viewer"},
            auth.Principal(roles.Role.VIEWER, "team-a"),
            id="viewer of a tenant",
        ),
        pytest.param({"role": "viewer"}, auth.Principal(roles.Role.VIEWER), id="fleet viewer"),
        pytest.param({"role": "metrics"}, auth.Principal(roles.Role.METRICS), id="metrics"),
        pytest.param(
            {"role": "agent:a100"},
            auth.Principal(roles.Role.AGENT, cluster="a100"),
            id="role agent:cluster",
        ),
        pytest.param(
            {"role": "admin", "admin": True, "name": "ops"},
            auth.Principal(roles.Role.ADMIN, label="ops"),
            id="role admin and admin: true",
        ),
    ],
)
def test_an_entry_names_its_principal(entry: dict[str, Any], principal: auth.Principal) -> None:
    [read_entry] = read({"token": SECRET, **entry})
    assert auth.principal_of_entry(read_entry) == principal
    by_digest = auth.Authenticator(read({"sha256": DIGEST.upper(), **entry}))
    assert by_digest.identify(f"Bearer {SECRET}") == principal


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        pytest.param(
            {"tokens": [{"token": SECRET, "tenant": "a", "role": "owner"}]},
            "tokens[0]: no role 'owner'",
            id="unknown role",
        ),
        pytest.param(
            {"tokens": [{"token": SECRET, "role": "submitter"}]},
            "tokens[0]: role submitter needs the tenant",
            id="submitter without a tenant",
        ),
        pytest.param(
            {"tokens": [{"token": SECRET, "tenant": "a", "role": "metrics"}]},
            "tokens[0]: role metrics belongs to no tenant",
            id="metrics with a tenant",
        ),
        pytest.param(
            {"tokens": [{"token": SECRET, "agent": "h100", "role": "agent:a100"}]},
            "tokens[0]: agent: h100 contradicts role agent:a100",
            id="two clusters",
        ),
        pytest.param(
            {"tokens": [{"token": SECRET, "admin": True, "role": "viewer"}]},
            "tokens[0]: admin: true contradicts role viewer",
            id="admin and viewer",
        ),
        pytest.param(
            {"tokens": [{"token": SECRET, "sha256": DIGEST, "tenant": "a"}]},
            "tokens[0]: each entry needs exactly one of token or sha256",
            id="token and digest",
        ),
        pytest.param(
            {"tokens": [{"sha256": SECRET, "tenant": "a"}]},
            "tokens[0].sha256: String should match pattern",
            id="a digest that is not one",
        ),
        pytest.param(
            {"tokens": [{"token": "ok", "tenant": "a", "expires": "2026-07-01T00:00:00"}]},
            "tokens[0].expires: give its time zone (RFC 3339: 2026-07-01T00:00:00Z)",
            id="expires without a zone",
        ),
        pytest.param(
            {"tokens": [{"token": "ok", "tenant": "a", "expires": "next week"}]},
            "tokens[0].expires: Input should be a valid datetime",
            id="expires not a time",
        ),
        pytest.param(
            {"tokens": [{"token": SECRET, "tenant": "a", "tokn": SECRET}]},
            "tokens[0].tokn: Extra inputs are not permitted",
            id="a misspelt field",
        ),
        pytest.param(
            {"tokens": [{"token": SECRET, "tenant": "a"}, {"sha256": DIGEST, "agent": "b"}]},
            "tokens[1]: the same token as tokens[0]",
            id="one token twice",
        ),
        pytest.param({"tokenz": []}, "tokens: Field required", id="no tokens list"),
        pytest.param([SECRET], "needs a mapping with a `tokens:` list", id="not a mapping"),
    ],
)
def test_a_file_that_does_not_add_up_is_refused_naming_the_entry_never_the_token(
    document: Any, problem: str
) -> None:
    with pytest.raises(tokens.TokensFileError) as raised:
        tokens.parse(yaml.safe_dump(document).encode(), where="tokens.yaml")
    message = str(raised.value)
    assert message.startswith("tokens.yaml: ") and problem in message, message
    assert SECRET not in message and DIGEST not in message.lower()


def test_a_yaml_error_says_where_without_quoting_the_line() -> None:
    text = f"tokens:\n  - token: {SECRET}\n    tenant: [team-a\n"
    with pytest.raises(tokens.TokensFileError, match=r"not YAML: .* at line \d+, column \d+"):
        tokens.parse(text.encode(), where="tokens.yaml")
    try:
        tokens.parse(text.encode(), where="tokens.yaml")
    except tokens.TokensFileError as exc:
        assert SECRET not in str(exc)


def test_an_expired_token_is_unauthenticated_naming_it_expired_never_echoing_it() -> None:
    past = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    authenticator = auth.Authenticator(
        read(
            {"token": SECRET, "tenant": "team-a", "expires": past.isoformat(), "name": "ci-a"},
            {"token": "later", "tenant": "team-a", "expires": "2999-01-01T00:00:00+02:00"},
        )
    )
    with pytest.raises(auth.TokenExpired) as raised:
        authenticator.identify(f"Bearer {SECRET}")
    assert isinstance(raised.value, errors.Unauthenticated)
    assert raised.value.detail.startswith(
        "this token (submitter of tenant team-a (token 'ci-a')) expired at 2025-01-02T03:04:05Z"
    )
    assert SECRET not in raised.value.detail
    # the same token a second before it expires
    just_before = past - timedelta(seconds=1)
    assert authenticator.identify(f"Bearer {SECRET}", now=just_before).tenant == "team-a"
    assert authenticator.identify("Bearer later").tenant == "team-a"


# ---- gpufed token create -------------------------------------------------------------------


def test_a_created_entry_reads_as_the_broker_reads_it_and_holds_no_token() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    expires = issuing.expiry_of("30d", seconds=30 * 86400, now=now)
    token, entry = issuing.create(tenant="team-a", role="viewer", expires=expires, name="dash")
    text = issuing.render(token, entry, output="text")
    first, *rest = text.splitlines()
    assert first == token and token.startswith(issuing.PREFIX) and len(token) > 40
    assert all(token not in line for line in rest)
    pasted = "tokens:\n" + "\n".join(rest) + "\n"
    [read_back] = tokens.parse(pasted.encode(), where="pasted")
    assert read_back.digest() == tokens.digest(token)
    assert read_back.expires == datetime(2026, 1, 31, tzinfo=UTC)
    principal = auth.Authenticator([read_back]).identify(f"Bearer {token}", now=now)
    assert principal == auth.Principal(roles.Role.VIEWER, "team-a", label="dash")


@pytest.mark.parametrize(
    ("tenant", "role", "when", "problem"),
    [
        pytest.param(None, None, None, "exactly one of tenant, agent", id="no one"),
        pytest.param(None, "tenant-admin", None, "needs the tenant", id="tenant-admin alone"),
        pytest.param("a", "agent:h100", None, "belongs to no tenant", id="agent with a tenant"),
        pytest.param("a", None, "tomorrow", "a duration (90m, 30d) or an RFC 3339", id="when?"),
        pytest.param("a", None, "2026-01-01T00:00:00", "give its time zone", id="no zone"),
    ],
)
def test_token_create_refuses_what_the_broker_would(
    tenant: str | None, role: str | None, when: str | None, problem: str
) -> None:
    with pytest.raises(issuing.TokenRequestError, match=re.escape(problem)):
        expires = issuing.expiry_of(when, seconds=None, now=datetime.now(UTC))
        issuing.create(tenant=tenant, role=role, expires=expires, name=None)
