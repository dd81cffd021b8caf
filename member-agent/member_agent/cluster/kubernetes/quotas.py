"""Kubernetes ResourceQuotas on GPUs, as the agent reads them: what a namespace may still ask.

The Kubernetes backend lists and watches the ResourceQuotas of the namespaces it may create pods
in (`backend.py`, one `watching.ListWatch` per namespace, as the chart's Roles allow) into a
`QuotaBook`. `QuotaBook.gpu_quotas` gives, per quota on `requests.nvidia.com/gpu` or
`limits.nvidia.com/gpu`, its `hard` value and what is used: the larger of the quota's
`status.used` (the API server's count, updated at admission) and the GPUs requested by the
namespace's non-terminal pods as the agent's own pod watch sees them (which already includes
pods it has just created, before the quota's status catches up). For extended resources
requests equal limits, so both resources count the same pods.

Quotas with `scopes` or a `scopeSelector` count only some pods (by priority class, by
`activeDeadlineSeconds`, ...); they are left to the API server's admission and not checked
here, as are quotas whose quantities do not read as a number of GPUs.
"""

from __future__ import annotations

import decimal
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker.api import jobs
from member_agent.inventory import model

logger = logging.getLogger(__name__)

GPU_QUOTA_RESOURCES = (f"requests.{jobs.GPU_RESOURCE}", f"limits.{jobs.GPU_RESOURCE}")
_SUFFIXES = {
    "m": decimal.Decimal("0.001"),
    "": decimal.Decimal(1),
    "k": decimal.Decimal(10) ** 3,
    "M": decimal.Decimal(10) ** 6,
    "G": decimal.Decimal(10) ** 9,
    "T": decimal.Decimal(10) ** 12,
    "P": decimal.Decimal(10) ** 15,
    "E": decimal.Decimal(10) ** 18,
    "Ki": decimal.Decimal(2) ** 10,
    "Mi": decimal.Decimal(2) ** 20,
    "Gi": decimal.Decimal(2) ** 30,
    "Ti": decimal.Decimal(2) ** 40,
    "Pi": decimal.Decimal(2) ** 50,
    "Ei": decimal.Decimal(2) ** 60,
}


def parse_count(value: Any, *, round_up: bool) -> int | None:
    """A Kubernetes quantity ("4", 4, "1k", "1500m") as a whole count, rounded down (a hard
    limit) or up (a use); None when it is not a quantity."""
    text = str(value).strip()
    number, suffix = text, ""
    for candidate in sorted(_SUFFIXES, key=len, reverse=True):
        if candidate and text.endswith(candidate):
            number, suffix = text[: -len(candidate)], candidate
            break
    try:
        amount = decimal.Decimal(number) * _SUFFIXES[suffix]
    except decimal.InvalidOperation:
        return None
    if not amount.is_finite() or amount < 0:
        return None
    return int(math.ceil(amount) if round_up else math.floor(amount))


@dataclass(frozen=True)
class QuotaRecord:
    """What gpufed keeps of one ResourceQuota: its GPU resources only."""

    namespace: str
    name: str
    hard: dict[str, int]
    used: dict[str, int]
    scoped: bool

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


def read_quota(raw: Mapping[str, Any]) -> QuotaRecord:
    """The GPU part of a ResourceQuota: `spec.hard` (else `status.hard`) and `status.used`."""
    meta = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    state = raw.get("status") or {}
    where = f"ResourceQuota {meta.get('namespace')}/{meta.get('name')}"
    hard_raw = spec.get("hard") or state.get("hard") or {}
    used_raw = state.get("used") or {}
    hard: dict[str, int] = {}
    used: dict[str, int] = {}
    for resource in GPU_QUOTA_RESOURCES:
        if resource in hard_raw:
            limit = parse_count(hard_raw[resource], round_up=False)
            if limit is None:
                logger.warning("%s: %s %r is not a quantity", where, resource, hard_raw[resource])
                continue
            hard[resource] = limit
        if resource in used_raw:
            used[resource] = parse_count(used_raw[resource], round_up=True) or 0
    return QuotaRecord(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name", "")),
        hard=hard,
        used=used,
        scoped=bool(spec.get("scopes") or spec.get("scopeSelector")),
    )


class QuotaBook:
    """The GPU quotas of the watched namespaces."""

    def __init__(self) -> None:
        self._quotas: dict[tuple[str, str], QuotaRecord] = {}

    def replace(self, items: list[dict[str, Any]], *, namespace: str | None) -> None:
        """Every quota of `namespace` (None: of all namespaces) is now `items`."""
        self._quotas = {
            key: quota
            for key, quota in self._quotas.items()
            if namespace is not None and quota.namespace != namespace
        }
        for item in items:
            quota = read_quota(item)
            self._quotas[quota.key] = quota

    def apply(self, kind: str, raw: dict[str, Any]) -> None:
        quota = read_quota(raw)
        if kind == "DELETED":
            self._quotas.pop(quota.key, None)
        else:
            self._quotas[quota.key] = quota

    def gpu_quotas(self, namespace: str, *, in_use: int) -> list[model.GPUQuota]:
        """The namespace's unscoped GPU quotas; `in_use`: GPUs its live pods request."""
        out = []
        for quota in self._quotas.values():
            if quota.namespace != namespace or quota.scoped:
                continue
            for resource, hard in sorted(quota.hard.items()):
                used = max(quota.used.get(resource, 0), in_use)
                out.append(model.GPUQuota(namespace, quota.name, resource, hard=hard, used=used))
        return sorted(out, key=lambda q: (q.name, q.resource))


class QuotaFeed:
    """The sink (`watching.Sink`) of one namespace's ResourceQuota watch (or all namespaces')."""

    def __init__(self, book: QuotaBook, namespace: str | None) -> None:
        self._book = book
        self._namespace = namespace

    def replace(self, items: list[dict[str, Any]], *, started: float) -> None:
        del started
        self._book.replace(items, namespace=self._namespace)

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        self._book.apply(kind, obj)
