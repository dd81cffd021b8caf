"""Dependencies decided: is a waiting job's `spec.dependsOn` met, can it still be, and does a
submit close a cycle. Pure: no await, no clock, no I/O.

Called by `jobs.dependents` (the leader's task that queues or fails `Waiting` jobs) with the
states of the jobs each dependency resolved to (`api.dependencies.Resolved`), and by the
submit (`http.workflows`) with the graph of the request's jobs and the jobs they name.
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


def _want(condition: Condition) -> str:
    return "to succeed" if condition == Condition.SUCCEEDED else "to finish"


def decide(
    resolved: Sequence[dependencies.Resolved], states: Mapping[str, JobState | None]
) -> Verdict:
    """The verdict on dependencies `resolved`, the jobs' states in `states` (None or absent:
    no such job, here or in history)."""
    waiting: list[str] = []
    for entry in resolved:
        if not entry.ids:
            return Verdict(failed=f"dependency {entry.job!r}: no such job")
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
