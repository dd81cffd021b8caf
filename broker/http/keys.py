"""The application's state, one key each (`web.AppKey`): set by `broker.app`, read by handlers."""

from __future__ import annotations

from aiohttp import web

from broker.dispatch import connecting, leading
from broker.http import auth
from broker.jobs import fleet, service
from broker.state import electing, registry

AUTHENTICATOR = auth.AUTHENTICATOR
JOBS = web.AppKey("jobs", service.Jobs)
QUEUES = web.AppKey("queues", registry.QueueRegistry)
FLEET = web.AppKey("fleet", fleet.Fleet)
SESSIONS = web.AppKey("sessions", connecting.Sessions)
READY = web.AppKey("ready", dict[str, bool])
LEADERSHIP = web.AppKey("leadership", electing.Leadership)
LEADER_WORK = web.AppKey("leader_work", leading.LeaderWork)
