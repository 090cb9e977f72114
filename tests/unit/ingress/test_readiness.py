"""app.ingress.readiness: when the app can answer (a table), how Serve's replica states are read,
and what /ready and generation requests get on the real ingress app (app.ingress.server)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from app.config.args import IngressArgs
from app.ingress.readiness import (
    REFRESH_S,
    RETRY_AFTER_S,
    Deployment,
    ReadinessProbe,
    Replicas,
    decide,
    replicas_by_role,
    start_failure,
)
from app.ingress.server import make_app

UP, DOWN, TWO = Replicas(1, 1), Replicas(0, 1), Replicas(1, 2)


@pytest.mark.parametrize(
    "decode, prefill, prefill_was_up, ready, decode_text, prefill_text",
    [
        (UP, UP, False, True, "1/1 replicas ready", "1/1 replicas ready"),
        (TWO, UP, True, True, "1/2 replicas ready", "1/1 replicas ready"),  # one of two decode replicas replaced
        (DOWN, UP, True, False, "0/1 replicas ready (starting or replaced)", "1/1 replicas ready"),
        (DOWN, DOWN, False, False, "0/1 replicas ready (starting or replaced)", "starting"),  # start-up
        (UP, DOWN, False, False, "1/1 replicas ready", "starting"),  # prefill never up yet: requests would wait
        (UP, DOWN, True, True, "1/1 replicas ready", "0/1 replicas ready: decode replicas prefill locally"),
        (UP, None, True, True, "1/1 replicas ready", "0/0 replicas ready: decode replicas prefill locally"),
        (None, None, False, False, "not deployed", "not deployed"),  # Serve has not created the app yet
    ],
)
def test_when_the_app_can_answer(decode, prefill, prefill_was_up, ready, decode_text, prefill_text):
    state = decide("push", decode, prefill, prefill_was_up)
    assert (state.ready, state.decode, state.prefill) == (ready, decode_text, prefill_text)
    assert state.body()["ready"] is ready and state.body()["mode"] == "push"


def test_replicas_are_counted_by_role_from_serves_states():
    states = {
        "OpenAiIngress": {"RUNNING": 1},
        "Decode:SmolLM2-135M-Instruct": {"RUNNING": 1, "STARTING": 1},
        "Prefill:SmolLM2-135M-Instruct": {"STARTING": 1},
        "Decode:other-model": {"RUNNING": 2},
    }
    assert replicas_by_role(states) == (Replicas(3, 4), Replicas(0, 1))
    assert replicas_by_role({"OpenAiIngress": {"RUNNING": 1}}) == (None, None)


@pytest.mark.parametrize("state, serving", [
    ("RUNNING", True),
    ("RECOVERING", True),  # a controller back after a head restart re-attaches it: it never stopped serving
    ("PENDING_MIGRATION", True),  # its node drains: it serves until its replacement runs
    ("STARTING", False), ("UPDATING", False), ("STOPPING", False),
])
def test_a_replica_counts_as_ready_in_each_state_in_which_it_serves(state, serving):
    decode, _ = replicas_by_role({"Decode:m": {state: 1}})
    assert decide("push", decode, Replicas(1, 1), True).ready is serving


_PORT_BUSY = ("A replica failed to start with exception. Retrying 2 more time(s). Error:\nTraceback (most recent call last):\n"
              "  File \"connector/port_check.py\", line 60, in wait_until_free\n"
              "connector.port_check.PortBusy: decode NIXL side-channel port 10.0.0.5:22000 is held by pid 77 (VLLM::EngineCore)\n")


@pytest.mark.parametrize("deployments, expected", [
    ({"Decode:m": Deployment({"STARTING": 1}, "UPDATING", _PORT_BUSY), "Prefill:m": Deployment({"RUNNING": 1}, "HEALTHY")},
     "decode replicas fail to start; Serve retries: connector.port_check.PortBusy: decode NIXL side-channel port "
     "10.0.0.5:22000 is held by pid 77 (VLLM::EngineCore)"),
    ({"Prefill:m": Deployment({}, "DEPLOY_FAILED", "The deployment failed to start 3 times in a row.\nError:\nRuntimeError: boom")},
     "prefill replicas failed to start; Serve gave up: RuntimeError: boom"),
    ({"Prefill:m": Deployment({}, "DEPLOY_FAILED", "")}, "prefill replicas failed to start; Serve gave up: no reason given"),
    # Starting slowly, healthy, or a deployment that is not an engine's: nothing to say.
    ({"Decode:m": Deployment({"STARTING": 1}, "UPDATING", "Deployment 'Decode:m' has 1 replicas that have taken more "
                             "than 30s to initialize.")}, None),
    ({"Decode:m": Deployment({"RUNNING": 1}, "HEALTHY")}, None),
    ({"OpenAiIngress": Deployment({}, "DEPLOY_FAILED", "Error:\nValueError: bad")}, None),
])
def test_why_replicas_fail_to_start_is_serves_last_line(deployments, expected):
    assert start_failure(deployments) == expected


def test_a_start_failure_is_in_the_ready_body_only_while_there_is_one():
    state = decide("push", Replicas(0, 1), Replicas(1, 1), False, failure="decode replicas fail to start; Serve retries: x")
    assert state.body()["failure"] == "decode replicas fail to start; Serve retries: x" and not state.ready
    assert "failure" not in decide("push", Replicas(1, 1), Replicas(1, 1), False).body()


class _Serve:
    """Serve's replica states as the probe reads them; each read counted."""

    def __init__(self):
        self.states = {"Decode:m": {"STARTING": 1}, "Prefill:m": {"STARTING": 1}}
        self.reads = 0
        self.fail = False

    def __call__(self):
        self.reads += 1
        if self.fail:
            raise ConnectionError("controller unreachable")
        return {name: Deployment(states) for name, states in self.states.items()}


