"""Commits that share one etcd request.

`Sharing` sends the transactions given in one turn of the event loop, or while a request is on
its way, together in one request: each one nested in it (etcd's `request_txn`) keeps its own
compares and succeeds or fails alone, and all of them land at one revision, in the order given.
A commit given while no request is on its way is sent at the end of the loop's turn: nothing
waits for company.

At a moderate rate the broker's writers (new jobs, a cycle's dispatch, the agents' reports, a
deadline, the lease's term) each commit a few records at a time, and what a request costs the
broker is mostly the same whatever it carries: the gRPC call, the watch's event, the wake-ups
of the tasks around it. Sharing pays it once for the commits that waited together.

What goes together (`take`): the waiting commits in order, as many as keep the request within
etcd's bounds (`max_ops`: the nested transactions and the largest one's operations;
`max_bytes`) and write no key twice (etcd refuses a request that does); the rest wait for the
next request. A request etcd refuses as a whole for its shape (too many operations, too large:
a server whose bounds are lower than ours) never landed, and its commits are sent again one
request each. Any other error is every commit's answer, as it would have been each one's alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aetcd import rpc

from broker.state import errors

log = logging.getLogger(__name__)

NESTING_BYTES = 8  # what nesting a transaction adds to the request, at most (tag and length)
# etcd's answers to a request it refused for its shape, before applying any of it
REFUSED_SHAPES = frozenset({rpc.StatusCode.INVALID_ARGUMENT})


@dataclass(frozen=True)
class Answer:
    """A commit's own transaction response (`succeeded`, `responses`) and the revision of the
    request that carried it."""

    response: Any
    revision: int


@dataclass(eq=False)
class Waiting:
    """A commit waiting for its request: the transaction, its size, the keys it writes, and
    the future its answer is set on."""

    request: Any  # rpc.TxnRequest
    ops: int  # its largest branch: compares, success or failure operations
    size: int  # bytes
    keys: frozenset[bytes]  # keys it puts or deletes
    answer: asyncio.Future[Answer]


def waiting_of(request: Any, answer: asyncio.Future[Answer]) -> Waiting:
    keys = set()
    for op in request.success:
        if op.HasField("request_put"):
            keys.add(op.request_put.key)
        elif op.HasField("request_delete_range"):
            keys.add(op.request_delete_range.key)
    ops = max(len(request.compare), len(request.success), len(request.failure))
    return Waiting(request, ops, request.ByteSize(), frozenset(keys), answer)


def take(waiting: Sequence[Waiting], *, max_ops: int, max_bytes: int) -> int:
    """How many of the first `waiting` commits one request carries: at least one, and then as
    many as keep its nested transactions and the largest one's operations within `max_ops`,
    its bytes within `max_bytes`, and no key written twice."""
    keys: set[bytes] = set()
    size = largest = 0
    for count, item in enumerate(waiting):
        largest = max(largest, item.ops)
        size += item.size + NESTING_BYTES
        fits = count + 1 + largest <= max_ops and size <= max_bytes
        if count and not (fits and keys.isdisjoint(item.keys)):
            return count
        keys |= item.keys
    return len(waiting)


def nest(items: Sequence[Waiting]) -> Any:
    """One request carrying `items`' transactions, each nested: it has no compares of its own,
    so each nested one succeeds or fails by its own."""
    return rpc.TxnRequest(success=[rpc.RequestOp(request_txn=item.request) for item in items])


def answers(items: Sequence[Waiting], response: Any) -> list[Answer]:
    """Each item's answer from the response to its request (`nest`ed, unless alone)."""
    revision = int(response.header.revision)
    if len(items) == 1:
        return [Answer(response, revision)]
    return [Answer(op.response_txn, revision) for op in response.responses]


def refused_for_shape(exc: errors.StoreError) -> bool:
    """Whether etcd refused a request for its shape before applying any of it."""
    cause = exc.__cause__
    if not isinstance(cause, rpc.AioRpcError):
        cause = cause.__cause__ if cause is not None else None
    return isinstance(cause, rpc.AioRpcError) and cause.code() in REFUSED_SHAPES


class Sharing:
    """The commits waiting for a request, and the task that sends them (one request at a
    time); `send` is the store's call of one request, which raises store errors."""

    def __init__(
        self, send: Callable[[Any], Awaitable[Any]], *, max_ops: int, max_bytes: int
    ) -> None:
        self._send = send
        self.max_ops = max_ops
        self.max_bytes = max_bytes
        self._waiting: collections.deque[Waiting] = collections.deque()
        self._sender: asyncio.Task[None] | None = None
        self.requests = 0  # requests sent
        self.commits = 0  # commits they carried

    async def commit(self, request: Any) -> Answer:
        """Send `request` with whatever else waits; its own answer. Cancelled while it waits
        it is never sent; once sent, the request goes on for the others."""
        item = waiting_of(request, asyncio.get_running_loop().create_future())
        self._waiting.append(item)
        if self._sender is None or self._sender.done():
            # a context of its own: not the fields and span of the commit that started it
            self._sender = asyncio.create_task(
                self._run(), name="etcd-commits", context=contextvars.Context()
            )
        try:
            return await item.answer
        except asyncio.CancelledError:
            if item in self._waiting:
                self._waiting.remove(item)
            raise

    def close(self, problem: str) -> None:
        """Stop sending: what waits is answered with a StoreError saying `problem`."""
        if self._sender is not None:
            self._sender.cancel()
        while self._waiting:
            _fail(self._waiting.popleft(), errors.StoreError(problem))

    async def _run(self) -> None:
        try:
            while self._waiting:
                count = take(self._waiting, max_ops=self.max_ops, max_bytes=self.max_bytes)
                items = [self._waiting.popleft() for _ in range(count)]
                items = [item for item in items if not item.answer.done()]  # not cancelled
                if items:
                    await self._carry(items)
        except Exception as exc:  # a bug: what waits is answered with it, never stranded
            log.exception("etcd commits: the sender failed")
            while self._waiting:
                _fail(self._waiting.popleft(), exc)

    async def _carry(self, items: list[Waiting]) -> None:
        try:
            self.requests += 1
            response = await self._send(items[0].request if len(items) == 1 else nest(items))
        except errors.StoreError as exc:
            if len(items) > 1 and refused_for_shape(exc):
                log.warning(
                    "etcd refused %d transactions in one request (%s): one a request",
                    len(items),
                    exc,
                )
                for item in items:
                    await self._carry([item])
                return
            for item in items:
                _fail(item, exc)
            return
        except asyncio.CancelledError:  # the store closed: the request may have landed
            problem = "etcd txn: the store closed while the request was on its way"
            for item in items:
                _fail(item, errors.TemporaryStoreError(problem))
            raise
        except Exception as exc:  # a bug: every commit's answer, the sender goes on
            for item in items:
                _fail(item, exc)
            return
        self.commits += len(items)
        for item, answer in zip(items, answers(items, response), strict=True):
            if not item.answer.done():
                item.answer.set_result(answer)


def _fail(item: Waiting, exc: BaseException) -> None:
    if not item.answer.done():
        item.answer.set_exception(exc)
