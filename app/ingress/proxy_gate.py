"""A quick 503 from Serve's HTTP proxy while the app's ingress has no running replica yet.

Serve's proxy learns an app's route as soon as the app is deployed, and from then on hands each
request to the ingress deployment's handle, which waits for a running replica. While the first
ingress replica starts (~20 s on the embedded default, with the engines loading beside it),
``/health``, ``/ready`` and completions would hang until client timeouts. This middleware runs in
every proxy (Serve's ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``: ``PROXY_ENV``, which every way of
starting Ray here sets) and answers such requests at once: 503, ``Retry-After`` and an OpenAI-style
error (``/ready``: the readiness body's shape). Once the route's handle has seen a running replica it
steps aside for good: a replaced ingress is covered by surge (``ingress.max_surge_percent``), and a
handle that later has no replica does what Serve does (it waits, for the replacement).

Before any app is deployed (Serve's route table still empty) it answers the same 503, not Serve's 404.
Serve's own ``/-/healthz`` and ``/-/routes`` pass through. Kept light: the proxy imports it, so it
imports only the standard library, Starlette and ``readiness``'s constants.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.middleware import Middleware

from app.ingress.readiness import RETRY_AFTER_S

logger = logging.getLogger("ray.serve." + __name__)

PROXY_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": f"{__name__}:middlewares"}


def middlewares() -> list[Middleware]:
    """What Serve's proxy calls (``PROXY_ENV``) for the middlewares it wraps its ASGI app in."""
    return [Middleware(StartingGate)]


def starting_body(path: str) -> dict[str, Any]:
    """The 503's body for ``path`` while no ingress replica runs, or no app is deployed yet (pure)."""
    if path == "/ready":
        return {"ready": False, "ingress": "starting: no replica running yet"}
    return {"error": {
        "message": f"the app is starting: no ingress replica is running yet; retry after {RETRY_AFTER_S} s, "
                   "or wait for GET /ready to answer 200",
        "type": "server_error", "param": None, "code": 503,
    }}


def _proxy_router(app: Any) -> Any | None:
    """Serve's ``ProxyRouter`` under ``app``: the middlewares before ours each keep the app they wrap in ``_app``
    (``RequestIdMiddleware``) or ``app``; the innermost is the ``HTTPProxy``, which holds the router."""
    for _ in range(8):
        if (router := getattr(app, "proxy_router", None)) is not None:
            return router
        app = getattr(app, "_app", None) or getattr(app, "app", None)
        if app is None:
            return None
    return None


class StartingGate:
    """A pure ASGI middleware: open once each matched route's handle has seen a running replica."""

    def __init__(self, app: Any):
        self.app = app
        self._router = _proxy_router(app)
        self._open_routes: set[str] = set()
        if self._router is None:
            logger.warning("proxy_gate: Serve's proxy router was not found under the proxy's app; requests that "
                           "come before the ingress runs will wait for it (connector/seams.py, HTTPProxy.proxy_router)")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self._router is None:
            return await self.app(scope, receive, send)
        path = scope.get("path", "")[len(scope.get("root_path", "")):]
        if path.startswith("/-/"):  # Serve's own routes
            return await self.app(scope, receive, send)
        if not self._router.ready_for_traffic(True)[0]:  # no app deployed yet: not a 404 to a client that retries
            return await _send_json(send, 503, starting_body(path), {"retry-after": str(RETRY_AFTER_S)})
        matched = self._router.match_route(path)
        if matched is None:  # a 404 (no such app): Serve answers at once
            return await self.app(scope, receive, send)
        route, handle = matched[0], matched[1]
        if route in self._open_routes or handle.running_replicas_populated():
            if route not in self._open_routes:
                self._open_routes.add(route)
                logger.info("proxy_gate: %s has a running ingress replica; requests pass from now on", route)
            return await self.app(scope, receive, send)
        await _send_json(send, 503, starting_body(path), {"retry-after": str(RETRY_AFTER_S)})


async def _send_json(send, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    raw = json.dumps(body).encode()
    header_list = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    header_list += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": header_list})
    await send({"type": "http.response.body", "body": raw})
