"""The member agent's install: the rendered manifests are valid Kubernetes objects, the chart's
values match their schema, and the RBAC grants exactly what the agent needs.

No Helm binary exists here, so deploy/manifests/member-agent.yaml is the chart rendered by hand
for deploy/helm/member-agent/ci/example-values.yaml; the tests below also check that the two
agree (kinds, names, the values that reach the objects).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from gpufed import cli
from member_agent.cluster.kubernetes import backend as k8s
from member_agent.cluster.kubernetes import objects
from tests.helmrender import merged

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "member-agent"
RENDERED = ROOT / "deploy" / "manifests" / "member-agent.yaml"
RELEASE_NAMESPACE = "gpufed-system"
FULLNAME = "gpufed-member-agent"
KUBERNETES_VERSIONS = ["1.29", kubernetes_validate.latest_version()]


def load_objects(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
EXAMPLE = merged(DEFAULTS, yaml.safe_load((CHART / "ci" / "example-values.yaml").read_text()))
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
MANIFESTS = sorted((ROOT / "deploy" / "manifests").glob("*.yaml"))
ALL_OBJECTS = [(path, obj) for path in MANIFESTS for obj in load_objects(path)]
AGENT = load_objects(RENDERED)


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [obj for obj in AGENT if obj["kind"] == kind]


def object_id(path: Path, obj: dict[str, Any]) -> str:
    meta = obj.get("metadata", {})
    return f"{path.name}:{obj['kind']}/{meta.get('namespace', '-')}/{meta.get('name')}"


# -- (a) valid Kubernetes objects ----------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    "obj", [pytest.param(obj, id=object_id(path, obj)) for path, obj in ALL_OBJECTS]
)
def test_every_rendered_object_is_valid_kubernetes(obj: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param({"replicas": "one"}, id="a string where an integer goes"),
        pytest.param({"strategy": {"type": "Recreate", "rollingUpdat": {}}}, id="a typo"),
    ],
)
def test_the_validator_rejects_a_broken_deployment(breakage: dict[str, Any]) -> None:
    [deployment] = of_kind("Deployment")
    broken = merged(deployment, {"spec": breakage})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


# -- (b) values against values.schema.json -------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        pytest.param(merged(DEFAULTS, {"namespaces": ["team-a"]}), id="values.yaml, a namespace"),
        pytest.param(merged(DEFAULTS, {"allNamespaces": True}), id="values.yaml, allNamespaces"),
        pytest.param(EXAMPLE, id="ci/example-values.yaml"),
        pytest.param(
            merged(
                DEFAULTS,
                {
                    "namespaces": ["team-a"],
                    "broker": {"token": {"create": True, "value": "s3cret"}},
                },
            ),
            id="token Secret created by the chart",
        ),
        pytest.param(
            merged(
                EXAMPLE,
                {"devices": {"mode": "dra", "dra": {"attributes": {"product": "productName"}}}},
            ),
            id="DRA mode",
        ),
    ],
)
def test_values_match_the_schema(values: dict[str, Any]) -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator(SCHEMA).validate(values)


@pytest.mark.parametrize(
    ("override", "complaint"),
    [
        pytest.param({"cluster": "GPU East"}, "does not match", id="cluster not a DNS label"),
        pytest.param({"namespaces": ["Team_A"]}, "does not match", id="bad namespace"),
        pytest.param({"labelKeys": {"rak": "x"}}, "rak", id="unknown label key"),
        pytest.param({"healthPort": 80}, "less than the minimum", id="privileged port"),
        pytest.param({"logLevel": "verbose"}, "is not one of", id="unknown log level"),
        pytest.param({"broker": {"url": "gpufed:8080"}}, "does not match", id="URL without scheme"),
        pytest.param(
            {"broker": {"token": {"create": True, "existingSecret": "also-this"}}},
            "was expected",
            id="both an existing and a created Secret",
        ),
        pytest.param({"replicas": 2}, "replicas", id="replicas cannot be set"),
        pytest.param({"devices": {"mode": "mig"}}, "is not one of", id="unknown devices mode"),
        pytest.param(
            {"devices": {"dra": {"attributes": {"serial": "serialNumber"}}}},
            "is not one of",
            id="unknown DRA attribute",
        ),
        pytest.param(
            {"devices": {"sharedGpuResource": "gpu-shared"}},
            "does not match",
            id="shared GPU resource without a domain",
        ),
    ],
)
def test_the_schema_rejects_bad_values(override: dict[str, Any], complaint: str) -> None:
    with pytest.raises(jsonschema.ValidationError, match=complaint):
        jsonschema.Draft7Validator(SCHEMA).validate(merged(EXAMPLE, override))


def test_default_label_keys_are_the_agents_defaults() -> None:
    assert objects.LabelKeys.from_mapping(DEFAULTS["labelKeys"]) == objects.LabelKeys()


# -- (c) RBAC: exactly what the agent needs ------------------------------------------------


def rules_of(obj: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in obj["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_cluster_role_reads_nodes_and_pods_and_nothing_more() -> None:
    [role] = of_kind("ClusterRole")
    assert rules_of(role) == {
        ("", resource, verb) for resource in ("nodes", "pods") for verb in ("get", "list", "watch")
    }


def test_each_allowed_namespace_gets_pod_create_delete_patch_and_quota_reads() -> None:
    roles = {role["metadata"]["namespace"]: role for role in of_kind("Role")}
    assert sorted(roles) == sorted(EXAMPLE["namespaces"])
    for role in roles.values():
        assert rules_of(role) == {
            ("", "pods", "create"),
            ("", "pods", "delete"),
            ("", "pods", "patch"),
            ("", "resourcequotas", "get"),
            ("", "resourcequotas", "list"),
            ("", "resourcequotas", "watch"),
        }


def test_the_bindings_grant_the_roles_to_the_agents_service_account() -> None:
    [account] = of_kind("ServiceAccount")
    [deployment] = of_kind("Deployment")
    subject = {
        "kind": "ServiceAccount",
        "name": account["metadata"]["name"],
        "namespace": RELEASE_NAMESPACE,
    }
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == subject["name"]
    bindings = of_kind("ClusterRoleBinding") + of_kind("RoleBinding")
    assert len(bindings) == 1 + len(EXAMPLE["namespaces"])
    for binding in bindings:
        assert binding["subjects"] == [subject]
        role_kind = "ClusterRole" if binding["kind"] == "ClusterRoleBinding" else "Role"
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": role_kind,
            "name": FULLNAME,
        }
        if role_kind == "Role":
            assert binding["metadata"]["namespace"] in EXAMPLE["namespaces"]


# -- the Deployment and the config it runs with --------------------------------------------


def test_the_deployment_runs_one_locked_down_agent() -> None:
    [deployment] = of_kind("Deployment")
    spec = deployment["spec"]
    assert (spec["replicas"], spec["strategy"]["type"]) == (1, "Recreate")
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    [container] = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["health"]
    assert port == EXAMPLE["healthPort"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["image"] == f"{EXAMPLE['image']['repository']}:{EXAMPLE['image']['tag']}"
    volumes = {v["name"]: v for v in pod["volumes"]}
    token = volumes["token"]["secret"]
    assert token["secretName"] == EXAMPLE["broker"]["token"]["existingSecret"]
    assert token["items"] == [{"key": EXAMPLE["broker"]["token"]["key"], "path": "token"}]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["token"] == "/var/run/secrets/gpufed"
    assert pod["securityContext"]["runAsUser"] == 10001  # the Dockerfile's user


def agent_container() -> dict[str, Any]:
    [deployment] = of_kind("Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def test_the_agent_is_started_with_flags_the_cli_accepts() -> None:
    """The image's entrypoint is `gpufed agent --backend kubernetes`; the chart adds the rest."""
    args = cli.build_parser().parse_args(
        ["agent", "--backend", "kubernetes", *agent_container()["args"]]
    )
    assert (args.command, args.backend) == ("agent", "kubernetes")
    assert args.broker == EXAMPLE["broker"]["url"]
    assert args.cluster == EXAMPLE["cluster"]
    assert args.token_file == "/var/run/secrets/gpufed/token"
    assert args.metrics_port == EXAMPLE["healthPort"]  # where /healthz is served
    assert args.log_level == EXAMPLE["logLevel"].upper()
    assert args.devices == EXAMPLE["devices"]["mode"] == "device-plugin"
    assert args.shared_gpu_resource == EXAMPLE["devices"]["sharedGpuResource"]
    assert not [arg for arg in agent_container()["args"] if arg.startswith("--dra-")]


def test_the_backend_reads_namespaces_and_label_keys_from_the_pods_env() -> None:
    env = {e["name"]: e["value"] for e in agent_container()["env"]}
    assert k8s.namespaces_from_env(env) == EXAMPLE["namespaces"]
    keys = k8s.label_keys_from_env(env)
    assert keys == objects.LabelKeys.from_mapping(EXAMPLE["labelKeys"])
    assert keys.rack == "example.com/rack"


def test_the_rendered_file_has_what_the_templates_produce() -> None:
    kinds: set[str] = set()
    for template in (CHART / "templates").glob("*.yaml"):
        # only with broker.token.create; with clientCertificate.certManager; with
        # metrics.serviceMonitor (the Prometheus Operator's CRDs)
        if template.name in {"secret.yaml", "certificate.yaml", "servicemonitor.yaml"}:
            continue
        kinds.update(re.findall(r"^kind: (\w+)$", template.read_text(), flags=re.M))
    assert {obj["kind"] for obj in AGENT} == kinds
    names = {obj["metadata"]["name"] for obj in AGENT}
    assert names == {FULLNAME}
