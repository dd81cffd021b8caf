"""EtcdStore: the production Store on etcd v3, through the aetcd client.

Reads and transactions go to etcd's KV service directly (aetcd's stubs), so a commit gets the
revision it created and a list can page through any number of keys at one revision. Watches
use aetcd's watcher, wrapped: when the stream dies (etcd restarted, connection lost) the watch
is opened again from the revision after the last event it delivered, with backoff, so a
consumer sees every event exactly once; a compacted start revision raises CompactedError.

Leases are plain: `grant_lease`, `keep_alive` (one refresh; call it from a task of your own),
`revoke_lease`. aetcd and gRPC errors become `broker.state.errors` types, chained:
unreachable or timed out is TemporaryStoreError.

Given several endpoints (`etcd://A,B,C`), the store talks to one member at a time and fails
over to the next member that answers when a call to the current one cannot get through (at
most one attempt a second, so a whole-cluster outage answers fast). A read is then tried once
more on the new member; a transaction is not (it may have landed): its caller gets the
TemporaryStoreError and decides again from fresh state, as for any failed commit.

A transaction has a deadline (`write_timeout`, 5 s by default): a store that cannot commit
(no quorum: two of three members down) fails it with a TemporaryStoreError then (503 and
`Retry-After` at the API), never holds it until quorum returns. Once a transaction has run
out its deadline and none has committed since, the store is `stalled`: the next ones get a
probe's deadline (`stalled_timeout`: a few of the latest commits' round trips, at least a
second), so writes queued behind the first one do not each wait the whole deadline again; the
first commit that gets an answer ends the stall.

TLS and etcd users (`etcd_credentials.EtcdCredentials`) apply to every member: each client,
the first and every one a fail-over opens, is made with them. etcd forgets its auth tokens
when it restarts (and a JWT token expires): a call refused for its token authenticates again
on the same member and is tried once more, a transaction too (a refused one did not land).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import aetcd
from aetcd import rpc
from aetcd import utils as aetcd_utils

from broker.state import errors, etcd_credentials, etcd_sharing, store
from kits import tasks

log = logging.getLogger(__name__)
CLOSE_TIMEOUT = 5.0  # seconds the client's channel is given to close

DEFAULT_TIMEOUT = 5.0
DEFAULT_WRITE_TIMEOUT = 5.0  # a transaction the store cannot commit fails this soon
STALLED_MIN_TIMEOUT = 1.0  # a transaction while the store is stalled: at least this long ...
STALLED_ROUND_TRIPS = 4.0  # ... and this many of the latest commits' round trips
PROBE_TIMEOUT = 2.0
# commits sharing one request (`etcd_sharing`): its nested transactions and the largest one's
# operations within what one transaction may have (the job store's bound, under etcd's default
# --max-txn-ops of 128), and its bytes well under etcd's default --max-request-bytes (1.5 MiB)
SHARED_MAX_OPS = 100
SHARED_MAX_BYTES = 512 * 1024  # and half of etcd's --max-request-bytes at most
DEFAULT_MAX_REQUEST_BYTES = 1536 * 1024  # etcd's default --max-request-bytes (1.5 MiB)
PROBE_KEY = b"/gpufed/probe"  # under /gpufed/, where a least-privilege etcd role lets it read
FAILOVER_EVERY = 1.0  # seconds between two attempts to find another member
LIST_PAGE_SIZE = 1_000
WATCH_BACKOFF_INITIAL = 0.05
WATCH_BACKOFF_MAX = 2.0
ALARM_NAMES = {1: "NOSPACE", 2: "CORRUPT"}  # etcdserverpb.AlarmType
CHANNEL_OPTIONS: dict[str, int] = {
    # Reconnect quickly after etcd restarts (gRPC's default first backoff is 1 s).
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 2_000,
    # Notice a dead peer on an idle watch stream (etcd allows pings every 5 s).
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
}
TEMPORARY_CODES = frozenset(
    {
        rpc.StatusCode.UNAVAILABLE,
        rpc.StatusCode.DEADLINE_EXCEEDED,
        rpc.StatusCode.RESOURCE_EXHAUSTED,
        rpc.StatusCode.ABORTED,
    }
)
# etcd's answer to a write while its space quota alarm (NOSPACE) is raised. Not temporary: every
# member refuses writes and lease grants until an operator frees space and disarms the alarm
# (reads, deletes and lease renewals keep working).
NO_SPACE_DETAIL = "database space exceeded"
NO_SPACE_ADVICE = (
    "etcd's space quota alarm is raised: compact and defragment etcd, then disarm the alarm"
)
# etcd's answers to a token it does not know (it restarted; a JWT expired) or that predates a
# change of users or roles: authenticating again is the cure.
REFUSED_TOKEN_DETAILS = ("invalid auth token", "revision of auth store is old")
# etcd's answers when it could not commit in time (no quorum, no leader, a leader election):
# the same request may succeed later. "context deadline exceeded" is the server giving up at
# the request's own deadline, answered as UNKNOWN.
UNCOMMITTED_DETAILS = (
    "context deadline exceeded",
    "etcdserver: request timed out",
    "etcdserver: no leader",
    "etcdserver: leader changed",
    "etcdserver: too many requests",
)
# INTERNAL with these details is gRPC core failing to send on a connection that broke (a
# member killed mid-call, seen on a watch), not an answer of etcd's: another member may serve
LOCAL_TRANSPORT_FAILURE = "Internal error from Core"
TEMPORARY_CLIENT_ERRORS = (
    aetcd.ConnectionFailedError,
    aetcd.ConnectionTimeoutError,
    aetcd.WatchTimeoutError,
    TimeoutError,
)


class AuthTokenRefusedError(errors.TemporaryStoreError):
    """etcd refused the client's auth token (it restarted, the token expired, the users
    changed); the store authenticates again, and callers see this if that fails too."""


def translate_error(exc: BaseException, what: str) -> errors.StoreError:
    """The store error for an aetcd or gRPC failure of `what` (the caller chains it)."""
    rpc_error = exc if isinstance(exc, rpc.AioRpcError) else exc.__cause__
    details = rpc_error.details() if isinstance(rpc_error, rpc.AioRpcError) else str(exc)
    message = f"etcd {what}: {details}"
    if isinstance(exc, aetcd.RevisionCompactedError) or "has been compacted" in details:
        return errors.CompactedError(message)
    if "lease not found" in details:
        return errors.LeaseExpiredError(message)
    if any(text in details for text in REFUSED_TOKEN_DETAILS):
        return AuthTokenRefusedError(message)
    if NO_SPACE_DETAIL in details:  # before the codes: etcd answers it as RESOURCE_EXHAUSTED
        return errors.StoreFullError(f"{message} ({NO_SPACE_ADVICE})")
    if isinstance(exc, TEMPORARY_CLIENT_ERRORS):
        return errors.TemporaryStoreError(message)
    if any(text in details for text in UNCOMMITTED_DETAILS):
        return errors.TemporaryStoreError(message)
    if isinstance(rpc_error, rpc.AioRpcError) and rpc_error.code() in TEMPORARY_CODES:
        return errors.TemporaryStoreError(message)
    if isinstance(rpc_error, rpc.AioRpcError) and details.startswith(LOCAL_TRANSPORT_FAILURE):
        return errors.TemporaryStoreError(message)  # gRPC's own: the member went away mid-call
    return errors.StoreError(message)


@contextlib.contextmanager
def translating_errors(what: str) -> Iterator[None]:
    """Raise aetcd and gRPC errors of the block as store errors."""
    try:
        yield
    except (aetcd.ClientError, rpc.AioRpcError, TimeoutError) as exc:
        raise translate_error(exc, what) from exc


def encode_prefix(prefix: str) -> tuple[bytes, bytes]:
    """etcd's [key, range_end) for every key under `prefix` (all keys if it is empty)."""
    if not prefix:
        return b"\0", b"\0"
    key = prefix.encode()
    return key, aetcd_utils.prefix_range_end(key)


