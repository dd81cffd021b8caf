"""Which cluster an agent's client certificate names (`broker.http.peers.cluster_of`), over
the dictionaries `ssl` gives for a verified peer certificate."""

from __future__ import annotations

from typing import Any

import pytest

from broker.api import errors
from broker.http import peers


def cert(cn: str | None = None, *sans: tuple[str, str]) -> dict[str, Any]:
    subject: tuple[tuple[tuple[str, str], ...], ...] = ((("organizationName", "gpufed"),),)
    if cn is not None:
        subject += ((("commonName", cn),),)
    return {"subject": subject, "subjectAltName": sans, "notAfter": "Jan  1 00:00:00 2030 GMT"}


@pytest.mark.parametrize(
    ("peer", "cluster"),
    [
        pytest.param(cert("h100"), "h100", id="the common name"),
        pytest.param(
            cert("agent", ("URI", "spiffe://gpufed/cluster/a100")), "a100", id="a SPIFFE URI SAN"
        ),
        pytest.param(
            cert("h100", ("URI", "spiffe://example.org/cluster/a100")),
            "a100",
            id="the URI SAN wins over the common name, in any trust domain",
        ),
        pytest.param(
            cert("h100", ("URI", "https://example.org/cluster/a100"), ("DNS", "a100")),
            "h100",
            id="other SANs are not cluster names",
        ),
        pytest.param(
            cert(None, ("URI", "spiffe://gpufed/cluster/a100"), ("URI", "spiffe://x/cluster/a100")),
            "a100",
            id="one cluster named twice",
        ),
    ],
)
def test_the_cluster_a_certificate_names(peer: dict[str, Any], cluster: str) -> None:
    assert peers.cluster_of(peer) == cluster


@pytest.mark.parametrize(
    ("peer", "message"),
    [
        pytest.param(
            cert(
                "x", ("URI", "spiffe://gpufed/cluster/a100"), ("URI", "spiffe://gpufed/cluster/b")
            ),
            "names several clusters (a100, b)",
            id="two clusters",
        ),
        pytest.param(cert(None), "names no cluster", id="no common name, no URI SAN"),
        pytest.param(cert("H100 Cluster"), "names no cluster", id="a common name not a DNS label"),
        pytest.param(
            cert(None, ("URI", "spiffe://gpufed/cluster/a100/extra")),
            "names no cluster",
            id="a longer SPIFFE path",
        ),
    ],
)
def test_a_certificate_that_names_no_one_cluster_is_forbidden(
    peer: dict[str, Any], message: str
) -> None:
    with pytest.raises(errors.Forbidden, match=message.replace("(", r"\(").replace(")", r"\)")):
        peers.cluster_of(peer)
