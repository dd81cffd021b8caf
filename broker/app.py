"""Wiring only: the broker's aiohttp application from its settings."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler
from pydantic import BaseModel, ConfigDict

from broker.dispatch import connecting, lifecycle
from broker.dispatch import fleet as fleet_
from broker.http import auth, clusters, jobs, openapi, problems
from broker.http import queues as queues_http
from broker.scheduler import cycle, registry
from broker.state import opening, records
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
    freeze_gc: bool = False  # the service sets it; tests running many apps in one process don't
    queues_file: Path | None = None  # config/queues.yaml; none: every queue is open
    cycle_interval_seconds: float = 0.005  # at most one scheduling cycle per interval


def create_app(settings: BrokerSettings) -> web.Application:
    app = web.Application(client_max_size=jobs.MAX_BODY, middlewares=[problems.problems_middleware])
    app[auth.AUTHENTICATOR] = auth.Authenticator.from_file(settings.tokens_file)
    queues = registry.QueueRegistry.from_file(settings.queues_file)
    app[jobs.QUEUES] = queues
    meters = metrics.BrokerMetrics()
    app[clusters.READY] = {"store": False, "scheduler": False}
    jobs.add_routes(app)
    clusters.add_routes(app)
    openapi.add_routes(app)
    queues_http.add_routes(app)
    app.router.add_get("/metrics", make_aiohttp_handler(registry=meters.registry))

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        backing = await opening.open_store(settings.store)
        job_records = records.JobRecords(
            backing, observe=lambda op, seconds: meters.store_latency.labels(op=op).observe(seconds)
        )
        await job_records.load()
        # what is loaded now lives as long as the broker: keep it out of the collector's
        # full passes, which otherwise stall scheduling cycles for milliseconds
        if settings.freeze_gc:
            gc.collect()
            gc.freeze()
        await queues.load(backing)
        app[clusters.READY]["store"] = True
        fleet = fleet_.Fleet(stale_after=3 * settings.heartbeat_seconds)
        life = lifecycle.Lifecycle(
            job_records,
            fleet,
            meters=meters,
            cancel_grace_seconds=settings.cancel_grace_seconds,
        )
        sessions = connecting.Sessions(
            life,
            fleet,
            meters=meters,
            heartbeat_seconds=settings.heartbeat_seconds,
            lost_after_seconds=settings.lost_after_seconds,
        )
        app[jobs.LIFECYCLE] = life
        app[clusters.FLEET] = fleet
        app[clusters.SESSIONS] = sessions
        scheduler = cycle.Scheduler(
            life,
            fleet,
            meters=meters,
            queues=queues,
            min_interval=settings.cycle_interval_seconds,
        )
        tasks = [
            asyncio.create_task(scheduler.run(), name="scheduler"),
            asyncio.create_task(sessions.watch(), name="sessions-watchdog"),
            asyncio.create_task(life.run_flusher(), name="group-commit"),
            asyncio.create_task(queues.follow(backing), name="queues-watch"),
        ]
        app[clusters.READY]["scheduler"] = True
        logger.info("broker ready: %d jobs loaded from %s", len(job_records), settings.store)
        yield
        for task in tasks:
            await cycle.stop_task(task)
        async with life.lock:
            await job_records.flush()
        await backing.close()

    app.cleanup_ctx.append(lifespan)
    return app
