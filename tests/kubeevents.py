"""What the API server checks in an events.k8s.io/v1 Event beyond its OpenAPI schema (which
kubernetes-validate checks): tests only, for the Events the agent writes on Nodes."""

from __future__ import annotations

import re
from typing import Any

_QUALIFIED = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def api_server_problems(event: dict[str, Any]) -> list[str]:
    """What the API server's ValidateEventCreate refuses in an events.k8s.io/v1 Event that
    the OpenAPI schema lets through (pkg/apis/core/validation/events.go)."""
    name = event["metadata"]["name"]
    out = []
    if len(name) > 253 or not _SUBDOMAIN.match(name):
        out.append(f"metadata.name {name!r}")
    if not event.get("eventTime"):
        out.append("eventTime: required")
    if event.get("type") not in ("Normal", "Warning"):
        out.append("type")
    if not event.get("regarding", {}).get("namespace") and event["metadata"]["namespace"] not in (
        "default",
        "kube-system",
    ):
        out.append("regarding.namespace: does not match the Event's")
    controller = event.get("reportingController", "")
    if not _QUALIFIED.match(controller) or len(controller.split("/")[-1]) > 63:
        out.append("reportingController")
    for field in ("reportingInstance", "action", "reason"):
        if not event.get(field) or len(event[field]) > 128:
            out.append(f"{field}: required, at most 128")
    if len(event.get("note", "").encode()) > 1024:
        out.append("note: at most 1 KiB")
    for unset in ("deprecatedFirstTimestamp", "deprecatedLastTimestamp", "deprecatedCount"):
        if unset in event:
            out.append(f"{unset}: must be unset")
    return out
