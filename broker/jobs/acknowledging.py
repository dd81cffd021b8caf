"""Acknowledgements of agents' final reports, sent only once the report is in the store.

`reports.AgentReports` hands every report that carries a `seq` to `after_commit`; the book
calls back once the job, as the report left it, is committed (at once when nothing of it waits
for the group commit: the report was applied already or changed nothing). The seqs that came
due together go out in one `Ack` per session. An ack names the session (epoch) the report came
on; if that session is over, the ack is dropped: the agent sends the report again on its next
session, where it is acknowledged without being applied twice. A report whose commit is
dropped (a conflict) is never acknowledged, and the agent sends it again.
"""

from __future__ import annotations

import asyncio
import logging

from broker.api import messages
from broker.jobs import book, fleet
from kits import tasks

logger = logging.getLogger(__name__)


class Acknowledgements:
    def __init__(self, jobs: book.JobBook, clusters: fleet.Fleet) -> None:
        self.book = jobs
        self.fleet = clusters
        self.sent = 0  # seqs acknowledged since the broker started
        self._due: dict[tuple[str, int], set[int]] = {}  # (cluster, epoch) -> seqs
        self._sender: asyncio.Task[None] | None = None

    def after_commit(self, cluster: str, job_id: str, *, seq: int, epoch: int) -> None:
        """Acknowledge report `seq` of session `epoch` once the job is committed."""
        self.book.after_commit(job_id, lambda: self._come_due(cluster, epoch, seq))

    def _come_due(self, cluster: str, epoch: int, seq: int) -> None:
        self._due.setdefault((cluster, epoch), set()).add(seq)
        if self._sender is None or self._sender.done():
            # a task of its own: the commit that calls back does not wait for the sockets
            self._sender = asyncio.get_running_loop().create_task(self._send_due())

    async def _send_due(self) -> None:
        await asyncio.sleep(0)  # the acks of one group commit, in one message per session
        while self._due:
            (name, epoch), seqs = self._due.popitem()
            cluster = self.fleet.clusters.get(name)
            if cluster is None or cluster.link is None or cluster.epoch != epoch:
                continue  # that session is over: the agent sends the reports again
            try:
                if await self.fleet.send(name, messages.Ack(epoch=epoch, seqs=sorted(seqs))):
                    self.sent += len(seqs)
            except Exception:  # one session's failure must not keep the others' acks
                logger.exception("acknowledging %d reports to %s failed", len(seqs), name)

    async def close(self) -> None:
        """Stop sending (on the way out: the agents send what is not acknowledged again)."""
        if self._sender is not None:
            await tasks.stop_task(self._sender)
