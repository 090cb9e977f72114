"""The ingress's admission control and error bodies (app/ingress/server.py), on the real FastAPI
app the ingress serves; a stand-in route plays the decode deployment."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray.exceptions import ActorDiedError, ActorUnavailableError

from app.config.args import AppArgs, IngressArgs
from app.ingress.server import ending_with_an_error_event, make_app


def _app(limit: int, **kwargs):
    app = make_app(IngressArgs(max_in_flight=limit, retry_after_s=2, max_body_bytes=4096, **kwargs))
    release = asyncio.Event()

    @app.post("/v1/completions")
    async def completions(body: dict):
        await release.wait()
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        async def stream():
            yield b"data: 1\n\n"
            await release.wait()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app, release


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress")


def test_requests_beyond_the_limit_get_a_quick_429_with_retry_after():
    async def go():
        app, release = _app(limit=2)
        async with _client(app) as client:
            held = [asyncio.create_task(client.post("/v1/completions", json={})) for _ in range(2)]
            while app.state.admission.in_flight < 2:
                await asyncio.sleep(0.01)
            rejected = await client.post("/v1/completions", json={})
            other_routes = await client.get("/v1/models")  # not generation: never turned away
            release.set()
            done = await asyncio.gather(*held)
            after = await client.post("/v1/completions", json={})
        return rejected, other_routes, done, after, app.state.admission.in_flight

    rejected, other_routes, done, after, in_flight = asyncio.run(go())
    assert rejected.status_code == 429 and rejected.headers["retry-after"] == "2"
    assert rejected.json()["error"]["type"] == "rate_limit_error" and "2 requests in flight" in rejected.json()["error"]["message"]
    assert other_routes.status_code == 200
    assert [r.status_code for r in done] == [200, 200] and after.status_code == 200
    assert in_flight == 0


async def _start_stream(app, path: str):
    """Drive ``app`` as an ASGI server would (httpx's test transport buffers whole bodies)."""
    sent: list[dict] = []
    received = False

    async def receive():
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.Event().wait()  # the client never hangs up

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")],
             "client": ("127.0.0.1", 1), "server": ("ingress", 80)}
    return asyncio.create_task(app(scope, receive, send)), sent


def test_a_stream_holds_its_slot_until_it_ends():
    async def go():
        app, release = _app(limit=1)
        task, sent = await _start_stream(app, "/v1/chat/completions")
        while not any(m.get("body", b"").startswith(b"data: 1") for m in sent):
            await asyncio.sleep(0.01)
        async with _client(app) as client:
            busy = await client.post("/v1/completions", json={})
        release.set()
        await task
        return busy.status_code, b"".join(m.get("body", b"") for m in sent), app.state.admission.in_flight

    busy, body, in_flight = asyncio.run(go())
    assert busy == 429 and body.endswith(b"data: [DONE]\n\n") and in_flight == 0


def test_a_stream_that_fails_after_it_started_ends_with_an_error_event():
    async def chunks():
        yield "data: 1\n\n"
        raise RuntimeError("replica died")  # in kind, what a dead decode replica's handle raises

    async def go():
        return [chunk async for chunk in ending_with_an_error_event(chunks(), "chat")]

    events = [line.removeprefix("data: ") for line in "".join(asyncio.run(go())).splitlines() if line.startswith("data: ")]
    assert events[0] == "1" and events[-1] == "[DONE]" and len(events) == 3
    error = json.loads(events[1])["error"]
    assert error["code"] == 503 and error["type"] == "server_error" and "RuntimeError" in error["message"]


def test_an_oversized_body_gets_413():
    async def go():
        app, _ = _app(limit=1)
        async with _client(app) as client:
            return await client.post("/v1/completions", json={"prompt": "x" * 5000})

    r = asyncio.run(go())
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_the_admission_limit_must_stay_below_serves():
    with pytest.raises(ValueError, match="must be below max_ongoing_requests"):
        AppArgs.parse({"ingress": {"max_in_flight": 256, "max_ongoing_requests": 256}})


