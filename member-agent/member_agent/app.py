"""The member agent process: settings and wiring only.

`run_agent(settings)` reads the limits file (`load_limits`, into `placement.limits`), builds the
cluster backend (simulated from a nodes file, or Kubernetes), the job handler
(`jobs.handling`), the summary reporter and the broker session (`session`), feeds the
backend's events to the handler, and runs until `stop` is set or SIGTERM arrives, then closes
everything. Before the first hello the handler adopts the jobs whose pods the backend found (an
agent restarted while its pods ran), so the broker neither loses nor runs them twice.

`broker_url` names one broker or several replicas, comma-separated (`session.brokers`:
failover and following the leader); `fence_after_seconds` is the longest the agent runs its
jobs without word from the broker (`session.leasing`, the rule in `broker.api.leases`).
With `dcgm_urls` (`--dcgm-url`) the agent reads dcgm-exporter every `dcgm_interval_seconds`
(`utilisation.scraping`) and serves each queue's GPUs allocated and utilised on its /metrics
(`utilisation.exporting`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from broker.api import affinity, inventory
from kits import garbage
from member_agent import telemetry
from member_agent.cluster import base, gpuhealth
from member_agent.cluster.kubernetes import health
from member_agent.cluster.simulated import backend as simulated
from member_agent.cluster.simulated import pods as simulated_pods
from member_agent.jobs import handling
from member_agent.placement import limits
from member_agent.session import brokers, connecting, reporting, tls
from member_agent.utilisation import scraping

logger = logging.getLogger(__name__)

# the ResourceSlice attributes (and the memory capacity) whose names DRA mode can be told
DRA_ATTRIBUTES = (
    *("index", "uuid", "product", "memory", "clique", "type"),
    *("profile", "parent_index", "parent_uuid"),  # MIG devices
)


class BackoffSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    initial_seconds: Annotated[float, Field(gt=0)] = 0.1
    max_seconds: Annotated[float, Field(gt=0)] = 5.0
    auth_retry_seconds: Annotated[float, Field(gt=0)] = 30.0


class AgentSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    broker_url: Annotated[
        str,
        Field(
            description="a broker URL, or several comma-separated (the replicas of one broker): "
            "the agent tries the next on a connection failure and follows the leader a "
            "follower names"
        ),
    ]
    cluster: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")]
    cluster_labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=inventory.MAX_LABELS,
        description="the cluster's labels, reported in its summaries: what a job's "
        "spec.clusters selects on (region=eu-west, tier=spot)",
    )
    token_file: Path | None = None
    # TLS to the broker (session.tls): the CA of its certificate (None: the system's), and
    # this agent's client certificate and key for a broker with --client-ca (mTLS)
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    # the name the brokers' certificate is checked against (default: each URL's host), for
    # replicas reached by address (a leader a follower names by its pod IP)
    tls_server_name: str | None = None
    backend: Literal["simulated", "kubernetes"] = "simulated"
    nodes_file: Path | None = None
    limits_file: Path | None = None
    heartbeat_seconds: Annotated[float, Field(gt=0)] = Field(
        5.0, description="used until the broker's welcome gives its own"
    )
    fence_after_seconds: Annotated[float, Field(gt=0)] | None = Field(
        None,
        description="without word from the broker this long the agent fences itself (no new "
        "pods; the pods of jobs whose clusterLost policy is requeue deleted). None: as late as "
        "the grace the broker's welcome says allows (broker.api.leases), else 30 s; a value "
        "makes it sooner, never later",
    )
    connect_timeout_seconds: Annotated[float, Field(gt=0)] = Field(
        10.0,
        description="the longest a connect to a broker and its upgrade may take; never more "
        "than two heartbeats (a frozen broker accepts the connection and never answers)",
    )
    backoff: BackoffSettings = Field(default_factory=BackoffSettings)
    summary_interval_seconds: Annotated[float, Field(ge=0)] = 0.05
    start_delay_seconds: Annotated[float, Field(ge=0)] = Field(
        0.05, description="simulated backend: Pending → Running"
    )
    failure_grace_seconds: Annotated[float, Field(ge=0)] = Field(
        30.0, description="grace of the pods deleted when a gang fails"
    )
    finished_pods_ttl_seconds: Annotated[float, Field(ge=0)] | None = Field(
        handling.FINISHED_PODS_TTL_SECONDS,
        description="the pods of a finished job are deleted this long after the broker "
        "acknowledged its final report (kept meanwhile for their logs); None: never (the "
        "cluster's own terminated-pod collection only)",
    )
    policy: str = "default"
    kubeconfig: str | None = Field(None, description="kubernetes backend; None: in-cluster")
    kube_context: str | None = None
    namespaces: list[str] | None = Field(None, description="kubernetes backend: namespaces")
    devices: Literal["device-plugin", "dra"] = Field(
        "device-plugin",
        description="kubernetes backend: how pods get their GPUs: device-plugin (nvidia.com/gpu, "
        "the kubelet picks the devices) or dra (a ResourceClaim per pod allocated to the GPUs "
        "gpufed chose; Kubernetes 1.33+ and a DRA driver); see docs/kubernetes.md",
    )
    dra_driver: str = Field("gpu.nvidia.com", description="dra: the driver whose slices count")
    dra_device_class: str | None = Field(None, description="dra: claims' DeviceClass (the driver)")
    dra_attributes: dict[str, str] = Field(
        default_factory=dict,
        description="dra: which slice attribute means what (index, uuid, product, memory, "
        "clique, type), e.g. {'product': 'productName'}",
    )
    shared_gpu_resource: str | None = Field(
        None,
        description="device-plugin: the resource of the device plugin's shared GPU replicas "
        "(default nvidia.com/gpu.shared); sharing pods go only to nodes advertising it",
    )
    auto_cordon: bool = Field(
        False,
        description="cordon a node (Kubernetes: spec.unschedulable) once cordon_after of its "
        "GPUs have failed",
    )
    cordon_after: Annotated[int, Field(ge=1)] = Field(
        gpuhealth.DEFAULT_CORDON_AFTER,
        description="GPU failures on one node within cordon_window_seconds before auto_cordon "
        "cordons it (GPUs already unhealthy when the agent starts are not counted)",
    )
    cordon_window_seconds: Annotated[float, Field(gt=0)] = Field(
        gpuhealth.DEFAULT_CORDON_WINDOW,
        description="only GPU failures this recent count toward cordon_after",
    )
    gpu_health_taints: list[str] | None = Field(
        None,
        description="kubernetes backend: node and DRA device taint keys that mark GPUs "
        "unhealthy (None: " + ", ".join(health.DEFAULT_TAINTS) + ")",
    )
    gpu_health_labels: list[str] | None = Field(
        None,
        description="kubernetes backend: node label keys that mark GPUs unhealthy (None: "
        + ", ".join(health.DEFAULT_LABELS)
        + ")",
    )
    gpu_health_conditions: list[str] | None = Field(
        None,
        description="kubernetes backend: node condition types that, True, mark GPUs "
        "unhealthy (None: " + ", ".join(health.DEFAULT_CONDITIONS) + ")",
    )
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 0
    freeze_gc: bool = Field(False, description="move start-up objects out of the collector")
    metrics_host: str = "0.0.0.0"
    journal_file: Path | None = Field(
        None, description="simulated backend: a JSON line each time a pod starts or stops running"
    )
    proxy_url: str | None = Field(
        None,
        description="an HTTP proxy (http://host:port) every broker connection goes through; "
        "HTTP_PROXY and the like are not read",
        pattern=r"^http://[^/\s]+/?$",
    )
    dcgm_urls: list[str] = Field(
        default_factory=list,
        description="dcgm-exporter's /metrics (one URL per exporter, or a Prometheus /federate "
        "URL for all): GPU utilisation per queue on the agent's /metrics (utilisation/)",
    )
    dcgm_interval_seconds: Annotated[float, Field(gt=0)] = scraping.DEFAULT_INTERVAL_SECONDS
    dcgm_timeout_seconds: Annotated[float, Field(gt=0)] = scraping.DEFAULT_TIMEOUT_SECONDS

    @field_validator("broker_url")
    @classmethod
    def _broker_urls(cls, value: str) -> str:
        brokers.parse_urls(value)  # raises ValueError naming the URL that is not one
        return value

    @field_validator("dcgm_urls")
    @classmethod
    def _dcgm_urls(cls, value: list[str]) -> list[str]:
        return [scraping.check_url(url) for url in value]

    @field_validator("dra_attributes")
    @classmethod
    def _dra_attributes(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(DRA_ATTRIBUTES))
        if unknown:
            raise ValueError(f"unknown {unknown}; known: {', '.join(DRA_ATTRIBUTES)}")
        return value

    @field_validator("cluster_labels")
    @classmethod
    def _cluster_labels(cls, value: dict[str, str]) -> dict[str, str]:
        found = affinity.labels_problem(value)
        if found is not None:
            key, item, problem = found
            raise ValueError(f"cluster label {key}={item}: {problem}")
        return value

    def health_settings(self) -> gpuhealth.HealthSettings:
        return gpuhealth.HealthSettings(
            auto_cordon=self.auto_cordon,
            cordon_after=self.cordon_after,
            cordon_window=self.cordon_window_seconds,
        )

    def health_keys(self) -> health.HealthKeys:
        given = {
            "taints": self.gpu_health_taints,
            "labels": self.gpu_health_labels,
            "conditions": self.gpu_health_conditions,
        }
        return health.HealthKeys(**{k: tuple(v) for k, v in given.items() if v is not None})

    def device_keys(self) -> dict[str, str]:
        """The DRA mode's `DeviceKeys`, as `DeviceKeys.from_mapping` reads them."""
        keys = {"driver": self.dra_driver, "deviceClass": self.dra_device_class or self.dra_driver}
        return {**keys, **self.dra_attributes}

    @property
    def broker_urls(self) -> tuple[str, ...]:
        return brokers.parse_urls(self.broker_url)

    @property
    def tls_files(self) -> tls.ClientFiles:
        return tls.ClientFiles(self.ca_file, self.cert_file, self.key_file)

    @model_validator(mode="after")
    def _nodes(self) -> AgentSettings:
        if self.backend == "simulated" and self.nodes_file is None:
            raise ValueError("nodes_file: the simulated backend needs a cluster description")
        return self

    @model_validator(mode="after")
    def _dcgm(self) -> AgentSettings:
        if self.dcgm_urls and not self.metrics_port:
            raise ValueError("dcgm_urls: GPU utilisation is served on /metrics: set metrics_port")
        return self

    @model_validator(mode="after")
    def _tls(self) -> AgentSettings:
        if self.tls_files.given:
            tls.build_context(self.tls_files)  # every file read now: a bad one stops the start
        return self

    def connect_settings(self) -> connecting.ConnectSettings:
        return connecting.ConnectSettings(
            broker_urls=self.broker_urls,
            cluster=self.cluster,
            token_file=self.token_file,
            heartbeat_seconds=self.heartbeat_seconds,
            fence_after_seconds=self.fence_after_seconds,
            failure_grace_seconds=self.failure_grace_seconds,
            backoff_initial_seconds=self.backoff.initial_seconds,
            backoff_max_seconds=self.backoff.max_seconds,
            auth_retry_seconds=self.backoff.auth_retry_seconds,
            connect_timeout_seconds=self.connect_timeout_seconds,
            proxy_url=self.proxy_url,
            tls_files=self.tls_files,
            tls_server_name=self.tls_server_name,
        )


