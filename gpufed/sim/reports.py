"""Figures of a trace replay: per-percent buckets, the policy table, CSVs, plot and dump.

Called by `gpufed.sim.simulating` after the runs. The arrived-workload axis follows the FGD
authors' analysis (`experiments/analysis/merge_alloc_discrete*.py`): after every pod,
arrived % = 100 × requested GPU milli so far (failed pods included) / capacity and allocated %
likewise; snapshots are grouped by arrived % rounded to an integer, each rounded to two
decimals and averaged; an empty bucket takes the snapshots within ±1.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufed.sim import plotting, runs

DATA = Path(__file__).resolve().parents[2] / "e2e" / "data"

# our policy -> the published policy it is compared with ("" = none)
COMPARED = {
    "default": "06-FGD",
    "fgd": "06-FGD",
    "fgd-float": "06-FGD",
    "bestfit": "05-BestFit",
    "random": "01-Random",
}
PUBLISHED_ONLY = ("02-DotProd", "03-GpuClustering", "04-GpuPacking")

Stats = tuple[float, float, float]  # median, mean, sd


def bucket(arrived: Sequence[int], values: Sequence[float], capacity: int) -> dict[int, float]:
    """Per integer arrived %, the mean of `values` as % of `capacity` (authors' rounding)."""
    groups: dict[int, list[float]] = {}
    for came, value in zip(arrived, values, strict=True):
        groups.setdefault(round(100 * came / capacity), []).append(round(100 * value / capacity, 2))
    out: dict[int, float] = {}
    for percent in range(0, 131):
        items = groups.get(percent)
        if not items:
            items = [v for p in (percent - 1, percent, percent + 1) for v in groups.get(p, [])]
        if items:
            out[percent] = round(sum(items) / len(items), 2)
    return out


def stats(values: Sequence[float]) -> Stats | None:
    if not values:
        return None
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return (statistics.median(values), statistics.mean(values), sd)


def load_published(explicit: Path | None, pods: Path) -> dict[tuple[str, str, str, int], Stats]:
    """Published per-policy figures: `explicit`, else beside the trace, else e2e/data."""
    candidates = [explicit] if explicit is not None else [
        pods.parent.parent / "fgd-expected-results" / "anchor_summary.csv",
        pods.parent / "fgd_published.csv",
        DATA / "fgd_published.csv",
    ]  # fmt: skip
    for path in candidates:
        if path.is_file():
            table: dict[tuple[str, str, str, int], Stats] = {}
            with path.open(newline="") as handle:
                for row in csv.DictReader(handle):
                    policy = row.get("policy") or row.get("sc_policy") or ""
                    key = (row["workload"], policy, row["metric"], int(row["arrived_pct"]))
                    table[key] = (float(row["median"]), float(row["mean"]), float(row["stdev"]))
            return table
    return {}


@dataclass
class Row:
    policy: str
    seeds: int
    unalloc100: Stats | None
    unalloc130: Stats | None
    frag100: Stats | None
    failed: float
    seconds: float
    compared: str
    published100: Stats | None
    published130: Stats | None
    published_frag100: Stats | None


def _unalloc(alloc: Stats | None) -> Stats | None:
    return None if alloc is None else (100 - alloc[0], 100 - alloc[1], alloc[2])


def summarise(
    outcomes: Sequence[runs.Outcome],
    names: Sequence[str],
    published: dict[tuple[str, str, str, int], Stats],
    *,
    workload: str,
) -> list[Row]:
    rows = []
    for name in names:
        mine = [o for o in outcomes if o.job.policy == name]
        compared = COMPARED.get(name, "")
        rows.append(
            Row(
                policy=name,
                seeds=len(mine),
                unalloc100=stats([100 - o.alloc[100] for o in mine if 100 in o.alloc]),
                unalloc130=stats([100 - o.alloc[130] for o in mine if 130 in o.alloc]),
                frag100=stats([o.frag[100] for o in mine if 100 in o.frag]),
                failed=statistics.mean(o.failed for o in mine) if mine else 0.0,
                seconds=statistics.mean(o.seconds for o in mine) if mine else 0.0,
                compared=compared,
                published100=_unalloc(published.get((workload, compared, "gpu_alloc_pct", 100))),
                published130=_unalloc(published.get((workload, compared, "gpu_alloc_pct", 130))),
                published_frag100=published.get(
                    (workload, compared, "frag_amount_pct_of_capacity", 100)
                ),
            )
        )
    for label in PUBLISHED_ONLY:
        alloc100 = published.get((workload, label, "gpu_alloc_pct", 100))
        if alloc100 is not None:
            rows.append(
                Row(label, 0, None, None, None, 0.0, 0.0, label, _unalloc(alloc100),
                    _unalloc(published.get((workload, label, "gpu_alloc_pct", 130))),
                    published.get((workload, label, "frag_amount_pct_of_capacity", 100)))
            )  # fmt: skip
    return rows


def _fmt(value: Stats | None) -> str:
    if value is None:
        return "—"
    return f"{value[0]:5.2f} | {value[1]:5.2f}±{value[2]:.2f}"


def print_table(
    rows: Sequence[Row], *, workload: str, seeds: Sequence[int], args: argparse.Namespace
) -> None:
    seed_text = f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])
    print(
        f"workload {workload}  seeds {seed_text}  tune {args.tune}  clusters {args.clusters}\n"
        "unallocated GPUs, % of capacity: median | mean±sd over seeds (published: the FGD "
        "authors' runs, Weng et al. ATC'23)"
    )
    header = (
        f"{'policy':<17}{'ours @100%':<21}{'ours @130%':<21}{'frag @100%':<21}"
        f"{'published (as)':<18}{'published @100%':<21}{'published @130%':<21}"
        f"{'pub frag @100%':<21}{'failed':>7}{'s/run':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        ours = row.seeds > 0
        print(
            f"{(row.policy if ours else '(' + row.policy + ')'):<17}"
            f"{_fmt(row.unalloc100):<21}{_fmt(row.unalloc130):<21}{_fmt(row.frag100):<21}"
            f"{(row.compared.split('-', 1)[-1] if row.compared else '—'):<18}"
            f"{_fmt(row.published100):<21}{_fmt(row.published130):<21}"
            f"{_fmt(row.published_frag100):<21}"
            f"{(f'{row.failed:.0f}' if ours else ''):>7}"
            f"{(f'{row.seconds:.1f}' if ours else ''):>7}"
        )


def write_outputs(
    out: Path, rows: Sequence[Row], outcomes: Sequence[runs.Outcome], names: Sequence[str]
) -> None:
    """summary.csv, seeds.csv (per run), allocation.csv (allocation % vs arrived %), the PNG."""
    with (out / "seeds.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            ["policy", "seed", "pods", "failed", "unallocated_pct@100", "unallocated_pct@130",
             "frag_amount_pct@100", "seconds"]
        )  # fmt: skip
        for outcome in outcomes:
            writer.writerow(
                [
                    outcome.job.policy,
                    outcome.job.seed,
                    outcome.pods,
                    outcome.failed,
                    *(
                        f"{100 - outcome.alloc[p]:.2f}" if p in outcome.alloc else ""
                        for p in (100, 130)
                    ),
                    f"{outcome.frag[100]:.2f}" if 100 in outcome.frag else "",
                    f"{outcome.seconds:.2f}",
                ]
            )
    with (out / "summary.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            ["policy", "seeds", "metric", "ours_median", "ours_mean", "ours_sd",
             "published_as", "published_median", "published_mean", "published_sd"]
        )  # fmt: skip
        for row in rows:
            for metric, ours, theirs in (
                ("unallocated_pct@100", row.unalloc100, row.published100),
                ("unallocated_pct@130", row.unalloc130, row.published130),
                ("frag_amount_pct@100", row.frag100, row.published_frag100),
            ):
                writer.writerow(
                    [row.policy, row.seeds, metric, *_cells(ours), row.compared, *_cells(theirs)]
                )
    series = []
    with (out / "allocation.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            ["policy", "arrived_pct", "seeds", "alloc_median", "alloc_mean", "alloc_sd"]
        )
        for name in names:
            points = []
            for percent in range(0, 131):
                values = [o.alloc[percent] for o in outcomes
                          if o.job.policy == name and percent in o.alloc]  # fmt: skip
                figures = stats(values)
                if figures is None:
                    continue
                writer.writerow([name, percent, len(values), *_cells(figures)])
                points.append((float(percent), figures[0]))
            series.append((name, points))
    plotting.plot_lines(
        out / "allocation.png",
        series,
        title="GPU ALLOCATION VS ARRIVED WORKLOAD (MEDIAN OVER SEEDS)",
        x_range=(50, 130),
        y_range=(50, 100),
        x_step=10,
        y_step=10,
        x_label="ARRIVED WORKLOAD %",
        y_label="ALLOCATED %",
    )


