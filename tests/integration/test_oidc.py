"""People's OIDC tokens through a real broker on loopback: key pairs generated here, the
JWKS served by a second aiohttp server on loopback (or a file), JWTs signed with PyJWT.
A token with the right claims submits; a wrong audience, another issuer, an expired or not
yet valid one, a forged signature or algorithm gets 401; claims granting nothing, or two
tenants, get 403; a rotated key is fetched on its first use; a cancel names the person.
What claims may grant: fleet roles only from the fleet groups, a group under a tenant only
that tenant's roles, tenants held to DNS labels (refusals counted on /metrics); a JWKS file
read again only when it changed."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests import guarded
from tests.builders import make_job
from tests.guarded import Start
from tests.idp import AUDIENCE, ISSUER, Provider


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    async with guarded.brokers(tmp_path) as starting:
        yield starting


@pytest.fixture
async def provider() -> AsyncIterator[tuple[Provider, str]]:
    """The provider and the URL of its JWKS, served on loopback."""
    idp = Provider()
    idp.add("k1")

    async def keys(request: web.Request) -> web.Response:
        idp.fetches += 1
        await asyncio.sleep(idp.delay)
        return web.json_response(idp.jwks())

    app = web.Application()
    app.router.add_get("/jwks", keys)
    server = TestServer(app)
    await server.start_server()
    yield idp, str(server.make_url("/jwks"))
    await server.close()


def oidc(jwks: str, **more: Any) -> dict[str, Any]:
    return {
        "issuer": ISSUER,
        "audience": AUDIENCE,
        "jwks": jwks,
        "username_claim": "preferred_username",
        **more,
    }


async def test_a_token_with_the_right_claims_submits_and_wrong_ones_get_401(
    start: Start, provider: tuple[Provider, str]
) -> None:
    idp, url = provider
    broker = await start(oidc_provider=oidc(url, min_refetch_seconds=0.0))
    job = make_job(queue="a-q").document()

    status, body, _ = await broker.call(idp.token(), "POST", "/v1/jobs", job)
    assert status == 202, body
    status, got, _ = await broker.call(idp.token(), "GET", f"/v1/jobs/{body['id']}")
    assert status == 200 and got["tenant"] == "team-a"
    # a job of another tenant is not this person's to see
    other = await broker.submit("team-b", "b-q")
    assert (await broker.call(idp.token(), "GET", f"/v1/jobs/{other}"))[0] == 404

    refused = {
        "not for this broker": idp.token(aud="another-service"),
        "not from": idp.token(iss="https://evil.example.test"),
        "expired": idp.token(lifetime=-120),
        "not valid yet": idp.token(nbf=int(time.time()) + 600),
        "MissingRequiredClaimError": jwt.encode(
            {"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "groups": ["gpufed:admin"]},
            idp.keys["k1"],
            algorithm="RS256",
            headers={"kid": "k1"},
        ),
        "'HS256' is not accepted": jwt.encode(
            {"iss": ISSUER, "aud": AUDIENCE, "exp": int(time.time()) + 60, "sub": "x"},
            "not-a-key-but-a-secret-of-32-bytes!!",
            algorithm="HS256",
            headers={"kid": "k1"},
        ),
        "InvalidSignatureError": _tampered(idp.token(), groups=["gpufed:admin"]),
    }
    for case, token in refused.items():
        status, problem, headers = await broker.call(token, "POST", "/v1/jobs", job)
        assert status == 401, (case, problem)
        assert "invalid_token" in headers.get("WWW-Authenticate", ""), case
        assert case in problem["detail"] and token not in json.dumps(problem), problem
    # within the leeway, a just-expired token still passes
    status, _, _ = await broker.call(idp.token(lifetime=-5), "POST", "/v1/jobs", job)
    assert status == 202


def _tampered(token: str, **claims: Any) -> str:
    """The token with its payload replaced, the signature kept."""
    head, payload, signature = token.split(".")
    data = json.loads(jwt.utils.base64url_decode(payload))
    data.update(claims)
    forged = jwt.utils.base64url_encode(json.dumps(data).encode()).decode()
    return f"{head}.{forged}.{signature}"


async def test_claims_map_to_roles_and_tenants(
    start: Start, provider: tuple[Provider, str]
) -> None:
    idp, url = provider
    broker = await start(oidc_provider=oidc(url))
    job = make_job(queue="a-q").document()
    cases: list[tuple[list[str], str, str, Any, int]] = [
        (["gpufed:team-a:viewer"], "POST", "/v1/jobs", job, 403),
        (["gpufed:team-a:viewer"], "GET", "/v1/jobs", None, 200),
        (["gpufed:team-a:viewer", "gpufed:team-a:submitter"], "POST", "/v1/jobs", job, 202),
        (["developers", "gpufed-other:team-a:submitter"], "GET", "/v1/jobs", None, 403),
        (["gpufed:team-a:submitter", "gpufed:team-b:submitter"], "GET", "/v1/jobs", None, 403),
        (["gpufed:team-a:agent"], "GET", "/v1/jobs", None, 403),
        (["gpufed:submitter"], "GET", "/v1/jobs", None, 403),  # a tenant role needs a tenant
        (["gpufed:admin", "gpufed:team-a:viewer"], "GET", "/v1/queues/b-q", None, 200),
        (["gpufed:team-a:tenant-admin"], "GET", "/v1/queues/b-q", None, 404),
        (["gpufed:viewer"], "GET", "/metrics", None, 200),
        (["gpufed:metrics"], "GET", "/v1/jobs", None, 403),
    ]
    for groups, method, path, body, expected in cases:
        status, answer, _ = await broker.call(idp.token(groups=groups), method, path, body)
        assert status == expected, (groups, method, path, answer)
    # the tokens file still works beside OIDC
    assert (await broker.call("team-a", "GET", "/v1/jobs"))[0] == 200


async def test_roles_from_a_role_claim_and_a_tenant_claim(
    start: Start, provider: tuple[Provider, str]
) -> None:
    idp, url = provider
    broker = await start(oidc_provider=oidc(url, role_claim="roles", tenant_claim="team"))
    job = make_job(queue="a-q").document()
    token = idp.token(roles=["viewer", "submitter"], team="team-a", groups=[])
    assert (await broker.call(token, "POST", "/v1/jobs", job))[0] == 202
    no_tenant = idp.token(roles="submitter", groups=["gpufed:team-a:submitter"])
    assert (await broker.call(no_tenant, "POST", "/v1/jobs", job))[0] == 403


async def test_an_ec_key_from_a_jwks_file(start: Start, tmp_path: Path) -> None:
    idp = Provider()
    idp.add("ec1", curve=True)
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps(idp.jwks()))
    broker = await start(oidc_provider=oidc(str(jwks)))
    status, body, _ = await broker.call(
        idp.token("ec1"), "POST", "/v1/jobs", make_job(queue="a-q").document()
    )
    assert status == 202, body


async def test_a_rotated_key_is_fetched_on_first_use_and_a_cancel_names_the_person(
    start: Start, provider: tuple[Provider, str]
) -> None:
    idp, url = provider
    broker = await start(oidc_provider=oidc(url, min_refetch_seconds=0.0))
    job_id = await broker.submit(idp.token())
    fetched = idp.fetches
    idp.add("k2")  # the provider rotates: a new key, published
    status, body, _ = await broker.call(idp.token("k2"), "DELETE", f"/v1/jobs/{job_id}")
    assert status == 202, body
    assert idp.fetches == fetched + 1
    cancel = body["status"]["events"][-1]
    assert cancel["state"] == "Cancelled" and "oidc 'alice'" in cancel["by"], cancel
    # a key the provider never published does not verify, however often it is tried
    idp.add("rogue", publish=False)
    assert (await broker.call(idp.token("rogue"), "GET", "/v1/jobs"))[0] == 401


# ---- what claims may grant: fleet roles from fleet groups, tenants held to DNS labels -------


async def rejected(broker: guarded.Broker) -> dict[str, float]:
    """`gpufed_oidc_rejected_claims_total` by reason, read from the broker's /metrics."""
    status, text, _ = await broker.call("admin", "GET", "/metrics")
    assert status == 200, text
    found = {}
    for line in str(text).splitlines():
        if line.startswith("gpufed_oidc_rejected_claims_total{"):
            labels, _, value = line.partition("} ")
            found[labels.split('reason="')[1].rstrip('"')] = float(value)
    return found