def test_the_probe_reads_serve_at_most_every_refresh_period_and_remembers_prefill_was_up():
    async def go():
        now = [0.0]
        serve = _Serve()
        probe = ReadinessProbe("pull", read_deployments=serve, clock=lambda: now[0])
        assert (await probe.fresh()).prefill == "starting" and serve.reads == 1
        assert not (await probe.fresh()).ready and serve.reads == 1  # within the period: no second read

        serve.states = {"Decode:m": {"RUNNING": 1}, "Prefill:m": {"RUNNING": 1}}
        now[0] += REFRESH_S + 0.1
        assert (await probe.current()).ready is False  # the last answer, at once; the next is read behind it
        await asyncio.sleep(0.05)
        assert (await probe.current()).ready is True and serve.reads == 2

        serve.states = {"Decode:m": {"RUNNING": 1}, "Prefill:m": {"STARTING": 1}}  # prefill replaced
        now[0] += REFRESH_S + 0.1
        state = await probe.fresh()
        assert state.ready and "prefill locally" in state.prefill

        serve.fail = True  # the controller is briefly away: the last answer stands
        now[0] += REFRESH_S + 0.1
        assert (await probe.fresh()) == state

    asyncio.run(go())


def _ingress(serve: _Serve):
    app = make_app(IngressArgs(), ReadinessProbe("push", read_deployments=serve))

    @app.post("/v1/completions")
    async def completions(body: dict):
        return {"ok": True}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    return app


