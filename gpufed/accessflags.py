"""`gpufed broker`'s flags for who may come in and how much they may take: OIDC for people,
the audit log, rate limits, timeouts and connections per client (broker.http.oidc, audit,
limits, listening), and the settings they make."""

from __future__ import annotations

import argparse
from typing import Any

OIDC_GROUPS_HELP = (
    "the claim holding the person's groups (default groups); a group gpufed:TENANT:ROLE "
    "grants ROLE (tenant-admin, submitter, viewer; admin means tenant-admin) in TENANT, a "
    "DNS label; fleet roles come only from --oidc-fleet-group; the strongest grant wins, "
    "grants in two tenants are refused"
)


def rate(text: str) -> float:
    """argparse's type for --rate-limit: requests a second from 50/s, 600/m or 50."""
    from broker.http import limits

    try:
        return limits.parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fleet_group(text: str) -> tuple[str, str]:
    """argparse's type for --oidc-fleet-group: (group, role) from ROLE=GROUP."""
    from broker.http import oidc

    try:
        group, role = oidc.parse_fleet_group(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return group, role.value


def add_broker_flags(broker: argparse.ArgumentParser) -> None:
    oidc = broker.add_argument_group("people's tokens from an OpenID Connect provider")
    oidc.add_argument(
        "--oidc-issuer",
        metavar="URL",
        help="accept JWTs of this issuer (their `iss`) besides the tokens file; RS256 or "
        "ES256, exp and nbf checked with --oidc-leeway",
    )
    oidc.add_argument(
        "--oidc-audience", metavar="AUD", help="the `aud` the JWTs must name (this broker)"
    )
    oidc.add_argument(
        "--oidc-jwks",
        metavar="FILE|URL",
        help="the issuer's signing keys: a JWKS file (read again when it changes) or URL "
        "(fetched every 10 min and on an unknown kid); default: the issuer's "
        "/.well-known/openid-configuration names it",
    )
    oidc.add_argument("--oidc-groups-claim", default="groups", help=OIDC_GROUPS_HELP)
    oidc.add_argument(
        "--oidc-group-prefix",
        default="gpufed:",
        help="what starts the groups meant for gpufed (default gpufed:)",
    )
    oidc.add_argument(
        "--oidc-role-claim",
        metavar="CLAIM",
        help="read roles from this claim instead of groups (a role name or a list of them)",
    )
    oidc.add_argument(
        "--oidc-tenant-claim",
        metavar="CLAIM",
        help="the claim naming the tenant of tenant roles given as a plain role "
        "(--oidc-role-claim, or a group gpufed:ROLE)",
    )
    oidc.add_argument(
        "--oidc-fleet-group",
        action="append",
        type=fleet_group,
        metavar="ROLE=GROUP",
        help="members of GROUP get the fleet role ROLE (admin, viewer, metrics); repeatable. "
        "Fleet roles come from these groups only; none given: gpufed:admin, gpufed:viewer "
        "and gpufed:metrics (the prefix and the role)",
    )
    oidc.add_argument(
        "--oidc-tenant",
        action="append",
        metavar="NAME",
        help="a tenant a token may name (repeatable); none given: any DNS label",
    )
    oidc.add_argument(
        "--oidc-username-claim",
        default="sub",
        metavar="CLAIM",
        help="what names the person in the audit log and job events (default sub; e.g. email)",
    )
    oidc.add_argument(
        "--oidc-leeway",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="clock skew allowed on exp and nbf (default 30)",
    )
    guard = broker.add_argument_group("audit and limits")
    guard.add_argument(
        "--audit-log",
        metavar="FILE|-",
        help="append a JSON line per mutating call and refused credential (who, tenant, "
        "role, action, target, result, trace id, source address) to FILE, or - for stdout",
    )
    guard.add_argument(
        "--rate-limit",
        type=rate,
        metavar="RATE",
        help="requests per bearer token (50/s, 600/m): past it 429 with Retry-After; an "
        "address sending refused tokens faster is limited too (default: no limit)",
    )
    guard.add_argument(
        "--rate-burst",
        type=float,
        metavar="N",
        help="requests a token may make at once before --rate-limit applies (default 2x it)",
    )
    guard.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a connection must send its request's headers within this (from opening or "
        "the previous answer), else it is closed (default 30)",
    )
    guard.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a request's body must arrive within this, else 408 (default 30)",
    )
    guard.add_argument(
        "--max-request-jobs",
        type=int,
        default=10_000,
        metavar="N",
        help="jobs one submit or batch may store, each array's count counted whole; past "
        "it 422 naming spec.array.count (default and most 10000)",
    )
    guard.add_argument(
        "--max-request-dependencies",
        type=int,
        default=100_000,
        metavar="N",
        help="dependsOn entries one submit or batch may store, each job of an array counted "
        "(an array of 10000 with 3 entries: 30000); an entry naming an array is one, "
        "whatever its size; past it 422 naming spec.dependsOn (default 100000)",
    )
    guard.add_argument(
        "--max-page-bytes",
        type=int,
        default=8 * 1024 * 1024,
        metavar="BYTES",
        help="a GET /v1/jobs page stops before its body passes this and gives a continue "
        "token; it always holds one job (default 8388608, 8 MiB)",
    )
    guard.add_argument(
        "--max-connections-per-client",
        type=int,
        default=256,
        metavar="N",
        help="open connections one client address may hold (through a trusted proxy: "
        "requests in progress of one forwarded client); an idle one is closed to admit a new "
        "one, and when all are busy 16 more serve only /healthz, /readyz and agents; past "
        "that 503 (default 256)",
    )
    guard.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        metavar="CIDR",
        help="a proxy (address or CIDR, repeatable or comma-separated, e.g. the ingress's "
        "pod network) whose X-Forwarded-For names the client: caps, rate limits and the "
        "audit log then count that client, and the proxy's own connections are not capped; "
        "the header is ignored from any other peer (default: none)",
    )
    guard.add_argument(
        "--max-requests-per-principal",
        type=int,
        default=64,
        metavar="N",
        help="requests in progress of one token or OIDC user (event streams and slow bodies "
        "included; agents not counted): one more is 429 (default 64; 0: no limit)",
    )
    guard.add_argument(
        "--max-event-streams",
        type=int,
        default=500,
        metavar="N",
        help="GET /v1/events streams open on this replica; the last tenth go only to callers "
        "holding none (default 500)",
    )
    guard.add_argument(
        "--max-event-streams-per-principal",
        type=int,
        default=8,
        metavar="N",
        help="GET /v1/events streams one token or OIDC user may hold: one more is 429 (default 8)",
    )


