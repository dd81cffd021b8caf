"""The broker's cluster choice honours node affinity on the GPU model (the one label it sees)
and stays permissive for every other label; a stored bad queue name harms nobody."""

from __future__ import annotations

from typing import Any

import pytest

from broker.api import inventory, jobs, queues
from broker.api.queues import ReasonCode
from broker.planning import fitting, holdings, planning, quotas, snapshot, usage
from tests.builders import expr, make_job, make_model_summary, make_summary

GPU = jobs.GPU_PRODUCT_LABEL
H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"
L4 = "NVIDIA-L4"


def _summaries() -> list[inventory.ClusterSummary]:
    """h100 is the tightest fit for an 8-GPU pod (one node with 8 free); the others are roomier."""
    return [
        make_summary("h100", make_model_summary(H100, nodes_by_free=[0] * 8 + [1])),
        make_summary("a100", make_model_summary(A100, nodes_by_free=[0] * 8 + [4])),
        make_summary(
            "l4", make_model_summary(L4, nodes_by_free=[0] * 8 + [4], gpu_memory_mib=24576)
        ),
    ]


def _fleet() -> snapshot.FleetSnapshot:
    return snapshot.FleetSnapshot.build(
        [snapshot.ClusterCapacity.from_summary(s, healthy=True) for s in _summaries()]
    )


EVERY = {"h100", "a100", "l4"}


@pytest.mark.parametrize(
    ("terms", "fits"),
    [
        pytest.param([], EVERY, id="no affinity: every cluster"),
        pytest.param([[expr(GPU, "NotIn", H100)]], {"a100", "l4"}, id="NotIn excludes H100"),
        pytest.param([[expr(GPU, "NotIn", H100, L4)]], {"a100"}, id="NotIn of two models"),
        pytest.param([[expr(GPU, "In", A100, L4)]], {"a100", "l4"}, id="In"),
        pytest.param([[expr(GPU, "Exists")]], EVERY, id="Exists on the model: any GPU"),
        pytest.param([[expr(GPU, "DoesNotExist")]], set(), id="DoesNotExist: no GPU node"),
        pytest.param([[expr(GPU, "Gt", "1")]], set(), id="Gt on a model name: never"),
        pytest.param([[expr("zone", "In", "a")]], EVERY, id="another label: the agent decides"),
        pytest.param(
            [[expr("zone", "DoesNotExist"), expr(GPU, "NotIn", A100)]],
            {"h100", "l4"},
            id="model and unseen label ANDed",
        ),
        pytest.param(
            [[expr(GPU, "In", L4)], [expr("zone", "In", "a")]], EVERY, id="ORed with unseen"
        ),
        pytest.param(
            [[expr(GPU, "In", L4)], [expr(GPU, "In", H100)]], {"l4", "h100"}, id="ORed models"
        ),
    ],
)
def test_which_clusters_fit(terms: list[list[dict[str, Any]]], fits: set[str]) -> None:
    builder = make_job(gpus=8)
    if terms:
        builder = builder.node_affinity(*terms)
    request = builder.request()
    fleet = _fleet()
    found = {
        name
        for name, cluster in fleet.clusters.items()
        if isinstance(fitting.fit_gang(cluster, request), fitting.Fit)
    }
    assert found == fits
    present = {H100, A100, L4}
    models = {next(iter(fleet.clusters[n].models)) for n in fits}
    assert quotas.allowed_models(request, present) == models
    for name in EVERY - fits:
        miss = fitting.fit_gang(fleet.clusters[name], request)
        assert isinstance(miss, fitting.NoFit) and miss.code == ReasonCode.GPU_MODEL


def test_notin_h100_is_not_planned_on_the_tightest_h100() -> None:
    plain = planning.plan_cycle(_fleet(), [make_job(gpus=8).pending("j1")])
    assert [a.cluster for a in plain.assignments] == ["h100"]
    avoid = make_job(gpus=8).node_affinity([expr(GPU, "NotIn", H100)])
    plan = planning.plan_cycle(_fleet(), [avoid.pending("j1")])
    assert [a.cluster for a in plan.assignments] in (["a100"], ["l4"])


def test_a_job_no_cluster_can_take_says_so() -> None:
    job = make_job(gpus=8).node_affinity([expr(GPU, "NotIn", H100, A100, L4)])
    plan = planning.plan_cycle(_fleet(), [job.pending("j1")])
    assert plan.assignments == []
    [miss] = plan.unplaceable
    assert any(f"matching {GPU} NotIn" in reason for reason in miss.reasons), miss.reasons


def test_a_cpu_only_task_asking_for_a_node_without_gpus_is_left_to_the_agent() -> None:
    job = make_job(gpus=8).task("loader", gpus=0).node_affinity([expr(GPU, "DoesNotExist")])
    plan = planning.plan_cycle(_fleet(), [job.pending("j1")])
    assert [a.cluster for a in plan.assignments] == ["h100"]


def test_a_running_job_is_counted_on_a_model_its_affinity_allows() -> None:
    request = make_job(gpus=8).node_affinity([expr(GPU, "NotIn", H100)]).request()
    assert holdings.infer_models(request, [H100, A100]) == {A100: 8}


def _stored_with_bad_queue(job_id: str) -> snapshot.PendingJob:
    """A job an older broker accepted in queue `Team_A` (read back without the submit rules)."""
    return make_job(gpus=1, queue="Team_A").pending(job_id)


def test_a_stored_bad_queue_name_neither_halts_the_cycle_nor_the_listing() -> None:
    good = make_job(gpus=1, queue="team-b").pending("good")
    plan = planning.plan_cycle(_fleet(), [_stored_with_bad_queue("old"), good])
    assert {a.job_id for a in plan.assignments} == {"old", "good"}
    running = [
        snapshot.RunningJob(job_id="r", queue="Team_A", priority=0, cluster="h100", gpus={H100: 1})
    ]
    views = usage.build_views(
        queues.QueuesConfig(),
        running=running,
        pending=[_stored_with_bad_queue("old")],
        fleet_gpus={H100: 8},
    )
    [view] = [v for v in views if v.name == "Team_A"]
    assert not view.declared and view.status.pending_jobs == 1
