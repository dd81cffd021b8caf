"""The broker's listener: connections per client address capped, a header timeout, and the
process's run until SIGTERM or SIGINT.

A client address holds at most `max_connections_per_client` connections at once (an agent
session is one); one more is answered `503` with `Retry-After` and closed before aiohttp
reads it. A connection must send its request's headers within `header_timeout` of opening,
or of the previous answer (aiohttp's keep-alive timer: it closes a connection that has no
request in progress, also one half-way through its headers), so a slow client cannot hold
connections without sending; the body has its own timeout (`limits.body_middleware`).

`run` is what `gpufed broker` serves with (aiohttp's `run_app` cannot cap connections);
tests start the same `CappedSite` with `start`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import time
from collections import Counter
from dataclasses import dataclass

from aiohttp import web

logger = logging.getLogger(__name__)

REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: 40\r\n\r\ntoo many connections from this address\r\n"
)


@dataclass(frozen=True)
class ListenSettings:
    # seconds a connection may take to send a request's headers (or stay idle between two)
    header_timeout: float = 30.0
    max_connections_per_client: int = 256
    shutdown_timeout: float = 60.0


class ConnectionCap:
    """Open connections per client address, at most `per_address` each."""

    def __init__(self, per_address: int) -> None:
        self.per_address = per_address
        self.open: Counter[str] = Counter()
        self.refused = 0

    def admit(self, address: str) -> bool:
        if self.open[address] >= self.per_address:
            self.refused += 1
            return False
        self.open[address] += 1
        return True

    def release(self, address: str) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]


class _Capped(asyncio.Protocol):
    """aiohttp's protocol for one connection, or a refusal if its address is over the cap."""

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap) -> None:
        self._inner = inner
        self._cap = cap
        self._address: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self._cap.admit(address):
            if self._cap.refused in (1, 10, 100) or self._cap.refused % 1000 == 0:
                logger.warning(
                    "refused a connection from %s: it holds %d already (%d refused so far)",
                    address,
                    self._cap.per_address,
                    self._cap.refused,
                )
            if isinstance(transport, asyncio.WriteTransport):
                transport.write(REFUSED)
            transport.close()
            return
        self._address = address
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._address is None:
            return
        self._cap.release(self._address)
        self._address = None
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._address is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._address is not None else None

    def pause_writing(self) -> None:
        if self._address is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._address is not None:
            self._inner.resume_writing()


class CappedSite(web.BaseSite):
    """A TCP site whose connections pass the cap first (TLS when given a context)."""

    __slots__ = ("_bound", "_cap", "_host", "_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        cap: ConnectionCap,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._host = host
        self._port = port
        self._cap = cap
        self._bound = port

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._bound}"

    @property
    def port(self) -> int:
        """The port bound (the one asked, or the system's pick for 0)."""
        return self._bound

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        cap = self._cap
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Capped(server(), cap),
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=True,
        )
        if self._server.sockets:
            self._bound = self._server.sockets[0].getsockname()[1]


async def start(
    app: web.Application,
    *,
    host: str,
    port: int,
    settings: ListenSettings,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, CappedSite]:
    """`app` served on host:port (its startup run): the runner to clean up, and the site."""
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        keepalive_timeout=settings.header_timeout,
        shutdown_timeout=settings.shutdown_timeout,
    )
    await runner.setup()
    site = CappedSite(
        runner,
        host,
        port,
        cap=ConnectionCap(settings.max_connections_per_client),
        ssl_context=ssl_context,
    )
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site


def run(
    app: web.Application,
    *,
    host: str,
    port: int,
    settings: ListenSettings,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """Serve `app` until SIGTERM or SIGINT, then shut it down (its cleanups run)."""

    async def serving() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def stopping(signum: signal.Signals) -> None:
            logger.info("%s: shutting down (a leader hands over first)", signum.name)
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping, signum)
        runner, site = await start(
            app, host=host, port=port, settings=settings, ssl_context=ssl_context
        )
        logger.info("listening on %s", site.name)
        try:
            await stop.wait()
        finally:
            began = time.monotonic()
            await runner.cleanup()
            logger.info("stopped in %.2f s", time.monotonic() - began)

    asyncio.run(serving())
