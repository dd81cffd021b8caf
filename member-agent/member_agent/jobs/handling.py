"""The agent's job controller: what it does with offers, cancels and pod events.

`JobHandler` is driven by the session (`session.connecting.Connector`) and by the backend's
event stream (`app.run_agent`); it owns the job table (`table`), which starts with the jobs
found in the cluster (`adopt`, see `adopting`). Offers and cancels are handled one at a time
under `lock`, so two offers never book the same GPUs. An offer goes through four steps, each a
method of its own: check (`_check`: the gang's shape, its images against the offer's
`allowed_images` (`broker.api.images`), the limits file and the namespace's ResourceQuotas,
`placement.limits.check_gpus`), place (`_place`: `placement.gang.place_gang` on
the live inventory, through `placing.Placer`), bind (`_bind`: `binding.create_gang`,
all-or-nothing) and reply (`_accept` / `_reject`). Pod events move jobs through Running,
Succeeded and Failed; a failed gang has its remaining pods deleted (`deleting.Deleter`). No
socket here: replies leave through `reply`, job updates through `updating.Updater`, which
keeps final reports until the broker acknowledges them.

Attempts: an offer of the attempt the table holds is a re-send, answered with the same pods
(and the final state, if reached); one of a later attempt (the broker runs the job again: a
retry, a preemption, a lost cluster) deletes the earlier attempt's live pods, drops its record
and is placed as new, its pods named for the attempt (`broker.api.gangs.pod_name`); one of an
earlier attempt is rejected (`check_fresh`). A cancel stops only the attempt it names (or an
earlier one). A cancel with reason `Preempted` gives notice first: the pods are annotated
`gpufed.io/preemption-notice` (the deadline, RFC 3339), deleted with the cancel's grace, and
the job stays as it is (`table.TrackedJob.stopping`) until none of its pods is live; only then
is it Cancelled and reported, so the broker does not count its GPUs free while the workload
still checkpoints on them. A pod's `gpufed.io/last-checkpoint` (the backend's pod events) is
reported when it moves forward (`updating.Updater.send_checkpoint`).

Fencing: when the agent's cluster lease lapses (`session.leasing`: no word from the broker for
its fence time) the session calls `fence`: offers are rejected from then on (`fenced`), and
every job whose `spec.failurePolicy.clusterLost` is `requeue` is stopped as a cancel would stop
it, reason `ClusterLost`: its pods deleted, its final report kept until a broker acknowledges
it. A `wait` job keeps its pods. `unfence` (the lease renewed) lets offers in again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from prometheus_client import Histogram

from broker.api import gangs, images, jobs, messages, status
from member_agent.binding import binding
from member_agent.cluster import base
from member_agent.jobs import adopting, deleting, placing, spans, table, updating
from member_agent.placement import gang, limits

logger = logging.getLogger(__name__)

Reply = Callable[[messages.Message], None]


CLUSTER_LOST = "ClusterLost"  # the reason of the jobs a fence stops
PREEMPTED = "Preempted"  # a cancel's reason that preempts: notice, grace, then Cancelled
STOP_MARGIN_SECONDS = 30.0  # past a preemption's grace: reported even if pods still show
# a finished job's pods stay this long after the broker acknowledged its final report: for
# their logs, as `ttlSecondsAfterFinished` keeps a Kubernetes Job's (`deleting.Deleter`)
FINISHED_PODS_TTL_SECONDS = 600.0


@dataclass(frozen=True)
class Rejection:
    """An offer turned down: the result `JobHandler.offers` counts, and the reasons sent."""

    result: str  # stale, fenced, invalid, image, limit, unplaceable, binding_failed
    reasons: list[str]


def check_fresh(
    offer: messages.Offer, held: table.TrackedJob | None, *, session_epoch: int
) -> Rejection | None:
    """A stale offer's rejection: one of another session, or of an attempt older than the
    one the table holds. None when the offer is current."""
    if offer.epoch != session_epoch:
        return Rejection("stale", [f"stale epoch {offer.epoch}: this session is {session_epoch}"])
    if held is not None and held.attempt > offer.attempt:
        return Rejection(
            "stale", [f"stale attempt {offer.attempt}: this cluster holds attempt {held.attempt}"]
        )
    return None


def _make_record(
    offer: messages.Offer, requests: Sequence[base.PodRequest], *, request: gangs.GangRequest
) -> table.TrackedJob:
    """The table's record of an offer whose pods are about to be created."""
    return table.TrackedJob(
        job_id=offer.job_id,
        epoch=offer.epoch,
        namespace=offer.job.metadata.namespace,
        gpus=request.gpus,
        min_member=request.min_member,
        traceparent=offer.traceparent,
        attempt=offer.attempt,
        pods={
            r.name: status.PodStatus(name=r.name, task=r.task, node=r.node, gpus=list(r.gpus))
            for r in requests
        },
        cluster_lost=offer.job.spec.cluster_lost,
        queue=offer.job.spec.queue,
    )


