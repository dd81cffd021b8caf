"""Wiring only: the broker's aiohttp application from its settings."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from broker.api import leases, submits
from broker.api.queues import QueueMode
from broker.dispatch import connecting, leading
from broker.http import (
    arrays,
    audit,
    auth,
    clusters,
    console,
    events,
    forwarding,
    gpumap,
    headers,
    jobs,
    keys,
    limits,
    listing,
    oidc,
    openapi,
    peers,
    problems,
    queues,
    tls,
)
from broker.jobs import fleet, scheduling, service, watching
from broker.planning.backlog import budget
from broker.state import (
    electing,
    etcd,
    etcd_credentials,
    opening,
    probing,
    quarantine,
    records,
    registry,
    store,
)
from broker.state.history import protocol as history_store
from broker.telemetry import metrics, stalls
from kits import garbage

logger = logging.getLogger(__name__)


class BrokerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    store: str = "sqlite:///.gpufed/broker.db"
    tokens_file: Path = Path("config/tokens.yaml")
    # the tokens file is read again when it changes (looked at this often: a change applies
    # within two looks, so a revoked token is refused within 5 s) and on SIGHUP
    tokens_poll_seconds: float = Field(1.0, gt=0, le=2.0)
    reload_tokens_on_sighup: bool = False  # the service sets it; tests of many apps don't
    # /metrics without a token (a scraper that cannot send one); else admin, metrics, viewer
    metrics_public: bool = False
    # people's JWTs from an OIDC provider (broker.http.oidc); None: the tokens file only
    oidc_provider: oidc.OidcSettings | None = None
    # a JSON line per mutating call and refused credential (broker.http.audit); "-": stdout
    audit_log: str | None = None
    # requests a second per bearer token, and the burst held (broker.http.limits); None: off
    rate_limit: float | None = Field(None, gt=0)
    rate_burst: float | None = Field(None, ge=1)
    # seconds a client may take to send a body (the headers' timeout: broker.http.listening)
    body_timeout_seconds: float = Field(30.0, gt=0)
    # requests in progress per principal, agents' not counted (broker.http.limits); 0: none
    max_requests_per_principal: int = Field(limits.MAX_REQUESTS_PER_PRINCIPAL, ge=0)
    # GET /v1/events streams open on a replica, and of one principal (broker.http.events)
    max_event_streams: int = Field(events.MAX_STREAMS, ge=1)
    max_event_streams_per_principal: int = Field(events.MAX_STREAMS_PER_PRINCIPAL, ge=1)
    host: str = "127.0.0.1"
    port: int = 8080
    heartbeat_seconds: float = 5.0
    lost_after_seconds: float = 60.0
    cancel_grace_seconds: float = 30.0
    # an offer neither accepted nor rejected this long is withdrawn and the job queued again
    offer_timeout_seconds: float = Field(30.0, gt=0)
    # a job dispatched and not Running this long is withdrawn and queued again (StartTimeout)
    start_timeout_seconds: float = Field(600.0, gt=0)
    # offers out unanswered to one agent, at most (0: no limit)
    max_offers_in_flight: int = Field(fleet.MAX_OFFERS_IN_FLIGHT, ge=0)
    freeze_gc: bool = False  # the service sets it; tests running many apps in one process don't
    queues_file: Path | None = None  # config/queues.yaml; none: every queue is open
    # open: any queue name takes jobs; declared: only declared queues (default with a file)
    queue_mode: QueueMode | None = None
    # how long an Idempotency-Key replays its job (24 h); after it the key makes a new job
    idempotency_window_seconds: float = Field(records.IDEMPOTENCY_WINDOW_SECONDS, gt=0)
    cycle_interval_seconds: float = 0.005  # at most one scheduling cycle per interval
    plan_limit: int = Field(budget.DEFAULT_LIMIT, ge=1)  # pending jobs one cycle plans, at most
    # the store's request limit (etcd's --max-request-bytes): commits stay under it
    max_request_bytes: int = 1536 * 1024
    # what one request may expand to: jobs (arrays counted whole) and dependsOn entries
    max_request_jobs: int = Field(submits.MAX_REQUEST_JOBS, ge=1, le=submits.MAX_REQUEST_JOBS)
    max_request_dependencies: int = Field(submits.MAX_REQUEST_DEPENDENCIES, ge=0)
    # a GET /v1/jobs page stops before its body passes this (with a continue token)
    max_page_bytes: int = Field(listing.DEFAULT_PAGE_BYTES, ge=64 * 1024)
    # several replicas on etcd: the URL other replicas send agents to (default http://host:port)
    advertise_url: str | None = None
    # the leader's lease: a leader killed with -9 is replaced within it (plus one cycle)
    leader_lease_seconds: int = Field(electing.DEFAULT_TTL, ge=1, le=300)
    replica_id: str | None = None  # default <hostname>:<port>; unique among the replicas
    # etcd over TLS: the CA of etcd's certificate, a client certificate and its key (mTLS)
    etcd_ca_file: Path | None = None
    etcd_cert_file: Path | None = None
    etcd_key_file: Path | None = None
    # etcd's authentication: a user, its password from a file or given (GPUFED_ETCD_PASSWORD)
    etcd_user: str | None = None
    etcd_password_file: Path | None = None
    etcd_password: SecretStr | None = None
    # where finished jobs go (sqlite:///path | postgresql://...); None: history.db beside an
    # SQLite store, none for etcd (give one: replicated brokers share it); "none": no history
    history: str | None = None
    # a finished job stays in the store (and memory) this long, then moves to history
    retain_finished_seconds: float = Field(3600.0, ge=0)
    # history keeps a finished job this long, then prunes it
    history_ttl_seconds: float = Field(7 * 86400.0, gt=0)
    # the console's link to a job's trace: a Grafana Explore URL holding "{trace_id}"
    trace_url_template: str | None = None
    # HTTPS (and wss for agents): the listener's certificate chain and key, reloaded on change
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # agent mTLS: the CA of the agents' client certificates; a session then needs one, and
    # the cluster it names (broker.http.peers)
    client_ca_file: Path | None = None
    # a follower asking the leader over HTTPS: the CA of the replicas' certificates, and the
    # name they hold (broker.http.forwarding)
    peer_ca_file: Path | None = None
    peer_server_name: str | None = None
    tls_poll_seconds: float = Field(tls.POLL_SECONDS, gt=0)

    @property
    def history_url(self) -> str | None:
        if self.history == "none":
            return None
        return self.history or opening.default_history_url(self.store)

    @property
    def advertised(self) -> str:
        scheme = "https" if self.tls_files is not None else "http"
        return self.advertise_url or f"{scheme}://{self.host}:{self.port}"

    @property
    def tls_files(self) -> tls.ServerFiles | None:
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return tls.ServerFiles(self.tls_cert_file, self.tls_key_file, self.client_ca_file)

    @model_validator(mode="after")
    def _tls(self) -> BrokerSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("--client-ca needs --tls-cert and --tls-key (HTTPS)")
        return self

    @property
    def replica(self) -> str:
        return self.replica_id or f"{socket.gethostname()}:{self.port}"

    @model_validator(mode="after")
    def _trace_url_template(self) -> BrokerSettings:
        if self.trace_url_template is not None:
            problem = console.check_trace_url_template(self.trace_url_template)
            if problem is not None:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _grace(self) -> BrokerSettings:
        # agents fence themselves before the grace ends: it must leave them room (api.leases)
        problem = leases.check_lost_after(self.lost_after_seconds, heartbeat=self.heartbeat_seconds)
        if problem is None and self.store.startswith("etcd"):  # replicas: a leader lease
            problem = leases.check_leader_lease(
                self.leader_lease_seconds,
                heartbeat=self.heartbeat_seconds,
                lost_after=self.lost_after_seconds,
            )
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _etcd_credentials(self) -> BrokerSettings:
        given = {
            "--etcd-ca": self.etcd_ca_file,
            "--etcd-cert": self.etcd_cert_file,
            "--etcd-key": self.etcd_key_file,
            "--etcd-user": self.etcd_user,
            "--etcd-password-file": self.etcd_password_file,
        }
        flags = [flag for flag, value in given.items() if value is not None]
        if flags and not self.store.startswith(opening.ETCD_SCHEME):
            raise ValueError(f"{', '.join(flags)}: only for an etcd store, not {self.store}")
        self.load_etcd_credentials()  # every file read now: a bad one stops the start
        return self

    def load_etcd_credentials(self) -> etcd_credentials.EtcdCredentials:
        """The etcd store's TLS files and user, checked; ValueError naming the flag."""
        return etcd_credentials.load_credentials(
            ca_file=self.etcd_ca_file,
            cert_file=self.etcd_cert_file,
            key_file=self.etcd_key_file,
            user=self.etcd_user,
            password_file=self.etcd_password_file,
            password=self.etcd_password.get_secret_value() if self.etcd_password else None,
        )


