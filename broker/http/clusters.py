"""Cluster routes: the fleet view for users, the agents' session endpoint, the replica's
status, health probes.

Agents follow the leader: on a replica whose leader work does not run (a follower, or a
leader still syncing), `GET /v1/agents/connect` is 409 `urn:gpufed:problem:not-leader` with
the leader's URL in `leader` (null if none is known) and `Retry-After: 1`. `GET /v1/clusters`
on a follower shows what the leader published (`dispatch.leading`). `GET /v1/status` needs no
token (probes, `gpufed status`): who this replica is, who leads, the term, whether the job
cache is synced.
"""

from __future__ import annotations

import time

from aiohttp import web

from broker.api import errors, replicas
from broker.http import auth, keys, peers


async def list_clusters(request: web.Request) -> web.Response:
    running = request.app[keys.JOBS].holding_per_cluster()
    views = await request.app[keys.LEADER_WORK].cluster_views(running)
    return web.json_response({"items": [v.model_dump(mode="json") for v in views]})


async def connect_agent(request: web.Request) -> web.StreamResponse:
    principal = auth.caller(request)  # an agent's (broker.http.roles)
    if not request.app[keys.LEADER_WORK].active:
        assert principal.cluster is not None
        request.app[keys.LEADER_WORK].knocked(principal.cluster)  # for the leader (knocking)
        leader = request.app[keys.LEADERSHIP].leader_url
        raise errors.NotLeader(
            f"this broker replica does not lead: connect to the leader ({leader or 'none yet'})",
            leader=leader,
        )
    assert principal.cluster is not None
    header = request.headers.get("Authorization")
    authenticator = request.app[auth.AUTHENTICATOR]
    expires = peers.expiry(request)  # a client certificate's (--client-ca)

    def allowed() -> bool:  # the session lasts as long as its token and certificate are valid
        if expires is not None and time.time() >= expires:
            return False
        return not header or authenticator.still_names(header, principal)

    return await request.app[keys.SESSIONS].serve(request, principal.cluster, allowed=allowed)


def replica_status(app: web.Application) -> replicas.ReplicaStatus:
    leadership = app[keys.LEADERSHIP]
    work = app.get(keys.LEADER_WORK)
    return replicas.ReplicaStatus(
        replica=leadership.replica,
        role=replicas.Role.LEADER if leadership.is_leader else replicas.Role.FOLLOWER,
        leader=leadership.leader_url,
        term=leadership.term,
        synced=app[keys.READY].get("synced", False),
        active=work is not None and work.active,
        url=leadership.url,
    )


async def status(request: web.Request) -> web.Response:
    if keys.LEADERSHIP not in request.app:
        raise errors.Unavailable("the broker is starting", title="Not ready")
    return web.json_response(replica_status(request.app).model_dump(mode="json"))


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
    app.router.add_get("/v1/status", status)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
