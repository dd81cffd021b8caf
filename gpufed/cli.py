"""`gpufed`: run the broker or an agent, submit and watch jobs, run the demo or the simulator."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpufed import batches, client, daemons, tables

DEFAULT_BROKER = "http://127.0.0.1:8080"


def _token(args: argparse.Namespace) -> str:
    if args.token:
        return str(args.token)
    if os.environ.get("GPUFED_TOKEN"):
        return os.environ["GPUFED_TOKEN"]
    path = args.token_file or os.environ.get("GPUFED_TOKEN_FILE")
    if path:
        return Path(path).read_text().strip()
    raise SystemExit("gpufed: no token: pass --token, --token-file, or set GPUFED_TOKEN")


def _user_parser(sub: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
    parser.add_argument(
        "--broker",
        default=os.environ.get("GPUFED_BROKER", DEFAULT_BROKER),
        help="broker URL (env GPUFED_BROKER)",
    )
    parser.add_argument("--token", help="bearer token (env GPUFED_TOKEN)")
    parser.add_argument("--token-file", help="file holding the token (env GPUFED_TOKEN_FILE)")
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpufed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    daemons.add_broker_parser(sub)
    daemons.add_agent_parser(sub)

    submit = _user_parser(
        sub,
        "submit",
        "submit GPUJobs from a YAML or JSON file ('-' = stdin) or a directory; several "
        "documents go in batches (POST /v1/jobs:batch), one line per job",
    )
    submit.add_argument("file", nargs="?", help="as -f")
    submit.add_argument(
        "-f",
        "--filename",
        help="a file of one or more YAML documents (---) or one JSON document, '-' (stdin), or "
        "a directory: every *.yaml, *.yml, *.json in it, sorted by name. One document: "
        "POST /v1/jobs; several: batches of up to 1000, exit 1 if any job is refused",
    )
    submit.add_argument(
        "--idempotency-key",
        metavar="K",
        help="the job's key: submitting again with it replays the job. With several "
        "documents, the one at index i (from 0, in file order, files sorted) gets K-<i>",
    )
    for name, text in [
        ("get", "show one job"),
        ("cancel", "cancel a job"),
        ("why", "why a job is not running"),
    ]:
        _user_parser(sub, name, text).add_argument("job_id")
    listing = _user_parser(sub, "list", "list jobs, live and finished (history), newest first")
    listing.add_argument("--queue", help="only this queue's jobs")
    listing.add_argument("--state", help="only jobs in this state (any case: running, Queued)")
    listing.add_argument("--cluster", help="only jobs placed on this cluster")
    listing.add_argument(
        "-l", "--selector", help="label selector on metadata.labels (team=vision,tier!=spot)"
    )
    listing.add_argument(
        "--limit", type=int, default=500, help="at most this many jobs (default 500)"
    )
    listing.add_argument("--all", action="store_true", help="every job, page after page")
    _user_parser(sub, "clusters", "member clusters and their GPUs")
    _user_parser(
        sub, "status", "the broker replicas (--broker URL1,URL2,...): role, leader, term, synced"
    )
    queues = _user_parser(
        sub, "queues", "queues: quotas, usage, fair share (a tenant's token: its own queues)"
    )
    queues.add_argument("name", nargs="?", help="one queue; `delete NAME`: delete queue NAME")
    queues.add_argument("target", nargs="?", help=argparse.SUPPRESS)
    queues.add_argument(
        "--apply", metavar="FILE", help="put queue NAME from FILE, or each queue of a queues file"
    )

    token = sub.add_parser("token", help="tokens for the broker's tokens file")
    token_actions = token.add_subparsers(dest="action", required=True)
    create = token_actions.add_parser(
        "create",
        help="print a new random token (once) and its entry for the tokens file (digest only)",
    )
    create.add_argument("--tenant", help="the tenant it acts for (submitter by default)")
    create.add_argument(
        "--role",
        help="admin, tenant-admin, submitter, viewer (no --tenant: the whole fleet), "
        "agent:CLUSTER, metrics",
    )
    create.add_argument(
        "--expires", metavar="WHEN", help="a duration (90m, 30d) or an RFC 3339 time; none: never"
    )
    create.add_argument("--name", help="names the token in the broker's logs and problems")
    create.add_argument("-o", "--output", choices=["text", "json"], default="text")

    demo = sub.add_parser("demo", help="broker + 3 simulated clusters + a mixed workload")
    demo.add_argument("--jobs", type=int, default=72)
    demo.add_argument("--keep", action="store_true", help="keep the work directory")

    from gpufed.sim import simulating

    simulating.add_parser(sub)
    return parser


def _print(args: argparse.Namespace, data: Any, table: str) -> None:
    if args.output == "json":
        print(json.dumps(data, indent=2))
    else:
        print(table)


def _job_table(items: Sequence[dict[str, Any]]) -> str:
    rows = []
    for job in items:
        st = job["status"]
        gpus = sum(len(p.get("gpus", [])) for p in st.get("pods", []))
        rows.append(
            [
                job["id"],
                job["job"]["spec"]["queue"],
                st["state"],
                st.get("cluster") or "",
                gpus or "",
                job["created"][:19].replace("T", " "),
            ]
        )
    return tables.render(["ID", "QUEUE", "STATE", "CLUSTER", "GPUS", "CREATED"], rows)


def _job_detail(job: dict[str, Any]) -> str:
    st = job["status"]
    lines = [
        f"Job:      {job['id']}  ({job['job']['metadata']['name']})",
        f"Tenant:   {job['tenant']}   Queue: {job['job']['spec']['queue']}",
        f"State:    {st['state']}" + (f" on {st['cluster']}" if st.get("cluster") else ""),
        f"Trace:    {job.get('traceId') or '-'}",
    ]
    if st.get("reasons"):
        lines.append("Waiting:  " + "; ".join(st["reasons"]))
    if st.get("pods"):
        lines.append("")
        lines.append(
            tables.render(
                ["POD", "NODE", "GPUS", "PHASE"],
                [
                    [
                        p["name"],
                        p["node"],
                        ",".join(str(g["index"]) for g in p.get("gpus", [])),
                        p.get("phase", ""),
                    ]
                    for p in st["pods"]
                ],
            )
        )
    lines.append("")
    lines.append(
        tables.render(
            ["TIME", "STATE", "REASON", "MESSAGE"],
            [
                [e["time"][11:23], e["state"], e["reason"], e.get("message", "")]
                for e in st["events"]
            ],
        )
    )
    return "\n".join(lines)


async def _user_command(args: argparse.Namespace) -> int:
    async with client.BrokerClient(args.broker, _token(args)) as api:
        try:
            return await _dispatch_user(args, api)
        except client.BrokerError as exc:
            print(f"gpufed {args.command}: {exc.detail}", file=sys.stderr)
            for error in exc.body.get("errors", [])[1:]:
                print(f"  {error.get('field')}: {error.get('message')}", file=sys.stderr)
            return 1


async def _submit(args: argparse.Namespace, api: client.BrokerClient) -> int:
    path = args.filename or args.file
    if path is None:
        raise SystemExit("gpufed submit: name a file, '-' (stdin) or a directory (-f PATH)")
    try:
        documents = batches.read_documents(
            path, stdin_text=sys.stdin.read() if path == "-" else None
        )
    except batches.DocumentError as exc:
        print(f"gpufed submit: {exc}; nothing submitted", file=sys.stderr)
        return 1
    if not documents:
        print(f"gpufed submit: no job in {path}", file=sys.stderr)
        return 1
    if len(documents) == 1:  # one job: the single route, the text as written
        only = documents[0]
        result = await api.submit(
            only.text, yaml=not only.is_json, idempotency_key=args.idempotency_key
        )
        _print(args, result, f"{result['id']} {result['state']} (trace {result.get('traceId')})")
        return 0
    answered: list[dict[str, Any]] = []
    try:
        async for results in batches.submit_all(api, documents, key=args.idempotency_key):
            answered.extend(results)
            if args.output != "json":
                for result in results:
                    print(batches.line_of(result), flush=True)
    except client.BrokerError:
        left = len(documents) - len(answered)
        print(f"gpufed submit: {left} of {len(documents)} jobs not submitted", file=sys.stderr)
        if args.output == "json":
            print(json.dumps(answered, indent=2))
        raise
    if args.output == "json":
        print(json.dumps(answered, indent=2))
    return 1 if any(int(r["status"]) >= 400 for r in answered) else 0


async def _dispatch_user(args: argparse.Namespace, api: client.BrokerClient) -> int:
    if args.command == "submit":
        return await _submit(args, api)
    elif args.command == "get":
        job = await api.get(args.job_id)
        _print(args, job, _job_detail(job))
    elif args.command == "cancel":
        job = await api.cancel(args.job_id)
        _print(args, job, f"{job['id']} cancelling ({job['status']['state']})")
    elif args.command == "why":
        answer = await api.why(args.job_id)
        rows = [[r["cluster"], r["code"], r["message"]] for r in answer.get("reasons", [])]
        if not rows:
            rows = [[c["cluster"], "", r] for c in answer["clusters"] for r in c["reasons"]]
        text = f"{answer['id']}: {answer['state']} (queue {answer.get('queue', '-')})"
        table = tables.render(["CLUSTER", "CODE", "REASON"], rows)
        text += "\n" + (table if rows else answer["message"])
        _print(args, answer, text)
    elif args.command == "queues":
        return await _queues_command(args, api)
    elif args.command == "list":
        items, more = await _list_jobs(args, api)
        _print(args, items, _job_table(items))
        if more:
            print(f"(more jobs than --limit {args.limit}: raise it, or --all)", file=sys.stderr)
    elif args.command == "clusters":
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
            ]
            for c in items
            for m in (
                c["models"]
                or [{"model": "-", "total": "", "free": "", "allocated": "", "unavailable": ""}]
            )
        ]
        table = tables.render(
            ["CLUSTER", "HEALTH", "MODEL", "GPUS", "FREE", "ALLOCATED", "UNAVAILABLE", "JOBS"],
            rows,
        )
        degraded = [f"{c['name']}: {c['reason']}" for c in items if c.get("reason")]
        _print(args, items, "\n".join([table, *degraded]))
    return 0


async def _list_jobs(
    args: argparse.Namespace, api: client.BrokerClient
) -> tuple[list[dict[str, Any]], bool]:
    """The jobs `gpufed list` shows, a page at a time; and whether more were left out."""
    state = _state_name(args.state) if args.state else None
    wanted = None if args.all else max(1, args.limit)
    items: list[dict[str, Any]] = []
    cont: str | None = None
    while wanted is None or len(items) < wanted:
        size = client.PAGE if wanted is None else min(client.PAGE, wanted - len(items))
        page, cont = await api.job_page(
            queue=args.queue,
            state=state,
            cluster=args.cluster,
            selector=args.selector,
            limit=size,
            cont=cont,
        )
        items += page
        if cont is None:
            break
    return items, cont is not None


def _state_name(text: str) -> str:
    """A job state as the API spells it, from any case (`running` → `Running`)."""
    from broker.api import status

    for state in status.JobState:
        if state.value.lower() == text.lower():
            return state.value
    return text  # the broker names the states it takes


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


async def _queues_command(args: argparse.Namespace, api: client.BrokerClient) -> int:
    import yaml

    if args.target is not None:
        if args.name != "delete" or args.apply:
            print("gpufed queues: use `gpufed queues delete NAME`", file=sys.stderr)
            return 2
        answer = await api.delete_queue(args.target)
        text = f"queue {args.target} deleted"
        if answer:
            text = f"queue {args.target}: the API's override removed, the queues file's applies"
        _print(args, answer, text)
        return 0
    if args.apply:
        document = yaml.safe_load(Path(args.apply).read_text()) or {}
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
    _print(args, views if len(views) != 1 or not args.name else views[0], text)
    return 0


async def _status_command(args: argparse.Namespace) -> int:
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
    _print(args, data, table)
    for note in notes:
        print(f"gpufed status: {note}", file=sys.stderr)
    return 1 if notes or len(seen) < len(urls) else 0


def _token_command(args: argparse.Namespace) -> int:
    """`gpufed token create`: the token on the first line, then its entry for the file."""
    from datetime import UTC, datetime

    from gpufed import issuing

    seconds = None
    if args.expires is not None:
        try:
            seconds = daemons.duration(args.expires)
        except argparse.ArgumentTypeError:  # not a duration: an RFC 3339 time, or wrong
            seconds = None
    try:
        expires = issuing.expiry_of(args.expires, seconds=seconds, now=datetime.now(UTC))
        token, entry = issuing.create(
            tenant=args.tenant, role=args.role, expires=expires, name=args.name
        )
    except issuing.TokenRequestError as exc:
        print(f"gpufed token create: {exc}", file=sys.stderr)
        return 2
    print(issuing.render(token, entry, output=args.output))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "broker" and args.action is not None:
        from gpufed import stores

        if args.action == "backup":
            return stores.backup_command(args.store, args.out)
        return stores.quarantine_command(
            args.store, output=args.output, etcd_flags=daemons.etcd_flags(args)
        )
    if args.command == "broker":
        return daemons.run_broker(args)
    if args.command == "agent":
        return daemons.run_agent(args)
    if args.command == "token":
        return _token_command(args)
    if args.command == "demo":
        from gpufed.local import demo

        return demo.main(jobs=args.jobs, keep=args.keep)
    if args.command == "simulate":
        from gpufed.sim import simulating

        return simulating.run(args)
    try:
        if args.command == "status":  # no token needed
            return asyncio.run(_status_command(args))
        return asyncio.run(_user_command(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