def decode_entry(kv: Any) -> store.Entry:
    return store.Entry(
        key=kv.key.decode(),
        value=bytes(kv.value),
        mod_revision=int(kv.mod_revision),
        create_revision=int(kv.create_revision),
    )


def build_compare(compare: store.Compare) -> Any:
    key = compare.key.encode()
    if compare.mod_revision == 0:  # must not exist
        return rpc.Compare(
            key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=0
        )
    return rpc.Compare(
        key=key,
        target=rpc.Compare.MOD,
        result=rpc.Compare.EQUAL,
        mod_revision=compare.mod_revision,
    )


def build_txn_request(txn: store.Txn) -> Any:
    success = [
        rpc.RequestOp(
            request_put=rpc.PutRequest(key=key.encode(), value=value, lease=txn.lease_of(key))
        )
        for key, value in txn.puts
    ]
    success += [
        rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key.encode()))
        for key in txn.deletes
    ]
    # On failure, read the compared keys so the ConflictError can say what they are now.
    failure = [
        rpc.RequestOp(request_range=rpc.RangeRequest(key=compare.key.encode(), keys_only=True))
        for compare in txn.compares
    ]
    return rpc.TxnRequest(
        compare=[build_compare(compare) for compare in txn.compares],
        success=success,
        failure=failure,
    )


