"""The one table of routes and roles (`broker.http.roles`) covers every route the broker serves,
no more, and the OpenAPI document says the same as the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker import app as broker_app
from broker.http import openapi, roles

REPO = Path(__file__).resolve().parents[4]


def served_routes(tmp_path: Path) -> set[tuple[str, str]]:
    settings = broker_app.BrokerSettings(
        store=f"sqlite:///{tmp_path / 'broker.db'}", tokens_file=REPO / "config" / "tokens.yaml"
    )
    app = broker_app.create_app(settings)
    return {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }


def test_every_route_served_has_a_rule_and_every_rule_a_route(tmp_path: Path) -> None:
    assert served_routes(tmp_path) == set(roles.ROUTES)


def test_the_openapi_document_states_the_tables_rule_on_every_operation() -> None:
    paths = openapi.build_spec()["paths"]
    described = {
        (method.upper(), path)
        for path, item in paths.items()
        for method in item
        if method != "parameters"
    }
    assert described == set(roles.ROUTES)
    for (method, path), rule in roles.ROUTES.items():
        operation = paths[path][method.lower()]
        if rule.public:
            assert operation["security"] == [] and "401" not in operation["responses"], path
        else:
            assert "security" not in operation, f"{method} {path}: the document's bearer"
            assert set(operation["x-gpufed-roles"]) == {
                "agent:<cluster>" if r == roles.Role.AGENT else r.value for r in rule.roles
            }
            assert f"Roles: {roles.spell(rule.roles)}" in operation["description"]
            assert {"401", "403"} <= set(operation["responses"]), f"{method} {path}"


@pytest.mark.parametrize(
    ("role", "routes"),
    [
        pytest.param(roles.Role.AGENT, {("GET", "/v1/agents/connect")}, id="agent: its session"),
        pytest.param(roles.Role.METRICS, {("GET", "/metrics")}, id="metrics: /metrics"),
        pytest.param(
            roles.Role.VIEWER,
            {key for key in roles.ROUTES if key[0] == "GET"} - {("GET", "/v1/agents/connect")},
            id="viewer: every read",
        ),
    ],
)
def test_a_narrow_role_reaches_only_its_routes(
    role: roles.Role, routes: set[tuple[str, str]]
) -> None:
    reached = {key for key, rule in roles.ROUTES.items() if role in rule.roles or rule.public}
    public = {key for key, rule in roles.ROUTES.items() if rule.public}
    assert reached - public == routes - public


def test_metrics_public_changes_only_metrics() -> None:
    opened = roles.table(metrics_public=True)
    changed = {key for key in roles.ROUTES if opened[key] != roles.ROUTES[key]}
    assert changed == {roles.METRICS_ROUTE} and opened[roles.METRICS_ROUTE].public
