"""`GET /openapi.json`: the API described from the same pydantic models it validates with."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic.json_schema import models_json_schema

from broker.api import inventory, jobs, queues, replicas, status

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


def build_spec() -> dict[str, Any]:
    _, schemas = models_json_schema(
        [
            (jobs.GPUJob, "validation"),
            (status.JobRecord, "serialization"),
            (status.JobList, "serialization"),
            (status.SubmitResponse, "serialization"),
            (inventory.ClusterView, "serialization"),
            (queues.QueueSpec, "validation"),
            (queues.QueueList, "serialization"),
            (queues.QueueView, "serialization"),
            (queues.WhyAnswer, "serialization"),
            (replicas.ReplicaStatus, "serialization"),
        ],
        by_alias=True,
        ref_template="#/components/schemas/{model}",
    )
    components = schemas.get("$defs", {})
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
                            "makes a new job."
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
                        "summary": "List jobs of the caller's tenant",
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
                            {"name": "limit", "in": "query", "schema": {"type": "integer"}},
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
                        "summary": "Queues: quotas, usage, fair share (admin sees all)",
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
                        "summary": "Create or replace a queue (admin token)",
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
                        "summary": "Delete a queue stored through the API (admin token)",
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
                        "summary": "Member clusters: health and GPUs by model",
                        "responses": {"200": {"description": "clusters"}, **auth_errors},
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
            },
        }
    )


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(build_spec())


def add_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi)
