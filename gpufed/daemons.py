"""`gpufed broker` and `gpufed agent`: the long-running programs — their flags, the settings
their flags make, and running them (logging, tracing, the exit codes: 2 for bad settings, 3 for
an agent whose token the broker refused). `cli` adds their parsers and calls `run_*`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from gpufed import accessflags, logs, tlsflags


def add_broker_parser(sub: Any) -> None:
    broker = sub.add_parser("broker", help="run the broker")
    broker.add_argument(
        "--store", default="sqlite:///.gpufed/broker.db", help="sqlite:///PATH or etcd://HOST:PORT"
    )
    broker.add_argument(
        "--tokens",
        default="config/tokens.yaml",
        help="tokens file, read again when it changes and on SIGHUP (gpufed token create)",
    )
    broker.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without a token (default: an admin, metrics or fleet viewer token)",
    )
    broker.add_argument("--host", default="127.0.0.1", help="address to listen on")
    broker.add_argument("--port", type=int, default=8080, help="port to listen on")
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
        "--start-timeout",
        type=float,
        default=600.0,
        help="seconds a dispatched job may take to be Running before it is withdrawn from its "
        "cluster and queued again (StartTimeout); a cluster that keeps failing to start jobs "
        "is scored down for a while",
    )
    broker.add_argument(
        "--max-offers-in-flight",
        type=int,
        default=1000,
        help="offers out unanswered to one agent at most (its window: halved when its "
        "offers time out, grown back as it answers); more jobs for its cluster wait "
        "(ClusterBusy) or go elsewhere (0: no limit)",
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
        "--plan-limit",
        type=int,
        default=500,  # broker.planning.backlog.budget.DEFAULT_LIMIT
        help="pending jobs one scheduling cycle plans, at most (heads of every queue first; "
        "a deeper backlog is planned in slices over the next cycles)",
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
    broker.add_argument(
        "--history",
        metavar="URL",
        help="where finished jobs go: sqlite:///path or postgresql://user@host/db (shared by "
        "replicas); default: history.db beside an SQLite store, none for etcd; 'none': keep "
        "finished jobs in the store",
    )
    broker.add_argument(
        "--retain-finished",
        type=duration,
        default="1h",
        metavar="DURATION",
        help="a finished job stays in the store this long, then moves to history (90s, 30m, "
        "1h, 7d; default 1h)",
    )
    broker.add_argument(
        "--history-ttl",
        type=duration,
        default="7d",
        metavar="DURATION",
        help="history keeps a finished job this long (default 7d)",
    )
    broker.add_argument(
        "--trace-url-template",
        metavar="URL",
        help="the console links a job to its trace with this URL, {trace_id} replaced "
        "(a Grafana Explore URL whose TraceQL query is {trace_id}, as the broker chart's "
        "traceUrlTemplate; default: no link)",
    )
    add_etcd_flags(broker)
    tlsflags.add_broker_flags(broker)
    accessflags.add_broker_flags(broker)
    broker.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    _add_store_commands(broker)


def add_agent_parser(sub: Any) -> None:
    agent = sub.add_parser("agent", help="run a member agent")
    agent.add_argument(
        "--broker",
        required=True,
        help="broker URL, or the replicas' URLs comma-separated (URL1,URL2,URL3): the agent "
        "tries the next on a connection failure and follows the leader a follower names",
    )
    agent.add_argument(
        "--cluster", required=True, help="the member cluster's name (its token's agent:NAME)"
    )
    agent.add_argument(
        "--token-file", help="the cluster's token (required unless --cert: mTLS, docs/security.md)"
    )
    tlsflags.add_agent_flags(agent)
    agent.add_argument(
        "--cluster-label",
        action="append",
        dest="cluster_labels",
        type=labels_of,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="a label of the cluster, reported to the broker: what a job's spec.clusters "
        "selects on, e.g. region=eu-west,tier=spot (repeat, or comma-separate)",
    )
    agent.add_argument(
        "--backend",
        choices=["simulated", "kubernetes"],
        default="simulated",
        help="simulated: nodes from --nodes, pods that only pretend; kubernetes: a real cluster",
    )
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
        "--devices",
        choices=["device-plugin", "dra"],
        default="device-plugin",
        help="kubernetes backend: how pods get their GPUs: device-plugin (nvidia.com/gpu; the "
        "kubelet picks which) or dra (a ResourceClaim per pod allocated to exactly the GPUs "
        "gpufed chose; Kubernetes 1.33+ and a DRA driver); see docs/kubernetes.md",
    )
    agent.add_argument(
        "--dra-driver",
        default="gpu.nvidia.com",
        metavar="NAME",
        help="dra: the driver whose ResourceSlices publish the GPUs (default gpu.nvidia.com)",
    )
    agent.add_argument(
        "--dra-device-class",
        metavar="NAME",
        help="dra: the DeviceClass gpufed's claims ask for (default: the driver's name)",
    )
    agent.add_argument(
        "--dra-attribute",
        action="append",
        dest="dra_attributes",
        type=key_value,
        metavar="WHAT=NAME",
        help="dra: the slice attribute that says WHAT (index, uuid, product, memory: a "
        "capacity, clique, type), e.g. product=productName (repeat)",
    )
    agent.add_argument(
        "--shared-gpu-resource",
        metavar="NAME",
        help="device-plugin: the resource of the device plugin's shared GPU replicas (default "
        "nvidia.com/gpu.shared); a job asking gpu-milli goes only to nodes advertising it",
    )
    agent.add_argument(
        "--auto-cordon",
        action="store_true",
        help="cordon a node (spec.unschedulable) once --cordon-after of its GPUs have failed; "
        "without it, failed GPUs only leave the inventory",
    )
    agent.add_argument(
        "--cordon-after",
        type=int,
        default=2,
        metavar="N",
        help="GPU failures on one node within --cordon-window before --auto-cordon cordons it "
        "(GPUs already unhealthy when the agent starts are not counted)",
    )
    agent.add_argument(
        "--finished-pods-ttl",
        type=duration_or_never,
        default=600.0,
        metavar="SECONDS",
        help="how long the pods of a finished job stay in the cluster (for their logs) after "
        "the broker has its final report, then the agent deletes them (600: 10m; 0: at "
        "once; never: left to the cluster's own terminated-pod collection)",
    )
    agent.add_argument(
        "--cordon-window",
        type=duration,
        default=3600.0,
        metavar="SECONDS",
        help="only GPU failures this recent count toward --cordon-after (3600: 1h; 30m, 2h)",
    )
    agent.add_argument(
        "--gpu-health-taint",
        action="append",
        dest="gpu_health_taints",
        metavar="KEY",
        help="kubernetes: a node or DRA device taint key that marks GPUs unhealthy (repeat; "
        "replaces the defaults gpufed.io/gpu-unhealthy, nvidia.com/gpu-xid, "
        "gpu.nvidia.com/xid, gpu.nvidia.com/gpu-lost); its value names GPUs as gpu-<i>, or "
        "none: all of the node's",
    )
    agent.add_argument(
        "--gpu-health-label",
        action="append",
        dest="gpu_health_labels",
        metavar="KEY",
        help="kubernetes: a node label key that marks GPUs unhealthy (repeat; replaces the "
        "default gpufed.io/gpu-unhealthy)",
    )
    agent.add_argument(
        "--gpu-health-condition",
        action="append",
        dest="gpu_health_conditions",
        metavar="TYPE",
        help="kubernetes: a node condition type that, True, marks GPUs unhealthy (repeat; "
        "replaces the default GPUUnhealthy); its message names GPUs as gpu-<i>, or none: all",
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
    agent.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="the longest a connect to a broker and its WebSocket upgrade may take before the "
        "next broker URL is tried (never more than two heartbeats; default 10)",
    )
    agent.add_argument(
        "--proxy",
        metavar="URL",
        help="an HTTP proxy (http://host:port) for the connections to the broker; HTTP_PROXY "
        "is not read",
    )
    agent.add_argument(
        "--metrics-port", type=int, default=0, help="serve /metrics on this port (0: not at all)"
    )
    agent.add_argument(
        "--dcgm-url",
        action="append",
        dest="dcgm_urls",
        metavar="URL",
        help="dcgm-exporter's Prometheus page (http://HOST:9400/metrics; repeat for each "
        "exporter, or one Prometheus /federate URL for all): each queue's GPUs allocated and "
        "utilised on /metrics (needs --metrics-port); see docs/kubernetes.md",
    )
    agent.add_argument(
        "--dcgm-interval",
        type=duration,
        default=15.0,
        metavar="SECONDS",
        help="how often the --dcgm-url pages are read",
    )
    agent.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(text: str) -> float:
    """Seconds from `90`, `90s`, `30m`, `1h` or `7d` (argparse's type for durations)."""
    value = text.strip().lower()
    scale = DURATION_UNITS.get(value[-1:]) if value else None
    number = value[:-1] if scale is not None else value
    try:
        seconds = float(number) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: a number of seconds, or with s, m, h or d (30m, 7d)"
        ) from None
    if not 0 <= seconds < float("inf"):  # NaN fails both
        raise argparse.ArgumentTypeError(f"{text!r}: a duration of 0 or more")
    return seconds


