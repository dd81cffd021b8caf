"""The broker chart and the scrape configs reach /metrics now that it needs a token: the
ServiceMonitor sends one from a Secret, and `metrics.public` passes --metrics-public to a
broker that takes it.

Rendered by Helm's engine (tests/integration/test_helm_render.py's renderer; skipped without Go).
"""

from __future__ import annotations

from gpufed import daemons
from tests.integration import test_helm_render
from tests.integration.test_deploy_broker import parse_broker_args
from tests.integration.test_helm_render import BROKER, Render, broker_container

renderer = test_helm_render.renderer  # the module's fixtures: the renderer built once
render = test_helm_render.render


def test_by_default_the_chart_keeps_metrics_behind_a_token(render: Render) -> None:
    args = broker_container(render("broker"))["args"]
    assert "--metrics-public" not in args
    assert daemons.broker_settings(parse_broker_args(args)).metrics_public is False


def test_metrics_public_passes_the_flag_the_broker_takes(render: Render) -> None:
    args = broker_container(render("broker", {"metrics": {"public": True}}))["args"]
    assert "--metrics-public" in args
    assert daemons.broker_settings(parse_broker_args(args)).metrics_public is True


def test_the_service_monitor_sends_the_metrics_token_from_its_secret(render: Render) -> None:
    monitor = {"enabled": True, "tokenSecret": {"name": "gpufed-metrics", "key": "t"}}
    rendered = render("broker", {"metrics": {"serviceMonitor": monitor}})
    [endpoint] = rendered.one("ServiceMonitor", BROKER)["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "gpufed-metrics", "key": "t"},
    }
    without = render("broker", {"metrics": {"serviceMonitor": {"enabled": True}}})
    [endpoint] = without.one("ServiceMonitor", BROKER)["spec"]["endpoints"]
    assert "authorization" not in endpoint
