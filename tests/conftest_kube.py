"""Fixtures for the Kubernetes backend against the emulator (registered by tests/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from broker.api import jobs, messages
from member_agent.cluster import base
from member_agent.cluster.kubernetes import backend as k8s
from member_agent.cluster.kubernetes import watching
from member_agent.jobs import handling
from member_agent.placement import limits
from tests import helmrender, kubeauthz, kubeemulator

FAST = watching.Backoff(initial=0.01, maximum=0.05)
Kube = tuple[kubeemulator.Emulator, ApiClient]
Start = Callable[..., Awaitable[k8s.KubernetesBackend]]
SCALE = 0.02  # the retries' waits, scaled down: a Retry-After of 1 s waits 20 ms


@pytest.fixture
async def kube() -> AsyncIterator[Kube]:
    """An emulated API server and a kubernetes-asyncio client pointed at it."""
    async with kubeemulator.running() as running:
        yield running


@pytest.fixture
async def start(kube: Kube) -> AsyncIterator[Start]:
    """Start KubernetesBackends on the emulator (fast backoff); all are closed afterwards.

    Each backend talks as the agent's ServiceAccount with the RBAC the member-agent chart
    renders for the way it runs (its namespaces, devices mode, auto-cordon: tests/kubeauthz.py),
    so a request the chart does not allow is 403 as on a real cluster (skipped without Go)."""
    if helmrender.MISSING:
        pytest.skip(helmrender.MISSING)
    started: list[k8s.KubernetesBackend] = []
    clients: list[ApiClient] = []

    async def start_backend(**kwargs: Any) -> k8s.KubernetesBackend:
        settings = kwargs.get("health_settings")
        values = kubeauthz.agent_values(
            namespaces=kwargs.get("namespaces"),
            devices=kwargs.get("devices", "device-plugin"),
            auto_cordon=bool(settings and settings.auto_cordon),
        )
        token = f"{kubeauthz.AGENT_TOKEN}-{len(clients)}"
        kube[0].accounts[token] = kubeauthz.chart_authorizer(values)
        configuration = client.Configuration(host=kube[1].configuration.host)
        api = ApiClient(configuration=configuration)
        api.set_default_header("Authorization", f"Bearer {token}")
        clients.append(api)
        backend = k8s.KubernetesBackend("c1", api_client=api, backoff=FAST, **kwargs)
        protocol: base.ClusterBackend = backend  # mypy checks it is a ClusterBackend
        del protocol
        started.append(backend)
        await backend.start()
        return backend

    yield start_backend
    for backend in started:
        await backend.close()
    for api in clients:
        await api.close()
    # the agent swallows some refusals (an Event it cannot record): any is a test's failure
    assert not kube[0].forbidden, f"refused by the chart's RBAC: {kube[0].forbidden}"


@pytest.fixture
def dra(kube: Kube) -> Kube:
    """The emulated API server serving resource.k8s.io/v1 (Kubernetes 1.34) for DRA mode."""
    kube[0].declare_dra(("v1",))
    return kube


class Waits:
    """A RetryPolicy's sleep: records the waits asked for, sleeps them scaled down (`SCALE`)."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)
        await asyncio.sleep(seconds * SCALE)


@contextlib.asynccontextmanager
async def following(
    backend: k8s.KubernetesBackend, handler: handling.JobHandler
) -> AsyncIterator[None]:
    """Feed the backend's events to the agent's handler, as the agent process does."""

    async def feed() -> None:
        async for event in backend.events():
            handler.handle_event(event)

    task = asyncio.create_task(feed())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class KubeAgent:
    """A job handler on a Kubernetes backend, its replies and updates recorded."""

    def __init__(
        self, backend: k8s.KubernetesBackend, agent_limits: limits.AgentLimits | None = None
    ) -> None:
        self.sent: list[messages.Message] = []
        self.handler = handling.JobHandler(
            backend, send=self._send, agent_limits=agent_limits, failure_grace_seconds=0
        )

    def _send(
        self, message: messages.Message, /, *, on_sent: Callable[[], None] | None = None
    ) -> None:
        self.sent.append(message)

    async def offer(self, job_id: str, job: jobs.GPUJob, *, epoch: int = 1) -> messages.Message:
        replies: list[messages.Message] = []
        offer = messages.Offer(job_id=job_id, epoch=epoch, tenant="team", job=job)
        await self.handler.handle_offer(offer, session_epoch=epoch, reply=replies.append)
        return replies[-1]

    async def cancel(self, job_id: str) -> None:
        await self.handler.handle_cancel(
            messages.Cancel(job_id=job_id, epoch=1, reason="Cancelled", grace_seconds=0)
        )


def gpu_job(
    name: str = "train",
    *,
    gpus: int = 1,
    replicas: int = 1,
    namespace: str = "default",
    annotations: dict[str, str] | None = None,
    containers: list[tuple[str, int]] | None = None,
) -> jobs.GPUJob:
    """A GPUJob of one task: `replicas` pods of `gpus` GPUs (or of the given containers)."""
    shapes = containers if containers is not None else [("main", gpus)]
    return jobs.GPUJob.model_validate(
        {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "queue": "research",
                "tasks": [
                    {
                        "name": "worker",
                        "replicas": replicas,
                        "template": {
                            "metadata": {"annotations": dict(annotations or {})},
                            "spec": {
                                "containers": [
                                    {
                                        "name": cname,
                                        "image": "trainer:1",
                                        "resources": {
                                            "limits": {jobs.GPU_RESOURCE: count} if count else {},
                                            "requests": {"cpu": "1"},
                                        },
                                    }
                                    for cname, count in shapes
                                ]
                            },
                        },
                    }
                ],
            },
        }
    )
