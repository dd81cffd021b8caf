"""The agent's local limits: GPUs per namespace, checked on every offer before placement.

They mirror a Kubernetes ResourceQuota on `requests.nvidia.com/gpu` (a shared-GPU pod counts
one GPU). The broker's quotas stay the source of truth; these protect the cluster from a broker
that is wrong. Read from a YAML file (`config/agent-limits.example.yaml`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field


class LimitsFileError(ValueError):
    """The limits file cannot be read or does not validate."""


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


def load_limits(path: Path | str | None) -> AgentLimits:
    """The limits of a YAML file; no file means no limits."""
    if path is None:
        return AgentLimits()
    try:
        raw: Any = yaml.safe_load(Path(path).read_text()) or {}
        return AgentLimits.model_validate(raw)
    except (OSError, yaml.YAMLError) as exc:
        raise LimitsFileError(f"{path}: {exc}") from exc
    except pydantic.ValidationError as exc:
        where = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        )
        raise LimitsFileError(f"{path}: {where}") from exc
