"""The simulated backend's pods: a pod running on timers (`SimPod`), what its annotations
say of its run (`parse_duration`, `parse_outcome`), and the journal of when each started
and stopped (`Journal`, `gpufed agent --sim-journal FILE`)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.api import status
from member_agent.cluster import base


def parse_duration(text: str) -> float:
    """Seconds from `12`, `1.5`, `30s`, `5m` or `2h`."""
    text = text.strip()
    factor = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(text[-1:], 0.0)
    number = text[:-1] if factor else text
    value = float(number) * (factor or 1.0)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"not a duration: {text!r}")
    return value


def on_attempt(text: str, attempt: int) -> str | None:
    """What `text` says before its `@<attempts>` (a comma-separated list), if it holds for
    `attempt` (every attempt when none are listed); None if not; ValueError for a list that
    is not one."""
    said, at, attempts = text.partition("@")
    if at:
        try:
            only = {int(part) for part in attempts.split(",")}
        except ValueError:
            raise ValueError(f"not a list of attempts: {attempts!r}") from None
        if attempt not in only:
            return None
    return said


def parse_outcome(text: str, *, attempt: int = 1) -> tuple[status.PodPhase, str]:
    """`Succeeded`, `Failed` or `Failed:<reason>` (reason defaults to Error), optionally for
    some attempts only: `Failed:NodeLost@1`, `Failed@1,2`; another attempt succeeds."""
    outcome = on_attempt(text, attempt)
    if outcome is None:
        return status.PodPhase.SUCCEEDED, ""
    phase, _, reason = outcome.partition(":")
    if phase.strip() == "Failed":
        return status.PodPhase.FAILED, reason.strip() or "Error"
    return status.PodPhase.SUCCEEDED, ""


class Journal:
    """When each pod started and stopped running, a JSON line each: `{"t": <unix seconds>,
    "event": "start" | "stop", "cluster", "job", "pod", "attempt", "node", "phase"}` (and
    `env`, the `GPUFED_*` variables its workload got, such as GPUFED_ARRAY_INDEX). Lines are
    written as they happen (line-buffered, appended), so a reader sees them at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", encoding="utf-8", buffering=1)

    def write(
        self,
        event: str,
        cluster: str,
        pod: SimPod,
        *,
        phase: str,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        line: dict[str, object] = {
            "t": time.time(),
            "event": event,
            "cluster": cluster,
            "job": pod.request.job_id,
            "pod": pod.request.name,
            "attempt": attempt_of(pod.request.annotations),
            "node": pod.request.node,
            "phase": phase,
            **(extra or {}),
        }
        env = gpufed_env(pod.request.template)
        if env:
            line["env"] = env  # what gpufed set in its workload's environment
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()


def gpufed_env(template: Mapping[str, Any]) -> dict[str, str]:
    """The `GPUFED_*` variables of the pod's first container (the array index)."""
    containers = (template.get("spec") or {}).get("containers") or [{}]
    env = containers[0].get("env") or [] if isinstance(containers[0], dict) else []
    return {
        str(e["name"]): str(e.get("value", ""))
        for e in env
        if isinstance(e, dict) and str(e.get("name", "")).startswith("GPUFED_")
    }


@dataclass
class SimPod:
    request: base.PodRequest
    phase: status.PodPhase
    duration: float | None
    outcome: tuple[status.PodPhase, str]
    created: float
    reason: str = ""
    started: float | None = None
    finished: float | None = None
    timer: asyncio.TimerHandle | None = None
    annotations: dict[str, str] = field(default_factory=dict)  # as the pod has them now
    exit_after: float = 0.0  # seconds its workload takes to exit after SIGTERM
    checkpoint_every: float | None = None
    checkpoint_timer: asyncio.TimerHandle | None = None
    terminating_until: float | None = None  # deleted with a grace: gone by then

    def stop_timers(self) -> None:
        for handle in (self.timer, self.checkpoint_timer):
            if handle is not None:
                handle.cancel()
        self.timer = self.checkpoint_timer = None

    def status(self) -> status.PodStatus:
        return status.PodStatus(
            name=self.request.name,
            task=self.request.task,
            node=self.request.node,
            gpus=list(self.request.gpus),
            phase=self.phase,
            reason=self.reason,
        )


def done(pod: SimPod) -> bool:
    return pod.phase in (status.PodPhase.SUCCEEDED, status.PodPhase.FAILED)


def attempt_of(annotations: Mapping[str, str]) -> int:
    raw = annotations.get(base.ATTEMPT_ANNOTATION, "")
    return int(raw) if raw.isdigit() else 1


def template_annotations(template: dict[str, Any]) -> dict[str, str]:
    metadata = template.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    return {str(k): str(v) for k, v in annotations.items()}