def test_with_an_api_key_every_route_but_health_needs_it(monkeypatch):
    monkeypatch.setenv("TEST_RDV_KEY", "s3cret")

    async def go():
        app, release = _app(limit=4, api_key_env="TEST_RDV_KEY")
        release.set()
        async with _client(app) as client:
            return {
                "none": await client.get("/v1/models"),
                "wrong": await client.post("/v1/completions", json={}, headers={"Authorization": "Bearer nope"}),
                "basic": await client.get("/v1/models", headers={"Authorization": "Basic s3cret"}),
                "right": await client.post("/v1/completions", json={}, headers={"Authorization": "Bearer s3cret"}),
                "health": await client.get("/health"),
            }, app.state.admission.in_flight

    responses, in_flight = asyncio.run(go())
    for name in ("none", "wrong", "basic"):
        r = responses[name]
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", name
        assert r.json()["error"]["type"] == "authentication_error"
    assert responses["right"].status_code == 200 and responses["health"].status_code == 200
    assert in_flight == 0


def test_an_api_key_variable_that_is_not_set_is_a_clear_503(monkeypatch):
    monkeypatch.delenv("TEST_RDV_KEY", raising=False)

    async def go():
        app, _ = _app(limit=1, api_key_env="TEST_RDV_KEY")
        async with _client(app) as client:
            return await client.get("/v1/models", headers={"Authorization": "Bearer x"})

    r = asyncio.run(go())
    assert r.status_code == 503 and "TEST_RDV_KEY is not set" in r.json()["error"]["message"]


def test_without_an_api_key_nothing_is_asked():
    async def go():
        app, _ = _app(limit=1)
        async with _client(app) as client:
            return await client.get("/v1/models")

    assert asyncio.run(go()).status_code == 200


def _echo_app():
    """An ingress whose completions route echoes the body and conversation header it got."""
    app = make_app(IngressArgs(max_body_bytes=4096))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return {"body": await request.json(), "conversation": request.headers.get("x-conversation-id")}

    return app


def _post_all(app, calls):
    async def go():
        async with _client(app) as client:
            return [await client.post(kwargs.pop("path", "/v1/completions"), **kwargs) for kwargs in map(dict, calls)]

    return asyncio.run(go())


def test_a_body_conversation_id_moves_into_the_header_and_vllm_never_sees_it():
    from_body, from_header, both_agree, without = _post_all(_echo_app(), [
        {"json": {"prompt": "hi", "conversation_id": "chat-1"}},
        {"json": {"prompt": "hi"}, "headers": {"X-Conversation-Id": "chat-2"}},
        {"json": {"prompt": "hi", "conversation_id": "chat-3"}, "headers": {"X-Conversation-Id": "chat-3"}},
        {"json": {"prompt": "hi"}},
    ])
    assert from_body.json() == {"body": {"prompt": "hi"}, "conversation": "chat-1"}
    assert from_header.json() == {"body": {"prompt": "hi"}, "conversation": "chat-2"}
    assert both_agree.json() == {"body": {"prompt": "hi"}, "conversation": "chat-3"}
    assert without.json() == {"body": {"prompt": "hi"}, "conversation": None}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"json": {"prompt": "hi", "conversation_id": "has space"}},
        {"json": {"prompt": "hi", "conversation_id": 7}},
        {"json": {"prompt": "hi", "conversation_id": "x" * 129}},
        {"json": {"prompt": "hi"}, "headers": {"X-Conversation-Id": "bad/slash"}},
        {"json": {"prompt": "hi", "conversation_id": "a"}, "headers": {"X-Conversation-Id": "b"}},
    ],
)
def test_a_bad_conversation_id_is_a_400_naming_the_field(kwargs):
    app = _echo_app()
    bad, after = _post_all(app, [kwargs, {"json": {"prompt": "hi"}}])
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "conversation_id"
    assert after.status_code == 200
    assert app.state.admission.in_flight == 0


