"""Security headers on the broker's answers.

Every answer says `X-Content-Type-Options: nosniff` (a JSON body is never run as script).
An HTML answer — the web console under `/ui/`, whoever serves it — also says it may not be
framed by another site (`X-Frame-Options: DENY`, CSP `frame-ancestors 'none'`) and sends no
referrer. A handler that sets one of these itself (a console's own Content-Security-Policy)
keeps its own; a CSP without `frame-ancestors` gets it added.

It is a response-prepare hook rather than a middleware so that it sees every answer the
way it is sent: static files (whose content type is only known when they are prepared),
aiohttp's own 404s and 405s, and error pages alike.
"""

from __future__ import annotations

from aiohttp import web

ALWAYS = {"X-Content-Type-Options": "nosniff"}
HTML = {
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
FRAME_ANCESTORS = "frame-ancestors 'none'"
HTML_TYPES = ("text/html", "application/xhtml+xml")


async def add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    headers = response.headers
    for name, value in ALWAYS.items():
        headers.setdefault(name, value)
    if not response.content_type.startswith(HTML_TYPES):
        return
    for name, value in HTML.items():
        headers.setdefault(name, value)
    policy = headers.get("Content-Security-Policy")
    if policy is None:
        headers["Content-Security-Policy"] = FRAME_ANCESTORS
    elif "frame-ancestors" not in policy:
        headers["Content-Security-Policy"] = f"{policy.rstrip('; ')}; {FRAME_ANCESTORS}"


def install(app: web.Application) -> None:
    app.on_response_prepare.append(add_security_headers)
