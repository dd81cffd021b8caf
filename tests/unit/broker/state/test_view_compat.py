"""The cluster views the leader publishes for the followers (`state.views`), across broker
versions: a follower of the previous release (strict models) reads the view of a cluster
that uses nothing newer, during a rolling upgrade; a newer field is written when set."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from broker.api import inventory
from broker.state import views

# ClusterView's fields at commit 53a2470 (the release before GPU health came in)
PREVIOUS = {
    "connected",
    "epoch",
    "health",
    "labels",
    "last_seen_seconds",
    "models",
    "name",
    "reason",
    "running_jobs",
}


def view(**changes: object) -> inventory.ClusterView:
    totals = inventory.ModelTotals(
        model="NVIDIA-H100-80GB-HBM3", total=64, free=8, allocated=56, unavailable=0
    )
    base = inventory.ClusterView(
        name="east", health="Ready", connected=True, epoch=3, models=[totals]
    )
    return base.model_copy(update=changes)


def test_a_healthy_clusters_view_has_only_keys_the_previous_release_knows() -> None:
    data = json.loads(views.encode_view(view(), seen_at=12.5))
    assert set(data) - {"seenAt"} <= PREVIOUS
    published = views.decode_view(views.encode_view(view(), seen_at=12.5))
    assert published.view == view()
    assert published.seen_at == 12.5


def test_gpu_trouble_and_labels_are_written_when_there_are_some() -> None:
    troubled = view(unhealthy_gpus=2, cordoned_nodes=["h100-000"], labels={"region": "eu"})
    data = json.loads(views.encode_view(troubled, seen_at=None))
    assert (data["unhealthy_gpus"], data["cordoned_nodes"]) == (2, ["h100-000"])
    assert data["labels"] == {"region": "eu"}
    assert views.decode_view(views.encode_view(troubled, seen_at=None)).view == troubled


def test_mig_devices_are_written_only_for_a_model_that_has_some() -> None:
    data = json.loads(views.encode_view(view(), seen_at=None))
    assert set(data["models"][0]) == {"model", "total", "free", "allocated", "unavailable"}
    slices = [inventory.MIGTotals(profile="1g.10gb", total=14, free=9)]
    [totals] = view().models
    with_mig = view(models=[totals.model_copy(update={"mig": slices})])
    data = json.loads(views.encode_view(with_mig, seen_at=None))
    assert data["models"][0]["mig"] == [{"profile": "1g.10gb", "total": 14, "free": 9}]
    assert views.decode_view(views.encode_view(with_mig, seen_at=None)).view == with_mig


def test_a_cluster_scored_down_is_shown_so_by_a_follower() -> None:
    down = view(
        scored_down_until=datetime(2026, 1, 1, 12, 10, tzinfo=UTC),
        scored_down_reason="3 jobs it accepted did not start within 1800 s",
    )
    data = json.loads(views.encode_view(down, seen_at=None))
    assert data["scored_down_until"] == "2026-01-01T12:10:00Z"
    assert views.decode_view(views.encode_view(down, seen_at=None)).view == down
    assert "scored_down_until" not in json.loads(views.encode_view(view(), seen_at=None))
