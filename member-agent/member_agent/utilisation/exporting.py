"""The agent's GPU allocation and utilisation per queue, as `/metrics` families.

`telemetry.AgentCollector` yields `collect(...)` at every scrape: the job table's live pods
joined (`readings.join`) to the readings the `scraping.DCGMScraper` holds now, so allocation is
as of the scrape and utilisation as of the last dcgm-exporter page. In GPUs, a shared GPU
counted by its share:

- `gpufed_agent_queue_gpus_allocated{cluster,queue}`: held by the queue's live pods (always
  exported, `--dcgm-url` or not);
- `gpufed_agent_queue_gpus_measured`: of those, the GPUs with a reading;
- `gpufed_agent_queue_gpus_utilised`: the sum of their utilisation (two GPUs 50% busy: 1.0),
  so `utilised / measured` is the queue's GPU utilisation;
- `gpufed_agent_queue_gpus_idle`: measured GPUs under 5% busy (the alert
  `GpufedGPUsAllocatedIdle` fires on them after 30 minutes);
- `gpufed_agent_queue_gpu_memory_used_bytes`, `gpufed_agent_queue_gpu_memory_bytes`: their
  framebuffer used, and used + free;
- `gpufed_agent_dcgm_up{cluster}` (1 while every URL gives a dcgm-exporter page),
  `gpufed_agent_dcgm_scrape_failures_total{cluster}`, `gpufed_agent_dcgm_gpus{cluster}`
  (GPUs the last pages showed, gpufed's or not).

The broker gets none of this: it decides nothing on utilisation, and Prometheus scrapes every
agent (their series carry `cluster`), so the fleet dashboard and the alerts read them there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from member_agent.jobs import table
from member_agent.utilisation import readings, scraping

_PER_QUEUE = (
    ("measured", "gpufed_agent_queue_gpus_measured", "GPUs held with a DCGM reading"),
    (
        "busy",
        "gpufed_agent_queue_gpus_utilised",
        "Sum of the utilisation of the GPUs held (1: one GPU fully busy), from DCGM",
    ),
    ("idle", "gpufed_agent_queue_gpus_idle", "GPUs held under 5% busy, from DCGM"),
    (
        "memory_used_bytes",
        "gpufed_agent_queue_gpu_memory_used_bytes",
        "Framebuffer used on the GPUs held, from DCGM",
    ),
    (
        "memory_bytes",
        "gpufed_agent_queue_gpu_memory_bytes",
        "Framebuffer (used + free) of the GPUs held whose memory DCGM reported",
    ),
)


# queues remembered to export at 0 once they hold nothing (their lines go to 0, not stop)
KNOWN_QUEUES_LIMIT = 100


def collect(
    cluster: str,
    jobs: Iterable[table.TrackedJob],
    scraper: scraping.DCGMScraper | None,
    *,
    known: set[str] | None = None,
) -> Iterator[Metric]:
    """The families above; without a scraper, allocation only. `known`: the queues exported
    before (kept up to date here, up to `KNOWN_QUEUES_LIMIT`), at 0 when they hold nothing."""
    labels = ["cluster", "queue"]
    holdings = readings.holdings_of(jobs)
    uses = readings.join(scraper.gpus() if scraper is not None else (), holdings)
    if known is not None:
        for queue in uses:
            if len(known) < KNOWN_QUEUES_LIMIT:
                known.add(queue)
        uses = {**{queue: readings.QueueUse() for queue in known}, **uses}
    allocated = GaugeMetricFamily(
        "gpufed_agent_queue_gpus_allocated",
        "GPUs held by the queue's live pods (a shared GPU counts its share)",
        labels=labels,
    )
    for queue, use in sorted(uses.items()):
        allocated.add_metric([cluster, queue], use.allocated)
    yield allocated
    if scraper is None:
        return
    for attribute, name, documentation in _PER_QUEUE:
        family = GaugeMetricFamily(name, documentation, labels=labels)
        for queue, use in sorted(uses.items()):
            family.add_metric([cluster, queue], getattr(use, attribute))
        yield family
    up = GaugeMetricFamily(
        "gpufed_agent_dcgm_up",
        "1 while every --dcgm-url answered its last fetch with a dcgm-exporter page",
        labels=["cluster"],
    )
    up.add_metric([cluster], 1.0 if scraper.up else 0.0)
    yield up
    failures = CounterMetricFamily(
        "gpufed_agent_dcgm_scrape_failures",
        "Fetches of a --dcgm-url that gave no dcgm-exporter page",
        labels=["cluster"],
    )
    failures.add_metric([cluster], scraper.failures)
    yield failures
    gpus = GaugeMetricFamily(
        "gpufed_agent_dcgm_gpus",
        "GPUs the last dcgm-exporter pages showed (gpufed's pods' or not)",
        labels=["cluster"],
    )
    gpus.add_metric([cluster], len({(r.hostname, r.index) for r in scraper.gpus()}))
    yield gpus
