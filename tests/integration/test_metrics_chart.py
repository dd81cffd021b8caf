"""The broker chart and the scrape configs reach /metrics now that it needs a token: the
ServiceMonitor sends one from a Secret, and `metrics.public` passes --metrics-public to a
broker that takes it. The agent chart serves the agent's /metrics on a Service, with scrape
annotations or a ServiceMonitor; both monitors name the scrape jobs the rules match.

Rendered by Helm's engine (tests/integration/test_helm_render.py's renderer; skipped without Go).
"""

from __future__ import annotations

from gpufed import daemons
from tests.integration import test_helm_render
from tests.integration.test_deploy_broker import parse_broker_args
from tests.integration.test_helm_render import (
    AGENT,
    BROKER,
    Render,
    agent_settings,
    broker_container,
)

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


def test_the_agent_serves_metrics_on_a_service_its_service_monitor_scrapes(render: Render) -> None:
    rendered = render("member-agent")
    deployment = rendered.one("Deployment", AGENT)
    pod = deployment["spec"]["template"]
    [container] = pod["spec"]["containers"]
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["health"]
    # metrics on by default, on the port the Service and the scrape annotations name
    assert agent_settings(rendered).metrics_port == port == rendered.values["healthPort"]
    service = rendered.one("Service", AGENT)
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    [service_port] = service["spec"]["ports"]
    assert (service_port["targetPort"], service_port["port"]) == ("health", port)
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (
        str(port),
        "/metrics",
    )
    assert "ServiceMonitor" not in rendered.kinds()  # needs the Prometheus Operator's CRDs

    monitor = {"enabled": True, "interval": "15s", "labels": {"release": "kps"}}
    with_monitor = render("member-agent", {"metrics": {"serviceMonitor": monitor}})
    servicemonitor = with_monitor.one("ServiceMonitor", AGENT)
    assert servicemonitor["metadata"]["labels"]["release"] == "kps"
    assert servicemonitor["spec"]["selector"]["matchLabels"].items() <= (
        with_monitor.one("Service", AGENT)["metadata"]["labels"].items()
    )
    [endpoint] = servicemonitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == (
        service_port["name"],
        "/metrics",
        "15s",
    )
    # every agent series has its own `cluster` label: no target label may shadow it
    assert not any(r.get("targetLabel") == "cluster" for r in endpoint.get("relabelings", []))