def _cells(value: Stats | None) -> list[str]:
    return ["", "", ""] if value is None else [f"{v:.3f}" for v in value]


def write_dump(path: Path, rows: Sequence[tuple[int, str, str, str, str]]) -> None:
    """One row per pod in arrival order: order,pod,cluster,node,gpus."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["order", "pod", "cluster", "node", "gpus"])
        writer.writerows(rows)


def print_timed(outcomes: Sequence[runs.Outcome], names: Sequence[str]) -> None:
    print("time-driven replay: queueing delay (trace seconds after compression), GPU use")
    header = (
        f"{'policy':<12}{'seed':>6}{'placed':>8}{'waiting':>9}{'p50 s':>10}{'p90 s':>10}"
        f"{'p99 s':>10}{'max s':>10}{'peak GPU %':>12}{'mean GPU %':>12}"
    )
    print(header)
    print("-" * len(header))
    for outcome in outcomes:
        timed = outcome.timed
        if timed is None:
            continue
        delays = sorted(timed.delays)

        def pct(q: float, delays: list[float] = delays) -> float:
            return delays[min(len(delays) - 1, int(q * len(delays)))] if delays else 0.0

        cap = max(timed.capacity_milli, 1)
        print(
            f"{outcome.job.policy:<12}{outcome.job.seed:>6}{len(delays):>8}"
            f"{timed.never_placed:>9}{pct(0.5):>10.0f}{pct(0.9):>10.0f}{pct(0.99):>10.0f}"
            f"{(delays[-1] if delays else 0.0):>10.0f}"
            f"{100 * timed.peak_allocated_milli / cap:>12.2f}"
            f"{100 * timed.mean_allocated_milli / cap:>12.2f}"
        )
    sys.stdout.flush()
