"""Prometheus metrics of the broker, on a registry of its own (one per app, so tests can run
several brokers in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from broker.api import inventory, queues, status

# Every label value a counter can take that is known before it happens is exported at 0 from
# the start (a series born at 1 hides its first event from increase() and rate()).
STORE_ALARMS = ("NOSPACE", "CORRUPT")  # etcd's
FINISHED_STATES = tuple(sorted(s.value for s in status.TERMINAL))
PLACEMENT_RESULTS = ("accepted", "rejected", "timeout", "start_timeout")
PREEMPTION_REASONS = ("Priority", "Reclaim")  # planning.preemption's PRIORITY and RECLAIM
# the states `fleet.Cluster.health` gives an agent session, exported one-hot
SESSION_STATES = ("Connecting", "Ready", "Degraded", "Unreachable", "Lost")
# `gpufed_cluster_gpus{state}`: they sum to the cluster's GPUs of that model
GPU_STATES = ("free", "shared_free", "allocated", "unavailable")

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,  # the decision target: p99 over 2 ms is read exactly from this bucket
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
# what a job waits (submit to dispatch, to running): from the 50 ms dispatch target to a day,
# each bucket at most 1.5 times the one below from 10 s on, so a quantile read from them is
# within 1.5 times the true one (a jump from 60 s to 300 s reads a 70 s p99 as up to 4 times that)
WAIT_BUCKETS = (
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
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
    90.0,
    120.0,
    180.0,
    240.0,
    300.0,
    450.0,
    600.0,
    900.0,
    1200.0,
    1800.0,
    2700.0,
    3600.0,
    5400.0,
    7200.0,
    10800.0,
    14400.0,
    21600.0,
    32400.0,
    43200.0,
    64800.0,
    86400.0,
)


OTHER_QUEUE = "other"
# undeclared queues named in labels besides the declared ones (first seen); the rest: other
SPARE_QUEUE_LABELS = 20


class QueueLabels:
    """The `queue` label's value for a queue name: a declared queue's name, the first
    `spare` undeclared names seen (so an open-mode fleet of a few queues reads as before),
    and `other` for the rest: a submitter naming new queues cannot grow the series."""

    def __init__(self, *, spare: int = SPARE_QUEUE_LABELS) -> None:
        self.spare = spare
        self._config: Callable[[], queues.QueuesConfig | None] = lambda: None
        self._of: queues.QueuesConfig | None = None
        self._declared: frozenset[str] = frozenset()
        self._seen: set[str] = set()

    def follow(self, config: Callable[[], queues.QueuesConfig | None]) -> None:
        """The declared queues are those of `config()` (the registry's, as it changes)."""
        self._config = config

    def declared(self) -> frozenset[str]:
        """The names of the declared queues, as the configuration has them now."""
        config = self._config()
        if config is not self._of:  # a new configuration: its names, once
            self._of = config
            self._declared = frozenset(q.name for q in config.queues) if config else frozenset()
        return self._declared

    def _is_declared(self, name: str) -> bool:
        return name in self.declared()

    def __call__(self, name: str) -> str:
        if name in self._seen or self._is_declared(name):
            return name
        if len(self._seen) < self.spare:
            self._seen.add(name)
            return name
        return OTHER_QUEUE


class _Declaring(Collector):
    """Registered first, so that at each scrape, before the families are read, the declared
    queues (they change at run time) have their series: a queue's first job or preemption
    then moves its counter from 0 instead of creating it at 1."""

    def __init__(self, meters: BrokerMetrics) -> None:
        self.meters = meters

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        self.meters.declare_queues()
        return iter(())


@dataclass(frozen=True)
class ModelGPUs:
    """One GPU model of a cluster, as `gpufed_cluster_gpus` exports it."""

    total: int
    free: int
    shared_free: float
    unavailable: int

    @property
    def allocated(self) -> float:
        return max(0.0, self.total - self.free - self.shared_free - self.unavailable)


class BrokerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.queue_label = QueueLabels()
        r = self.registry
        r.register(_Declaring(self))
        self._queues_declared: frozenset[str] = frozenset()
        self._queue_series: set[str] = set()  # queue labels whose counters are exported
        self._pending_labels: set[str] = set()  # every queue label exported, to go back to 0
        self._cluster_models: dict[str, dict[str, ModelGPUs]] = {}  # last summary's, per cluster
        self.jobs_submitted = Counter(
            "gpufed_jobs_submitted", "Jobs accepted by the broker", ["queue"], registry=r
        )
        self.jobs_finished = Counter(
            "gpufed_jobs_finished",
            "Jobs that reached a final state, by queue and state",
            ["queue", "state"],
            registry=r,
        )
        self.placements = Counter(
            "gpufed_placements",
            "Offers answered by agents, or withdrawn unanswered, by cluster and result",
            ["cluster", "result"],
            registry=r,
        )
        self.cluster_sessions = Counter(
            "gpufed_cluster_sessions",
            "Sessions this broker welcomed from the cluster's agent (a reconnect or an agent"
            " restart adds one)",
            ["cluster"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "gpufed_event_loop_lag_seconds",
            "How late the broker's event loop ran a timer (a blocked loop delays everything)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        self.gc_pauses = Histogram(
            "gpufed_gc_pause_seconds",
            "How long each pass of the garbage collector held the broker, by generation",
            ["generation"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
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
        self.summary_duration = Histogram(
            "gpufed_agent_summary_duration_seconds",
            "Applying one agent's summary to the broker's view of its cluster",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.submit_to_dispatch = Histogram(
            "gpufed_job_submit_to_dispatch_seconds",
            "Submit to first offer",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.submit_to_running = Histogram(
            "gpufed_job_submit_to_running_seconds",
            "Submit to Running",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.pending_jobs = Gauge(
            "gpufed_pending_jobs", "Jobs waiting in a queue", ["queue"], registry=r
        )
        self.waiting_jobs = Gauge(
            "gpufed_waiting_jobs",
            "Jobs Waiting for their dependencies (spec.dependsOn), not yet queued",
            registry=r,
        )
        self.parked_jobs = Gauge(
            "gpufed_parked_jobs",
            "Queued jobs that fit nowhere, set aside until something that could admit them"
            " changes (not planned each cycle)",
            registry=r,
        )
        self.pending_oldest_age = Gauge(
            "gpufed_pending_oldest_age_seconds",
            "How long the queue's oldest waiting job has been Queued (since it last entered)",
            ["queue"],
            registry=r,
        )
        self.cluster_gpus = Gauge(
            "gpufed_cluster_gpus",
            "GPUs per cluster and model by state: free (whole GPUs new work can have),"
            " shared_free (the free share of GPUs pods share), allocated (held, a shared GPU by"
            " its pods' share), unavailable (not usable: nodes down or cordoned, GPUs unhealthy,"
            " and every free GPU of a cluster whose session is not Ready)",
            ["cluster", "model", "state"],
            registry=r,
        )
        self.agent_connected = Gauge(
            "gpufed_agent_session_connected",
            "1 when the cluster's agent is connected",
            ["cluster"],
            registry=r,
        )
        self.agent_session_state = Gauge(
            "gpufed_agent_session_state",
            "The broker's view of each cluster's agent session: 1 for its current state",
            ["cluster", "state"],
            registry=r,
        )
        self.offer_window = Gauge(
            "gpufed_agent_offer_window",
            "How many offers may be out unanswered to the cluster's agent now (halved when"
            " offers time out, grown back as they are answered; --max-offers-in-flight at most)",
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
        self.store_quarantined = Gauge(
            "gpufed_store_quarantined_records",
            "Stored records set aside because they do not parse, by kind (jobs, queues);"
            " list them with `gpufed broker quarantine`",
            ["kind"],
            registry=r,
        )
        self._add_queue_metrics(r)
        self._add_fault_metrics(r)
        self._add_replica_metrics(r)

    def _add_replica_metrics(self, r: CollectorRegistry) -> None:
        """Several replicas on one store: who leads, in which term, and is the cache synced."""
        self.leader = Gauge(
            "gpufed_broker_leader", "1 while this broker replica is the leader", registry=r
        )
        self.term = Gauge(
            "gpufed_broker_term",
            "The leader's term as this replica knows it (grows with each new leader)",
            registry=r,
        )
        self.cache_synced = Gauge(
            "gpufed_broker_cache_synced",
            "1 while this replica's job cache has caught up with the store",
            registry=r,
        )

    def clear_leader_gauges(self) -> None:
        """This replica stopped leading: the gauges only the leader exports are dropped, so
        a sum over replicas never counts a former leader's last values."""
        for gauge in (
            self.pending_jobs,
            self.pending_oldest_age,
            self.cluster_gpus,
            self.agent_connected,
            self.agent_session_state,
            self.cluster_fragmentation,
            self.offer_window,
            self.queue_gpus_in_use,
            self.queue_gpus_guaranteed,
            self.queue_gpus_fair_share,
            self.queue_dominant_share,
        ):
            gauge.clear()
        self.reservations.set(0)
        self.parked_jobs.set(0)
        self._cluster_models.clear()

    def _add_fault_metrics(self, r: CollectorRegistry) -> None:
        """Failures kept local: what was refused or set aside, and what went on regardless."""
        self.agent_messages_refused = Counter(
            "gpufed_agent_messages_refused",
            "Agent messages refused as malformed or inconsistent (the session is closed)",
            ["cluster", "type"],
            registry=r,
        )
        self.agent_messages_failed = Counter(
            "gpufed_agent_messages_failed",
            "Agent messages whose handling raised (logged; the session goes on)",
            ["cluster", "type"],
            registry=r,
        )
        self.set_aside = Counter(
            "gpufed_planning_set_aside",
            "Jobs or clusters a scheduling cycle set aside because planning them raised",
            ["kind"],
            registry=r,
        )
        self.store_up = Gauge(
            "gpufed_store_up", "1 while the broker's store answers its probe", registry=r
        )
        self.store_alarm = Gauge(
            "gpufed_store_alarm",
            "1 while the store has this alarm raised (etcd NOSPACE: writes refused)",
            ["alarm"],
            registry=r,
        )
        for alarm in STORE_ALARMS:
            self.store_alarm.labels(alarm=alarm).set(0)
        self.background_errors = Counter(
            "gpufed_background_errors",
            "Errors a background task survived (retried with backoff)",
            ["task"],
            registry=r,
        )

    def _add_queue_metrics(self, r: CollectorRegistry) -> None:
        """Tenancy: per queue (and GPU model) usage against guarantee and fair share."""
        self.scheduling_cycles = Counter(
            "gpufed_scheduling_cycles", "Scheduling cycles run", registry=r
        )
        self.preemptions = Counter(
            "gpufed_preemptions",
            "Jobs preempted, by the victim's queue and why (Reclaim, Priority)",
            ["queue", "reason"],
            registry=r,
        )
        self.queue_gpus_in_use = Gauge(
            "gpufed_queue_gpus_in_use",
            "GPUs held by the queue's Dispatched and Running jobs",
            ["queue", "model"],
            registry=r,
        )
        self.queue_gpus_guaranteed = Gauge(
            "gpufed_queue_gpus_guaranteed",
            "GPUs guaranteed to the queue",
            ["queue", "model"],
            registry=r,
        )
        self.queue_gpus_fair_share = Gauge(
            "gpufed_queue_gpus_fair_share",
            "GPUs the queue's weight entitles it to among the active queues of its cohort",
            ["queue", "model"],
            registry=r,
        )
        self.queue_dominant_share = Gauge(
            "gpufed_queue_dominant_share_ratio",
            "The queue's weighted dominant share of its cohort, divided by its weight",
            ["queue"],
            registry=r,
        )
        self.reservations = Gauge(
            "gpufed_reservations", "Jobs holding a reservation against starvation", registry=r
        )

    def set_quarantined(self, counts: Mapping[str, int]) -> None:
        """Export the records in the store's quarantine per kind (jobs and queues always)."""
        for kind in sorted({"jobs", "queues", *counts}):
            self.store_quarantined.labels(kind=kind).set(counts.get(kind, 0))

    def declare_queues(self) -> None:
        """The declared queues' series of the counters and the pending gauges, at 0 until
        they move (once per configuration)."""
        declared = self.queue_label.declared()
        if declared == self._queues_declared:
            return
        for queue in declared - self._queues_declared:
            self._declare_queue(queue)
        self._queues_declared = declared

    def _declare_queue(self, queue: str) -> None:
        self._queue_series.add(queue)
        self.jobs_submitted.labels(queue=queue)
        for state in FINISHED_STATES:
            self.jobs_finished.labels(queue=queue, state=state)
        for reason in PREEMPTION_REASONS:
            self.preemptions.labels(queue=queue, reason=reason)

    def count_submitted(self, queue: str) -> None:
        """A job of the queue labelled `queue` was accepted. An undeclared queue's series
        of the counters start at 0 here, so its first finished or preempted job counts."""
        if queue not in self._queue_series:
            self._declare_queue(queue)
        self.jobs_submitted.labels(queue=queue).inc()

    def welcome_session(self, cluster: str) -> None:
        """A session of `cluster`'s agent was welcomed: counted, and the cluster's placement
        results exported at 0 from its first session on."""
        for result in PLACEMENT_RESULTS:
            self.placements.labels(cluster=cluster, result=result)
        self.cluster_sessions.labels(cluster=cluster).inc()

    def set_pending(self, counts: Mapping[str, int], ages: Mapping[str, float]) -> None:
        """Jobs Queued per queue label and how long the oldest has waited; a declared queue,
        or one exported before, with none reads 0 (its line goes to 0, it does not stop)."""
        known = self._pending_labels | self.queue_label.declared() | set(counts)
        self._pending_labels = known
        for label in known:
            self.pending_jobs.labels(queue=label).set(counts.get(label, 0))
            self.pending_oldest_age.labels(queue=label).set(ages.get(label, 0.0))

    def set_session_state(self, cluster: str, state: str) -> None:
        """Export `state` as the cluster's session state (1) and every other state as 0."""
        for known in SESSION_STATES:
            self.agent_session_state.labels(cluster=cluster, state=known).set(
                1 if known == state else 0
            )

    def set_cluster(
        self,
        cluster: str,
        *,
        health: str,
        models: Mapping[str, ModelGPUs] | None = None,
        fragmentation: float = 0.0,
    ) -> None:
        """Export the cluster's session state (one-hot), GPUs and stranded GPUs. `models`
        from its last summary (None: the ones exported last, e.g. while it reconnects).

        GPUs count as free only while the session is Ready: in every other state the broker
        offers the cluster nothing, so its free GPUs (whole or shared) are unavailable. Once
        Lost, its jobs were requeued elsewhere: all its GPUs are unavailable. Stranded GPUs
        are free GPUs too: 0 unless Ready."""
        self.set_session_state(cluster, health)
        if models is not None:
            self._cluster_models[cluster] = dict(models)
        ready = health == "Ready"
        for model, gpus in self._cluster_models.get(cluster, {}).items():
            if health == "Lost":
                values = (0.0, 0.0, 0.0, float(gpus.total))
            elif ready:
                values = (gpus.free, gpus.shared_free, gpus.allocated, gpus.unavailable)
            else:
                offered = gpus.free + gpus.shared_free
                values = (0.0, 0.0, gpus.allocated, gpus.unavailable + offered)
            for state, value in zip(GPU_STATES, values, strict=True):
                self.cluster_gpus.labels(cluster=cluster, model=model, state=state).set(value)
        self.cluster_fragmentation.labels(cluster=cluster).set(fragmentation if ready else 0.0)


def model_gpus(summary: inventory.ModelSummary, *, total: int) -> ModelGPUs:
    """A model's GPUs from a summary; `total` as the planner reads it (`total_gpus_of`)."""
    return ModelGPUs(
        total=total,
        free=summary.free_gpus,
        shared_free=summary.shared_free_milli / 1000,
        unavailable=summary.unavailable_gpus,
    )
