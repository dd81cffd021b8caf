"""The DCGM scraper against a real HTTP server serving dcgm-exporter's page: readings while it
answers, none once it fails (down, garbage, an error status, too slow, too large), a failure
counted each time, one log line per change of state, and the loop never dying of it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from member_agent.utilisation import scraping
from tests import dcgmpages
from tests.dcgmpages import GPU

LOGGER = "member_agent.utilisation.scraping"
PAGE = dcgmpages.render([GPU("gpu-node-1", 0, util=87, fb_used=1024), GPU("gpu-node-1", 1)])


class Exporter:
    """A dcgm-exporter stand-in whose answer the test changes: the page, garbage, a status."""

    def __init__(self) -> None:
        self.answer: tuple[int, str, str] | None = None  # status, body, content type
        self.delay = 0.0
        self.served = 0

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        del request
        self.served += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.answer is not None:
            code, body, content_type = self.answer
            return web.Response(status=code, text=body, content_type=content_type)
        return web.Response(text=PAGE, content_type="text/plain", charset="utf-8")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        return app


@pytest.fixture
async def exporter() -> AsyncIterator[tuple[Exporter, TestServer]]:
    fake = Exporter()
    server = TestServer(fake.app())
    await server.start_server()
    try:
        yield fake, server
    finally:
        await server.close()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"]


async def test_readings_while_it_answers_none_once_it_fails_and_one_line_per_change(
    exporter: tuple[Exporter, TestServer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    fake, server = exporter
    url = str(server.make_url("/metrics"))
    scraper = scraping.DCGMScraper([url], timeout=2.0)
    await scraper.start(background=False)
    try:
        await scraper.scrape()
        assert scraper.up
        assert [(r.hostname, r.index, r.util_percent) for r in scraper.gpus()] == [
            ("gpu-node-1", 0, 87.0),
            ("gpu-node-1", 1, 0.0),
        ]

        fake.answer = (503, "DCGM not ready", "text/plain")
        await scraper.scrape()
        assert (scraper.up, scraper.gpus(), scraper.failures) == (False, [], 1)
        assert "HTTP 503" in scraper.endpoints[0].problem

        fake.answer = (200, "<html>oops</html>", "text/html")
        for _ in range(3):
            await scraper.scrape()
        assert (scraper.up, scraper.failures) == (False, 4)
        assert "not dcgm-exporter's page" in scraper.endpoints[0].problem
        assert len(warnings_of(caplog)) == 1, "one warning when it went down, not one a scrape"
        assert url in warnings_of(caplog)[0] and "HTTP 503" in warnings_of(caplog)[0]

        fake.answer = None
        await scraper.scrape()
        assert scraper.up and len(scraper.gpus()) == 2
        back = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
        assert back[-1] == f"dcgm-exporter {url} answers: 2 GPUs"

        await server.close()  # nothing listens there any more
        await scraper.scrape()
        await scraper.scrape()
        assert (scraper.up, scraper.gpus(), scraper.failures) == (False, [], 6)
        assert len(warnings_of(caplog)) == 2
        assert "ClientConnectorError" in scraper.endpoints[0].problem
    finally:
        await scraper.close()


async def test_too_slow_and_too_large_answers_are_failures(
    exporter: tuple[Exporter, TestServer],
) -> None:
    fake, server = exporter
    url = str(server.make_url("/metrics"))
    slow = scraping.DCGMScraper([url], timeout=0.2)
    small = scraping.DCGMScraper([url], max_bytes=1000)
    await slow.start(background=False)
    await small.start(background=False)
    try:
        await small.scrape()
        assert not small.up
        assert small.endpoints[0].problem == "the page is larger than 1000 bytes"
        fake.delay = 1.0
        await slow.scrape()
        assert not slow.up
        assert slow.endpoints[0].problem.startswith("TimeoutError")
    finally:
        await slow.close()
        await small.close()


async def test_one_endpoint_down_keeps_the_others_readings(
    exporter: tuple[Exporter, TestServer],
) -> None:
    _, server = exporter
    good = str(server.make_url("/metrics"))
    missing = str(server.make_url("/no-such-page"))
    scraper = scraping.DCGMScraper([good, missing])
    await scraper.start(background=False)
    try:
        await scraper.scrape()
        assert not scraper.up
        assert [e.up for e in scraper.endpoints] == [True, False]
        assert len(scraper.gpus()) == 2
    finally:
        await scraper.close()


async def test_the_loop_keeps_fetching_through_failures_until_closed(
    exporter: tuple[Exporter, TestServer],
) -> None:
    fake, server = exporter
    fake.answer = (200, "garbage{{{\n", "text/plain")
    scraper = scraping.DCGMScraper([str(server.make_url("/metrics"))], interval=0.02)
    await scraper.start()
    try:
        for _ in range(200):
            if fake.served >= 5:
                break
            await asyncio.sleep(0.01)
        assert fake.served >= 5 and scraper.failures >= 4
        fake.answer = None
        seen = fake.served
        for _ in range(200):
            if scraper.up:
                break
            await asyncio.sleep(0.01)
        assert scraper.up and fake.served > seen
    finally:
        await scraper.close()
    served = fake.served
    await asyncio.sleep(0.1)
    assert fake.served == served, "closed: no more fetches"


@pytest.mark.parametrize(
    "url", ["dcgm-exporter:9400/metrics", "ftp://host/metrics", "http:///metrics", ""]
)
def test_a_url_that_is_not_http_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="is not an http"):
        scraping.check_url(url)
