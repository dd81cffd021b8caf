"""Wiring only: the broker's aiohttp application from its settings."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler
from pydantic import BaseModel, ConfigDict, Field

from broker.api.queues import QueueMode
from broker.dispatch import connecting
from broker.http import auth, clusters, jobs, keys, openapi, problems, queues
from broker.jobs import fleet, scheduling, service
from broker.state import opening, probing, quarantine, records, registry
from broker.telemetry import metrics

logger = logging.getLogger(__name__)


class BrokerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    store: str = "sqlite:///.gpufed/broker.db"
    tokens_file: Path = Path("config/tokens.yaml")
    host: str = "127.0.0.1"
    port: int = 8080
    heartbeat_seconds: float = 5.0
    lost_after_seconds: float = 60.0
    cancel_grace_seconds: float = 30.0
    # an offer neither accepted nor rejected this long is withdrawn and the job queued again
    offer_timeout_seconds: float = Field(30.0, gt=0)
    freeze_gc: bool = False  # the service sets it; tests running many apps in one process don't
    queues_file: Path | None = None  # config/queues.yaml; none: every queue is open
    # open: any queue name takes jobs; declared: only declared queues (default with a file)
    queue_mode: QueueMode | None = None
    # how long an Idempotency-Key replays its job (24 h); after it the key makes a new job
    idempotency_window_seconds: float = Field(records.IDEMPOTENCY_WINDOW_SECONDS, gt=0)
    cycle_interval_seconds: float = 0.005  # at most one scheduling cycle per interval
    # the store's request limit (etcd's --max-request-bytes): commits stay under it
    max_request_bytes: int = 1536 * 1024


def create_app(settings: BrokerSettings) -> web.Application:
    app = web.Application(client_max_size=jobs.MAX_BODY, middlewares=[problems.problems_middleware])
    app[auth.AUTHENTICATOR] = auth.Authenticator.from_file(settings.tokens_file)
    queue_registry = registry.QueueRegistry.from_file(
        settings.queues_file, mode=settings.queue_mode
    )
    app[keys.QUEUES] = queue_registry
    meters = metrics.BrokerMetrics()
    app[keys.READY] = {"store": False, "scheduler": False}
    jobs.add_routes(app)
    clusters.add_routes(app)
    openapi.add_routes(app)
    queues.add_routes(app)
    app.router.add_get("/metrics", make_aiohttp_handler(registry=meters.registry))

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        backing = await opening.open_store(settings.store)
        job_store = records.JobStore(
            backing,
            observe=lambda op, seconds: meters.store_latency.labels(op=op).observe(seconds),
            max_request_bytes=settings.max_request_bytes,
        )
        clusters_view = fleet.Fleet(
            stale_after=3 * settings.heartbeat_seconds,
            cancel_grace_seconds=settings.cancel_grace_seconds,
            offer_timeout_seconds=settings.offer_timeout_seconds,
        )
        book = service.Jobs(
            job_store,
            clusters_view,
            meters=meters,
            idempotency_window=settings.idempotency_window_seconds,
        )
        await book.load()
        # what is loaded now lives as long as the broker: keep it out of the collector's
        # full passes, which otherwise stall scheduling cycles for milliseconds
        if settings.freeze_gc:
            gc.collect()
            gc.freeze()
        await queue_registry.load(backing)
        meters.set_quarantined(await quarantine.report(backing))
        queue_registry.report_undeclared(book.unfinished_queues())
        app[keys.READY]["store"] = True
        sessions = connecting.Sessions(
            book.reports,
            clusters_view,
            job_store=job_store,
            meters=meters,
            heartbeat_seconds=settings.heartbeat_seconds,
            lost_after_seconds=settings.lost_after_seconds,
        )
        app[keys.JOBS] = book
        app[keys.FLEET] = clusters_view
        app[keys.SESSIONS] = sessions
        scheduler = scheduling.Scheduler(
            book.book,
            clusters_view,
            dispatcher=book.dispatcher,
            accounts=book.accounts,
            victims=book.victims,
            meters=meters,
            queues=queue_registry,
            min_interval=settings.cycle_interval_seconds,
        )

        def store_answers(up: bool) -> None:
            app[keys.READY]["store"] = up
            meters.store_up.set(1 if up else 0)

        meters.store_up.set(1)
        tasks = [
            asyncio.create_task(probing.probe_store(backing, store_answers), name="store-probe"),
            asyncio.create_task(scheduler.run(), name="scheduler"),
            asyncio.create_task(sessions.watch(), name="sessions-watchdog"),
            asyncio.create_task(book.run_flusher(), name="group-commit"),
            asyncio.create_task(book.run_key_sweeper(), name="idempotency-sweep"),
            asyncio.create_task(queue_registry.follow(backing), name="queues-watch"),
        ]
        app[keys.READY]["scheduler"] = True
        logger.info("broker ready: %d jobs loaded from %s", len(book), settings.store)
        yield
        for task in tasks:
            await scheduling.stop_task(task)
        await book.close()
        await backing.close()

    app.cleanup_ctx.append(lifespan)
    return app