def _trace_id(traceparent: str | None) -> str:
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) == 4 else ""


def _nothing() -> None:
    return None


class JobHandler:
    def __init__(
        self,
        backend: base.ClusterBackend,
        *,
        send: updating.Send,
        agent_limits: limits.AgentLimits | None = None,
        on_change: Callable[[], None] = _nothing,
        clock: Callable[[], float] = time.monotonic,
        failure_grace_seconds: float = 30.0,
        finished_pods_ttl_seconds: float | None = FINISHED_PODS_TTL_SECONDS,
        policy: str = "default",
        jobs_table: table.JobTable | None = None,
    ) -> None:
        self.backend = backend
        self.limits = agent_limits or limits.AgentLimits()
        self.on_change = on_change
        self.clock = clock
        self.table = jobs_table or table.JobTable()
        self.lock = asyncio.Lock()
        self.offers: Counter[str] = Counter()
        self.updates = updating.Updater(send, clock=clock)
        # free capacity indexed for placement, kept current node by node
        self.placer = placing.Placer(policy=policy)
        # pods deleted by a rollback whose DELETED event has not come yet
        self._tombstones: set[str] = set()
        self.deleter = deleting.Deleter(
            backend, grace_seconds=failure_grace_seconds, on_change=on_change
        )
        self._pruned = -math.inf
        self.finished_pods_ttl = finished_pods_ttl_seconds  # None: never deleted
        self.fenced: str | None = None  # why, while the cluster lease has lapsed
        self.fences = 0
        self.fenced_jobs = 0  # jobs a fence stopped

    @property
    def placement_duration(self) -> Histogram:
        """Time to choose nodes and GPUs for an offer's gang; `telemetry.AgentCollector`
        exports it."""
        return self.placer.duration

    # -- offers: check → place → bind → reply -----------------------------------------------

    async def handle_offer(
        self, offer: messages.Offer, *, session_epoch: int, reply: Reply
    ) -> None:
        async with self.lock:
            result = await self._handle_offer(offer, session_epoch=session_epoch, reply=reply)
        self.offers[result] += 1

    async def _handle_offer(
        self, offer: messages.Offer, *, session_epoch: int, reply: Reply
    ) -> str:
        """One offer, answered Accepted or Rejected; returns the result `offers` counts."""
        self._prune()
        if self.fenced is not None:  # the broker may run it elsewhere soon: create nothing
            fenced = Rejection("fenced", [f"the agent fenced itself: {self.fenced}"])
            return self._reject(offer, fenced, reply=reply)
        # which attempt: stale, the one held (a re-send), or a new one (replacing an earlier)
        held = self.table.get(offer.job_id)
        stale = check_fresh(offer, held, session_epoch=session_epoch)
        if stale is not None:
            return self._reject(offer, stale, reply=reply)
        if held is not None and held.attempt == offer.attempt:
            return self._resend(offer, held, reply=reply)
        earlier = self.table.supersede(offer.job_id, offer.attempt)
        if earlier is not None:
            await self._retire(earlier, attempt=offer.attempt)
        # check → place → bind → reply
        request = self._check(offer)
        if isinstance(request, Rejection):
            return self._reject(offer, request, reply=reply)
        placement = self._place(offer, request)
        if isinstance(placement, gang.NoPlacement):
            unplaceable = Rejection("unplaceable", sorted(placement.reasons))
            return self._reject(offer, unplaceable, reply=reply)
        record = await self._bind(offer, placement, request=request)
        if isinstance(record, Rejection):
            return self._reject(offer, record, reply=reply)
        return self._accept(record, reply)

    def housekeep(self) -> None:
        """What an idle agent does too (the session's heartbeat calls it): forget the
        terminal jobs the broker has seen, as an offer would (once no offer is being
        handled), and delete the finished pods due. Without it, the jobs finished in the
        last `keep_reported` seconds before the last offer stayed in the table, and in
        memory, until the next one came."""
        if not self.lock.locked():
            self._prune()

    def _prune(self) -> None:
        """Forget the terminal jobs the broker has seen, at most once a second; their pods
        are deleted `finished_pods_ttl` after the broker's acknowledgement."""
        now = self.clock()
        if now - self._pruned >= 1.0:
            for record in self.table.prune(now=now):
                if self.finished_pods_ttl is not None and record.acked_at is not None:
                    self.deleter.schedule(record, due=record.acked_at + self.finished_pods_ttl)
            self.deleter.sweep(now)
            self._pruned = now

    def _resend(self, offer: messages.Offer, held: table.TrackedJob, *, reply: Reply) -> str:
        """An offer of the attempt the table holds: the same pods again, and its state."""
        held.epoch = offer.epoch
        reply(held.accepted())
        if held.state != status.JobState.DISPATCHED:
            self.updates.send_state(held, held.state, held.reason)
        return "resent"

    def _check(self, offer: messages.Offer) -> gangs.GangRequest | Rejection:
        """The offer's gang, if its shape is valid, its images are allowed (the broker checked
        them at submit; the list may have narrowed since) and it fits the namespace's GPU
        limits (the limits file and the cluster's ResourceQuotas)."""
        try:
            request = gangs.gang_request(offer.job_id, offer.job, attempt=offer.attempt)
        except jobs.ShapeError as exc:
            return Rejection("invalid", [str(exc)])
        untrusted = images.refusals(offer.job, offer.allowed_images)
        if untrusted:
            return Rejection("image", [f"{r.field}: {r.message}" for r in untrusted])
        namespace = offer.job.metadata.namespace
        limited = self.limits.gpu_limit(namespace) is not None  # else nothing to count against
        over = limits.check_gpus(
            self.limits,
            namespace,
            in_use=self.table.gpus_in_use(namespace) if limited else 0,
            asked=request.gpus,
            quotas=self.backend.gpu_quotas(namespace),
        )
        if over is not None:  # the file or a ResourceQuota: one `limit` result for both
            return Rejection("limit", [over.reason])
        return request

    def _place(
        self, offer: messages.Offer, request: gangs.GangRequest
    ) -> gang.GangPlacement | gang.NoPlacement:
        """Nodes and GPUs for every pod on the live inventory (pure placement, timed)."""
        with spans.span(
            "agent.place", offer.traceparent, {"job_id": offer.job_id, "pods": request.pods}
        ):
            return self.placer.place(self.backend.inventory(), request)

    async def _bind(
        self, offer: messages.Offer, placement: gang.GangPlacement, *, request: gangs.GangRequest
    ) -> table.TrackedJob | Rejection:
        """Create the gang's pods, all or none. The job is in the table while they are
        created (`binding`), so pod events find it; a rollback takes it out again."""
        requests = binding.build_requests(
            offer.job_id,
            offer.job,
            placement,
            traceparent=offer.traceparent,
            epoch=offer.epoch,
            attempt=offer.attempt,
        )
        record = _make_record(offer, requests, request=request)
        self.table.add(record)
        self.placer.mark_stale(r.node for r in requests)
        try:
            with spans.span(
                "agent.bind", offer.traceparent, {"job_id": offer.job_id, "pods": len(requests)}
            ):
                await binding.create_gang(self.backend, requests)
        except binding.BindingError as exc:
            self.table.remove(offer.job_id)
            self._tombstones.update(exc.rolled_back)
            self.on_change()
            return Rejection("binding_failed", [f"creating pods failed: {exc}"])
        except BaseException:
            self.table.remove(offer.job_id)
            raise
        record.binding = False
        return record

    def _accept(self, record: table.TrackedJob, reply: Reply) -> str:
        reply(record.accepted())
        logger.debug(
            "offer %s accepted: %d pods, %d GPUs", record.job_id, len(record.pods), record.gpus
        )
        self._follow(record)
        self.on_change()
        return "accepted"

    def _reject(self, offer: messages.Offer, rejection: Rejection, *, reply: Reply) -> str:
        logger.info(
            "offer %s rejected: %s",
            offer.job_id,
            "; ".join(rejection.reasons),
            extra={"job_id": offer.job_id, "trace_id": _trace_id(offer.traceparent)},
        )
        reply(
            messages.Rejected(
                job_id=offer.job_id,
                epoch=offer.epoch,
                reasons=rejection.reasons,
                traceparent=offer.traceparent,
                attempt=offer.attempt,
            )
        )
        return rejection.result

    async def _retire(self, record: table.TrackedJob, *, attempt: int) -> None:
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
        self.placer.mark_stale(p.node for p in live)
        await self.deleter.delete_live(record)

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
                self.updates.send_cancelled(cancel)
            elif record.state.terminal:
                self.updates.send_state(record, record.state, record.reason)
            else:
                await self._cancel(record, cancel)

    async def _cancel(self, record: table.TrackedJob, cancel: messages.Cancel) -> None:
        """Stop a live job: Cancelled at once, its pods deleted with the cancel's grace; a
        preemption gives notice first and reports Cancelled once the pods are gone."""
        if cancel.reason == PREEMPTED:
            if record.stopping is None:
                await self._preempt(record, cancel)
            return
        await self._stop([record], reason=cancel.reason, grace_seconds=cancel.grace_seconds)
        logger.info("job %s cancelled: %s", cancel.job_id, cancel.reason)

    async def _preempt(self, record: table.TrackedJob, cancel: messages.Cancel) -> None:
        """Preempted: every live pod annotated with the deadline
        (`gpufed.io/preemption-notice`), then deleted with the grace period. The job stays
        as it is, holding its GPUs, until no pod is live (`_check_stopped`): only then is it
        Cancelled and reported, so the broker counts its GPUs free only once they are."""
        grace = max(0.0, cancel.grace_seconds)
        deadline = datetime.now(UTC) + timedelta(seconds=grace)
        live = record.live_pods()
        names = [(record.namespace, pod.name) for pod in live]
        notice = {base.PREEMPTION_NOTICE_ANNOTATION: base.rfc3339(deadline)}
        unannotated = await binding.annotate_pods(self.backend, names, notice)
        record.stopping = cancel.reason
        failed = set(await binding.delete_pods(self.backend, names, grace_seconds=grace))
        for pod in live:  # a pod that could not be deleted is not waited for
            if pod.name in failed:
                record.set_phase(pod, status.PodPhase.DELETED, reason=cancel.reason)
        said = [f"{len(failed)} pods could not be deleted"] if failed else []
        said += [f"{len(unannotated)} pods got no notice"] if unannotated else []
        record.stop_message = "; ".join(said)
        logger.info(
            "job %s preempted: %d pods deleted with %g s of grace (notice until %s)",
            record.job_id,
            len(live),
            grace,
            notice[base.PREEMPTION_NOTICE_ANNOTATION],
            extra={"job_id": record.job_id, "trace_id": _trace_id(record.traceparent)},
        )
        asyncio.get_running_loop().call_later(
            grace + STOP_MARGIN_SECONDS, self._stop_overdue, record
        )
        self._check_stopped(record)

    def _check_stopped(self, record: table.TrackedJob) -> None:
        """A stopping job none of whose pods is live any more: Cancelled, reported."""
        if record.stopping is None or record.state.terminal or record.live_pods():
            return
        record.finish(status.JobState.CANCELLED, record.stopping, now=self.clock())
        self.updates.send_final(record, message=record.stop_message)
        self.on_change()

    def _stop_overdue(self, record: table.TrackedJob) -> None:
        """The grace has long passed and pods of a stopping job still show live (an event
        lost): it is reported Cancelled anyway; the inventory still holds what they hold."""
        if self.table.get(record.job_id) is not record or record.state.terminal:
            return
        left = record.live_pods()
        for pod in left:
            record.set_phase(pod, status.PodPhase.DELETED, reason=record.stopping or "")
        logger.warning("job %s: %d pods still live past their grace", record.job_id, len(left))
        said = [record.stop_message] if record.stop_message else []
        record.stop_message = "; ".join([*said, f"{len(left)} pods still live past the grace"])
        self._check_stopped(record)

    async def _stop(
        self,
        records: Sequence[table.TrackedJob],
        *,
        reason: str,
        grace_seconds: float,
        message: str = "",
    ) -> None:
        """Stop live jobs: Cancelled at once (before the pod events of their deletion come),
        their pods deleted together with the grace, each final report kept until acked."""
        now = self.clock()
        pods: list[tuple[table.TrackedJob, status.PodStatus]] = []
        for record in records:
            record.finish(status.JobState.CANCELLED, reason, now=now)
            pods.extend(
                (record, p) for p in record.pods.values() if p.phase != status.PodPhase.DELETED
            )
        failed = set(
            await binding.delete_pods(
                self.backend,
                ((record.namespace, pod.name) for record, pod in pods),
                grace_seconds=grace_seconds,
            )
        )
        for record, pod in pods:
            if pod.name not in failed:
                record.set_phase(pod, status.PodPhase.DELETED, reason=reason)
        for record in records:
            left = sum(p.name in failed for p in record.pods.values())
            said = [message] if message else []
            said += [f"{left} pods could not be deleted"] if left else []
            self.updates.send_final(record, message="; ".join(said))
        self.on_change()

    # -- fencing ---------------------------------------------------------------------------

    async def fence(self, *, reason: str, grace_seconds: float) -> int:
        """The cluster lease lapsed: no new pods, and the jobs whose `clusterLost` policy is
        `requeue` stopped (`ClusterLost`), their pods deleted with `grace_seconds`. Returns
        how many were stopped."""
        self.fenced = reason
        self.fences += 1
        async with self.lock:  # after the offer being bound, if any: its pods go too
            if not self.is_fenced():  # renewed while waiting
                return 0
            live = [r for r in self.table if not r.state.terminal]
            stopping = [r for r in live if r.cluster_lost == jobs.ClusterLostPolicy.REQUEUE]
            if stopping:
                self.placer.mark_stale(p.node for r in stopping for p in r.live_pods())
                await self._stop(
                    stopping,
                    reason=CLUSTER_LOST,
                    grace_seconds=grace_seconds,
                    message=f"the agent fenced itself: {reason}",
                )
        self.fenced_jobs += len(stopping)
        logger.warning(
            "fenced: %d jobs stopped (clusterLost: requeue), %d kept running (clusterLost: "
            "wait); no new pods until the broker is heard again",
            len(stopping),
            len(live) - len(stopping),
        )
        return len(stopping)

    def is_fenced(self) -> bool:
        return self.fenced is not None

    def unfence(self) -> None:
        """The cluster lease was renewed: offers are placed again."""
        self.fenced = None

    # -- pod events ------------------------------------------------------------------------

    def handle_event(self, event: base.BackendEvent) -> None:
        """Apply one backend event; inventory changes are the reporter's business."""
        if not isinstance(event, base.PodEvent):
            self.placer.forget()  # nodes changed: index them again
            return
        if event.node:
            self.placer.mark_stale((event.node,))
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
        if event.checkpoint:
            self._note_checkpoint(record, event.checkpoint)
        if record.stopping is not None:
            self._check_stopped(record)
            return
        self._follow(record)

    def _note_checkpoint(self, record: table.TrackedJob, text: str) -> None:
        """A pod says its workload checkpointed: the job's newest checkpoint, reported."""
        at = base.read_time(text)
        if at is None or (record.checkpoint is not None and at <= record.checkpoint):
            return
        record.checkpoint = at
        if not record.state.terminal and record.stopping is None:
            self.updates.send_checkpoint(record)

    def _follow(self, record: table.TrackedJob) -> None:
        steps = record.advance(now=self.clock())
        for state, reason in steps:
            self.updates.send_state(record, state, reason)
        if steps and record.state == status.JobState.FAILED:
            logger.info("job %s failed (%s): deleting its pods", record.job_id, record.reason)
            self.deleter.spawn(self.deleter.delete_live(record))

    # -- adoption and hello ----------------------------------------------------------------

    def adopt(self, held: Mapping[str, base.HeldJob]) -> int:
        """Take the jobs found in the cluster at start into the table (before the first
        hello), each at its latest attempt; a gang that failed meanwhile has its remaining pods
        deleted, and so have the pods of earlier attempts."""
        adopted = adopting.adopt_jobs(self.table, held, now=self.clock())
        for record in adopted:
            earlier = adopting.earlier_pods(held[record.job_id])
            if earlier:
                self.deleter.spawn(self.deleter.delete(record.job_id, record.namespace, earlier))
            if record.state == status.JobState.FAILED:
                self.deleter.spawn(self.deleter.delete_live(record))
            if record.state.terminal:  # finished while the agent was away: report it
                self.updates.hold_final(record)
        if adopted:
            self.on_change()
        return len(adopted)

    def hello_jobs(self) -> list[messages.AgentJob]:
        """The jobs for `hello`: every one not finished, and the finished ones whose final
        report the broker has not acknowledged (sent again once it welcomes the session)."""
        return [r.agent_job() for r in self.table.for_hello(now=self.clock())]

    def holds_live_jobs(self) -> bool:
        return any(not r.state.terminal for r in self.table)

    def pods_by_phase(self) -> Counter[str]:
        return Counter(p.phase.value for r in self.table for p in r.pods.values())

    async def close(self) -> None:
        """Wait for the clean-ups of failed gangs still deleting pods."""
        await self.deleter.close()
