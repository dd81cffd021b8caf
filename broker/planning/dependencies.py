"""Dependencies decided: is a waiting job's `spec.dependsOn` met, can it still be, and does a
submit close a cycle. Pure: no await, no clock, no I/O.

Called by `jobs.dependents` (the leader's task that queues or fails `Waiting` jobs) with the
states of the jobs each dependency resolved to (`api.dependencies.Resolved`) and, for one
that names an array, what its jobs' ends add up to (`ArrayEnds`, made by `summarize` once
per change of the array, not once per job waiting for it); and by the submit with the graph
of the request's jobs and the jobs they name (`find_cycle`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from broker.api import dependencies
from broker.api.dependencies import Condition
from broker.api.status import JobState


@dataclass(frozen=True)
class Verdict:
    """What a waiting job's dependencies say now: `met` (queue it), `failed` (the reason it
    can never start, DependencyFailed), or neither: `waiting_for` says which jobs it waits
    for, in its `dependsOn` order."""

    met: bool = False
    failed: str | None = None
    waiting_for: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class ArrayEnds:
    """What an array's jobs say now, in index order: how many there are, how many have not
    ended (the first of them, to name), the first that ended otherwise than Succeeded, the
    first that is gone (in neither the book, the store nor history)."""

    count: int
    unfinished: int = 0
    first_unfinished: tuple[str, JobState] | None = None
    first_unsuccessful: tuple[str, JobState] | None = None
    first_gone: str | None = None


def summarize(member_ids: Sequence[str], states: Mapping[str, JobState | None]) -> ArrayEnds:
    """`ArrayEnds` of the array of `member_ids` (index order), the jobs' states in `states`."""
    unfinished = 0
    first_unfinished: tuple[str, JobState] | None = None
    first_unsuccessful: tuple[str, JobState] | None = None
    first_gone: str | None = None
    for job_id in member_ids:
        state = states.get(job_id)
        if state is None:
            first_gone = first_gone or job_id
        elif not state.terminal:
            unfinished += 1
            first_unfinished = first_unfinished or (job_id, state)
        elif state != JobState.SUCCEEDED and first_unsuccessful is None:
            first_unsuccessful = (job_id, state)
    return ArrayEnds(
        count=len(member_ids),
        unfinished=unfinished,
        first_unfinished=first_unfinished,
        first_unsuccessful=first_unsuccessful,
        first_gone=first_gone,
    )


def _want(condition: Condition) -> str:
    return "to succeed" if condition == Condition.SUCCEEDED else "to finish"


def decide(
    resolved: Sequence[dependencies.Resolved],
    states: Mapping[str, JobState | None],
    arrays: Mapping[str, ArrayEnds] | None = None,
) -> Verdict:
    """The verdict on dependencies `resolved`, the jobs' states in `states` (None or absent:
    no such job, here or in history), an array's in `arrays` by its id (absent: each of its
    jobs' in `states`)."""
    waiting: list[str] = []
    for entry in resolved:
        if not entry.found:
            return Verdict(failed=f"dependency {entry.job!r}: no such job")
        if entry.array is not None:
            ends = (arrays or {}).get(entry.array) or summarize(entry.member_ids(), states)
            failed = _array_failed(entry, ends)
            if failed is not None:
                return Verdict(failed=failed)
            if ends.first_unfinished is not None:
                first, first_state = ends.first_unfinished
                waiting.append(
                    f"array {entry.job!r}: {ends.unfinished} of its {ends.count} jobs "
                    f"{_want(entry.condition)} (job {first}: {first_state.value})"
                )
            continue
        for job_id in entry.ids:
            state = states.get(job_id)
            if state is None:
                return Verdict(failed=f"dependency {entry.job!r}: job {job_id} is gone")
            if not state.terminal:
                waiting.append(f"job {job_id} ({state.value}) {_want(entry.condition)}")
                continue
            if entry.condition == Condition.SUCCEEDED and state != JobState.SUCCEEDED:
                return Verdict(
                    failed=f"dependency {entry.job!r}: job {job_id} ended {state.value}, "
                    "and this job needs it to succeed"
                )
    if waiting:
        return Verdict(waiting_for=tuple(waiting))
    return Verdict(met=True)


def _array_failed(entry: dependencies.Resolved, ends: ArrayEnds) -> str | None:
    if ends.first_gone is not None:
        return f"dependency {entry.job!r}: job {ends.first_gone} of the array is gone"
    if entry.condition == Condition.SUCCEEDED and ends.first_unsuccessful is not None:
        job_id, state = ends.first_unsuccessful
        return (
            f"dependency {entry.job!r}: job {job_id} of the array ended {state.value}, and "
            "this job needs every job of it to succeed"
        )
    return None


def find_cycle(starts: Sequence[str], edges: Callable[[str], Sequence[str]]) -> list[str] | None:
    """A cycle reachable from `starts` in the graph `edges` (a job -> the jobs it depends
    on), as the path that closes it (`[a, b, a]`), or None. Iterative depth-first search:
    each job is visited once, however deep the chain."""
    done: set[str] = set()
    for start in starts:
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        stack: list[tuple[str, list[str]]] = [(start, list(edges(start)))]
        while stack:
            node, todo = stack[-1]
            if not todo:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
                continue
            nxt = todo.pop()
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt in done:
                continue
            path.append(nxt)
            on_path.add(nxt)
            stack.append((nxt, list(edges(nxt))))
    return None
