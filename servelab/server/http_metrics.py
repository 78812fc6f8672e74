"""HTTP request metrics per route, as prometheus-fastapi-instrumentator names them (vLLM's
server uses it): `http_requests_total{handler,method,status}` and
`http_request_duration_seconds{handler,method}`.

One ASGI middleware, outermost but for CORS, so that the API-key and body-size refusals are
counted too. `handler` is the template of the route that served the request, read from the
scope once the router has run (`/v1/chat/completions`; behind a mount, its prefix and the
mounted app's route, such as `/lab/api/live`), or "none" for a request no route took (an
unknown path, or one the guard refused first): never the raw path, so a scanner probing random
URLs cannot grow the series without bound. Status codes are grouped (`2xx`, `4xx` ...),
as the instrumentator does by default. /metrics and /health are left out, as vLLM leaves them:
scrapes and probes would drown the API's own traffic.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from servelab.server.guards import OPEN_PATHS, ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from servelab.server.state import ServerState

UNMATCHED = "none"


def route_template(scope: Scope, root_path: str) -> str:
    """The template of the route that served `scope` (read once the router has run), behind the
    prefix of any mount it went through; "none" for a request no route took."""
    mount_prefix = scope.get("root_path", "")[len(root_path) :]
    route_path = getattr(scope.get("route"), "path", "")
    return mount_prefix + route_path or UNMATCHED


class HttpMetricsMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.state.is_attached or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        metrics = self.state.metrics
        root_path = scope.get("root_path", "")
        start = time.perf_counter()
        status_code = 500  # what the client gets if the app raises before it starts a response

        async def send_and_note(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            handler = route_template(scope, root_path)
            metrics.http.observe(handler, scope["method"], status_code, time.perf_counter() - start)


__all__ = ["HttpMetricsMiddleware", "route_template"]
