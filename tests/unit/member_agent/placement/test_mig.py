"""MIG slices end to end in the pure core: the job's request, the inventory's books, the
agent's gang placement, the summary sent up and the broker's cluster choice over it."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import pydantic
import pytest

from broker.api import gangs, jobs, mig, status
from broker.api import inventory as api
from broker.planning import planning, snapshot
from member_agent.inventory import model, summary
from member_agent.placement import gang
from tests import agentbuilders as b
from tests.builders import make_job

PROFILE = "1g.10gb"
WHERE = "spec.tasks[0].template"


def mig_node(name: str, *, slices: dict[str, int], gpus: int = 0, **kw: Any) -> model.Node:
    node = b.node(name, gpus=gpus, **kw)
    node.mig = dict(slices)
    node.mig_free = {p: tuple(range(n)) for p, n in slices.items()}
    return node


def mig_job(slices: int = 1, *, pods: int = 1, profile: str = PROFILE) -> gangs.GangRequest:
    return (
        make_job("m", gpus=slices)
        .annotate(mig.MIG_PROFILE_ANNOTATION, profile)
        .gang(pods)
        .request()
    )


def limits_job(limits: dict[str, Any], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    doc = make_job("m", gpus=0).document()
    template = doc["spec"]["tasks"][0]["template"]
    template["spec"]["containers"][0]["resources"]["limits"] = limits
    template["metadata"]["annotations"] = dict(annotations or {})
    return doc


# -- the job's request ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "annotations", "profile", "slices"),
    [
        pytest.param({"nvidia.com/mig-1g.10gb": 2}, {}, "1g.10gb", 2, id="the resource in limits"),
        pytest.param(
            {"nvidia.com/gpu": 3}, {mig.MIG_PROFILE_ANNOTATION: "3g.40gb"}, "3g.40gb", 3,
            id="the annotation: nvidia.com/gpu counts the slices",
        ),
        pytest.param(
            {"nvidia.com/mig-2g.20gb": "1"}, {mig.MIG_PROFILE_ANNOTATION: "2g.20gb"}, "2g.20gb", 1,
            id="both, agreeing",
        ),
    ],
)  # fmt: skip
def test_a_pod_asks_for_slices_of_one_profile(
    limits: dict[str, Any], annotations: dict[str, str], profile: str, slices: int
) -> None:
    job = jobs.validate_submitted(limits_job(limits, annotations))
    shape = jobs.shape_of(job.spec.tasks[0])
    assert (shape.gpus, shape.mig_profile, shape.mig_slices) == (0, profile, slices)


LIMITS = f"{WHERE}.spec.containers[0].resources.limits"
ANNOTATIONS = f"{WHERE}.metadata.annotations"


@pytest.mark.parametrize(
    ("limits", "annotations", "field", "says"),
    [
        pytest.param(
            {"nvidia.com/mig-huge": 1}, {}, f"{LIMITS}[nvidia.com/mig-huge]", "not a MIG profile",
            id="unknown profile syntax in the resource",
        ),
        pytest.param(
            {"nvidia.com/gpu": 1}, {mig.MIG_PROFILE_ANNOTATION: "1g"},
            f"{ANNOTATIONS}[{mig.MIG_PROFILE_ANNOTATION}]", "not a MIG profile",
            id="unknown profile syntax in the annotation",
        ),
        pytest.param(
            {"nvidia.com/gpu": 1, "nvidia.com/mig-1g.10gb": 1}, {},
            f"{LIMITS}[nvidia.com/mig-1g.10gb]", "not both", id="MIG plus whole GPUs",
        ),
        pytest.param(
            {"nvidia.com/gpu": 1},
            {mig.MIG_PROFILE_ANNOTATION: PROFILE, jobs.GPU_MILLI_ANNOTATION: "1000"},
            f"{ANNOTATIONS}[{jobs.GPU_MILLI_ANNOTATION}]", "not a share", id="MIG plus gpu-milli",
        ),
        pytest.param(
            {"nvidia.com/mig-1g.10gb": 1, "nvidia.com/mig-3g.40gb": 1}, {},
            f"{LIMITS}[nvidia.com/mig-3g.40gb]", "one profile", id="two profiles",
        ),
        pytest.param(
            {"nvidia.com/mig-1g.10gb": 1}, {mig.MIG_PROFILE_ANNOTATION: "3g.40gb"},
            f"{ANNOTATIONS}[{mig.MIG_PROFILE_ANNOTATION}]", "names 3g.40gb",
            id="the annotation names another profile",
        ),
        pytest.param(
            {"nvidia.com/mig-1g.10gb": "1.5"}, {}, f"{LIMITS}[nvidia.com/mig-1g.10gb]",
            "whole number", id="a fraction of a slice",
        ),
    ],
)  # fmt: skip
def test_a_bad_mig_request_is_refused_naming_the_field(
    limits: dict[str, Any], annotations: dict[str, str], field: str, says: str
) -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        jobs.validate_submitted(limits_job(limits, annotations))
    text = str(caught.value)
    assert f"{field}: " in text and says in text, text


def test_a_stored_record_breaking_a_mig_rule_still_loads_as_before() -> None:
    """Leniency for records and offers: what an older broker accepted reads as it did."""
    doc = limits_job({"nvidia.com/gpu": 1, "nvidia.com/mig-1g.10gb": 1})
    shape = jobs.shape_of(jobs.GPUJob.model_validate(doc).spec.tasks[0])
    assert (shape.gpus, shape.mig_slices) == (1, 0)


# -- the inventory and the agent's placement ------------------------------------------------


def test_the_inventory_books_and_frees_slices() -> None:
    inv = b.inventory(mig_node("a", slices={PROFILE: 7}))
    pod = b_placement("p", "a")
    inv.apply(pod, mig={PROFILE: (0, 3)})
    assert inv.nodes["a"].mig_free[PROFILE] == (1, 2, 4, 5, 6)
    with pytest.raises(ValueError, match="not free"):
        inv.apply(b_placement("q", "a"), mig={PROFILE: (3,)})
    inv.release("p")
    assert inv.nodes["a"].mig_free[PROFILE] == tuple(range(7))


def b_placement(name: str, node: str) -> status.PodPlacement:
    return status.PodPlacement(name=name, task="t", node=node)


def test_a_mig_gang_goes_to_the_node_with_slices_of_its_profile_best_fit() -> None:
    inv = b.inventory(
        mig_node("other", slices={"3g.40gb": 2}),
        mig_node("roomy", slices={PROFILE: 7}),
        mig_node("snug", slices={PROFILE: 3}),
        b.node("whole"),
    )
    placed = gang.place_gang(inv, mig_job(2, pods=2))
    assert isinstance(placed, gang.GangPlacement)
    where = sorted((p.placement.node, p.mig[PROFILE]) for p in placed.pods)
    # the fullest node that fits takes the first pod, the second no longer fits there
    assert where == [("roomy", (0, 1)), ("snug", (0, 1))]
    assert all(p.placement.gpus == [] for p in placed.pods)


def test_a_mig_gang_is_all_or_nothing() -> None:
    inv = b.inventory(mig_node("a", slices={PROFILE: 3}), mig_node("b", slices={PROFILE: 2}))
    placed = gang.place_gang(inv, mig_job(2, pods=3))
    assert isinstance(placed, gang.NoPlacement)
    assert placed.reasons == (
        "gang: 3 pods × 2 MIG slices of 1g.10gb need 3 nodes with 2 1g.10gb free, 2 have",
    )
    assert inv.nodes["a"].mig_free[PROFILE] == (0, 1, 2)  # nothing booked


@pytest.mark.parametrize(
    ("nodes", "request_", "reason"),
    [
        pytest.param(
            [b.node("whole")], mig_job(1),
            "mig: no ready node has MIG devices of profile 1g.10gb (cluster has no MIG devices)",
            id="no MIG node",
        ),
        pytest.param(
            [mig_node("a", slices={"3g.40gb": 2})], mig_job(1),
            "mig: no ready node has MIG devices of profile 1g.10gb (cluster has 3g.40gb)",
            id="another profile only",
        ),
        pytest.param(
            [mig_node("a", slices={PROFILE: 2})], mig_job(3),
            "mig: no node has 3 MIG devices of 1g.10gb (largest has 2)", id="too few on any node",
        ),
    ],
)  # fmt: skip
def test_why_a_mig_gang_does_not_fit(
    nodes: list[model.Node], request_: gangs.GangRequest, reason: str
) -> None:
    placed = gang.place_gang(b.inventory(*nodes), request_)
    assert isinstance(placed, gang.NoPlacement) and placed.reasons == (reason,)


# -- the summary and the broker's choice -----------------------------------------------------


def test_the_summary_counts_free_slices_per_profile() -> None:
    used = mig_node("a", slices={PROFILE: 7, "3g.40gb": 1})
    used.mig_free[PROFILE] = (5, 6)
    inv = b.inventory(
        used, mig_node("b", slices={PROFILE: 7}), mig_node("down", slices={PROFILE: 7}, ready=False)
    )
    found = summary.summarise(inv).model("H100")
    assert found is not None and found.mig is not None
    slices = found.mig[PROFILE]
    assert (slices.total, slices.free) == (21, 9)
    assert slices.nodes_by_free == [0, 0, 1, 0, 0, 0, 0, 1]
    assert found.mig["3g.40gb"].nodes_by_free == [0, 1]
    assert summary.summarise(b.inventory(b.node("x"))).models[0].mig is None


def _choose(
    clusters: dict[str, model.Inventory], *requests: gangs.GangRequest
) -> planning.CyclePlan:
    capacities = []
    for name, inv in clusters.items():
        inv.cluster = name
        capacities.append(
            snapshot.ClusterCapacity.from_summary(summary.summarise(inv), healthy=True)
        )
    pending = [
        snapshot.PendingJob(
            job_id=f"j{i}", queue="q", priority=0,
            created=datetime(2026, 1, 1, i, tzinfo=UTC),
            request=dataclasses.replace(r, job_id=f"j{i}"),
        )
        for i, r in enumerate(requests)
    ]  # fmt: skip
    return planning.plan_cycle(snapshot.FleetSnapshot.build(capacities), pending)


def test_the_broker_sends_a_mig_job_only_where_its_profile_has_free_slices() -> None:
    full = mig_node("f", slices={PROFILE: 7})
    full.mig_free[PROFILE] = ()
    clusters = {
        "a-whole": b.inventory(b.node("w")),
        "b-other-profile": b.inventory(mig_node("o", slices={"3g.40gb": 2})),
        "c-full": b.inventory(full),
        "d-free": b.inventory(mig_node("d", slices={PROFILE: 7})),
    }
    plan = _choose(clusters, mig_job(2))
    assert [a.cluster for a in plan.assignments] == ["d-free"]


def test_the_broker_refuses_a_mig_job_where_no_cluster_has_room_and_says_why() -> None:
    clusters = {"small": b.inventory(mig_node("s", slices={PROFILE: 2}))}
    plan = _choose(clusters, mig_job(3))
    assert plan.assignments == []
    [miss] = plan.unplaceable
    assert miss.reasons == (
        "small: needs 1 node(s) with 3 free MIG device(s) of 1g.10gb on H100; not enough free",
    )


def test_the_broker_prefers_the_tightest_fit_and_deducts_what_it_assumed() -> None:
    clusters = {
        "roomy": b.inventory(mig_node("r", slices={PROFILE: 7})),
        "snug": b.inventory(mig_node("s", slices={PROFILE: 2})),
    }
    plan = _choose(clusters, mig_job(2), mig_job(2))
    # the first takes the exact fit; the second sees the snug node taken and goes elsewhere
    assert [(a.job_id, a.cluster) for a in plan.assignments] == [("j0", "snug"), ("j1", "roomy")]


def test_an_old_agents_summary_has_no_mig_and_parses_as_before() -> None:
    raw = summary.summarise(b.inventory(b.node("x"))).model_dump(mode="json", exclude_none=True)
    assert "mig" not in raw["models"][0]
    assert api.ClusterSummary.model_validate(raw).models[0].mig is None


def test_a_summary_with_inconsistent_mig_counts_is_refused() -> None:
    bad = {"model": "H100", "nodes": 1, "mig": {PROFILE: {"total": 2, "free": 3}}}
    with pytest.raises(pydantic.ValidationError, match="more free MIG devices than total"):
        api.ModelSummary.model_validate(bad)
    worse = {"model": "H100", "nodes": 1, "mig": {PROFILE: {"total": 9, "free": 9,
             "nodes_by_free": [0, 2]}}}  # fmt: skip
    with pytest.raises(pydantic.ValidationError, match="more nodes"):
        api.ModelSummary.model_validate(worse)
