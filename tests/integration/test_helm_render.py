"""The charts rendered by Helm's own template engine, and what comes out.

No Helm binary can be installed here, but Helm's engine is Go's text/template with the sprig
functions, and Debian packages both. deploy/render adds Helm's own functions and objects and
prints what `helm template` prints. These tests build it, render both charts with their example
values and with variants (SQLite, an etcd of your own, TLS to etcd, an etcd user, several
broker URLs, the agent's DRA mode),
validate every object against the Kubernetes schemas, follow the HA wiring from the brokers to
etcd's members, and check that deploy/manifests/ is exactly the renderer's output, so a template
change without `deploy/render/regenerate.sh` fails here.
"""

from __future__ import annotations

import difflib
import json
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from broker.http import openapi
from broker.state import opening
from gpufed import cli, daemons
from member_agent.cluster.kubernetes import backend as k8s
from member_agent.cluster.kubernetes import devices, health
from tests import helmrender, kubeauthz
from tests.integration.test_deploy_broker import flag_values, parse_broker_args
from tests.integration.test_deploy_manifests import KUBERNETES_VERSIONS, rules_of

if helmrender.MISSING:
    pytest.skip(helmrender.MISSING, allow_module_level=True)

ROOT = helmrender.ROOT
CHARTS = helmrender.CHARTS
RELEASE, NAMESPACE = helmrender.RELEASE, helmrender.NAMESPACE
BROKER, ETCD = "gpufed-broker", "gpufed-broker-etcd"
ETCD_DOMAIN = f"{ETCD}.{NAMESPACE}.svc.cluster.local"


@dataclass(frozen=True)
class Rendered:
    text: str
    values: dict[str, Any]

    @property
    def objects(self) -> list[dict[str, Any]]:
        return [doc for doc in yaml.safe_load_all(self.text) if doc]

    def kinds(self) -> list[str]:
        return [obj["kind"] for obj in self.objects]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        [obj] = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        return obj


Render = Callable[..., Rendered]


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return helmrender.build_renderer(tmp_path_factory.mktemp("render"))


run_renderer = helmrender.run_renderer


@pytest.fixture(scope="module")
def render(renderer: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Render]:
    """render(chart, override) -> the chart for its ci/example-values.yaml plus `override`,
    after checking the merged values against values.schema.json as Helm does first."""
    work = tmp_path_factory.mktemp("values")
    cache: dict[str, Rendered] = {}

    def _render(chart: str, override: dict[str, Any] | None = None) -> Rendered:
        key = json.dumps([chart, override], sort_keys=True)
        if key not in cache:
            directory = CHARTS / chart
            example = directory / "ci" / "example-values.yaml"
            values = helmrender.chart_values(chart, override)
            overrides = work / f"override-{len(cache)}.yaml"
            overrides.write_text(yaml.safe_dump(override or {}))
            done = run_renderer(renderer, directory, [example, overrides])
            assert done.returncode == 0, done.stderr
            cache[key] = Rendered(done.stdout, values)
        return cache[key]

    yield _render


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


