"""Cluster routes: the fleet view for users, the agents' session endpoint, health probes."""

from __future__ import annotations

import time

from aiohttp import web

from broker.api import errors, inventory
from broker.http import auth, keys


async def list_clusters(request: web.Request) -> web.Response:
    auth.require_user(request)
    fleet = request.app[keys.FLEET]
    running = request.app[keys.JOBS].holding_per_cluster()
    now = time.monotonic()
    views = []
    for name in sorted(fleet.clusters):
        cluster = fleet.clusters[name]
        models = []
        if cluster.summary is not None:
            for m in cluster.summary.models:
                models.append(
                    inventory.ModelTotals(
                        model=m.model,
                        total=m.total_gpus,
                        free=m.free_gpus,
                        allocated=m.total_gpus - m.free_gpus - m.unavailable_gpus,
                        unavailable=m.unavailable_gpus,
                    )
                )
        views.append(
            inventory.ClusterView(
                name=name,
                health=cluster.health(now=now, stale_after=fleet.stale_after),
                connected=cluster.connected,
                epoch=cluster.epoch,
                last_seen_seconds=round(now - cluster.last_seen, 3) if cluster.last_seen else None,
                models=models,
                running_jobs=running.get(name, 0),
                reason=cluster.reason,
            )
        )
    return web.json_response({"items": [v.model_dump(mode="json") for v in views]})


async def connect_agent(request: web.Request) -> web.StreamResponse:
    principal = auth.principal_of(request)
    if principal.kind != "agent":
        raise errors.Forbidden("only agent tokens open agent sessions")
    return await request.app[keys.SESSIONS].serve(request, principal.name)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    ready = request.app[keys.READY]
    if not all(ready.values()):
        waiting = sorted(k for k, v in ready.items() if not v)
        raise errors.Unavailable(f"waiting for: {', '.join(waiting)}", title="Not ready")
    return web.json_response({"status": "ready"})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/clusters", list_clusters)
    app.router.add_get("/v1/agents/connect", connect_agent)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
