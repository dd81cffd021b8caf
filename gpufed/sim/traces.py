"""The Alibaba GPU trace (2023, "openb") as data: node and pod CSVs, and protocol A's order.

`gpufed simulate` loads the CSVs here and asks `arrange` for the replay order of one seed.
Protocol A is the FGD paper's (Weng et al., USENIX ATC '23; the authors' simulator): pods
sorted by name and shuffled with the seed; copies drawn uniformly with replacement and
appended until the GPU request would pass `tune` × capacity (the stop test adds the drawn
pod's *per-GPU* milli, as the authors' code does); if the trace already asks for more,
random pods are removed instead. Then the nodes get a random rank from the same generator:
equal scores go to the lowest rank. No departures, no retries.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

GPU_MILLI = 1000


class TraceError(ValueError):
    """A trace file that cannot be read as the openb schema."""


@dataclass(frozen=True)
class TraceNode:
    sn: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int  # per GPU; < 1000 only for sharing pods
    models: tuple[str, ...] = ()
    creation: int | None = None
    deletion: int | None = None

    @property
    def gpu_total(self) -> int:
        return self.num_gpu * self.gpu_milli

    @property
    def shape(self) -> tuple[int, int, int, tuple[str, ...]]:
        """FGD's typical-shape key: CPU, per-GPU milli, GPU count, models."""
        return (self.cpu_milli, self.gpu_milli, self.num_gpu, self.models)


def _int(row: dict[str, str], column: str, where: str) -> int:
    try:
        return int(row[column])
    except (KeyError, ValueError) as exc:
        raise TraceError(f"{where}: column {column!r} is not an integer") from exc


def _open_rows(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as handle:
            return list(csv.DictReader(handle))
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from exc


def load_nodes(path: Path) -> list[TraceNode]:
    """GPU nodes of a node-list CSV (`sn, cpu_milli, memory_mib, gpu, model`)."""
    nodes = []
    for line, row in enumerate(_open_rows(path), start=2):
        where = f"{path.name}:{line}"
        nodes.append(
            TraceNode(
                sn=row.get("sn") or f"node-{line - 2:04d}",
                cpu_milli=_int(row, "cpu_milli", where),
                memory_mib=_int(row, "memory_mib", where),
                gpus=_int(row, "gpu", where),
                model=row.get("model") or "",
            )
        )
    return nodes


def load_pods(path: Path) -> list[TracePod]:
    """Pods of a pod-list CSV; times are kept when the file has them."""
    pods = []
    for line, row in enumerate(_open_rows(path), start=2):
        where = f"{path.name}:{line}"
        num_gpu = _int(row, "num_gpu", where)
        spec = (row.get("gpu_spec") or "").strip()
        created = (row.get("creation_time") or "").strip()
        deleted = (row.get("deletion_time") or "").strip()
        pods.append(
            TracePod(
                name=row.get("name") or f"pod-{line - 2:04d}",
                cpu_milli=_int(row, "cpu_milli", where),
                memory_mib=_int(row, "memory_mib", where),
                num_gpu=num_gpu,
                gpu_milli=_int(row, "gpu_milli", where) if num_gpu else 0,
                models=tuple(sorted(m for m in spec.split("|") if m)),
                creation=int(created) if created else None,
                deletion=int(deleted) if deleted else None,
            )
        )
    return pods


@dataclass(frozen=True)
class Arrangement:
    """One seed's replay: pods in arrival order and each node's tie-break rank."""

    pods: tuple[TracePod, ...]
    ranks: dict[str, int]
    original: int  # pods taken from the trace itself (the rest are copies)


def arrange(
    pods: Sequence[TracePod], nodes: Sequence[TraceNode], *, seed: int, tune: float
) -> Arrangement:
    """Protocol A's order for `seed`: shuffle, inflate (or prune) to `tune` × GPU capacity."""
    rng = random.Random(seed)
    by_name = sorted(pods, key=lambda pod: pod.name)
    order = list(by_name)
    rng.shuffle(order)
    capacity = sum(node.gpus for node in nodes) * GPU_MILLI
    target = tune * capacity
    total = sum(pod.gpu_total for pod in order)
    original = len(order)
    if tune > 0 and total > target:
        while total > target and order:
            removed = order.pop(rng.randrange(len(order)))
            total -= removed.gpu_total
        original = len(order)
    elif tune > 0 and total < target and by_name:
        copy = 0
        while True:
            drawn = by_name[rng.randrange(len(by_name))]
            if total + drawn.gpu_milli > target:  # per-GPU milli: the authors' stop test
                break
            total += drawn.gpu_total
            order.append(replace(drawn, name=f"{drawn.name}-tuned-{copy}"))
            copy += 1
    names = sorted(node.sn for node in nodes)
    permutation = list(range(len(names)))
    rng.shuffle(permutation)
    return Arrangement(
        pods=tuple(order),
        ranks={name: permutation[i] for i, name in enumerate(names)},
        original=original,
    )


def split_clusters(
    nodes: Sequence[TraceNode], *, clusters: int, seed: int
) -> list[list[TraceNode]]:
    """A seeded random split of the nodes into `clusters` member clusters of near-equal size.

    Nodes are sorted by name, shuffled with `random.Random(seed)` and dealt round-robin, so
    every cluster gets about the same number of nodes and a similar model mix.
    """
    if clusters < 1:
        raise ValueError("clusters must be at least 1")
    ordered = sorted(nodes, key=lambda node: node.sn)
    random.Random(seed).shuffle(ordered)
    return [ordered[i::clusters] for i in range(clusters)]