BROKER_VARIANTS = {
    "three brokers on the chart's etcd": None,
    "one broker on SQLite": {"replicas": 1, "store": {"type": "sqlite"}},
    "an etcd of your own": {
        "store": {"etcd": {"endpoints": ["etcd-a.storage.svc:2379", "etcd-b.storage.svc"]}}
    },
    "TLS to the chart's etcd": {
        "store": {"etcd": {"tls": {"enabled": True, "existingSecret": "gpufed-etcd-client"}}},
        "etcd": {"tls": {"existingSecret": "gpufed-etcd-peer"}},
    },
    "TLS to an etcd of your own": {
        "store": {
            "etcd": {
                "endpoints": ["etcd.storage.svc:2379"],
                "tls": {"enabled": True, "existingSecret": "gpufed-etcd-client", "caKey": "ca"},
            }
        }
    },
    "TLS and a user to an etcd of your own": {
        "store": {
            "etcd": {
                "endpoints": ["etcd.storage.svc:2379"],
                "tls": {"enabled": True, "existingSecret": "gpufed-etcd-client"},
                "auth": {"user": "gpufed-broker", "existingSecret": "gpufed-etcd-user"},
            }
        }
    },
    "API sources named, etcd clients added": {
        "networkPolicy": {
            "api": {
                "ingressNamespaceSelector": {"kubernetes.io/metadata.name": "ingress-nginx"},
                "cidrs": ["203.0.113.0/24", "2001:db8::/32"],
                "from": [{"podSelector": {"matchLabels": {"app": "console-proxy"}}}],
            },
            "monitoringNamespace": "monitoring",
            "etcd": {"clientsFrom": [{"podSelector": {"matchLabels": {"app": "etcd-backup"}}}]},
        }
    },
    "Grafana dashboards as ConfigMaps": {
        "grafana": {"dashboards": {"enabled": True, "annotations": {"grafana_folder": "gpufed"}}}
    },
    "five of each, spread over zones": {
        "replicas": 5,
        "podAntiAffinity": {"type": "required", "topologyKey": "topology.kubernetes.io/zone"},
        "etcd": {"replicas": 5, "podAntiAffinity": {"topologyKey": "topology.kubernetes.io/zone"}},
    },
}
AGENT_VARIANTS: dict[str, Any] = {
    "one broker URL": None,
    "every broker replica's URL": {
        "broker": {"url": "", "urls": [f"https://b{i}.gpufed.example.com" for i in range(3)]}
    },
    "a token Secret from the chart": {
        "broker": {"token": {"existingSecret": "", "create": True, "value": "s3cret"}}
    },
    "cluster labels": {"clusterLabels": {"region": "eu-west", "example.com/tier": "spot"}},
    "GPUs through DRA": {
        "devices": {
            "mode": "dra",
            "dra": {
                "deviceClass": "gpu.example.com",
                "attributes": {"product": "productName", "index": "gpu.nvidia.com/minor"},
            },
        }
    },
    "GPU utilisation from DCGM": {
        "dcgm": {
            "urls": [
                "http://10.0.3.7:9400/metrics",
                'http://prometheus.monitoring:9090/federate?match[]={__name__=~"DCGM_FI_DEV_.*"}',
            ],
            "interval": "30s",
        }
    },
    "metrics from another namespace and a CIDR, traces out": {
        "networkPolicy": {
            "monitoringNamespace": "observability",
            "metricsFrom": [{"ipBlock": {"cidr": "10.8.0.0/16"}}],
        },
        "otel": {
            "endpoint": "http://otel-collector.observability:4317",
            "protocol": "grpc",
            "sampler": "always_on",
        },
        "extraEnv": [{"name": "OTEL_EXPORTER_OTLP_HEADERS", "value": "x-scope-orgid=gpu"}],
    },
    "GPU health and auto-cordon": {
        "gpuHealth": {
            "taints": ["example.com/gpu-xid"],
            "labels": ["example.com/gpu-bad"],
            "conditions": ["XidError"],
            "autoCordon": True,
            "cordonAfter": 3,
            "cordonWindow": "30m",
        }
    },
}
VARIANTS = [
    pytest.param("broker", override, id=f"broker: {name}")
    for name, override in BROKER_VARIANTS.items()
] + [
    pytest.param("member-agent", override, id=f"member-agent: {name}")
    for name, override in AGENT_VARIANTS.items()
]


# -- what the renderer prints is what is committed, and it is valid -----------------------


@pytest.mark.parametrize("chart", ["broker", "member-agent"])
def test_the_committed_manifests_are_the_renderers_output(render: Render, chart: str) -> None:
    committed = (ROOT / "deploy" / "manifests" / f"{chart}.yaml").read_text()
    body = committed[committed.index("---\n") :]  # after the file's opening comment block
    rendered = render(chart).text
    drift = "".join(
        difflib.unified_diff(
            body.splitlines(keepends=True), rendered.splitlines(keepends=True), "committed", "chart"
        )
    )
    assert body == rendered, f"run deploy/render/regenerate.sh:\n{drift[:4000]}"


@pytest.mark.parametrize(("chart", "override"), VARIANTS)
def test_every_rendered_object_is_valid_kubernetes(
    render: Render, chart: str, override: dict[str, Any] | None
) -> None:
    objects = render(chart, override).objects
    assert objects
    for obj in objects:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
        if obj["kind"] not in {"ClusterRole", "ClusterRoleBinding"}:
            assert obj["metadata"]["namespace"]


@pytest.mark.parametrize("chart", ["broker", "member-agent"])
def test_either_chart_takes_the_global_values_of_an_umbrella_chart(
    render: Render, chart: str
) -> None:
    """As a dependency, a chart gets the parent's `global` values merged into its own, and
    Helm checks them against its values.schema.json like any other key."""
    umbrella = {"global": {"imageRegistry": "registry.example.com", "storageClass": "fast"}}
    assert render(chart, umbrella).text == render(chart).text


@pytest.mark.parametrize(
    ("chart", "override"),
    [
        pytest.param("broker", None, id="broker"),
        pytest.param("broker", {"metrics": {"podAnnotations": False}}, id="broker, no scrape"),
        pytest.param("member-agent", None, id="member-agent"),
    ],
)
def test_the_cluster_autoscaler_may_move_gpufeds_own_pods(
    render: Render, chart: str, override: dict[str, Any] | None
) -> None:
    """The cluster autoscaler keeps a node whose pods have local storage unless each such
    volume is named safe to lose: the brokers' and the agent's only one is /tmp, scratch."""
    pod = render(chart, override).one("Deployment", f"gpufed-{chart}")["spec"]["template"]
    scratch = {v["name"] for v in pod["spec"]["volumes"] if "emptyDir" in v}
    named = pod["metadata"]["annotations"][
        "cluster-autoscaler.kubernetes.io/safe-to-evict-local-volumes"
    ]
    assert set(named.split(",")) == scratch == {"tmp"}


