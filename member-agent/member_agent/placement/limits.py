"""The agent's local GPU limits per namespace: does an offer's gang fit them? Pure.

`jobs.handling.JobHandler` calls `check_gpus` on every offer before placement; no I/O, no
clock (the limits file is read once at start by `app.load_limits`; the quotas come from the
backend). Two sources, and the stricter wins: the agent's limits (`AgentLimits`, the schema of
`config/agent-limits.example.yaml`, counted against the jobs the agent holds) and the cluster's
own Kubernetes ResourceQuotas on `requests.nvidia.com/gpu` / `limits.nvidia.com/gpu`
(`inventory.model.GPUQuota`, counted against every live pod of the namespace; a shared-GPU pod
counts one GPU). The broker's quotas stay the source of truth; these protect the cluster from a
broker that is wrong, and turn what the API server would refuse pod by pod into one clear
rejection before anything is created.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from member_agent.inventory import model


class AgentLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace_gpus: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    default_namespace_gpus: Annotated[int | None, Field(ge=0)] = None

    def gpu_limit(self, namespace: str) -> int | None:
        return self.namespace_gpus.get(namespace, self.default_namespace_gpus)

    def check(self, namespace: str, *, in_use: int, asked: int) -> str | None:
        """None when `asked` more GPUs fit the namespace's limit, else the reason."""
        limit = self.gpu_limit(namespace)
        if limit is None or in_use + asked <= limit:
            return None
        return (
            f"namespace {namespace}: GPU limit {limit} on this cluster, {in_use} in use, "
            f"the job asks for {asked}"
        )


@dataclass(frozen=True)
class Over:
    """An offer that goes over a limit: which source, the room it leaves, and why."""

    source: Literal["limit", "quota"]
    room: int
    reason: str


def check_gpus(
    agent_limits: AgentLimits,
    namespace: str,
    *,
    in_use: int,
    asked: int,
    quotas: Sequence[model.GPUQuota] = (),
) -> Over | None:
    """None when `asked` more GPUs fit both the limits file (`in_use`: GPUs of the jobs the
    agent holds in the namespace) and every quota; else the strictest limit that is exceeded
    (the one leaving the least room)."""
    over: list[Over] = []
    limit = agent_limits.gpu_limit(namespace)
    reason = agent_limits.check(namespace, in_use=in_use, asked=asked)
    if limit is not None and reason is not None:
        over.append(Over("limit", max(limit - in_use, 0), reason))
    for quota in quotas:
        if asked > quota.room:
            reason = (
                f"namespace {namespace}: ResourceQuota {quota.name} allows {quota.hard} "
                f"{quota.resource}, {quota.used} used, {quota.room} left, the job asks for {asked}"
            )
            over.append(Over("quota", quota.room, reason))
    return min(over, key=lambda o: (o.room, o.source != "quota")) if over else None
