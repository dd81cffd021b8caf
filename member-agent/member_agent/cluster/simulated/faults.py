"""GPU failures on the simulated backend, composed into `backend.SimulatedBackend` as its
`gpus`: what a test or a job injects, applied as the Kubernetes backend applies what its
cluster says (`gpuhealth`).

- `fail_gpu(node, index)`: the GPU turns unhealthy. It leaves the inventory at once (never free,
  counted unavailable in the summary), gpufed's pods running on it fail `GPUFailed` (the agent
  fails the whole gang; the broker retries it within its failure policy), the health book
  counts the failure and, with `auto_cordon`, cordons the node after `cordon_after` of them
  within `cordon_window` seconds (the node is then unschedulable: no new pod goes there).
  `heal_gpu` brings it back. The simulated cluster starts with the agent, so there is nothing
  to seed (`gpuhealth`): every GPU failing is a failure.
- A job's pod template annotation `gpufed.io/sim-gpu-failure: <after>[@<attempts>]` (a
  duration, then optionally a comma-separated list of attempts as `sim-outcome` takes): that
  long after the pod starts running, the first GPU it holds fails, on those attempts only
  (every attempt when none are listed). What the e2e suite injects into real agent processes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from broker.api import status
from member_agent.cluster import base, gpuhealth
from member_agent.cluster.simulated import pods as simulated_pods
from member_agent.inventory import model

logger = logging.getLogger(__name__)

SIM_GPU_FAILURE_ANNOTATION = "gpufed.io/sim-gpu-failure"


def parse_gpu_failure(
    text: str, *, attempt: int, parse_duration: Callable[[str], float]
) -> float | None:
    """Seconds after the pod starts until its GPU fails (None: not on this attempt); raises
    ValueError for a text that is not `<duration>[@<attempts>]`."""
    after = simulated_pods.on_attempt(text, attempt)
    return parse_duration(after) if after is not None else None


class GPUFaults:
    """The simulated cluster's GPU health: injected failures, the book that counts them."""

    def __init__(
        self,
        inventory: model.Inventory,
        settings: gpuhealth.HealthSettings | None,
        *,
        pods: Callable[[], Sequence[Any]],  # the backend's SimPods
        finish: Callable[[Any, status.PodPhase, str], None],
        emit: Callable[[base.BackendEvent], None],
        duration: Callable[[str], float],
    ) -> None:
        self._inventory = inventory
        self._pods = pods
        self._finish = finish
        self._emit = emit
        self._duration = duration
        self.book = gpuhealth.HealthBook(inventory.cluster, settings, cordon=self._cordon)

    def fail_gpu(self, node: str, index: int, *, reason: str = "injected") -> int:
        """GPU `index` of `node` fails; returns how many of gpufed's pods failed with it."""
        found = self._inventory.nodes[node]
        if not 0 <= index < found.gpu_count:
            raise ValueError(f"node {node} has no GPU {index}")
        failed = self._set(node, found.unhealthy | {index}, reason=reason)
        on_it = [
            pod
            for pod in self._pods()
            if pod.request.node == node
            and pod.phase in (status.PodPhase.PENDING, status.PodPhase.RUNNING)
            and any(slot.index in failed for slot in pod.request.gpus)
        ]
        for pod in on_it:
            self._finish(pod, status.PodPhase.FAILED, gpuhealth.GPU_FAILED)
        self.book.pods_failed(len(on_it))
        self._emit(base.InventoryChanged(reason=f"GPU {index} of node {node} failed"))
        return len(on_it)

    def heal_gpu(self, node: str, index: int) -> None:
        """GPU `index` of `node` is healthy again (the node stays cordoned if it was)."""
        self._set(node, self._inventory.nodes[node].unhealthy - {index}, reason="healed")
        self._emit(base.InventoryChanged(reason=f"GPU {index} of node {node} healthy"))

    def arm(self, pod: Any) -> None:
        """A pod started running: with the annotation, fail its first GPU when it says (if the
        pod still runs then). An annotation that does not parse is logged and ignored."""
        text = pod.annotations.get(SIM_GPU_FAILURE_ANNOTATION)
        if text is None or not pod.request.gpus:
            return
        raw = pod.annotations.get(base.ATTEMPT_ANNOTATION, "")
        attempt = int(raw) if raw.isdigit() else 1
        try:
            after = parse_gpu_failure(text, attempt=attempt, parse_duration=self._duration)
        except ValueError as exc:
            logger.warning("pod %s: %s: %s", pod.request.name, SIM_GPU_FAILURE_ANNOTATION, exc)
            return
        if after is not None:
            asyncio.get_running_loop().call_later(after, self._fire, pod)

    def _fire(self, pod: Any) -> None:
        if pod.phase != status.PodPhase.RUNNING:
            return
        index = pod.request.gpus[0].index
        logger.info("simulated GPU %d of node %s fails", index, pod.request.node)
        self.fail_gpu(pod.request.node, index, reason=f"{SIM_GPU_FAILURE_ANNOTATION} of a pod")

    def _set(self, node: str, unhealthy: frozenset[int], *, reason: str) -> frozenset[int]:
        self._inventory.set_unhealthy(node, unhealthy)
        return self.book.observe(node, unhealthy, reason=reason)

    def _cordon(self, node: str, why: str) -> None:
        self._inventory.nodes[node].schedulable = False
        self._inventory.touch(node)
        logger.warning("simulated node %s cordoned: %s", node, why)
