"""Who may call which route: the roles, and the one table of routes with the roles each allows.

`auth.middleware` reads the table before any handler runs (a route missing from it is
refused: it fails closed), and `openapi` states it on every operation, so the document and
the broker cannot disagree. What a role may see inside a route (its own tenant's jobs and
queues) is the handler's part: `auth.Principal.sees`.

    admin         everything, every tenant's jobs and queues
    tenant-admin  what a submitter may, and its tenant's queues (PUT, DELETE)
    submitter     submit, cancel and read its tenant's jobs; read its tenant's queues
    viewer        read only: its tenant's jobs and queues, or, without a tenant, the fleet's
    agent:<name>  the agent session of cluster <name>, nothing else
    metrics       GET /metrics only (a Prometheus scraper)

A token without a role keeps what it meant before roles: a tenant's token is its submitter,
`admin: true` the admin, `agent: <name>` that cluster's agent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType


class Role(StrEnum):
    ADMIN = "admin"
    TENANT_ADMIN = "tenant-admin"
    SUBMITTER = "submitter"
    VIEWER = "viewer"
    AGENT = "agent"  # written agent:<cluster>
    METRICS = "metrics"


# roles that belong to one tenant (a viewer may, or may see the whole fleet)
TENANT_ROLES = frozenset({Role.TENANT_ADMIN, Role.SUBMITTER})


@dataclass(frozen=True)
class Rule:
    """The roles one route allows (none: no token is read) and what they may do there."""

    roles: frozenset[Role]
    what: str
    # the route shows every tenant's data (/metrics): a token of one tenant is refused
    fleet_wide: bool = False

    @property
    def public(self) -> bool:
        return not self.roles


def _rule(*roles: Role, what: str, fleet_wide: bool = False) -> Rule:
    return Rule(frozenset(roles), what, fleet_wide)


_READERS = (Role.ADMIN, Role.TENANT_ADMIN, Role.SUBMITTER, Role.VIEWER)
_SUBMITTERS = (Role.TENANT_ADMIN, Role.SUBMITTER)
_QUEUE_ADMINS = (Role.ADMIN, Role.TENANT_ADMIN)
PUBLIC = Rule(frozenset(), "no token")

ROUTES: Mapping[tuple[str, str], Rule] = MappingProxyType(
    {
        ("POST", "/v1/jobs"): _rule(*_SUBMITTERS, what="submits a job of its tenant"),
        ("POST", "/v1/jobs:batch"): _rule(*_SUBMITTERS, what="submits jobs of its tenant"),
        ("GET", "/v1/jobs"): _rule(
            *_READERS, what="its tenant's jobs (admin, a viewer without tenant: every tenant's)"
        ),
        ("GET", "/v1/jobs/{job_id}"): _rule(*_READERS, what="a job of its tenant (admin: any)"),
        ("DELETE", "/v1/jobs/{job_id}"): _rule(
            Role.ADMIN, *_SUBMITTERS, what="cancels a job of its tenant (admin: any)"
        ),
        ("GET", "/v1/jobs/{job_id}/why"): _rule(*_READERS, what="a job of its tenant (admin: any)"),
        ("DELETE", "/v1/arrays/{array}"): _rule(
            Role.ADMIN, *_SUBMITTERS, what="cancels an array's jobs of its tenant (admin: any)"
        ),
        ("GET", "/v1/queues"): _rule(
            *_READERS, what="its tenant's queues (admin, a viewer without tenant: every queue)"
        ),
        ("GET", "/v1/queues/{name}"): _rule(*_READERS, what="a queue of its tenant (admin: any)"),
        ("PUT", "/v1/queues/{name}"): _rule(
            *_QUEUE_ADMINS, what="creates or replaces a queue of its tenant (admin: any)"
        ),
        ("DELETE", "/v1/queues/{name}"): _rule(
            *_QUEUE_ADMINS, what="deletes a queue of its tenant (admin: any)"
        ),
        ("GET", "/v1/clusters"): _rule(*_READERS, what="the fleet's clusters"),
        ("GET", "/v1/clusters/{name}/gpus"): _rule(
            *_READERS, what="a cluster's GPU map (job ids: its tenant's only; admin: any)"
        ),
        ("GET", "/v1/events"): _rule(
            *_READERS, what="its tenant's job changes, live (admin, a fleet viewer: every job's)"
        ),
        ("GET", "/v1/whoami"): _rule(*_READERS, what="who its token names"),
        ("GET", "/v1/agents/connect"): _rule(Role.AGENT, what="the session of its own cluster"),
        ("GET", "/metrics"): _rule(
            Role.ADMIN,
            Role.VIEWER,
            Role.METRICS,
            what="every series (a viewer without tenant only: they span every tenant)",
            fleet_wide=True,
        ),
        ("GET", "/v1/status"): PUBLIC,
        ("GET", "/healthz"): PUBLIC,
        ("GET", "/readyz"): PUBLIC,
        ("GET", "/openapi.json"): PUBLIC,
        # the console's static files: they hold no data (the API reads it with a token)
        ("GET", "/ui"): PUBLIC,
        ("GET", "/ui/"): PUBLIC,
        ("GET", "/ui/{path}"): PUBLIC,
    }
)

METRICS_ROUTE = ("GET", "/metrics")


def table(*, metrics_public: bool = False) -> Mapping[tuple[str, str], Rule]:
    """The table a broker serves with; `--metrics-public` lets /metrics answer without a token
    (a scraper that cannot send one)."""
    if not metrics_public:
        return ROUTES
    return MappingProxyType({**ROUTES, METRICS_ROUTE: PUBLIC})


def rule_of(access: Mapping[tuple[str, str], Rule], method: str, path: str) -> Rule | None:
    """The rule of `method path` (HEAD is its GET's); None: the route has none."""
    return access.get(("GET" if method == "HEAD" else method, path))


def spell(roles: frozenset[Role]) -> str:
    """`admin, tenant-admin or submitter`, in the table's order."""
    names = [_written(r) for r in Role if r in roles]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _written(role: Role) -> str:
    return "agent:<cluster>" if role == Role.AGENT else role.value
