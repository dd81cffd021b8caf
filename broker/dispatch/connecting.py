"""The agent's WebSocket session on the broker side: hello, welcome, then messages both ways.

`GET /v1/agents/connect` with an agent token or client certificate (`http.peers`). The first
frame must be Hello for the cluster they name; the broker bumps the cluster's epoch
(fencing), reconciles the jobs the agent holds, answers Welcome, and then handles summaries,
acknowledgements and job status until the socket closes (final reports are acknowledged on
the session they came on, once committed).
A watchdog marks silent clusters Unreachable and, past a grace period, runs their jobs
elsewhere, and withdraws offers left unanswered past the offer timeout.

Only the leader holds sessions (`http.clusters` refuses agents elsewhere with 409 and the
leader's URL); the epoch bump is fenced by the leader's term, and a replica that stops leading
closes every session (`close_all`): its agents reconnect to the new leader. A session whose
credentials stop being valid (`allowed`: the agent's token revoked or expired) is closed
within a second (`GUARD_SECONDS`); the agent's reconnection is then refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import pydantic
from aiohttp import WSMsgType, web

from broker.api import messages
from broker.jobs import fleet, reports
from broker.planning import snapshot
from broker.state import electing, errors, records
from broker.telemetry import metrics

logger = logging.getLogger(__name__)
# why a session was refused at its hello (closed 4003): the audit line says it (http.audit)
REFUSED_HELLO = web.RequestKey("refused_hello", str)

GUARD_SECONDS = 1.0  # how often a session's credentials are checked again
CLOSE_ALL_SECONDS = 1.0  # a handover closes the agent sessions for at most this long
Inbox = asyncio.Queue[tuple[float, messages.Message] | None]  # (read at, message); None: the end
INBOX_MESSAGES = 4096  # read ahead of what is applied; past it the socket waits (TCP)
BATCH_MESSAGES = 512  # reports applied under one hold of the book's lock, at most


def describe(exc: Exception) -> str:
    """One line of what was wrong with a message: the first field and why."""
    if isinstance(exc, pydantic.ValidationError):
        first = exc.errors(include_url=False)[0] if exc.errors() else None
        if first is not None:
            where = ".".join(str(part) for part in first["loc"])
            return f"{where}: {first['msg']}" if where else str(first["msg"])
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc)[:200] or type(exc).__name__


class SocketLink:
    """AgentLink over an aiohttp WebSocket to an agent of protocol `peer` (its hello's)."""

    def __init__(self, ws: web.WebSocketResponse, *, peer: int = messages.PROTOCOL_VERSION) -> None:
        self.ws = ws
        self.peer = peer

    async def send(self, message: messages._Msg) -> None:
        if self.ws.closed:
            raise ConnectionResetError("agent session closed")
        await self.ws.send_str(messages.encode(message, peer=self.peer))

    async def close(self, *, reason: str) -> None:
        await self.ws.close(code=4000, message=reason.encode()[:120])


class Sessions:
    """Runs agent sessions and the watchdog over them."""

    def __init__(
        self,
        agent_reports: reports.AgentReports,
        clusters: fleet.Fleet,
        *,
        job_store: records.JobStore,
        meters: metrics.BrokerMetrics,
        heartbeat_seconds: float = 5.0,
        lost_after_seconds: float = 60.0,
        leadership: electing.Leadership | None = None,
    ) -> None:
        self.reports = agent_reports
        self.fleet = clusters
        self.job_store = job_store
        self.meters = meters
        self.heartbeat = heartbeat_seconds
        self.lost_after = lost_after_seconds
        self.leadership = leadership
        self._links: set[SocketLink] = set()

    async def close_all(self, *, reason: str, timeout: float = CLOSE_ALL_SECONDS) -> int:
        """Close every agent session (this replica stops leading), all at once and for at
        most `timeout` (a close waits for the agent's answer: one busy agent must not hold a
        handover up); returns how many."""
        links = list(self._links)

        async def close(link: SocketLink) -> None:
            with contextlib.suppress(Exception):
                await link.close(reason=reason)

        closing = [asyncio.ensure_future(close(link)) for link in links]
        if closing:
            _, late = await asyncio.wait(closing, timeout=timeout)
            for task in late:  # the socket goes with the server; the agent reconnects
                task.cancel()
        return len(links)

    async def serve(
        self,
        request: web.Request,
        cluster_name: str,
        *,
        allowed: Callable[[], bool] | None = None,
    ) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=16 * 1024 * 1024)
        await ws.prepare(request)
        try:
            first = await ws.receive(timeout=10.0)
            hello = messages.decode(first.data) if first.type == WSMsgType.TEXT else None
        except (TimeoutError, pydantic.ValidationError):
            hello = None
        if not isinstance(hello, messages.Hello) or hello.cluster != cluster_name:
            refusal = f"first message must be hello for {cluster_name} (its token's, certificate's)"
            request[REFUSED_HELLO] = refusal
            await ws.close(code=4003, message=refusal.encode()[:120])
            return ws
        link = SocketLink(ws, peer=hello.v)
        try:
            fence = self.leadership.fence() if self.leadership is not None else None
            epoch = await self.job_store.next_epoch(cluster_name, fence=fence)
        except errors.ConflictError as exc:  # this replica stopped leading meanwhile
            if self.leadership is not None:
                self.leadership.lost_fence(exc)
            await ws.close(code=4009, message=b"not the leader: connect to the leader")
            return ws
        self._links.add(link)
        cluster = await self.fleet.attach(cluster_name, link, epoch=epoch)
        self.meters.agent_connected.labels(cluster=cluster_name).set(1)
        logger.info(
            "agent of %s connected, epoch %d, holding %d jobs", cluster_name, epoch, len(hello.jobs)
        )
        beating = asyncio.create_task(self._beat(link))
        guarding = (
            asyncio.create_task(self._guard(link, allowed, cluster=cluster_name))
            if allowed is not None
            else None
        )
        try:
            if self.leadership is not None and not self.leadership.is_leader:
                await link.close(reason="not the leader: connect to the leader")
                return ws  # it stopped leading while the session opened (close_all missed it)
            grace = self.lost_after  # the agent fences itself before it ends (api.leases)
            welcome = messages.welcome_for(
                hello, epoch=epoch, heartbeat_seconds=self.heartbeat, lost_after_seconds=grace
            )
            await link.send(welcome)
            self.meters.welcome_session(cluster_name)
            cluster.unapplied, cluster.applied_read_at = 0, time.monotonic()
            self._fall_behind(cluster, link)  # its next frames wait while its hello is applied
            try:
                await self.reports.hello(cluster, hello)
            finally:
                self._caught_up(cluster, link)
            del first, hello  # a hello of thousands of jobs is not kept for the session
            await self._receive(ws, link, cluster, epoch=epoch)
        finally:
            for task in (beating, guarding):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            self._links.discard(link)
            self.fleet.detach(cluster_name, link)
            if cluster.link is None:
                self.meters.agent_connected.labels(cluster=cluster_name).set(0)
            logger.info("agent of %s disconnected", cluster_name)
        return ws

    @staticmethod
    def _fall_behind(cluster: fleet.Cluster, link: SocketLink) -> None:
        cluster.behind = link
        cluster.behind_since = time.monotonic()

    @staticmethod
    def _caught_up(cluster: fleet.Cluster, link: SocketLink) -> None:
        """The broker reads the session's frames again: the agent's silence counts anew."""
        if cluster.behind is link:
            cluster.behind = None
        cluster.last_seen = time.monotonic()

    async def _receive(
        self,
        ws: web.WebSocketResponse,
        link: SocketLink,
        cluster: fleet.Cluster,
        *,
        epoch: int,
    ) -> None:
        """Read the session's frames into a queue while `_work` applies what has arrived,
        a batch at a time, until the socket closes and the queue is empty. While the queue
        is full the broker is behind (`Cluster.behind`): the agent is not taken for silent."""
        inbox: Inbox = asyncio.Queue(maxsize=INBOX_MESSAGES)
        working = asyncio.create_task(self._work(inbox, link, cluster, epoch=epoch))
        try:
            async for frame in ws:
                if frame.type != WSMsgType.TEXT:
                    continue
                read_at = cluster.last_seen = time.monotonic()
                try:
                    message = messages.decode(frame.data)
                except (pydantic.ValidationError, ValueError, RecursionError) as exc:
                    await self._refuse(ws, cluster, frame.data, exc)
                    break
                if cluster.link is link:
                    cluster.unapplied += 1
                    self._heard(cluster, message)
                if inbox.full():
                    self._fall_behind(cluster, link)
                    try:
                        await inbox.put((read_at, message))
                    finally:
                        self._caught_up(cluster, link)
                else:
                    inbox.put_nowait((read_at, message))
        finally:
            with contextlib.suppress(asyncio.QueueFull):
                inbox.put_nowait(None)
            if inbox.full():  # cancelled with the inbox full: what is read is still applied
                working.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await working

    def _heard(self, cluster: fleet.Cluster, message: messages.Message) -> None:
        """An answer to an offer, read: a slot of the agent's offer window is free now,
        before the answer is applied (a cycle held for one may run: `fleet.changed`)."""
        if not isinstance(message, messages.Accepted | messages.Rejected):
            return
        if cluster.inflight.hear(message.job_id, message.attempt):
            self.fleet.changed.set()

    async def _work(
        self, inbox: Inbox, link: SocketLink, cluster: fleet.Cluster, *, epoch: int
    ) -> None:
        """Apply the messages in the order they came: a run of reports under one hold of the
        book's lock (`reports.apply`), a summary as it comes; then note how far the broker
        is (`Cluster.heard_until`: offers are not overdue for answers it has not applied)."""
        while True:
            batch = [await inbox.get()]
            while not inbox.empty() and len(batch) < BATCH_MESSAGES and batch[-1] is not None:
                batch.append(inbox.get_nowait())
            done = batch[-1] is None
            read = [item for item in batch if item is not None]
            try:
                await self._apply(cluster, [message for _, message in read], epoch=epoch)
            finally:
                if read and cluster.link is link:
                    cluster.unapplied -= len(read)
                    cluster.applied_read_at = read[-1][0]
            if done:
                return

    async def _apply(
        self, cluster: fleet.Cluster, batch: list[messages.Message], *, epoch: int
    ) -> None:
        run: list[messages.Message] = []
        for message in batch:
            if isinstance(message, messages.Accepted | messages.Rejected | messages.JobUpdate):
                run.append(message)
                continue
            if run:
                await self.reports.apply(cluster, run, session=epoch)
                run = []
            self._handle(cluster, message)
        if run:
            await self.reports.apply(cluster, run, session=epoch)

    async def _refuse(
        self, ws: web.WebSocketResponse, cluster: fleet.Cluster, data: str, exc: Exception
    ) -> None:
        """A frame that does not decode: the cluster is Degraded (no new work) until a good
        full summary, and the session is closed with the reason; the agent reconnects."""
        kind = messages.peek_type(data)
        reason = f"bad {kind} message: {describe(exc)}"
        self.meters.agent_messages_refused.labels(cluster=cluster.name, type=kind).inc()
        logger.warning("refused a message from %s: %s", cluster.name, reason)
        cluster.degrade(reason)
        self.fleet.changed.set()
        await ws.close(code=4400, message=reason.encode()[:120])

    def _handle(self, cluster: fleet.Cluster, message: messages.Message) -> None:
        """A message other than a report (those go to `reports.apply`)."""
        try:
            match message:
                case messages.Summary():
                    started = time.perf_counter()
                    cluster.apply_summary(message)
                    self._export_cluster(cluster, now=time.monotonic())
                    self.fleet.changed.set()
                    self.meters.summary_duration.observe(time.perf_counter() - started)
                case messages.Heartbeat():
                    pass
                case _:
                    logger.warning("unexpected %s from %s", message.type, cluster.name)
        except Exception:  # one message's failure must not end the session
            kind = type(message).__name__
            self.meters.agent_messages_failed.labels(cluster=cluster.name, type=kind).inc()
            logger.exception("handling %s from %s failed", kind, cluster.name)

    def _export_cluster(self, cluster: fleet.Cluster, *, now: float) -> None:
        """The cluster's session state and GPUs as the broker sees them now."""
        summary = cluster.summary
        models = None
        if summary is not None:
            models = {
                m.model: metrics.model_gpus(m, total=snapshot.total_gpus_of(m))
                for m in summary.models
            }
        self.meters.set_cluster(
            cluster.name,
            health=cluster.health(now=now, stale_after=self.fleet.stale_after),
            models=models,
            fragmentation=summary.fragmentation_milli / 1000 if summary is not None else 0.0,
        )

    async def _beat(self, link: SocketLink) -> None:
        seq = 0
        while True:
            await asyncio.sleep(self.heartbeat)
            seq += 1
            try:
                await link.send(messages.Heartbeat(seq=seq))
            except ConnectionError:
                return

    async def _guard(self, link: SocketLink, allowed: Callable[[], bool], *, cluster: str) -> None:
        """Close the session once `allowed()` is false (its token revoked or expired)."""
        while True:  # polled: revoking or expiring a token sets no event
            if not allowed():
                break
            await asyncio.sleep(GUARD_SECONDS)
        logger.warning("closing the session of %s: its token or certificate lapsed", cluster)
        with contextlib.suppress(Exception):
            await link.close(reason="the agent's token was revoked or has expired")

    async def watch(self) -> None:
        """Close silent sessions; withdraw offers unanswered past the offer timeout; requeue the
        jobs of clusters gone past their grace; export each session's state. Runs until
        cancelled: an error with one cluster is logged and counted, and the others (and the
        next pass) go on."""
        every = min(self.heartbeat, 1.0)
        while True:
            slept = time.monotonic()
            await asyncio.sleep(every)
            now = time.monotonic()
            # woken late, the loop was held (a big batch, a collector pass): the agents'
            # frames of that time are still unread, and their silence is the broker's
            stalled = now - slept > 1.5 * every
            for cluster in list(self.fleet.clusters.values()):
                try:
                    await self._check(cluster, now=now, stalled=stalled)
                except Exception:
                    self.meters.background_errors.labels(task="sessions-watchdog").inc()
                    logger.exception("watching the session of %s failed", cluster.name)

    async def _check(self, cluster: fleet.Cluster, *, now: float, stalled: bool = False) -> None:
        link = cluster.link
        if link is not None and not stalled and cluster.silent_for(now) > 3 * self.heartbeat:
            logger.warning(
                "agent of %s silent for %.1fs: closing its session",
                cluster.name,
                cluster.silent_for(now),
            )
            self.fleet.detach(cluster.name, link)
            await link.close(reason="heartbeat timeout")
        await self.reports.withdraw_unanswered(cluster, now=cluster.heard_until(now))
        if (
            cluster.link is None
            and not cluster.lost
            and cluster.disconnected_at is not None
            and now - cluster.disconnected_at > self.lost_after
        ):
            moved = await self.reports.cluster_lost(cluster.name)
            cluster.lost = True
            logger.warning("cluster %s lost: %d jobs requeued", cluster.name, moved)
        self._export_cluster(cluster, now=now)