def duration_or_never(text: str) -> float | None:
    """A `duration`, or None for `never`."""
    return None if text.strip().lower() == "never" else duration(text)


def key_value(text: str) -> tuple[str, str]:
    """`what=name` (argparse's type for --dra-attribute)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: WHAT=NAME, e.g. product=productName")
    return key.strip(), value.strip()


def labels_of(text: str) -> dict[str, str]:
    """`region=eu-west,tier=spot` (argparse's type for --cluster-label); the keys and
    values are checked with the agent's settings."""
    out: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"{part!r}: KEY=VALUE, e.g. region=eu-west")
        out[key.strip()] = value.strip()
    return out


ETCD_PASSWORD_ENV = "GPUFED_ETCD_PASSWORD"


def add_etcd_flags(parser: argparse.ArgumentParser, *, default: Any = None) -> None:
    """TLS and authentication to an etcd store (broker.state.etcd_credentials), for every
    endpoint of --store etcd://A,B,C."""
    parser.add_argument(
        "--etcd-ca",
        metavar="FILE",
        default=default,
        help="etcd over TLS: the CA certificate (PEM) that signed etcd's (default with "
        "--etcd-cert: the system's CAs)",
    )
    parser.add_argument(
        "--etcd-cert",
        metavar="FILE",
        default=default,
        help="etcd over TLS: the broker's client certificate (PEM), for an etcd with "
        "--client-cert-auth; needs --etcd-key",
    )
    parser.add_argument(
        "--etcd-key", metavar="FILE", default=default, help="the private key (PEM) of --etcd-cert"
    )
    parser.add_argument(
        "--etcd-user",
        metavar="NAME",
        default=default,
        help="etcd authentication: the etcd user the broker is; needs --etcd-password-file "
        f"(or the password in env {ETCD_PASSWORD_ENV})",
    )
    parser.add_argument(
        "--etcd-password-file",
        metavar="FILE",
        default=default,
        help="file holding --etcd-user's password (a trailing newline is dropped)",
    )


