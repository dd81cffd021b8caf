"""A TCP proxy on loopback that a test controls, to partition an agent from its broker.

`TcpProxy(port)` forwards every connection to `127.0.0.1:port` until `cut()`:

- `cut(mode="blackhole")`, what a network partition looks like: connections stay open and new
  ones are accepted, but nothing gets through either way (what is sent is read and dropped, so
  no sender ever blocks) and no end hears of the other closing.
- `cut(mode="reset")`: every connection is reset and new ones are refused at once.

`TcpProxy(http_proxy=True)` is an HTTP forward proxy instead (what `HTTP_PROXY` names): each
connection goes where its first request line says (`GET http://host:port/path HTTP/1.1`,
rewritten to the origin form), then bytes flow both ways as above (a WebSocket upgrade too).
An agent whose every connection goes through it can be cut off whichever broker URL it dials.

`delay` (seconds, each way; 0 by default, changed at any time) holds every chunk that long
before passing it on, in order: a slow link, e.g. a store a round trip of `2 * delay` away.

`heal()` forwards new connections again. The connections that lived through a cut have lost
bytes, so they are reset then (as TCP would, once the peers notice). The proxy runs in the
test's event loop; `close()` stops it and resets everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["blackhole", "reset"]
CHUNK = 64 * 1024


@dataclass(eq=False)
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    cut: bool = False  # lived through a cut: drops what it reads, reset on heal
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def reset(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class TcpProxy:
    def __init__(
        self, upstream_port: int = 0, *, host: str = "127.0.0.1", http_proxy: bool = False
    ) -> None:
        self.host = host
        self.upstream_port = upstream_port
        self.http_proxy = http_proxy
        self.mode: Mode | None = None
        self.delay = 0.0  # seconds each chunk is held, each way
        self.port = 0
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def cut(self, *, mode: Mode = "blackhole") -> None:
        self.mode = mode
        for connection in list(self._connections):
            connection.cut = True
            if mode == "reset":
                self._drop(connection)

    def heal(self) -> None:
        self.mode = None
        for connection in list(self._connections):
            if connection.cut:
                self._drop(connection)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            self._drop(connection)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def _drop(self, connection: _Connection) -> None:
        connection.reset()
        self._connections.discard(connection)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.mode == "reset":
            writer.transport.abort()
            return
        connection = _Connection(client=writer, cut=self.mode == "blackhole")
        self._connections.add(connection)
        if connection.cut:  # accepted, never forwarded: read and drop until healed
            connection.tasks.append(asyncio.current_task())  # type: ignore[arg-type]
            await self._pump(reader, None, connection)
            return
        first = b""
        target = (self.host, self.upstream_port)
        if self.http_proxy:
            try:
                first, target = await _request_line(reader)
            except (ValueError, OSError, asyncio.IncompleteReadError):
                self._drop(connection)
                return
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            self._drop(connection)
            return
        connection.upstream = up_writer
        up_writer.write(first)
        if self.mode is not None:  # cut while connecting
            connection.cut = True
        there = asyncio.create_task(self._pump(reader, up_writer, connection))
        back = asyncio.create_task(self._pump(up_reader, writer, connection))
        connection.tasks += [there, back]
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(there, back)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter | None,
        connection: _Connection,
    ) -> None:
        """Copy one direction, each chunk `delay` later (a task of its own sends); while
        cut, drop what comes. An end that closes is passed on, after what came before it, only
        while the connection is not cut (a partition hides it)."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        sender = None
        if writer is not None:
            sender = asyncio.create_task(_send(queue, writer, connection))
            connection.tasks.append(sender)
        try:
            while data := await reader.read(CHUNK):
                if connection.cut or writer is None:
                    continue
                queue.put_nowait((time.monotonic() + self.delay, data))
        except (ConnectionError, OSError):
            pass
        if sender is not None:
            queue.put_nowait(None)
            with contextlib.suppress(asyncio.CancelledError):
                await sender
        if not connection.cut:
            self._drop(connection)


async def _send(
    queue: asyncio.Queue[tuple[float, bytes] | None],
    writer: asyncio.StreamWriter,
    connection: _Connection,
) -> None:
    """Write what `_pump` read, each chunk once it is due, in order, until its end."""
    try:
        while (item := await queue.get()) is not None:
            due, data = item
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            if connection.cut:
                continue
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass


async def _request_line(reader: asyncio.StreamReader) -> tuple[bytes, tuple[str, int]]:
    """A proxied request's first line in origin form, and where it goes."""
    line = await reader.readuntil(b"\r\n")
    method, target, version = line.decode("latin-1").rstrip("\r\n").split(" ")
    if not target.startswith("http://"):
        raise ValueError(f"not a proxied http request: {target!r}")
    authority, _, path = target[len("http://") :].partition("/")
    host, _, port = authority.rpartition(":")
    origin = f"{method} /{path} {version}\r\n".encode("latin-1")
    return origin, (host.strip("[]"), int(port or 80))
