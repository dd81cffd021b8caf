"""The member agent's RBAC as the chart renders it, enforced on the emulator. Tests only.

The agent's requests carry its ServiceAccount's token (`AGENT_TOKEN`); the emulator asks the
`Authorizer` about each of them, and anything its Roles and ClusterRole do not grant is 403
Forbidden with the API server's Status body. The rules are read from the chart rendered by
Helm's engine (tests/helmrender.py) for values matching how the agent runs (`agent_values`), so
a verb the code needs and the chart lacks fails a test. Requests without that token are the
test's own (a cluster admin, the kubelet, a controller) and are not checked.

As the RBAC authorizer does: a Role's rules hold in its namespace only, a ClusterRole's (bound
by a ClusterRoleBinding) everywhere; a list or watch over all namespaces needs a ClusterRole;
`pods` does not cover `pods/status`; `resourceNames` limits a rule to those objects (and never
grants list, watch or create); `*` matches anything. Discovery (`/api`, `/apis/...`) is allowed,
as `system:discovery` allows it to every authenticated user. Not modelled: aggregated
ClusterRoles, Roles bound to other subjects, impersonation, admission (quota, webhooks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import kmock

from tests import helmrender

AGENT_TOKEN = "gpufed-member-agent-token"  # a made-up ServiceAccount token
AGENT_CHART = "member-agent"


@dataclass(frozen=True)
class Rule:
    groups: frozenset[str]
    resources: frozenset[str]  # "pods", "pods/status", "*"
    verbs: frozenset[str]
    names: frozenset[str]  # resourceNames; empty: any
    namespace: str | None  # None: cluster-wide (a ClusterRole bound by a ClusterRoleBinding)

    def allows(
        self, group: str, resource: str, verb: str, namespace: str | None, name: str
    ) -> bool:
        if self.namespace is not None and namespace != self.namespace:
            return False
        if not ({group, "*"} & self.groups and {verb, "*"} & self.verbs):
            return False
        if not {resource, "*"} & self.resources:
            return False
        return not self.names or (name in self.names and verb not in ("list", "watch", "create"))


@dataclass(frozen=True)
class Authorizer:
    """What one ServiceAccount may do, from the rendered RBAC objects bound to it."""

    user: str
    rules: tuple[Rule, ...]

    @classmethod
    def from_objects(
        cls, objects: Iterable[Mapping[str, Any]], *, namespace: str, account: str
    ) -> Authorizer:
        objects = list(objects)
        roles = {
            (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
            for o in objects
            if o["kind"] in ("Role", "ClusterRole")
        }
        rules: list[Rule] = []
        for binding in objects:
            if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            if not any(
                s.get("kind") == "ServiceAccount"
                and s.get("name") == account
                and s.get("namespace") == namespace
                for s in binding.get("subjects") or []
            ):
                continue
            where = binding["metadata"].get("namespace")  # None for a ClusterRoleBinding
            ref = binding["roleRef"]
            role = roles.get((ref["kind"], where if ref["kind"] == "Role" else None, ref["name"]))
            assert role is not None, f"{binding['kind']} {binding['metadata']['name']}: no {ref}"
            for rule in role.get("rules") or []:
                rules.append(
                    Rule(
                        frozenset(rule.get("apiGroups") or []),
                        frozenset(rule.get("resources") or []),
                        frozenset(rule.get("verbs") or []),
                        frozenset(rule.get("resourceNames") or []),
                        where,
                    )
                )
        return cls(f"system:serviceaccount:{namespace}:{account}", tuple(rules))

    def allows(
        self, group: str, resource: str, verb: str, namespace: str | None, name: str = ""
    ) -> bool:
        return any(rule.allows(group, resource, verb, namespace, name) for rule in self.rules)

    def check(self, request: kmock.Request) -> aiohttp.web.StreamResponse | None:
        """None when `request` is allowed, else the API server's 403 answer."""
        if request.resource is None:
            return None  # discovery and other non-resource URLs
        verb = verb_of(request)
        group = request.resource.group or ""
        resource = str(request.resource.plural)
        if request.subresource:
            resource = f"{resource}/{request.subresource}"
        name = request.name or ""
        if self.allows(group, resource, verb, request.namespace, name):
            return None
        what = f'{request.resource.plural} "{name}"' if name else request.resource.plural
        where = (
            f' in the namespace "{request.namespace}"'
            if request.namespace
            else " at the cluster scope"
        )
        return forbidden(
            request,
            f'User "{self.user}" cannot {verb} resource "{resource}" in API group "{group}"{where}',
            what=what,
        )


def forbidden(
    request: kmock.Request, why: str, *, what: str | None = None
) -> aiohttp.web.StreamResponse:
    """The API server's 403 for `request`: `<what> is forbidden: <why>`."""
    assert request.resource is not None
    name = request.name or ""
    if what is None:
        what = f'{request.resource.plural} "{name}"' if name else request.resource.plural
    details: dict[str, Any] = {"kind": request.resource.plural}
    if name:
        details["name"] = name
    body = {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "message": f"{what} is forbidden: {why}",
        "reason": "Forbidden",
        "details": details,
        "code": 403,
    }
    return aiohttp.web.json_response(body, status=403)


def verb_of(request: kmock.Request) -> str:
    method = str(request.method.value).upper()
    watching = str(request.params.get("watch", "")).lower() in ("true", "1")
    if request.action == kmock.action.WATCH or watching:
        return "watch"
    if method == "GET":
        return "get" if request.name else "list"
    if method == "DELETE":
        return "delete" if request.name else "deletecollection"
    verbs = {"POST": "create", "PUT": "update", "PATCH": "patch"}
    return verbs.get(method, method.lower())


def agent_values(
    *,
    namespaces: Iterable[str] | None,
    devices: str = "device-plugin",
    auto_cordon: bool = False,
) -> dict[str, Any]:
    """The chart's values for an agent run this way (namespaces None: every namespace)."""
    values: dict[str, Any] = {
        "devices": {"mode": devices},
        "gpuHealth": {"autoCordon": auto_cordon},
    }
    if namespaces is None:
        values.update(allNamespaces=True, namespaces=[])
    else:
        values["namespaces"] = sorted(set(namespaces))
    return values


def chart_authorizer(values: dict[str, Any]) -> Authorizer:
    """The agent's ServiceAccount as the member-agent chart renders it for `values` (over its
    example values). Callers skip when `helmrender.MISSING`."""
    objects = helmrender.render_chart(AGENT_CHART, values)
    [account] = [o for o in objects if o["kind"] == "ServiceAccount"]
    return Authorizer.from_objects(
        objects, namespace=account["metadata"]["namespace"], account=account["metadata"]["name"]
    )
