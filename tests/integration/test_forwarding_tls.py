"""A follower asks the leader over HTTPS (`http.forwarding` with `--peer-ca-file` and
`--peer-server-name`): real TLS handshakes on loopback, certificates made in the test. The
leader's certificate names `broker-0.gpufed.internal` only, not the address it is reached at,
as a replica that advertises its pod address is."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from broker.http import forwarding
from tests import certificates

NAME = "broker-0.gpufed.internal"


@pytest.fixture
async def leader(tmp_path: Path) -> AsyncIterator[tuple[str, Path, Path]]:
    """An HTTPS leader on loopback answering `why`; its URL, its CA, and a CA of nothing."""
    ca = certificates.make_ca("replicas CA")
    cert, key = certificates.write_pair(
        certificates.make_leaf(NAME, ca=ca, server=True, dns=(NAME,), loopback=False),
        tmp_path,
        "leader",
    )
    ca_file = certificates.write_ca(ca, tmp_path / "ca.crt")
    other = certificates.write_ca(certificates.make_ca("another CA"), tmp_path / "other.crt")

    async def why(request: web.Request) -> web.Response:
        assert request.headers.get(forwarding.FORWARDED) == "1"
        return web.json_response({"from": "leader", "auth": request.headers["Authorization"]})

    app = web.Application()
    app.router.add_get("/v1/jobs/{id}/why", why)
    runner = web.AppRunner(app)
    await runner.setup()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = runner.addresses[0][1]
    yield f"https://127.0.0.1:{port}", ca_file, other
    await runner.cleanup()


async def ask_through_follower(leader_url: str, peers: dict[str, Any]) -> dict[str, Any]:
    """A follower (plain HTTP on loopback) whose handler forwards to `leader_url`."""

    async def why(request: web.Request) -> web.Response:
        answer = await forwarding.ask_leader(request, leader_url)
        return web.json_response(answer if answer is not None else {"from": "own cache"})

    app = web.Application()
    forwarding.configure(app, **peers)
    app.router.add_get("/v1/jobs/{id}/why", why)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with (
            aiohttp.ClientSession() as client,
            client.get(
                f"http://127.0.0.1:{port}/v1/jobs/j1/why",
                headers={"Authorization": "Bearer dev-team-a"},
            ) as response,
        ):
            assert response.status == 200
            body: dict[str, Any] = await response.json()
            return body
    finally:
        await runner.cleanup()


async def test_a_follower_that_trusts_the_replicas_ca_and_name_gets_the_leaders_answer(
    leader: tuple[str, Path, Path],
) -> None:
    url, ca_file, _ = leader
    answer = await ask_through_follower(url, {"ca_file": ca_file, "server_name": NAME})
    assert answer == {"from": "leader", "auth": "Bearer dev-team-a"}


@pytest.mark.parametrize(
    "peers",
    [
        pytest.param({"ca_file": None, "server_name": NAME}, id="the system CAs: not trusted"),
        pytest.param({"ca_file": "other", "server_name": NAME}, id="another CA: not trusted"),
        pytest.param({"ca_file": "ca", "server_name": None}, id="the address: not named"),
        pytest.param({"ca_file": "ca", "server_name": "broker-9.x"}, id="another name"),
    ],
)
async def test_a_leader_not_verified_is_not_asked_and_the_follower_answers_itself(
    leader: tuple[str, Path, Path], peers: dict[str, Any]
) -> None:
    url, ca_file, other = leader
    files = {"ca": ca_file, "other": other, None: None}
    given = {**peers, "ca_file": files[peers["ca_file"]]}
    assert await ask_through_follower(url, given) == {"from": "own cache"}
