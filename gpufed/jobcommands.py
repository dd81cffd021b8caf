"""The job commands of `gpufed`: submit, get (and `get -w`, watching), cancel, why, list.

Each takes the parsed arguments and a `client.BrokerClient` and returns the exit code; what
the broker refuses is raised (`client.BrokerError`) for `problems` to say. Tables go to stdout
with `-o table` (and `-o wide` for list), the API's JSON with `-o json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from gpufed import batches, client, problems, tables

FINAL = frozenset({"Succeeded", "Failed", "Cancelled"})
WATCH_SECONDS = 1.0  # between two looks of `get -w`
WATCH_RETRIES = 30  # looks in a row the broker may miss (restarting, failing over)
UNAVAILABLE = frozenset({0, 502, 503, 504})  # not reached, or not serving for now
WIDE_NODES = 3  # nodes `list -o wide` names of a job, then +N


def print_answer(args: argparse.Namespace, data: Any, table: str) -> None:
    if args.output == "json":
        print(json.dumps(data, indent=2))
    else:
        print(table)


def _gpus(job: dict[str, Any]) -> int:
    return sum(len(p.get("gpus", [])) for p in job["status"].get("pods", []))


def _when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _times(job: dict[str, Any], *, now: datetime) -> tuple[float | None, float | None]:
    """Seconds the job waited (submitted → first running, or → now/its end if it never ran)
    and ran (first running → its end, or → now); None where it does not apply."""
    events = job["status"].get("events", [])
    created = _when(job["created"])
    started = next((_when(e["time"]) for e in events if e["state"] == "Running"), None)
    ended = None
    if job["status"]["state"] in FINAL and events:
        ended = _when(events[-1]["time"])
    waited = ((started or ended or now) - created).total_seconds()
    ran = None if started is None else ((ended or now) - started).total_seconds()
    return max(0.0, waited), None if ran is None else max(0.0, ran)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    whole = int(seconds)
    if whole < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def job_table(items: Sequence[dict[str, Any]], *, wide: bool = False) -> str:
    now = datetime.now(UTC)
    headers = ["ID", "QUEUE", "STATE", "CLUSTER", "GPUS", "CREATED"]
    if wide:
        headers = ["ID", "NAME", "TENANT", "QUEUE", "PRIORITY", "STATE", "CLUSTER", "GPUS",
                   "PODS", "NODES", "CREATED", "WAITED", "RAN"]  # fmt: skip
    rows = []
    for job in items:
        st, spec = job["status"], job["job"]["spec"]
        created = job["created"][:19].replace("T", " ")
        if not wide:
            row = [job["id"], spec["queue"], st["state"], st.get("cluster") or "",
                   _gpus(job) or "", created]  # fmt: skip
        else:
            waited, ran = _times(job, now=now)
            nodes = sorted({p["node"] for p in st.get("pods", []) if p.get("node")})
            if len(nodes) > WIDE_NODES:
                nodes = [*nodes[:WIDE_NODES], f"+{len(nodes) - WIDE_NODES}"]
            row = [
                job["id"], job["job"]["metadata"]["name"], job["tenant"], spec["queue"],
                spec.get("priority", ""), st["state"], st.get("cluster") or "",
                _gpus(job) or "", len(st.get("pods", [])) or "", ",".join(nodes) or "",
                created, _duration(waited), _duration(ran),
            ]  # fmt: skip
        rows.append(row)
    return tables.render(headers, rows)


def _event_row(event: dict[str, Any]) -> list[str]:
    return [event["time"][11:23], event["state"], event["reason"], event.get("message", "")]


def job_detail(job: dict[str, Any]) -> str:
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
        tables.render(["TIME", "STATE", "REASON", "MESSAGE"], [_event_row(e) for e in st["events"]])
    )
    return "\n".join(lines)


async def submit(args: argparse.Namespace, api: client.BrokerClient) -> int:
    path = args.filename or args.file
    if path is None:
        raise problems.CliError(
            "name a file, '-' (stdin) or a directory (-f PATH)", kind="usage", title="Usage", code=2
        )
    stdin_text = sys.stdin.read() if path == "-" else None
    try:
        documents = await asyncio.to_thread(batches.read_documents, path, stdin_text=stdin_text)
    except batches.DocumentError as exc:
        detail = f"{exc}; nothing submitted"
        raise problems.CliError(detail, kind="document", title="Not a job") from exc
    except OSError as exc:
        raise problems.file_error(exc) from exc
    if not documents:
        raise problems.CliError(f"no job in {path}", kind="document", title="No job")
    if len(documents) == 1:  # one job: the single route, the text as written
        only = documents[0]
        result = await api.submit(
            only.text, yaml=not only.is_json, idempotency_key=args.idempotency_key
        )
        print_answer(
            args, result, f"{result['id']} {result['state']} (trace {result.get('traceId')})"
        )
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


async def get(args: argparse.Namespace, api: client.BrokerClient) -> int:
    if args.watch:
        return await watch(args, api)
    job = await api.get(args.job_id)
    print_answer(args, job, job_detail(job))
    return 0


async def watch(args: argparse.Namespace, api: client.BrokerClient) -> int:
    """`gpufed get -w`: a line per event (each state change, with its reason) until the job
    is final; with `-o json`, the job as one JSON line each time. 0 once it Succeeded, 1 once
    it Failed or was Cancelled. A broker that does not answer for a while (a restart, a
    failover) is waited for, up to `WATCH_RETRIES` looks."""
    shown = 0  # events printed
    first = True
    missed = 0
    while True:
        try:
            job = await api.get(args.job_id)
        except client.BrokerError as exc:
            missed += 1
            if exc.status not in UNAVAILABLE or missed > WATCH_RETRIES:
                raise
            print(f"gpufed get: {exc.detail} (still watching)", file=sys.stderr)
            await asyncio.sleep(WATCH_SECONDS)
            continue
        missed = 0
        events = job["status"]["events"]
        shown = min(shown, len(events))  # fewer events than shown: never, but not a crash
        if args.output == "json":
            if first or len(events) > shown:
                print(json.dumps(job), flush=True)
        else:
            if first:
                spec = job["job"]
                print(f"{job['id']}  ({spec['metadata']['name']}, queue {spec['spec']['queue']})")
            for event in events[shown:]:
                print(_watch_line(event), flush=True)
        shown, first = len(events), False
        state = job["status"]["state"]
        if state in FINAL:
            return 0 if state == "Succeeded" else 1
        await asyncio.sleep(WATCH_SECONDS)


def _watch_line(event: dict[str, Any]) -> str:
    time_, state, reason, message = _event_row(event)
    where = f" on {event['cluster']}" if event.get("cluster") and state == "Running" else ""
    return f"{time_}  {state + where:<18}  {reason:<16}  {message}".rstrip()


async def cancel(args: argparse.Namespace, api: client.BrokerClient) -> int:
    if getattr(args, "array", False):
        found = await api.cancel_array(args.job_id, index=args.index)
        lines = [f"{j['id']} cancelling ({j['status']['state']})" for j in found["items"]]
        print_answer(args, found, "\n".join(lines))
        return 0
    if getattr(args, "index", None) is not None:
        raise problems.CliError(
            "--index goes with --array", kind="usage", title="Bad arguments", code=2
        )
    job = await api.cancel(args.job_id)
    print_answer(args, job, f"{job['id']} cancelling ({job['status']['state']})")
    return 0


def array_selector(args: argparse.Namespace) -> str | None:
    """`--selector` with `--array NAME` (and `--index I`) added as their labels."""
    from broker.api import arrays

    parts = [args.selector] if args.selector else []
    if getattr(args, "array", None):
        parts.append(f"{arrays.ARRAY_LABEL}={args.array}")
        if args.index is not None:
            parts.append(f"{arrays.INDEX_LABEL}={args.index}")
    elif getattr(args, "index", None) is not None:
        raise problems.CliError(
            "--index goes with --array", kind="usage", title="Bad arguments", code=2
        )
    return ",".join(parts) or None


async def why(args: argparse.Namespace, api: client.BrokerClient) -> int:
    answer = await api.why(args.job_id)
    rows = [[r["cluster"], r["code"], r["message"]] for r in answer.get("reasons", [])]
    if not rows:
        rows = [[c["cluster"], "", r] for c in answer["clusters"] for r in c["reasons"]]
    text = f"{answer['id']}: {answer['state']} (queue {answer.get('queue', '-')})"
    table = tables.render(["CLUSTER", "CODE", "REASON"], rows)
    text += "\n" + (table if rows else answer["message"])
    line = in_line(answer)
    if line:
        text += "\n" + line
    print_answer(args, answer, text)
    return 0


def in_line(answer: dict[str, Any]) -> str:
    """A queued job's position and ETA in words ("" for a job not queued)."""
    place = answer.get("position")
    words = []
    if place:
        models = ", ".join(place.get("models") or []) or "no GPU model"
        words.append(
            f"position: {place['inQueue']} in its queue, {place['competing']} among the "
            f"queued jobs wanting {models} ({place['gpusAhead']} GPUs ahead)"
        )
    if answer.get("eta"):
        words.append(f"eta: {answer['eta']}")
    elif answer.get("etaReason"):
        words.append(f"eta: unknown ({answer['etaReason']})")
    return "\n".join(words)


async def list_jobs(args: argparse.Namespace, api: client.BrokerClient) -> int:
    """`gpufed list`: live jobs, then finished ones (history), newest first (`--sort oldest`:
    the reverse), page by page; `--search` is matched by the broker (`q`)."""
    state = state_name(args.state) if args.state else None
    wanted = None if args.all else max(1, args.limit)
    items: list[dict[str, Any]] = []
    cont: str | None = None
    while wanted is None or len(items) < wanted:
        size = client.PAGE if wanted is None else min(client.PAGE, wanted - len(items))
        page, cont = await api.job_page(
            queue=args.queue,
            state=state,
            cluster=args.cluster,
            selector=array_selector(args),
            search=args.search,
            sort=args.sort,
            limit=size,
            cont=cont,
        )
        items += page
        if cont is None:
            break
    print_answer(args, items, job_table(items, wide=args.output == "wide"))
    if cont is not None:
        print(f"(more jobs than --limit {args.limit}: raise it, or --all)", file=sys.stderr)
    return 0


def state_name(text: str) -> str:
    """A job state as the API spells it, from any case (`running` → `Running`)."""
    from broker.api import status

    for state in status.JobState:
        if state.value.lower() == text.lower():
            return state.value
    return text  # the broker names the states it takes
