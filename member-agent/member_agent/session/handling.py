"""What the agent does with offers, cancels and pod events; the replies and job updates.

`JobHandler` is driven by the session (`connecting.Connector`) and by the backend's event
stream; it owns the job table, which starts with the jobs found in the cluster (`adopt`, see
`adopting`). Offers and cancels are handled one at a time under `lock`, so two offers never book
the same GPUs: each offer is checked (epoch, held already, the limits file and the namespace's
ResourceQuotas, see `limits.check_gpus`),
placed with `placement.gang.place_gang` on the live inventory and bound all-or-nothing with
`binding.create_gang`. Pod events move jobs through Running, Succeeded and Failed; a failed gang
has its remaining pods deleted. No socket here: messages leave through `send` and `reply`.

Attempts: an offer of the attempt the table holds is a re-send, answered with the same pods
(and the final state, if reached); one of a later attempt (the broker runs the job again: a
retry, a preemption, a lost cluster) deletes the earlier attempt's live pods, drops its record
and is placed as new, its pods named for the attempt (`jobs.pod_name`); one of an earlier
attempt is rejected. A cancel stops only the attempt it names (or an earlier one).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

from opentelemetry import propagate, trace
from prometheus_client import Histogram

from broker.api import jobs, messages, status
from member_agent.binding import binding
from member_agent.cluster import base
from member_agent.inventory import model
from member_agent.placement import gang, indexing
from member_agent.session import adopting, limits, table

logger = logging.getLogger(__name__)
tracer = trace.get_tracer("member_agent.session")


def _trace_id(traceparent: str | None) -> str:
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) == 4 else ""


Reply = Callable[[messages.Message], None]

# seconds; the agent's placement target is p99 <= 10 ms
PLACEMENT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class Send(Protocol):
    def __call__(
        self, message: messages.Message, /, *, on_sent: Callable[[], None] | None = None
    ) -> None: ...


def _nothing() -> None:
    return None


class JobHandler:
    def __init__(
        self,
        backend: base.ClusterBackend,
        *,
        send: Send,
        agent_limits: limits.AgentLimits | None = None,
        on_change: Callable[[], None] = _nothing,
        clock: Callable[[], float] = time.monotonic,
        failure_grace_seconds: float = 30.0,
        policy: str = "default",
        jobs_table: table.JobTable | None = None,
    ) -> None:
        self.backend = backend
        self.send = send
        self.limits = agent_limits or limits.AgentLimits()
        self.on_change = on_change
        self.clock = clock
        self.failure_grace_seconds = failure_grace_seconds
        self.policy = policy
        self.table = jobs_table or table.JobTable()
        self.lock = asyncio.Lock()
        self.offers: Counter[str] = Counter()
        # time to choose nodes and GPUs for an offer's gang; `telemetry.AgentCollector` exports it
        self.placement_duration = Histogram(
            "gpufed_agent_placement_duration_seconds",
            "Choosing nodes and GPUs for one offer's gang (index refresh and place_gang)",
            buckets=PLACEMENT_BUCKETS,
            registry=None,
        )
        # pods deleted by a rollback whose DELETED event has not come yet
        self._tombstones: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # free capacity indexed for placement, kept current node by node
        self._index: indexing.FreeIndex | None = None
        self._stale_nodes: set[str] = set()
        self._pruned = -math.inf

    # -- offers ----------------------------------------------------------------------------

    async def handle_offer(
        self, offer: messages.Offer, *, session_epoch: int, reply: Reply
    ) -> None:
        async with self.lock:
            result = await self._handle_offer(offer, session_epoch=session_epoch, reply=reply)
        self.offers[result] += 1

    async def _handle_offer(
        self, offer: messages.Offer, *, session_epoch: int, reply: Reply
    ) -> str:
        def reject(result: str, reasons: list[str]) -> str:
            logger.info(
                "offer %s rejected: %s",
                offer.job_id,
                "; ".join(reasons),
                extra={"job_id": offer.job_id, "trace_id": _trace_id(offer.traceparent)},
            )
            reply(
                messages.Rejected(
                    job_id=offer.job_id,
                    epoch=offer.epoch,
                    reasons=reasons,
                    traceparent=offer.traceparent,
                    attempt=offer.attempt,
                )
            )
            return result

        now = self.clock()
        if now - self._pruned >= 1.0:
            self.table.prune(now=now)
            self._pruned = now
        if offer.epoch != session_epoch:
            return reject("stale", [f"stale epoch {offer.epoch}: this session is {session_epoch}"])
        held = self.table.get(offer.job_id)
        if held is not None and held.attempt > offer.attempt:
            return reject(
                "stale",
                [f"stale attempt {offer.attempt}: this cluster holds attempt {held.attempt}"],
            )
        if held is not None and held.attempt == offer.attempt:
            held.epoch = offer.epoch
            reply(self._accepted(held))
            if held.state != status.JobState.DISPATCHED:
                self._send_update(held, held.state, held.reason)
            return "resent"
        earlier = self.table.supersede(offer.job_id, offer.attempt)
        if earlier is not None:
            await self._retire(earlier, attempt=offer.attempt)
        try:
            request = jobs.gang_request(offer.job_id, offer.job, attempt=offer.attempt)
        except jobs.ShapeError as exc:
            return reject("invalid", [str(exc)])
        namespace = offer.job.metadata.namespace
        over = limits.check_gpus(
            self.limits,
            namespace,
            in_use=self.table.gpus_in_use(namespace),
            asked=request.gpus,
            quotas=self.backend.gpu_quotas(namespace),
        )
        if over is not None:  # the file or a ResourceQuota: one `limit` result for both
            return reject("limit", [over.reason])
        context = propagate.extract({"traceparent": offer.traceparent or ""})
        with tracer.start_as_current_span(
            "agent.place",
            context=context,
            attributes={"job_id": offer.job_id, "pods": request.pods},
        ):
            inventory = self.backend.inventory()
            with self.placement_duration.time():
                placement = gang.place_gang(
                    inventory, request, policy=self.policy, index=self._fresh_index(inventory)
                )
        if isinstance(placement, gang.Unplaceable):
            return reject("unplaceable", sorted(placement.reasons))
        requests = binding.build_requests(
            offer.job_id,
            offer.job,
            placement,
            traceparent=offer.traceparent,
            epoch=offer.epoch,
            attempt=offer.attempt,
        )
        record = table.JobRecord(
            job_id=offer.job_id,
            epoch=offer.epoch,
            namespace=namespace,
            gpus=request.gpus,
            min_member=request.min_member,
            traceparent=offer.traceparent,
            attempt=offer.attempt,
            pods={
                r.name: status.PodStatus(name=r.name, task=r.task, node=r.node, gpus=list(r.gpus))
                for r in requests
            },
        )
        self.table.add(record)
        self._stale_nodes.update(r.node for r in requests)
        try:
            with tracer.start_as_current_span(
                "agent.bind",
                context=context,
                attributes={"job_id": offer.job_id, "pods": len(requests)},
            ):
                await binding.create_gang(self.backend, requests)
        except binding.BindingError as exc:
            self.table.remove(offer.job_id)
            self._tombstones.update(exc.rolled_back)
            self.on_change()
            return reject("binding_failed", [f"creating pods failed: {exc}"])
        except BaseException:
            self.table.remove(offer.job_id)
            raise
        record.binding = False
        reply(self._accepted(record))
        logger.debug(
            "offer %s accepted: %d pods, %d GPUs", offer.job_id, len(requests), request.gpus
        )
        self._follow(record)
        self.on_change()
        return "accepted"

    def _accepted(self, record: table.JobRecord) -> messages.Accepted:
        return messages.Accepted(
            job_id=record.job_id,
            epoch=record.epoch,
            pods=record.placements(),
            traceparent=record.traceparent,
            attempt=record.attempt,
        )

    async def _retire(self, record: table.JobRecord, *, attempt: int) -> None:
        """An earlier attempt of a job the broker runs again: its live pods go, with the
        failure grace (its failed ones stay for their logs, under names of their own)."""
        live = record.live_pods()
        logger.info(
            "job %s: attempt %d replaces attempt %d (%s), deleting %d live pods",
            record.job_id,
            attempt,
            record.attempt,
            record.state.value,
            len(live),
            extra={"job_id": record.job_id, "trace_id": _trace_id(record.traceparent)},
        )
        self._stale_nodes.update(p.node for p in live)
        await self._delete_live(record)

    def _fresh_index(self, inventory: model.Inventory) -> indexing.FreeIndex:
        """The placement index, with the nodes changed since the last offer read again."""
        index = self._index
        if index is not None and all(name in inventory.nodes for name in self._stale_nodes):
            for name in self._stale_nodes:
                index.refresh(inventory.nodes[name])
        else:
            index = self._index = indexing.FreeIndex.build(inventory)
        self._stale_nodes.clear()
        return index

    # -- cancels ---------------------------------------------------------------------------

    async def handle_cancel(self, cancel: messages.Cancel) -> None:
        async with self.lock:
            record = self.table.get(cancel.job_id)
            earlier = self.table.supersede(cancel.job_id, cancel.attempt)
            if earlier is not None:  # the broker has moved past it: it goes too
                await self._retire(earlier, attempt=cancel.attempt)
                record = None
            if record is None or record.attempt > cancel.attempt:
                # nothing of that attempt here (a later one keeps running): it is stopped
                self.send(
                    messages.JobUpdate(
                        job_id=cancel.job_id,
                        epoch=cancel.epoch,
                        state=status.JobState.CANCELLED,
                        reason=cancel.reason,
                        traceparent=cancel.traceparent,
                        attempt=cancel.attempt,
                    )
                )
                return
            if record.state.terminal:
                self._send_update(record, record.state, record.reason)
                return
            record.finish(status.JobState.CANCELLED, cancel.reason, now=self.clock())
            pods = [p for p in record.pods.values() if p.phase != status.PodPhase.DELETED]
            failed = set(
                await binding.delete_pods(
                    self.backend,
                    ((record.namespace, p.name) for p in pods),
                    grace_seconds=cancel.grace_seconds,
                )
            )
            for pod in pods:
                if pod.name not in failed:
                    record.set_phase(pod, status.PodPhase.DELETED, reason=cancel.reason)
            message = f"{len(failed)} pods could not be deleted" if failed else ""
            update = record.update()
            update.message = message
            self.send(update, on_sent=self._reported(record))
            logger.info("job %s cancelled: %s", cancel.job_id, cancel.reason)
            self.on_change()

    # -- pod events ------------------------------------------------------------------------

    def handle_event(self, event: base.BackendEvent) -> None:
        """Apply one backend event; inventory changes are the reporter's business."""
        if not isinstance(event, base.PodEvent):
            self._index = None  # nodes changed: index them again
            return
        if event.node:
            self._stale_nodes.add(event.node)
        if event.phase == status.PodPhase.DELETED and event.name in self._tombstones:
            self._tombstones.discard(event.name)
            return
        record = self.table.get(event.job_id)
        if record is None:
            return
        pod = record.pods.get(event.name)
        if pod is None:
            return
        record.set_phase(pod, event.phase, reason=event.reason)
        self._follow(record)

    def _follow(self, record: table.JobRecord) -> None:
        steps = record.advance(now=self.clock())
        for state, reason in steps:
            self._send_update(record, state, reason)
        if steps and record.state == status.JobState.FAILED:
            logger.info("job %s failed (%s): deleting its pods", record.job_id, record.reason)
            self._spawn(self._delete_live(record))

    async def _delete_live(self, record: table.JobRecord) -> None:
        await self._delete_pods(record.job_id, record.namespace, record.live_pods())

    async def _delete_pods(
        self, job_id: str, namespace: str, pods: Sequence[status.PodStatus]
    ) -> None:
        if not pods:
            return
        try:
            await binding.delete_pods(
                self.backend,
                ((namespace, p.name) for p in pods),
                grace_seconds=self.failure_grace_seconds,
            )
        except Exception:
            logger.exception("deleting %d pods of job %s", len(pods), job_id)
        self.on_change()

    def _send_update(self, record: table.JobRecord, state: status.JobState, reason: str) -> None:
        self._trace_running(record, state, reason)
        update = record.update(state, reason)
        self.send(update, on_sent=self._reported(record) if state.terminal else None)

    @staticmethod
    def _trace_running(record: table.JobRecord, state: status.JobState, reason: str) -> None:
        """`job.running`: from the gang running to its final state, in the job's trace."""
        if state == status.JobState.RUNNING and record.running_since_ns is None:
            record.running_since_ns = time.time_ns()
        elif state.terminal and record.running_since_ns is not None:
            span = tracer.start_span(
                "job.running",
                context=propagate.extract({"traceparent": record.traceparent or ""}),
                start_time=record.running_since_ns,
                attributes={
                    "gpufed.job": record.job_id,
                    "gpufed.state": state.value,
                    "gpufed.reason": reason,
                    "gpufed.pods": len(record.pods),
                },
            )
            if state == status.JobState.FAILED:
                span.set_status(trace.StatusCode.ERROR, reason)
            span.end()
            record.running_since_ns = None

    def _reported(self, record: table.JobRecord) -> Callable[[], None]:
        def mark() -> None:
            record.reported_at = self.clock()

        return mark

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- adoption and hello ----------------------------------------------------------------

    def adopt(self, held: Mapping[str, base.HeldJob]) -> int:
        """Take the jobs found in the cluster at start into the table (before the first
        hello), each at its latest attempt; a gang that failed meanwhile has its remaining pods
        deleted, and so have the pods of earlier attempts."""
        adopted = adopting.adopt_jobs(self.table, held, now=self.clock())
        for record in adopted:
            earlier = adopting.earlier_pods(held[record.job_id])
            if earlier:
                self._spawn(self._delete_pods(record.job_id, record.namespace, earlier))
            if record.state == status.JobState.FAILED:
                self._spawn(self._delete_live(record))
        if adopted:
            self.on_change()
        return len(adopted)

    def hello_jobs(self) -> tuple[list[messages.AgentJob], Callable[[], None]]:
        """The jobs for `hello`, and what to call once it went out (the terminal ones among
        them are then known to the broker)."""
        records = self.table.for_hello(now=self.clock())
        terminal = [r for r in records if r.state.terminal]

        def mark() -> None:
            now = self.clock()
            for record in terminal:
                if record.reported_at is None:
                    record.reported_at = now

        return [r.agent_job() for r in records], mark

    def pods_by_phase(self) -> Counter[str]:
        return Counter(p.phase.value for r in self.table for p in r.pods.values())

    async def close(self) -> None:
        """Wait for the clean-ups of failed gangs still deleting pods."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
