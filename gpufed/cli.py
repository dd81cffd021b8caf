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

from gpufed import client, logs, tables

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

    broker = sub.add_parser("broker", help="run the broker")
    broker.add_argument(
        "--store", default="sqlite:///.gpufed/broker.db", help="sqlite:///PATH or etcd://HOST:PORT"
    )
    broker.add_argument("--tokens", default="config/tokens.yaml", help="tokens file")
    broker.add_argument("--host", default="127.0.0.1")
    broker.add_argument("--port", type=int, default=8080)
    broker.add_argument("--heartbeat", type=float, default=5.0, help="agent heartbeat, seconds")
    broker.add_argument(
        "--lost-after",
        type=float,
        default=60.0,
        help="seconds a cluster may stay away before its jobs move",
    )
    broker.add_argument(
        "--offer-timeout",
        type=float,
        default=30.0,
        help="seconds an agent may take to answer an offer before it is withdrawn",
    )
    broker.add_argument(
        "--queues", help="queues, quotas and priority classes YAML (none: every queue is open)"
    )
    broker.add_argument(
        "--queue-mode",
        choices=["open", "declared"],
        help="open: a job may name any queue (undeclared ones are open queues); declared: "
        "only a declared queue of its tenant (default: declared with --queues, else open)",
    )
    broker.add_argument(
        "--idempotency-window",
        type=float,
        default=24 * 3600.0,
        help="seconds an Idempotency-Key replays its job; after it the key makes a new job",
    )
    broker.add_argument(
        "--cycle-interval",
        type=float,
        default=0.005,
        help="seconds between scheduling cycles, at least",
    )
    broker.add_argument(
        "--max-request-bytes",
        type=int,
        default=1536 * 1024,
        help="the store's request limit (etcd's --max-request-bytes, default 1.5 MiB): "
        "commits are split to stay under it; a job that could never fit is refused (413)",
    )
    broker.add_argument(
        "--advertise-url",
        help="the URL other replicas send agents to, and `gpufed status` shows "
        "(default http://HOST:PORT)",
    )
    broker.add_argument(
        "--leader-lease-seconds",
        type=int,
        default=5,
        help="several replicas on etcd: the leader's lease; a leader killed with -9 is "
        "replaced within it (SIGTERM hands over at once)",
    )
    broker.add_argument("--log-level", default="INFO")
    _add_store_commands(broker)

    agent = sub.add_parser("agent", help="run a member agent")
    agent.add_argument(
        "--broker",
        required=True,
        help="broker URL, or the replicas' URLs comma-separated (URL1,URL2,URL3): the agent "
        "tries the next on a connection failure and follows the leader a follower names",
    )
    agent.add_argument("--cluster", required=True)
    agent.add_argument("--token-file", required=True)
    agent.add_argument("--backend", choices=["simulated", "kubernetes"], default="simulated")
    agent.add_argument("--nodes", help="node pools YAML (simulated backend)")
    agent.add_argument("--limits", help="per-namespace GPU limits YAML")
    agent.add_argument("--kubeconfig", help="kubernetes backend: kubeconfig (default: in-cluster)")
    agent.add_argument("--context", help="kubernetes backend: kubeconfig context")
    agent.add_argument(
        "--namespace",
        action="append",
        dest="namespaces",
        help="kubernetes backend: a namespace pods may be created in (repeat)",
    )
    agent.add_argument(
        "--fence-after",
        type=float,
        help="seconds without word from the broker after which the agent fences itself: no "
        "new pods, and the pods of jobs whose failurePolicy.clusterLost is requeue deleted "
        "(default: as late as the grace the broker says allows, a quarter of it or 2 "
        "heartbeats + 1 s before its --lost-after, 45 s of the default 60 s; 30 s with a "
        "broker that does not say it); a value makes it sooner, never later",
    )
    agent.add_argument(
        "--sim-journal",
        help="simulated backend: append a JSON line to this file each time a pod starts or "
        "stops running",
    )
    agent.add_argument("--metrics-port", type=int, default=0)
    agent.add_argument("--log-level", default="INFO")

    submit = _user_parser(sub, "submit", "submit a GPUJob from a YAML or JSON file ('-' = stdin)")
    submit.add_argument("file")
    submit.add_argument("--idempotency-key")
    for name, text in [
        ("get", "show one job"),
        ("cancel", "cancel a job"),
        ("why", "why a job is not running"),
    ]:
        _user_parser(sub, name, text).add_argument("job_id")
    listing = _user_parser(sub, "list", "list jobs")
    listing.add_argument("--queue")
    listing.add_argument("--state")
    _user_parser(sub, "clusters", "member clusters and their GPUs")
    _user_parser(
        sub, "status", "the broker replicas (--broker URL1,URL2,...): role, leader, term, synced"
    )
    queues = _user_parser(sub, "queues", "queues: quotas, usage, fair share (admin token)")
    queues.add_argument("name", nargs="?", help="one queue; `delete NAME`: delete queue NAME")
    queues.add_argument("target", nargs="?", help=argparse.SUPPRESS)
    queues.add_argument(
        "--apply", metavar="FILE", help="put queue NAME from FILE, or each queue of a queues file"
    )

    demo = sub.add_parser("demo", help="broker + 3 simulated clusters + a mixed workload")
    demo.add_argument("--jobs", type=int, default=72)
    demo.add_argument("--keep", action="store_true", help="keep the work directory")

    from gpufed.sim import simulating

    simulating.add_parser(sub)
    return parser


