"""The proxy's starting gate (app.ingress.proxy_gate), inside Serve's own proxy middleware chain and route table:
Serve's ProxyRouter and middleware application are real; the handle is the one thing faked (a running replica)."""

from __future__ import annotations

import asyncio
import json

import pytest
from ray.serve._private import http_util
from ray.serve._private.common import DeploymentID, EndpointInfo
from ray.serve._private.proxy_router import ProxyRouter
from ray.serve.config import HTTPOptions

from app.ingress.proxy_gate import PROXY_ENV, StartingGate
from app.ingress.readiness import RETRY_AFTER_S
from app.tools.procs import new_run_env


class _Handle:
    """Serve's handle as the proxy holds it: whether it has seen a running replica."""

    def __init__(self):
        self.populated = False

    def running_replicas_populated(self) -> bool:
        return self.populated


class _Proxy:
    """Stands where Serve's HTTPProxy stands: the innermost ASGI app, holding its router as ``proxy_router``."""

    def __init__(self, router: ProxyRouter):
        self.proxy_router = router
        self.reached: list[str] = []

    async def __call__(self, scope, receive, send):
        self.reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


@pytest.fixture
def proxy(monkeypatch):
    """Serve's proxy chain with the callback set as PROXY_ENV sets it, and one app at "/"."""
    (name, import_path), = PROXY_ENV.items()
    monkeypatch.setattr(http_util, name, import_path)  # Serve reads the variable once, when it is imported
    handle = _Handle()
    router = ProxyRouter(lambda endpoint, info: handle)
    router.update_routes({DeploymentID(name="OpenAiIngress", app_name="default"): EndpointInfo(route="/")})
    inner = _Proxy(router)
    app = http_util._apply_middlewares(inner, http_util.configure_http_middlewares(HTTPOptions()).middlewares)
    return app, inner, handle


def _get(app, path: str) -> tuple[int, dict[str, str], dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "headers": [], "query_string": b""}
    asyncio.run(app(scope, receive, send))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, json.loads(body)


def test_serves_proxy_installs_the_gate_from_the_variable_every_run_sets():
    assert set(PROXY_ENV.items()) <= set(new_run_env({}).items())
    assert new_run_env({**PROXY_ENV, "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "mine:cb"})[
        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "mine:cb", "a callback of the user's own is kept"


@pytest.mark.parametrize("path", ["/v1/completions", "/health", "/ready"])
def test_before_the_ingress_runs_the_proxy_answers_at_once_with_a_retryable_503(proxy, path):
    app, inner, _ = proxy
    status, headers, body = _get(app, path)
    assert (status, headers["retry-after"], inner.reached) == (503, str(RETRY_AFTER_S), [])
    if path == "/ready":
        assert body["ready"] is False and "starting" in body["ingress"], body
    else:
        assert body["error"]["code"] == 503 and "no ingress replica is running yet" in body["error"]["message"], body


def test_once_a_replica_has_run_every_request_passes_for_good(proxy):
    app, inner, handle = proxy
    handle.populated = True
    assert _get(app, "/v1/completions")[0] == 200
    handle.populated = False  # the handle of a replaced ingress: Serve's own wait, covered by surge
    assert _get(app, "/ready")[0] == 200 and inner.reached == ["/v1/completions", "/ready"]


def test_before_any_app_is_deployed_the_proxy_says_starting_not_404(proxy):
    app, inner, _ = proxy
    inner.proxy_router.__init__(inner.proxy_router._get_handle)  # Serve's router before its first route table
    status, headers, body = _get(app, "/v1/completions")
    assert (status, headers["retry-after"], inner.reached) == (503, str(RETRY_AFTER_S), []), body


def test_serves_own_routes_pass_before_the_ingress_runs(proxy):
    app, inner, _ = proxy
    assert _get(app, "/-/healthz")[0] == 200 and inner.reached == ["/-/healthz"]


def test_without_serves_router_the_gate_steps_aside_and_says_so(caplog):
    reached = []

    async def bare(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    caplog.set_level("WARNING")
    assert _get(StartingGate(bare), "/v1/completions")[0] == 200 and reached == ["/v1/completions"]
    assert "proxy router was not found" in caplog.text
