"""The agent's WebSocket session with the broker: connect out, hello, heartbeats, reconnect.

`Connector.run` loops until stopped: connect `GET {broker}/v1/agents/connect` with the
cluster's bearer token (or its client certificate, over TLS: `tls`), send `hello` with every
job the agent holds, wait for `welcome`, send a full summary, then read offers and cancels
(handled one at a time by `jobs.handling.JobHandler`) and write replies, job updates,
summaries and heartbeats. Silence for three heartbeat intervals
drops the session; it is opened again with exponential backoff and jitter, on the next broker
URL after a connection failure or a silent session (a frozen or cut-off leader: another replica
takes the lead, and going back to it first would only wait out a connect timeout), on the
leader a follower names after a 409 (`brokers`). A connect and its upgrade may take
`--connect-timeout` and no more than two heartbeats.
Once a replica has answered 409, the brokers are up and choosing a leader: until a session is
welcomed, no wait is longer than the replica's Retry-After (a dead leader it still names, and
the next URL, are tried at that pace rather than at the backoff's ceiling). An agent
behind an egress proxy names it (`--proxy`); the environment's `HTTP_PROXY` is not read, so a
proxy set for package downloads never comes between an agent and its broker by surprise.
A 401/403 (or a session closed with 4001/4003 before its welcome: the token of another
cluster) is permanent until the token changes: an agent that no broker has welcomed yet and
that holds no running job exits with the reason (`brokers.AuthError` out of `run`); otherwise
it is logged and retried slowly (exiting would leave its pods unfenced).

Every message of the broker on a welcomed session renews the cluster lease (`leasing`); the
lease is kept by `run` and fences the job handler when it lapses.

Messages are routed through `Router`: while no session is live they are dropped, and `hello`
carries the current state of every job on the next one. Final reports are the exception: the
job handler's `updating.Updater` keeps them until the broker acknowledges them (`ack`, for
this session's epoch), sends them again once a broker of protocol 2 welcomes a session, and
again on a live one while unanswered (checked with every heartbeat). A broker of protocol 1
does not acknowledge: `seq` is left out of what is written to it, and a write counts as
delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp
import pydantic

from broker.api import jobs, messages
from kits import interning
from member_agent.jobs import handling
from member_agent.session import brokers, leasing, reporting, tls

logger = logging.getLogger(__name__)

CONNECT_PATH = "/v1/agents/connect"
CONNECT_WAIT_BEATS = 2.0  # a connect and upgrade take at most this many heartbeats ...
MIN_CONNECT_WAIT_SECONDS = 2.0  # ... and may always take this long
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
Outgoing = tuple[messages.Message, Callable[[], None] | None]
T = TypeVar("T")


@dataclass(frozen=True)
class ConnectSettings:
    broker_urls: tuple[str, ...]
    cluster: str
    token_file: Path | None = None
    heartbeat_seconds: float = 5.0  # until the broker's welcome says otherwise
    fence_after_seconds: float | None = None  # None: as late as the broker's grace allows
    failure_grace_seconds: float = 30.0  # at most, for the pods a fence deletes
    backoff_initial_seconds: float = 0.1
    backoff_max_seconds: float = 5.0
    auth_retry_seconds: float = 30.0
    connect_timeout_seconds: float = 10.0
    max_message_bytes: int = MAX_MESSAGE_BYTES
    proxy_url: str | None = None  # an HTTP proxy for every broker connection
    # --ca-file, --cert, --key (session.tls)
    tls_files: tls.ClientFiles = field(default_factory=tls.ClientFiles)
    tls_server_name: str | None = None  # the name every broker's certificate must have


def connect_url(broker: str) -> str:
    return broker.rstrip("/") + CONNECT_PATH


def backoff_delay(
    attempt: int,
    *,
    initial: float,
    maximum: float,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before attempt `attempt` + 1: doubling from `initial`, capped at
    `maximum`, the upper half jittered."""
    base = min(maximum, initial * (1 << min(attempt, 60)))
    return base / 2 + rand() * base / 2