class LimitsFileError(ValueError):
    """The limits file cannot be read or does not validate."""


def load_limits(path: Path | str | None) -> limits.AgentLimits:
    """The limits of a YAML file; no file means no limits."""
    if path is None:
        return limits.AgentLimits()
    try:
        raw: Any = yaml.safe_load(Path(path).read_text()) or {}
        return limits.AgentLimits.model_validate(raw)
    except (OSError, yaml.YAMLError) as exc:
        raise LimitsFileError(f"{path}: {exc}") from exc
    except pydantic.ValidationError as exc:
        where = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        )
        raise LimitsFileError(f"{path}: {where}") from exc


def make_backend(settings: AgentSettings) -> base.ClusterBackend:
    if settings.backend == "kubernetes":
        # written separately; imported only when asked for
        module: Any = importlib.import_module("member_agent.cluster.kubernetes.backend")
        backend: base.ClusterBackend = module.KubernetesBackend(
            settings.cluster,
            kubeconfig=settings.kubeconfig,
            context=settings.kube_context,
            namespaces=settings.namespaces,
            devices=settings.devices,
            device_keys=module.DeviceKeys.from_mapping(settings.device_keys()),
            shared_gpu_resource=settings.shared_gpu_resource,
            health_keys=settings.health_keys(),
            health_settings=settings.health_settings(),
        )
        return backend
    assert settings.nodes_file is not None
    return simulated.SimulatedBackend(
        settings.cluster,
        simulated.load_pools(settings.nodes_file),
        start_delay=settings.start_delay_seconds,
        journal=simulated_pods.Journal(settings.journal_file) if settings.journal_file else None,
        health_settings=settings.health_settings(),
    )


