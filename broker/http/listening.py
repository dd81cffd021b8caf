"""The broker's listener: connections per client address capped, a header timeout, and the
process's run until SIGTERM or SIGINT.

A client address holds at most `max_connections_per_client` connections at once. A
connection with no request in progress (idle between two, or still sending its headers)
holds no slot against a newcomer: when the address is at its cap, its longest-idle
connection is closed to admit the new one, so idle connections cannot lock an address out.
When every one of them has a request in progress, up to `RESERVE` more are admitted as
reserved connections, which serve only `EXEMPT_PATHS` (the health probes and the agents'
sessions: `broker.http.limits.client_middleware` answers anything else `503` and closes
it); past that a connection is answered `503` with `Retry-After` and closed before aiohttp
reads it. Requests in progress are bounded per principal too (`broker.http.limits`), so one
token cannot fill its address's slots.

A peer among `trusted_proxies` (an ingress: addresses or CIDRs) is not capped itself; its
`X-Forwarded-For` names the client (`ConnectionCap.client_of`), whose requests in progress
are capped at the same number. From any other peer the header is ignored.

A connection must send its request's headers within `header_timeout` of opening, or of the
previous answer (aiohttp's keep-alive timer: it closes a connection that has no request in
progress, also one half-way through its headers), so a slow client cannot hold connections
without sending; the body has its own timeout (`limits.body_middleware`).

`run` is what `gpufed broker` serves with (aiohttp's `run_app` cannot cap connections);
tests start the same `CappedSite` with `start`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import ssl
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from aiohttp import web

logger = logging.getLogger(__name__)

REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: 40\r\n\r\ntoo many connections from this address\r\n"
)
# connections an address may open past its cap while all of its others have a request in
# progress: for the routes below only
RESERVE = 16
# what users' caps never refuse: the probes and the agents' sessions (an agent kept out
# past --lost-after loses its cluster's jobs)
EXEMPT_PATHS = frozenset({"/healthz", "/readyz", "/v1/agents/connect"})

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class ListenSettings:
    # seconds a connection may take to send a request's headers (or stay idle between two)
    header_timeout: float = 30.0
    max_connections_per_client: int = 256
    shutdown_timeout: float = 60.0
    # addresses or CIDRs of proxies whose X-Forwarded-For names the client (none: ignored)
    trusted_proxies: tuple[str, ...] = ()


def parse_networks(texts: Iterable[str]) -> tuple[Network, ...]:
    """`10.0.0.0/8`, `192.0.2.7`, `fd00::/8` as networks; ValueError naming a bad one."""
    networks = []
    for text in texts:
        try:
            networks.append(ipaddress.ip_network(text.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{text!r} is not an IP address or CIDR") from None
    return tuple(networks)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@dataclass(eq=False)
class Connection:
    """One admitted connection: its peer address, and whether a request is in progress."""

    address: str
    transport: asyncio.BaseTransport
    capped: bool = True  # false: a trusted proxy's
    reserved: bool = False  # admitted past the cap: EXEMPT_PATHS only
    busy: int = 0  # requests in progress on it
    exempt: bool = False  # its request in progress is on EXEMPT_PATHS: it takes no slot


class ConnectionCap:
    """Open connections per client address, at most `per_address` each (and `reserve` more
    for the exempt routes); requests in progress per client, the same number."""

    def __init__(
        self,
        per_address: int,
        *,
        reserve: int = RESERVE,
        trusted_proxies: Iterable[str] = (),
    ) -> None:
        self.per_address = per_address
        self.reserve = reserve
        self.trusted = parse_networks(trusted_proxies)
        # an address's connections, the longest idle first (moved last as a request ends)
        self.open: dict[str, dict[Connection, None]] = {}
        self.by_transport: dict[asyncio.BaseTransport, Connection] = {}
        self.requests: Counter[str] = Counter()  # in progress, by client (forwarded-for)
        self.refused = 0
        self.evicted = 0

    def trusts(self, address: str) -> bool:
        """Whether `address` is a trusted proxy."""
        if not self.trusted:
            return False
        parsed = _address(address)
        return parsed is not None and any(parsed in network for network in self.trusted)

    def client_of(self, peer: str, forwarded_for: str | None) -> str:
        """The client a request comes from: `peer`, or, from a trusted proxy, the nearest
        address in `X-Forwarded-For` (read from the right) that is not a trusted proxy.
        An entry that is not an address stops the walk at the last trusted one."""
        if not forwarded_for or not self.trusts(peer):
            return peer
        client = peer
        for hop in reversed(forwarded_for.split(",")):
            parsed = _address(hop)
            if parsed is None:
                break
            client = str(parsed)
            if not self.trusts(client):
                break
        return client

    def admit(self, address: str, transport: asyncio.BaseTransport) -> Connection | None:
        """The connection admitted (an idle one of the address closed to make room, if
        need be), or None: refused."""
        if self.trusts(address):
            connection = Connection(address, transport, capped=False)
            self.by_transport[transport] = connection
            return connection
        held = self.open.setdefault(address, {})
        reserved = False
        if len(held) >= self.per_address:  # probes' and agents' sessions take no slot
            taking = sum(1 for c in held if not c.exempt)
            if taking >= self.per_address:
                idle = next((c for c in held if not c.busy), None)
                if idle is not None:
                    self._evict(idle)
                    taking -= 1
            if taking >= self.per_address + self.reserve:
                self.refused += 1
                return None
            regular = sum(1 for c in held if not c.exempt and not c.reserved)
            reserved = regular >= self.per_address
        connection = Connection(address, transport, reserved=reserved)
        held[connection] = None
        self.by_transport[transport] = connection
        return connection

    def _evict(self, connection: Connection) -> None:
        self.release(connection)
        self.evicted += 1
        connection.transport.close()

    def release(self, connection: Connection) -> None:
        if self.by_transport.pop(connection.transport, None) is None:
            return  # released already (evicted, then lost)
        held = self.open.get(connection.address)
        if held is not None:
            held.pop(connection, None)
            if not held:
                del self.open[connection.address]

    def find(self, transport: asyncio.BaseTransport | None) -> Connection | None:
        return self.by_transport.get(transport) if transport is not None else None

    def begin(self, connection: Connection | None, client: str, *, counted: bool) -> None:
        """A request in progress on `connection` (none: not one of the cap's), from `client`
        (`counted`: against its cap; not for EXEMPT_PATHS). `end` follows it."""
        if connection is not None:
            connection.busy += 1
            connection.exempt = not counted
        if counted:
            self.requests[client] += 1

    def end(self, connection: Connection | None, client: str, *, counted: bool) -> None:
        if counted:
            self.requests[client] -= 1
            if self.requests[client] <= 0:
                del self.requests[client]
        if connection is not None:
            connection.busy -= 1
            connection.exempt = False
            held = self.open.get(connection.address)
            if not connection.busy and held is not None and connection in held:
                del held[connection]  # the most recently idle: evicted last
                held[connection] = None


CONNECTIONS = web.AppKey("connections", ConnectionCap)


class _Capped(asyncio.Protocol):
    """aiohttp's protocol for one connection, or a refusal if its address is over the cap."""

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap) -> None:
        self._inner = inner
        self._cap = cap
        self._connection: Connection | None = None  # None: refused, or lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        self._connection = self._cap.admit(address, transport)
        if self._connection is None:
            if self._cap.refused in (1, 10, 100) or self._cap.refused % 1000 == 0:
                logger.warning(
                    "refused a connection from %s: it holds %d already, each with a request "
                    "in progress (%d refused so far)",
                    address,
                    self._cap.per_address + self._cap.reserve,
                    self._cap.refused,
                )
            if isinstance(transport, asyncio.WriteTransport):
                transport.write(REFUSED)
            transport.close()
            return
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._connection is None:
            return
        self._cap.release(self._connection)
        self._connection = None
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._connection is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._connection is not None else None

    def pause_writing(self) -> None:
        if self._connection is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._connection is not None:
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
    cap = ConnectionCap(
        settings.max_connections_per_client, trusted_proxies=settings.trusted_proxies
    )
    app[CONNECTIONS] = cap  # limits.client_middleware reads it: who the client is, its share
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
        cap=cap,
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