@pytest.mark.parametrize("chart", ["broker", "member-agent"])
def test_the_notes_render(renderer: Path, chart: str) -> None:
    directory = CHARTS / chart
    done = run_renderer(renderer, directory, [directory / "ci/example-values.yaml"], "--notes")
    assert done.returncode == 0, done.stderr
    assert f"deployment/gpufed-{chart}" in done.stdout
    assert "<no value>" not in done.stdout


# -- three brokers, spread, with a disruption budget ---------------------------------------


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return bool(selector["matchLabels"].items() <= labels.items())


def anti_affinity_terms(workload: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    rules = workload["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    terms = rules[f"{kind}DuringSchedulingIgnoredDuringExecution"]
    return [term.get("podAffinityTerm", term) for term in terms]


def test_three_brokers_are_spread_over_nodes_and_drained_one_at_a_time(render: Render) -> None:
    rendered = render("broker")
    deployment = rendered.one("Deployment", BROKER)
    statefulset = rendered.one("StatefulSet", ETCD)
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    budget = rendered.one("PodDisruptionBudget", BROKER)["spec"]
    assert budget["selector"] == deployment["spec"]["selector"]
    assert budget["maxUnavailable"] == 1  # two of three keep serving through a drain
    assert not selects(budget["selector"], pod_labels(statefulset))

    [term] = anti_affinity_terms(deployment, "preferred")
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"], pod_labels(deployment))
    assert not selects(term["labelSelector"], pod_labels(statefulset))


def test_the_anti_affinity_topology_and_strength_are_values(render: Render) -> None:
    rendered = render("broker", BROKER_VARIANTS["five of each, spread over zones"])
    deployment = rendered.one("Deployment", BROKER)
    [term] = anti_affinity_terms(deployment, "required")
    assert term["topologyKey"] == "topology.kubernetes.io/zone"
    [etcd_term] = anti_affinity_terms(rendered.one("StatefulSet", ETCD), "preferred")
    assert etcd_term["topologyKey"] == "topology.kubernetes.io/zone"
    assert deployment["spec"]["replicas"] == 5
    flags = flag_values(etcd_container(rendered)["args"])
    assert len(flags["--initial-cluster"].split(",")) == 5


# -- the chart's etcd and how the brokers reach it -----------------------------------------


def etcd_container(rendered: Rendered) -> dict[str, Any]:
    [container] = rendered.one("StatefulSet", ETCD)["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def broker_container(rendered: Rendered) -> dict[str, Any]:
    [container] = rendered.one("Deployment", BROKER)["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def downward_env(container: dict[str, Any]) -> dict[str, str]:
    return {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
        if "fieldRef" in e.get("valueFrom", {})
    }


def for_pod(arg: str, pod: str) -> str:
    """An arg as Kubernetes expands it in one pod ($(POD_NAME) is the pod's name)."""
    return arg.replace("$(POD_NAME)", pod)


@pytest.mark.parametrize(
    ("override", "scheme"),
    [
        pytest.param(None, "http", id="plain"),
        pytest.param(BROKER_VARIANTS["TLS to the chart's etcd"], "https", id="TLS"),
    ],
)
def test_the_etcd_members_find_each_other_by_the_statefulsets_pod_names(
    render: Render, override: dict[str, Any] | None, scheme: str
) -> None:
    rendered = render("broker", override)
    statefulset = rendered.one("StatefulSet", ETCD)
    service = rendered.one("Service", ETCD)
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    assert service["spec"]["publishNotReadyAddresses"] is True  # peers resolve before ready
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(statefulset))
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"

    container = etcd_container(rendered)
    assert downward_env(container)["POD_NAME"] == "metadata.name"
    flags = flag_values(container["args"])
    pods = [f"{ETCD}-{i}" for i in range(statefulset["spec"]["replicas"])]
    assert len(pods) == 3
    members = dict(member.split("=", 1) for member in flags["--initial-cluster"].split(","))
    assert members == {pod: f"{scheme}://{pod}.{ETCD_DOMAIN}:2380" for pod in pods}
    for pod in pods:
        assert for_pod(flags["--name"], pod) == pod
        assert for_pod(flags["--initial-advertise-peer-urls"], pod) == members[pod]
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert (ports["client"], ports["peer"]) == (2379, 2380)

    # the brokers' --store is every member's client URL, under the same Service
    advertised = {for_pod(flags["--advertise-client-urls"], pod) for pod in pods}
    store = parse_broker_args(broker_container(rendered)["args"]).store
    assert {f"{scheme}://{host}:{port}" for host, port in opening.parse_etcd_endpoints(store)} == (
        advertised
    )
    budget = rendered.one("PodDisruptionBudget", ETCD)["spec"]
    assert budget["maxUnavailable"] == 1 and selects(budget["selector"], pod_labels(statefulset))


def test_etcd_keeps_its_data_and_is_probed_without_quorum(render: Render) -> None:
    rendered = render("broker")
    statefulset = rendered.one("StatefulSet", ETCD)
    container = etcd_container(rendered)
    flags = flag_values(container["args"])
    [claim] = statefulset["spec"]["volumeClaimTemplates"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert posixpath.dirname(flags["--data-dir"]) == mount["mountPath"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    assert flags["--listen-metrics-urls"] == "http://0.0.0.0:2381"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == 2381
    probes = {"startupProbe": "/livez", "livenessProbe": "/livez", "readinessProbe": "/readyz"}
    for probe, path in probes.items():
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}


def test_each_broker_advertises_its_own_pod(render: Render) -> None:
    container = broker_container(render("broker"))
    assert downward_env(container)["POD_IP"] == "status.podIP"
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert flag_values(container["args"])["--advertise-url"] == f"http://$(POD_IP):{port}"
    assert flag_values(container["args"])["--leader-lease-seconds"] == "5"
    served = openapi.build_spec()["paths"]
    for probe, path in {"startupProbe": "/healthz", "readinessProbe": "/readyz"}.items():
        assert container[probe]["httpGet"]["path"] == path
        assert path in served


# -- SQLite, an etcd of your own, TLS ------------------------------------------------------


def test_sqlite_is_one_broker_on_a_volume_and_nothing_of_etcd(render: Render) -> None:
    rendered = render("broker", BROKER_VARIANTS["one broker on SQLite"])
    assert "StatefulSet" not in rendered.kinds()
    assert "PodDisruptionBudget" not in rendered.kinds()  # a budget of one would block drains
    deployment = rendered.one("Deployment", BROKER)
    assert (deployment["spec"]["replicas"], deployment["spec"]["strategy"]) == (
        1,
        {"type": "Recreate"},
    )
    container = broker_container(rendered)
    path = opening.parse_sqlite_path(parse_broker_args(container["args"]).store)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert posixpath.dirname(path) == mounts["data"]
    claim = rendered.one("PersistentVolumeClaim", f"{BROKER}-data")
    [volume] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "data"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_the_glibc_allocator_preloads_nothing(render: Render) -> None:
    env = {
        e["name"]: e.get("value")
        for e in broker_container(render("broker", {"allocator": "glibc"}))["env"]
    }
    assert env["PYTHONMALLOC"] == "malloc"
    assert not {"LD_PRELOAD", "MALLOC_CONF"} & env.keys()
    with pytest.raises(jsonschema.ValidationError, match="'tcmalloc' is not one of"):
        render("broker", {"allocator": "tcmalloc"})


def test_the_schema_keeps_sqlite_to_one_broker(render: Render) -> None:
    with pytest.raises(jsonschema.ValidationError, match="3 is greater than the maximum of 1"):
        render("broker", {"store": {"type": "sqlite"}})


def test_an_etcd_of_your_own_replaces_the_charts(render: Render) -> None:
    rendered = render("broker", BROKER_VARIANTS["an etcd of your own"])
    assert "StatefulSet" not in rendered.kinds()
    for kind in ("Service", "PodDisruptionBudget"):
        names = [obj["metadata"]["name"] for obj in rendered.objects if obj["kind"] == kind]
        assert names == [BROKER], kind
    store = parse_broker_args(broker_container(rendered)["args"]).store
    assert opening.parse_etcd_endpoints(store) == [
        ("etcd-a.storage.svc", 2379),
        ("etcd-b.storage.svc", 2379),
    ]


@pytest.mark.parametrize(
    "variant", ["TLS to the chart's etcd", "TLS to an etcd of your own"], ids=str
)
def test_the_brokers_client_certificate_is_mounted_where_the_flags_point(
    render: Render, variant: str
) -> None:
    """--etcd-ca, --etcd-cert and --etcd-key, as the broker parses them, name the Secret's
    files."""
    rendered = render("broker", BROKER_VARIANTS[variant])
    tls = rendered.values["store"]["etcd"]["tls"]
    container = broker_container(rendered)
    args = parse_broker_args(container["args"])
    flags = {"--etcd-ca": args.etcd_ca, "--etcd-cert": args.etcd_cert, "--etcd-key": args.etcd_key}
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "etcd-tls"]
    assert mount["readOnly"] is True
    [volume] = [
        v
        for v in rendered.one("Deployment", BROKER)["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "etcd-tls"
    ]
    assert volume["secret"]["secretName"] == tls["existingSecret"]
    files = {item["path"]: item["key"] for item in volume["secret"]["items"]}
    for flag, key in (("--etcd-ca", "caKey"), ("--etcd-cert", "certKey"), ("--etcd-key", "keyKey")):
        directory, filename = posixpath.split(flags[flag])
        assert directory == mount["mountPath"]
        assert files[filename] == tls[key]


def test_an_etcd_users_password_is_a_file_from_its_secret(render: Render) -> None:
    rendered = render("broker", BROKER_VARIANTS["TLS and a user to an etcd of your own"])
    auth = rendered.values["store"]["etcd"]["auth"]
    container = broker_container(rendered)
    args = parse_broker_args(container["args"])
    assert args.etcd_user == auth["user"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "etcd-auth"]
    assert mount["readOnly"] is True
    directory, filename = posixpath.split(args.etcd_password_file)
    assert directory == mount["mountPath"]
    [volume] = [
        v
        for v in rendered.one("Deployment", BROKER)["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "etcd-auth"
    ]
    assert volume["secret"]["secretName"] == auth["existingSecret"]
    assert volume["secret"]["items"] == [{"key": auth["passwordKey"], "path": filename}]
    # the password itself is never an argument nor in the environment
    assert not any("password" in e["name"].lower() for e in container.get("env", []))
    assert args.etcd_ca and args.etcd_cert  # and TLS is on alongside


def test_no_etcd_user_no_password_volume(render: Render) -> None:
    container = broker_container(render("broker", BROKER_VARIANTS["TLS to an etcd of your own"]))
    args = parse_broker_args(container["args"])
    assert (args.etcd_user, args.etcd_password_file) == (None, None)
    assert "etcd-auth" not in {m["name"] for m in container["volumeMounts"]}


def test_the_charts_etcd_serves_tls_with_its_own_certificate(render: Render) -> None:
    rendered = render("broker", BROKER_VARIANTS["TLS to the chart's etcd"])
    container = etcd_container(rendered)
    flags = flag_values(container["args"])
    assert flags["--client-cert-auth"] == flags["--peer-client-cert-auth"] == "true"
    assert flags["--listen-client-urls"].startswith("https://")
    assert flags["--listen-metrics-urls"].startswith("http://")  # the probes stay plain
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    for flag in ("--trusted-ca-file", "--cert-file", "--key-file", "--peer-cert-file"):
        assert posixpath.dirname(flags[flag]) == mounts["tls"]
    [volume] = [
        v
        for v in rendered.one("StatefulSet", ETCD)["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "tls"
    ]
    assert volume["secret"]["secretName"] == "gpufed-etcd-peer"


# -- the member agent ----------------------------------------------------------------------


def test_the_agent_gets_every_broker_replicas_url(render: Render) -> None:
    override = AGENT_VARIANTS["every broker replica's URL"]
    rendered = render("member-agent", override)
    [container] = rendered.one("Deployment", "gpufed-member-agent")["spec"]["template"]["spec"][
        "containers"
    ]
    args = cli.build_parser().parse_args(["agent", "--backend", "kubernetes", *container["args"]])
    assert args.broker == ",".join(override["broker"]["urls"])


def test_the_agent_reports_the_cluster_labels_of_its_values(render: Render) -> None:
    override = AGENT_VARIANTS["cluster labels"]
    settings = agent_settings(render("member-agent", override))
    assert settings.cluster_labels == override["clusterLabels"]
    # the example's own (ci/example-values.yaml)
    assert agent_settings(render("member-agent", {})).cluster_labels == {"region": "us-east"}


def test_the_agent_deletes_finished_pods_after_the_ttl_of_its_values(render: Render) -> None:
    assert agent_settings(render("member-agent", {})).finished_pods_ttl_seconds == 600.0
    hour = agent_settings(render("member-agent", {"finishedPodsTTL": "1h"}))
    assert hour.finished_pods_ttl_seconds == 3600.0
    kept = agent_settings(render("member-agent", {"finishedPodsTTL": "never"}))
    assert kept.finished_pods_ttl_seconds is None
    with pytest.raises(jsonschema.ValidationError, match="'soon' does not match"):
        render("member-agent", {"finishedPodsTTL": "soon"})


def test_the_agent_preloads_jemalloc_as_the_broker_does(render: Render) -> None:
    def env_of(values: dict[str, Any]) -> dict[str, Any]:
        spec = render("member-agent", values).one("Deployment", AGENT)["spec"]["template"]["spec"]
        [container] = spec["containers"]
        return {e["name"]: e.get("value") for e in container["env"]}

    broker_env = {e["name"]: e.get("value") for e in broker_container(render("broker", {}))["env"]}
    agent_env = env_of({})  # the default: jemalloc
    for name in ("PYTHONMALLOC", "LD_PRELOAD", "MALLOC_CONF"):
        assert agent_env[name] == broker_env[name], name
    assert not {"PYTHONMALLOC", "LD_PRELOAD", "MALLOC_CONF"} & env_of({"allocator": "glibc"}).keys()
    with pytest.raises(jsonschema.ValidationError, match="'tcmalloc' is not one of"):
        render("member-agent", {"allocator": "tcmalloc"})


AGENT = "gpufed-member-agent"
RESOURCE = "resource.k8s.io"
EVENTS = "events.k8s.io"
# the agent's own rules in device-plugin mode, cluster-wide and in each of its namespaces
AGENT_CLUSTER_RULES = {("", r, v) for r in ("nodes", "pods") for v in ("get", "list", "watch")}
AGENT_NAMESPACE_RULES = {("", "pods", v) for v in ("create", "delete", "patch")} | {
    ("", "resourcequotas", v) for v in ("get", "list", "watch")
}


def agent_settings(rendered: Rendered) -> Any:
    """The AgentSettings the rendered container's args make, as `gpufed agent` builds them."""
    [container] = rendered.one("Deployment", AGENT)["spec"]["template"]["spec"]["containers"]
    args = cli.build_parser().parse_args(["agent", "--backend", "kubernetes", *container["args"]])
    return daemons.agent_settings(args)


def agent_roles(rendered: Rendered) -> dict[str, set[tuple[str, str, str]]]:
    return {
        role["metadata"]["namespace"]: rules_of(role)
        for role in rendered.objects
        if role["kind"] == "Role"
    }


def test_dra_mode_grants_the_claims_rbac_and_passes_the_dra_flags(render: Render) -> None:
    rendered = render("member-agent", AGENT_VARIANTS["GPUs through DRA"])
    # cluster-wide: the slices (the GPUs) and every namespace's claims, read only
    assert rules_of(rendered.one("ClusterRole", AGENT)) == AGENT_CLUSTER_RULES | {
        (RESOURCE, r, v)
        for r in ("resourceslices", "resourceclaims")
        for v in ("get", "list", "watch")
    }
    # in each namespace pods go to: what cluster.kubernetes.claiming calls, nothing more
    roles = agent_roles(rendered)
    assert sorted(roles) == sorted(rendered.values["namespaces"])
    for rules in roles.values():
        assert rules == AGENT_NAMESPACE_RULES | {
            (RESOURCE, "resourceclaims", v) for v in ("create", "get", "patch", "delete")
        } | {(RESOURCE, "resourceclaims/status", "patch")}

    settings = agent_settings(rendered)
    assert settings.devices == "dra"
    assert devices.DeviceKeys.from_mapping(settings.device_keys()) == devices.DeviceKeys(
        driver="gpu.nvidia.com", device_class="gpu.example.com", index="gpu.nvidia.com/minor"
    )
    assert settings.shared_gpu_resource is None  # a device-plugin flag


def test_device_plugin_mode_renders_no_dra_rules_nor_flags(render: Render) -> None:
    rendered = render("member-agent")
    assert rendered.values["devices"]["mode"] == "device-plugin"
    assert rules_of(rendered.one("ClusterRole", AGENT)) == AGENT_CLUSTER_RULES
    roles = agent_roles(rendered)
    assert sorted(roles) == sorted(rendered.values["namespaces"])
    assert all(rules == AGENT_NAMESPACE_RULES for rules in roles.values())
    assert RESOURCE not in rendered.text
    [container] = rendered.one("Deployment", AGENT)["spec"]["template"]["spec"]["containers"]
    assert not [arg for arg in container["args"] if arg.startswith("--dra-")]
    settings = agent_settings(rendered)
    assert settings.devices == "device-plugin"
    assert settings.shared_gpu_resource == "nvidia.com/gpu.shared"


def test_the_dcgm_urls_and_interval_are_values(render: Render) -> None:
    override = AGENT_VARIANTS["GPU utilisation from DCGM"]
    settings = agent_settings(render("member-agent", override))
    assert settings.dcgm_urls == override["dcgm"]["urls"]
    assert settings.dcgm_interval_seconds == 30.0
    assert agent_settings(render("member-agent")).dcgm_urls == []  # none by default


def test_gpu_health_keys_and_auto_cordon_are_values(render: Render) -> None:
    rendered = render("member-agent", AGENT_VARIANTS["GPU health and auto-cordon"])
    settings = agent_settings(rendered)
    assert (settings.auto_cordon, settings.cordon_after) == (True, 3)
    assert settings.health_settings().cordon_window == 1800.0
    assert settings.health_keys() == health.HealthKeys(
        taints=("example.com/gpu-xid",), labels=("example.com/gpu-bad",), conditions=("XidError",)
    )
    # cordoning patches nodes and records Events on them: those verbs more, cluster-wide
    rules = rules_of(rendered.one("ClusterRole", AGENT))
    assert rules == AGENT_CLUSTER_RULES | {("", "nodes", "patch"), (EVENTS, "events", "create")}
    default = agent_settings(render("member-agent"))
    assert not default.auto_cordon and default.health_keys() == health.HealthKeys()
    assert default.health_settings().cordon_window == 3600.0
    assert rules_of(render("member-agent").one("ClusterRole", AGENT)) == AGENT_CLUSTER_RULES


def test_the_default_namespaces_are_refused_not_an_agent_that_refuses_every_job(
    render: Render, renderer: Path, tmp_path: Path
) -> None:
    # `namespaces: []` would render no Role and GPUFED_NAMESPACES="" (no namespace at all)
    with pytest.raises(jsonschema.ValidationError, match="should be non-empty"):
        render("member-agent", {"namespaces": []})
    # and the templates, which Helm renders even where no schema is checked, fail too
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"namespaces": []}))
    chart = CHARTS / "member-agent"
    done = run_renderer(renderer, chart, [chart / "ci" / "example-values.yaml", values])
    assert done.returncode != 0
    assert "list the namespaces the agent may create pods in, or set allNamespaces" in done.stderr
    with pytest.raises(jsonschema.ValidationError, match="is expected to be empty"):
        render("member-agent", {"allNamespaces": True})  # and the example's namespaces


@pytest.mark.parametrize("mode", ["device-plugin", "dra"])
def test_all_namespaces_mode_grants_in_every_namespace_what_a_role_grants_in_one(
    render: Render, renderer: Path, tmp_path: Path, mode: str
) -> None:
    override = {"allNamespaces": True, "namespaces": [], "devices": {"mode": mode}}
    rendered = render("member-agent", override)
    listed = render("member-agent", {"devices": {"mode": mode}})
    assert "Role" not in rendered.kinds() and "RoleBinding" not in rendered.kinds()
    [role, *_] = agent_roles(listed).values()
    cluster_rules = rules_of(rendered.one("ClusterRole", AGENT))
    assert cluster_rules == rules_of(listed.one("ClusterRole", AGENT)) | role
    # GPUFED_NAMESPACES unset: the backend takes any namespace
    [container] = rendered.one("Deployment", AGENT)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert k8s.NAMESPACES_ENV not in env
    assert k8s.namespaces_from_env(env) is None
    # and the ServiceAccount may create, patch and delete pods anywhere
    account = kubeauthz.chart_authorizer(override)
    for verb in ("create", "patch", "delete"):
        assert account.allows("", "pods", verb, "any-namespace", "p")
    assert not account.allows("", "pods/exec", "create", "any-namespace", "p")
    assert not account.allows("", "secrets", "get", "any-namespace", "s")
    # the notes say so, not an empty list
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(override))
    chart = CHARTS / "member-agent"
    done = run_renderer(renderer, chart, [chart / "ci" / "example-values.yaml", values], "--notes")
    assert done.returncode == 0, done.stderr
    assert "It may create pods in every namespace" in done.stdout


def test_the_notes_name_the_namespaces_and_the_dra_versions(renderer: Path, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"devices": {"mode": "dra"}}))
    chart = CHARTS / "member-agent"
    done = run_renderer(renderer, chart, [chart / "ci" / "example-values.yaml", values], "--notes")
    assert done.returncode == 0, done.stderr
    assert "It may create pods in: team-a, team-b (and refuses jobs for any other)" in done.stdout
    assert "Kubernetes 1.34 or later, or 1.33 with" in done.stdout
    assert "DynamicResourceAllocation feature gate" in done.stdout


