"""Which cluster an agent's client certificate names (agent mTLS, `--client-ca`).

The listener asks every client for a certificate and verifies the one it gets against the
client CA (`broker.http.tls`); only the agent route reads it. The cluster is the name in a URI
SAN `spiffe://<trust domain>/cluster/<name>` (SPIFFE's form, what cert-manager's or SPIRE's
certificates carry), else the subject's common name. A certificate naming two clusters, or
none, is refused. With `--client-ca` an agent must send one: a token alone no longer opens a
session, a certificate alone does, and a token sent beside it must name the same cluster
(`auth.middleware`). Then the hello must claim that cluster (`dispatch.connecting`), and the
session is closed when the certificate expires (`expiry`), as when a token is revoked.

The client CA is the agents' own: whatever it signs is an agent of the cluster it names.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from broker.api import errors

CLUSTER_URI = re.compile(r"spiffe://[^/\s]+/cluster/([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)")
CLUSTER_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# whether the agent route takes its cluster from the client certificate (--client-ca is set)
AGENT_CERTIFICATES = web.AppKey("agent_certificates", bool)

PeerCert = Mapping[str, Any]  # ssl.SSLSocket.getpeercert()'s dictionary


def peer_certificate(request: web.Request) -> PeerCert | None:
    """The client's certificate, verified by the client CA, or None if it sent none."""
    transport = request.transport
    if transport is None:
        return None
    cert = transport.get_extra_info("peercert")
    return cert or None


def cluster_of(cert: PeerCert) -> str:
    """The one cluster `cert` names (URI SAN, else common name); Forbidden otherwise."""
    uris = [value for kind, value in cert.get("subjectAltName", ()) if kind == "URI"]
    named = sorted({m.group(1) for uri in uris if (m := CLUSTER_URI.fullmatch(uri))})
    if len(named) > 1:
        raise errors.Forbidden(
            f"the client certificate names several clusters ({', '.join(named)}): "
            "an agent's names one"
        )
    if named:
        return named[0]
    common = [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    if len(common) == 1 and CLUSTER_NAME.fullmatch(common[0]):
        return str(common[0])
    raise errors.Forbidden(
        "the client certificate names no cluster: give it a URI SAN "
        "spiffe://<trust domain>/cluster/<name> or the cluster as its common name"
    )


def agent_cluster(request: web.Request) -> str:
    """The cluster the agent's certificate names: Unauthenticated if it sent none."""
    cert = peer_certificate(request)
    if cert is None:
        raise errors.Unauthenticated(
            "this broker takes agents with a client certificate (--client-ca): the agent "
            "sent none (gpufed agent --cert, --key)"
        )
    return cluster_of(cert)


def expiry(request: web.Request) -> float | None:
    """When the client's certificate stops being valid (seconds since the epoch), if any."""
    cert = peer_certificate(request)
    if cert is None or "notAfter" not in cert:
        return None
    return float(ssl.cert_time_to_seconds(cert["notAfter"]))
