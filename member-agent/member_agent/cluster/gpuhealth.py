"""GPU health, whichever backend reads it: GPUs that failed, nodes cordoned for it, the counts.

A backend decides which GPUs of a node are unhealthy (the Kubernetes backend from the device
plugin's allocatable, health taints and labels and DRA device taints, `kubernetes_health`; the
simulated one from what a test injects) and takes them out of its inventory
(`model.Inventory.set_unhealthy`) at once. It tells the `HealthBook` each time a node's set
changes (`observe`); the book answers which GPUs have just failed, so that the backend fails
gpufed's pods on them (`GPU_FAILED`: the agent fails the whole gang, the broker retries it
within its `failurePolicy`, GPUFailed being one of the default `retryOn` reasons), and whether
the node is to be cordoned now: with `auto_cordon`, once `cordon_after` GPU failures were seen
on it (a GPU turning unhealthy is one failure; counted since the agent started). The book keeps
what `/metrics` shows: unhealthy GPUs per node, GPU failures, gangs failed, cordons.

A node is cordoned once (the book remembers it); uncordoning is left to people, who see why in
the log line, the node's `gpufed.io/cordoned` annotation (Kubernetes) and the metrics.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from broker.api import inventory

logger = logging.getLogger(__name__)

GPU_FAILED = "GPUFailed"  # the reason of a pod (and its gang) on a GPU that failed
CORDON_ANNOTATION = "gpufed.io/cordoned"  # on a Node gpufed cordoned: why
DEFAULT_CORDON_AFTER = 2


@dataclass(frozen=True)
class HealthSettings:
    """`--auto-cordon` and `--cordon-after`."""

    auto_cordon: bool = False
    cordon_after: int = DEFAULT_CORDON_AFTER  # GPU failures on one node before it is cordoned

    def __post_init__(self) -> None:
        if self.cordon_after < 1:
            raise ValueError(f"cordon_after: {self.cordon_after} is below 1")


Cordon = Callable[[str, str], None]  # node, why: a backend's way of cordoning a node


class HealthBook:
    """What the agent knows of its GPUs' health; a backend feeds it, `/metrics` reads it."""

    def __init__(
        self, cluster: str, settings: HealthSettings | None = None, *, cordon: Cordon | None = None
    ) -> None:
        self.cluster = cluster
        self.settings = settings or HealthSettings()
        self.cordon = cordon
        self.unhealthy: dict[str, frozenset[int]] = {}  # node -> unhealthy GPU indices now
        self.failures: Counter[str] = Counter()  # node -> GPUs seen turning unhealthy
        self.gpu_failures = 0
        self.failed_pods = 0  # gpufed's pods failed GPUFailed
        self.cordoned: dict[str, str] = {}  # node -> why gpufed cordoned it
        self.cordons = 0

    def observe(self, node: str, unhealthy: Iterable[int], *, reason: str = "") -> frozenset[int]:
        """The node's unhealthy GPUs now; returns those that have just failed (and cordons
        the node when it has failed often enough, with `auto_cordon`)."""
        now = frozenset(unhealthy)
        before = self.unhealthy.get(node, frozenset())
        if now:
            self.unhealthy[node] = now
        else:
            self.unhealthy.pop(node, None)
        failed = now - before
        if now != before:
            logger.warning(
                "cluster %s: node %s: unhealthy GPUs %s (were %s)%s",
                self.cluster,
                node,
                _indices(now),
                _indices(before),
                f": {reason}" if reason else "",
            )
        if failed:
            self.failures[node] += len(failed)
            self.gpu_failures += len(failed)
            self._maybe_cordon(node)
        return failed

    def forget(self, node: str) -> None:
        """The node is gone from the cluster: its GPUs are no longer unhealthy ones of ours."""
        self.unhealthy.pop(node, None)

    def pods_failed(self, count: int = 1) -> None:
        self.failed_pods += count

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
        count = self.failures[node]
        if not self.settings.auto_cordon or node in self.cordoned:
            return
        if count < self.settings.cordon_after:
            return
        why = f"{GPU_FAILED}: {count} GPU failures on this node"
        self.cordoned[node] = why
        self.cordons += 1
        logger.warning("cluster %s: cordoning node %s (%s)", self.cluster, node, why)
        if self.cordon is not None:
            self.cordon(node, why)


def _indices(found: frozenset[int]) -> str:
    return ",".join(str(i) for i in sorted(found)) or "none"
