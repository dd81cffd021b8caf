"""Wiring only: the broker's aiohttp application from its settings."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler
from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.api import leases
from broker.api.queues import QueueMode
from broker.dispatch import connecting, leading
from broker.http import auth, clusters, jobs, keys, openapi, problems, queues
from broker.jobs import fleet, scheduling, service, watching
from broker.state import electing, opening, probing, quarantine, records, registry, store
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
    # several replicas on etcd: the URL other replicas send agents to (default http://host:port)
    advertise_url: str | None = None
    # the leader's lease: a leader killed with -9 is replaced within it (plus one cycle)
    leader_lease_seconds: int = Field(electing.DEFAULT_TTL, ge=1, le=300)
    replica_id: str | None = None  # default <hostname>:<port>; unique among the replicas

    @property
    def advertised(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"

    @property
    def replica(self) -> str:
        return self.replica_id or f"{socket.gethostname()}:{self.port}"

    @model_validator(mode="after")
    def _grace(self) -> BrokerSettings:
        # agents fence themselves before the grace ends: it must leave them room (api.leases)
        problem = leases.check_lost_after(self.lost_after_seconds, heartbeat=self.heartbeat_seconds)
        if problem is not None:
            raise ValueError(problem)
        return self


def create_app(settings: BrokerSettings) -> web.Application:
    app = web.Application(client_max_size=jobs.MAX_BODY, middlewares=[problems.problems_middleware])
    app[auth.AUTHENTICATOR] = auth.Authenticator.from_file(settings.tokens_file)
    queue_registry = registry.QueueRegistry.from_file(
        settings.queues_file, mode=settings.queue_mode
    )
    app[keys.QUEUES] = queue_registry
    meters = metrics.BrokerMetrics()
    app[keys.READY] = {"store": False, "synced": False, "scheduler": False}
    handing_over: list[Callable[[], Awaitable[None]]] = []  # set once started

    async def on_shutdown(app: web.Application) -> None:
        for hand_over in handing_over:
            await hand_over()

    app.on_shutdown.append(on_shutdown)
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
        leadership = _leadership(settings, backing, meters)
        book = service.Jobs(
            job_store,
            clusters_view,
            meters=meters,
            idempotency_window=settings.idempotency_window_seconds,
            leadership=leadership,
        )
        loaded_at = await book.load()
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
            leadership=leadership,
        )
        app[keys.JOBS] = book
        app[keys.FLEET] = clusters_view
        app[keys.SESSIONS] = sessions
        app[keys.LEADERSHIP] = leadership

        def make_scheduler() -> scheduling.Scheduler:  # one per term
            return scheduling.Scheduler(
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

        def synced(up: bool) -> None:
            app[keys.READY]["synced"] = up
            meters.cache_synced.set(1 if up else 0)

        watch = None
        if leadership.replicated:  # other replicas write the store too: follow it
            watch = watching.BookWatch(
                book.book,
                backing,
                replica=leadership.replica,
                on_error=meters.background_errors.labels(task=watching.TASK).inc,
                on_synced=synced,
            )
        work = leading.LeaderWork(
            leadership,
            jobs=book,
            sessions=sessions,
            backing=backing,
            meters=meters,
            make_scheduler=make_scheduler,
            watch=watch,
        )
        app[keys.LEADER_WORK] = work
        meters.store_up.set(1)
        tasks = [
            asyncio.create_task(probing.probe_store(backing, store_answers), name="store-probe"),
            asyncio.create_task(book.run_flusher(), name="group-commit"),
            asyncio.create_task(queue_registry.follow(backing), name="queues-watch"),
        ]
        if watch is not None:
            tasks += [
                asyncio.create_task(watch.run(loaded_at + 1), name=watching.TASK),
                asyncio.create_task(watch.check(), name="jobs-sync"),
                asyncio.create_task(leadership.run(), name="election"),
                asyncio.create_task(work.follow_views(), name="cluster-views-follow"),
            ]
        else:
            synced(True)  # the one replica: its book is the store's
        leader_task = asyncio.create_task(work.run(), name="leader-work")
        if not leadership.replicated:
            await asyncio.wait_for(work.activated.wait(), 10.0)
        handed: list[bool] = []

        async def hand_over() -> None:
            """Stop deciding, commit what waits (still within the term), close the agent
            sessions, and give the lease up: a follower leads within a round trip."""
            if handed:
                return
            handed.append(True)
            await work.close(leader_task)
            await book.close()
            await sessions.close_all(reason="the broker is shutting down")
            await leadership.resign()

        handing_over.append(hand_over)
        app[keys.READY]["scheduler"] = True
        logger.info(
            "broker ready: %d jobs loaded from %s, replica %s (%s)",
            len(book),
            settings.store,
            leadership.replica,
            settings.advertised,
        )
        yield
        await hand_over()
        for task in tasks:
            await scheduling.stop_task(task)
        await backing.close()

    app.cleanup_ctx.append(lifespan)
    return app


def _leadership(
    settings: BrokerSettings, backing: store.DurableStore, meters: metrics.BrokerMetrics
) -> electing.Leadership:
    """An election on etcd (several replicas may share it); SQLite has one replica: it leads."""
    leadership: electing.Leadership
    if settings.store.startswith(opening.ETCD_SCHEME):
        leadership = electing.Election(
            backing,
            replica=settings.replica,
            url=settings.advertised,
            ttl=settings.leader_lease_seconds,
            on_error=meters.background_errors.labels(task="election").inc,
        )
    else:
        leadership = electing.Sole(settings.replica, settings.advertised)

    def changed() -> None:
        meters.leader.set(1 if leadership.is_leader else 0)
        meters.term.set(leadership.term)

    leadership.on_change(changed)
    changed()
    return leadership