def test_the_shared_gpu_resource_is_a_value(render: Render) -> None:
    rendered = render("member-agent", {"devices": {"sharedGpuResource": "nvidia.com/gpu.mps"}})
    assert agent_settings(rendered).shared_gpu_resource == "nvidia.com/gpu.mps"


@pytest.mark.parametrize(
    ("devices_values", "complaint"),
    [
        pytest.param({"mode": "mig"}, "'mig' is not one of", id="an unknown mode"),
        pytest.param(
            {"mode": "dra", "dra": {"attributes": {"serial": "serialNumber"}}},
            "'serial' is not one of",
            id="an attribute the agent does not read",
        ),
        pytest.param(
            {"mode": "dra", "dra": {"driver": "GPU.nvidia.com"}},
            "does not match",
            id="a driver that is not a DNS subdomain",
        ),
    ],
)
def test_the_schema_refuses_bad_devices_values(
    render: Render, devices_values: dict[str, Any], complaint: str
) -> None:
    with pytest.raises(jsonschema.ValidationError, match=complaint):
        render("member-agent", {"devices": devices_values})


# -- the renderer keeps Helm's rules -------------------------------------------------------


@pytest.mark.parametrize(
    ("chart", "override", "message"),
    [
        pytest.param(
            "broker",
            {"tokens": {"existingSecret": ""}},
            "tokens.existingSecret is required",
            id="broker without its tokens Secret",
        ),
        pytest.param(
            "broker",
            {"store": {"etcd": {"tls": {"enabled": True, "existingSecret": "client"}}}},
            "etcd.tls.existingSecret (the members' certificate) is required",
            id="the chart's etcd on TLS without its certificate",
        ),
        pytest.param(
            "broker",
            {"store": {"etcd": {"auth": {"user": "gpufed-broker"}}}},
            "store.etcd.auth.existingSecret (the etcd user's password) is required",
            id="an etcd user without its password's Secret",
        ),
        pytest.param(
            "member-agent",
            {"broker": {"url": ""}},
            "broker.url (or broker.urls) is required",
            id="agent without a broker",
        ),
    ],
)
def test_a_missing_required_value_fails_the_render_with_the_charts_message(
    renderer: Path, tmp_path: Path, chart: str, override: dict[str, Any], message: str
) -> None:
    directory = CHARTS / chart
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(override))
    done = run_renderer(renderer, directory, [directory / "ci/example-values.yaml", values])
    assert done.returncode == 1
    assert done.stdout == ""
    assert f"Error: execution error at ({chart}/templates/" in done.stderr
    assert message in done.stderr


