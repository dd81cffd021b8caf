"""The inventory summaries the agent sends: a full one per session, then coalesced deltas.

`SummaryReporter.attach` gives the full summary that opens a session; afterwards every
`mark_dirty()` (a pod created, finished or deleted, a node changed) schedules one summary at
most every `interval` seconds. It sends only the GPU models that changed (`full=False`) when
that is smaller, the whole summary otherwise, and nothing when nothing changed. `seq` grows
with every summary the agent process sends.

The summary itself comes from `member_agent.inventory.summary.summarise` when that module
exists, else from `summarise_fallback` here.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.api import inventory, messages
from member_agent.inventory import model

logger = logging.getLogger(__name__)

Summarise = Callable[[model.Inventory], inventory.ClusterSummary]
SUMMARY_MODULE = "member_agent.inventory.summary"


def find_summarise() -> tuple[Summarise, str]:
    """The shared `summarise` if its module exists, else the fallback; and which one."""
    try:
        module = importlib.import_module(SUMMARY_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != SUMMARY_MODULE:
            raise
        return summarise_fallback, "fallback"
    function = getattr(module, "summarise", None)
    if not callable(function):
        return summarise_fallback, "fallback"
    shared: Summarise = function
    return shared, SUMMARY_MODULE


@dataclass
class _Model:
    name: str
    gpu_memory_mib: int = 0
    gpus_per_node: int = 0
    nodes: int = 0
    total: int = 0
    free: int = 0
    unavailable: int = 0
    by_free: dict[int, int] = field(default_factory=dict)
    racks: dict[str, dict[int, int]] = field(default_factory=dict)
    shared_free_milli: int = 0
    nvlink_block: int = 0
    domains: dict[str, int] = field(default_factory=dict)
    cpu: int = 0
    memory: int = 0

    def add(self, node: model.Node) -> None:
        self.nodes += 1
        self.total += node.gpu_count
        self.gpu_memory_mib = max(self.gpu_memory_mib, node.gpu_memory_mib)
        self.gpus_per_node = max(self.gpus_per_node, node.gpu_count)
        if not node.available:
            self.unavailable += node.gpu_count
            return
        whole = node.whole_free
        self.free += whole
        self.by_free[whole] = self.by_free.get(whole, 0) + 1
        if node.rack:
            rack = self.racks.setdefault(node.rack, {})
            rack[whole] = rack.get(whole, 0) + 1
        self.shared_free_milli += sum(m for m in node.gpu_free if 0 < m < model.GPU_MILLI)
        self.nvlink_block = max(self.nvlink_block, _largest_island(node))
        if node.nvlink_domain:
            self.domains[node.nvlink_domain] = self.domains.get(node.nvlink_domain, 0) + whole
        self.cpu = max(self.cpu, node.cpu_free)
        self.memory = max(self.memory, node.memory_free)

    def summary(self) -> inventory.ModelSummary:
        width = self.gpus_per_node + 1
        return inventory.ModelSummary(
            model=self.name,
            gpu_memory_mib=self.gpu_memory_mib,
            gpus_per_node=self.gpus_per_node,
            nodes=self.nodes,
            total_gpus=self.total,
            free_gpus=self.free,
            unavailable_gpus=self.unavailable,
            nodes_by_free=_histogram(self.by_free, width),
            shared_free_milli=self.shared_free_milli,
            largest_free_nvlink_block=max([self.nvlink_block, *self.domains.values()]),
            racks={rack: _histogram(h, width) for rack, h in sorted(self.racks.items())},
            max_free_cpu_milli=self.cpu,
            max_free_memory_mib=self.memory,
        )


def _histogram(counts: dict[int, int], width: int) -> list[int]:
    out = [0] * max(width, max(counts, default=0) + 1)
    for free, nodes in counts.items():
        out[free] = nodes
    return out


def _largest_island(node: model.Node) -> int:
    """Whole free GPUs in the node's best NVLink island (1 GPU without NVLink)."""
    whole = [m == model.GPU_MILLI for m in node.gpu_free]
    if node.nvlink_island <= 1:
        return 1 if any(whole) else 0
    best = 0
    for start in range(0, len(whole), node.nvlink_island):
        best = max(best, sum(whole[start : start + node.nvlink_island]))
    return best


def summarise_fallback(inv: model.Inventory) -> inventory.ClusterSummary:
    """A ClusterSummary per GPU model, from the nodes of `inv`."""
    models: dict[str, _Model] = {}
    for node in inv:
        if node.gpu_count == 0:
            continue
        acc = models.get(node.model)
        if acc is None:
            acc = models[node.model] = _Model(name=node.model)
        acc.add(node)
    return inventory.ClusterSummary(
        cluster=inv.cluster, models=[models[name].summary() for name in sorted(models)]
    )


class SummaryReporter:
    def __init__(
        self,
        source: Callable[[], model.Inventory],
        *,
        cluster: str,
        interval: float = 0.05,
        summarise: Summarise | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.cluster = cluster
        self.interval = interval
        self.summarise: Summarise
        if summarise is None:
            self.summarise, which = find_summarise()
            logger.info("summaries from %s", which)
        else:
            self.summarise = summarise
        self.clock = clock
        self.seq = 0
        self.sent = 0
        self._baseline: dict[str, inventory.ModelSummary] | None = None
        self._send: Callable[[messages.Summary], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last = -math.inf

    def attach(self, send: Callable[[messages.Summary], None]) -> messages.Summary:
        """Start reporting on a new session: the full summary to send first."""
        self.detach()
        summary = self._compute()
        self._baseline = {m.model: m for m in summary.models}
        self._send = send
        self._last = self.clock()
        return messages.Summary(full=True, summary=summary)

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
        summary = self._compute(bump=False)
        current = {m.model: m for m in summary.models}
        baseline = self._baseline or {}
        changed = [m for m in summary.models if baseline.get(m.model) != m]
        removed = set(baseline) - set(current)
        if not changed and not removed:
            return None
        self.seq += 1
        self._baseline = current
        self.sent += 1
        if removed or len(changed) >= len(summary.models):
            return messages.Summary(full=True, summary=summary.model_copy(update={"seq": self.seq}))
        delta = summary.model_copy(update={"seq": self.seq, "models": changed})
        return messages.Summary(full=False, summary=delta)

    def _compute(self, *, bump: bool = True) -> inventory.ClusterSummary:
        summary = self.summarise(self.source())
        update: dict[str, object] = {"cluster": self.cluster}
        if bump:
            self.seq += 1
            self.sent += 1
            update["seq"] = self.seq
        return summary.model_copy(update=update)
