"""The broker's install: the rendered manifests are valid Kubernetes objects, the chart's values
match their schema, and the Deployment starts a broker the real CLI accepts, with its probes,
ports, config files and store where the flags say.

No Helm binary exists here, so deploy/manifests/broker.yaml is the chart rendered by hand for
deploy/helm/broker/ci/example-values.yaml; the tests below also check that the two agree.
"""

from __future__ import annotations

import json
import posixpath
import re
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from broker.http import openapi
from broker.state import opening
from gpufed import cli
from tests.integration.test_deploy_manifests import KUBERNETES_VERSIONS, load_objects, merged

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "broker"
RENDERED = ROOT / "deploy" / "manifests" / "broker.yaml"
RELEASE_NAMESPACE = "gpufed-system"
FULLNAME = "gpufed-broker"

DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
EXAMPLE = merged(DEFAULTS, yaml.safe_load((CHART / "ci" / "example-values.yaml").read_text()))
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
BROKER = load_objects(RENDERED)


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [obj for obj in BROKER if obj["kind"] == kind]


def pod_spec() -> dict[str, Any]:
    [deployment] = of_kind("Deployment")
    return deployment["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def broker_container() -> dict[str, Any]:
    [container] = pod_spec()["containers"]
    return container  # type: ignore[no-any-return]


# -- valid Kubernetes objects --------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    "obj", [pytest.param(obj, id=f"{obj['kind']}/{obj['metadata']['name']}") for obj in BROKER]
)
def test_every_rendered_object_is_valid_kubernetes(obj: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


# -- values against values.schema.json -----------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        pytest.param(DEFAULTS, id="values.yaml"),
        pytest.param(EXAMPLE, id="ci/example-values.yaml"),
        pytest.param(
            merged(
                DEFAULTS, {"tokens": {"existingSecret": "t"}, "store": {"sqlite": {"size": "20Gi"}}}
            ),
            id="sqlite on a 20Gi claim",
        ),
        pytest.param(merged(EXAMPLE, {"replicas": 0}), id="scaled to zero"),
    ],
)
def test_values_match_the_schema(values: dict[str, Any]) -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator(SCHEMA).validate(values)


@pytest.mark.parametrize(
    ("override", "complaint"),
    [
        pytest.param({"replicas": 2}, "greater than the maximum", id="two replicas"),
        pytest.param(
            {"store": {"etcd": {"url": ""}}}, "should be non-empty", id="etcd without URL"
        ),
        pytest.param(
            {"store": {"etcd": {"url": "http://etcd:2379"}}}, "does not match", id="not an etcd URL"
        ),
        pytest.param({"store": {"type": "postgres"}}, "is not one of", id="unknown store"),
        pytest.param({"store": {"sqlite": {"size": "lots"}}}, "does not match", id="bad size"),
        pytest.param({"tokens": {"secret": "x"}}, "secret", id="typo in tokens"),
        pytest.param({"heartbeatSeconds": 0}, "less than or equal", id="zero heartbeat"),
        pytest.param({"otel": {"protocol": "http/json"}}, "is not one of", id="bad OTLP protocol"),
        pytest.param({"ingress": {"host": ""}}, "should be non-empty", id="ingress without host"),
    ],
)
def test_the_schema_rejects_bad_values(override: dict[str, Any], complaint: str) -> None:
    with pytest.raises(jsonschema.ValidationError, match=complaint):
        jsonschema.Draft7Validator(SCHEMA).validate(merged(EXAMPLE, override))


# -- the Deployment: one locked-down broker the CLI accepts --------------------------------


def test_the_broker_is_started_with_flags_the_cli_accepts() -> None:
    """The image's entrypoint is `gpufed agent`; the chart sets `gpufed` and `broker ...`."""
    container = broker_container()
    assert container["command"] == ["gpufed"]
    args = cli.build_parser().parse_args(container["args"])
    assert args.command == "broker"
    assert (args.host, args.port) == ("0.0.0.0", 8080)
    assert args.store == EXAMPLE["store"]["etcd"]["url"]
    assert opening.parse_etcd_endpoints(args.store) == [
        ("etcd-0.etcd.gpufed-system.svc", 2379),
        ("etcd-1.etcd.gpufed-system.svc", 2379),
    ]
    assert (args.heartbeat, args.lost_after, args.offer_timeout) == (
        EXAMPLE["heartbeatSeconds"],
        EXAMPLE["lostAfterSeconds"],
        EXAMPLE["offerTimeoutSeconds"],
    )
    assert args.log_level == EXAMPLE["logLevel"].upper()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port}


