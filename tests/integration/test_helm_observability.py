"""What the charts plug into an existing monitoring stack: the dashboards as ConfigMaps for
Grafana's sidecar, the rules as a PrometheusRule (both copies of deploy/grafana and
deploy/prometheus, kept the same by deploy/helm/sync-observability.sh), the console's link to a
job's trace in Grafana Explore, and the OTEL settings of both processes.

Rendered by Helm's engine (tests/integration/test_helm_render.py's renderer; skipped without Go).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from broker.http import console
from broker.telemetry import tracing
from gpufed import daemons
from tests.integration import test_helm_render
from tests.integration.test_deploy_broker import parse_broker_args
from tests.integration.test_helm_render import AGENT, BROKER, ROOT, Render, broker_container

renderer = test_helm_render.renderer  # the module's fixtures: the renderer built once
render = test_helm_render.render

DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "broker"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
RULES = DEPLOY / "prometheus" / "alerts.yaml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yaml"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "gpufed.yaml"


def test_the_charts_dashboards_and_rules_are_copies_of_their_sources() -> None:
    """One source each: deploy/grafana/dashboards and deploy/prometheus/alerts.yaml; the chart
    holds copies because Helm reads no file outside it."""
    sources = {path.name: path.read_bytes() for path in DASHBOARDS.glob("*.json")}
    copies = {path.name: path.read_bytes() for path in (CHART / "dashboards").glob("*.json")}
    assert sources
    stale = sorted(
        name for name in sources.keys() | copies.keys() if sources.get(name) != copies.get(name)
    )
    assert not stale, f"run deploy/helm/sync-observability.sh: {stale} differ"
    assert (CHART / "rules" / "alerts.yaml").read_bytes() == RULES.read_bytes(), (
        "run deploy/helm/sync-observability.sh"
    )


def test_each_dashboard_is_a_config_map_for_grafanas_sidecar(render: Render) -> None:
    assert "ConfigMap" not in render("broker").kinds()  # off by default
    dashboards = {"enabled": True, "labelValue": "gpufed", "namespace": "monitoring"}
    rendered = render("broker", {"grafana": {"dashboards": dashboards}})
    maps = [obj for obj in rendered.objects if obj["kind"] == "ConfigMap"]
    served: dict[str, str] = {}
    for config in maps:
        assert config["metadata"]["labels"]["grafana_dashboard"] == "gpufed"
        assert config["metadata"]["namespace"] == "monitoring"
        served.update(config["data"])
    # every dashboard of deploy/grafana/dashboards, byte for byte, each its own ConfigMap
    assert len(maps) == len(served)
    assert served == {path.name: path.read_text() for path in DASHBOARDS.glob("*.json")}
    for text in served.values():
        assert json.loads(text)["uid"]
    default = render("broker", {"grafana": {"dashboards": {"enabled": True}}})
    [label] = {
        obj["metadata"]["labels"]["grafana_dashboard"]
        for obj in default.objects
        if obj["kind"] == "ConfigMap"
    }
    assert label == "1"  # the grafana chart's sidecar default


def rule_groups(rendered: test_helm_render.Rendered) -> list[dict[str, Any]]:
    [rule] = [obj for obj in rendered.objects if obj["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"] == BROKER
    return rule["spec"]["groups"]  # type: ignore[no-any-return]


def test_the_prometheus_rule_holds_the_rules_of_alerts_yaml(render: Render) -> None:
    assert "PrometheusRule" not in render("broker").kinds()  # off by default
    rendered = render(
        "broker", {"metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}}
    )
    [rule] = [obj for obj in rendered.objects if obj["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "kps"
    groups = rule_groups(rendered)
    assert groups == yaml.safe_load(RULES.read_text())["groups"]
    # alert templates reach the operator as written, not expanded by Helm
    annotations = [r.get("annotations", {}) for g in groups for r in g["rules"]]
    assert any("{{ $labels." in text for a in annotations for text in a.values())


def test_the_prometheus_rules_pass_the_rule_unit_tests(render: Render, tmp_path: Path) -> None:
    """promtool's unit tests of alerts.yaml, run against the rules the PrometheusRule holds."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    rendered = render("broker", {"metrics": {"prometheusRule": {"enabled": True}}})
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump({"groups": rule_groups(rendered)}))
    shutil.copy(RULE_TESTS, tmp_path / "alerts_test.yaml")
    for args in (("check", "rules", "alerts.yaml"), ("test", "rules", "alerts_test.yaml")):
        done = subprocess.run(
            [promtool, *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout


# -- the console's link to a job's trace ----------------------------------------------------


def datasource_uids() -> dict[str, str]:
    """The provisioned data sources' uid by type (prometheus, tempo)."""
    provisioned = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    return {source["type"]: source["uid"] for source in provisioned}


def dashboard_trace_link() -> str:
    """The job dashboard's "Open trace in Explore" link, its data source variables resolved to
    the provisioned data sources (the `${trace_id}` variable kept)."""
    dashboard = json.loads((DASHBOARDS / "gpufed-job.json").read_text())
    [link] = [link["url"] for link in dashboard["links"] if "/explore" in link["url"]]
    uids = datasource_uids()
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable["type"] == "datasource":
            link = link.replace(f"${{{variable['name']}}}", uids[variable["query"]])
    return str(link)


def explore_pane(url: str) -> tuple[str, dict[str, list[str]], Any]:
    """An Explore URL as Grafana reads it: its path, its parameters, and the panes' JSON."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    [panes] = query.pop("panes")
    return parts.path, query, json.loads(panes)


def test_the_default_trace_link_opens_the_trace_as_the_job_dashboard_does(render: Render) -> None:
    args = parse_broker_args(broker_container(render("broker"))["args"])
    template = daemons.broker_settings(args).trace_url_template
    assert template is not None
    assert console.check_trace_url_template(template) is None
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    opened = template.replace(console.TRACE_PLACEHOLDER, trace_id)
    expected = dashboard_trace_link().replace("${trace_id}", trace_id)
    path, query, panes = explore_pane(opened)
    assert (path, query, panes) == explore_pane(expected)
    assert "gpufed-tempo" in json.dumps(panes)  # the Tempo data source's provisioned uid
    # a template of your own, or none
    mine = "https://grafana.example.com/explore?traceId={trace_id}"
    args = parse_broker_args(broker_container(render("broker", {"traceUrlTemplate": mine}))["args"])
    assert daemons.broker_settings(args).trace_url_template == mine
    none = broker_container(render("broker", {"traceUrlTemplate": ""}))["args"]
    assert not [arg for arg in none if arg.startswith("--trace-url-template")]


def test_the_schema_refuses_a_trace_link_without_the_trace_id(render: Render) -> None:
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        render("broker", {"traceUrlTemplate": "http://grafana:3000/explore?traceId=x"})


# -- OTEL settings ----------------------------------------------------------------------------


def container_env(rendered: test_helm_render.Rendered, kind: str, name: str) -> dict[str, str]:
    [container] = rendered.one(kind, name)["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_the_agent_takes_the_otel_values_the_broker_takes(render: Render) -> None:
    """The same `otel` and `extraEnv` values give the agent the OTEL_* variables they give the
    broker, and with them an exporter: its spans (agent.place, agent.bind) join each trace."""
    quiet = container_env(render("member-agent", {"otel": {"endpoint": ""}}), "Deployment", AGENT)
    assert not tracing.records_spans(tracing.provider_for("gpufed-agent", environ=quiet))
    otel = {"endpoint": "http://otel-collector.observability.svc:4317", "protocol": "grpc"}
    extra = [{"name": "OTEL_EXPORTER_OTLP_HEADERS", "value": "x-scope-orgid=gpu"}]
    values = {"otel": {**otel, "sampler": "parentbased_always_on"}, "extraEnv": extra}
    env = container_env(render("member-agent", values), "Deployment", AGENT)
    broker_env = container_env(render("broker", values), "Deployment", BROKER)
    assert {k: v for k, v in env.items() if k.startswith("OTEL_")} == {
        k: v for k, v in broker_env.items() if k.startswith("OTEL_")
    }
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == otel["endpoint"]
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_always_on"
    assert env["OTEL_EXPORTER_OTLP_HEADERS"] == "x-scope-orgid=gpu"
    provider = tracing.provider_for("gpufed-agent", environ=env)
    assert tracing.records_spans(provider)
    provider.shutdown()


@pytest.mark.parametrize("chart", ["broker", "member-agent"])
def test_with_an_endpoint_a_share_of_the_jobs_is_traced_by_default(
    render: Render, chart: str
) -> None:
    """The charts' sampler: set with an endpoint only (none set, none recorded), and left to
    `extraEnv` when `otel.sampler` is empty, so that no variable is given twice."""
    kind, name = ("Deployment", BROKER) if chart == "broker" else ("Deployment", AGENT)
    endpoint = "http://otel-collector.observability.svc:4318"

    def sampler_env(otel: dict[str, str], extra: list[dict[str, str]] | None = None) -> list[str]:
        rendered = render(chart, {"otel": otel, "extraEnv": extra or []})
        [container] = rendered.one(kind, name)["spec"]["template"]["spec"]["containers"]
        return [
            f"{e['name']}={e['value']}"
            for e in container["env"]
            if e["name"].startswith("OTEL_TRACES_SAMPLER")
        ]

    assert sampler_env({"endpoint": ""}) == []
    assert sampler_env({"endpoint": endpoint}) == [
        "OTEL_TRACES_SAMPLER=parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG=1",  # every job, as the product promises
    ]
    assert sampler_env({"endpoint": endpoint, "samplerArg": "0.1"})[1] == (
        "OTEL_TRACES_SAMPLER_ARG=0.1"
    )
    mine = [{"name": "OTEL_TRACES_SAMPLER", "value": "always_on"}]
    assert sampler_env({"endpoint": endpoint, "sampler": ""}, mine) == [
        "OTEL_TRACES_SAMPLER=always_on"
    ]


def test_the_schema_refuses_a_share_out_of_range(render: Render) -> None:
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        render("broker", {"otel": {"endpoint": "http://collector:4318", "samplerArg": "10%"}})
