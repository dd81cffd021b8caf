"""The charts' NetworkPolicies, read as a network plugin enforces them: which peer may open a
connection to which pod on which port.

On by default. The chart's etcd (the job store; plain HTTP unless store.etcd.tls) takes its
client port from the brokers only and its peer port from its members only; the brokers' port
stays open until `networkPolicy.api` names its sources (the ingress controller's namespace,
CIDRs of agents and clients); the agent takes connections on its metrics port only, from the
monitoring namespace. Rendered by Helm's engine (tests/integration/test_helm_render.py's
renderer; skipped without Go).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from tests.integration import test_helm_render
from tests.integration.test_helm_render import AGENT, BROKER, ETCD, NAMESPACE, Render, Rendered

renderer = test_helm_render.renderer  # the module's fixtures: the renderer built once
render = test_helm_render.render

NS_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace


@dataclass(frozen=True)
class Peer:
    """Who opens the connection: a pod (its namespace and labels) or an address outside."""

    ip: str
    namespace: str | None = None  # None: not a pod of the cluster
    labels: dict[str, str] = field(default_factory=dict)


def outside(ip: str) -> Peer:
    return Peer(ip)


def pod(namespace: str, ip: str = "10.1.2.3", **labels: str) -> Peer:
    return Peer(ip, namespace, labels)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector: matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def peer_matches(peer: dict[str, Any], policy_namespace: str, source: Peer) -> bool:
    if "ipBlock" in peer:
        address = ipaddress.ip_address(source.ip)
        block = peer["ipBlock"]
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(cidr) for cidr in block.get("except", [])
        )
    if source.namespace is None:
        return False  # selectors pick pods only
    if "namespaceSelector" in peer:
        namespace_labels = {NS_LABEL: source.namespace}
        if not selects(peer["namespaceSelector"], namespace_labels):
            return False
    elif source.namespace != policy_namespace:
        return False  # a podSelector alone: the policy's own namespace
    return selects(peer.get("podSelector", {}), source.labels)


def port_numbers(workload: dict[str, Any]) -> dict[str, int]:
    return {
        port["name"]: port["containerPort"]
        for container in workload["spec"]["template"]["spec"]["containers"]
        for port in container.get("ports", [])
    }


def admits(rendered: Rendered, kind: str, name: str, port: str, source: Peer) -> bool:
    """Whether `source` may open a TCP connection to `port` (a container port's name) of the
    pods of workload kind/name, under every NetworkPolicy the chart rendered."""
    workload = rendered.one(kind, name)
    labels = workload["spec"]["template"]["metadata"]["labels"]
    numbers = port_numbers(workload)
    number = numbers[port]
    policies = [
        p
        for p in rendered.objects
        if p["kind"] == "NetworkPolicy"
        and p["metadata"]["namespace"] == workload["metadata"]["namespace"]
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], labels)
    ]
    if not policies:
        return True  # a pod no policy selects takes any connection
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None:
                # a named port must be one of the pod's: an unknown name matches nothing
                wanted = {
                    numbers[p["port"]] if isinstance(p["port"], str) else p["port"] for p in ports
                }
                if number not in wanted or any(p.get("protocol", "TCP") != "TCP" for p in ports):
                    continue
            sources = rule.get("from")
            if not sources:
                return True
            if any(peer_matches(peer, policy["metadata"]["namespace"], source) for peer in sources):
                return True
    return False


BROKER_POD = pod(
    NAMESPACE, **{"app.kubernetes.io/name": "broker", "app.kubernetes.io/instance": "gpufed"}
)
ETCD_POD = pod(
    NAMESPACE, **{"app.kubernetes.io/name": "etcd", "app.kubernetes.io/instance": "gpufed"}
)
NEIGHBOUR = pod(NAMESPACE, app="something-else")  # another pod of the release's namespace
TENANT_POD = pod("team-a", app="notebook")
INGRESS_POD = pod("ingress-nginx", **{"app.kubernetes.io/name": "ingress-nginx"})
PROMETHEUS_POD = pod("monitoring", **{"app.kubernetes.io/name": "prometheus"})
AGENT_ADDRESS = outside("203.0.113.7")
STRANGER = outside("198.51.100.9")

RESTRICTED_API = {
    "networkPolicy": {
        "api": {
            "ingressNamespaceSelector": {NS_LABEL: "ingress-nginx"},
            "cidrs": ["203.0.113.0/24"],
        },
        "monitoringNamespace": "monitoring",
    }
}


def test_by_default_only_the_brokers_reach_etcd_and_anyone_the_brokers(render: Render) -> None:
    rendered = render("broker")
    assert rendered.values["networkPolicy"]["enabled"] is True
    assert admits(rendered, "StatefulSet", ETCD, "client", BROKER_POD)
    for source in (NEIGHBOUR, TENANT_POD, INGRESS_POD, PROMETHEUS_POD, STRANGER, ETCD_POD):
        assert not admits(rendered, "StatefulSet", ETCD, "client", source), source
    # a pod of another namespace wearing the brokers' labels is not a broker
    assert not admits(rendered, "StatefulSet", ETCD, "client", pod("team-a", **BROKER_POD.labels))
    # the peer port takes the other members only
    assert admits(rendered, "StatefulSet", ETCD, "peer", ETCD_POD)
    for source in (BROKER_POD, NEIGHBOUR, TENANT_POD):
        assert not admits(rendered, "StatefulSet", ETCD, "peer", source), source
    # the metrics port (/metrics, /livez, /readyz; no data) stays open to any scraper
    assert admits(rendered, "StatefulSet", ETCD, "metrics", PROMETHEUS_POD)
    # while the brokers' port stays open: agents come from other clusters through an ingress or
    # a load balancer whose addresses the chart cannot know, and closing it by default would
    # cut a working install off
    for source in (AGENT_ADDRESS, STRANGER, INGRESS_POD, TENANT_POD, BROKER_POD):
        assert admits(rendered, "Deployment", BROKER, "http", source), source


def test_named_sources_close_the_brokers_port_to_everyone_else(render: Render) -> None:
    rendered = render("broker", RESTRICTED_API)
    for source in (INGRESS_POD, AGENT_ADDRESS, PROMETHEUS_POD, BROKER_POD):
        assert admits(rendered, "Deployment", BROKER, "http", source), source
    for source in (STRANGER, TENANT_POD, NEIGHBOUR, pod("kube-system")):
        assert not admits(rendered, "Deployment", BROKER, "http", source), source
    # the monitoring namespace is now the only one let in to etcd's metrics port
    assert admits(rendered, "StatefulSet", ETCD, "metrics", PROMETHEUS_POD)
    assert not admits(rendered, "StatefulSet", ETCD, "metrics", TENANT_POD)
    assert not admits(rendered, "StatefulSet", ETCD, "client", PROMETHEUS_POD)


def test_more_etcd_clients_and_api_peers_are_values(render: Render) -> None:
    backup = pod(NAMESPACE, app="etcd-backup")
    rendered = render(
        "broker",
        {
            "networkPolicy": {
                "api": {"from": [{"podSelector": {"matchLabels": {"app": "console-proxy"}}}]},
                "etcd": {"clientsFrom": [{"podSelector": {"matchLabels": {"app": "etcd-backup"}}}]},
            }
        },
    )
    assert admits(rendered, "StatefulSet", ETCD, "client", backup)
    assert not admits(rendered, "StatefulSet", ETCD, "client", NEIGHBOUR)
    assert admits(rendered, "Deployment", BROKER, "http", pod(NAMESPACE, app="console-proxy"))
    assert not admits(rendered, "Deployment", BROKER, "http", STRANGER)


@pytest.mark.parametrize(
    "override",
    [
        pytest.param(test_helm_render.BROKER_VARIANTS["one broker on SQLite"], id="SQLite"),
        pytest.param(test_helm_render.BROKER_VARIANTS["an etcd of your own"], id="own etcd"),
    ],
)
def test_without_the_charts_etcd_only_the_brokers_policy(
    render: Render, override: dict[str, Any]
) -> None:
    rendered = render("broker", override)
    policies = [o["metadata"]["name"] for o in rendered.objects if o["kind"] == "NetworkPolicy"]
    assert policies == [BROKER]


def test_network_policies_can_be_turned_off(render: Render) -> None:
    for chart in ("broker", "member-agent"):
        rendered = render(chart, {"networkPolicy": {"enabled": False}})
        assert "NetworkPolicy" not in rendered.kinds(), chart


def test_the_agents_metrics_port_takes_the_monitoring_namespace_only(render: Render) -> None:
    rendered = render("member-agent")
    assert admits(rendered, "Deployment", AGENT, "health", PROMETHEUS_POD)
    for source in (TENANT_POD, pod(NAMESPACE), STRANGER):
        assert not admits(rendered, "Deployment", AGENT, "health", source), source

    elsewhere = render(
        "member-agent",
        {
            "networkPolicy": {
                "monitoringNamespace": "observability",
                "metricsFrom": [{"ipBlock": {"cidr": "10.8.0.0/16"}}],
            }
        },
    )
    assert admits(elsewhere, "Deployment", AGENT, "health", pod("observability"))
    assert admits(elsewhere, "Deployment", AGENT, "health", outside("10.8.1.1"))
    assert not admits(elsewhere, "Deployment", AGENT, "health", PROMETHEUS_POD)

    nobody = render("member-agent", {"networkPolicy": {"monitoringNamespace": ""}})
    assert not admits(nobody, "Deployment", AGENT, "health", PROMETHEUS_POD)


def test_the_schema_refuses_a_bad_cidr(render: Render) -> None:
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        render("broker", {"networkPolicy": {"api": {"cidrs": ["203.0.113.0"]}}})


@pytest.mark.parametrize(
    ("chart", "override", "said"),
    [
        pytest.param(
            "broker",
            None,
            "the brokers' port is open to anyone until networkPolicy.api names its sources",
            id="broker, API open",
        ),
        pytest.param(
            "broker",
            RESTRICTED_API,
            "the brokers' port from the sources in networkPolicy.api only",
            id="broker, API sources",
        ),
        pytest.param(
            "member-agent",
            None,
            "metrics port (8081) only the namespace monitoring",
            id="member-agent",
        ),
    ],
)
def test_the_notes_say_who_may_connect(
    renderer: Path, tmp_path: Path, chart: str, override: dict[str, Any] | None, said: str
) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(override or {}))
    directory = test_helm_render.CHARTS / chart
    done = test_helm_render.run_renderer(
        renderer, directory, [directory / "ci" / "example-values.yaml", values], "--notes"
    )
    assert done.returncode == 0, done.stderr
    assert said in " ".join(done.stdout.split())
