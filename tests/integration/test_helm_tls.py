"""The charts' TLS: the broker's certificate and the agents' client CA, an agent's CA and
client certificate, from Secrets or from cert-manager, rendered by Helm's engine (the renderer
of test_helm_render.py) and read back as the programs read their flags.

What must hold: every flag points at a file a mounted Secret holds, under the key the values
name; the probes and the advertised URL speak HTTPS once the port does; an agent with a
certificate needs no token; cert-manager's Certificate fills the Secret the pods mount and
names the cluster where the broker reads it (the URI SAN).
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from broker.http import peers
from gpufed import cli
from tests.integration import test_helm_render
from tests.integration.test_deploy_broker import parse_broker_args
from tests.integration.test_deploy_manifests import KUBERNETES_VERSIONS

# its fixtures: the renderer built once for this module, and render(chart, override)
renderer = test_helm_render.renderer
render = test_helm_render.render
Render = test_helm_render.Render
Rendered = test_helm_render.Rendered
BROKER = test_helm_render.BROKER

AGENT = "gpufed-member-agent"
ISSUER = {"name": "gpufed-ca", "kind": "ClusterIssuer"}
BROKER_TLS = {
    "tls": {
        "enabled": True,
        "existingSecret": "gpufed-broker-tls",
        "certKey": "cert.pem",
        "clientCA": {"existingSecret": "gpufed-agents-ca", "key": "agents.pem"},
    }
}
BROKER_CERT_MANAGER = {
    "tls": {
        "enabled": True,
        "clientCA": {"existingSecret": "gpufed-agents-ca"},
        "certManager": {"enabled": True, "issuerRef": ISSUER, "dnsNames": ["b.example.com"]},
    }
}
AGENT_MTLS: dict[str, Any] = {
    "broker": {
        "token": {"existingSecret": ""},
        "tls": {"caSecret": "gpufed-broker-ca", "serverName": "gpufed-broker.gpufed-system.svc"},
    },
    "clientCertificate": {"enabled": True, "existingSecret": "gpu-east-1-agent", "keyKey": "k"},
}
AGENT_CERT_MANAGER = {
    "broker": {"token": {"existingSecret": ""}},
    "clientCertificate": {"enabled": True, "certManager": {"enabled": True, "issuerRef": ISSUER}},
}


def pod_spec(rendered: Rendered, name: str) -> dict[str, Any]:
    return rendered.one("Deployment", name)["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def mounted_files(rendered: Rendered, name: str) -> dict[str, tuple[str, str]]:
    """Every file a Secret volume puts in the container: path -> (Secret, key)."""
    spec = pod_spec(rendered, name)
    [container] = spec["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    files = {}
    for volume in spec["volumes"]:
        if "secret" in volume and volume["name"] in mounts:
            for item in volume["secret"]["items"]:
                path = posixpath.join(mounts[volume["name"]], item["path"])
                files[path] = (volume["secret"]["secretName"], item["key"])
    return files


def valid(rendered: Rendered) -> None:
    for obj in rendered.objects:
        if obj["apiVersion"].startswith("cert-manager.io/"):
            continue  # not a Kubernetes schema
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_broker_serves_https_with_its_secret_and_takes_agents_of_the_client_ca(
    render: Render,
) -> None:
    rendered = render("broker", BROKER_TLS)
    valid(rendered)
    container = test_helm_render.broker_container(rendered)
    args = parse_broker_args(container["args"])
    files = mounted_files(rendered, BROKER)
    assert files[args.tls_cert] == ("gpufed-broker-tls", "cert.pem")
    assert files[args.tls_key] == ("gpufed-broker-tls", "tls.key")
    assert files[args.client_ca] == ("gpufed-agents-ca", "agents.pem")
    assert args.advertise_url == "https://$(POD_IP):8080"
    # followers verify the leader (at its pod address) with the Secret's CA and the Service name
    assert files[args.peer_ca_file] == ("gpufed-broker-tls", "ca.crt")
    assert args.peer_server_name == "gpufed-broker.gpufed-system.svc"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
    annotations = rendered.one("Deployment", BROKER)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scheme"] == "https"


def test_without_tls_the_broker_speaks_http_and_mounts_no_certificate(render: Render) -> None:
    container = test_helm_render.broker_container(render("broker"))
    args = parse_broker_args(container["args"])
    assert (args.tls_cert, args.tls_key, args.client_ca) == (None, None, None)
    assert "scheme" not in container["readinessProbe"]["httpGet"]
    assert args.advertise_url.startswith("http://")


def test_cert_manager_issues_the_brokers_certificate_into_the_mounted_secret(
    render: Render,
) -> None:
    rendered = render("broker", BROKER_CERT_MANAGER)
    valid(rendered)
    certificate = rendered.one("Certificate", BROKER)
    args = parse_broker_args(test_helm_render.broker_container(rendered)["args"])
    files = mounted_files(rendered, BROKER)
    assert files[args.tls_cert] == (certificate["spec"]["secretName"], "tls.crt")
    assert files[args.tls_key] == (certificate["spec"]["secretName"], "tls.key")
    names = certificate["spec"]["dnsNames"]
    assert {"gpufed-broker.gpufed-system.svc", "gpufed.example.com", "b.example.com"} <= set(names)
    assert certificate["spec"]["issuerRef"] == {**ISSUER, "group": "cert-manager.io"}
    assert certificate["spec"]["usages"] == ["server auth"]
    assert args.peer_server_name in names
    assert files[args.peer_ca_file] == (certificate["spec"]["secretName"], "ca.crt")


def test_a_public_issuers_secret_without_a_ca_leaves_peers_to_the_system_cas(
    render: Render,
) -> None:
    override = {"tls": {**BROKER_TLS["tls"], "peerCA": False, "peerServerName": "b.example"}}
    rendered = render("broker", override)
    valid(rendered)
    args = parse_broker_args(test_helm_render.broker_container(rendered)["args"])
    assert args.peer_ca_file is None
    assert args.peer_server_name == "b.example"
    assert "/etc/gpufed/tls/ca.crt" not in mounted_files(rendered, BROKER)


def agent_args(rendered: Rendered) -> Any:
    [container] = pod_spec(rendered, AGENT)["containers"]
    return cli.build_parser().parse_args(["agent", "--backend", "kubernetes", *container["args"]])


def test_an_agent_with_a_client_certificate_needs_no_token(render: Render) -> None:
    rendered = render("member-agent", AGENT_MTLS)
    valid(rendered)
    args = agent_args(rendered)
    files = mounted_files(rendered, AGENT)
    assert args.token_file is None and "token" not in {
        v["name"] for v in pod_spec(rendered, AGENT)["volumes"]
    }
    assert files[args.cert] == ("gpu-east-1-agent", "tls.crt")
    assert files[args.key] == ("gpu-east-1-agent", "k")
    assert files[args.ca_file] == ("gpufed-broker-ca", "ca.crt")
    assert args.tls_server_name == "gpufed-broker.gpufed-system.svc"


def test_an_agent_keeps_its_token_beside_a_certificate_and_needs_one_of_them(
    render: Render,
) -> None:
    both = {**AGENT_MTLS, "broker": {"tls": AGENT_MTLS["broker"]["tls"]}}
    args = agent_args(render("member-agent", both))
    assert args.token_file and args.cert
    args = agent_args(render("member-agent"))
    assert args.token_file and args.cert is None and args.ca_file is None


def test_cert_manager_issues_the_agents_certificate_naming_its_cluster(render: Render) -> None:
    rendered = render("member-agent", AGENT_CERT_MANAGER)
    valid(rendered)
    certificate = rendered.one("Certificate", f"{AGENT}-client")
    args = agent_args(rendered)
    files = mounted_files(rendered, AGENT)
    assert files[args.cert] == (certificate["spec"]["secretName"], "tls.crt")
    [uri] = certificate["spec"]["uris"]
    assert uri == "spiffe://gpufed/cluster/gpu-east-1"
    # the name the broker reads from it is the cluster the agent says it is
    assert peers.cluster_of({"subjectAltName": (("URI", uri),)}) == args.cluster
    assert certificate["spec"]["usages"] == ["client auth"]


@pytest.mark.parametrize(
    ("chart", "override", "message"),
    [
        pytest.param(
            "broker",
            {"tls": {"enabled": True}},
            "tls.existingSecret (or tls.certManager.enabled) is required",
            id="broker TLS without a Secret",
        ),
        pytest.param(
            "member-agent",
            {"clientCertificate": {"enabled": True}, "broker": {"token": {"existingSecret": ""}}},
            "clientCertificate.existingSecret (or clientCertificate.certManager.enabled)",
            id="agent mTLS without a Secret",
        ),
        pytest.param(
            "member-agent",
            {"broker": {"token": {"existingSecret": ""}}},
            "broker.token.existingSecret (or broker.token.create with broker.token.value)",
            id="agent with neither token nor certificate",
        ),
    ],
)
def test_a_missing_secret_fails_the_render_saying_which(
    renderer: Path, tmp_path: Path, chart: str, override: dict[str, Any], message: str
) -> None:
    values = tmp_path / "override.yaml"
    values.write_text(yaml.safe_dump(override))
    charts = test_helm_render.CHARTS
    example = charts / chart / "ci" / "example-values.yaml"
    done = test_helm_render.run_renderer(renderer, charts / chart, [example, values])
    assert done.returncode != 0 and message in done.stderr
