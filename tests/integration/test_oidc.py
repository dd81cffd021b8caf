"""People's OIDC tokens through a real broker on loopback: key pairs generated here, the
JWKS served by a second aiohttp server on loopback (or a file), JWTs signed with PyJWT.
A token with the right claims submits; a wrong audience, another issuer, an expired or not
yet valid one, a forged signature or algorithm gets 401; claims granting nothing, or two
tenants, get 403; a rotated key is fetched on its first use; a cancel names the person."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from tests import guarded
from tests.builders import make_job
from tests.guarded import Start

ISSUER = "https://idp.example.test/realms/gpufed"
AUDIENCE = "gpufed-broker"


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    async with guarded.brokers(tmp_path) as starting:
        yield starting


class Provider:
    """An OIDC provider as far as the broker sees one: its keys, published as a JWKS."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}  # kid -> private key
        self.published: list[str] = []  # the kids the JWKS shows
        self.fetches = 0

    def add(self, kid: str, *, curve: bool = False, publish: bool = True) -> None:
        self.keys[kid] = (
            ec.generate_private_key(ec.SECP256R1())
            if curve
            else rsa.generate_private_key(public_exponent=65537, key_size=2048)
        )
        if publish:
            self.published.append(kid)

    def jwks(self) -> dict[str, Any]:
        found = []
        for kid in self.published:
            key = self.keys[kid]
            algorithm = jwt.algorithms.ECAlgorithm if _is_ec(key) else jwt.algorithms.RSAAlgorithm
            data = json.loads(algorithm.to_jwk(key.public_key()))
            data.update(kid=kid, use="sig", alg="ES256" if _is_ec(key) else "RS256")
            found.append(data)
        return {"keys": found}

    def token(self, kid: str = "k1", *, lifetime: float = 300, **claims: Any) -> str:
        now = int(time.time())
        body = {
            "iss": ISSUER,
            "aud": AUDIENCE,
            "sub": "u-123",
            "preferred_username": "alice",
            "iat": now,
            "exp": now + int(lifetime),
            "groups": ["gpufed:team-a:submitter"],
            **claims,
        }
        key = self.keys[kid]
        algorithm = "ES256" if _is_ec(key) else "RS256"
        return jwt.encode(body, key, algorithm=algorithm, headers={"kid": kid})


def _is_ec(key: Any) -> bool:
    return isinstance(key, ec.EllipticCurvePrivateKey)


@pytest.fixture
async def provider() -> AsyncIterator[tuple[Provider, str]]:
    """The provider and the URL of its JWKS, served on loopback."""
    idp = Provider()
    idp.add("k1")

    async def keys(request: web.Request) -> web.Response:
        idp.fetches += 1
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
