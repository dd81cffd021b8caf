"""What a verified OIDC token's claims grant: the gpufed roles, each of the fleet or of one
tenant, and the claims refused on the way. Pure: `broker.http.oidc.Verifier` calls
`grants_of` then `choose` for every token it has verified, and counts and logs what was
refused.

Two kinds of grant, from two sources the broker tells apart:

- **Fleet roles** (admin, a viewer of the whole fleet, metrics) come only from the groups
  named in `ClaimRules.fleet_groups` (`--oidc-fleet-group ROLE=GROUP`), matched whole. When
  none is named, the groups `gpufed:admin`, `gpufed:viewer` and `gpufed:metrics` (the group
  prefix and the role) are the fleet groups. No tenant group can spell one of them: a tenant
  group has a tenant between the prefix and the role, and a tenant holds no `:`.
- **Tenant roles** (tenant-admin, submitter, a tenant's viewer) from a group
  `gpufed:TENANT:ROLE`, or a plain role (a group `gpufed:ROLE`, or a value of the role claim
  with `--oidc-role-claim`) whose tenant is the tenant claim's (`--oidc-tenant-claim`). A
  group under a tenant grants only roles of that tenant: `admin` there is that tenant's
  tenant-admin; `metrics` (and a fleet role where no tenant names where it belongs) grants
  nothing. A default fleet group `gpufed:viewer` in a token whose tenant claim names a
  tenant is that tenant's viewer.

A tenant from a token is checked as every tenant name is: a DNS label (lower-case letters,
digits and `-`, at most 63 characters), and one of `ClaimRules.tenants` when that is set
(`--oidc-tenant`). Anything else grants nothing, and comes back as a `Refusal`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.api import errors, jobs
from broker.http import roles

FLEET_ROLES = frozenset({roles.Role.ADMIN, roles.Role.VIEWER, roles.Role.METRICS})
# why a claim granted nothing: the `reason` label of gpufed_oidc_rejected_claims_total
TENANT_NOT_DNS_LABEL = "tenant_not_dns_label"
TENANT_NOT_ALLOWED = "tenant_not_allowed"
FLEET_ROLE_OUTSIDE_FLEET_GROUPS = "fleet_role_outside_fleet_groups"
REASONS = (TENANT_NOT_DNS_LABEL, TENANT_NOT_ALLOWED, FLEET_ROLE_OUTSIDE_FLEET_GROUPS)
# how much of a refused claim a log line or a problem repeats
SHOWN_CHARACTERS = 64
# the order grants are preferred in: the first a token holds is its role
_STRENGTH = (
    roles.Role.ADMIN,
    roles.Role.TENANT_ADMIN,
    roles.Role.SUBMITTER,
    roles.Role.VIEWER,
    roles.Role.METRICS,
)


@dataclass(frozen=True)
class ClaimRules:
    """How claims read (`oidc.OidcSettings.rules`)."""

    groups_claim: str = "groups"
    group_prefix: str = "gpufed:"
    role_claim: str | None = None
    tenant_claim: str | None = None
    # group -> fleet role; None: the prefix's admin, viewer and metrics groups
    fleet_groups: Mapping[str, roles.Role] | None = None
    # the tenants a token may name; None: any DNS label
    tenants: frozenset[str] | None = None

    def fleet_roles(self) -> dict[str, roles.Role]:
        if self.fleet_groups is not None:
            return dict(self.fleet_groups)
        return {self.group_prefix + role.value: role for role in FLEET_ROLES}


@dataclass(frozen=True)
class Grant:
    role: roles.Role
    tenant: str | None = None


@dataclass(frozen=True)
class Refusal:
    """A claim that granted nothing: why (one of `REASONS`), and which claim."""

    reason: str
    claim: str  # the claim's name
    value: str  # the value refused, shortened

    def describe(self) -> str:
        why = {
            TENANT_NOT_DNS_LABEL: "names a tenant that is not a DNS label",
            TENANT_NOT_ALLOWED: "names a tenant this broker does not accept",
            FLEET_ROLE_OUTSIDE_FLEET_GROUPS: "names a fleet role outside the fleet groups",
        }[self.reason]
        return f"{self.claim} {self.value} {why}"


@dataclass
class Mapped:
    """What a token's claims grant, and what they asked for and did not get."""

    grants: list[Grant] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)


