"""The leader's view of each member cluster, kept in the store for the followers.

Only the leader holds agent sessions; it publishes what `GET /v1/clusters` shows of each
cluster (health, epoch, GPU totals by model, reason) under `/gpufed/clusters/<name>/view`
(`broker.dispatch.leading`, fenced by its term, at most once a second and only on change,
and every `REFRESH_SECONDS` so the time it last heard from the agent stays current).
Followers answer from these (`read_views`), with their own count of running jobs. A view is
JSON: the `ClusterView` and `seenAt`, the wall-clock time the leader last heard from the
agent (None: never).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import pydantic

from broker.api import inventory
from broker.state import records, store

logger = logging.getLogger(__name__)

VIEW = "/view"
REFRESH_SECONDS = 10.0


def view_key(cluster: str) -> str:
    return f"{records.CLUSTERS}{cluster}{VIEW}"


@dataclass(frozen=True)
class Published:
    view: inventory.ClusterView
    seen_at: float | None  # wall clock (seconds since the epoch)


def encode_view(view: inventory.ClusterView, *, seen_at: float | None) -> bytes:
    # without the fields at their defaults (no labels, no GPU trouble): a view a follower of
    # the previous release reads too, during a rolling upgrade (its models are strict)
    data = view.model_dump(
        mode="json", exclude={"last_seen_seconds", "running_jobs"}, exclude_defaults=True
    )
    data["seenAt"] = seen_at
    return json.dumps(data, sort_keys=True).encode()


def decode_view(value: bytes) -> Published:
    data = json.loads(value)
    seen_at = data.pop("seenAt", None)
    view = inventory.ClusterView.model_validate(data)
    return Published(view, float(seen_at) if seen_at is not None else None)


async def read_views(backing: store.Store) -> list[Published]:
    """Every published view, by cluster name; one that does not decode is left out."""
    entries, _ = await backing.list(records.CLUSTERS)
    out = []
    for entry in entries:
        if not entry.key.endswith(VIEW):
            continue
        try:
            out.append(decode_view(entry.value))
        except (ValueError, TypeError, pydantic.ValidationError) as exc:
            logger.warning("cluster view %s does not decode, not shown: %s", entry.key, exc)
    return sorted(out, key=lambda item: item.view.name)
