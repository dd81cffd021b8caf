"""`GET /openapi.json`: the API described from the same pydantic models it validates with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web
from pydantic.json_schema import models_json_schema

from broker.api import gpumap, inventory, jobs, queues, replicas, status, submits
from broker.http import auth, console, roles
from broker.state.history import query as queries

PROBLEM = {"$ref": "#/components/schemas/Problem"}


def _problem(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/problem+json": {"schema": PROBLEM}},
    }


def _with_common_answers(spec: dict[str, Any]) -> dict[str, Any]:
    """Every operation declares what any route may answer: 401/403 and 503 (the store does
    not answer; Retry-After) where a token is needed, 400 for a malformed query or body,
    413 and 422 for a body that is too large or invalid."""
    for item in spec["paths"].values():
        for method, operation in item.items():
            if method == "parameters":
                continue
            responses = operation["responses"]
            if operation.get("security") != []:
                responses.setdefault("401", _problem("missing or unknown token"))
                responses.setdefault("403", _problem("not allowed"))
                responses.setdefault("503", _problem("the store does not answer; retry"))
                if method in ("post", "put", "delete"):  # a write the store may refuse
                    responses.setdefault(
                        "507", _problem("the store is full (store-full): nothing was written")
                    )
            queried = any(p.get("in") == "query" for p in operation.get("parameters", []))
            if queried or "requestBody" in operation:
                responses.setdefault("400", _problem("malformed query or body"))
            if "requestBody" in operation:
                responses.setdefault("413", _problem("body too large"))
                responses.setdefault("422", _problem("invalid body: the field is named"))
    return spec


def _with_roles(
    spec: dict[str, Any], access: Mapping[tuple[str, str], roles.Rule]
) -> dict[str, Any]:
    """Every operation states its rule of `broker.http.roles`: no token (`security: []`), or
    the roles it allows (`x-gpufed-roles`, and in words in its description and 403)."""
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            rule = roles.rule_of(access, method.upper(), path) if method != "parameters" else None
            if rule is None:
                continue
            if rule.public:
                operation["security"] = []
                for status_code in ("401", "403", "503", "507"):
                    operation["responses"].pop(status_code, None)
                continue
            operation.pop("security", None)
            _with_common_answers({"paths": {path: {method: operation}}})
            allowed = roles.spell(rule.roles)
            operation["x-gpufed-roles"] = [
                "agent:<cluster>" if r == roles.Role.AGENT else r.value
                for r in roles.Role
                if r in rule.roles
            ]
            words = f"Roles: {allowed} ({rule.what})."
            operation["description"] = " ".join(filter(None, [operation.get("description"), words]))
            responses = operation["responses"]
            responses["401"] = _problem(
                "missing or unknown token; an expired one: urn:gpufed:problem:token-expired"
            )
            responses["403"] = _problem(f"the token's role is not {allowed} (the role is named)")
    return spec


def build_spec(access: Mapping[tuple[str, str], roles.Rule] = roles.ROUTES) -> dict[str, Any]:
    """The document of a broker serving with the rules `access` (`roles.table`)."""
    return _with_roles(_document(), access)


def _document() -> dict[str, Any]:
    _, schemas = models_json_schema(
        [
            (jobs.GPUJob, "validation"),
            (status.JobRecord, "serialization"),
            (status.JobList, "serialization"),
            (status.SubmitResponse, "serialization"),
            (submits.BatchSubmit, "validation"),
            (submits.BatchAnswer, "serialization"),
            (inventory.ClusterView, "serialization"),
            (queues.QueueSpec, "validation"),
            (queues.QueueList, "serialization"),
            (queues.QueueView, "serialization"),
            (queues.WhyAnswer, "serialization"),
            (replicas.ReplicaStatus, "serialization"),
            (gpumap.GpuMap, "serialization"),
        ],
        by_alias=True,
        ref_template="#/components/schemas/{model}",
    )
    components = schemas.get("$defs", {})
    # a batch item's problem is the Problem every refusal is (a dict to pydantic)
    components["BatchItemAnswer"]["properties"]["problem"] = {"anyOf": [PROBLEM, {"type": "null"}]}
    # a batch item's job is a GPUJob, described here without the reference: two levels
    # deeper than POST /v1/jobs's body, schemathesis (hypothesis, on CPython 3.11.7) hits a
    # recursion bug while generating it ("AST constructor recursion depth mismatch")
    components["BatchItem"]["properties"]["job"] = {
        "type": "object",
        "description": "a GPUJob (schema GPUJob), held to every rule of POST /v1/jobs",
    }
    components["Problem"] = {
        "type": "object",
        "properties": {
            "type": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "field": {"type": "string"},
            "instance": {"type": "string"},
            "errors": {"type": "array", "items": {"type": "object"}},
            "leader": {
                "type": ["string", "null"],
                "description": "not-leader: the leader's advertise URL (null: none known yet)",
            },
        },
        "required": ["title", "status", "detail"],
    }

    def ref(name: str) -> dict[str, Any]:
        return {"$ref": f"#/components/schemas/{name}"}

    job_id = [{"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    auth_errors = {"401": _problem("missing or unknown token"), "403": _problem("not allowed")}
    return _with_common_answers(
        {
            "openapi": "3.1.0",
            "info": {"title": "gpufed broker", "version": "1"},
            "components": {
                "schemas": components,
                "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            },
            "security": [{"bearer": []}],
            "paths": {
                "/v1/jobs": {
                    "post": {
                        "summary": "Submit a GPUJob (JSON or YAML); Idempotency-Key honoured",
                        "description": (
                            "The same Idempotency-Key with the same body within 24 h (the broker's "
                            "idempotency window) answers the first job again, with the header "
                            "Idempotent-Replayed: true; with another body it is a 422 of type "
                            "urn:gpufed:problem:idempotency-key-reused. After the window the key "
                            "makes a new job. A job with spec.dependsOn is stored Waiting (a "
                            "dependency cycle is a 422 naming spec.dependsOn[i].job); one with "
                            "spec.array stores spec.array.count jobs `<name>-<i>` (ids "
                            "`<array.id>-<i>`), the answer naming index 0 and the array."
                        ),
                        "parameters": [
                            {
                                "name": "Idempotency-Key",
                                "in": "header",
                                "schema": {"type": "string", "minLength": 1, "maxLength": 255},
                            }
                        ],
                        "requestBody": {
                            "required": True,
                            "content": {
                                "application/json": {"schema": ref("GPUJob")},
                                "application/yaml": {"schema": ref("GPUJob")},
                            },
                        },
                        "responses": {
                            "202": {
                                "description": "queued",
                                "content": {"application/json": {"schema": ref("SubmitResponse")}},
                            },
                            "400": _problem("malformed body"),
                            "413": _problem("body over 1 MiB"),
                            "422": _problem(
                                "invalid job: the field is named; or idempotency-key-reused: "
                                "the key was used for another body"
                            ),
                            **auth_errors,
                        },
                    },
                    "get": {
                        "summary": "List jobs of the caller's tenant, live and finished",
                        "description": (
                            "Newest first: live jobs by creation, then finished ones (from "
                            "the store and from history) by finish time; sort=oldest reverses "
                            "it. A page ends with metadata.continue while more follow: pass it "
                            "as continue, with the same filters, q and sort, for the next page."
                        ),
                        "parameters": [
                            {"name": "queue", "in": "query", "schema": {"type": "string"}},
                            {
                                "name": "state",
                                "in": "query",
                                "schema": {
                                    "type": "string",
                                    "enum": [s.value for s in status.JobState],
                                },
                            },
                            {"name": "cluster", "in": "query", "schema": {"type": "string"}},
                            {
                                "name": "labelSelector",
                                "in": "query",
                                "description": "Kubernetes label selector on metadata.labels",
                                "schema": {"type": "string"},
                            },
                            {
                                "name": "finishedAfter",
                                "in": "query",
                                "schema": {"type": "string", "format": "date-time"},
                            },
                            {
                                "name": "finishedBefore",
                                "in": "query",
                                "schema": {"type": "string", "format": "date-time"},
                            },
                            {
                                "name": "q",
                                "in": "query",
                                "description": (
                                    "text the job's name (metadata.name) or id holds, ASCII "
                                    "case ignored; % and _ are plain characters"
                                ),
                                "schema": {"type": "string", "maxLength": queries.MAX_TEXT},
                            },
                            {
                                "name": "sort",
                                "in": "query",
                                "description": (
                                    "newest: live jobs newest created first, then finished "
                                    "ones latest finished first; oldest: the reverse"
                                ),
                                "schema": {
                                    "type": "string",
                                    "enum": [o.value for o in queries.Order],
                                    "default": queries.Order.NEWEST.value,
                                },
                            },
                            {
                                "name": "limit",
                                "in": "query",
                                "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                            },
                            {"name": "continue", "in": "query", "schema": {"type": "string"}},
                        ],
                        "responses": {
                            "200": {
                                "description": "jobs",
                                "content": {"application/json": {"schema": ref("JobList")}},
                            },
                            **auth_errors,
                        },
                    },
                },
                "/v1/jobs:batch": {
                    "post": {
                        "summary": "Submit up to 1000 GPUJobs in one body, each with its own key",
                        "description": (
                            "Every item is held to the checks of POST /v1/jobs, and answered on "
                            "its own, in request order: 202 queued, 200 its idempotencyKey's job "
                            "replayed, or the 4xx a single submit would have had (problem, the "
                            "field named from the body: items[3].job.spec.queue), nothing "
                            "stored for it; the valid items are stored together. A key used "
                            "twice in one batch: the later item replays the earlier one's job "
                            "with the same body, and is a 422 idempotency-key-reused with "
                            "another. A body that is not a batch (not JSON or YAML, no items, "
                            "none or over 1000, over 8 MiB) is one problem and stores nothing. "
                            "Keys go in the items: the Idempotency-Key header is refused (400)."
                        ),
                        "requestBody": {
                            "required": True,
                            "content": {
                                "application/json": {"schema": ref("BatchSubmit")},
                                "application/yaml": {"schema": ref("BatchSubmit")},
                            },
                        },
                        "responses": {
                            "200": {
                                "description": "one answer per item, in request order",
                                "content": {"application/json": {"schema": ref("BatchAnswer")}},
                            },
                            "400": _problem("malformed body, or an Idempotency-Key header"),
                            "413": _problem("body over 8 MiB"),
                            "422": _problem("not a batch: the field (items) is named"),
                            **auth_errors,
                        },
                    },
                },
                "/v1/jobs/{job_id}": {
                    "parameters": job_id,
                    "get": {
                        "summary": "One job with its status and history",
                        "responses": {
                            "200": {
                                "description": "the job",
                                "content": {"application/json": {"schema": ref("JobRecord")}},
                            },
                            "404": _problem("no such job"),
                            **auth_errors,
                        },
                    },
                    "delete": {
                        "summary": "Cancel a job",
                        "responses": {
                            "202": {
                                "description": "cancelling",
                                "content": {"application/json": {"schema": ref("JobRecord")}},
                            },
                            "404": _problem("no such job"),
                            **auth_errors,
                        },
                    },
                },
                "/v1/arrays/{array}": {
                    "parameters": [
                        {
                            "name": "array",
                            "in": "path",
                            "required": True,
                            "description": "an array's id, or its name: the caller's newest "
                            "array of that name",
                            "schema": {"type": "string"},
                        }
                    ],
                    "delete": {
                        "summary": "Cancel an array's jobs (spec.array), or one index of it",
                        "description": (
                            "Every job of the array not finished yet is cancelled as DELETE "
                            "/v1/jobs/{id} would; with index, only that one. List an array with "
                            "GET /v1/jobs?labelSelector=gpufed.io/array=<name> (and "
                            ",gpufed.io/array-index=<i> for one index)."
                        ),
                        "parameters": [
                            {
                                "name": "index",
                                "in": "query",
                                "description": "cancel only the job of this index",
                                "schema": {"type": "integer", "minimum": 0},
                            }
                        ],
                        "responses": {
                            "202": {
                                "description": "the array's jobs as committed",
                                "content": {"application/json": {"schema": ref("JobList")}},
                            },
                            "404": _problem("no such array (or index) with jobs not yet retired"),
                            **auth_errors,
                        },
                    },
                },
                "/v1/jobs/{job_id}/why": {
                    "parameters": job_id,
                    "get": {
                        "summary": "Why a job is not placed, per cluster",
                        "responses": {
                            "200": {"description": "reasons"},
                            "404": _problem("no such job"),
                            **auth_errors,
                        },
                    },
                },
                "/v1/queues": {
                    "get": {
                        "summary": "Queues: quotas, usage, fair share (a tenant sees its own)",
                        "responses": {
                            "200": {
                                "description": "queues",
                                "content": {"application/json": {"schema": ref("QueueList")}},
                            },
                            **auth_errors,
                        },
                    },
                },
                "/v1/queues/{name}": {
                    "parameters": [
                        {
                            "name": "name",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "get": {
                        "summary": "One queue",
                        "responses": {
                            "200": {
                                "description": "the queue",
                                "content": {"application/json": {"schema": ref("QueueView")}},
                            },
                            "404": _problem("no such queue"),
                            **auth_errors,
                        },
                    },
                    "put": {
                        "summary": "Create or replace a queue",
                        "requestBody": {
                            "required": True,
                            "content": {"application/json": {"schema": ref("QueueSpec")}},
                        },
                        "responses": {
                            "200": {
                                "description": "replaced; warnings listed",
                                "content": {"application/json": {"schema": ref("QueueView")}},
                            },
                            "201": {
                                "description": "created; warnings listed",
                                "content": {"application/json": {"schema": ref("QueueView")}},
                            },
                            "400": _problem("malformed body"),
                            "422": _problem("invalid queue: the field is named; nothing stored"),
                            **auth_errors,
                        },
                    },
                    "delete": {
                        "summary": "Delete a queue stored through the API",
                        "description": (
                            "A queue stored through the API only, with no unfinished job, is "
                            "deleted (204). A queue of the queues file overridden by a PUT gets "
                            "the file's definition back (200, the queue as it is now). A queue "
                            "only in the file cannot be deleted through the API (409)."
                        ),
                        "responses": {
                            "200": {
                                "description": "the override removed: the file's queue applies",
                                "content": {"application/json": {"schema": ref("QueueView")}},
                            },
                            "204": {"description": "deleted"},
                            "404": _problem("no such queue"),
                            "409": _problem(
                                "the queue has unfinished jobs (how many is said), "
                                "or is declared in the queues file"
                            ),
                            **auth_errors,
                        },
                    },
                },
                "/v1/clusters": {
                    "get": {
                        "summary": "Member clusters: health, GPUs and MIG devices by model",
                        "responses": {
                            "200": {
                                "description": "clusters",
                                "content": {
                                    "application/json": {
                                        "schema": {
                                            "type": "object",
                                            "required": ["items"],
                                            "properties": {
                                                "items": {
                                                    "type": "array",
                                                    "items": ref("ClusterView"),
                                                }
                                            },
                                        }
                                    }
                                },
                            },
                            **auth_errors,
                        },
                    }
                },
                "/v1/agents/connect": {
                    "get": {
                        "summary": "Agent WebSocket session (agent token), on the leader only",
                        "description": (
                            "A replica that does not lead (or a leader still syncing its "
                            "cache) answers 409 of type urn:gpufed:problem:not-leader, with "
                            "the leader's advertise URL in `leader` (null if none is known) "
                            "and Retry-After: 1."
                        ),
                        "responses": {
                            "101": {"description": "upgraded"},
                            "409": {
                                "description": "not the leader: connect to `leader`",
                                "headers": {"Retry-After": {"schema": {"type": "integer"}}},
                                "content": {"application/problem+json": {"schema": PROBLEM}},
                            },
                        },
                    }
                },
                "/v1/status": {
                    "get": {
                        "summary": "This replica: its role, the leader, the term, cache synced",
                        "security": [],
                        "responses": {
                            "200": {
                                "description": "the replica's status",
                                "content": {"application/json": {"schema": ref("ReplicaStatus")}},
                            },
                            "503": _problem("the broker is starting"),
                        },
                    }
                },
                "/openapi.json": {
                    "get": {"security": [], "responses": {"200": {"description": "this document"}}}
                },
                "/healthz": {
                    "get": {"security": [], "responses": {"200": {"description": "alive"}}}
                },
                "/readyz": {
                    "get": {
                        "security": [],
                        "responses": {
                            "200": {"description": "ready"},
                            "503": _problem("not ready"),
                        },
                    }
                },
                "/metrics": {
                    "get": {"security": [], "responses": {"200": {"description": "Prometheus"}}}
                },
                **console.openapi_paths(_problem),
            },
        }
    )


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(build_spec(request.app[auth.ACCESS]))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi)
