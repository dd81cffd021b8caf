"""The web console at `/ui/`: static pages the broker serves, and `GET /v1/whoami`.

The console is a few files of HTML, CSS and JavaScript modules (`broker/http/static/`, package
data of the wheel): no build step, no CDN, nothing to run besides the broker. It holds no data
of its own: the browser reads the JSON API with the token the user signs in with (kept in
`sessionStorage`, sent as `Authorization: Bearer`, never in a URL), follows job changes on
`GET /v1/events` (`events`), and draws a cluster's GPU map from
`GET /v1/clusters/{name}/gpus` (`gpumap`). So the pages need no token (`roles`: public) and
show nothing until the API answers them.

The files are read once, when the app is made, and served from memory by name: a path that is
not one of them is a 404 (no file system path is ever built from a request). The index names
the `--trace-url-template` in a `<meta>` tag, from which a job's page builds the link to its
trace (a Grafana Explore URL whose query is `{trace_id}`: the broker chart's traceUrlTemplate).
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

from aiohttp import web

from broker.api import errors
from broker.http import auth, events

TRACE_PLACEHOLDER = "{trace_id}"
_TEMPLATE_META = '<meta name="gpufed-trace-url-template" content="">'
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}


def check_trace_url_template(template: str) -> str | None:
    """What is wrong with a `--trace-url-template`, or None."""
    if TRACE_PLACEHOLDER not in template:
        return f"--trace-url-template: must contain {TRACE_PLACEHOLDER}"
    if not template.startswith(("http://", "https://")):
        return "--trace-url-template: must be an http:// or https:// URL"
    return None


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str


def _walk(folder: Traversable, prefix: str = "") -> dict[str, Asset]:
    found: dict[str, Asset] = {}
    for entry in folder.iterdir():
        name = f"{prefix}{entry.name}"
        if entry.is_dir():
            found.update(_walk(entry, f"{name}/"))
            continue
        suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
        content_type = _TYPES.get(suffix)
        if content_type is not None:
            found[name] = Asset(entry.read_bytes(), content_type)
    return found


def load_assets(*, trace_url_template: str | None = None) -> dict[str, Asset]:
    """Every file of the console by its path under /ui/, the index with the trace template."""
    assets = _walk(resources.files("broker.http").joinpath("static"))
    index = assets["index.html"].body.decode()
    if _TEMPLATE_META not in index:
        raise RuntimeError("broker/http/static/index.html lost its trace template <meta>")
    meta = _TEMPLATE_META.replace(
        'content=""', f'content="{html.escape(trace_url_template or "", quote=True)}"'
    )
    assets["index.html"] = Asset(index.replace(_TEMPLATE_META, meta).encode(), _TYPES[".html"])
    return assets


ASSETS = web.AppKey("console_assets", dict[str, Asset])


# the console's own policy: its files only, no inline script or style, no other origin
# (`headers` adds frame-ancestors to it)
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'"
)


def _answer(asset: Asset) -> web.Response:
    # no-cache: the browser asks again (cheaply) and never runs an older console's modules
    # against a newer broker
    headers = {"Cache-Control": "no-cache"}
    if asset.content_type.startswith("text/html"):
        headers["Content-Security-Policy"] = POLICY
    return web.Response(
        body=asset.body,
        content_type=asset.content_type.split(";")[0],
        charset="utf-8" if "charset" in asset.content_type else None,
        headers=headers,
    )


async def root(request: web.Request) -> web.StreamResponse:
    raise web.HTTPPermanentRedirect("/ui/")


async def index(request: web.Request) -> web.Response:
    return _answer(request.app[ASSETS]["index.html"])


async def asset(request: web.Request) -> web.Response:
    found = request.app[ASSETS].get(request.match_info["path"])
    if found is None:
        raise errors.NotFound(f"no console file {request.match_info['path']!r}")
    return _answer(found)


async def whoami(request: web.Request) -> web.Response:
    """Who the token names: what the console shows and what it offers (Cancel)."""
    return web.json_response(events.describe(auth.caller(request)))


def add_routes(app: web.Application, *, trace_url_template: str | None = None) -> None:
    app[ASSETS] = load_assets(trace_url_template=trace_url_template)
    app.router.add_get("/ui", root)
    app.router.add_get("/ui/", index)
    app.router.add_get("/ui/{path:.+}", asset)
    app.router.add_get("/v1/whoami", whoami)


def openapi_paths(problem: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """The console's and its routes' part of `/openapi.json` (`problem`: a problem answer)."""
    path = [{"name": "path", "in": "path", "required": True, "schema": {"type": "string"}}]
    name = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
    html_page = {"text/html": {"schema": {"type": "string"}}}
    return {
        "/v1/whoami": {
            "get": {
                "summary": "Who the token names: role, tenant (the console's sign-in)",
                "responses": {"200": {"description": "the caller"}},
            }
        },
        "/v1/events": {
            "get": {
                "summary": "Job changes the caller may see, live (server-sent events)",
                "description": (
                    "text/event-stream: `hello` first, then `job` (a JobRecord) for each job "
                    "changed, coalesced over a quarter of a second; `resync` when too many "
                    "changed at once (read GET /v1/jobs again); `bye` when the token is no "
                    "longer valid. Send the token in the Authorization header."
                ),
                "responses": {
                    "200": {
                        "description": "the stream",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}},
                    },
                },
            }
        },
        "/v1/clusters/{name}/gpus": {
            "get": {
                "summary": "A cluster's GPU map: every node a row of GPU cells",
                "parameters": name,
                "responses": {
                    "200": {
                        "description": "the map",
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/GpuMap"}}
                        },
                    },
                    "404": problem("no such cluster"),
                    "503": problem("a follower whose leader did not answer"),
                },
            }
        },
        "/ui": {
            "get": {
                "summary": "The web console (redirects to /ui/)",
                "security": [],
                "responses": {"308": {"description": "to /ui/"}},
            }
        },
        "/ui/": {
            "get": {
                "summary": "The web console",
                "security": [],
                "responses": {"200": {"description": "its page", "content": html_page}},
            }
        },
        "/ui/{path}": {
            "get": {
                "summary": "A file of the web console (scripts, styles)",
                "security": [],
                "parameters": path,
                "responses": {
                    "200": {"description": "the file"},
                    "404": problem("not a file of the console"),
                },
            }
        },
    }