def broker_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The BrokerSettings fields of these flags (ValueError naming a flag missing)."""
    settings: dict[str, Any] = {
        "audit_log": args.audit_log,
        "rate_limit": args.rate_limit,
        "rate_burst": args.rate_burst,
        "body_timeout_seconds": args.body_timeout,
        "max_request_jobs": args.max_request_jobs,
        "max_request_dependencies": args.max_request_dependencies,
        "max_page_bytes": args.max_page_bytes,
        "max_requests_per_principal": args.max_requests_per_principal,
        "max_event_streams": args.max_event_streams,
        "max_event_streams_per_principal": args.max_event_streams_per_principal,
    }
    if args.oidc_issuer is not None or args.oidc_audience is not None:
        if args.oidc_issuer is None or args.oidc_audience is None:
            raise ValueError("--oidc-issuer and --oidc-audience go together")
        settings["oidc_provider"] = {
            "issuer": args.oidc_issuer,
            "audience": args.oidc_audience,
            "jwks": args.oidc_jwks,
            "groups_claim": args.oidc_groups_claim,
            "group_prefix": args.oidc_group_prefix,
            "role_claim": args.oidc_role_claim,
            "tenant_claim": args.oidc_tenant_claim,
            "username_claim": args.oidc_username_claim,
            "leeway_seconds": args.oidc_leeway,
            "fleet_groups": dict(args.oidc_fleet_group) if args.oidc_fleet_group else None,
            "tenants": frozenset(args.oidc_tenant) if args.oidc_tenant else None,
        }
    return settings


def listen_settings(args: argparse.Namespace) -> Any:
    from broker.http import listening

    if args.header_timeout <= 0 or args.max_connections_per_client < 1:
        raise ValueError("--header-timeout must be above 0, --max-connections-per-client 1+")
    proxies = tuple(p for given in args.trusted_proxy for p in given.split(",") if p.strip())
    listening.parse_networks(proxies)  # ValueError naming a bad one
    return listening.ListenSettings(
        header_timeout=args.header_timeout,
        max_connections_per_client=args.max_connections_per_client,
        trusted_proxies=proxies,
    )
