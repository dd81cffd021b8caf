"""`gpufed simulate`: replay the Alibaba GPU trace through gpufed's placement.

Protocol A (default, `--mode a`) is the FGD paper's: the 1,213-node pool, pods shuffled per
seed, inflated to `--tune` × GPU capacity, never leaving, never retried. It prints, per
policy, the unallocated GPUs at 100% and 130% arrived workload (median and mean ± sd over
seeds) beside the published figure for the same workload, FGD's fragmentation measure at
100%, and writes `summary.csv`, `allocation.csv` (allocation vs arrived workload) and
`allocation.png` (drawn by `gpufed.sim.plotting`, no matplotlib) to `--out`. `--mode time`
replays pods at their creation times (divided by `--time-compression`), releases them at their
own lifetime, queues what does not fit (FIFO) and reports queueing-delay percentiles.

`--clusters K` splits the nodes into K member clusters (`traces.split_clusters`, seeded by
`--split-seed`), and every pod first goes through the broker's planner (`plan_cycle`).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

from gpufed.sim import replaying, reports, runs, traces
from member_agent.inventory import fragmentation
from member_agent.placement import policies

DATA = Path(__file__).resolve().parents[2] / "e2e" / "data"
DEFAULT_NODES = DATA / "openb_node_list_gpu_node.csv"
DEFAULT_PODS = DATA / "openb_pod_list_default.csv"


class SimulateError(Exception):
    """Bad input for `gpufed simulate` (missing file, unknown policy, bad seeds)."""


def add_parser(subparsers: Any) -> None:
    """Register `simulate` on an argparse sub-parsers object."""
    parser = subparsers.add_parser(
        "simulate",
        help="replay the Alibaba GPU trace through the placement policies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=Path, default=DEFAULT_NODES, help="node list CSV")
    parser.add_argument("--pods", type=Path, default=DEFAULT_PODS, help="pod list CSV")
    parser.add_argument(
        "--policy", default="default,fgd", help=f"comma-separated: {', '.join(policies.names())}"
    )
    parser.add_argument("--seeds", default="42-51", help="e.g. 42-51 or 42,45")
    parser.add_argument("--tune", type=float, default=1.3, help="inflate to this × GPU capacity")
    parser.add_argument("--clusters", type=int, default=1, help="member clusters (K)")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the node split")
    parser.add_argument(
        "--dump-placements",
        type=Path,
        default=None,
        help="CSV of every pod's placement (first policy, first seed)",
    )
    parser.add_argument("--out", type=Path, default=None, help="directory for CSVs and PNG")
    parser.add_argument(
        "--mode",
        choices=("a", "time"),
        default="a",
        help="a: the FGD paper's protocol A (arrivals only); time: arrivals and departures, "
        "with queueing delays",
    )
    parser.add_argument(
        "--time-compression",
        type=float,
        default=1.0,
        help="--mode time: trace seconds per replayed second",
    )
    parser.add_argument("--jobs", type=int, default=1, help="worker processes over runs")
    parser.add_argument(
        "--published", type=Path, default=None, help="published figures CSV (fgd_published.csv)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part.strip()[1:]:
                low, high = part.split("-", 1)
                seeds.extend(range(int(low), int(high) + 1))
            elif part.strip():
                seeds.append(int(part))
    except ValueError as exc:
        raise SimulateError(f"--seeds: {text!r} is not like 42-51 or 42,45") from exc
    if not seeds:
        raise SimulateError("--seeds: no seed given")
    return seeds


def run_job(job: runs.Job, progress: replaying.Progress | None = None) -> runs.Outcome:
    """Load the trace, replay it once, and reduce the snapshots to per-percent figures."""
    started = time.perf_counter()
    nodes = traces.load_nodes(job.nodes)
    pods = traces.load_pods(job.pods)
    workload = fragmentation.derive_workload(pod.shape for pod in pods)
    arrangement = traces.arrange(pods, nodes, seed=job.seed, tune=job.tune)
    groups = (
        [nodes]
        if job.clusters <= 1
        else traces.split_clusters(nodes, clusters=job.clusters, seed=job.split_seed)
    )
    federation = replaying.Federation(
        groups,
        ranks=arrangement.ranks,
        make_scorer=lambda: policies.make(job.policy, workload=workload, seed=job.seed),
        workload=workload,
    )
    outcome = runs.Outcome(job=job, seconds=0.0)
    if job.mode == "time":
        outcome.timed = replaying.replay_in_time(
            federation, pods, compression=job.compression, progress=progress
        )
        outcome.pods = len(pods)
    else:
        replay = replaying.replay_protocol_a(federation, arrangement.pods, progress=progress)
        outcome.alloc = reports.bucket(replay.arrived, replay.allocated,
                                       replay.capacity_milli)  # fmt: skip
        outcome.frag = reports.bucket(replay.arrived, replay.fragmentation, replay.capacity_milli)
        outcome.failed = replay.failed
        outcome.pods = len(arrangement.pods)
        if job.dump:
            outcome.dump = [
                (p.order, p.pod, p.cluster, p.node, ";".join(f"{i}:{m}" for i, m in p.gpus))
                for p in replay.placements
            ]
    outcome.seconds = time.perf_counter() - started
    return outcome


class ProgressBar:
    """A one-line progress bar on stderr."""

    def __init__(self, total_runs: int, *, enabled: bool) -> None:
        self.total = total_runs
        self.done = 0
        self.enabled = enabled
        self.label = ""

    def pods(self, done: int, total: int) -> None:
        self._draw(self.done + done / max(total, 1), f"{self.label} pod {done}/{total}")

    def run_finished(self, label: str) -> None:
        self.done += 1
        self._draw(float(self.done), label)

    def _draw(self, progress: float, note: str) -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * progress / max(self.total, 1))
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} runs {note:<40}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    """`gpufed simulate`: exit code 0, or 2 on bad input (the message on stderr)."""
    try:
        return _run(args)
    except (SimulateError, traces.TraceError, policies.UnknownPolicy) as exc:
        print(f"gpufed simulate: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    names = [name.strip() for name in args.policy.split(",") if name.strip()]
    for name in names:
        if name not in policies.REGISTRY:
            raise policies.UnknownPolicy(
                f"unknown policy {name!r}; known: {', '.join(policies.names())}"
            )
    seeds = parse_seeds(args.seeds)
    for path in (args.nodes, args.pods):
        if not path.is_file():
            raise SimulateError(f"{path}: no such file")
    jobs = [
        runs.Job(args.nodes, args.pods, name, seed, args.tune, args.clusters, args.split_seed,
                 args.mode, args.time_compression,
                 dump=args.dump_placements is not None and (name, seed) == (names[0], seeds[0]))
        for name in names
        for seed in seeds
    ]  # fmt: skip
    bar = ProgressBar(len(jobs), enabled=not args.quiet)
    outcomes: list[runs.Outcome] = []
    if args.jobs <= 1:
        for job in jobs:
            bar.label = f"{job.policy} seed {job.seed}"
            outcomes.append(run_job(job, progress=bar.pods))
            bar.run_finished(f"{job.policy} seed {job.seed} {outcomes[-1].seconds:.1f}s")
    else:
        with futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
            pending = {pool.submit(run_job, job): job for job in jobs}
            for done in futures.as_completed(pending):
                outcomes.append(done.result())
                job = pending[done]
                bar.run_finished(f"{job.policy} seed {job.seed} {outcomes[-1].seconds:.1f}s")
    bar.close()
    outcomes.sort(key=lambda o: (names.index(o.job.policy), o.job.seed))
    if args.dump_placements is not None:
        reports.write_dump(args.dump_placements, outcomes[0].dump)
    if args.mode == "time":
        reports.print_timed(outcomes, names)
        return 0
    published = reports.load_published(args.published, args.pods)
    rows = reports.summarise(outcomes, names, published, workload=args.pods.stem)
    reports.print_table(rows, workload=args.pods.stem, seeds=seeds, args=args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        reports.write_outputs(args.out, rows, outcomes, names)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpufed simulate", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