def shown(value: object) -> str:
    """`value` as a log line or a problem may repeat it: its repr, at most
    `SHOWN_CHARACTERS` of it."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 1] + "…"


def tenant_problem(name: str, rules: ClaimRules) -> str | None:
    """Why `name` is no tenant a token may name (a reason of `REASONS`), or None."""
    if not jobs.DNS_LABEL.fullmatch(name):
        return TENANT_NOT_DNS_LABEL
    if rules.tenants is not None and name not in rules.tenants:
        return TENANT_NOT_ALLOWED
    return None


def grants_of(claims: Mapping[str, Any], rules: ClaimRules) -> Mapped:
    """The gpufed roles a verified token's claims grant, and the claims refused."""
    mapped = Mapped()
    tenant, tenant_named = _claimed_tenant(claims, rules, mapped)
    fleet = rules.fleet_roles()
    for group in _strings(claims.get(rules.groups_claim)):
        role = fleet.get(group)
        if role is None:
            if rules.role_claim is None and group.startswith(rules.group_prefix):
                _add_group(mapped, group, tenant, tenant_named=tenant_named, rules=rules)
        elif role == roles.Role.VIEWER and tenant_named and rules.fleet_groups is None:
            if tenant is not None:  # the default viewer group in a token naming a tenant
                mapped.grants.append(Grant(role, tenant))
        else:
            mapped.grants.append(Grant(role))
    if rules.role_claim is not None:
        for name in _strings(claims.get(rules.role_claim)):
            _add_tenant_role(
                mapped, name, tenant, tenant_named=tenant_named, refused=(rules.role_claim, name)
            )
    return mapped


def _claimed_tenant(
    claims: Mapping[str, Any], rules: ClaimRules, mapped: Mapped
) -> tuple[str | None, bool]:
    """The tenant claim's tenant (None: absent or refused) and whether the token names one."""
    if rules.tenant_claim is None or rules.tenant_claim not in claims:
        return None, False
    value = claims[rules.tenant_claim]
    problem = tenant_problem(value, rules) if isinstance(value, str) else TENANT_NOT_DNS_LABEL
    if problem is not None:
        mapped.refused.append(Refusal(problem, rules.tenant_claim, shown(value)))
        return None, True
    return value, True


def _add_group(
    mapped: Mapped, group: str, tenant: str | None, *, tenant_named: bool, rules: ClaimRules
) -> None:
    """A group of the prefix that is no fleet group: `TENANT:ROLE` or a plain `ROLE`."""
    head, colon, name = group.removeprefix(rules.group_prefix).rpartition(":")
    if not colon:  # a plain role: of the tenant claim's tenant
        _add_tenant_role(
            mapped, name, tenant, tenant_named=tenant_named, refused=(rules.groups_claim, group)
        )
        return
    if _role(name) is None:
        return  # another application's group, or agent: never from OIDC
    problem = tenant_problem(head, rules)
    if problem is not None:
        mapped.refused.append(Refusal(problem, rules.groups_claim, shown(group)))
        return
    _add_tenant_role(mapped, name, head, tenant_named=True, refused=(rules.groups_claim, group))


def _add_tenant_role(
    mapped: Mapped,
    name: str,
    tenant: str | None,
    *,
    tenant_named: bool,
    refused: tuple[str, str],
) -> None:
    """`name` as a role of `tenant`: admin is its tenant-admin; metrics, or a fleet role
    where no tenant is named, grants nothing (`refused`: the claim and value to report)."""
    role = _role(name)
    if role is None:
        return
    if role == roles.Role.METRICS or (role in FLEET_ROLES and not tenant_named):
        claim, value = refused
        mapped.refused.append(Refusal(FLEET_ROLE_OUTSIDE_FLEET_GROUPS, claim, shown(value)))
        return
    if role == roles.Role.ADMIN:
        role = roles.Role.TENANT_ADMIN
    if tenant is not None:  # None: the tenant was refused, or none was named
        mapped.grants.append(Grant(role, tenant))


def _role(name: str) -> roles.Role | None:
    """The gpufed role `name` spells; None for another application's role and for agent."""
    try:
        role = roles.Role(name)
    except ValueError:
        return None
    return None if role == roles.Role.AGENT else role


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, str)]
    return []


def choose(mapped: Mapped, *, who: str) -> Grant:
    """The grant a principal acts with: the strongest; Forbidden if none, or several
    tenants."""
    grants = mapped.grants
    if not grants:
        refused = "; ".join(refusal.describe() for refusal in mapped.refused[:3])
        raise errors.Forbidden(
            f"this OIDC token ({who}) grants no gpufed role" + (f": {refused}" if refused else ""),
            field=mapped.refused[0].claim if mapped.refused else None,
        )
    best = min(grants, key=lambda g: (_STRENGTH.index(g.role), g.tenant is None))
    if best.role == roles.Role.ADMIN:
        return best
    tenants = sorted({g.tenant for g in grants if g.tenant is not None})
    if len(tenants) > 1:
        raise errors.Forbidden(
            f"this OIDC token ({who}) grants roles in tenants {', '.join(tenants)}: one "
            "identity acts for one tenant (ask for a token of one)"
        )
    return best