def _add_store_commands(broker: argparse.ArgumentParser) -> None:
    """`gpufed broker backup|quarantine`: admin commands on the store (gpufed/stores.py)."""
    actions = broker.add_subparsers(dest="action", metavar="{backup,quarantine}")
    store_help = "the broker's --store: sqlite:///PATH or etcd://HOST:PORT"
    backup = actions.add_parser(
        "backup", help="copy the SQLite store consistently, also while the broker runs"
    )
    backup.add_argument("--store", default=argparse.SUPPRESS, help=store_help)
    backup.add_argument("out", help="where the copy goes (replaced whole, or not at all)")
    quarantine = actions.add_parser(
        "quarantine", help="list the stored records set aside because they do not parse"
    )
    quarantine.add_argument("--store", default=argparse.SUPPRESS, help=store_help)
    quarantine.add_argument("-o", "--output", choices=["table", "json"], default="table")


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


async def _dispatch_user(args: argparse.Namespace, api: client.BrokerClient) -> int:
    if args.command == "submit":
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        is_json = text.lstrip().startswith("{")
        result = await api.submit(text, yaml=not is_json, idempotency_key=args.idempotency_key)
        _print(args, result, f"{result['id']} {result['state']} (trace {result.get('traceId')})")
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
        items = await api.jobs(queue=args.queue, state=args.state)
        _print(args, items, _job_table(items))
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


def _run_broker(args: argparse.Namespace) -> int:
    import pydantic
    from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

    from broker import app
    from broker.telemetry import tracing

    logs.setup(service="gpufed-broker", level=args.log_level)
    try:
        settings = _broker_settings(args)
    except pydantic.ValidationError as exc:  # e.g. a --lost-after too short to fence in
        print(f"gpufed broker: {_settings_problem(exc)}", file=sys.stderr)
        return 2
    tracing.setup("gpufed-broker")
    # before any Application is created: the instrumentor patches the class
    AioHttpServerInstrumentor().instrument()
    from aiohttp import web

    from broker.state import registry

    try:
        application = app.create_app(settings)
    except registry.QueuesFileError as exc:
        print(f"gpufed broker: {exc}", file=sys.stderr)
        return 2
    from broker.state import errors

    try:
        web.run_app(
            application,
            host=args.host,
            port=args.port,
            print=None,
            access_log=None,
            handle_signals=True,
        )
    except errors.StoreError as exc:  # the store cannot be used: say why in one line
        print(f"gpufed broker: {exc}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()
    return 0


def _broker_settings(args: argparse.Namespace) -> Any:
    from broker import app

    return app.BrokerSettings(
        store=args.store,
        tokens_file=Path(args.tokens),
        host=args.host,
        port=args.port,
        heartbeat_seconds=args.heartbeat,
        lost_after_seconds=args.lost_after,
        offer_timeout_seconds=args.offer_timeout,
        freeze_gc=True,
        queues_file=Path(args.queues) if args.queues else None,
        queue_mode=args.queue_mode,
        idempotency_window_seconds=args.idempotency_window,
        cycle_interval_seconds=args.cycle_interval,
        max_request_bytes=args.max_request_bytes,
        advertise_url=args.advertise_url,
        leader_lease_seconds=args.leader_lease_seconds,
    )


def _settings_problem(exc: Exception) -> str:
    """The first complaint of a settings model, in one line."""
    import pydantic

    if not isinstance(exc, pydantic.ValidationError) or not exc.errors():
        return str(exc)
    first = exc.errors()[0]
    text = str(first["msg"]).removeprefix("Value error, ")
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {text}" if where else text


def _run_agent(args: argparse.Namespace) -> int:
    import pydantic

    from broker.telemetry import tracing
    from member_agent import app as agent_app
    from member_agent.session import brokers

    logs.setup(service="gpufed-agent", level=args.log_level)
    try:
        settings = _agent_settings(args)
    except pydantic.ValidationError as exc:
        print(f"gpufed agent: {_settings_problem(exc)}", file=sys.stderr)
        return 2
    tracing.setup("gpufed-agent", cluster=args.cluster)
    try:
        asyncio.run(agent_app.run_agent(settings))
    except brokers.AuthError as exc:  # before any session: a wrong token or token file
        print(f"gpufed agent: the broker refused cluster {args.cluster}: {exc}", file=sys.stderr)
        return 3
    finally:
        tracing.shutdown()
    return 0


def _agent_settings(args: argparse.Namespace) -> Any:
    from member_agent import app as agent_app

    return agent_app.AgentSettings.model_validate(
        {
            "broker_url": args.broker,
            "cluster": args.cluster,
            "token_file": args.token_file,
            "backend": args.backend,
            "nodes_file": args.nodes,
            "limits_file": args.limits,
            "metrics_port": args.metrics_port,
            "kubeconfig": args.kubeconfig,
            "kube_context": args.context,
            "namespaces": args.namespaces,
            "freeze_gc": True,
            "fence_after_seconds": args.fence_after,
            "journal_file": args.sim_journal,
        }
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "broker" and args.action is not None:
        from gpufed import stores

        if args.action == "backup":
            return stores.backup_command(args.store, args.out)
        return stores.quarantine_command(args.store, output=args.output)
    if args.command == "broker":
        return _run_broker(args)
    if args.command == "agent":
        return _run_agent(args)
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
