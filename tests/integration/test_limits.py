"""Hardening through a real broker on loopback, served as `gpufed broker` serves it: rate
limits per token (10,000 requests above the limit get 429 while another client is served
with bounded latency), an address guessing tokens, the header and body timeouts against a
slow client, the connections per address (idle ones make room; probes and agents still
served when all are busy), requests in progress per principal, the event streams' reserve,
security headers on HTML, the `queue` label bounded, and a malformed request logged in one
line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import statistics
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from broker.http import auth, listening, roles
from tests import guarded
from tests.builders import make_job
from tests.guarded import Broker, Start, bearer

FLOOD = 10_000


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    async with guarded.brokers(tmp_path) as starting:
        yield starting


async def _get(session: aiohttp.ClientSession, url: str, token: str) -> tuple[int, str | None]:
    async with session.get(url, headers=bearer(token)) as answer:
        await answer.read()
        return answer.status, answer.headers.get("Retry-After")


async def test_a_client_over_its_rate_limit_gets_429s_and_others_are_served(
    start: Start,
) -> None:
    broker = await start(rate_limit=50.0, rate_burst=100.0)
    url = broker.url + "/v1/jobs?limit=1"
    statuses: dict[int, int] = {}
    retry_after: set[str | None] = set()
    flooding = True

    async def flood(session: aiohttp.ClientSession, share: int) -> None:
        for _ in range(share):
            status, retry = await _get(session, url, "team-a")
            statuses[status] = statuses.get(status, 0) + 1
            if status == 429:
                retry_after.add(retry)

    latencies: list[float] = []
    other: dict[int, int] = {}

    async def polite() -> None:  # team-b, 20 requests a second: within its own limit
        async with aiohttp.ClientSession() as session:
            while flooding:
                began = time.perf_counter()
                status, _ = await _get(session, url, "team-b")
                latencies.append(time.perf_counter() - began)
                other[status] = other.get(status, 0) + 1
                await asyncio.sleep(0.05)

    began = time.perf_counter()
    served = asyncio.create_task(polite())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) as session:
        await asyncio.gather(*(flood(session, FLOOD // 16) for _ in range(16)))
    elapsed = time.perf_counter() - began
    flooding = False
    await served
    latencies.sort()
    p50 = statistics.median(latencies)
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    print(
        f"\nflood: {FLOOD} requests of one token in {elapsed:.1f} s ({FLOOD / elapsed:.0f}/s): "
        f"{statuses.get(200, 0)} answered 200, {statuses.get(429, 0)} 429 "
        f"(limit 50/s, burst 100); the other client: {sum(other.values())} requests, "
        f"{other.get(200, 0)} 200, latency p50 {p50 * 1000:.1f} ms, "
        f"p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms"
    )
    assert sum(statuses.values()) == FLOOD
    allowed = 100 + 50 * elapsed + 5  # the burst, and what refilled while it went on
    assert statuses.get(200, 0) <= allowed
    assert statuses.get(429, 0) >= FLOOD - allowed
    assert set(statuses) == {200, 429}
    assert retry_after == {"1"}  # whole seconds, at least 1
    assert other == {200: len(latencies)} and len(latencies) >= 10
    assert latencies[-1] < 2.0, "the other client waited too long"
    # the flood's token is itself again once its bucket refills
    await asyncio.sleep(0.1)
    status, _, _ = await broker.call("team-a", "GET", "/v1/jobs?limit=1")
    assert status == 200


async def test_an_address_guessing_tokens_is_turned_away_before_any_lookup(
    start: Start,
) -> None:
    broker = await start(rate_limit=20.0, rate_burst=20.0)
    seen: dict[int, int] = {}
    for _ in range(200):
        status, problem, headers = await broker.call(secrets.token_urlsafe(), "GET", "/v1/jobs")
        seen[status] = seen.get(status, 0) + 1
        if status == 429:
            assert "refused credentials" in problem["detail"] and headers["Retry-After"]
    assert seen.get(401, 0) <= 40 and seen.get(429, 0) >= 160, seen
    # no token at all (a probe) is never limited
    assert (await broker.call(None, "GET", "/healthz"))[0] == 200


async def test_no_rate_limit_by_default(start: Start) -> None:
    broker = await start()
    # 300 requests at once, 32 in progress at a time: within the token's share
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as session:
        answers = await asyncio.gather(
            *(_get(session, broker.url + "/v1/jobs?limit=1", "team-a") for _ in range(300))
        )
    assert {status for status, _ in answers} == {200}


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> tuple[bytes, float]:
    """What the server sent before it closed the connection, and when it closed it."""
    began = time.monotonic()
    data = await asyncio.wait_for(reader.read(), seconds)
    return data, time.monotonic() - began


async def test_a_slow_client_is_closed_at_the_header_and_body_timeouts(start: Start) -> None:
    listen = listening.ListenSettings(header_timeout=1.0)
    broker = await start(listen=listen, body_timeout_seconds=1.0)
    # connected and silent
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.port)
    data, took = await _closed_within(reader, 5.0)
    assert data == b"" and took < 2.5
    await _close(writer)
    # headers started, never finished (slowloris), a byte now and then
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.port)
    writer.write(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n")
    began = time.monotonic()
    while not reader.at_eof() and time.monotonic() - began < 5.0:
        writer.write(b"X-Slow: 1\r\n")
        await asyncio.sleep(0.2)
        if reader.at_eof() or writer.is_closing():
            break
        try:
            await asyncio.wait_for(reader.read(1), 0.01)
        except TimeoutError:
            continue
    assert time.monotonic() - began < 2.5, "a slow header keeps its connection"
    await _close(writer)
    # the whole headers, a body that stops half-way
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.port)
    writer.write(
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer team-a\r\n"
        b'Content-Type: application/json\r\nContent-Length: 400\r\n\r\n{"kind":'
    )
    data, took = await _closed_within(reader, 5.0)
    assert data.startswith(b"HTTP/1.1 408"), data[:80]
    assert took < 2.5
    await _close(writer)
    # a client that sends in time is served as before
    assert (await broker.call("team-a", "POST", "/v1/jobs", make_job(queue="a-q").document()))[
        0
    ] == 202


async def _request(
    port: int, path: str, token: str | None = None
) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """A new connection's first answer (its head and what came with it), the connection kept."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth_line = f"Authorization: Bearer {token}\r\n" if token else ""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth_line}\r\n".encode())
    return await asyncio.wait_for(reader.read(400), 5.0), reader, writer