class EtcdStore(store.Shortcuts):
    """The Store on an etcd cluster; create it with `await EtcdStore.connect(endpoints)`."""

    def __init__(
        self,
        client: aetcd.Client,
        *,
        endpoint: str,
        rpc_timeout: float = DEFAULT_TIMEOUT,
        endpoints: Sequence[tuple[str, int]] = (),
        credentials: etcd_credentials.EtcdCredentials = etcd_credentials.NONE,
        write_timeout: float = DEFAULT_WRITE_TIMEOUT,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self.endpoint = endpoint
        self._client = client
        self._timeout = rpc_timeout
        self.write_timeout = write_timeout
        self.stalled = False  # a transaction ran out its deadline, none committed since
        self._commit_seconds = 0.0  # the latest commits' round trip (moving average)
        self._credentials = credentials
        self._closing = asyncio.Event()
        self._endpoints = list(endpoints)
        self._switching = asyncio.Lock()
        self._tried_at = 0.0
        # the transactions given while one is on its way go together in the next request
        self.max_request_bytes = max_request_bytes
        self._sharing = etcd_sharing.Sharing(
            self._send_txn,
            max_ops=SHARED_MAX_OPS,
            max_bytes=min(SHARED_MAX_BYTES, max_request_bytes // 2),
        )

    @classmethod
    async def connect(
        cls,
        endpoints: Sequence[tuple[str, int]],
        *,
        rpc_timeout: float = DEFAULT_TIMEOUT,
        credentials: etcd_credentials.EtcdCredentials = etcd_credentials.NONE,
        write_timeout: float = DEFAULT_WRITE_TIMEOUT,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> EtcdStore:
        """A store on the first of `endpoints` (host, port) that answers; it fails over to
        the others later, with the same `credentials` (TLS, user).

        `rpc_timeout` bounds each unary call (seconds); watches are not bounded by it.
        `write_timeout` bounds a transaction (`commit`); `max_request_bytes` is etcd's
        `--max-request-bytes`, which the commits sharing a request stay well within.
        """
        failures: builtins.list[str] = []
        temporary = False
        for host, port in endpoints:
            try:
                client = await _open_client(
                    host, port, rpc_timeout=rpc_timeout, credentials=credentials
                )
            except errors.StoreError as exc:
                failures.append(f"{host}:{port} ({exc})")
                temporary = temporary or isinstance(exc, errors.TemporaryStoreError)
                continue
            return cls(
                client,
                endpoint=f"{host}:{port}",
                rpc_timeout=rpc_timeout,
                endpoints=endpoints,
                credentials=credentials,
                write_timeout=write_timeout,
                max_request_bytes=max_request_bytes,
            )
        error = errors.TemporaryStoreError if temporary else errors.StoreError
        raise error(f"no etcd endpoint answers: {'; '.join(failures)}")

    def connector(self) -> Callable[[], Awaitable[EtcdStore]]:
        """Opens another store on the same members (the one this store talks to first), with
        the same credentials: a connection of its own for a task that must not queue behind
        this one's calls (`state.renewing`: the leader's lease keeper). Call it on the loop
        this store runs on: gRPC's asyncio stack is not fit for several loops."""
        current = self.endpoint.rsplit(":", 1)
        first = [(host, port) for host, port in self._endpoints if [host, str(port)] == current]
        endpoints = first + [e for e in self._endpoints if e not in first]
        timeout, credentials, write_timeout = self._timeout, self._credentials, self.write_timeout
        max_request_bytes = self.max_request_bytes

        async def connect() -> EtcdStore:
            return await EtcdStore.connect(
                endpoints or [(current[0], int(current[1]))],
                rpc_timeout=timeout,
                credentials=credentials,
                write_timeout=write_timeout,
                max_request_bytes=max_request_bytes,
            )

        return connect

    async def _fail_over(self, failed: aetcd.Client) -> bool:
        """Move to the next member that answers, after `failed` could not be reached; True
        if the store now talks to another member."""
        async with self._switching:
            if self._client is not failed:
                return True  # another call has moved on already
            if len(self._endpoints) < 2 or self._closing.is_set():
                return False
            now = time.monotonic()
            if now - self._tried_at < FAILOVER_EVERY:
                return False
            self._tried_at = now
            current = self.endpoint
            names = [f"{host}:{port}" for host, port in self._endpoints]
            start = names.index(current) + 1 if current in names else 0
            for step in range(len(names) - 1):
                host, port = self._endpoints[(start + step) % len(names)]
                try:
                    client = await _open_client(
                        host, port, rpc_timeout=self._timeout, credentials=self._credentials
                    )
                except errors.StoreError as exc:
                    log.warning("etcd member %s:%s does not answer either: %s", host, port, exc)
                    continue
                self._client, self.endpoint = client, f"{host}:{port}"
                log.warning("etcd member %s unreachable: now using %s", current, self.endpoint)
                await _close_client(failed, 1.0)
                return True
            return False

    async def _authenticate_again(self, refused: aetcd.Client) -> bool:
        """A new client of the current member (a new auth token), after `refused`'s token was
        refused; True if the store now has one."""
        async with self._switching:
            if self._client is not refused:
                return True  # another call has done it already
            if self._closing.is_set():
                return False
            host, _, port = self.endpoint.rpartition(":")
            try:
                client = await _open_client(
                    host, int(port), rpc_timeout=self._timeout, credentials=self._credentials
                )
            except errors.StoreError as exc:
                log.warning("etcd %s: cannot authenticate again: %s", self.endpoint, exc)
                return False
            self._client = client
            log.info("etcd %s refused the auth token: authenticated again", self.endpoint)
            await _close_client(refused, 1.0)
            return True

    async def _recover(self, failed: aetcd.Client, exc: errors.TemporaryStoreError) -> bool:
        """After `exc` on `failed`: authenticate again (a refused token) or fail over; True if
        the store now has another client."""
        if isinstance(exc, AuthTokenRefusedError):
            return await self._authenticate_again(failed)
        return await self._fail_over(failed)

    async def _call(self, what: str, call: Callable[[aetcd.Client], Awaitable[Any]], *,
                    retry: bool) -> Any:  # fmt: skip
        """`call` on the current member; after a TemporaryStoreError, fail over (and, for a
        call that may run twice, `retry` it once on the new member). A call refused for its
        auth token is tried again once authenticated again, `retry` or not: it did not run."""
        client = self._client
        try:
            return await call(client)
        except errors.TemporaryStoreError as exc:
            moved = await self._recover(client, exc)
            if not (moved and (retry or isinstance(exc, AuthTokenRefusedError))):
                raise
            log.info("etcd %s: trying again on %s", what, self.endpoint)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._client is client or (task is not None and task.cancelling()):
                raise  # a real cancellation
            # gRPC cancels the calls of a client another call replaced (a fail-over, a new
            # authentication) and closed: the call did not finish, it may have landed
            problem = f"etcd {what}: interrupted when the store moved to a new connection"
            if not retry:
                raise errors.TemporaryStoreError(problem) from None
            log.info("%s; trying again on %s", problem, self.endpoint)
        return await call(self._client)

    # -- the Store protocol ------------------------------------------------------------------

    async def get(self, key: str) -> store.Entry | None:
        response = await self._read_range(key.encode(), None)
        return decode_entry(response.kvs[0]) if response.kvs else None

    async def list(self, prefix: str) -> tuple[builtins.list[store.Entry], int]:
        start, end = encode_prefix(prefix)
        for _ in range(3):
            try:
                return await self._read_pages(start, end)
            except errors.CompactedError:  # compacted between two pages: read again
                continue
        raise errors.TemporaryStoreError(f"etcd list {prefix!r}: compacted while paging")

    async def commit(self, txn: store.Txn) -> int:
        store.check_txn(txn)
        answer = await self._sharing.commit(build_txn_request(txn))
        response = answer.response
        if not response.succeeded:
            failed = {}
            for compare, op in zip(txn.compares, response.responses, strict=True):
                kvs = op.response_range.kvs
                current = int(kvs[0].mod_revision) if kvs else 0
                if current != compare.mod_revision:
                    failed[compare.key] = current
            raise errors.ConflictError(
                f"compare failed (key: current revision): {failed}", revisions=failed
            )
        return answer.revision

    async def _send_txn(self, request: Any) -> Any:
        """One transaction request (some commits' own, nested or not: `etcd_sharing`), within
        the deadline; its response."""
        deadline = self.commit_timeout()
        started = time.monotonic()

        async def send(client: aetcd.Client) -> Any:
            stub = self._stub("txn", client)
            with translating_errors("txn"):
                return await stub.Txn(request, timeout=deadline, metadata=client.metadata)

        try:
            response = await self._call("txn", send, retry=False)
        except errors.TemporaryStoreError as exc:
            if time.monotonic() - started >= deadline * 0.9:  # not answered in time
                self.stalled = True
                raise errors.TemporaryStoreError(
                    f"etcd txn: not committed within {deadline:g} s (has etcd lost its "
                    f"quorum?): {exc}"
                ) from exc
            raise
        self._answered(time.monotonic() - started)
        return response

    def watch(self, prefix: str, *, start_revision: int) -> AsyncIterator[store.WatchEvent]:
        if start_revision < 1:
            raise ValueError(f"start_revision must be >= 1, not {start_revision}")
        return self._follow_watch(prefix, start_revision)

    async def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._sharing.close("etcd txn: the store is closed")
        if not await _close_client(self._client, CLOSE_TIMEOUT):
            log.warning("the etcd client did not close within %.0f s; left behind", CLOSE_TIMEOUT)

    def commit_timeout(self) -> float:
        """The deadline of the next transaction: `write_timeout`, or while the store is
        `stalled` a probe's (a few of the latest commits' round trips, at least a second)."""
        if not self.stalled:
            return self.write_timeout
        probe = max(STALLED_MIN_TIMEOUT, STALLED_ROUND_TRIPS * self._commit_seconds)
        return min(self.write_timeout, probe)

    def _answered(self, seconds: float) -> None:
        """A transaction got its answer (committed or refused) after `seconds`."""
        if self.stalled:
            log.warning("etcd commits again (a transaction answered in %.3f s)", seconds)
        self.stalled = False
        average = self._commit_seconds
        self._commit_seconds = seconds if average == 0.0 else 0.8 * average + 0.2 * seconds

    # -- DurableStore extras -----------------------------------------------------------------

    async def grant_lease(self, ttl: int) -> int:
        self._check_open("grant lease")

        async def grant(client: aetcd.Client) -> Any:
            with translating_errors("grant lease"):
                return await client.lease(ttl)

        lease = await self._call("grant lease", grant, retry=False)
        return int(lease.id)

    async def keep_alive(self, lease: int) -> int:
        self._check_open("keep lease alive")

        async def refresh(client: aetcd.Client) -> Any:
            with translating_errors(f"keep lease {lease} alive"):
                return await client.refresh_lease(lease)

        reply = await self._call("keep lease alive", refresh, retry=True)
        if reply is None:
            raise errors.TemporaryStoreError(f"etcd keep lease {lease} alive: no reply")
        if reply.TTL <= 0:
            raise errors.LeaseExpiredError(f"etcd lease {lease} has expired")
        return int(reply.TTL)

    async def revoke_lease(self, lease: int) -> None:
        self._check_open("revoke lease")
        with contextlib.suppress(errors.LeaseExpiredError), translating_errors("revoke lease"):
            await self._client.revoke_lease(lease)

    async def alarms(self) -> set[str]:
        """The names of etcd's raised alarms (`NOSPACE`, `CORRUPT`), of every member."""

        async def read(client: aetcd.Client) -> set[str]:
            with translating_errors("list alarms"):
                return {ALARM_NAMES.get(a.alarm_type, str(a.alarm_type)) async for a in
                        client.list_alarms()}  # fmt: skip

        self._check_open("list alarms")
        found: set[str] = await self._call("list alarms", read, retry=True)
        return found

    async def compact(self, revision: int) -> None:
        self._check_open("compact")
        with contextlib.suppress(errors.CompactedError), translating_errors("compact"):
            await self._client.compact(revision, physical=True)

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closing.is_set():
            raise errors.StoreError(f"etcd {what}: the store is closed")

    def _stub(self, what: str, client: aetcd.Client | None = None) -> Any:
        self._check_open(what)
        client = client or self._client
        if client.kvstub is None:
            raise errors.StoreError(f"etcd {what}: the client is not connected")
        return client.kvstub

    async def _read_range(
        self,
        key: bytes,
        range_end: bytes | None,
        *,
        limit: int = 0,
        revision: int = 0,
        rpc_timeout: float | None = None,
    ) -> Any:
        request = rpc.RangeRequest(key=key, limit=limit, revision=revision)
        if range_end is not None:
            request.range_end = range_end

        async def read(client: aetcd.Client) -> Any:
            stub = self._stub("range", client)
            with translating_errors("range"):
                return await stub.Range(
                    request, timeout=rpc_timeout or self._timeout, metadata=client.metadata
                )

        return await self._call("range", read, retry=True)

    async def _read_pages(self, start: bytes, end: bytes) -> tuple[builtins.list[store.Entry], int]:
        """Every entry in [start, end), sorted by key, read page by page at one revision."""
        entries: builtins.list[store.Entry] = []
        revision = 0
        while True:
            response = await self._read_range(start, end, limit=LIST_PAGE_SIZE, revision=revision)
            revision = revision or int(response.header.revision)
            entries.extend(decode_entry(kv) for kv in response.kvs)
            if not response.more or not response.kvs:
                return entries, revision
            start = response.kvs[-1].key + b"\0"

    async def _follow_watch(
        self, prefix: str, start_revision: int
    ) -> AsyncIterator[store.WatchEvent]:
        key, range_end = encode_prefix(prefix)
        next_revision = start_revision
        delay = WATCH_BACKOFF_INITIAL
        while not self._closing.is_set():
            watch = None
            client = self._client
            try:
                with translating_errors(f"watch {prefix!r} from {next_revision}"):
                    watch = await client.watch(
                        key, range_end=range_end, start_revision=next_revision
                    )
                    async for event in watch:
                        delay = WATCH_BACKOFF_INITIAL
                        kv = event.kv
                        next_revision = int(kv.mod_revision) + 1
                        yield store.WatchEvent(
                            type=store.EventType.PUT
                            if event.kind == aetcd.EventKind.PUT
                            else store.EventType.DELETE,
                            key=kv.key.decode(),
                            value=bytes(kv.value),
                            revision=int(kv.mod_revision),
                        )
            except errors.TemporaryStoreError as exc:
                if self._closing.is_set():
                    return
                log.warning("%s; resuming in %.2f s", exc, delay)
                await self._recover(client, exc)  # another member, if this one is gone
                if self._credentials.user is not None:
                    # etcd may have restarted and forgotten the token, and a watch it refuses
                    # looks created to aetcd: a read authenticates again if it must.
                    with contextlib.suppress(errors.StoreError):
                        await self._read_range(PROBE_KEY, None)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closing.is_set() or (task is not None and task.cancelling()):
                    raise  # the consumer (or the store) is going away: a real cancellation
                # gRPC cancels a stream whose client was closed by a fail-over: watch again
                log.warning("etcd watch %r: its client was closed; resuming", prefix)
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(watch.cancel(), 1.0)
            # The stream ended or broke: wait (unless closing) and watch again.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, WATCH_BACKOFF_MAX)


async def _close_client(client: aetcd.Client, timeout: float) -> bool:
    """Close `client`, waiting for it at most `timeout` seconds; True if it closed. A close
    that does not answer is cancelled and left behind, never waited for again: not
    `wait_for`, which on its timeout (or its caller's cancellation) waits for the close to
    take the cancellation, and a gRPC channel's close may never take it (a term's end, a
    fail-over, the exit would hang on it)."""
    closing = asyncio.ensure_future(client.close())
    try:
        done, _ = await asyncio.wait({closing}, timeout=timeout)
    except asyncio.CancelledError:
        closing.cancel()
        closing.add_done_callback(tasks.retrieve)
        raise
    if not done:
        closing.cancel()
        closing.add_done_callback(tasks.retrieve)
        return False
    if not closing.cancelled() and closing.exception() is not None:
        log.warning("closing an etcd client failed: %s", closing.exception())
    return True


async def _open_client(
    host: str, port: int, *, rpc_timeout: float, credentials: etcd_credentials.EtcdCredentials
) -> aetcd.Client:
    """A connected client of the member at host:port that has answered a read."""
    client = etcd_credentials.make_client(
        host, port, credentials, timeout=rpc_timeout, options=CHANNEL_OPTIONS
    )
    who = f" as user {credentials.user!r}" if credentials.user is not None else ""
    try:
        with translating_errors(f"connect {host}:{port}{who}"):
            await client.connect()
            request = rpc.RangeRequest(key=PROBE_KEY)
            await client.kvstub.Range(request, timeout=PROBE_TIMEOUT, metadata=client.metadata)
    except errors.StoreError:
        await client.close()
        raise
    return client