def test_the_chart_refuses_a_kubernetes_older_than_its_kube_version(renderer: Path) -> None:
    directory = CHARTS / "broker"
    done = run_renderer(
        renderer, directory, [directory / "ci/example-values.yaml"], "--kube-version", "1.26.3"
    )
    assert done.returncode == 1
    assert "chart requires kubeVersion: >=1.27.0-0 which is incompatible with Kubernetes" in (
        done.stderr
    )


SCRATCH_TEMPLATES = {
    "_helpers.tpl": '{{- define "scratch.name" -}}{{ .Release.Name }}-{{ .Chart.Name }}{{- end -}}',
    "NOTES.txt": "notes are not manifests",
    "b-deployment.yaml": """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "scratch.name" . }}
""",
    "a-config.yaml": """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "scratch.name" . }}
data:
  big: {{ .Values.big | quote }}
  bigInt: {{ .Values.big | int64 | quote }}
  tpl: {{ tpl .Values.greeting . | quote }}
  lookup: {{ lookup "v1" "Secret" "default" "x" | toJson | quote }}
  minor: {{ .Capabilities.KubeVersion.Minor | quote }}
  policy: {{ .Capabilities.APIVersions.Has "policy/v1" | quote }}
  dropped: {{ toJson .Values.nested | quote }}
  missing: "{{ .Values.notThere }}"
  labels: |
    {{- dict "zeta" 1 "alpha" "two" | toYaml | nindent 4 }}
""",
    "z-account.yaml": """\
# a comment before the condition: Helm keeps it as a document of its own
{{- if .Values.account }}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ include "scratch.name" . }}
{{- end }}
""",
}


