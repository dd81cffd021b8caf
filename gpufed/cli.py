"""`gpufed`: run the broker or an agent, submit and watch jobs, run the demo or the simulator."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from gpufed import client, completions, daemons, fleetcommands, jobcommands, problems, tlsflags

DEFAULT_BROKER = "http://127.0.0.1:8080"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that shows each flag's default, unless there is none (None, off) or the help
    already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default in (None, False, argparse.SUPPRESS)
            or default == []
            or "default" in text
            or "%(default)" in text
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """gpufed's parser: every sub-command's too (argparse makes them of the same class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def version() -> str:
    try:
        return metadata.version("gpufed")
    except metadata.PackageNotFoundError:  # a checkout that was never installed
        return "unknown"


def _token(args: argparse.Namespace) -> str:
    """--token, --token-file, then env GPUFED_TOKEN, GPUFED_TOKEN_FILE: a flag wins."""
    if args.token:
        return str(args.token)
    if not args.token_file and os.environ.get("GPUFED_TOKEN"):
        return os.environ["GPUFED_TOKEN"]
    path = args.token_file or os.environ.get("GPUFED_TOKEN_FILE")
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise problems.file_error(exc, what="token file") from exc
    raise problems.CliError(
        "no token: pass --token, --token-file, or set GPUFED_TOKEN (a dev token: "
        "config/tokens.yaml; a real one: gpufed token create)",
        kind="no-token",
        title="No token",
    )


def _user_parser(
    sub: Any, name: str, help_text: str, *, outputs: Sequence[str] = ("table", "json")
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
    parser.add_argument(
        "--broker",
        default=os.environ.get("GPUFED_BROKER", DEFAULT_BROKER),
        help="broker URL, or every replica's comma-separated (env GPUFED_BROKER)",
    )
    parser.add_argument("--token", help="bearer token (env GPUFED_TOKEN)")
    parser.add_argument("--token-file", help="file holding the token (env GPUFED_TOKEN_FILE)")
    tlsflags.add_ca_flag(parser)
    parser.add_argument(
        "-o",
        "--output",
        choices=list(outputs),
        default="table",
        help="table for people; json for scripts: the API's JSON on stdout, and an error as "
        "a problem document (RFC 9457) on stderr",
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="gpufed", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gpufed {version()}")
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
    get = _user_parser(sub, "get", "show one job: status, pods with nodes and GPUs, events")
    get.add_argument("job_id", help="the job's id (gpufed list)")
    get.add_argument(
        "-w",
        "--watch",
        action="store_true",
        help="print each event (state change) until the job ends; exit 0 if it Succeeded, "
        "1 if it Failed or was Cancelled",
    )
    cancelling = _user_parser(sub, "cancel", "cancel a job, or an array's jobs (--array)")
    cancelling.add_argument("job_id", help="the job's id (gpufed list); with --array, the array")
    cancelling.add_argument(
        "--array",
        action="store_true",
        help="JOB_ID names an array (spec.array): its id, or its name (the newest array of "
        "that name); every job of it not finished is cancelled",
    )
    cancelling.add_argument(
        "--index", type=int, help="with --array: only the job of this index", default=None
    )
    _user_parser(sub, "why", "why a job is not running").add_argument(
        "job_id", help="the job's id (gpufed list)"
    )
    listing = _user_parser(
        sub,
        "list",
        "list jobs, live and finished (history), newest first",
        outputs=("table", "wide", "json"),
    )
    listing.add_argument("--queue", help="only this queue's jobs")
    listing.add_argument("--state", help="only jobs in this state (any case: running, Queued)")
    listing.add_argument("--cluster", help="only jobs placed on this cluster")
    listing.add_argument(
        "-l", "--selector", help="label selector on metadata.labels (team=vision,tier!=spot)"
    )
    listing.add_argument(
        "--array", help="only the jobs of the arrays of this name (label gpufed.io/array)"
    )
    listing.add_argument(
        "--index", type=int, help="with --array: only the job of this index", default=None
    )
    listing.add_argument(
        "-q", "--search", metavar="TEXT", help="only jobs whose name or id holds TEXT (any case)"
    )
    listing.add_argument(
        "--sort",
        choices=("newest", "oldest"),
        default="newest",
        help="newest first (live jobs, then the latest finished) or the reverse",
    )
    listing.add_argument("--limit", type=int, default=500, help="at most this many jobs")
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
    queues.add_argument(
        "--allotments",
        action="store_true",
        help="what each tenant may claim with its queues (its tenant-admin's bound), and what "
        "its queues claim of it now",
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
    create.add_argument(
        "-o",
        "--output",
        choices=["text", "json"],
        default="text",
        help="text: the token, then the entry as YAML; json: both in one document",
    )

    demo = sub.add_parser("demo", help="broker + 3 simulated clusters + a mixed workload")
    demo.add_argument("--jobs", type=int, default=72, help="jobs of the mixed workload")
    demo.add_argument("--keep", action="store_true", help="keep the work directory")

    completion = sub.add_parser(
        "completion",
        help="print a shell completion script",
        description="print a completion script for bash or zsh: `source <(gpufed completion "
        "bash)` in ~/.bashrc, `source <(gpufed completion zsh)` in ~/.zshrc",
    )
    completion.add_argument("shell", choices=completions.SHELLS, help="the shell")

    from gpufed.sim import simulating

    simulating.add_parser(sub)
    return parser


async def _user_command(args: argparse.Namespace) -> int:
    """A command that talks to the broker: its exit code, what went wrong said (`problems`)."""
    if args.command == "status":  # no token needed
        return await fleetcommands.status(args)
    command = {
        "submit": jobcommands.submit,
        "get": jobcommands.get,
        "cancel": jobcommands.cancel,
        "why": jobcommands.why,
        "list": jobcommands.list_jobs,
        "clusters": fleetcommands.clusters,
        "queues": fleetcommands.queues,
    }[args.command]
    output = "json" if args.output == "json" else "table"
    try:
        ca_file = tlsflags.ca_file(args)
        async with client.BrokerClient(args.broker, _token(args), ca_file=ca_file) as api:
            return await command(args, api)
    except (client.BrokerError, problems.CliError) as exc:
        return problems.report(args.command, exc, output=output)


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
    parser = build_parser()
    args = parser.parse_args(argv)
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
        return problems.run("token", lambda: _token_command(args))
    if args.command == "completion":
        return problems.run("completion", lambda: _print(completions.script(parser, args.shell)))
    if args.command == "demo":
        from gpufed.local import demo

        return demo.main(jobs=args.jobs, keep=args.keep)
    if args.command == "simulate":
        from gpufed.sim import simulating

        return simulating.run(args)
    output = "json" if args.output == "json" else "table"
    return problems.run(args.command, lambda: asyncio.run(_user_command(args)), output=output)


def _print(text: str) -> int:
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
