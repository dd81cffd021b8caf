"""Fair shares of the broker itself (real broker and agent processes, every client on one
loopback address as behind an ingress): what one tenant token holds — event streams,
connections, requests in progress — leaves the others, the admin, the agents and the health
probes served; `X-Forwarded-For` names the client only from a trusted proxy; a reader that
closes its stream frees it at once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gpufed.local import processes

pytestmark = pytest.mark.e2e

STREAMS_PER_PRINCIPAL = 8  # the defaults (--max-event-streams-per-principal,
REQUESTS_PER_PRINCIPAL = 64  # --max-requests-per-principal)
FORWARDED = "203.0.113.7"  # the client a proxy names
OTHER_FORWARDED = "198.51.100.9"


async def start(fleet: processes.LocalFleet, *broker_args: str) -> processes.LocalFleet:
    fleet.write_tokens(tenants=["team-a", "team-b"], clusters=["h100", "a100"])
    fleet.broker_args = list(broker_args)
    await fleet.start_broker()
    await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    await fleet.wait_clusters_ready(["h100"])
    return fleet


@contextlib.asynccontextmanager
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client with no connection limit of its own: each request its own connection."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        yield client


def headers(fleet: processes.LocalFleet, who: str, forwarded: str | None) -> dict[str, str]:
    sent = {"Authorization": f"Bearer {fleet.tokens[who]}"}
    if forwarded is not None:
        sent["X-Forwarded-For"] = forwarded
    return sent


async def open_stream(
    client: aiohttp.ClientSession,
    fleet: processes.LocalFleet,
    who: str,
    *,
    forwarded: str | None = None,
) -> tuple[int | None, aiohttp.ClientResponse | None]:
    """`GET /v1/events` as `who`: its status, and the open stream (its hello read) if 200;
    None for a connection closed without an answer."""
    try:
        response = await client.get(
            f"{fleet.url}/v1/events", headers=headers(fleet, who, forwarded)
        )
    except aiohttp.ClientError:
        return None, None
    if response.status != 200:
        response.release()
        return response.status, None
    await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)  # hello
    return 200, response


async def status_of(
    fleet: processes.LocalFleet, path: str, who: str | None = None, *, forwarded: str | None = None
) -> int | None:
    """A new connection's answer to `GET path` (None: closed without one)."""
    sent = headers(fleet, who, forwarded) if who is not None else {}
    try:
        async with (
            session() as client,
            client.get(f"{fleet.url}{path}", headers=sent) as response,
        ):
            await response.read()
            return response.status
    except aiohttp.ClientError:
        return None


async def fill_streams(
    client: aiohttp.ClientSession,
    fleet: processes.LocalFleet,
    who: str,
    *,
    forwarded: str | None = None,
    most: int = 600,
) -> tuple[list[aiohttp.ClientResponse], int | None]:
    """`who` opens streams until one is refused: the open ones and the refusal's status."""
    held: list[aiohttp.ClientResponse] = []
    for _ in range(most):
        status, response = await open_stream(client, fleet, who, forwarded=forwarded)
        if response is None:
            return held, status
        held.append(response)
    return held, 200


async def test_a_token_opening_streams_until_refused_leaves_one_for_another_tenant_and_the_admin(
    fleet: processes.LocalFleet,
) -> None:
    await start(fleet)
    async with session() as client:
        held, refused = await fill_streams(client, fleet, "team-a")
        for other in ("team-b", "admin"):
            status, stream = await open_stream(client, fleet, other)
            assert status == 200, f"{other} refused a stream after team-a opened {len(held)}"
            assert stream is not None
            stream.close()
        assert (refused, len(held)) == (429, STREAMS_PER_PRINCIPAL)
        for stream in held:
            stream.close()