def test_the_renderer_keeps_helms_semantics(renderer: Path, tmp_path: Path) -> None:
    """What a chart author relies on: defines shared across files, tpl, Helm's float64 numbers,
    an empty lookup, capabilities, nulls deleting defaults, NOTES and partials not emitted,
    documents in install order, and the stray comment-only document Helm 3 prints."""
    chart = tmp_path / "scratch"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: scratch\nversion: 1.2.3\n")
    (chart / "values.yaml").write_text(
        "big: 1572864\ngreeting: 'hello {{ .Release.Name }}'\naccount: false\n"
        "nested: {keep: 1, drop: 2}\n"
    )
    for name, text in SCRATCH_TEMPLATES.items():
        (chart / "templates" / name).write_text(text)
    values = tmp_path / "override.yaml"
    values.write_text("nested: {drop: null}\n")

    done = run_renderer(renderer, chart, [values])
    assert done.returncode == 0, done.stderr
    sources = [line for line in done.stdout.splitlines() if line.startswith("# Source: ")]
    assert sources == [
        "# Source: scratch/templates/a-config.yaml",  # ConfigMap before Deployment
        "# Source: scratch/templates/b-deployment.yaml",
        "# Source: scratch/templates/z-account.yaml",  # the comment alone, as an unknown kind
    ]
    config, deployment = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    assert deployment["metadata"]["name"] == "gpufed-scratch"
    assert config["data"] == {
        "big": "1.572864e+06",  # every number in .Values is a float64, as in Helm
        "bigInt": "1572864",
        "tpl": "hello gpufed",
        "lookup": "{}",
        "minor": "29",
        "policy": "true",
        "dropped": '{"keep":1}',
        "missing": "",
        "labels": "alpha: two\nzeta: 1\n",
    }
    assert done.stdout.endswith(
        "# Source: scratch/templates/z-account.yaml\n"
        "# a comment before the condition: Helm keeps it as a document of its own\n"
    )
