"""The broker's install: the rendered manifests are valid Kubernetes objects, the chart's values
match their schema, and the Deployment starts brokers the real CLI accepts, with their probes,
ports, config files and store where the flags say.

deploy/manifests/broker.yaml is the chart rendered by deploy/render (Helm's template engine) for
deploy/helm/broker/ci/example-values.yaml; test_helm_render.py checks that it is exactly the
renderer's output and renders the other variants. The tests here need no Go: they read the
committed file and the chart's sources.
"""

from __future__ import annotations

import argparse
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
from gpufed.local import allocator
from tests.integration.test_deploy_manifests import KUBERNETES_VERSIONS, load_objects, merged

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "broker"
RENDERED = ROOT / "deploy" / "manifests" / "broker.yaml"
RELEASE_NAMESPACE = "gpufed-system"
FULLNAME = "gpufed-broker"
ETCD_NAME = f"{FULLNAME}-etcd"

DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
EXAMPLE = merged(DEFAULTS, yaml.safe_load((CHART / "ci" / "example-values.yaml").read_text()))
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
BROKER = load_objects(RENDERED)


# Flags the chart passes that the broker does not take yet, while it gains them alongside the
# chart: until the CLI has one it may appear unparsed; once it has it, it is parsed and checked
# like every other flag, so a misspelt flag fails either way. None awaited now: issue 11's
# --advertise-url, --leader-lease-seconds and --etcd-ca/--etcd-cert/--etcd-key are all there.
AWAITED_BROKER_FLAGS: frozenset[str] = frozenset()


def parse_broker_args(args: list[str]) -> argparse.Namespace:
    """The container's args through the real CLI parser, tolerating only the awaited flags."""
    parsed, unknown = cli.build_parser().parse_known_args(args)
    names = {arg.split("=", 1)[0] for arg in unknown}
    assert names <= AWAITED_BROKER_FLAGS, f"flags the broker does not take: {sorted(names)}"
    return parsed


def flag_values(args: list[str]) -> dict[str, str]:
    """--name=value args as a dict (every flag the charts pass has the = form)."""
    return dict(arg.split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [obj for obj in BROKER if obj["kind"] == kind]


def named(kind: str, name: str) -> dict[str, Any]:
    [obj] = [obj for obj in of_kind(kind) if obj["metadata"]["name"] == name]
    return obj


def pod_spec() -> dict[str, Any]:
    return named("Deployment", FULLNAME)["spec"]["template"]["spec"]  # type: ignore[no-any-return]


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
                DEFAULTS,
                {
                    "replicas": 1,
                    "tokens": {"existingSecret": "t"},
                    "store": {"type": "sqlite", "sqlite": {"size": "20Gi"}},
                },
            ),
            id="one broker on SQLite, a 20Gi claim",
        ),
        pytest.param(merged(EXAMPLE, {"replicas": 0}), id="scaled to zero"),
        pytest.param(
            merged(EXAMPLE, {"store": {"etcd": {"endpoints": ["etcd-0.etcd:2379", "etcd-1"]}}}),
            id="an etcd of your own",
        ),
        pytest.param(
            merged(
                EXAMPLE,
                {
                    "store": {"etcd": {"tls": {"enabled": True, "existingSecret": "etcd-client"}}},
                    "etcd": {"tls": {"existingSecret": "etcd-server"}, "replicas": 5},
                    "podDisruptionBudget": {"maxUnavailable": "34%"},
                },
            ),
            id="TLS to five members",
        ),
        pytest.param(
            merged(
                EXAMPLE,
                {
                    "store": {
                        "etcd": {
                            "endpoints": ["etcd.storage.svc"],
                            "auth": {"user": "gpufed-broker", "existingSecret": "etcd-user"},
                        }
                    }
                },
            ),
            id="an etcd user",
        ),
    ],
)
def test_values_match_the_schema(values: dict[str, Any]) -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator(SCHEMA).validate(values)


