"""What a 1-pod job costs at least, in CPU: the steps every job goes through, each timed on
its own with the functions the services call, and summed with the counts of a soak.

    .venv/bin/python -m e2e.bench_floor [--calls 20000] [--repeats 5]

Each step is timed `--repeats` times over `--calls` calls, in this thread's CPU time (on a
shared machine the turns of other processes do not count); the median is printed. The steps
are only the ones no design of this broker can skip for a job that is stored at each state a
user can see (Queued, Dispatched, its pods placed, Running, Succeeded), sent to an agent and
reported back: reading and validating it, drafting and encoding each record written, the
etcd transaction's share of each write, decoding the agent's reports, one log line per
transition, its history row; and, on the agent, decoding the offer and encoding its reports.
Planning, placement, the book's indices, HTTP, WebSocket framing, the store's round trips,
spans and metrics are left out: the sum is a floor, the real cost is above it (compare
`python -m e2e.bench_soak`, which prints the CPU each process spent per job).

Printed: each step's microseconds, the broker's and the agent's floor per job, and what that
floor allows at most: jobs per second on one core, and against the 3,000 pods/s target on
2 cores (every process together may spend 667 us per job). Asserts nothing.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker.api import jobs, messages, status
from broker.api.status import JobState
from broker.jobs import book
from broker.state import etcd, records, store
from broker.state.history import protocol as history
from e2e import bench_throughput
from gpufed import logs

TARGET_PODS_PER_SECOND = 3000
CORES = 2
TXN_RECORDS = 100  # records in one group commit's transaction (its share per record)


@dataclass(frozen=True)
class Step:
    name: str
    per_job: float  # how many times a job goes through it
    call: Callable[[], object]
    side: str = "broker"


def records_through_life(body: dict[str, Any]) -> list[status.JobRecord]:
    """One job's record at each state it is written in: Queued, Dispatched, its pods
    placed (Accepted), Running, Succeeded."""
    job = jobs.validate_submitted(body)
    record = status.JobRecord(
        id="bench-0-1a2b3c4d",
        tenant="team-a",
        job=job,
        traceparent=f"00-{'a' * 32}-{'b' * 16}-01",
        trace_id="a" * 32,
        idempotency_key="soak-1",
    )
    record.record(JobState.QUEUED, "Submitted")
    stages = [record]
    record = book.draft_of(record)
    record.status.cluster, record.status.epoch, record.status.attempts = "bench-a", 3, 1
    record.record(JobState.DISPATCHED, "Dispatched", "to bench-a")
    stages.append(record)
    record = book.draft_of(record)
    record.status.pods = [
        status.PodStatus(
            name="bench-0-1a2b3c4d-main-0",
            task="main",
            node="bench-a-node-0417",
            gpus=[status.GPUSlot(index=3)],
        )
    ]
    stages.append(record)
    for state in (JobState.RUNNING, JobState.SUCCEEDED):
        record = book.draft_of(record)
        record.record(state, state.value)
        stages.append(record)
    return stages


def steps() -> list[Step]:
    body = bench_throughput.job_body(1, 1)
    item = json.dumps({"idempotencyKey": "soak-1", "job": body}).encode()
    stages = records_through_life(body)
    final = stages[-1]
    encoded = [records.Encoded(r, records.encode(r)) for r in stages[1:]]
    keys = [records.job_key(f"job-{i}") for i in range(TXN_RECORDS)]
    txn = store.Txn(
        compares=[store.Compare(key, 1000 + i) for i, key in enumerate(keys)],
        puts=[(key, encoded[i % len(encoded)].value) for i, key in enumerate(keys)],
    )
    pods = [
        status.PodPlacement(name=p.name, task=p.task, node=p.node, gpus=p.gpus)
        for p in final.status.pods
    ]
    accepted_message = messages.Accepted(job_id=final.id, epoch=3, pods=pods)
    accepted = messages.encode(accepted_message)
    succeeded_message = messages.JobUpdate(
        job_id=final.id, epoch=3, state=JobState.SUCCEEDED, pods=final.status.pods, seq=7
    )
    succeeded = messages.encode(succeeded_message)
    offer_message = messages.Offer(job_id=final.id, epoch=3, tenant="team-a", job=final.job)
    offer = messages.encode(offer_message)
    logger = logging.getLogger("bench.floor")
    logger.propagate = False
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(logs.JsonFormatter(service="broker"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logs.skip_record_lookups()  # as `logs.setup` does in the services

    def log_line() -> None:
        logger.info(
            "job %s: %s -> %s (%s)",
            final.id,
            "Dispatched",
            "Running",
            "Running",
            extra={"job_id": final.id, "cluster": "bench-a", "trace_id": final.trace_id,
                   "state": "Running"},
        )  # fmt: skip
        stream = handler.stream
        stream.seek(0)
        stream.truncate()

    interning = records.Interners()  # the book's: a sweep's jobs share their template
    offered = records.Interners()  # the agent's session's, likewise
    return [
        Step("submit: parse the item's JSON", 1, lambda: json.loads(item)),
        Step(
            "submit: validate the job",
            1,
            lambda: jobs.validate_submitted(body, interning=interning),  # as the broker does
        ),
        Step("draft a record (copy)", 4, lambda: book.draft_of(final)),
        Step("encode a record (5 writes)", 5, lambda: records.encode(final)),
        Step("etcd txn request, per record", 5, lambda: etcd.build_txn_request(txn)),
        Step("encode the offer", 1, lambda: messages.encode(offer_message)),
        Step("decode Accepted", 1, lambda: messages.decode(accepted)),
        Step("decode a JobUpdate (Running, Succeeded)", 2, lambda: messages.decode(succeeded)),
        Step("log a transition", 4, log_line),
        Step("history row (encodes the record)", 1, lambda: history.HistoryRow.of(final)),
        Step("decode the offer", 1, lambda: messages.decode(offer, interning=offered), "agent"),
        Step("encode Accepted", 1, lambda: messages.encode(accepted_message), "agent"),
        Step("encode a JobUpdate", 2, lambda: messages.encode(succeeded_message), "agent"),
    ]


def time_step(step: Step, *, calls: int, repeats: int) -> float:
    """Median microseconds per call of `step` (per record for the transaction's share)."""
    runs = []
    for _ in range(repeats):
        began = time.thread_time()
        for _ in range(calls):
            step.call()
        runs.append((time.thread_time() - began) / calls * 1e6)
    each = statistics.median(runs)
    return each / TXN_RECORDS if step.name.startswith("etcd txn") else each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    totals: dict[str, float] = {}
    print(f"{'step':<50} {'us/call':>8} {'x/job':>6} {'us/job':>8}")
    for step in steps():
        calls = max(1, args.calls // TXN_RECORDS) if step.name.startswith("etcd") else args.calls
        each = time_step(step, calls=calls, repeats=args.repeats)
        cost = each * step.per_job
        totals[step.side] = totals.get(step.side, 0.0) + cost
        print(f"{step.side + ': ' + step.name:<50} {each:8.2f} {step.per_job:6g} {cost:8.1f}")
    budget = CORES * 1e6 / TARGET_PODS_PER_SECOND
    for side, total in totals.items():
        print(f"{side} floor: {total:.0f} us per job, at most {1e6 / total:,.0f} jobs/s on one "
              f"core")  # fmt: skip
    both = sum(totals.values())
    print(
        f"{TARGET_PODS_PER_SECOND:,} pods/s on {CORES} cores leaves {budget:.0f} us per job for "
        f"every process together (broker, agents, etcd); these floors alone take {both:.0f} us "
        f"({both / budget:.0%} of it)"
    )


if __name__ == "__main__":
    main()