async def _consume(
    backend: base.ClusterBackend,
    handler: handling.JobHandler,
    reporter: reporting.SummaryReporter,
) -> None:
    async for event in backend.events():
        handler.handle_event(event)
        reporter.mark_dirty()


async def run_agent(
    settings: AgentSettings,
    *,
    stop: asyncio.Event | None = None,
    backend: base.ClusterBackend | None = None,
) -> None:
    """Run the agent until `stop` is set or SIGTERM. A `backend` given here is started and
    used but left open for the caller; otherwise one is built from the settings."""
    stop = stop or asyncio.Event()
    agent_limits = load_limits(settings.limits_file)
    async with contextlib.AsyncExitStack() as stack:
        cluster = backend or make_backend(settings)
        if backend is None:
            stack.push_async_callback(cluster.close)
        await cluster.start()
        # the inventory lives as long as the agent: keep it out of the collector's full
        # passes, which otherwise stall placements for milliseconds; and young passes as
        # the broker's collector has them (most of what a busy agent allocates, a message
        # decoded or encoded, is freed by reference counting a moment later)
        if settings.freeze_gc:
            garbage.settle(young=garbage.THRESHOLDS[0])
        reporter = reporting.SummaryReporter(
            cluster.inventory,
            cluster=settings.cluster,
            interval=settings.summary_interval_seconds,
            labels=settings.cluster_labels,
            health=lambda: cluster.gpu_health().summary(),
        )
        stack.callback(reporter.detach)
        router = connecting.Router()
        handler = handling.JobHandler(
            cluster,
            send=router.send,
            agent_limits=agent_limits,
            on_change=reporter.mark_dirty,
            failure_grace_seconds=settings.failure_grace_seconds,
            finished_pods_ttl_seconds=settings.finished_pods_ttl_seconds,
            policy=settings.policy,
        )
        stack.push_async_callback(handler.close)
        handler.adopt(cluster.held_jobs())
        connector = connecting.Connector(
            settings.connect_settings(), handler=handler, reporter=reporter, router=router
        )
        if settings.metrics_port:
            dcgm = None
            if settings.dcgm_urls:
                dcgm = scraping.DCGMScraper(
                    settings.dcgm_urls,
                    interval=settings.dcgm_interval_seconds,
                    timeout=settings.dcgm_timeout_seconds,
                )
                await dcgm.start()
                stack.push_async_callback(dcgm.close)
            collector = telemetry.AgentCollector(
                cluster=settings.cluster,
                handler=handler,
                connector=connector,
                reporter=reporter,
                dcgm=dcgm,
            )
            runner = await telemetry.start_server(
                collector, host=settings.metrics_host, port=settings.metrics_port
            )
            stack.push_async_callback(runner.cleanup)
        _handle_sigterm(stack, stop)
        logger.info(
            "agent for cluster %s started, broker %s, fencing after %g s without word from it",
            settings.cluster,
            ", ".join(settings.broker_urls),
            connector.lease.fence_after,
        )
        await _serve(connector, _consume(cluster, handler, reporter), stop)
    logger.info("agent for cluster %s stopped", settings.cluster)


def _handle_sigterm(stack: contextlib.AsyncExitStack, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    except (NotImplementedError, RuntimeError, ValueError):
        return  # not the main thread, or no signals here
    stack.callback(loop.remove_signal_handler, signal.SIGTERM)


async def _serve(
    connector: connecting.Connector, consume: Coroutine[Any, Any, None], stop: asyncio.Event
) -> None:
    """The broker session and the cluster's events, until stopped or the events end."""
    events = asyncio.create_task(consume, name="agent-events")
    session = asyncio.create_task(connector.run(stop), name="agent-session")
    try:
        done, _ = await asyncio.wait({events, session}, return_when=asyncio.FIRST_COMPLETED)
        if events in done:
            logger.error("the cluster's event stream ended: stopping")
            stop.set()
        await session
        failure = events.exception() if events.done() and not events.cancelled() else None
        if failure is not None:
            raise failure
    finally:
        stop.set()
        for task in (session, events):
            task.cancel()
        await asyncio.gather(session, events, return_exceptions=True)