REASONS = dict.fromkeys(
    ["tenant_not_dns_label", "tenant_not_allowed", "fleet_role_outside_fleet_groups"], 0.0
)


async def test_refused_claims_are_counted_by_reason_from_the_start(
    start: Start, provider: tuple[Provider, str]
) -> None:
    _, url = provider
    broker = await start(oidc_provider=oidc(url))
    assert await rejected(broker) == REASONS


@pytest.mark.parametrize(
    ("groups", "calls", "reason"),
    [
        pytest.param(
            ["gpufed:team-a:admin"],
            [("POST", "/v1/jobs", 202), ("GET", "/v1/queues/b-q", 404), ("GET", "/metrics", 403)],
            None,
            id="admin under a tenant is that tenant's tenant-admin, not the fleet admin",
        ),
        pytest.param(
            ["gpufed:team-a:metrics"],
            [("GET", "/metrics", 403), ("GET", "/v1/jobs", 403)],
            "fleet_role_outside_fleet_groups",
            id="metrics under a tenant grants nothing",
        ),
    ],
)
async def test_a_group_under_a_tenant_grants_only_roles_of_that_tenant(
    start: Start,
    provider: tuple[Provider, str],
    groups: list[str],
    calls: list[tuple[str, str, int]],
    reason: str | None,
) -> None:
    idp, url = provider
    broker = await start(oidc_provider=oidc(url))
    token = idp.token(groups=groups)
    for method, path, expected in calls:
        body = make_job(queue="a-q").document() if method == "POST" else None
        status, answer, _ = await broker.call(token, method, path, body)
        assert status == expected, (method, path, answer)
    counted = {**REASONS, **({reason: float(len(calls))} if reason else {})}
    assert await rejected(broker) == counted


