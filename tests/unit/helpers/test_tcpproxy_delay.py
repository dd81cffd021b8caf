"""The test proxy's `delay`: every chunk held that long each way, in order (a slow store)."""

from __future__ import annotations

import asyncio
import time

from tests import tcpproxy

ECHOED: list[asyncio.Task[None]] = []


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    task = asyncio.current_task()
    assert task is not None
    ECHOED.append(task)  # awaited by the test: no stream left for the GC after its loop
    try:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()
        await writer.wait_closed()


async def test_a_delayed_proxy_holds_each_chunk_each_way_in_order() -> None:
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    proxy = await tcpproxy.TcpProxy(server.sockets[0].getsockname()[1]).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"a")
        assert await reader.readexactly(1) == b"a"  # no delay yet
        proxy.delay = 0.2
        started = time.monotonic()
        for chunk in (b"1", b"2", b"3"):
            writer.write(chunk)
            await writer.drain()
        assert await reader.readexactly(3) == b"123"
        assert 0.4 <= time.monotonic() - started < 1.0  # a round trip of twice the delay
        writer.close()
        await writer.wait_closed()
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()
        await asyncio.gather(*ECHOED, return_exceptions=True)
        ECHOED.clear()
