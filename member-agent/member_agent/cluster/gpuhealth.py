"""GPU health, whichever backend reads it: GPUs that failed, nodes cordoned for it, the counts.

A backend decides which GPUs of a node are unhealthy (the Kubernetes backend from the device
plugin's allocatable, health taints and labels and DRA device taints, `kubernetes.health`; the
simulated one from what a test injects) and takes them out of its inventory
(`model.Inventory.set_unhealthy`) at once. It tells the `HealthBook` each time a node's set
changes (`observe`); the book answers which GPUs have just failed, so that the backend fails
gpufed's pods on them (`GPU_FAILED`: the agent fails the whole gang, the broker retries it
within its `failurePolicy`, GPUFailed being one of the default `retryOn` reasons), and whether
the node is to be cordoned now: with `auto_cordon`, once `cordon_after` GPU failures were seen
on it within the last `cordon_window` seconds (a GPU turning unhealthy is one failure).

**Seeding.** A backend that reads a cluster which was there before the agent (Kubernetes)
builds its book with `seeding=True` and calls `seeded()` once its first lists are read. Until
then, what `observe` is told is how the cluster already was: every unhealthy GPU is returned
(gpufed's pods still running on one must fail GPUFailed, as they would have had the agent been
up), but none is counted as a failure, so a restarted agent does not cordon a node for GPUs
that failed before it started (and were counted, maybe cordoned for, by the agent before it).

The book keeps what `/metrics` shows: unhealthy GPUs per node, GPU failures, gangs failed,
cordons, and the Events a backend wrote about them (or failed to). The clock is injected
(`clock`, seconds, monotonic by default) so that the window is tested without waiting.

A node is cordoned once (the book remembers it); uncordoning is left to people, who see why in
the log line, the node's `gpufed.io/cordoned` annotation and Event (Kubernetes) and the metrics.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from broker.api import inventory

logger = logging.getLogger(__name__)

GPU_FAILED = "GPUFailed"  # the reason of a pod (and its gang) on a GPU that failed
CORDON_ANNOTATION = "gpufed.io/cordoned"  # on a Node gpufed cordoned: why
DEFAULT_CORDON_AFTER = 2
DEFAULT_CORDON_WINDOW = 3600.0  # seconds: failures older than this no longer count


@dataclass(frozen=True)
class HealthSettings:
    """`--auto-cordon`, `--cordon-after` and `--cordon-window`."""

    auto_cordon: bool = False
    cordon_after: int = DEFAULT_CORDON_AFTER  # GPU failures on one node before it is cordoned
    cordon_window: float = DEFAULT_CORDON_WINDOW  # seconds: only failures this recent count

    def __post_init__(self) -> None:
        if self.cordon_after < 1:
            raise ValueError(f"cordon_after: {self.cordon_after} is below 1")
        if not self.cordon_window > 0:
            raise ValueError(f"cordon_window: {self.cordon_window} is not above 0 seconds")


Cordon = Callable[[str, str], None]  # node, why: a backend's way of cordoning a node


class HealthBook:
    """What the agent knows of its GPUs' health; a backend feeds it, `/metrics` reads it."""

    def __init__(
        self,
        cluster: str,
        settings: HealthSettings | None = None,
        *,
        cordon: Cordon | None = None,
        seeding: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.settings = settings or HealthSettings()
        self.cordon = cordon
        self.seeding = seeding  # reading how the cluster already was: nothing is a failure
        self._clock = clock
        self.unhealthy: dict[str, frozenset[int]] = {}  # node -> unhealthy GPU indices now
        self.reasons: dict[str, str] = {}  # node -> why its GPUs are unhealthy, as last told
        self._failed_at: dict[str, deque[float]] = {}  # node -> when its GPUs failed, oldest first
        self.gpu_failures = 0  # GPUs seen turning unhealthy while the agent ran
        self.seeded_gpus = 0  # GPUs already unhealthy when the agent started
        self.failed_pods = 0  # gpufed's pods failed GPUFailed
        self.cordoned: dict[str, str] = {}  # node -> why gpufed cordoned it
        self.cordons = 0
        self.events_written = 0  # Events about GPU failures and cordons the cluster took
        self.events_failed = 0  # ... and those it did not (logged, nothing else waits on them)

    def observe(self, node: str, unhealthy: Iterable[int], *, reason: str = "") -> frozenset[int]:
        """The node's unhealthy GPUs now; returns those that have just failed (and cordons
        the node when it has failed often enough, with `auto_cordon`). While seeding: every
        unhealthy GPU, none counted."""
        now = frozenset(unhealthy)
        before = self.unhealthy.get(node, frozenset())
        if now:
            self.unhealthy[node] = now
            self.reasons[node] = reason
        else:
            self.unhealthy.pop(node, None)
            self.reasons.pop(node, None)
        failed = now - before
        if now != before:
            logger.warning(
                "cluster %s: node %s: unhealthy GPUs %s (were %s)%s%s",
                self.cluster,
                node,
                _indices(now),
                _indices(before),
                f": {reason}" if reason else "",
                " (already so when the agent started)" if self.seeding and failed else "",
            )
        if self.seeding:
            self.seeded_gpus += len(failed)
            return now  # a pod of gpufed's found on any of them fails, whenever it is listed
        if failed:
            at = self._clock()
            self._failed_at.setdefault(node, deque()).extend([at] * len(failed))
            self.gpu_failures += len(failed)
            self._maybe_cordon(node)
        return failed

    def seeded(self) -> None:
        """The backend has read how the cluster was when the agent started: from now on a GPU
        turning unhealthy is a failure."""
        if self.seeding:
            self.seeding = False
            logger.info(
                "cluster %s: %d GPUs unhealthy at start (not counted as failures)",
                self.cluster,
                self.seeded_gpus,
            )

    def recent_failures(self, node: str) -> int:
        """GPU failures on the node within the last `cordon_window` seconds."""
        times = self._failed_at.get(node)
        if not times:
            return 0
        since = self._clock() - self.settings.cordon_window
        while times and times[0] <= since:
            times.popleft()
        if not times:
            del self._failed_at[node]
        return len(times)

    def forget(self, node: str) -> None:
        """The node is gone from the cluster: its GPUs are no longer unhealthy ones of ours."""
        self.unhealthy.pop(node, None)
        self.reasons.pop(node, None)

    def pods_failed(self, count: int = 1) -> None:
        self.failed_pods += count

    def event_written(self, *, ok: bool) -> None:
        """A backend wrote an Event about a GPU failure or a cordon (`ok`), or failed to."""
        if ok:
            self.events_written += 1
        else:
            self.events_failed += 1

    def summary(self) -> inventory.GPUHealth:
        """What the summary sent to the broker says of it (protocol 6)."""
        return inventory.GPUHealth(
            unhealthy_gpus=sum(len(found) for found in self.unhealthy.values()),
            cordoned_nodes=sorted(self.cordoned),
        )

    def unhealthy_gpus(self) -> dict[str, int]:
        """Unhealthy GPUs by node (nodes with none left out)."""
        return {node: len(found) for node, found in sorted(self.unhealthy.items()) if found}

    def _maybe_cordon(self, node: str) -> None:
        if not self.settings.auto_cordon or node in self.cordoned:
            return
        count = self.recent_failures(node)
        if count < self.settings.cordon_after:
            return
        window = _duration(self.settings.cordon_window)
        why = f"{GPU_FAILED}: {count} GPU failures on this node within {window}"
        self.cordoned[node] = why
        self.cordons += 1
        logger.warning("cluster %s: cordoning node %s (%s)", self.cluster, node, why)
        if self.cordon is not None:
            self.cordon(node, why)


def _indices(found: frozenset[int]) -> str:
    return ",".join(str(i) for i in sorted(found)) or "none"


def _duration(seconds: float) -> str:
    """`1h`, `30m`, `90s`, `1h30m`: the window as people write it."""
    whole = round(seconds)
    if whole < 60 or whole % 60:
        return f"{seconds:g}s"
    hours, minutes = divmod(whole // 60, 60)
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "")