async def test_fleet_roles_come_only_from_the_configured_fleet_groups(
    start: Start, provider: tuple[Provider, str]
) -> None:
    idp, url = provider
    fleet_groups = {"platform-admins": "admin", "prometheus": "metrics", "auditors": "viewer"}
    broker = await start(oidc_provider=oidc(url, fleet_groups=fleet_groups))
    cases = [
        (["platform-admins"], "GET", "/v1/queues/b-q", 200),
        (["prometheus"], "GET", "/metrics", 200),
        (["prometheus"], "GET", "/v1/jobs", 403),
        (["auditors"], "GET", "/v1/queues/b-q", 200),
        # the default groups are not fleet groups once fleet groups are named
        (["gpufed:admin"], "GET", "/v1/queues/b-q", 403),
        (["gpufed:metrics"], "GET", "/metrics", 403),
        (["gpufed:viewer"], "GET", "/v1/jobs", 403),
        # nor is a group that names a fleet group under a tenant
        (["gpufed:platform-admins:admin"], "GET", "/v1/queues/b-q", 404),
    ]
    for groups, method, path, expected in cases:
        status, answer, _ = await broker.call(idp.token(groups=groups), method, path)
        assert status == expected, (groups, method, path, answer)
    assert (await rejected(broker))["fleet_role_outside_fleet_groups"] == 3


@pytest.mark.parametrize(
    "tenant",
    [
        pytest.param("../../", id="a path"),
        pytest.param("<b>x</b>", id="markup"),
        pytest.param("a" * 5000, id="5000 characters"),
        pytest.param("team-a ", id="a trailing space"),
        pytest.param("Team-A", id="upper case"),
        pytest.param("team-a\n", id="a trailing newline"),
        pytest.param("", id="empty"),
    ],
)
@pytest.mark.parametrize("where", ["group", "tenant claim"])
async def test_a_tenant_that_is_not_a_dns_label_grants_nothing_and_is_counted(
    start: Start, provider: tuple[Provider, str], tenant: str, where: str
) -> None:
    idp, url = provider
    if where == "group":
        broker = await start(oidc_provider=oidc(url))
        token = idp.token(groups=[f"gpufed:{tenant}:submitter"])
    else:
        broker = await start(oidc_provider=oidc(url, role_claim="roles", tenant_claim="team"))
        token = idp.token(roles=["submitter"], team=tenant, groups=[])
    status, problem, _ = await broker.call(token, "POST", "/v1/jobs", make_job().document())
    assert status == 403, problem
    assert "not a DNS label" in problem["detail"] and len(problem["detail"]) < 400, problem
    assert (await rejected(broker))["tenant_not_dns_label"] == 1
    status, listed, _ = await broker.call("admin", "GET", "/v1/jobs")
    assert status == 200 and listed["items"] == [], listed  # nothing stored