@pytest.mark.parametrize(
    ("flag", "volume", "source", "key"),
    [
        pytest.param("tokens", "tokens", "secret", EXAMPLE["tokens"]["key"], id="tokens Secret"),
        pytest.param(
            "queues", "queues", "configMap", EXAMPLE["queues"]["key"], id="queues ConfigMap"
        ),
    ],
)
def test_the_config_files_are_mounted_where_the_flags_point(
    flag: str, volume: str, source: str, key: str
) -> None:
    args = vars(cli.build_parser().parse_args(broker_container()["args"]))
    directory, filename = posixpath.split(args[flag])
    mounts = {m["name"]: m for m in broker_container()["volumeMounts"]}
    assert mounts[volume] == {"name": volume, "mountPath": directory, "readOnly": True}
    [spec] = [v[source] for v in pod_spec()["volumes"] if v["name"] == volume]
    assert spec["items"] == [{"key": key, "path": filename}]
    name = spec.get("secretName", spec.get("name"))
    expected = (
        EXAMPLE["tokens"]["existingSecret"]
        if flag == "tokens"
        else EXAMPLE["queues"]["existingConfigMap"]
    )
    assert name == expected


def test_the_deployment_runs_one_locked_down_broker() -> None:
    [deployment] = of_kind("Deployment")
    spec = deployment["spec"]
    assert (spec["replicas"], spec["strategy"]["type"]) == (EXAMPLE["replicas"], "Recreate")
    pod = pod_spec()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the Dockerfile's user
    container = broker_container()
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["image"] == f"{EXAMPLE['image']['repository']}:{EXAMPLE['image']['tag']}"
    served = openapi.build_spec()["paths"]
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}
        assert path in served


def test_the_broker_needs_no_kubernetes_api_access() -> None:
    kinds = {obj["kind"] for obj in BROKER}
    assert not kinds & {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
    [account] = of_kind("ServiceAccount")
    assert account["automountServiceAccountToken"] is False
    assert pod_spec()["automountServiceAccountToken"] is False
    assert pod_spec()["serviceAccountName"] == account["metadata"]["name"]


def test_traces_go_where_the_otel_values_say() -> None:
    env = {e["name"]: e["value"] for e in broker_container()["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == EXAMPLE["otel"]["endpoint"]
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == EXAMPLE["otel"]["protocol"]


# -- Service, Ingress and scraping reach the container's port ------------------------------


def test_the_service_and_ingress_reach_the_broker() -> None:
    [deployment] = of_kind("Deployment")
    [service] = of_kind("Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["type"] == EXAMPLE["service"]["type"]
    [port] = service["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == (
        "http",
        EXAMPLE["service"]["port"],
        "http",
    )
    [ingress] = of_kind("Ingress")
    [rule] = ingress["spec"]["rules"]
    assert rule["host"] == EXAMPLE["ingress"]["host"]
    [path] = rule["http"]["paths"]
    assert path["backend"]["service"] == {
        "name": service["metadata"]["name"],
        "port": {"name": "http"},
    }
    assert ingress["spec"]["tls"] == [
        {
            "hosts": [EXAMPLE["ingress"]["host"]],
            "secretName": EXAMPLE["ingress"]["tls"]["secretName"],
        }
    ]


def test_prometheus_scrapes_the_brokers_metrics() -> None:
    [deployment] = of_kind("Deployment")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(broker_container()["ports"][0]["containerPort"]),
        "prometheus.io/path": "/metrics",
    }
    assert "/metrics" in openapi.build_spec()["paths"]


# -- the rendered file agrees with the templates -------------------------------------------


def test_the_rendered_file_has_what_the_templates_produce() -> None:
    skipped = {"pvc.yaml", "servicemonitor.yaml"}  # sqlite only; the ServiceMonitor toggle is off
    kinds: set[str] = set()
    for template in (CHART / "templates").glob("*.yaml"):
        if template.name not in skipped:
            kinds.update(re.findall(r"^kind: (\w+)$", template.read_text(), flags=re.M))
    assert {obj["kind"] for obj in BROKER} == kinds
    assert {obj["metadata"]["name"] for obj in BROKER} == {FULLNAME}
    assert {obj["metadata"]["namespace"] for obj in BROKER} == {RELEASE_NAMESPACE}


def test_the_sqlite_file_lives_on_the_data_volume() -> None:
    """With store.type sqlite the file must be on the PVC: the root filesystem is read-only."""
    [url] = re.findall(
        r"^(sqlite://\S+)$", (CHART / "templates" / "_helpers.tpl").read_text(), re.M
    )
    path = opening.parse_sqlite_path(url)
    deployment = (CHART / "templates" / "deployment.yaml").read_text()
    [mount] = re.findall(r"- name: data\n\s+mountPath: (\S+)", deployment)
    assert posixpath.isabs(path) and posixpath.dirname(path) == mount
    assert DEFAULTS["store"]["type"] == "sqlite"
    assert 'claimName: {{ include "broker.dataClaim" . }}' in deployment
