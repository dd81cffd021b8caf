"""The TLS flags of `gpufed broker`, `gpufed agent` and the user commands, and what they set.

    gpufed broker --tls-cert FILE --tls-key FILE [--client-ca FILE]   (broker.http.tls, peers)
                  [--peer-ca-file FILE] [--peer-server-name NAME]    (broker.http.forwarding)
    gpufed agent  [--ca-file FILE] [--cert FILE --key FILE] [--tls-server-name NAME]
                                                                      (member_agent.session.tls)
    gpufed submit|get|list|... [--ca-file FILE]                       (gpufed.client)

`--ca-file` (or `GPUFED_CA_FILE`) is the CA a client trusts for the broker's certificate
instead of the system's. Every file is read again when it changes: no restart to rotate.
"""

from __future__ import annotations

import argparse
import os
import ssl
from pathlib import Path
from typing import Any

CA_FILE_ENV = "GPUFED_CA_FILE"


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def add_broker_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="serve HTTPS (agents then connect with wss): the certificate chain (PEM), read "
        "again when it changes; needs --tls-key",
    )
    parser.add_argument("--tls-key", metavar="FILE", help="the private key (PEM) of --tls-cert")
    parser.add_argument(
        "--client-ca",
        metavar="FILE",
        help="agent mTLS: the CA (PEM) of the agents' client certificates; an agent must then "
        "send one, and its cluster is the one it names (URI SAN spiffe://DOMAIN/cluster/NAME, "
        "else the common name); user API clients need none",
    )
    parser.add_argument(
        "--peer-ca-file",
        metavar="FILE",
        help="several replicas with TLS: the CA (PEM) of the other replicas' certificates, "
        "which a follower verifies when it asks the leader (default: the system's CAs)",
    )
    parser.add_argument(
        "--peer-server-name",
        metavar="NAME",
        help="the name the other replicas' certificates hold (default: the host of each "
        "replica's advertised URL, often a pod address no certificate names)",
    )


def broker_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The broker flags as `BrokerSettings` fields."""
    return {
        "tls_cert_file": _path(args.tls_cert),
        "tls_key_file": _path(args.tls_key),
        "client_ca_file": _path(args.client_ca),
        "peer_ca_file": _path(args.peer_ca_file),
        "peer_server_name": args.peer_server_name or None,
    }


def add_ca_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ca-file",
        metavar="FILE",
        default=os.environ.get(CA_FILE_ENV) or None,
        help=f"the CA (PEM) that signed the broker's certificate (env {CA_FILE_ENV}; default: "
        "the system's CAs)",
    )


def add_agent_flags(parser: argparse.ArgumentParser) -> None:
    add_ca_flag(parser)
    parser.add_argument(
        "--cert",
        metavar="FILE",
        help="agent mTLS: this agent's client certificate (PEM), naming its cluster; read "
        "again when it changes; needs --key",
    )
    parser.add_argument("--key", metavar="FILE", help="the private key (PEM) of --cert")
    parser.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name the brokers' certificate must hold (default: each broker URL's host): "
        "for replicas that advertise their address, as a follower names the leader",
    )


def agent_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The agent flags as `AgentSettings` fields; ValueError without a token or certificate."""
    if args.token_file is None and args.cert is None:
        raise ValueError("give the cluster's --token-file, or its --cert and --key (mTLS)")
    return {
        "ca_file": args.ca_file,
        "cert_file": args.cert,
        "key_file": args.key,
        "tls_server_name": args.tls_server_name,
    }


def ca_file(args: argparse.Namespace) -> str | None:
    """A user command's --ca-file, checked (SystemExit saying what is wrong with it)."""
    path: str | None = args.ca_file
    if path is None:
        return None
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError as exc:  # an OSError too: first
        raise SystemExit(f"gpufed: the CA file {path} holds no PEM certificate ({exc})") from exc
    except OSError as exc:
        raise SystemExit(f"gpufed: cannot read the CA file {path}: {exc.strerror}") from exc
    return path