async def hold_slow_bodies(
    fleet: processes.LocalFleet, who: str, count: int
) -> tuple[list[asyncio.StreamWriter], list[bytes]]:
    """`count` POSTs of `who` whose bodies never finish, sent at once: the connections whose
    request is in progress a second later, and the answers the others got."""
    opened = [await asyncio.open_connection("127.0.0.1", fleet.port) for _ in range(count)]
    for _, writer in opened:
        writer.write(
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {fleet.tokens[who]}\r\n".encode()
            + b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"kind":'
        )
    await asyncio.sleep(1.0)
    pending, answers = [], []
    for reader, writer in opened:
        try:
            answers.append(await asyncio.wait_for(reader.read(200), 0.01))
        except TimeoutError:
            pending.append(writer)
            continue
        except ConnectionError:
            answers.append(b"")  # refused before a word
        writer.close()
    return pending, answers


async def test_a_tenant_holding_many_connections_leaves_others_agents_and_probes_served(
    fleet: processes.LocalFleet,
) -> None:
    await start(fleet)  # --max-connections-per-client 256, the default
    async with session() as client:
        streams, _ = await fill_streams(client, fleet, "team-a", most=16)
        slow, refused = await hold_slow_bodies(fleet, "team-a", 100)
        idle = [await asyncio.open_connection("127.0.0.1", fleet.port) for _ in range(300)]
        # every user of the address but team-a is served; so are the probes and the agents
        assert await status_of(fleet, "/v1/jobs", "team-b") == 200
        status, stream = await open_stream(client, fleet, "team-b")
        assert status == 200 and stream is not None
        stream.close()
        assert await status_of(fleet, "/healthz") == 200
        assert await status_of(fleet, "/readyz") == 200
        await fleet.start_agent("a100", processes.config_dir() / "clusters" / "a100.yaml")
        await fleet.wait_clusters_ready(["h100", "a100"], timeout=15)
        # what team-a holds is its share: requests in progress, streams among them
        assert len(streams) + len(slow) == REQUESTS_PER_PRINCIPAL
        assert refused and all(a.startswith(b"HTTP/1.1 429") for a in refused), refused[:1]
        assert await status_of(fleet, "/v1/jobs", "team-a") == 429
        for stream in streams:
            stream.close()
        for _, writer in idle:
            writer.close()
        for writer in slow:
            writer.close()


@pytest.mark.parametrize(
    "trusted",
    [
        pytest.param(True, id="through a trusted proxy the forwarded client is counted"),
        pytest.param(False, id="from any other peer X-Forwarded-For is ignored"),
    ],
)
async def test_the_per_address_cap_counts_the_forwarded_client_only_from_a_trusted_proxy(
    fleet: processes.LocalFleet, trusted: bool
) -> None:
    proxy = ["--trusted-proxy", "127.0.0.1/32"] if trusted else []
    await start(fleet, "--max-connections-per-client", "8", *proxy)
    async with session() as client:
        held, _ = await fill_streams(client, fleet, "team-a", forwarded=FORWARDED, most=8)
        assert len(held) == 8
        # the client holding 8: refused, whoever asks for it
        assert await status_of(fleet, "/v1/jobs", "team-b", forwarded=FORWARDED) == 503
        # another client: a client of its own only if a trusted proxy says so
        other = await status_of(fleet, "/v1/jobs", "team-b", forwarded=OTHER_FORWARDED)
        assert other == (200 if trusted else 503)
        assert await status_of(fleet, "/healthz") == 200
        for stream in held:
            stream.close()


async def test_a_reader_that_closes_its_stream_frees_its_slot_within_a_second(
    fleet: processes.LocalFleet,
) -> None:
    await start(fleet)
    async with session() as client:
        held, refused = await fill_streams(client, fleet, "team-a")
        assert (refused, len(held)) == (429, STREAMS_PER_PRINCIPAL)
        held.pop().close()  # the reader goes away; no keepalive is due for 15 s
        began = time.monotonic()
        while time.monotonic() - began < 5.0:
            status, stream = await open_stream(client, fleet, "team-a")
            if stream is not None:
                held.append(stream)
                break
            assert status == 429
            await asyncio.sleep(0.05)
        took = time.monotonic() - began
        assert len(held) == STREAMS_PER_PRINCIPAL and took < 1.0, f"freed after {took:.2f} s"
        for stream in held:
            stream.close()
