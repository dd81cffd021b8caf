"""The broker's and the agent's metrics tell the truth: what can be counted exists at 0 before
it happens, a queue with nothing pending reads 0, and a cluster that is not Ready offers no
free GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from broker.api import queues
from broker.planning import preemption
from broker.telemetry import metrics
from member_agent import telemetry
from member_agent.jobs import handling
from member_agent.utilisation import exporting


def sample(meters: metrics.BrokerMetrics, name: str, **labels: str) -> float | None:
    return meters.registry.get_sample_value(name, labels)


def declared(*names: str) -> queues.QueuesConfig:
    return queues.QueuesConfig.model_validate(
        {"queues": [{"name": n, "tenant": "team-a"} for n in names]}
    )


def test_a_declared_queue_s_counters_are_at_0_from_the_first_scrape() -> None:
    meters = metrics.BrokerMetrics()
    config = declared("train")
    meters.queue_label.follow(lambda: config)
    list(meters.registry.collect())  # what a scrape does (the series appear before they are read)
    assert sample(meters, "gpufed_jobs_submitted_total", queue="train") == 0
    assert sample(meters, "gpufed_jobs_finished_total", queue="train", state="Failed") == 0
    for reason in metrics.PREEMPTION_REASONS:
        assert sample(meters, "gpufed_preemptions_total", queue="train", reason=reason) == 0
    config = declared("train", "serve")  # declared at run time
    list(meters.registry.collect())
    assert sample(meters, "gpufed_preemptions_total", queue="serve", reason="Reclaim") == 0


def test_an_undeclared_queue_s_counters_start_at_0_with_its_first_job() -> None:
    meters = metrics.BrokerMetrics()
    meters.count_submitted("adhoc")
    assert sample(meters, "gpufed_jobs_submitted_total", queue="adhoc") == 1
    assert sample(meters, "gpufed_jobs_finished_total", queue="adhoc", state="Succeeded") == 0
    assert sample(meters, "gpufed_preemptions_total", queue="adhoc", reason="Priority") == 0


def test_a_welcomed_session_is_counted_and_its_placement_results_exported_at_0() -> None:
    meters = metrics.BrokerMetrics()
    meters.welcome_session("h100")
    meters.welcome_session("h100")  # the agent restarted
    assert sample(meters, "gpufed_cluster_sessions_total", cluster="h100") == 2
    for result in metrics.PLACEMENT_RESULTS:
        assert sample(meters, "gpufed_placements_total", cluster="h100", result=result) == 0


def test_a_queue_with_nothing_pending_reads_0() -> None:
    meters = metrics.BrokerMetrics()
    meters.set_pending({"train": 3}, {"train": 42.0})
    meters.set_pending({}, {})
    assert sample(meters, "gpufed_pending_jobs", queue="train") == 0
    assert sample(meters, "gpufed_pending_oldest_age_seconds", queue="train") == 0


# 16 GPUs: 6 whole free, 1.5 free on shared GPUs, 2 unavailable, so 6.5 allocated
GPUS = metrics.ModelGPUs(total=16, free=6, shared_free=1.5, unavailable=2)


@pytest.mark.parametrize(
    ("health", "expected"),
    [
        pytest.param("Ready", (6, 1.5, 6.5, 2), id="Ready: as the summary says"),
        pytest.param("Degraded", (0, 0, 6.5, 9.5), id="Degraded: free GPUs unavailable"),
        pytest.param("Unreachable", (0, 0, 6.5, 9.5), id="Unreachable: free GPUs unavailable"),
        pytest.param("Connecting", (0, 0, 6.5, 9.5), id="reconnecting: the last summary's"),
        pytest.param("Lost", (0, 0, 0, 16), id="Lost: every GPU unavailable"),
    ],
)
def test_only_a_ready_cluster_has_free_gpus(
    health: str, expected: tuple[float, float, float, float]
) -> None:
    meters = metrics.BrokerMetrics()
    meters.set_cluster("h100", health="Ready", models={"H100": GPUS}, fragmentation=3.0)
    meters.set_cluster("h100", health=health, fragmentation=3.0)
    got = tuple(
        sample(meters, "gpufed_cluster_gpus", cluster="h100", model="H100", state=state)
        for state in metrics.GPU_STATES
    )
    assert got == expected
    assert sum(expected) == GPUS.total
    stranded = sample(meters, "gpufed_cluster_fragmentation_gpus", cluster="h100")
    assert stranded == (3.0 if health == "Ready" else 0.0)
    assert sample(meters, "gpufed_agent_session_state", cluster="h100", state=health) == 1


def test_the_known_label_values_are_the_code_s() -> None:
    assert set(metrics.PREEMPTION_REASONS) == {preemption.PRIORITY, preemption.RECLAIM}
    source = Path(handling.__file__).read_text()
    results = set(re.findall(r'Rejection\(\s*"(\w+)"', source))
    results |= set(re.findall(r'^\s+return "(\w+)"$', source, re.MULTILINE))
    assert results == set(telemetry.OFFER_RESULTS)


def test_an_agent_queue_holding_no_gpu_any_more_reads_0() -> None:
    known = {"train"}  # what the collector exported before: train held GPUs then
    [allocated] = exporting.collect("h100", [], None, known=known)
    assert [(s.labels["queue"], s.value) for s in allocated.samples] == [("train", 0.0)]
