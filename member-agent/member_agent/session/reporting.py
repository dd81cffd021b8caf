"""The inventory summaries the agent sends: a full one per session, then coalesced deltas.

`SummaryReporter.attach` gives the full summary that opens a session; afterwards every
`mark_dirty()` (a pod created, finished or deleted, a node changed) schedules one summary at
most every `interval` seconds. It sends only the GPU models that changed (`full=False`) when
that is smaller, the whole summary otherwise, and nothing when nothing changed. `seq` grows
with every summary the agent process sends.

The summary itself is `member_agent.inventory.summary.summarise`, the one the simulator uses,
kept between reports (`inventory.tallies.KeptSummary`: only the nodes changed since are
counted again; a whole count now and then checks it, and a difference is logged).
Every summary carries the cluster's `labels` (`--cluster-label`) once the session's welcome
said the broker reads them (`send_labels`, protocol 5); an older broker is sent none. So
does its GPU health (`health`: unhealthy GPUs, nodes cordoned for GPU failures; `send_health`,
protocol 6), which alone changing sends a summary too. The models' MIG devices
(`ModelSummary.mig`) go only to a broker of protocol 7 (`send_mig`); to an older one they are
left out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping

from broker.api import inventory, messages
from member_agent.inventory import model, tallies

logger = logging.getLogger(__name__)

Summarise = Callable[[model.Inventory], inventory.ClusterSummary]


class SummaryReporter:
    def __init__(
        self,
        source: Callable[[], model.Inventory],
        *,
        cluster: str,
        interval: float = 0.05,
        summarise: Summarise | None = None,
        clock: Callable[[], float] = time.monotonic,
        labels: Mapping[str, str] | None = None,
        health: Callable[[], inventory.GPUHealth] | None = None,
    ) -> None:
        self.source = source
        self.health = health
        self.send_health = False  # set per session from the broker's welcome
        self.cluster = cluster
        self.labels = dict(labels or {})
        self.send_labels = False  # set per session from the broker's welcome
        self.send_mig = False  # set per session from the broker's welcome
        self.interval = interval
        self.kept = tallies.KeptSummary()
        self.summarise: Summarise = summarise or self.kept
        self.clock = clock
        self.seq = 0
        self.sent = 0
        self._baseline: dict[str, inventory.ModelSummary] | None = None
        self._health_sent: inventory.GPUHealth | None = None
        self._send: Callable[[messages.Summary], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last = -math.inf

    def attach(self, send: Callable[[messages.Summary], None]) -> messages.Summary:
        """Start reporting on a new session: the full summary to send first."""
        self.detach()
        first = self._compute()
        self._baseline = {m.model: m for m in first.models}
        self._health_sent = first.gpu_health
        self._send = send
        self._last = self.clock()
        return messages.Summary(full=True, summary=first)

    def detach(self) -> None:
        self._send = None
        self._baseline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def mark_dirty(self) -> None:
        """The inventory may have changed: report it within `interval` seconds."""
        if self._send is None or self._timer is not None:
            return
        delay = max(0.0, self._last + self.interval - self.clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self.flush)

    def flush(self) -> None:
        self._timer = None
        if self._send is None:
            return
        message = self.next_message()
        self._last = self.clock()
        if message is not None:
            self._send(message)

    def next_message(self) -> messages.Summary | None:
        """What changed since the last summary sent: a delta, a full summary, or None."""
        latest = self._compute(bump=False)
        current = {m.model: m for m in latest.models}
        baseline = self._baseline or {}
        changed = [m for m in latest.models if baseline.get(m.model) != m]
        removed = set(baseline) - set(current)
        if not changed and not removed and latest.gpu_health == self._health_sent:
            return None
        self._health_sent = latest.gpu_health
        self.seq += 1
        self._baseline = current
        self.sent += 1
        if removed or len(changed) >= len(latest.models):
            return messages.Summary(full=True, summary=latest.model_copy(update={"seq": self.seq}))
        delta = latest.model_copy(update={"seq": self.seq, "models": changed})
        return messages.Summary(full=False, summary=delta)

    def _compute(self, *, bump: bool = True) -> inventory.ClusterSummary:
        drifts = self.kept.drifts
        computed = self.summarise(self.source())
        if self.kept.drifts != drifts:
            logger.warning(
                "cluster %s: the kept summary differed from a whole count of the inventory "
                "(a node changed without Inventory.touch); the whole count is sent",
                self.cluster,
            )
        if not self.send_mig and any(m.mig is not None for m in computed.models):
            computed = computed.model_copy(
                update={"models": [m.model_copy(update={"mig": None}) for m in computed.models]}
            )
        update: dict[str, object] = {
            "cluster": self.cluster,
            "labels": dict(self.labels) if self.send_labels else {},
            "gpu_health": self.health() if self.health and self.send_health else None,
        }
        if bump:
            self.seq += 1
            self.sent += 1
            update["seq"] = self.seq
        return computed.model_copy(update=update)