def test_a_chunked_body_over_the_limit_is_a_413():
    async def chunks():
        for _ in range(5):
            yield b"x" * 1024

    (response,) = _post_all(_echo_app(), [{"content": chunks()}])
    assert response.status_code == 413


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": None, "max_tokens": 0}),  # upstream raised TypeError: a 500
        ("/v1/chat/completions", {"messages": None, "conversation_id": "c-1"}),
    ],
)
def test_a_body_that_crashes_the_request_model_is_a_400(path, body):
    app = _echo_app()
    bad, after = _post_all(app, [{"json": body, "path": path}, {"json": {"prompt": "hi"}}])
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["message"].startswith("malformed request body: TypeError"), bad.text
    assert after.status_code == 200
    assert app.state.admission.in_flight == 0


def test_a_body_the_model_only_rejects_is_left_to_the_endpoint():
    """Rejections keep FastAPI's detailed 4xx; a valid body reaches the endpoint unchanged."""
    rejected, valid = _post_all(_echo_app(), [
        {"json": {"prompt": "hi", "max_tokens": "ten"}},
        {"json": {"model": "m", "prompt": "hi", "max_tokens": 3}},
    ])
    assert rejected.status_code == 200 and rejected.json()["body"]["max_tokens"] == "ten"  # the stand-in accepts any dict
    assert valid.json()["body"] == {"model": "m", "prompt": "hi", "max_tokens": 3}


@pytest.mark.parametrize(
    "failures, outcome",
    [
        ([ActorDiedError()], "answered after 2 calls"),  # decode died before its first chunk: once more
        ([ActorUnavailableError("gone", None)], "answered after 2 calls"),
        ([ActorDiedError(), ActorDiedError()], "ActorDiedError after 2 calls"),  # only once
        ([ValueError("bad")], "ValueError after 1 calls"),  # not a lost replica: not retried
    ],
)
def test_a_request_whose_decode_replica_died_before_the_first_chunk_is_retried_once(monkeypatch, failures, outcome):
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

    from app.ingress.server import Ingress

    calls = []

    async def upstream(self, body, call_method, raw_request=None):
        calls.append(body)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return JSONResponse({"ok": True})

    monkeypatch.setattr(OpenAiIngress, "_process_llm_request", upstream)
    try:
        asyncio.run(Ingress(llm_deployments={}, model_cards={})._process_llm_request("body", "chat"))
        got = "answered"
    except Exception as exc:  # noqa: BLE001
        got = type(exc).__name__
    assert f"{got} after {len(calls)} calls" == outcome and set(calls) == {"body"}


def test_a_prefilled_answer_sends_the_request_through_the_decode_router_once_more(monkeypatch):
    """Late binding (pull): the entry replica's Prefilled is not the client's; the
    request goes out again with it attached, and a client's kv_transfer_params never do."""
    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

    from app.ingress.server import Ingress
    from app.routing.late_binding import Prefilled

    prefilled = Prefilled("rdv-1", {"remote_block_ids": [1]}, "entry")
    sent = []

    async def upstream(self, *, body, call_method, raw_request=None):
        sent.append(body)
        for chunk in ([prefilled] if len(sent) == 1 else ["a", "b"]):
            yield chunk

    monkeypatch.setattr(OpenAiIngress, "_get_response", upstream)
    client_body = CompletionRequest(model="m", prompt="hi", kv_transfer_params={"remote_host": "evil"})

    async def go():
        ingress = Ingress(llm_deployments={}, model_cards={})  # Ray's constructor: it only keeps the handles it is given
        return [c async for c in ingress._get_response(body=client_body, call_method="completions")]

    assert asyncio.run(go()) == ["a", "b"]
    assert [Prefilled.attached_to(b) for b in sent] == [None, prefilled]
    assert sent[0].kv_transfer_params is None


