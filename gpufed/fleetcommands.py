"""The fleet commands of `gpufed`: clusters, queues (list, show, apply, delete, allotments),
status.

As `jobcommands`: each returns the exit code and raises what the broker refuses. A tenant's
token lists and shows its own tenant's queues (the broker filters, `broker.http.roles`);
`status` asks every replica without a token.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpufed import client, jobcommands, problems, tables


async def clusters(args: argparse.Namespace, api: client.BrokerClient) -> int:
    items = await api.clusters()
    rows = [
        [
            c["name"],
            c["health"],
            m["model"],
            m["total"],
            m["free"],
            m["allocated"],
            m["unavailable"],
            c["running_jobs"],
            _mig_cell(m),
            ",".join(f"{k}={v}" for k, v in sorted((c.get("labels") or {}).items())) or "-",
        ]
        for c in items
        for m in (
            c["models"]
            or [{"model": "-", "total": "", "free": "", "allocated": "", "unavailable": ""}]
        )
    ]
    header = ["CLUSTER", "HEALTH", "MODEL", "GPUS", "FREE", "ALLOCATED", "UNAVAILABLE", "JOBS"]
    table = tables.render([*header, "MIG FREE/TOTAL", "LABELS"], rows)
    degraded = [f"{c['name']}: {c['reason']}" for c in items if c.get("reason")]
    sick = [_gpu_health(c) for c in items if c.get("unhealthy_gpus") or c.get("cordoned_nodes")]
    down = [_scored_down(c) for c in items if c.get("scored_down_until")]
    jobcommands.print_answer(args, items, "\n".join([table, *degraded, *sick, *down]))
    return 0


def _mig_cell(totals: dict[str, Any]) -> str:
    """`1g.10gb=10/14,3g.40gb=1/2`: a model's free and total MIG devices per profile
    (`-`: none, or a broker or agent before MIG)."""
    items = totals.get("mig") or []
    return ",".join(f"{i['profile']}={i['free']}/{i['total']}" for i in items) or "-"


def _gpu_health(cluster: dict[str, Any]) -> str:
    """`h100: 2 unhealthy GPUs; cordoned for GPU failures: node-3, node-7`."""
    parts = [f"{cluster.get('unhealthy_gpus') or 0} unhealthy GPUs"]
    if cluster.get("cordoned_nodes"):
        parts.append("cordoned for GPU failures: " + ", ".join(cluster["cordoned_nodes"]))
    return f"{cluster['name']}: " + "; ".join(parts)


def _scored_down(cluster: dict[str, Any]) -> str:
    """`stuck: scored down until 2025-01-01T10:10:00Z: 3 jobs it accepted did not start ...`"""
    why = cluster.get("scored_down_reason") or "it failed to start jobs it accepted"
    return f"{cluster['name']}: scored down until {cluster['scored_down_until']}: {why}"


def _queue_rows(views: Sequence[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for view in views:
        spec, st = view["spec"], view["status"]
        for item in st["gpus"] or [
            {"model": "-", "inUse": "", "guaranteed": "", "limit": "", "fairShare": ""}
        ]:
            rows.append(
                [
                    view["name"],
                    spec["tenant"],
                    spec["cohort"],
                    spec["weight"],
                    st["pendingJobs"],
                    st["runningJobs"],
                    item["model"],
                    item["inUse"],
                    item["guaranteed"],
                    "-" if item["limit"] is None else item["limit"],
                    item["fairShare"],
                    f"{st['dominantShare']:.3f}",
                    st["preemptions"],
                ]
            )
    return rows


QUEUE_HEADERS = [
    "QUEUE", "TENANT", "COHORT", "WEIGHT", "PENDING", "RUNNING", "MODEL", "IN USE",
    "GUARANTEED", "LIMIT", "FAIR SHARE", "SHARE", "PREEMPTED",
]  # fmt: skip


def _read_queues_file(path: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise problems.file_error(exc, what="queues file") from exc
    except yaml.YAMLError as exc:
        raise problems.CliError(
            f"{path}: not YAML: {exc}", kind="document", title="Not a queue"
        ) from exc


def _allotment_rows(shares: Sequence[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for share in shares:
        allotment = share["allotment"]
        for use in share["uses"]:
            rows.append(
                [
                    share["tenant"],
                    "declared" if share["declared"] else "from its queues",
                    use["model"],
                    f"{use['guaranteed']}/{use['allottedGuaranteed']}",
                    f"{_bound(use['limit'])}/{_bound(use['allottedLimit'])}",
                    f"{allotment['maxWeight']:g}",
                    allotment["maxPriorityClass"] or "-",
                    ",".join(allotment["cohorts"]) or "-",
                ]
            )
    return rows


def _bound(value: int | None) -> str:
    return "-" if value is None else str(value)


ALLOTMENT_HEADERS = [
    "TENANT", "ALLOTMENT", "MODEL", "GUARANTEED", "LIMITS", "MAX WEIGHT", "MAX CLASS", "COHORTS",
]  # fmt: skip


async def allotments(args: argparse.Namespace, api: client.BrokerClient) -> int:
    """`gpufed queues --allotments`: what each tenant may claim with its queues (a tenant's
    token: its own), and what its queues claim of it now: `claimed/allotted`, `-` unbounded."""
    shares = (await api.queues()).get("allotments", [])
    text = tables.render(ALLOTMENT_HEADERS, _allotment_rows(shares))
    warnings = [f"warning: {w}" for share in shares for w in share["warnings"]]
    jobcommands.print_answer(args, shares, "\n".join([text, *warnings]))
    return 0


async def queues(args: argparse.Namespace, api: client.BrokerClient) -> int:
    if args.allotments:
        if args.name or args.apply:
            raise problems.CliError(
                "--allotments lists every allotment the token may read: no NAME, no --apply",
                kind="usage",
                title="Usage",
                code=2,
            )
        return await allotments(args, api)
    if args.target is not None:
        if args.name != "delete" or args.apply:
            raise problems.CliError(
                "use `gpufed queues delete NAME`", kind="usage", title="Usage", code=2
            )
        answer = await api.delete_queue(args.target)
        text = f"queue {args.target} deleted"
        if answer:
            text = f"queue {args.target}: the API's override removed, the queues file's applies"
        jobcommands.print_answer(args, answer, text)
        return 0
    if args.apply:
        document = await asyncio.to_thread(_read_queues_file, args.apply)
        named = [{**document, "name": args.name}] if args.name else None
        specs = named or list(document.get("queues", []))
        views = [await api.put_queue(str(spec.pop("name")), spec) for spec in specs]
    elif args.name:
        views = [await api.queue(args.name)]
    else:
        listing = await api.queues()
        views = listing["items"]
    warnings = sorted({w for view in views for w in view.get("warnings", [])})
    text = tables.render(QUEUE_HEADERS, _queue_rows(views))
    if warnings:
        text += "\n" + "\n".join(f"warning: {w}" for w in warnings)
    jobcommands.print_answer(args, views if len(views) != 1 or not args.name else views[0], text)
    return 0


async def status(args: argparse.Namespace) -> int:
    """Each replica's own account of itself; 1 if one does not answer or none leads."""
    urls = client.split_urls(args.broker)
    answers = await asyncio.gather(*(client.replica_status(url) for url in urls))
    rows: list[list[Any]] = []
    for url, answer in zip(urls, answers, strict=True):
        if isinstance(answer, client.BrokerError):
            rows.append([url, "-", "unreachable", "-", "-", "-", answer.detail])
            continue
        synced = "yes" if answer.get("synced") else "no"
        leader = answer.get("leader") or "(none)"
        replica = answer.get("replica", "-")
        rows.append([url, replica, answer.get("role"), leader, answer.get("term"), synced, ""])
    seen = [a for a in answers if not isinstance(a, client.BrokerError)]
    notes = []
    leaders = {(a.get("leader"), a.get("term")) for a in seen}
    if not any(a.get("role") == "leader" for a in seen):
        notes.append("no replica leads")
    elif len(leaders) > 1:
        notes.append("the replicas do not agree on the leader yet")
    table = tables.render(["BROKER", "REPLICA", "ROLE", "LEADER", "TERM", "SYNCED", "ERROR"], rows)
    data = [
        {"broker": url, **(a if not isinstance(a, client.BrokerError) else {"error": a.detail})}
        for url, a in zip(urls, answers, strict=True)
    ]
    jobcommands.print_answer(args, data, table)
    for note in notes:
        print(f"gpufed status: {note}", file=sys.stderr)
    return 1 if notes or len(seen) < len(urls) else 0
