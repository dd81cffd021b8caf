"""Fetching dcgm-exporter's pages every few seconds, without ever stopping the agent for them.

`app.run_agent` starts a `DCGMScraper` when `--dcgm-url` is given and stops it on the way out;
`exporting.collect` reads its readings and its health at each scrape of the agent's `/metrics`.
Every URL (one exporter each, or a Prometheus `/federate` URL for all of them) is fetched every
`interval` seconds, all at once, each within `timeout`, and its page parsed by
`readings.parse_page` in a worker thread (a federated page of a large cluster is megabytes).

A URL that does not answer, answers with an error status, with more than `max_bytes`, or with
a page that is not dcgm-exporter's is *down*: its readings are dropped at once (stale ones would
hide an idle GPU or show a busy one), the failure is counted, and one warning says why when it
goes down; one line says so when it is back. Not a line per scrape: an exporter down for a day
logs twice. Nothing a scrape raises leaves the loop, which runs until `close`.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from kits import tasks
from member_agent.utilisation import readings

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_SECONDS = 15.0
DEFAULT_TIMEOUT_SECONDS = 5.0
MAX_PAGE_BYTES = 64 << 20


def check_url(url: str) -> str:
    """`url` if it is an http(s) URL with a host; else ValueError naming it."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL, e.g. http://dcgm-exporter:9400/metrics")
    return url.strip()


class FetchError(Exception):
    """An endpoint did not give a page: no answer, an error status, too large."""


@dataclass
class Endpoint:
    """One URL and what its last fetch gave."""

    url: str
    found: list[readings.GPUReading] = field(default_factory=list)
    up: bool | None = None  # None: not fetched yet
    problem: str = ""  # why it is down
    failures: int = 0  # fetches that failed, ever

    def succeeded(self, found: list[readings.GPUReading]) -> None:
        if self.up is not True:
            logger.info("dcgm-exporter %s answers: %d GPUs", self.url, len(found))
        self.found, self.up, self.problem = found, True, ""

    def failed(self, problem: str) -> None:
        self.failures += 1
        if self.up is not False:
            logger.warning(
                "dcgm-exporter %s is down (%s): its GPUs' utilisation is not exported until "
                "it answers again",
                self.url,
                problem,
            )
        self.found, self.up, self.problem = [], False, problem


class DCGMScraper:
    """Keeps the latest readings of every URL; `start` once, `close` at the end."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        interval: float = DEFAULT_INTERVAL_SECONDS,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        max_bytes: int = MAX_PAGE_BYTES,
    ) -> None:
        self.endpoints = [Endpoint(url) for url in urls]
        self.interval = interval
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, *, background: bool = True) -> None:
        """Begin fetching every interval, the first fetch at once (`background=False`: only
        when the caller calls `scrape`)."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            headers={"Accept": "text/plain"},
        )
        if background:
            self._task = asyncio.create_task(self._run(), name="dcgm-scraper")

    async def close(self) -> None:
        if self._task is not None:
            await tasks.stop_task(self._task)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def gpus(self) -> list[readings.GPUReading]:
        """The GPUs the endpoints that answered last showed."""
        return [reading for endpoint in self.endpoints for reading in endpoint.found]

    @property
    def up(self) -> bool:
        """Every endpoint answered its last fetch with a dcgm-exporter page."""
        return all(endpoint.up for endpoint in self.endpoints)

    @property
    def failures(self) -> int:
        return sum(endpoint.failures for endpoint in self.endpoints)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.scrape()
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))

    async def scrape(self) -> None:
        """Fetch every endpoint once (what the loop does every interval)."""
        await asyncio.gather(*(self._scrape(endpoint) for endpoint in self.endpoints))

    async def _scrape(self, endpoint: Endpoint) -> None:
        try:
            text = await self._fetch(endpoint.url)
            found = await asyncio.to_thread(readings.parse_page, text)
        except (FetchError, readings.PageError) as exc:
            endpoint.failed(str(exc))
        except (aiohttp.ClientError, TimeoutError, UnicodeError) as exc:
            endpoint.failed(f"{type(exc).__name__}: {exc}".rstrip(": "))
        except Exception as exc:  # never the agent's end: anything else is counted and said
            endpoint.failed(f"unexpected {type(exc).__name__}: {exc}")
        else:
            endpoint.succeeded(found)

    async def _fetch(self, url: str) -> str:
        if self._session is None:
            raise FetchError("the scraper is not started")
        async with self._session.get(url) as response:
            if response.status != 200:
                raise FetchError(f"HTTP {response.status} {response.reason or ''}".rstrip())
            body = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > self.max_bytes:
                    raise FetchError(f"the page is larger than {self.max_bytes} bytes")
            try:
                return body.decode(response.charset or "utf-8", errors="replace")
            except LookupError:  # a charset Python does not know
                return body.decode("utf-8", errors="replace")
