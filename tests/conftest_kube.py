"""Fixtures for the Kubernetes backend against the emulator (registered by tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

from member_agent.cluster import base, watching
from member_agent.cluster import kubernetes as k8s
from tests import kubeemulator

FAST = watching.Backoff(initial=0.01, maximum=0.05)
Kube = tuple[kubeemulator.Emulator, ApiClient]
Start = Callable[..., Awaitable[k8s.KubernetesBackend]]


@pytest.fixture
async def kube() -> AsyncIterator[Kube]:
    """An emulated API server and a kubernetes-asyncio client pointed at it."""
    async with kubeemulator.running() as running:
        yield running


@pytest.fixture
async def start(kube: Kube) -> AsyncIterator[Start]:
    """Start KubernetesBackends on the emulator (fast backoff); all are closed afterwards."""
    started: list[k8s.KubernetesBackend] = []

    async def start_backend(**kwargs: Any) -> k8s.KubernetesBackend:
        backend = k8s.KubernetesBackend("c1", api_client=kube[1], backoff=FAST, **kwargs)
        protocol: base.ClusterBackend = backend  # mypy checks it is a ClusterBackend
        del protocol
        started.append(backend)
        await backend.start()
        return backend

    yield start_backend
    for backend in started:
        await backend.close()
