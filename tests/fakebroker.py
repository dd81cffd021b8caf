"""A broker's side of the agent session protocol, scripted by a test, and the agent process
(`run_agent`) on a simulated cluster that outlives it: what the agent's session tests drive."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from aiohttp import WSMsgType, web

from broker.api import messages
from member_agent import app
from member_agent.cluster.simulated import backend as simulated

M = TypeVar("M")
TOKEN = "s3cret"


class FakeBroker:
    """The broker's side of the protocol, scripted by the test."""

    def __init__(self, *, heartbeat: float = 0.2) -> None:
        self.token = TOKEN
        self.heartbeat = heartbeat
        self.epoch = 40
        self.attempts = 0
        self.hellos: list[messages.Hello] = []
        self.received: asyncio.Queue[messages.Message] = asyncio.Queue()
        self.log: list[messages.Message] = []  # every message, hellos too, in order
        self.ws: web.WebSocketResponse | None = None
        self.silent = False
        self.version = messages.PROTOCOL_VERSION  # the welcome's: 1 is a broker without acks
        self.lost_after: float | None = None  # the grace the welcome says (protocol 3)
        self.down = False  # refuses every session (503), as a replica going away
        self.app = web.Application()
        self.app.router.add_get("/v1/agents/connect", self.connect)

    async def connect(self, request: web.Request) -> web.StreamResponse:
        self.attempts += 1
        if self.down:
            return web.Response(status=503, text="going away")
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.Response(status=401, text="bad token")
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        hello = messages.decode(await ws.receive_str())
        assert isinstance(hello, messages.Hello)
        self.hellos.append(hello)
        self.log.append(hello)
        self.epoch += 1
        await ws.send_str(
            messages.encode(
                messages.Welcome(
                    epoch=self.epoch,
                    heartbeat_seconds=self.heartbeat,
                    v=self.version,
                    lost_after_seconds=self.lost_after,
                )
            )
        )
        self.ws = ws
        beat = asyncio.create_task(self._beat(ws))
        try:
            async for frame in ws:
                if frame.type == WSMsgType.TEXT:
                    message = messages.decode(frame.data)
                    if not isinstance(message, messages.Heartbeat):
                        self.received.put_nowait(message)
                        self.log.append(message)
        finally:
            beat.cancel()
        return ws

    async def _beat(self, ws: web.WebSocketResponse) -> None:
        while not ws.closed:
            await asyncio.sleep(self.heartbeat)
            if not self.silent:
                await ws.send_str(messages.encode(messages.Heartbeat()))

    async def send(self, message: messages.Offer | messages.Cancel | messages.Ack) -> None:
        assert self.ws is not None
        await self.ws.send_str(messages.encode(message))

    async def expect(
        self, kind: type[M], where: Callable[[M], bool] = lambda m: True, *, timeout: float = 5
    ) -> M:
        """The next message of `kind` that matches, skipping others."""
        async with asyncio.timeout(timeout):
            while True:
                message = await self.received.get()
                if isinstance(message, kind) and where(message):
                    return message

    async def wait_for_hellos(self, count: int, *, timeout: float = 5) -> messages.Hello:
        async with asyncio.timeout(timeout):
            while len(self.hellos) < count:
                await asyncio.sleep(0.01)
        return self.hellos[count - 1]


class Agent:
    """The agent process (run_agent) on a simulated cluster that outlives it."""

    def __init__(
        self, settings: app.AgentSettings, backend: simulated.SimulatedBackend, token_file: Path
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.token_file = token_file
        self.stop_event = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.stop_event = asyncio.Event()
        self.task = asyncio.create_task(
            app.run_agent(self.settings, stop=self.stop_event, backend=self.backend)
        )

    async def stop(self) -> None:
        self.stop_event.set()
        if self.task is not None:
            async with asyncio.timeout(5):
                await self.task
