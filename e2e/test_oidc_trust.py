"""What an identity provider's claims may grant, through a real `gpufed broker` process with
OIDC on (a JWKS file, `--oidc-fleet-group`): fleet roles only from the fleet groups named, a
group under a tenant only that tenant's roles, and a tenant that is not a DNS label nothing,
each refusal counted on /metrics and nothing stored."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from gpufed.local import processes
from tests.builders import make_job
from tests.idp import AUDIENCE, ISSUER, Provider

pytestmark = pytest.mark.e2e

HOSTILE_TENANTS = ["../../", "<b>x</b>", "a" * 5000, "team-a ", "Team-A"]
# groups -> (method, path, status): what a token of those groups gets
CASES: dict[str, tuple[list[str], str, str, int]] = {
    "a fleet group's member is the admin": (["platform-admins"], "GET", "/metrics", 200),
    "a fleet group's member scrapes": (["prometheus"], "GET", "/metrics", 200),
    "admin under a tenant submits as its tenant-admin": (
        ["gpufed:team-a:admin"],
        "POST",
        "/v1/jobs",
        202,
    ),
    "admin under a tenant does not read the fleet's metrics": (
        ["gpufed:team-a:admin"],
        "GET",
        "/metrics",
        403,
    ),
    "metrics under a tenant does not scrape": (["gpufed:team-a:metrics"], "GET", "/metrics", 403),
    "the default admin group is none once fleet groups are named": (
        ["gpufed:admin"],
        "GET",
        "/metrics",
        403,
    ),
    **{
        f"tenant {tenant[:12]!r} ({len(tenant)} characters)": (
            [f"gpufed:{tenant}:submitter"],
            "POST",
            "/v1/jobs",
            403,
        )
        for tenant in HOSTILE_TENANTS
    },
}


async def call(fleet: processes.LocalFleet, token: str, method: str, path: str) -> tuple[int, str]:
    body = json.dumps(make_job(queue="a-q").document()) if method == "POST" else None
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, fleet.url + path, data=body, headers=headers) as response,
    ):
        return response.status, await response.text()


def rejected(metrics: str) -> dict[str, float]:
    found: dict[str, Any] = {}
    for line in metrics.splitlines():
        if line.startswith("gpufed_oidc_rejected_claims_total{"):
            labels, _, value = line.partition("} ")
            found[labels.split('reason="')[1].rstrip('"')] = float(value)
    return found


async def test_claims_grant_fleet_roles_only_from_fleet_groups_and_tenants_only_dns_labels(
    fleet: processes.LocalFleet,
) -> None:
    idp = Provider()
    idp.add("k1")
    jwks = fleet.workdir / "jwks.json"
    jwks.write_text(json.dumps(idp.jwks()))
    fleet.broker_args = [
        *("--oidc-issuer", ISSUER, "--oidc-audience", AUDIENCE, "--oidc-jwks", str(jwks)),
        *("--oidc-fleet-group", "admin=platform-admins"),
        *("--oidc-fleet-group", "metrics=prometheus"),
    ]
    fleet.write_tokens(tenants=["team-a", "team-b"], clusters=[])
    await fleet.start_broker()
    status, metrics = await call(fleet, fleet.tokens["metrics"], "GET", "/metrics")
    assert status == 200 and set(rejected(metrics).values()) == {0.0}, rejected(metrics)

    got = {}
    for case, (groups, method, path, _) in CASES.items():
        got[case] = (await call(fleet, idp.token(groups=groups), method, path))[0]
    assert got == {case: expected for case, (*_, expected) in CASES.items()}

    _, metrics = await call(fleet, fleet.tokens["metrics"], "GET", "/metrics")
    assert rejected(metrics) == {
        "tenant_not_dns_label": len(HOSTILE_TENANTS),
        "tenant_not_allowed": 0,
        "fleet_role_outside_fleet_groups": 2,  # gpufed:admin, gpufed:team-a:metrics
    }
    _, listed = await call(fleet, fleet.tokens["admin"], "GET", "/v1/jobs")
    assert [job["tenant"] for job in json.loads(listed)["items"]] == ["team-a"]
