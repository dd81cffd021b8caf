"""The agent's `/metrics` and `/healthz`: a few numbers read from its parts at scrape time.

`gpufed_agent_session_connected`, `gpufed_agent_sessions_total` (this process's sessions: a
restart starts it again, so the broker's `gpufed_cluster_sessions_total` is the one to alert on),
`gpufed_agent_offers_total{result}`, `gpufed_agent_pods{phase}`, `gpufed_agent_jobs{state}`,
`gpufed_agent_summaries_total`, `gpufed_agent_final_reports_unacknowledged`,
`gpufed_agent_final_reports_resent_total`, `gpufed_agent_fenced` (1 while the cluster lease has
lapsed), `gpufed_agent_lease_remaining_seconds`, `gpufed_agent_fences_total`,
`gpufed_agent_fenced_jobs_total`, `gpufed_agent_placement_duration_seconds` (the
handler's histogram), and the GPUs each queue holds with, given `--dcgm-url`, how busy they
are (`utilisation.exporting`). A collector of its own reads them from the handler, the
connector, the reporter and the DCGM scraper, so nothing has to remember to update a gauge.
Every family carries the `cluster` label. GPU health, from the backend's `gpuhealth.HealthBook`:
`gpufed_agent_gpus_unhealthy{node}`, `gpufed_agent_gpu_failures_total`,
`gpufed_agent_gpu_failed_pods_total`, `gpufed_agent_node_cordons_total`,
`gpufed_agent_nodes_cordoned`, `gpufed_agent_node_events_total{result}` (the Kubernetes
backend's Events about them, `written` or `failed`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client import aiohttp as prometheus_aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.api import status
from member_agent.cluster import gpuhealth
from member_agent.jobs import handling
from member_agent.session import connecting, reporting
from member_agent.utilisation import exporting, scraping

logger = logging.getLogger(__name__)

# Label values exported at 0 until they happen: a counter born at 1 hides its first event
# from increase() and rate(), and a gauge that vanishes leaves a line hanging at its last value.
# Every result `handling.JobHandler` counts an offer under.
OFFER_RESULTS = (
    "accepted",
    "binding_failed",
    "fenced",
    "image",
    "invalid",
    "limit",
    "resent",
    "stale",
    "unplaceable",
)
POD_PHASES = tuple(p.value for p in status.PodPhase)
# an agent holds a job from its offer on: never Waiting or Queued
JOB_STATES = tuple(
    s.value for s in status.JobState if s not in (status.JobState.WAITING, status.JobState.QUEUED)
)


def with_zeros(counts: Mapping[str, int], known: Iterable[str]) -> dict[str, int]:
    """`counts` with every `known` key it lacks at 0."""
    return {**dict.fromkeys(known, 0), **counts}


class AgentCollector(Collector):
    def __init__(
        self,
        *,
        cluster: str,
        handler: handling.JobHandler,
        connector: connecting.Connector,
        reporter: reporting.SummaryReporter,
        dcgm: scraping.DCGMScraper | None = None,
    ) -> None:
        self.cluster = cluster
        self.handler = handler
        self.connector = connector
        self.reporter = reporter
        self.dcgm = dcgm
        self._queues: set[str] = set()  # every queue exported so far (`exporting.collect`)

    def collect(self) -> Iterator[Metric]:
        labels = ["cluster"]
        connected = GaugeMetricFamily(
            "gpufed_agent_session_connected",
            "1 while a session with the broker is open",
            labels=labels,
        )
        connected.add_metric([self.cluster], 1.0 if self.connector.router.connected else 0.0)
        yield connected
        sessions = CounterMetricFamily(
            "gpufed_agent_sessions", "Sessions the broker welcomed", labels=labels
        )
        sessions.add_metric([self.cluster], self.connector.sessions)
        yield sessions
        offers = CounterMetricFamily(
            "gpufed_agent_offers", "Offers handled, by result", labels=["cluster", "result"]
        )
        for result, count in sorted(with_zeros(self.handler.offers, OFFER_RESULTS).items()):
            offers.add_metric([self.cluster, result], count)
        yield offers
        pods = GaugeMetricFamily(
            "gpufed_agent_pods",
            "Pods of the jobs the agent holds, by phase",
            labels=["cluster", "phase"],
        )
        phases = with_zeros(self.handler.pods_by_phase(), POD_PHASES)
        for phase, count in sorted(phases.items()):
            pods.add_metric([self.cluster, phase], count)
        yield pods
        jobs = GaugeMetricFamily(
            "gpufed_agent_jobs", "Jobs the agent holds, by state", labels=["cluster", "state"]
        )
        states = with_zeros(Counter(r.state.value for r in self.handler.table), JOB_STATES)
        for state, count in sorted(states.items()):
            jobs.add_metric([self.cluster, state], count)
        yield jobs
        summaries = CounterMetricFamily(
            "gpufed_agent_summaries", "Inventory summaries sent", labels=labels
        )
        summaries.add_metric([self.cluster], self.reporter.sent)
        yield summaries
        unacknowledged = GaugeMetricFamily(
            "gpufed_agent_final_reports_unacknowledged",
            "Final job reports kept until the broker acknowledges them",
            labels=labels,
        )
        unacknowledged.add_metric([self.cluster], len(self.handler.updates.pending))
        yield unacknowledged
        resent = CounterMetricFamily(
            "gpufed_agent_final_reports_resent",
            "Final job reports sent again, unanswered on a live session",
            labels=labels,
        )
        resent.add_metric([self.cluster], self.handler.updates.resent)
        yield resent
        yield from self._lease(labels)
        yield from _gpu_health(self.cluster, self.handler.backend.gpu_health())
        for family in self.handler.placement_duration.collect():
            yield label_cluster(family, self.cluster)
        yield from exporting.collect(
            self.cluster, self.handler.table, self.dcgm, known=self._queues
        )

    def _lease(self, labels: list[str]) -> Iterator[Metric]:
        lease = self.connector.lease
        fenced = GaugeMetricFamily(
            "gpufed_agent_fenced",
            "1 while the cluster lease has lapsed: no new pods, requeue jobs' pods deleted",
            labels=labels,
        )
        fenced.add_metric([self.cluster], 1.0 if self.handler.is_fenced() else 0.0)
        yield fenced
        remaining = GaugeMetricFamily(
            "gpufed_agent_lease_remaining_seconds",
            "Seconds until the agent fences itself unless the broker is heard",
            labels=labels,
        )
        remaining.add_metric([self.cluster], max(0.0, lease.remaining()))
        yield remaining
        fences = CounterMetricFamily(
            "gpufed_agent_fences", "Times the cluster lease lapsed", labels=labels
        )
        fences.add_metric([self.cluster], lease.lapses)
        yield fences
        stopped = CounterMetricFamily(
            "gpufed_agent_fenced_jobs", "Jobs a fence stopped (clusterLost: requeue)", labels=labels
        )
        stopped.add_metric([self.cluster], self.handler.fenced_jobs)
        yield stopped


def _gpu_health(cluster: str, book: gpuhealth.HealthBook) -> Iterator[Metric]:
    """`gpufed_agent_gpus_unhealthy{node}` (nodes with any), `gpufed_agent_gpu_failures_total`,
    `gpufed_agent_gpu_failed_pods_total`, `gpufed_agent_node_cordons_total`,
    `gpufed_agent_nodes_cordoned`, `gpufed_agent_node_events_total{result}`."""
    unhealthy = GaugeMetricFamily(
        "gpufed_agent_gpus_unhealthy",
        "GPUs out of service (unhealthy), by node: out of the inventory, counted unavailable",
        labels=["cluster", "node"],
    )
    for node, count in book.unhealthy_gpus().items():
        unhealthy.add_metric([cluster, node], count)
    yield unhealthy
    for name, doc, value in (
        (
            "gpufed_agent_gpu_failures",
            "GPUs seen turning unhealthy while the agent ran (not those unhealthy at its start)",
            book.gpu_failures,
        ),
        (
            "gpufed_agent_gpu_failed_pods",
            "Pods of gpufed's failed GPUFailed (their gangs with them)",
            book.failed_pods,
        ),
        (
            "gpufed_agent_node_cordons",
            "Nodes the agent cordoned after repeated GPU failures (--auto-cordon)",
            book.cordons,
        ),
    ):
        counter = CounterMetricFamily(name, doc, labels=["cluster"])
        counter.add_metric([cluster], value)
        yield counter
    cordoned = GaugeMetricFamily(
        "gpufed_agent_nodes_cordoned",
        "Nodes the agent has cordoned for GPU failures since it started",
        labels=["cluster"],
    )
    cordoned.add_metric([cluster], len(book.cordoned))
    yield cordoned
    events = CounterMetricFamily(
        "gpufed_agent_node_events",
        "Events about GPU failures and cordons the agent wrote on Nodes, or failed to write",
        labels=["cluster", "result"],
    )
    events.add_metric([cluster, "written"], book.events_written)
    events.add_metric([cluster, "failed"], book.events_failed)
    yield events


def label_cluster(family: Metric, cluster: str) -> Metric:
    """A copy of `family` whose samples all carry `cluster`."""
    labelled = Metric(family.name, family.documentation, family.type, family.unit)
    labelled.samples = [
        sample._replace(labels={"cluster": cluster, **sample.labels}) for sample in family.samples
    ]
    return labelled


async def start_server(collector: AgentCollector, *, host: str, port: int) -> web.AppRunner:
    """Serve `/metrics` and `/healthz` on host:port until the runner is cleaned up."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)

    async def healthz(request: web.Request) -> web.Response:
        del request
        return web.json_response(
            {"status": "ok", "connected": collector.connector.router.connected}
        )

    app = web.Application()
    app.router.add_get("/metrics", prometheus_aiohttp.make_aiohttp_handler(registry=registry))
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    logger.info("metrics on http://%s:%d/metrics", host, port)
    return runner
