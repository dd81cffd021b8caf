"""One simulator run as data: the `Job` to replay (a policy and a seed) and its `Outcome`.

`gpufed.sim.simulating` makes the jobs and runs them (in worker processes with `--jobs`, so
both are picklable); `gpufed.sim.reports` turns the outcomes into tables, CSVs and the plot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpufed.sim import replaying


@dataclass(frozen=True)
class Job:
    """One replay: a policy and a seed (picklable, for worker processes)."""

    nodes: Path
    pods: Path
    policy: str
    seed: int
    tune: float
    clusters: int
    split_seed: int
    mode: str
    compression: float
    dump: bool


@dataclass
class Outcome:
    job: Job
    seconds: float
    alloc: dict[int, float] = field(default_factory=dict)  # arrived % -> allocation %
    frag: dict[int, float] = field(default_factory=dict)  # arrived % -> frag amount %
    failed: int = 0
    pods: int = 0
    dump: list[tuple[int, str, str, str, str]] = field(default_factory=list)
    timed: replaying.TimedReplay | None = None