@pytest.mark.parametrize(
    ("override", "complaint"),
    [
        pytest.param(
            {"replicas": 2, "store": {"type": "sqlite"}},
            "2 is greater than the maximum of 1",
            id="two brokers on SQLite",
        ),
        pytest.param(
            {"store": {"etcd": {"url": "etcd://etcd:2379"}}}, "'url' was unexpected", id="old URL"
        ),
        pytest.param(
            {"store": {"etcd": {"endpoints": ["http://etcd:2379"]}}},
            "does not match",
            id="an endpoint with a scheme",
        ),
        pytest.param(
            {"store": {"etcd": {"tls": {"enabled": True}}}},
            "should be non-empty",
            id="TLS without its Secret",
        ),
        pytest.param(
            {"store": {"etcd": {"auth": {"user": "gpufed-broker"}}}},
            "should be non-empty",
            id="an etcd user without its Secret",
        ),
        pytest.param(
            {"store": {"etcd": {"auth": {"password": "s3cret"}}}},
            "'password' was unexpected",
            id="a password in the values",
        ),
        pytest.param({"etcd": {"replicas": 2}}, "is not one of", id="an even etcd cluster"),
        pytest.param(
            {"store": {"etcd": {"maxRequestBytes": "1.5Mi"}}}, "is not of type", id="bytes text"
        ),
        pytest.param({"podAntiAffinity": {"type": "soft"}}, "is not one of", id="affinity type"),
        pytest.param(
            {"podDisruptionBudget": {"maxUnavailable": 0}}, "is not valid", id="a PDB of zero"
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


# -- the Deployment: locked-down brokers the CLI accepts -----------------------------------


def test_the_broker_is_started_with_flags_the_cli_accepts() -> None:
    """The image's entrypoint is `gpufed agent`; the chart sets `gpufed` and `broker ...`."""
    container = broker_container()
    assert container["command"] == ["gpufed"]
    args = parse_broker_args(container["args"])
    assert args.command == "broker"
    assert (args.host, args.port) == ("0.0.0.0", 8080)
    domain = f"{ETCD_NAME}.{RELEASE_NAMESPACE}.svc.cluster.local"
    assert opening.parse_etcd_endpoints(args.store) == [
        (f"{ETCD_NAME}-{i}.{domain}", 2379) for i in range(EXAMPLE["etcd"]["replicas"])
    ]
    assert args.max_request_bytes == EXAMPLE["store"]["etcd"]["maxRequestBytes"]
    assert (args.heartbeat, args.lost_after, args.offer_timeout) == (
        EXAMPLE["heartbeatSeconds"],
        EXAMPLE["lostAfterSeconds"],
        EXAMPLE["offerTimeoutSeconds"],
    )
    assert args.max_offers_in_flight == EXAMPLE["maxOffersInFlight"]
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
    args = vars(parse_broker_args(broker_container()["args"]))
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


def test_the_deployment_runs_three_locked_down_brokers() -> None:
    spec = named("Deployment", FULLNAME)["spec"]
    assert spec["replicas"] == EXAMPLE["replicas"] == 3
    # an upgrade starts a new broker and waits for it to be ready before stopping an old one
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
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
    probes = {"startupProbe": "/healthz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    for probe, path in probes.items():
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}
        assert path in served


def test_the_broker_needs_no_kubernetes_api_access() -> None:
    kinds = {obj["kind"] for obj in BROKER}
    assert not kinds & {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
    [account] = of_kind("ServiceAccount")
    assert account["automountServiceAccountToken"] is False
    for workload in (*of_kind("Deployment"), *of_kind("StatefulSet")):
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_traces_go_where_the_otel_values_say() -> None:
    env = {e["name"]: e.get("value") for e in broker_container()["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == EXAMPLE["otel"]["endpoint"]
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == EXAMPLE["otel"]["protocol"]


def test_the_broker_runs_on_the_c_allocator_whose_free_pages_it_gives_back() -> None:
    env = {e["name"]: e.get("value") for e in broker_container()["env"]}
    assert env["PYTHONMALLOC"] == "malloc"  # kits.garbage trims it


def test_the_broker_preloads_the_jemalloc_the_image_links_with_the_local_brokers_settings() -> None:
    env = {e["name"]: e.get("value") for e in broker_container()["env"]}
    assert EXAMPLE["allocator"] == "jemalloc"  # the default
    assert env["MALLOC_CONF"] == allocator.JEMALLOC_CONF  # what e2e/test_allocator runs
    dockerfile = (ROOT / "member-agent" / "Dockerfile").read_text()
    [linked] = re.findall(r"ln -s .*? (\S+libjemalloc\.so\.2)\b", dockerfile)
    assert env["LD_PRELOAD"] == linked
    assert "apt-get install -y --no-install-recommends libjemalloc2" in dockerfile


# -- Service, Ingress and scraping reach the container's port ------------------------------


def test_the_service_and_ingress_reach_the_broker() -> None:
    deployment = named("Deployment", FULLNAME)
    service = named("Service", FULLNAME)
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
    deployment = named("Deployment", FULLNAME)
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert {k: v for k, v in annotations.items() if k.startswith("prometheus.io/")} == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(broker_container()["ports"][0]["containerPort"]),
        "prometheus.io/path": "/metrics",
    }
    assert "/metrics" in openapi.build_spec()["paths"]


# -- the rendered file agrees with the templates -------------------------------------------


def test_the_rendered_file_has_what_the_templates_produce() -> None:
    # sqlite only; the ServiceMonitor toggle is off; cert-manager's Certificate (tls) is off;
    # so are the dashboards' ConfigMaps and the PrometheusRule
    skipped = {
        "pvc.yaml",
        "servicemonitor.yaml",
        "certificate.yaml",
        "dashboards.yaml",
        "prometheusrule.yaml",
    }
    kinds: set[str] = set()
    for template in (CHART / "templates").glob("*.yaml"):
        if template.name not in skipped:
            kinds.update(re.findall(r"^kind: (\w+)$", template.read_text(), flags=re.M))
    assert {obj["kind"] for obj in BROKER} == kinds
    assert {obj["metadata"]["name"] for obj in BROKER} == {FULLNAME, ETCD_NAME}
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
    assert 'claimName: {{ include "broker.dataClaim" . }}' in deployment


# -- the chart's etcd ----------------------------------------------------------------------


def release_version(tag: str) -> tuple[int, ...]:
    """3.5.17 from v3.5.17 (quay.io/coreos/etcd) or 3.5.17-0 (registry.k8s.io/etcd)."""
    match = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)(-\d+)?", tag)
    assert match, f"not an etcd release tag: {tag!r}"
    return tuple(int(part) for part in match.groups()[:3])


def test_the_etcd_image_has_neither_the_3_5_0_to_3_5_2_bug_nor_old_probes() -> None:
    """3.5.0-3.5.2 can lose acknowledged writes when a member is killed (etcd-io/etcd#13766);
    /livez and /readyz, which the probes read, arrived in 3.5.12."""
    for image in (DEFAULTS["etcd"]["image"], EXAMPLE["etcd"]["image"]):
        assert release_version(image["tag"]) >= (3, 5, 12)
    [statefulset] = of_kind("StatefulSet")
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    repository, tag = container["image"].rsplit(":", 1)
    assert (repository, tag) == (DEFAULTS["etcd"]["image"]["repository"], "v3.5.17")


def test_etcd_and_the_brokers_agree_on_the_request_size_limit() -> None:
    [statefulset] = of_kind("StatefulSet")
    [etcd] = statefulset["spec"]["template"]["spec"]["containers"]
    etcd_limit = int(flag_values(etcd["args"])["--max-request-bytes"])
    assert parse_broker_args(broker_container()["args"]).max_request_bytes == etcd_limit
    assert etcd_limit == DEFAULTS["store"]["etcd"]["maxRequestBytes"] == 1536 * 1024
