"""What agents report about the jobs the broker gave them. Called by `dispatch.connecting`.

Accepted, Rejected, JobUpdate, the jobs an agent holds when it says hello (reconcile and
fencing), offers left unanswered past the offer timeout, and a cluster lost past its grace.
Each handler drafts the changes under the book's lock and commits them; a commit the store
refuses for now is handed to the group commit, which retries it, so a report is never dropped
while the broker runs (and a broker that restarts learns it again from the agent's hello).
Messages about an earlier attempt of a job are stale: they change nothing, and a copy still
running is cancelled, that attempt only. A final report with a `seq` is acknowledged once the
job is committed as it left it (`acknowledging`), also when it changed nothing: the agent
sends it until then, and a report sent twice is applied once.

A cluster answers for what it accepts: an accept must name the gang's pods
(`messages.accept_problem`); one that does not is taken for a rejection with that reason, the
agent is told to delete that attempt, and the cluster gets a strike (`fleet.Fleet.strike`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from datetime import datetime

from broker.api import messages, status
from broker.api.jobs import ClusterLostPolicy
from broker.api.status import JobState
from broker.jobs import acknowledging, book, fleet, preempting, transitions
from broker.state import errors
from broker.telemetry import jobspans, metrics

logger = logging.getLogger(__name__)

# reports applied (jobs reconciled) between two yields to the loop: one step of a task is
# one run of the loop's callbacks, and a lease renewal's answer waits behind it
YIELD_EVERY = 64
# the reason of the Cancel an agent is sent for an accept the broker refused
ACCEPT_REFUSED = "AcceptRefused"


class AgentReports:
    def __init__(
        self,
        jobs: book.JobBook,
        clusters: fleet.Fleet,
        *,
        victims: preempting.Preemptions,
        spans: jobspans.JobSpans,
        meters: metrics.BrokerMetrics,
        acks: acknowledging.Acknowledgements,
    ) -> None:
        self.book = jobs
        self.fleet = clusters
        self.victims = victims
        self.acks = acks
        self.spans = spans
        self.meters = meters

    def _owned(self, cluster: str, job_id: str) -> status.JobRecord | None:
        record = self.book.latest(job_id)
        if record is None or record.status.cluster != cluster or record.status.state.terminal:
            return None
        return record

    async def _commit(self, drafts: Sequence[status.JobRecord]) -> None:
        """Commit now; if the store cannot take it now, with the next group commit."""
        if not drafts:
            return
        try:
            await self.book.commit(drafts)
        except errors.ConflictError as exc:
            logger.warning(
                "report of %d jobs lost a race, records read again: %s", len(drafts), exc
            )
        except errors.StoreError as exc:
            logger.warning("report of %d jobs not committed yet, retrying: %s", len(drafts), exc)
            for draft in drafts:
                self.book.commit_soon(draft)

    def _answered(self, cluster: fleet.Cluster) -> None:
        """An offer was answered: a slot of the agent's offer window is free (a cycle may
        wait for one: `fleet.changed`), and a window that was cut grows back (`fleet`)."""
        self.fleet.changed.set()
        if cluster.offer_window is not None:
            self.fleet.offers_answered(cluster)
            self._window_gauge(cluster)

    def _window_gauge(self, cluster: fleet.Cluster) -> None:
        window = self.fleet.offer_window(cluster)
        if window is not None:
            self.meters.offer_window.labels(cluster=cluster.name).set(window)

    async def _cancel_stale(self, cluster: str, job_id: str, epoch: int, attempt: int) -> None:
        await self.fleet.send_cancel(cluster, job_id, epoch=epoch, reason="Stale", attempt=attempt)

    async def accepted(self, cluster: fleet.Cluster, message: messages.Accepted) -> None:
        async with self.book.lock:
            await self._accepted(cluster, message)

    async def _accepted(self, cluster: fleet.Cluster, message: messages.Accepted) -> None:
        record = self._owned(cluster.name, message.job_id)
        if record is not None and transitions.is_stale(record, message.attempt):
            await self._cancel_stale(cluster.name, record.id, message.epoch, message.attempt)
            return
        if record is not None and record.status.state == JobState.DISPATCHED:
            problem = messages.accept_problem(message, record.job)
            if problem is not None:
                await self._refuse_accept(cluster, record, message, problem)
                return
        if cluster.accept(message.job_id):
            self._answered(cluster)
        self.spans.answered(message.job_id, accepted=True)
        if record is None:
            await self._cancel_stale(cluster.name, message.job_id, message.epoch, message.attempt)
            return
        self.meters.placements.labels(cluster=cluster.name, result="accepted").inc()
        draft = book.draft_of(record)
        draft.status.pods = [
            status.PodStatus(name=p.name, task=p.task, node=p.node, gpus=p.gpus)
            for p in message.pods
        ]
        self.book.commit_soon(draft)
        if record.status.cancel_requested:
            await self.fleet.send_cancel(
                cluster.name,
                record.id,
                epoch=message.epoch,
                reason="Cancelled",
                attempt=message.attempt,
            )

    async def _refuse_accept(
        self,
        cluster: fleet.Cluster,
        record: status.JobRecord,
        message: messages.Accepted,
        problem: str,
    ) -> None:
        """An accept that does not say where the gang runs (`messages.accept_problem`) holds
        the job nowhere the broker can see: taken for a rejection with `problem` as its
        reason (the job offered elsewhere), the agent told to delete what it may have
        created of that attempt, and a strike against the cluster (`fleet.strike`)."""
        logger.warning(
            "%s: accept of job %s refused: %s",
            cluster.name,
            record.id,
            problem,
            extra={"job_id": record.id, "cluster": cluster.name},
        )
        rejection = messages.Rejected(
            job_id=message.job_id, epoch=message.epoch, reasons=[problem], attempt=message.attempt
        )
        draft = self._rejected(cluster, rejection)
        if draft is not None:
            self.book.commit_soon(draft)
        self.fleet.strike(cluster, f"job {record.id} {problem}", now=time.monotonic())
        await self.fleet.send_cancel(
            cluster.name,
            record.id,
            epoch=message.epoch,
            reason=ACCEPT_REFUSED,
            attempt=message.attempt,
        )

    async def rejected(self, cluster: fleet.Cluster, message: messages.Rejected) -> None:
        async with self.book.lock:
            draft = self._rejected(cluster, message)
            if draft is not None:
                await self._commit([draft])

    def _rejected(
        self, cluster: fleet.Cluster, message: messages.Rejected
    ) -> status.JobRecord | None:
        """The job queued again (or cancelled, if asked): the draft to commit, if any."""
        record = self._owned(cluster.name, message.job_id)
        if record is not None and transitions.is_stale(record, message.attempt):
            return None
        flight = cluster.inflight.pop(message.job_id, None)
        if flight is not None and not flight.accepted:
            self._answered(cluster)
        self.spans.answered(message.job_id, accepted=False, reasons=message.reasons)
        if record is None or record.status.state != JobState.DISPATCHED:
            return None
        self.meters.placements.labels(cluster=cluster.name, result="rejected").inc()
        cluster.rejected[record.id] = cluster.summary.seq if cluster.summary else 0
        reasons = [f"{cluster.name}: {r}" for r in message.reasons]
        draft = book.draft_of(record)
        draft.status.reasons = reasons
        if draft.status.cancel_requested:
            transitions.move(draft, JobState.CANCELLED, "Cancelled", "cancelled while offered")
        else:
            transitions.requeue(draft, "Rejected", "; ".join(reasons))
        return draft

    async def job_update(
        self, cluster: fleet.Cluster, message: messages.JobUpdate, *, session: int | None = None
    ) -> None:
        """Apply what the agent says of a job (group-committed); a report with a `seq` is
        acknowledged on its `session` (the epoch it came on) once that is committed."""
        async with self.book.lock:
            await self._job_update(cluster, message, session=session)

    async def apply(
        self, cluster: fleet.Cluster, batch: Sequence[messages.Message], *, session: int
    ) -> None:
        """The reports an agent sent back to back (Accepted, Rejected, JobUpdate), applied in
        order under one hold of the book's lock, their changes left to the group commit (the
        hold never waits on the store). Each message waiting for the lock on its own would
        let one commit in flight (a dispatch, a group commit: a store round trip) pace a
        whole cluster's reports, one per round trip. One report's failure is counted and
        logged, and the others applied."""
        async with self.book.lock:
            for done, message in enumerate(batch):
                if done and not done % YIELD_EVERY:  # let the loop's other callbacks run
                    await asyncio.sleep(0)
                try:
                    match message:
                        case messages.Accepted():
                            await self._accepted(cluster, message)
                        case messages.Rejected():
                            # with the group commit: a batch never waits on the store
                            rejected = self._rejected(cluster, message)
                            if rejected is not None:
                                self.book.commit_soon(rejected)
                        case messages.JobUpdate():
                            await self._job_update(cluster, message, session=session)
                except Exception:  # one message's failure must not end the session
                    kind = type(message).__name__
                    self.meters.agent_messages_failed.labels(cluster=cluster.name, type=kind).inc()
                    logger.exception("handling %s from %s failed", kind, cluster.name)

    async def _job_update(
        self, cluster: fleet.Cluster, message: messages.JobUpdate, *, session: int | None
    ) -> None:
        session = cluster.epoch if session is None else session
        record = self._owned(cluster.name, message.job_id)
        if record is None or transitions.is_stale(record, message.attempt):
            # applied already (a report sent again), or about an attempt moved past
            if not message.state.terminal:
                await self._cancel_stale(
                    cluster.name, message.job_id, message.epoch, message.attempt
                )
        else:
            draft = book.draft_of(record)
            changed = self._update(
                draft,
                message.state,
                message.reason,
                message.message,
                message.pods,
                checkpoint=message.checkpoint,
            )
            if changed:
                self.book.commit_soon(draft)
        if message.seq is not None:
            self.acks.after_commit(cluster.name, message.job_id, seq=message.seq, epoch=session)

    def _update(
        self,
        draft: status.JobRecord,
        state: JobState,
        reason: str,
        text: str,
        pods: Sequence[status.PodStatus],
        *,
        checkpoint: datetime | None = None,
    ) -> bool:
        """Change `draft` as the agent's report says; False if nothing changed."""
        newer = checkpoint is not None and (
            draft.status.last_checkpoint is None or checkpoint > draft.status.last_checkpoint
        )
        if newer:
            draft.status.last_checkpoint = checkpoint
        moved_pods = bool(pods) and list(pods) != draft.status.pods
        if moved_pods:
            draft.status.pods = list(pods)
        current = draft.status.state
        if state == JobState.RUNNING and current != JobState.RUNNING:
            transitions.move(draft, JobState.RUNNING, reason or "PodsRunning", text)
        elif state == JobState.SUCCEEDED:
            transitions.move(draft, JobState.SUCCEEDED, reason or "Completed", text)
        elif state == JobState.FAILED:
            transitions.fail_or_retry(draft, reason or "Failed", text)
        elif state == JobState.CANCELLED:
            self._stopped(draft, reason or "Evicted", text)
        elif state == JobState.QUEUED:
            transitions.requeue(draft, reason or "Requeued", text)
        elif not moved_pods and not newer:
            return False  # what the broker knows already (a report sent again, a hello)
        return True

    def _stopped(self, draft: status.JobRecord, reason: str, text: str) -> None:
        """The job's pods are gone: cancelled if asked, requeued if preempted or lost."""
        preempted = self.victims.message_of(draft.id)
        if draft.status.cancel_requested:
            transitions.move(draft, JobState.CANCELLED, "Cancelled", text or "pods deleted")
        elif preempted is not None:
            transitions.requeue(draft, transitions.PREEMPTED, preempted)
        else:
            transitions.requeue(draft, reason, text or "the agent removed the job")

    async def hello(self, cluster: fleet.Cluster, hello: messages.Hello) -> None:
        """Reconcile what the agent holds with what the broker believes (fencing)."""
        async with self.book.lock:
            drafts: dict[str, status.JobRecord] = {}
            cancels: list[tuple[str, int]] = []  # job, attempt: cancel once committed
            held = {job.job_id for job in hello.jobs}
            for done, job in enumerate(hello.jobs):
                if done and not done % YIELD_EVERY:  # thousands held: the loop runs between
                    await asyncio.sleep(0)
                record = self._owned(cluster.name, job.job_id)
                if record is None or transitions.is_stale(record, job.attempt):
                    held.discard(job.job_id)  # not the attempt the broker runs there
                    if not job.state.terminal:
                        await self._cancel_stale(cluster.name, job.job_id, job.epoch, job.attempt)
                    continue
                # written only if the agent's account changes it: a reconnect of an agent
                # holding thousands of jobs in step with the broker writes none of them
                draft = book.draft_of(record)
                changed = False
                if transitions.is_waiting_for_cluster(record):
                    back = f"{cluster.name} is back, still holding the job"
                    transitions.move(draft, record.status.state, transitions.CLUSTER_RETURNED, back)
                    changed = True
                if draft.status.cancel_requested and not job.state.terminal:
                    cancels.append((job.job_id, job.attempt))
                elif job.state in (JobState.QUEUED, JobState.DISPATCHED):
                    if job.pods and list(job.pods) != draft.status.pods:
                        draft.status.pods = list(job.pods)
                        changed = True
                else:
                    reason = job.reason or "Reconciled"
                    text = "state reported on reconnect"
                    changed = self._update(draft, job.state, reason, text, job.pods) or changed
                if changed:
                    draft.status.epoch = cluster.epoch  # the session it was last reconciled in
                    drafts[job.job_id] = draft
            for record in self.book.on_cluster(cluster.name):
                if record.status.state not in book.HOLDING or record.id in held:
                    continue
                draft = drafts[record.id] = book.draft_of(record)
                if draft.status.cancel_requested:
                    transitions.move(
                        draft, JobState.CANCELLED, "Cancelled", "gone from the cluster"
                    )
                elif draft.id in self.victims:
                    self._stopped(draft, "LostByAgent", f"{cluster.name} no longer holds it")
                else:  # a failed attempt as far as its failure policy goes
                    lost = f"{cluster.name} no longer holds it"
                    transitions.fail_or_retry(draft, transitions.LOST_BY_AGENT, lost)
            await self._commit(list(drafts.values()))
            for job_id, attempt in cancels:
                await self.fleet.send_cancel(
                    cluster.name, job_id, epoch=cluster.epoch, reason="Cancelled", attempt=attempt
                )

    async def withdraw_unanswered(self, cluster: fleet.Cluster, *, now: float) -> int:
        """Offers the agent neither accepted nor rejected within the fleet's offer timeout (a
        hung agent that still heartbeats): each job is queued again (OfferTimeout) and the
        cluster passed over for it until a newer summary, as after a rejection; once that is
        committed the agent is sent a Cancel of that attempt (an answer that comes later is
        about an attempt moved past: stale). Returns the offers withdrawn."""
        timeout = self.fleet.offer_timeout
        if not cluster.unanswered(now=now, timeout=timeout):
            return 0
        text = f"{cluster.name}: the offer was not answered within {timeout:g} s"
        async with self.book.lock:
            drafts = []
            for job_id in cluster.unanswered(now=now, timeout=timeout):
                record = self.book.latest(job_id)
                if (
                    record is None
                    or record.status.cluster != cluster.name
                    or record.status.state != JobState.DISPATCHED
                ):
                    cluster.inflight.pop(job_id, None)  # moved on meanwhile
                    continue
                draft = book.draft_of(record)
                draft.status.reasons = [text]
                if draft.status.cancel_requested:
                    transitions.move(
                        draft, JobState.CANCELLED, "Cancelled", "cancelled while offered"
                    )
                else:
                    transitions.requeue(draft, transitions.OFFER_TIMEOUT, text)
                drafts.append(draft)
            try:
                await self.book.commit(drafts)
            except errors.StoreError as exc:  # what did not commit is tried again next pass
                logger.warning("withdrawing %d offers not committed: %s", len(drafts), exc)
            withdrawn = [draft for draft in drafts if self.book.get(draft.id) is draft]
            sent = [f.sent_at for d in withdrawn if (f := cluster.inflight.get(d.id)) is not None]
            if sent:
                self.fleet.offers_timed_out(cluster, sent_at=max(sent), now=time.monotonic())
                self._window_gauge(cluster)
            for draft in withdrawn:
                cluster.inflight.pop(draft.id, None)
                cluster.rejected[draft.id] = cluster.summary.seq if cluster.summary else 0
                self.spans.answered(draft.id, accepted=False, reasons=[text])
                self.meters.placements.labels(cluster=cluster.name, result="timeout").inc()
                await self.fleet.send_cancel(
                    cluster.name,
                    draft.id,
                    epoch=draft.status.epoch,
                    reason=transitions.OFFER_TIMEOUT,
                    attempt=transitions.attempt_of(draft),
                )
        if withdrawn:
            logger.warning(
                "%s: %d offers unanswered in %g s withdrawn", cluster.name, len(withdrawn), timeout
            )
        return len(withdrawn)

    async def cluster_lost(self, name: str) -> int:
        """The cluster stayed away past its grace period: run its jobs elsewhere (its agent
        has deleted their pods by now, see `api.leases`), except those whose
        `failurePolicy.clusterLost` is `wait`: they stay on it, and an event says they wait.
        Returns the jobs requeued or cancelled."""
        async with self.book.lock:
            drafts = []
            waiting = 0
            for record in self.book.on_cluster(name):
                if record.status.state not in book.HOLDING:
                    continue
                draft = book.draft_of(record)
                if draft.status.cancel_requested:
                    transitions.move(draft, JobState.CANCELLED, "Cancelled", f"{name} lost")
                elif record.job.spec.cluster_lost == ClusterLostPolicy.WAIT:
                    if transitions.is_waiting_for_cluster(record):
                        continue
                    waiting += 1
                    transitions.wait_for_cluster(
                        draft,
                        f"{name} unreachable past its grace; spec.failurePolicy.clusterLost is "
                        f"wait: it stays on {name} and is not restarted elsewhere",
                    )
                else:
                    text = f"{name} unreachable past its grace"
                    transitions.requeue(draft, transitions.CLUSTER_LOST, text)
                drafts.append(draft)
            await self._commit(drafts)
            if waiting:
                logger.warning(
                    "cluster %s lost: %d jobs wait for it (clusterLost: wait)", name, waiting
                )
            return len(drafts) - waiting
