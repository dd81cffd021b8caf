"""Prometheus metrics of the broker, on a registry of its own (one per app, so tests can run
several brokers in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


class BrokerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.jobs_submitted = Counter(
            "gpufed_jobs_submitted", "Jobs accepted by the broker", ["queue"], registry=r
        )
        self.jobs_finished = Counter(
            "gpufed_jobs_finished", "Jobs that reached a final state", ["state"], registry=r
        )
        self.placements = Counter(
            "gpufed_placements", "Offers answered by agents", ["result"], registry=r
        )
        self.cycle_duration = Histogram(
            "gpufed_scheduling_cycle_duration_seconds",
            "One scheduling cycle, end to end",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decision_duration = Histogram(
            "gpufed_scheduling_decision_duration_seconds",
            "Pure planning time per job decided",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.submit_to_dispatch = Histogram(
            "gpufed_job_submit_to_dispatch_seconds",
            "Submit to first offer",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.submit_to_running = Histogram(
            "gpufed_job_submit_to_running_seconds",
            "Submit to Running",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pending_jobs = Gauge(
            "gpufed_pending_jobs", "Jobs waiting in a queue", ["queue"], registry=r
        )
        self.cluster_gpus = Gauge(
            "gpufed_cluster_gpus",
            "GPUs per cluster and model by state",
            ["cluster", "model", "state"],
            registry=r,
        )
        self.agent_connected = Gauge(
            "gpufed_agent_session_connected",
            "1 when the cluster's agent is connected",
            ["cluster"],
            registry=r,
        )
        self.cluster_fragmentation = Gauge(
            "gpufed_cluster_fragmentation_gpus",
            "Free GPUs stranded by fragmentation (FGD measure against the expected workload)",
            ["cluster"],
            registry=r,
        )
        self.store_latency = Histogram(
            "gpufed_store_operation_duration_seconds",
            "Store writes by operation",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
