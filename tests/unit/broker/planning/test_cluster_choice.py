"""`spec.clusters`: the selector excludes clusters by their labels (and `why` says so per
cluster), `preferred` weights outrank the tightest fit, `order` spills over in order; submits
are held to every rule, naming the field, and stored records are read leniently."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from broker.api import clusterchoice, jobs, messages
from broker.api.queues import ReasonCode
from broker.http import problems
from broker.planning import planning, snapshot
from tests.builders import make_job, make_model_summary, make_summary
from tests.unit.broker.planning.sim import Cluster, Fleet, at, codes, config, pending, queue

H100 = "NVIDIA-H100-80GB-HBM3"
LABELS = {
    "eu-1": {"region": "eu", "tier": "spot"},
    "eu-2": {"region": "eu"},
    "us-1": {"region": "us", "tier": "spot"},
    "bare": {},
}


def _fleet(free: dict[str, int] | None = None) -> snapshot.FleetSnapshot:
    """One H100 cluster per name; `free` nodes of 8 free GPUs each (default 1)."""
    out = []
    for name, labels in LABELS.items():
        nodes = (free or {}).get(name, 1)
        summary = make_summary(name, make_model_summary(H100, nodes_by_free=[0] * 8 + [nodes]))
        summary = summary.model_copy(update={"labels": labels})
        out.append(snapshot.ClusterCapacity.from_summary(summary, healthy=True))
    return snapshot.FleetSnapshot.build(out)


def _expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": operator, "values": list(values)}


@pytest.mark.parametrize(
    ("selector", "allowed"),
    [
        pytest.param({}, set(LABELS), id="empty selector: every cluster"),
        pytest.param({"matchLabels": {"region": "eu"}}, {"eu-1", "eu-2"}, id="matchLabels"),
        pytest.param(
            {"matchLabels": {"region": "eu", "tier": "spot"}}, {"eu-1"}, id="matchLabels ANDed"
        ),
        pytest.param(
            {"matchExpressions": [_expr("region", "In", "eu", "us")]},
            {"eu-1", "eu-2", "us-1"},
            id="In",
        ),
        pytest.param(
            {"matchExpressions": [_expr("region", "NotIn", "eu")]},
            {"us-1", "bare"},
            id="NotIn: also a cluster without the label",
        ),
        pytest.param(
            {"matchExpressions": [_expr("tier", "Exists")]}, {"eu-1", "us-1"}, id="Exists"
        ),
        pytest.param(
            {"matchExpressions": [_expr("tier", "DoesNotExist")]},
            {"eu-2", "bare"},
            id="DoesNotExist",
        ),
        pytest.param(
            {
                "matchLabels": {"region": "eu"},
                "matchExpressions": [_expr("tier", "DoesNotExist")],
            },
            {"eu-2"},
            id="matchLabels and matchExpressions ANDed",
        ),
    ],
)
def test_the_selector_allows_only_the_clusters_it_matches(
    selector: dict[str, Any], allowed: set[str]
) -> None:
    choice = clusterchoice.choice_of(
        jobs.validate_submitted(make_job().clusters(selector=selector).document()).spec.clusters
    )
    assert {name for name, labels in LABELS.items() if clusterchoice.allows(choice, labels)} == (
        allowed
    )


def test_a_job_runs_only_where_its_selector_allows_and_why_names_the_others() -> None:
    fleet = _fleet(free={"us-1": 1, "eu-1": 0, "eu-2": 0, "bare": 2})
    job = make_job(gpus=8).clusters(selector={"matchLabels": {"region": "eu"}}).pending("j1")
    plan = planning.plan_cycle(fleet, [job])
    assert plan.assignments == []
    (miss,) = plan.unplaceable
    codes = {(r.cluster, r.code) for r in miss.details}
    assert codes == {
        ("us-1", ReasonCode.CLUSTER_SELECTOR),
        ("bare", ReasonCode.CLUSTER_SELECTOR),
        ("eu-1", ReasonCode.CAPACITY),
        ("eu-2", ReasonCode.CAPACITY),
    }
    excluded = next(r for r in miss.details if r.cluster == "us-1")
    assert excluded.message.startswith("excluded by spec.clusters")
    assert "region In [eu]" in excluded.message and "region=us" in excluded.message

    fleet = _fleet(free={"us-1": 1, "eu-1": 0, "eu-2": 3, "bare": 1})
    plan = planning.plan_cycle(fleet, [job])
    assert [a.cluster for a in plan.assignments] == ["eu-2"]


def test_preferred_weights_outrank_the_tightest_fit() -> None:
    # without preferences the tightest fit wins: the clusters with one free node
    fleet = _fleet(free={"eu-1": 3, "eu-2": 1, "us-1": 2, "bare": 1})
    plain = planning.plan_cycle(fleet, [make_job(gpus=8).pending("j1")])
    assert [a.cluster for a in plain.assignments] == ["bare"]
    preferred = [
        {"weight": 10, "selector": {"matchLabels": {"tier": "spot"}}},
        {"weight": 5, "selector": {"matchLabels": {"region": "us"}}},
    ]
    job = make_job(gpus=8).clusters(preferred=preferred).pending("j1")
    plan = planning.plan_cycle(_fleet(free={"eu-1": 3, "eu-2": 1, "us-1": 2, "bare": 1}), [job])
    assert [a.cluster for a in plan.assignments] == ["us-1"]  # 15 over eu-1's 10
    choice = job.clusters
    assert choice is not None
    assert [choice.score(LABELS[name]) for name in LABELS] == [10, 0, 15, 0]


def test_order_spills_over_to_the_next_cluster_where_the_job_fits() -> None:
    order = ["us-1", "eu-2", "eu-1"]
    job = make_job(gpus=8).clusters(order=order)
    placed = []
    for full in ([], ["us-1"], ["us-1", "eu-2"], ["us-1", "eu-2", "eu-1"]):
        fleet = _fleet(free={name: 0 if name in full else 4 for name in LABELS})
        plan = planning.plan_cycle(fleet, [job.pending("j1")])
        placed.append(plan.assignments[0].cluster)
    # the first in order with room, whatever the fit; one it does not name comes last
    assert placed == ["us-1", "eu-2", "eu-1", "bare"]


def test_order_within_the_selector_and_over_preferences() -> None:
    job = make_job(gpus=8).clusters(
        selector={"matchLabels": {"region": "eu"}},
        preferred=[{"weight": 100, "selector": {"matchLabels": {"tier": "spot"}}}],
        order=["us-1", "eu-2"],
    )
    plan = planning.plan_cycle(_fleet(), [job.pending("j1")])
    assert [a.cluster for a in plan.assignments] == ["eu-2"]  # us-1 excluded; order first


def test_jobs_in_one_cycle_spill_over_as_the_first_cluster_fills() -> None:
    fleet = _fleet(free={name: 1 for name in LABELS})
    order = ["eu-2", "eu-1"]
    pending = [make_job(gpus=8).clusters(order=order).pending(f"j{i}") for i in range(3)]
    plan = planning.plan_cycle(fleet, pending)
    assert [a.cluster for a in plan.assignments] == ["eu-2", "eu-1", "bare"]


@pytest.mark.parametrize(
    ("clusters", "field"),
    [
        pytest.param(
            {"selector": {"matchExpressions": [_expr("region", "Near", "eu")]}},
            "spec.clusters.selector.matchExpressions[0].operator",
            id="unknown operator",
        ),
        pytest.param(
            {"selector": {"matchExpressions": [{"key": "region", "operator": "In"}]}},
            "spec.clusters.selector.matchExpressions[0].values",
            id="In without values",
        ),
        pytest.param(
            {"selector": {"matchExpressions": [_expr("region", "Exists", "eu")]}},
            "spec.clusters.selector.matchExpressions[0].values",
            id="Exists with values",
        ),
        pytest.param(
            {"selector": {"matchExpressions": [_expr("Bad Key", "Exists")]}},
            "spec.clusters.selector.matchExpressions[0].key",
            id="a key that is not a label key",
        ),
        pytest.param(
            {"selector": {"matchLabels": {"region": "not a value"}}},
            "spec.clusters.selector.matchLabels",
            id="a value that is not a label value",
        ),
        pytest.param(
            {"preferred": [{"weight": 0, "selector": {}}]},
            "spec.clusters.preferred[0].weight",
            id="weight below 1",
        ),
        pytest.param(
            {"preferred": [{"weight": 101, "selector": {}}]},
            "spec.clusters.preferred[0].weight",
            id="weight above 100",
        ),
        pytest.param({"order": ["eu-1", "eu-1"]}, "spec.clusters.order", id="order repeats"),
        pytest.param({"order": ["EU_1"]}, "spec.clusters.order", id="order: not a name"),
        pytest.param({"pick": "eu-1"}, "spec.clusters.pick", id="an unknown field"),
    ],
)
def test_a_submit_is_refused_naming_the_field(clusters: dict[str, Any], field: str) -> None:
    document = make_job().document()
    document["spec"]["clusters"] = clusters
    with pytest.raises(pydantic.ValidationError) as caught:
        jobs.validate_submitted(document)
    assert [problems.field_path(e["loc"]) for e in caught.value.errors()] == [field]


def test_a_stored_record_is_read_leniently() -> None:
    document = make_job(gpus=8).document()
    document["spec"]["clusters"] = {
        "selector": {"matchExpressions": [_expr("region", "Near", "eu")]},
        "preferred": [{"weight": 1000, "selector": {}}],
        "order": ["EU_1", "EU_1"],
    }
    job = jobs.GPUJob.model_validate(document)  # no error: a newer broker's record loads
    assert job.spec.clusters is not None
    assert job.spec.clusters.preferred[0].weight == clusterchoice.MAX_WEIGHT
    choice = clusterchoice.choice_of(job.spec.clusters)
    # an operator it cannot read matches no cluster: the job waits with a reason
    assert not any(clusterchoice.allows(choice, labels) for labels in LABELS.values())


def test_no_spec_clusters_is_no_choice_and_stays_out_of_offers() -> None:
    assert clusterchoice.choice_of(None) is None
    assert clusterchoice.choice_of(clusterchoice.ClusterChoice()) is None
    job = make_job().clusters(order=["eu-1"]).build()
    offer = messages.Offer(job_id="j", epoch=1, tenant="t", job=job)
    assert '"clusters"' not in messages.encode(offer)


EU = {"matchLabels": {"region": "eu"}}


def test_a_job_preempts_only_on_clusters_its_selector_allows() -> None:
    """Queue b borrows both clusters; a reclaims. The victim that loses least work (the
    latest started) is on us-1, but the job may only run in the EU: the victim is on eu-1."""
    fleet = Fleet.of(
        Cluster("eu-1", nodes=1, labels={"region": "eu"}),
        Cluster("us-1", nodes=1, labels={"region": "us"}),
    )
    fleet.run("b-eu", "b", "eu-1", [8], started_s=0)
    fleet.run("b-us", "b", "us-1", [8], started_s=30)
    queues = config(queue("a", quotas={H100: (8, 16)}), queue("b", quotas={H100: (0, 16)}))
    anywhere = pending(make_job(gpus=8, queue="a"), "a-1")
    plan = fleet.plan([anywhere], queues=queues, now=at(60))
    assert [p.job_id for p in plan.preemptions] == ["b-us"]
    in_eu = pending(make_job(gpus=8, queue="a").clusters(selector=EU), "a-1")
    plan = fleet.plan([in_eu], queues=queues, now=at(60))
    assert [(p.job_id, p.cluster) for p in plan.preemptions] == [("b-eu", "eu-1")]
    assert codes(plan, "a-1")["us-1"] == {"ClusterSelector"}


def test_a_reservation_is_held_only_on_a_cluster_its_selector_allows() -> None:
    fleet = Fleet.of(
        Cluster("eu-1", nodes=2, labels={"region": "eu"}),
        Cluster("us-1", nodes=2, labels={"region": "us"}),
    )
    fleet.run("eu-busy", "a", "eu-1", [4, 4], started_s=0)
    fleet.run("us-busy", "a", "us-1", [2, 2], started_s=0)  # the roomier: reserved by default
    queues = config(queue("a", quotas={H100: (0, None)}), reserveAfterSeconds=300)
    gang = make_job(gpus=8, queue="a").gang(2)
    plan = fleet.plan([pending(gang, "gang")], queues=queues, now=at(400))
    assert plan.reservations["gang"].cluster == "us-1"
    plan = fleet.plan([pending(gang.clusters(selector=EU), "gang")], queues=queues, now=at(400))
    assert plan.reservations["gang"].cluster == "eu-1"