async def _open_stream(broker: Broker, token: str) -> aiohttp.ClientResponse:
    answer = await broker.session.get(broker.url + "/v1/events", headers=bearer(token))
    assert answer.status == 200, await answer.text()
    await answer.content.readuntil(b"\n\n")  # hello
    return answer


async def _served_within(broker: Broker, token: str, seconds: float) -> bool:
    """Whether `GET /v1/jobs` of `token` is answered 200 within `seconds` (asked again and
    again on new connections)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        answer, _, writer = await _request(broker.port, "/v1/jobs", token)
        await _close(writer)
        if answer.startswith(b"HTTP/1.1 200"):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_idle_connections_make_room_for_a_new_one(start: Start) -> None:
    broker = await start(listen=listening.ListenSettings(max_connections_per_client=4))
    idle = [await asyncio.open_connection("127.0.0.1", broker.port) for _ in range(4)]
    await asyncio.sleep(0.1)
    answer, _, writer = await _request(broker.port, "/v1/whoami", "team-b")
    assert answer.startswith(b"HTTP/1.1 200"), answer[:80]
    data, _ = await _closed_within(idle[0][0], 5.0)  # the longest idle made room
    assert data == b""
    for _, held in [*idle, (None, writer)]:
        await _close(held)


async def test_an_address_whose_connections_are_all_busy_still_serves_probes_and_agents(
    start: Start,
) -> None:
    broker = await start(listen=listening.ListenSettings(max_connections_per_client=4))
    streams = [await _open_stream(broker, token) for token in ("team-a", "team-a", "a-admin")]
    streams.append(await _open_stream(broker, "team-b"))
    # every connection of the address has a request in progress: a user's is refused
    answer, reader, writer = await _request(broker.port, "/v1/jobs", "admin")
    assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer, answer[:80]
    assert b"health probes and agents only" in answer + await reader.read()
    await _close(writer)
    for path in ("/healthz", "/readyz"):
        answer, _, writer = await _request(broker.port, path)
        assert answer.startswith(b"HTTP/1.1 200"), (path, answer[:80])
        await _close(writer)
    answer, _, writer = await _request(broker.port, "/v1/agents/connect", "agent-c1")
    assert answer.startswith(b"HTTP/1.1 400"), answer[:80]  # its route, answered: no upgrade
    await _close(writer)
    streams.pop().close()  # one of them ends: its slot is a user's again
    assert await _served_within(broker, "admin", 1.0)
    for stream in streams:
        stream.close()


async def test_a_principal_s_requests_in_progress_are_capped_not_its_tenant_s_neighbours(
    start: Start,
) -> None:
    broker = await start(max_requests_per_principal=2)
    streams = [await _open_stream(broker, "team-a") for _ in range(2)]
    status, problem, headers = await broker.call("team-a", "GET", "/v1/jobs")
    assert status == 429 and headers["Retry-After"] == "1"
    assert "2 requests in progress" in problem["detail"]
    assert (await broker.call("a-admin", "GET", "/v1/jobs"))[0] == 200  # another token
    assert (await broker.call("team-b", "GET", "/v1/jobs"))[0] == 200
    streams[0].close()
    assert await _served_within(broker, "team-a", 1.0)
    streams[1].close()


async def test_the_last_event_streams_are_kept_for_callers_holding_none(start: Start) -> None:
    broker = await start(max_event_streams=10, max_event_streams_per_principal=5)
    streams = [await _open_stream(broker, "team-a") for _ in range(5)]
    streams += [await _open_stream(broker, "a-admin") for _ in range(4)]  # 9: the reserve's 1
    status, problem, _ = await broker.call("a-admin", "GET", "/v1/events")
    assert status == 503 and "kept for callers holding none" in problem["detail"]
    status, problem, _ = await broker.call("team-a", "GET", "/v1/events")
    assert status == 429 and "holds 5 event streams" in problem["detail"]
    streams.append(await _open_stream(broker, "team-b"))  # holds none: the reserve's
    status, _, _ = await broker.call("admin", "GET", "/v1/events")
    assert status == 503  # all 10 taken
    for stream in streams:
        stream.close()


@pytest.mark.parametrize(
    ("trusted", "source"),
    [
        pytest.param(("127.0.0.0/8",), "203.0.113.7", id="behind a trusted proxy: the client"),
        pytest.param((), "127.0.0.1", id="no trusted proxy: the peer"),
    ],
)
async def test_the_audit_log_and_rate_limits_name_the_client_a_trusted_proxy_forwards(
    start: Start, tmp_path: Path, trusted: tuple[str, ...], source: str
) -> None:
    log = tmp_path / "audit.jsonl"
    broker = await start(
        listen=listening.ListenSettings(trusted_proxies=trusted),
        audit_log=str(log),
        rate_limit=1.0,
        rate_burst=1.0,
    )
    forwarded = {"X-Forwarded-For": "203.0.113.7"}
    status, _, _ = await broker.call("no-such-token", "GET", "/v1/jobs", headers=forwarded)
    assert status == 401
    status, problem, _ = await broker.call("guess-2", "GET", "/v1/jobs", headers=forwarded)
    assert status == 429 and f"client {source} " in problem["detail"]
    assert json.loads(log.read_text().splitlines()[0])["source"] == source
    # another client of the proxy has a failure budget of its own; the proxy's peer has none
    other = {"X-Forwarded-For": "198.51.100.9"}
    status, _, _ = await broker.call("guess-3", "GET", "/v1/jobs", headers=other)
    assert status == (401 if trusted else 429)


def _html_page(app: web.Application) -> None:
    async def page(request: web.Request) -> web.Response:
        return web.Response(text="<html><body>console</body></html>", content_type="text/html")

    async def framed(request: web.Request) -> web.Response:
        answer = web.Response(text="<html></html>", content_type="text/html")
        answer.headers["Content-Security-Policy"] = "default-src 'self'"
        return answer

    app.router.add_get("/ui/test-page", page)
    app.router.add_get("/ui/own-policy", framed)
    rules = app[auth.ACCESS]
    app[auth.ACCESS] = types.MappingProxyType(
        {
            **rules,
            ("GET", "/ui/test-page"): roles.PUBLIC,
            ("GET", "/ui/own-policy"): roles.PUBLIC,
        }
    )


async def test_html_answers_carry_security_headers(start: Start) -> None:
    broker = await start(prepare=_html_page)
    _, _, headers = await broker.call(None, "GET", "/ui/test-page")
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["Content-Security-Policy"] == "frame-ancestors 'none'"
    assert headers["Referrer-Policy"] == "no-referrer"
    _, _, headers = await broker.call(None, "GET", "/ui/own-policy")
    assert headers["Content-Security-Policy"] == "default-src 'self'; frame-ancestors 'none'"
    _, _, headers = await broker.call("team-a", "GET", "/v1/jobs")
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert "X-Frame-Options" not in headers  # JSON is not framed anyway


async def _metric_queues(broker: Broker, name: str) -> dict[str, float]:
    _, text, _ = await broker.call("admin", "GET", "/metrics")
    found: dict[str, float] = {}
    for line in str(text).splitlines():
        if line.startswith(name + "{"):
            queue = line.split('queue="', 1)[1].split('"', 1)[0]
            found[queue] = float(line.rsplit(" ", 1)[1])
    return found


async def test_the_queue_label_is_bounded(start: Start) -> None:
    broker = await start()  # open mode: any queue name takes jobs
    await broker.submit("team-a", "a-q")
    names = [f"made-up-{n}" for n in range(25)]
    for name in names:
        await broker.submit("team-a", name)
    submitted = await _metric_queues(broker, "gpufed_jobs_submitted_total")
    assert submitted["a-q"] == 1  # declared: its own series
    assert submitted["other"] == 5  # past the 20 undeclared names given one
    assert submitted["b-q"] == 0  # declared, no job yet: at 0 from the start
    assert len(submitted) == 2 + 20 + 1  # the declared, 20 undeclared, other
    pending: dict[str, float] = {}
    for _ in range(50):  # the scheduler exports the pending gauges each cycle
        pending = await _metric_queues(broker, "gpufed_pending_jobs")
        if sum(pending.values()) == 26:
            break
        await asyncio.sleep(0.05)
    assert pending.get("other") == 5 and len(pending) == 23, pending  # b-q at 0 too


async def test_malformed_requests_are_logged_in_one_line(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await start()
    caplog.set_level(logging.INFO)
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
    data, _ = await _closed_within(reader, 5.0)
    assert data.startswith(b"HTTP/1.0 400") or data.startswith(b"HTTP/1.1 400")
    await _close(writer)
    status, _, _ = await broker.call("team-a", "POST", "/v1/jobs", {"kind": "nonsense"})
    assert status == 422
    records = [r for r in caplog.records if r.name in ("aiohttp.server", "broker.http.problems")]
    parsed = [r for r in records if r.name == "aiohttp.server"]
    refused = [r for r in records if r.name == "broker.http.problems"]
    assert parsed and refused, [r.getMessage() for r in caplog.records]
    for record in records:
        assert record.exc_info is None and record.levelno == logging.INFO, record
        assert "\n" not in record.getMessage(), record.getMessage()
    assert "Content-Length" in parsed[0].getMessage()
    assert "422" in refused[0].getMessage()
