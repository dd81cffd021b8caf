"""The emulator's RBAC authorizer decides as the API server's RBAC authorizer does."""

from __future__ import annotations

from typing import Any

import pytest

from tests.kubeauthz import Authorizer

SA = {"kind": "ServiceAccount", "name": "agent", "namespace": "system"}


def role(kind: str, name: str, rules: list[dict[str, Any]], namespace: str | None = None) -> Any:
    meta: dict[str, Any] = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"kind": kind, "metadata": meta, "rules": rules}


def binding(kind: str, role_kind: str, name: str, namespace: str | None = None) -> Any:
    meta: dict[str, Any] = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {
        "kind": kind,
        "metadata": meta,
        "roleRef": {"kind": role_kind, "name": name},
        "subjects": [SA],
    }


OBJECTS = [
    role("ClusterRole", "read", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]),
    binding("ClusterRoleBinding", "ClusterRole", "read"),
    role(
        "Role",
        "write",
        [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "patch"]},
            {"apiGroups": ["x.io"], "resources": ["things/status"], "verbs": ["*"]},
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "verbs": ["get"],
                "resourceNames": ["a"],
            },
        ],
        "team-a",
    ),
    binding("RoleBinding", "Role", "write", "team-a"),
    # bound to someone else: grants the agent nothing
    role("ClusterRole", "all", [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]),
    {
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "all"},
        "roleRef": {"kind": "ClusterRole", "name": "all"},
        "subjects": [{"kind": "ServiceAccount", "name": "other", "namespace": "system"}],
    },
]


@pytest.mark.parametrize(
    ("asked", "allowed"),
    [
        pytest.param(("", "pods", "list", None, ""), True, id="a ClusterRole: all namespaces"),
        pytest.param(("", "pods", "list", "team-b", ""), True, id="a ClusterRole: any namespace"),
        pytest.param(("", "pods", "patch", "team-a", "p"), True, id="a Role in its namespace"),
        pytest.param(("", "pods", "patch", "team-b", "p"), False, id="a Role elsewhere"),
        pytest.param(("", "pods", "delete", "team-a", "p"), False, id="a verb not granted"),
        pytest.param(("", "pods/status", "patch", "team-a", "p"), False, id="not a subresource"),
        pytest.param(
            ("x.io", "things/status", "update", "team-a", "t"), True, id="a wildcard verb"
        ),
        pytest.param(("x.io", "things", "update", "team-a", "t"), False, id="only the subresource"),
        pytest.param(("", "configmaps", "get", "team-a", "a"), True, id="a resourceName"),
        pytest.param(("", "configmaps", "get", "team-a", "b"), False, id="another name"),
        pytest.param(("", "secrets", "get", "team-a", "s"), False, id="bound to another account"),
    ],
)
def test_rbac_decisions(asked: tuple[str, str, str, str | None, str], allowed: bool) -> None:
    """asked: (API group, resource, verb, namespace, name)."""
    account = Authorizer.from_objects(OBJECTS, namespace="system", account="agent")
    assert account.user == "system:serviceaccount:system:agent"
    assert account.allows(*asked) is allowed