def test_a_request_not_started_by_the_queue_deadline_is_a_503(monkeypatch):
    """Ingress: a stream with no first chunk by the deadline: the decode deployment's call made for
    the request is cancelled (Serve then cancels it on the replica, which aborts its engines' legs).
    A whole answer carries the deadline to the decode replica, which answers QueueExpired if its
    engine had not started it (app.request.queue_deadline): the same 503. A stream whose decode replica
    moved its deadline (by the request's own work) is waited for until the moved deadline."""
    from types import SimpleNamespace

    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

    from app.ingress.server import Ingress, _move_deadline
    from app.request.envelope import QUEUE_DEADLINE_AT
    from app.request.queue_deadline import QueueDeadline, QueueDeadlinePassed

    class Call:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    class Handle:
        def __init__(self):
            self.calls = []
            self.chat = SimpleNamespace(remote=self._remote)

        def _remote(self, *args):
            self.calls.append(Call())
            return self.calls[-1]

    handle = Handle()
    monkeypatch.setattr(OpenAiIngress, "_get_configured_serve_handle", lambda self, model_id: handle)

    async def upstream(self, body, call_method, raw_request=None):
        getattr(self._get_configured_serve_handle("m"), call_method).remote(body)
        if body.prompt == "long":  # what _get_response does with the replica's QueueDeadlineMoved
            _move_deadline(raw_request, time.time() + 1.0)
            await asyncio.sleep(0.4)
            return JSONResponse({"ok": True})
        await asyncio.sleep(0 if not body.stream else 30)  # a stream that never starts
        if body.prompt == "late":
            raise QueueDeadlinePassed("r1")  # what _get_response raises on the replica's QueueExpired
        return JSONResponse({"ok": True})

    monkeypatch.setattr(OpenAiIngress, "_process_llm_request", upstream)

    def request():
        return SimpleNamespace(state=SimpleNamespace(rendezvous_deadline=QueueDeadline(time.time() + 0.2, 0.2, 3),
                                                     rendezvous_arrived=time.time()))

    ingress = Ingress(llm_deployments={}, model_cards={})
    stream, whole, late = request(), request(), request()
    whole_body, late_body = SimpleNamespace(stream=False, prompt="p"), SimpleNamespace(stream=False, prompt="late")
    expired = asyncio.run(ingress._process_llm_request(SimpleNamespace(stream=True, prompt="p"), "chat", stream))
    answered = asyncio.run(ingress._process_llm_request(whole_body, "chat", whole))
    expired_whole = asyncio.run(ingress._process_llm_request(late_body, "chat", late))
    moved = asyncio.run(ingress._process_llm_request(SimpleNamespace(stream=True, prompt="long"), "chat", request()))
    assert moved.status_code == 200, "a stream past the setting but within its moved deadline was given up on"
    for response in (expired, expired_whole):
        assert response.status_code == 503 and response.headers["retry-after"] == "3"
        assert "queue deadline (0.2 s of waiting" in json.loads(response.body)["error"]["message"]
    assert stream.state.rendezvous_expired is True and late.state.rendezvous_expired is True
    assert answered.status_code == 200 and not hasattr(whole.state, "rendezvous_expired")
    # The whole answers carried the deadline to the replica; only the stream's call was cancelled here.
    assert QUEUE_DEADLINE_AT.read(whole_body) == whole.state.rendezvous_deadline.at
    assert [call.cancelled for call in handle.calls] == [True, False, False, False]


def test_a_request_expected_to_miss_the_slo_gets_a_429_saying_so():
    async def go():
        app, release = _app(limit=8, ttft_slo_s=5.0)
        admission = app.state.admission
        for _ in range(8):  # answers that taught it: 2 s per KiB ahead
            _, ticket = admission.try_enter(1024, now=0.0)
            admission.answered(ticket, now=2.0)
            admission.leave(ticket)
        async with _client(app) as client:
            held = [asyncio.create_task(client.post("/v1/completions", json={"prompt": "x" * 1500})) for _ in range(2)]
            while admission.in_flight < 2:
                await asyncio.sleep(0.01)
            rejected = await client.post("/v1/completions", json={"prompt": "x" * 3000})
            release.set()
            await asyncio.gather(*held)
        return rejected, admission.in_flight

    rejected, in_flight = asyncio.run(go())
    assert rejected.status_code == 429, rejected.text
    message = rejected.json()["error"]["message"]
    assert "expected time to the whole answer (not streamed)" in message and "5 s target" in message
    assert int(rejected.headers["retry-after"]) >= 1 and in_flight == 0
