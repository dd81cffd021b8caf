"""Topology groups: which sets of nodes a gang may be spread over. Pure.

Called by `gang.place_gang` before any node is chosen. It returns the node groups to try, in
order; the gang is placed wholly inside the first group where every pod fits.

* rack `required`: one group per rack; `preferred`: every rack, then the whole cluster.
* NVLink `required` on a gang of several pods, when some nodes carry an `nvlink_domain`: one
  group per domain (a node without a domain is a domain of its own: NVLink stops at its
  edge). When no node has a domain, NVLink only constrains GPUs inside each pod
  (`filtering.whole_slots` keeps a pod inside one island).

Groups are tried fullest first (least free GPU milli that can still hold the gang), so large
free racks and domains stay whole for large gangs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from broker.api import gangs, jobs
from member_agent.placement import indexing


@dataclass(frozen=True)
class Group:
    label: str  # "" for the whole cluster
    names: frozenset[str] | None  # None: every node


def plan_groups(
    entries: Iterable[indexing.Entry], request: gangs.GangRequest, *, gang_milli: int
) -> list[Group]:
    """The node groups to try for `request`, in order."""
    topo = request.topology
    rack_mode = topo.rack
    by_domain = request.pods > 1 and topo.nvlink == jobs.TopologyMode.REQUIRED
    if rack_mode == jobs.TopologyMode.NONE and not by_domain:
        return [Group("", None)]
    entries = list(entries)
    if by_domain and not any(entry.domain for entry in entries):
        by_domain = False
    keyed: dict[str, set[str]] = {}
    free: dict[str, int] = {}
    for entry in entries:
        parts = []
        if by_domain:
            parts.append(f"nvlink domain {entry.domain or entry.name}")
        if rack_mode != jobs.TopologyMode.NONE:
            parts.append(f"rack {entry.rack or '-'}")
        label = ", ".join(parts)
        keyed.setdefault(label, set()).add(entry.name)
        if entry.available:
            free[label] = free.get(label, 0) + sum(entry.gpu_free)
    ordered = sorted(
        keyed,
        key=lambda label: (free.get(label, 0) < gang_milli, free.get(label, 0), label),
    )
    groups = [Group(label, frozenset(keyed[label])) for label in ordered]
    if rack_mode == jobs.TopologyMode.PREFERRED:
        if by_domain:
            # anywhere, but still inside one NVLink domain
            domains: dict[str, set[str]] = {}
            for entry in entries:
                domains.setdefault(entry.domain or entry.name, set()).add(entry.name)
            groups += [
                Group(f"nvlink domain {name}", frozenset(members))
                for name, members in sorted(domains.items())
            ]
        else:
            groups.append(Group("", None))
    return groups