def create_app(settings: BrokerSettings) -> web.Application:
    app = web.Application(
        client_max_size=jobs.MAX_BODY,
        # the audit line (of what the client got), errors, rate limits, who asks, the body
        middlewares=[
            limits.client_middleware,  # who the client is (trusted proxies), its share
            audit.middleware,
            problems.problems_middleware,
            limits.rate_middleware,
            auth.middleware,
            limits.share_middleware,  # a principal's requests in progress
            limits.body_middleware,
        ],
    )
    auth.install(  # the tokens, followed while the broker runs; each route's roles
        app,
        settings.tokens_file,
        poll_seconds=settings.tokens_poll_seconds,
        sighup=settings.reload_tokens_on_sighup,
        metrics_public=settings.metrics_public,
    )
    if settings.audit_log is not None:
        audit.install(app, settings.audit_log)
    limits.install(
        app,
        rate=settings.rate_limit,
        burst=settings.rate_burst,
        body_timeout=settings.body_timeout_seconds,
        requests_per_principal=settings.max_requests_per_principal or None,
    )
    headers.install(app)  # nosniff; no framing of HTML answers
    problems.quiet_client_errors()  # a request aiohttp cannot parse: one line, no traceback
    if settings.tls_files is not None:  # HTTPS; the caller serves with app[tls.SERVER_TLS]
        server_tls = tls.install(app, settings.tls_files, poll_seconds=settings.tls_poll_seconds)
        app[peers.AGENT_CERTIFICATES] = server_tls.client_certificates
    forwarding.configure(app, ca_file=settings.peer_ca_file, server_name=settings.peer_server_name)
    queue_registry = registry.QueueRegistry.from_file(
        settings.queues_file, mode=settings.queue_mode
    )
    app[keys.QUEUES] = queue_registry
    meters = metrics.BrokerMetrics()
    meters.queue_label.follow(lambda: queue_registry.config)  # `queue`: declared, or other
    if settings.oidc_provider is not None:  # people's JWTs; refused claims on /metrics
        oidc.install(app, settings.oidc_provider, registry=meters.registry)
    app[keys.READY] = {"store": False, "synced": False, "scheduler": False}
    handing_over: list[Callable[[], Awaitable[None]]] = []  # set once started

    async def on_shutdown(app: web.Application) -> None:
        for hand_over in handing_over:
            await hand_over()

    app.on_shutdown.append(on_shutdown)
    jobs.add_routes(
        app,
        bounds=submits.Bounds(
            max_jobs=settings.max_request_jobs,
            max_dependencies=settings.max_request_dependencies,
        ),
        page_bytes=settings.max_page_bytes,
    )
    arrays.add_routes(app)
    clusters.add_routes(app)
    openapi.add_routes(app)
    queues.add_routes(app)
    events.add_routes(  # job changes, live (server-sent events)
        app,
        max_streams=settings.max_event_streams,
        per_principal=settings.max_event_streams_per_principal,
    )
    gpumap.add_routes(app)
    console.add_routes(app, trace_url_template=settings.trace_url_template)  # /ui/
    app.router.add_get("/metrics", make_aiohttp_handler(registry=meters.registry))

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        backing = await opening.open_store(
            settings.store,
            credentials=settings.load_etcd_credentials(),
            max_request_bytes=settings.max_request_bytes,
        )
        job_store = records.JobStore(
            backing,
            observe=lambda op, seconds: meters.store_latency.labels(op=op).observe(seconds),
            max_request_bytes=settings.max_request_bytes,
        )
        clusters_view = fleet.Fleet(
            stale_after=3 * settings.heartbeat_seconds,
            cancel_grace_seconds=settings.cancel_grace_seconds,
            offer_timeout_seconds=settings.offer_timeout_seconds,
            start_timeout_seconds=settings.start_timeout_seconds,
            max_offers_in_flight=settings.max_offers_in_flight or None,
        )
        leadership = _leadership(settings, backing, meters)
        book = service.Jobs(
            job_store,
            clusters_view,
            meters=meters,
            idempotency_window=settings.idempotency_window_seconds,
            leadership=leadership,
        )
        history = await _open_history(settings)
        book.book.history = history
        loaded_at = await book.load()
        # what is loaded now lives as long as the broker: keep it out of the collector's
        # full passes, which otherwise stall scheduling cycles for milliseconds
        if settings.freeze_gc:
            garbage.settle()
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
                # parked planning (the inadmissible set, `planning.backlog.parking`) is on: True
                # plans every queued job every cycle (the same decisions, O(backlog))
                full_replan=False,
                plan_limit=settings.plan_limit,
            )

        def store_answers(up: bool) -> None:
            app[keys.READY]["store"] = up
            meters.store_up.set(1 if up else 0)

        def store_alarms(raised: set[str]) -> None:
            for alarm in {*metrics.STORE_ALARMS, *raised}:
                meters.store_alarm.labels(alarm=alarm).set(1 if alarm in raised else 0)

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
            retention=(settings.retain_finished_seconds, settings.history_ttl_seconds),
        )
        app[keys.LEADER_WORK] = work
        meters.store_up.set(1)
        tasks = [
            asyncio.create_task(stalls.LoopMonitor(meters.loop_lag).run(), name="loop-monitor"),
            asyncio.create_task(
                probing.probe_store(
                    backing,
                    store_answers,
                    alarms=backing.alarms if isinstance(backing, etcd.EtcdStore) else None,
                    on_alarms=store_alarms,
                ),
                name="store-probe",
            ),
            asyncio.create_task(book.run_flusher(), name="group-commit"),
            asyncio.create_task(queue_registry.follow(backing), name="queues-watch"),
        ]
        if settings.freeze_gc:
            collector = garbage.Collector(meters.gc_pauses)
            collector.install()
            election = leadership if isinstance(leadership, electing.Election) else None
            renewed = election.renewed_within if election is not None else None

            def budget() -> float:
                """How long the process may stop: within the lease's slack, and, while
                leading, two heartbeats (the agents reconnect after three of silence)."""
                lease = election.pause_budget() if election is not None else float("inf")
                agents = 2 * settings.heartbeat_seconds if leadership.is_leader else lease
                return min(lease, agents)

            collecting = collector.run(renewed, budget, held=lambda: len(book))
            tasks.append(asyncio.create_task(collecting, name="collector"))
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
            steps: list[str] = []
            began = time.monotonic()
            for name, step in (
                ("the leader's work stopped", lambda: work.close(leader_task)),
                ("waiting commits flushed", book.close),
                ("agent sessions closed", lambda: sessions.close_all(reason="shutting down")),
                ("lease given up", leadership.resign),
            ):
                started = time.monotonic()
                await step()
                steps.append(f"{name} {time.monotonic() - started:.2f} s")
            logger.info("handed over in %.2f s: %s", time.monotonic() - began, ", ".join(steps))

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
        if history is not None:
            await history.close()
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
            connect=backing.connector() if isinstance(backing, etcd.EtcdStore) else None,
        )
    else:
        leadership = electing.Sole(settings.replica, settings.advertised)

    def changed() -> None:
        meters.leader.set(1 if leadership.is_leader else 0)
        meters.term.set(leadership.term)

    leadership.on_change(changed)
    changed()
    return leadership


async def _open_history(settings: BrokerSettings) -> history_store.HistoryStore | None:
    """The history store the settings name, opened; None (with a warning) if there is none:
    finished jobs then stay in the store."""
    url = settings.history_url
    if url is None:
        logger.warning(
            "no history store (--history): finished jobs stay in %s and in memory; give "
            "--history postgresql://... (shared by the replicas) to move them out",
            settings.store.split("://", 1)[0],
        )
        return None
    history = await opening.open_history(url)
    logger.info(
        "finished jobs move to history %s after %g s, pruned after %g s",
        url.split("@")[-1],
        settings.retain_finished_seconds,
        settings.history_ttl_seconds,
    )
    return history
