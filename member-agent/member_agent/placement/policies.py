"""The named placement policies: a registry from name to score plug-in. Pure.

`place_gang(..., policy="name")` resolves names here; `gpufed simulate --policy a,b` builds
them with the trace's expected workload. Names:

* `fgd`: FGD exactly as published (integer score, ties to the lowest rank).
* `fgd-float`: FGD comparing the fragmentation change itself, not its truncated sigmoid.
* `bestfit`: the FGD paper's BestFit (least weighted CPU/GPU leftover).
* `binpack`, `spread`, `firstfit`, `random`: the classic heuristics.
* `default`: FGD's score, ties to a node already in use, then the rank; see `make_default`.
"""

from __future__ import annotations

from collections.abc import Callable

from member_agent.inventory import fragmentation
from member_agent.placement import scoring

DEFAULT = "default"

Factory = Callable[[fragmentation.Workload, int], scoring.Scorer]


def make_default(workload: fragmentation.Workload, seed: int = 0) -> scoring.Scorer:
    """gpufed's default: FGD's integer score; among equal scores a node already running GPU
    work before an untouched one; then the rank (a stable pseudo-random order of the nodes).

    On the Alibaba 2023 trace (protocol A; `gpufed simulate`) it ties FGD within seed noise
    (median unallocated GPUs at 100% arrival), and keeps untouched nodes whole for gangs.
    Finer scores are worse: the exact fragmentation change (`fgd-float`) leaves more GPUs
    unallocated. e2e/README.md gives the figures.
    """
    del seed
    return scoring.FGD(workload, name=DEFAULT, prefer_used=True)


REGISTRY: dict[str, Factory] = {
    "fgd": lambda workload, seed: scoring.FGD(workload, name="fgd"),
    "fgd-float": lambda workload, seed: scoring.FGD(workload, name="fgd-float", truncate=False),
    "bestfit": lambda workload, seed: scoring.BestFit(),
    "binpack": lambda workload, seed: scoring.Binpack(),
    "spread": lambda workload, seed: scoring.Spread(),
    "firstfit": lambda workload, seed: scoring.Scorer(),
    "random": lambda workload, seed: scoring.Random(seed),
    DEFAULT: make_default,
}

_shared: dict[str, scoring.Scorer] = {}


class UnknownPolicy(ValueError):
    """A policy name that is not in the registry."""


def names() -> list[str]:
    return sorted(REGISTRY)


def make(
    name: str, *, workload: fragmentation.Workload | None = None, seed: int = 0
) -> scoring.Scorer:
    """A fresh plug-in for `name`, with `workload` as FGD's expected workload."""
    factory = REGISTRY.get(name)
    if factory is None:
        raise UnknownPolicy(f"unknown placement policy {name!r}; known: {', '.join(names())}")
    return factory(workload if workload is not None else fragmentation.default_workload(), seed)


def resolve(policy: str | scoring.Scorer) -> scoring.Scorer:
    """A plug-in object as is, or a shared one by name (with the fixed default workload)."""
    if isinstance(policy, scoring.Scorer):
        return policy
    scorer = _shared.get(policy)
    if scorer is None:
        scorer = make(policy)
        _shared[policy] = scorer
    return scorer