def read_token(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise brokers.TokenFileError(f"cannot read the token file {path}: {exc.strerror}") from exc
    if not token:
        raise brokers.TokenFileError(f"the token file {path} is empty")
    return token


class Stopped(brokers.SessionError):
    """The agent is stopping."""


async def _unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T:
    """`work`'s result, or Stopped (and `work` cancelled) if `stop` is set first."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise Stopped("the agent is stopping")
    return task.result()


class Link:
    """One session the broker welcomed (or is about to): where outgoing messages queue."""

    def __init__(self) -> None:
        self.outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
        self.work: asyncio.Queue[messages.Offer | messages.Cancel | None] = asyncio.Queue()
        self.epoch = -1
        self.heartbeat_seconds = 5.0
        self.closed = False
        self.welcomed = False
        self.acks = False  # the broker acknowledges final reports (its welcome's protocol)
        self.checkpoints = False  # the broker reads checkpoints in job updates (protocol 4)

    def send(
        self, message: messages.Message, /, *, on_sent: Callable[[], None] | None = None
    ) -> None:
        if not self.closed:
            self.outbox.put_nowait((message, on_sent))

    def send_summary(self, summary: messages.Summary) -> None:
        self.send(summary)


class Router:
    """Sends to the current session, or drops while there is none."""

    def __init__(self) -> None:
        self.link: Link | None = None
        self.dropped = 0

    def send(
        self, message: messages.Message, /, *, on_sent: Callable[[], None] | None = None
    ) -> None:
        link = self.link
        if link is None or link.closed:
            self.dropped += 1
            return
        link.send(message, on_sent=on_sent)

    @property
    def connected(self) -> bool:
        return self.link is not None and self.link.welcomed and not self.link.closed


class Connector:
    def __init__(
        self,
        settings: ConnectSettings,
        *,
        handler: handling.JobHandler,
        reporter: reporting.SummaryReporter,
        router: Router,
    ) -> None:
        self.settings = settings
        self.handler = handler
        self.reporter = reporter
        self.router = router
        self.sessions = 0  # sessions the broker welcomed
        self.failures = 0
        self.brokers = brokers.BrokerList(settings.broker_urls)
        self._welcomed = False  # the current attempt's session was welcomed
        self._silent = False  # ... and then the broker stopped answering (frozen, cut off)
        self._heartbeat = settings.heartbeat_seconds  # the last welcome's
        self._close_reason = ""  # what the broker's close frame said, last
        # the offered jobs' templates and shapes, one of each kind (a sweep's offers share)
        self.interning: interning.Interners[jobs.PodTemplate, jobs.PodShape, jobs.Tasks] = (
            interning.Interners()
        )
        self.tls = tls.ClientTls(settings.tls_files) if settings.tls_files.given else None
        self.lease = leasing.ClusterLease(
            requested=settings.fence_after_seconds,
            heartbeat=settings.heartbeat_seconds,
            failure_grace=settings.failure_grace_seconds,
            on_lapse=handler.fence,
            on_renew=handler.unfence,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Keep a session open until `stop` is set, and the cluster lease with it. Raises
        `brokers.AuthError` when the token is refused before any session was welcomed while
        the agent holds no running job (see the module docstring)."""
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.settings.connect_timeout_seconds
        )
        keeping = asyncio.create_task(self.lease.keep(), name="agent-lease")
        try:
            async with aiohttp.ClientSession(
                timeout=timeout, raise_for_status=brokers.check_handshake
            ) as http:
                await self._connect(http, stop)
        finally:
            keeping.cancel()
            await asyncio.gather(keeping, return_exceptions=True)

    async def _connect(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        attempt = 0
        redirected: float | None = None  # a replica's Retry-After since the last welcome
        while not stop.is_set():
            delay = None
            refused = False  # the token was refused: its own, slow retry
            broker = self.brokers.current
            self._welcomed = False
            self._silent = False
            try:
                await self._run_session(http, stop, broker)
            except Stopped:
                break
            except brokers.NotLeader as exc:
                self.failures += 1
                redirected = exc.retry_after
                followed = self.brokers.not_leader(exc.leader)
                logger.info(
                    "broker %s is not the leader (%s): connecting to %s",
                    broker,
                    exc,
                    self.brokers.current,
                )
                if followed and self.brokers.hops <= 1:
                    delay = 0.0  # straight to the leader it named
                elif self.brokers.current == broker:
                    delay = exc.retry_after
            except brokers.AuthError as exc:
                self.failures += 1
                refused = True
                if self.sessions == 0 and not self.handler.holds_live_jobs():
                    if isinstance(exc, brokers.TokenFileError):  # nothing reached a broker
                        logger.error("cluster %s: %s (stopping)", self.settings.cluster, exc)
                        raise
                    logger.error(
                        "broker %s refused cluster %s: %s; fix the token (stopping)",
                        broker,
                        self.settings.cluster,
                        exc,
                    )
                    raise
                delay = self.settings.auth_retry_seconds * (0.9 + 0.2 * random.random())
                logger.error(
                    "broker %s refused cluster %s: %s; fix the token, retrying in %.0f s",
                    broker,
                    self.settings.cluster,
                    exc,
                    delay,
                )
            except (aiohttp.ClientError, OSError, TimeoutError, brokers.SessionError) as exc:
                self.failures += 1
                logger.warning(
                    "session with broker %s failed (attempt %d): %s; next: %s",
                    broker,
                    attempt + 1,
                    str(exc) or type(exc).__name__,
                    self._next_broker(),
                )
            except Exception:
                self.failures += 1
                logger.exception("session with broker %s broke", broker)
                self._next_broker()
            if stop.is_set():
                break
            if self._silent:  # a broker that stopped answering: another replica leads soon
                logger.info("broker %s went silent: trying %s next", broker, self.brokers.failed())
                delay = 0.0
            if self._welcomed:  # a session that worked: the same broker again, soon
                attempt = 0
                redirected = None
            if delay is None or delay > 0:
                backoff = backoff_delay(
                    attempt,
                    initial=self.settings.backoff_initial_seconds,
                    maximum=self.settings.backoff_max_seconds,
                )
                attempt += 1
                delay = backoff if delay is None else max(delay, backoff)
                if redirected is not None and not refused:
                    # a replica answered: the brokers are up and a leader is being chosen;
                    # ask again as often as they said, not at the backoff's ceiling
                    delay = min(delay, redirected)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    @property
    def connect_wait(self) -> float:
        """Seconds a connect and its upgrade may take: `--connect-timeout`, and no more than
        two heartbeats. A frozen broker completes the TCP handshake and never answers: waiting
        longer for it only brings the agent's fence closer while another replica leads."""
        return min(
            self.settings.connect_timeout_seconds,
            max(MIN_CONNECT_WAIT_SECONDS, CONNECT_WAIT_BEATS * self._heartbeat),
        )

    def _next_broker(self) -> str:
        """After a failure: the same broker if it welcomed the session that broke, else the
        next URL."""
        return (
            self.brokers.current if self._welcomed and not self._silent else self.brokers.failed()
        )

    async def _run_session(
        self, http: aiohttp.ClientSession, stop: asyncio.Event, broker: str
    ) -> bool:
        """One session with `broker`, from connect to drop. True if the broker welcomed it."""
        token = read_token(self.settings.token_file)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        url = connect_url(broker)
        try:
            async with asyncio.timeout(self.connect_wait):
                ws = await _unless_stopped(
                    http.ws_connect(
                        url,
                        headers=headers,
                        autoping=True,
                        proxy=self.settings.proxy_url,
                        ssl=self.tls.context() if self.tls is not None else True,
                        server_hostname=self.settings.tls_server_name,
                        max_msg_size=self.settings.max_message_bytes,
                        timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=2.0),
                    ),
                    stop,
                )
        except aiohttp.WSServerHandshakeError as exc:  # a 1xx-3xx that is not an upgrade
            raise brokers.SessionError(f"HTTP {exc.status} {exc.message} at {url}") from exc
        link = Link()
        self.router.link = link
        try:
            await _unless_stopped(self._greet(ws, link), stop)
            self.sessions += 1
            self._welcomed = True
            self.brokers.welcomed()
            logger.info(
                "session with broker %s open: cluster %s, epoch %d",
                broker,
                self.settings.cluster,
                link.epoch,
            )
            await self._serve(ws, link, stop)
        finally:
            link.closed = True
            if self.router.link is link:
                self.router.link = None
            self.reporter.detach()
            await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY)
        return link.welcomed

    async def _greet(self, ws: aiohttp.ClientWebSocketResponse, link: Link) -> None:
        async with self.handler.lock:  # no offer half-bound while the jobs are listed
            jobs = self.handler.hello_jobs()
        hello = messages.Hello(cluster=self.settings.cluster, jobs=jobs)
        await ws.send_str(messages.encode(hello))
        wait = max(self.settings.connect_timeout_seconds, 3 * self.settings.heartbeat_seconds)
        async with asyncio.timeout(wait):
            while True:
                message = await self._receive(ws)
                if message is None:  # refused for its token (4001, 4003), or gone
                    brokers.check_close(ws.close_code, self._close_reason)
                    raise brokers.SessionError("the broker closed the session before its welcome")
                if isinstance(message, messages.Welcome):
                    break
                logger.warning("ignoring %s before the broker's welcome", message.type)
        link.epoch = message.epoch
        link.heartbeat_seconds = self._heartbeat = message.heartbeat_seconds
        link.acks = message.v >= messages.ACKS_SINCE
        link.checkpoints = message.v >= messages.CHECKPOINTS_SINCE
        self.reporter.send_labels = message.v >= messages.LABELS_SINCE
        self.reporter.send_health = message.v >= messages.GPU_HEALTH_SINCE
        self.reporter.send_mig = message.v >= messages.MIG_SINCE
        link.welcomed = True
        self.lease.set_terms(
            heartbeat=message.heartbeat_seconds, lost_after=message.lost_after_seconds
        )
        self.lease.renew()

    async def _serve(
        self, ws: aiohttp.ClientWebSocketResponse, link: Link, stop: asyncio.Event
    ) -> None:
        first = self.reporter.attach(link.send_summary)
        resent = self.handler.updates.session_started(acks=link.acks, checkpoints=link.checkpoints)
        if resent:
            logger.info("sending %d final reports not acknowledged yet", resent)
        tasks = {
            asyncio.create_task(self._read(ws, link), name="agent-read"),
            asyncio.create_task(self._write(ws, link, first), name="agent-write"),
            asyncio.create_task(self._beat(link), name="agent-heartbeat"),
            asyncio.create_task(stop.wait(), name="agent-stop"),
        }
        worker = asyncio.create_task(self._work(link), name="agent-offers")
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and (exc := task.exception()) is not None:
                    raise brokers.SessionError(f"{task.get_name()}: {exc}") from exc
        finally:
            link.closed = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            link.work.put_nowait(None)
            try:
                await asyncio.wait_for(worker, self.settings.connect_timeout_seconds * 3)
            except TimeoutError:
                logger.error("an offer was still being handled when the session closed")

    async def _read(self, ws: aiohttp.ClientWebSocketResponse, link: Link) -> None:
        while True:
            timeout = 3 * link.heartbeat_seconds
            try:
                message = await self._receive(ws, wait=timeout)
            except TimeoutError:
                logger.warning("nothing from the broker for %.1f s: reconnecting", timeout)
                self._silent = True
                return
            if message is None:
                logger.info("the broker closed the session (code %s)", ws.close_code)
                return
            self.lease.renew()  # whatever it says, the broker is there
            if isinstance(message, messages.Offer | messages.Cancel):
                link.work.put_nowait(message)
            elif isinstance(message, messages.Ack):
                if message.epoch == link.epoch:  # an ack of another session is not for us
                    self.handler.updates.acknowledge(message.seqs)
            elif not isinstance(message, messages.Heartbeat):
                logger.warning("ignoring an unexpected %s message", message.type)

    async def _receive(
        self, ws: aiohttp.ClientWebSocketResponse, *, wait: float | None = None
    ) -> messages.Message | None:
        """The next message that decodes, or None once the socket is closed."""
        while True:
            frame = await ws.receive(timeout=wait)
            if frame.type == aiohttp.WSMsgType.CLOSE:
                self._close_reason = str(frame.extra or "")
            if frame.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                try:
                    return messages.decode(frame.data, interning=self.interning)
                except pydantic.ValidationError as exc:
                    logger.warning(
                        "ignoring a message that does not decode: %s",
                        exc.errors(include_url=False)[:3],
                    )
                continue
            if frame.type == aiohttp.WSMsgType.ERROR:
                logger.warning("session error: %s", ws.exception())
            return None

    async def _write(
        self, ws: aiohttp.ClientWebSocketResponse, link: Link, first: messages.Summary
    ) -> None:
        await ws.send_str(messages.encode(first))
        while True:
            message, on_sent = await link.outbox.get()
            if (
                not link.acks
                and isinstance(message, messages.JobUpdate)
                and message.seq is not None
            ):
                message = message.model_copy(update={"seq": None})  # protocol 1 forbids it
            await ws.send_str(messages.encode(message))
            if on_sent is not None:
                on_sent()

    async def _beat(self, link: Link) -> None:
        seq = 0
        while True:
            await asyncio.sleep(link.heartbeat_seconds)
            seq += 1
            link.send(messages.Heartbeat(seq=seq))
            if link.acks:
                self.handler.updates.resend_overdue()
            self.handler.housekeep()

    async def _work(self, link: Link) -> None:
        """Offers and cancels of this session, one at a time, in arrival order."""
        while True:
            item = await link.work.get()
            if item is None:
                return
            if link.closed:
                continue  # the broker learns what happened from the next hello
            try:
                if isinstance(item, messages.Offer):
                    await self.handler.handle_offer(item, session_epoch=link.epoch, reply=link.send)
                else:
                    await self.handler.handle_cancel(item)
            except Exception as exc:
                logger.exception("handling %s of job %s failed", item.type, item.job_id)
                if isinstance(item, messages.Offer):
                    link.send(
                        messages.Rejected(
                            job_id=item.job_id,
                            epoch=item.epoch,
                            reasons=[f"agent error: {exc}"],
                            attempt=item.attempt,
                        )
                    )
