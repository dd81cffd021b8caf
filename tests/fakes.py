"""Fakes that satisfy the same Protocol as the real thing, for tests of the broker's shell."""

from __future__ import annotations

from broker.api import messages


class RecordingLink:
    """An agent session (`fleet.AgentLink`) that keeps the offers the broker sends."""

    def __init__(self) -> None:
        self.offers: list[messages.Offer] = []

    async def send(self, message: messages._Msg) -> None:
        if isinstance(message, messages.Offer):
            self.offers.append(message)

    async def close(self, *, reason: str) -> None:
        del reason


class SentLink:
    """An agent session (`fleet.AgentLink`) that keeps every message the broker sends, in
    order (`sent`)."""

    def __init__(self) -> None:
        self.sent: list[messages._Msg] = []

    async def send(self, message: messages._Msg) -> None:
        self.sent.append(message)

    async def close(self, *, reason: str) -> None:
        del reason
