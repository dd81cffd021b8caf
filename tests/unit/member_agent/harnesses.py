"""A job handler on a small simulated cluster, driven straight (no socket), every message it
sends recorded: what the handler tests use."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker.api import messages
from member_agent.cluster.simulated import backend as simulated
from member_agent.jobs import handling
from member_agent.placement import limits
from tests import agentbuilders

Sent = list[messages.Message]


class Harness:
    """A handler on a small simulated cluster, with every message it sends recorded."""

    def __init__(self, tmp_path: Path, *, agent_limits: limits.AgentLimits | None = None) -> None:
        self.backend: simulated.SimulatedBackend = agentbuilders.small_backend(tmp_path)
        self.sent: Sent = []
        self.replies: Sent = []
        self.now = 1000.0
        self.changes = 0
        self.handler = handling.JobHandler(
            self.backend,
            send=self._send,
            agent_limits=agent_limits,
            on_change=self._changed,
            clock=lambda: self.now,
            failure_grace_seconds=0,
        )
        self._events = self.backend.events()
        self.connected = True

    def _send(
        self, message: messages.Message, /, *, on_sent: Callable[[], None] | None = None
    ) -> None:
        if self.connected:
            self.sent.append(message)
            if on_sent is not None:
                on_sent()

    def _changed(self) -> None:
        self.changes += 1

    async def offer(
        self,
        job_id: str,
        *,
        epoch: int = 1,
        session_epoch: int = 1,
        attempt: int = 1,
        **job: Any,
    ) -> messages.Message:
        offer = agentbuilders.make_offer(
            job_id, agentbuilders.make_job(**job), epoch=epoch, attempt=attempt
        )
        await self.handler.handle_offer(
            offer, session_epoch=session_epoch, reply=self.replies.append
        )
        return self.replies[-1]

    async def pump(self, until: Callable[[], bool]) -> None:
        """Feed backend events to the handler until `until()` holds."""
        async with asyncio.timeout(5):
            while not until():
                self.handler.handle_event(await anext(self._events))

    def updates(self, job_id: str) -> list[tuple[str, str]]:
        return [
            (m.state.value, m.reason)
            for m in self.sent
            if isinstance(m, messages.JobUpdate) and m.job_id == job_id
        ]

    async def close(self) -> None:
        await self.handler.close()
        await self.backend.close()