async def test_a_tenant_outside_the_allowed_tenants_grants_nothing(
    start: Start, provider: tuple[Provider, str]
) -> None:
    idp, url = provider
    broker = await start(oidc_provider=oidc(url, tenants=["team-a"]))
    job = make_job(queue="b-q").document()
    outside = idp.token(groups=["gpufed:team-b:submitter"])
    assert (await broker.call(outside, "POST", "/v1/jobs", job))[0] == 403
    assert (await broker.call(idp.token(), "GET", "/v1/jobs"))[0] == 200  # team-a's
    assert (await rejected(broker))["tenant_not_allowed"] == 1


@pytest.mark.parametrize(
    ("claims", "call"),
    [
        pytest.param(
            {"roles": ["admin"], "team": "team-a"},
            ("GET", "/v1/queues/b-q", 404),
            id="admin with a tenant is that tenant's tenant-admin",
        ),
        pytest.param(
            {"roles": ["admin"]}, ("GET", "/v1/queues/b-q", 403), id="admin without a tenant"
        ),
        pytest.param({"roles": "metrics"}, ("GET", "/metrics", 403), id="metrics"),
        pytest.param({"roles": "viewer"}, ("GET", "/v1/jobs", 403), id="viewer without a tenant"),
        pytest.param(
            {"roles": [], "groups": ["gpufed:viewer"]},
            ("GET", "/v1/queues/b-q", 200),
            id="a fleet group beside the role claim",
        ),
    ],
)
async def test_a_role_claim_grants_only_roles_of_the_tenant_claims_tenant(
    start: Start,
    provider: tuple[Provider, str],
    claims: dict[str, Any],
    call: tuple[str, str, int],
) -> None:
    idp, url = provider
    broker = await start(oidc_provider=oidc(url, role_claim="roles", tenant_claim="team"))
    method, path, expected = call
    status, answer, _ = await broker.call(idp.token(**{"groups": [], **claims}), method, path)
    assert status == expected, answer


async def test_a_jwks_file_is_read_once_for_unknown_kids_and_again_when_it_changes(
    start: Start, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    idp = Provider()
    idp.add("k1")
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps(idp.jwks()))
    reads: list[Path] = []
    read_bytes = Path.read_bytes

    def counted(path: Path) -> bytes:
        if path == jwks:
            reads.append(path)
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", counted)
    broker = await start(oidc_provider=oidc(str(jwks), min_refetch_seconds=0.0))
    assert len(reads) == 1
    idp.add("k2", publish=False)
    for _ in range(20):
        assert (await broker.call(idp.token("k2"), "GET", "/v1/jobs"))[0] == 401
    assert len(reads) == 1  # the file did not change: no token made it read again
    idp.published.append("k2")  # the provider rotates: the file now holds k2
    jwks.write_text(json.dumps(idp.jwks()))
    status, answer, _ = await broker.call(idp.token("k2"), "GET", "/v1/jobs")
    assert status == 200, answer
    assert len(reads) == 2


async def test_a_long_username_is_cut_where_it_names_the_person(
    start: Start, provider: tuple[Provider, str]
) -> None:
    idp, url = provider
    broker = await start(oidc_provider=oidc(url))
    token = idp.token(preferred_username="x" * 5000)
    job_id = await broker.submit(token)
    status, body, _ = await broker.call(token, "DELETE", f"/v1/jobs/{job_id}")
    assert status == 202, body
    by = body["status"]["events"][-1]["by"]
    assert "xxx" in by and len(by) < 300, len(by)


async def test_tokens_of_a_new_kid_arriving_together_share_one_fetch_of_the_jwks_url(
    start: Start, provider: tuple[Provider, str]
) -> None:
    idp, url = provider
    broker = await start(oidc_provider=oidc(url, min_refetch_seconds=0.0))
    await broker.submit(idp.token())  # the keys of the start are in
    fetched = idp.fetches
    idp.add("k2")  # the provider rotates; its JWKS answers slowly
    idp.delay = 0.3
    answers = await asyncio.gather(
        *(broker.call(idp.token("k2"), "GET", "/v1/jobs") for _ in range(10))
    )
    assert [status for status, _, _ in answers] == [200] * 10
    assert idp.fetches == fetched + 1