def test_a_controller_that_does_not_answer_leaves_the_last_answer_standing_and_ready_answers_quickly():
    """Serve's controller restarting with the head (GCS fault tolerance): serve.status() waits for it. /ready
    must not: the pods' readiness probes would fail and empty the Service while every replica serves."""
    import threading

    async def go():
        now, answer = [0.0], threading.Event()
        serve = _Serve()
        serve.states = {"Decode:m": {"RUNNING": 1}, "Prefill:m": {"RUNNING": 1}}
        probe = ReadinessProbe("push", read_deployments=serve, clock=lambda: now[0], read_wait_s=0.2)
        ready = await probe.fresh()
        assert ready.ready and serve.reads == 1

        hung = lambda: answer.wait() and serve()  # noqa: E731  the controller is away until `answer` is set
        probe._read_deployments = hung
        now[0] += REFRESH_S + 0.1
        started = time.monotonic()
        assert await probe.fresh() == ready and await probe.fresh() == ready
        assert time.monotonic() - started < 1.0, "/ready waited on the controller"
        answer.set()  # back: the one read still out finishes, and the next answer is read as before
        await asyncio.sleep(0.1)
        assert serve.reads == 2

        unanswered = ReadinessProbe("push", read_deployments=lambda: threading.Event().wait(1), read_wait_s=0.2)
        assert (await unanswered.fresh()).ready is False  # never read yet: not ready, and said quickly

    asyncio.run(go())


def test_not_ready_is_a_503_on_ready_and_a_quick_503_for_generation_and_models_still_answer():
    async def go():
        serve = _Serve()
        app = _ingress(serve)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as client:
            ready = await client.get("/ready")
            assert ready.status_code == 503
            assert ready.json()["ready"] is False and ready.json()["prefill"] == "starting"
            generation = await client.post("/v1/completions", json={"prompt": "Hi"})
            assert generation.status_code == 503 and generation.headers["retry-after"] == str(RETRY_AFTER_S)
            error = generation.json()["error"]
            assert error["type"] == "server_error" and "GET /ready" in error["message"] and "starting" in error["message"]
            assert (await client.get("/v1/models")).status_code == 200  # OpenAI clients call it first

            serve.states = {"Decode:m": {"RUNNING": 1}, "Prefill:m": {"RUNNING": 1}}
            await asyncio.sleep(REFRESH_S + 0.1)
            ready = await client.get("/ready")
            assert ready.status_code == 200 and ready.json() == {
                "ready": True, "mode": "push", "decode": "1/1 replicas ready", "prefill": "1/1 replicas ready",
                "decode_replicas": 1, "prefill_replicas": 1,
            }
            assert (await client.post("/v1/completions", json={"prompt": "Hi"})).json() == {"ok": True}

    asyncio.run(go())


def test_ready_needs_no_api_key(monkeypatch):
    monkeypatch.setenv("RDV_TEST_KEY", "secret")
    serve = _Serve()
    serve.states = {"Decode:m": {"RUNNING": 1}, "Prefill:m": {"RUNNING": 1}}
    app = make_app(IngressArgs(api_key_env="RDV_TEST_KEY"), ReadinessProbe("push", read_deployments=serve))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as client:
            assert (await client.get("/ready")).status_code == 200  # probes carry no key

    asyncio.run(go())


def test_make_serve_watches_the_configs_own_address(tmp_path):
    from app.tools.run import _base_url

    config = tmp_path / "c.yaml"
    config.write_text("http_options:\n  host: 127.0.0.2\n  port: 8123\napplications: []\n")
    assert _base_url(str(config)) == "http://127.0.0.2:8123"
    config.write_text("applications: []\n")
    assert _base_url(str(config)) == "http://127.0.0.1:8000"  # Serve's defaults


@pytest.mark.parametrize(
    "status, body, expected",
    [
        (503, b'{"ready": false, "decode": "starting"}', (503, {"ready": False, "decode": "starting"})),
        (200, b'{"ready": true}', (200, {"ready": True})),
        (404, b"Path '/ready' not found.", None),  # Serve's proxy before the ingress is up
        (200, b'{"data": []}', None),  # some other app's route
    ],
)
def test_only_our_readiness_route_counts_as_an_answer(status, body, expected):
    import http.server
    import threading

    from app.tools.procs import read_readiness

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert read_readiness(f"http://127.0.0.1:{server.server_port}/ready") == expected
    finally:
        server.shutdown()
        server.server_close()
    assert read_readiness(f"http://127.0.0.1:{server.server_port}/ready") is None  # nothing listening
