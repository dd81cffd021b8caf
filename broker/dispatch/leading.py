"""What only the leader does: started when this replica's term begins, stopped when it ends.

Run by `broker.app` (`LeaderWork.run`) beside the election (`state.electing`). When the
replica starts leading it first passes a read barrier (`jobs.watching.BookWatch.sync`: every
job change the former leader committed is in the book), counts every cluster the book places
jobs on as away from now (`fleet.start_term`: the lost-cluster grace starts over), and then
starts the leader's tasks, each made anew for the term: the scheduling cycle, the sessions'
watchdog (offer timeouts, lost clusters), the idempotency sweep, the cancels followers commit
(`requests.ForwardedCancels`), the active deadlines (`jobs.deadlines`), the start timeouts
(`jobs.starting`), the waiting jobs
whose dependencies end (`jobs.dependents`), the cluster views
for the followers (`state.views`) and the retirement of finished jobs (`jobs.retiring`: to
the history store; without one, only the jobs past their own `ttlSecondsAfterFinished`,
deleted) and the agents' knocks at followers (`knocking`: a leader its agents reach only
through followers steps aside). Only then is it `active`: `http.clusters` accepts agents on an
active leader only, and on any other replica records the refused agent's knock (`knocked`).

When the term ends (`following` set: lease lost, a fenced commit refused, resigned), the tasks
are cancelled at once, every agent session is closed (the agents reconnect to the new
leader), what waited for the group commit is dropped (the agents report it again) and the
leader-only gauges are cleared. A task never dies of one error: its own loop logs and counts
(`gpufed_background_errors_total{task}`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from broker.api import inventory
from broker.dispatch import connecting, knocking
from broker.jobs import retiring, scheduling, service, watching
from broker.state import electing, errors, records, store, views
from broker.telemetry import metrics

logger = logging.getLogger(__name__)

PUBLISH_EVERY = 1.0
SYNC_RETRY = 0.2
FOLLOWER_VIEWS_EVERY = 2.0


class LeaderWork:
    def __init__(
        self,
        leadership: electing.Leadership,
        *,
        jobs: service.Jobs,
        sessions: connecting.Sessions,
        backing: store.Store,
        meters: metrics.BrokerMetrics,
        make_scheduler: Callable[[], scheduling.Scheduler],
        watch: watching.BookWatch | None = None,
        retention: tuple[float, float] | None = None,
    ) -> None:
        self.leadership = leadership
        self.jobs = jobs
        self.sessions = sessions
        self.backing = backing
        self.meters = meters
        self.make_scheduler = make_scheduler
        self.watch = watch
        self.retention = retention  # (retain finished, history TTL) seconds
        self.active = False  # the leader's work runs: agents are accepted
        self.activated = asyncio.Event()  # set the first time it is active
        self.published: list[views.Published] = []  # on a follower: the leader's views
        self.terms = 0  # terms led since the start
        self.scheduler: scheduling.Scheduler | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        # agents followers refuse, and the leader's watch over them (`knocking`)
        self.knocks: knocking.Knocks | None = None
        if isinstance(leadership, electing.Election):
            self.knocks = knocking.Knocks(
                leadership.backing,
                leadership,
                heartbeat=sessions.heartbeat,
                on_error=meters.background_errors.labels(task="knocks").inc,
            )

    def knocked(self, cluster: str) -> None:
        """An agent of `cluster` was refused here (this replica does not lead, or its work
        has not started): a follower records the knock for the leader (`knocking`)."""
        if self.knocks is not None:
            self.knocks.note(cluster)

    async def run(self) -> None:
        """Lead whenever elected, until cancelled."""
        while True:
            await self.leadership.leading.wait()
            try:
                if await self._begin():
                    await self.leadership.following.wait()
            except Exception:  # a bug of one term must not end the leader work for good
                self.meters.background_errors.labels(task="leader-work").inc()
                logger.exception("the leader's work failed; this replica stops leading")
                step_down = getattr(self.leadership, "step_down", None)
                if step_down is not None:
                    step_down("its leader work failed")
                await asyncio.sleep(SYNC_RETRY)
            finally:
                await self._wind_up()

    async def _wind_up(self) -> None:
        """End the term's work; an error on the way is logged and counted, never raised (it
        would end this task, and the replica would lead again without working)."""
        try:
            await self._stop_tasks()
            if not self._closing:
                await self._end()
        except Exception:
            self.meters.background_errors.labels(task="leader-work").inc()
            logger.exception("ending the leader's term failed")

    async def close(self, task: asyncio.Task[None] | None) -> None:
        """Stop the leader's work for good (SIGTERM: what waits for the group commit is
        flushed by the caller, still within the term, before it resigns)."""
        self._closing = True
        if task is not None:
            await scheduling.stop_task(task)
        await self._stop_tasks()

    async def _begin(self) -> bool:
        term = self.leadership.term
        started = time.monotonic()
        if not await self._synced():
            return False
        self.jobs.fleet.start_term(self.jobs.clusters_with_jobs(), now=time.monotonic())
        self.scheduler = self.make_scheduler()
        work: list[tuple[str, Coroutine[Any, Any, None]]] = [
            ("scheduler", self.scheduler.run()),
            ("sessions-watchdog", self.sessions.watch()),
            ("idempotency-sweep", self.jobs.run_key_sweeper()),
            ("forwarded-cancels", self.jobs.forwarded.run()),
            ("deadlines", self.jobs.run_deadlines()),
            ("start-timeouts", self.jobs.run_starts()),
            ("dependencies", self.jobs.run_dependencies()),
        ]
        if self.leadership.replicated:
            work.append(("cluster-views", self._publish_views()))
        if self.knocks is not None:  # a leader its agents reach only through followers
            work.append(("knocks", self.knocks.watch_term(self.jobs.fleet)))
        history = self.jobs.history
        if self.retention is not None:  # without a history: only the jobs' own TTLs
            retain, ttl = self.retention
            work.append(
                (
                    retiring.TASK,
                    retiring.run_retirer(
                        self.jobs.book,
                        history,
                        retain=retain,
                        ttl=ttl,
                        meters=self.meters,
                        ttls=self.jobs.ttls,
                    ),
                )
            )
        self._tasks = [asyncio.create_task(coro, name=name) for name, coro in work]
        self.active = True
        self.activated.set()
        self.terms += 1
        self.jobs.book.wakeup.set()  # plan what is queued now
        logger.warning(
            "leading term %d: work started %.3f s after the election",
            term,
            time.monotonic() - started,
        )
        return True

    async def _synced(self) -> bool:
        """Pass a read barrier while leading; False if the term ended first."""
        if self.watch is None:
            return True
        while self.leadership.is_leader:
            try:
                await self.watch.sync()
                return True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.meters.background_errors.labels(task=watching.TASK).inc()
                logger.warning("the new leader's cache did not sync yet: %s", str(exc) or "timeout")
                await asyncio.sleep(SYNC_RETRY)
        return False

    async def _stop_tasks(self) -> None:
        self.active = False
        tasks, self._tasks = self._tasks, []
        await asyncio.gather(*(scheduling.stop_task(task) for task in tasks))

    async def _end(self) -> None:
        """The term ended: no session, no draft, no gauge of it stays."""
        closed = await self.sessions.close_all(reason="this broker is not the leader any more")
        self.jobs.end_term()
        self.meters.clear_leader_gauges()
        logger.warning("stopped leading: %d agent sessions closed", closed)

    # ---- the cluster views the followers serve ---------------------------------------------

    async def cluster_views(self, running: Mapping[str, int]) -> list[inventory.ClusterView]:
        """`GET /v1/clusters`: the leader's own view; on a follower, what the leader
        published, with this replica's count of running jobs."""
        if self.active or not self.leadership.replicated:
            return self.jobs.fleet.views(now=time.monotonic(), running=running)
        self.published = await views.read_views(self.backing)
        wall = time.time()
        out = []
        for item in self.published:
            seen = round(max(0.0, wall - item.seen_at), 3) if item.seen_at is not None else None
            update = {"last_seen_seconds": seen, "running_jobs": running.get(item.view.name, 0)}
            out.append(item.view.model_copy(update=update))
        return out

    def fleet_gpus(self) -> dict[str, int]:
        """GPUs per model of the Ready clusters (the fair-share views of `GET /v1/queues`)."""
        if self.active or not self.leadership.replicated:
            return self.jobs.fleet.snapshot(now=time.monotonic()).total_gpus()
        out: dict[str, int] = {}
        for item in self.published:
            if item.view.health == "Ready":
                for model in item.view.models:
                    out[model.model] = out.get(model.model, 0) + model.total
        return out

    async def follow_views(self) -> None:
        """On a follower, read the leader's views every few seconds (for `fleet_gpus`)."""
        while True:
            await asyncio.sleep(FOLLOWER_VIEWS_EVERY)
            if self.active:
                continue
            try:
                self.published = await views.read_views(self.backing)
            except Exception as exc:
                self.meters.background_errors.labels(task="cluster-views").inc()
                logger.warning("reading the leader's cluster views failed: %s", exc)

    async def _publish_views(self) -> None:
        """Publish each cluster's view when it changed (at most every PUBLISH_EVERY s), and
        every `views.REFRESH_SECONDS`; fenced by the term."""
        published: dict[str, tuple[bytes, float]] = {}
        while True:
            try:
                await self._publish_once(published)
            except errors.NotLeaderError:
                return  # the term is over: the work is being stopped
            except Exception as exc:
                self.meters.background_errors.labels(task="cluster-views").inc()
                logger.warning("publishing the cluster views failed: %s", exc)
            await asyncio.sleep(PUBLISH_EVERY)

    async def _publish_once(self, published: dict[str, tuple[bytes, float]]) -> None:
        now, wall = time.monotonic(), time.time()
        fleet = self.jobs.fleet
        puts: list[tuple[str, bytes]] = []
        changed: dict[str, tuple[bytes, float]] = {}
        for view in fleet.views(now=now, running={}):
            content = views.encode_view(view, seen_at=None)
            before = published.get(view.name)
            fresh = before is not None and wall - before[1] < views.REFRESH_SECONDS
            if fresh and before is not None and before[0] == content:
                continue
            cluster = fleet.clusters[view.name]
            seen_at = wall - (now - cluster.last_seen) if cluster.last_seen else None
            puts.append((views.view_key(view.name), views.encode_view(view, seen_at=seen_at)))
            changed[view.name] = (content, wall)
        fence = self.leadership.fence()
        for start in range(0, len(puts), records.MAX_TXN_OPS):
            txn = store.Txn(
                compares=[fence] if fence is not None else [],
                puts=puts[start : start + records.MAX_TXN_OPS],
            )
            try:
                await self.backing.commit(txn)
            except errors.ConflictError as exc:
                if self.leadership.lost_fence(exc):
                    raise errors.NotLeaderError(str(exc), revisions=exc.revisions) from exc
                raise
        published.update(changed)