def etcd_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The --etcd-* flags (and GPUFED_ETCD_PASSWORD) as etcd_credentials.load_credentials's
    keyword arguments."""

    def path(value: str | None) -> Path | None:
        return Path(value) if value is not None else None

    return {
        "ca_file": path(args.etcd_ca),
        "cert_file": path(args.etcd_cert),
        "key_file": path(args.etcd_key),
        "user": args.etcd_user,
        "password_file": path(args.etcd_password_file),
        "password": os.environ.get(ETCD_PASSWORD_ENV) or None,
    }


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
    add_etcd_flags(quarantine, default=argparse.SUPPRESS)
    quarantine.add_argument(
        "-o", "--output", choices=["table", "json"], default="table", help="table, or JSON"
    )


def run_broker(args: argparse.Namespace) -> int:
    from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

    from broker import app
    from broker.telemetry import tracing

    logs.setup(service="gpufed-broker", level=args.log_level)
    try:
        settings = broker_settings(args)
        listen = accessflags.listen_settings(args)
    except ValueError as exc:  # e.g. a --lost-after too short to fence in (pydantic's too)
        print(f"gpufed broker: {settings_problem(exc)}", file=sys.stderr)
        return 2
    tracing.setup("gpufed-broker")
    if tracing.records_spans():
        # before any Application is created: the instrumentor patches the class. Not when no
        # span is recorded: its middleware then costs each request a share of the broker's CPU
        # and tells nothing
        AioHttpServerInstrumentor().instrument()
    from broker.http import listening, oidc, tls, tokens
    from broker.state import registry

    try:
        application = app.create_app(settings)
    except (
        registry.QueuesFileError,
        tokens.TokensFileError,
        tls.TlsFilesError,
        oidc.OidcError,
    ) as exc:
        print(f"gpufed broker: {exc}", file=sys.stderr)
        return 2
    server_tls = application.get(tls.SERVER_TLS)  # --tls-cert: HTTPS, reloaded on change
    from broker.state import errors

    try:
        listening.run(  # connections per client capped, the header timeout (--header-timeout)
            application,
            host=args.host,
            port=args.port,
            settings=listen,
            ssl_context=server_tls.context if server_tls is not None else None,
        )
    except errors.StoreError as exc:  # the store cannot be used: say why in one line
        print(f"gpufed broker: {exc}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()
    return 0


def broker_settings(args: argparse.Namespace) -> Any:
    from broker import app

    return app.BrokerSettings(
        store=args.store,
        tokens_file=Path(args.tokens),
        reload_tokens_on_sighup=True,
        metrics_public=args.metrics_public,
        host=args.host,
        port=args.port,
        heartbeat_seconds=args.heartbeat,
        lost_after_seconds=args.lost_after,
        offer_timeout_seconds=args.offer_timeout,
        start_timeout_seconds=args.start_timeout,
        max_offers_in_flight=args.max_offers_in_flight,
        freeze_gc=True,
        queues_file=Path(args.queues) if args.queues else None,
        queue_mode=args.queue_mode,
        idempotency_window_seconds=args.idempotency_window,
        cycle_interval_seconds=args.cycle_interval,
        plan_limit=args.plan_limit,
        max_request_bytes=args.max_request_bytes,
        advertise_url=args.advertise_url,
        leader_lease_seconds=args.leader_lease_seconds,
        history=args.history,
        retain_finished_seconds=args.retain_finished,
        history_ttl_seconds=args.history_ttl,
        trace_url_template=args.trace_url_template,
        **tlsflags.broker_settings(args),
        **accessflags.broker_settings(args),
        # etcd_ca_file, etcd_cert_file, etcd_key_file, etcd_user, etcd_password(_file)
        **{f"etcd_{name}": value for name, value in etcd_flags(args).items()},
    )


def settings_problem(exc: Exception) -> str:
    """The first complaint of a settings model, in one line."""
    import pydantic

    if not isinstance(exc, pydantic.ValidationError) or not exc.errors():
        return str(exc)
    first = exc.errors()[0]
    text = str(first["msg"]).removeprefix("Value error, ")
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {text}" if where else text


def run_agent(args: argparse.Namespace) -> int:
    from broker.telemetry import tracing
    from member_agent import app as agent_app
    from member_agent.session import brokers

    logs.setup(service="gpufed-agent", level=args.log_level)
    try:
        settings = agent_settings(args)
    except ValueError as exc:  # pydantic's, and neither a token nor a certificate
        print(f"gpufed agent: {settings_problem(exc)}", file=sys.stderr)
        return 2
    tracing.setup("gpufed-agent", cluster=args.cluster)
    try:
        asyncio.run(agent_app.run_agent(settings))
    except brokers.TokenFileError as exc:  # before any session: no token to send
        print(f"gpufed agent: {exc}", file=sys.stderr)
        return 3
    except brokers.AuthError as exc:  # before any session: a wrong token, another cluster's
        print(f"gpufed agent: the broker refused cluster {args.cluster}: {exc}", file=sys.stderr)
        return 3
    finally:
        tracing.shutdown()
    return 0


def agent_settings(args: argparse.Namespace) -> Any:
    from member_agent import app as agent_app

    return agent_app.AgentSettings.model_validate(
        {
            "broker_url": args.broker,
            "cluster": args.cluster,
            "cluster_labels": {k: v for item in args.cluster_labels or [] for k, v in item.items()},
            "token_file": args.token_file,
            "backend": args.backend,
            "nodes_file": args.nodes,
            "limits_file": args.limits,
            "metrics_port": args.metrics_port,
            "kubeconfig": args.kubeconfig,
            "kube_context": args.context,
            "namespaces": args.namespaces,
            "devices": args.devices,
            "dra_driver": args.dra_driver,
            "dra_device_class": args.dra_device_class,
            "dra_attributes": dict(args.dra_attributes or []),
            "shared_gpu_resource": args.shared_gpu_resource,
            "auto_cordon": args.auto_cordon,
            "cordon_after": args.cordon_after,
            "cordon_window_seconds": args.cordon_window,
            "gpu_health_taints": args.gpu_health_taints,
            "gpu_health_labels": args.gpu_health_labels,
            "gpu_health_conditions": args.gpu_health_conditions,
            "freeze_gc": True,
            "fence_after_seconds": args.fence_after,
            "connect_timeout_seconds": args.connect_timeout,
            "finished_pods_ttl_seconds": args.finished_pods_ttl,
            "journal_file": args.sim_journal,
            "proxy_url": args.proxy,
            "dcgm_urls": args.dcgm_urls or [],
            "dcgm_interval_seconds": args.dcgm_interval,
            **tlsflags.agent_settings(args),
        }
    )
