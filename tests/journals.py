"""Reading the simulated clusters' pod journals (`gpufed agent --sim-journal FILE`): when each
copy of each job ran, and for how long two copies of one job ran at the same moment.

A copy is one attempt of a job on one cluster; it runs while at least one of its pods runs. A
pod whose start has no stop (its agent was killed) counts as running until `until`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

Interval = tuple[float, float]


@dataclass(frozen=True)
class Copy:
    job: str
    cluster: str
    attempt: int


def read(paths: Iterable[Path], *, until: float | None = None) -> dict[Copy, list[Interval]]:
    """Every copy's running intervals (merged over its pods), from the journal files."""
    end = time.time() if until is None else until
    started: dict[tuple[Copy, str], float] = {}
    pods: dict[Copy, list[Interval]] = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            copy = Copy(entry["job"], entry["cluster"], int(entry["attempt"]))
            key = (copy, entry["pod"])
            if entry["event"] == "start":
                started[key] = float(entry["t"])
            elif entry["event"] == "stop" and key in started:  # not `terminate`: it runs on
                pods.setdefault(copy, []).append((started.pop(key), float(entry["t"])))
    for (copy, _), since in started.items():
        pods.setdefault(copy, []).append((since, end))
    return {copy: merge(intervals) for copy, intervals in pods.items()}


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, stop in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def overlap_seconds(copies: dict[Copy, list[Interval]]) -> dict[str, float]:
    """Per job, the seconds during which two or more of its copies ran at once."""
    edges: dict[str, list[tuple[float, int]]] = {}
    for copy, intervals in copies.items():
        for start, stop in intervals:
            edges.setdefault(copy.job, []).extend([(start, 1), (stop, -1)])
    out = {}
    for job, points in edges.items():
        running = 0
        since = 0.0
        total = 0.0
        for at, step in sorted(points, key=lambda p: (p[0], p[1])):  # stops before starts
            if running >= 2:
                total += at - since
            running += step
            since = at
        out[job] = total
    return out
