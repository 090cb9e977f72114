"""The OpenAI-compatible HTTP ingress: Ray Serve LLM's, plus health and readiness routes
(``app.readiness``: a quick 503 for generation requests while the app cannot answer), OpenAI-shaped
bodies for every HTTP error (FastAPI's own are ``{"detail": ...}``) and admission control:
a bounded number of generation requests in flight per ingress replica, beyond which the
client gets a quick 429 with ``Retry-After`` instead of a queue that grows without bound,
a request size limit (413), late binding of the decode replica in pull mode
(``app.late_binding``), one retry of a request whose decode replica died before its
first chunk, an error event (not a cut connection) ending a stream that failed after it
started, and, when ``ingress.api_key_env`` names an environment variable, bearer-token
authentication (401) on everything but ``/health``.

A ``conversation_id`` body field is validated and moved into the ``X-Conversation-Id``
header (where the decode router and replicas read it), so vLLM never sees an unknown
field; the header alone works too."""

from __future__ import annotations

import functools
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray.exceptions import RayActorError
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, OpenAiIngress, init
from ray.serve.metrics import Counter, Histogram
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.exceptions import VLLMClientError

from app.args import IngressArgs
from app.conversations import CONVERSATION_HEADER, CONVERSATION_ID_PATTERN, CONVERSATION_ID_RULE
from app.late_binding import Prefilled
from app.readiness import RETRY_AFTER_S, ReadinessProbe
from app.timeline import ARRIVED, FIRST_CHUNK, RequestTimeline

logger = logging.getLogger("ray.serve.rendezvous.ingress")  # under ray.serve: its handlers write the replica logs

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
# The request models the endpoints parse (Ray Serve LLM's, vLLM's underneath).
_REQUEST_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
GENERATION_PATHS = tuple(_REQUEST_MODELS)
OPEN_PATHS = ("/health", "/ready")  # probes never carry the key


def openai_error(status: int, message: str, *, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        headers=headers,
        content={
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
                "param": param,
                "code": status,
            }
        },
    )


class Admission:
    """Generation requests in flight on this ingress replica, at most ``limit``. One event
    loop runs the ingress, so plain counting is safe."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0

    def try_enter(self) -> bool:
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1


def make_app(args: IngressArgs | None = None, readiness: ReadinessProbe | None = None) -> FastAPI:
    """The ingress's FastAPI app; with ``readiness`` (the disaggregated app's) also
    ``/ready``, and a quick 503 for generation requests while the app cannot answer."""
    args = args or IngressArgs()
    retry_after_s, max_body_bytes, api_key_env = args.retry_after_s, args.max_body_bytes, args.api_key_env
    app = init()
    admission = Admission(args.max_in_flight)

    if readiness is not None:
        @app.get("/ready")
        async def _ready() -> JSONResponse:
            state = await readiness.fresh()
            return JSONResponse(status_code=200 if state.ready else 503, content=state.body())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return openai_error(exc.status_code, str(exc.detail))

    @app.middleware("http")
    async def _admit(request: Request, call_next) -> Response:
        if request.url.path not in GENERATION_PATHS:
            return await call_next(request)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            _rejected().inc(tags={"reason": "too_large"})
            return openai_error(413, f"request body of {size} bytes exceeds the limit of {max_body_bytes}")
        if readiness is not None and not (state := await readiness.current()).ready:
            _rejected().inc(tags={"reason": "not_ready"})
            return openai_error(
                503, f"not ready yet ({state.reason}); retry after {RETRY_AFTER_S} s, or wait for GET /ready to answer 200",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        # Admission before the body is read and validated: under overload a rejection must cost nearly nothing.
        if not admission.try_enter():
            _rejected().inc(tags={"reason": "busy"})
            return openai_error(
                429,
                f"server busy: {admission.limit} requests in flight on this replica; retry after {retry_after_s} s",
                headers={"Retry-After": str(retry_after_s)},
            )
        request.state.rendezvous_arrived = time.time()  # the request's timeline starts here (app.timeline)
        try:
            problem = await _prepare_body(request, max_body_bytes)
            if problem is not None:
                admission.leave()
                return problem
            response = await call_next(request)
        except BaseException:
            admission.leave()
            raise
        body = getattr(response, "body_iterator", None)
        if body is None:
            admission.leave()
            return response

        async def body_then_leave():  # a stream is in flight until its last chunk (or a hang-up)
            try:
                async for chunk in body:
                    yield chunk
            finally:
                admission.leave()

        response.body_iterator = body_then_leave()
        return response

    if api_key_env:
        # Added last, so it runs first: an unauthenticated request never takes a slot.
        @app.middleware("http")
        async def _authenticate(request: Request, call_next) -> Response:
            if request.url.path in OPEN_PATHS:
                return await call_next(request)
            expected = os.environ.get(api_key_env)  # read in the replica's process, where the secret is
            if not expected:
                return openai_error(503, f"authentication is on (ingress.api_key_env) but {api_key_env} is not set here")
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
                _rejected().inc(tags={"reason": "unauthorized"})
                return openai_error(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'", headers={"WWW-Authenticate": "Bearer"}
                )
            return await call_next(request)

    app.state.admission = admission
    return app


async def _prepare_body(request: Request, max_body_bytes: int) -> Response | None:
    """Check a generation request's body before the endpoint parses it, and move a body
    ``conversation_id`` into the header; an error response if the body cannot be served."""
    body = await request.body()
    if len(body) > max_body_bytes:  # a chunked upload has no Content-Length to check up front
        _rejected().inc(tags={"reason": "too_large"})
        return openai_error(413, f"request body of {len(body)} bytes exceeds the limit of {max_body_bytes}")
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None  # not JSON: FastAPI reports it
    header = request.headers.get(CONVERSATION_HEADER)
    conversation_id = header
    if isinstance(payload, dict) and "conversation_id" in payload:
        conversation_id = payload.pop("conversation_id")
        if header is not None and conversation_id != header:
            return openai_error(400, "conversation_id and the X-Conversation-Id header differ", param="conversation_id")
        request._body = json.dumps(payload).encode()  # what the endpoint will read
    if isinstance(payload, dict):
        problem = _crashes_the_model(request.url.path, payload)
        if problem is not None:
            return openai_error(400, f"malformed request body: {problem}")
    if conversation_id is None:
        return None
    if not isinstance(conversation_id, str) or not CONVERSATION_ID_PATTERN.fullmatch(conversation_id):
        return openai_error(400, f"conversation_id must be {CONVERSATION_ID_RULE}", param="conversation_id")
    headers = [(k, v) for k, v in request.scope["headers"] if k not in (b"content-length", CONVERSATION_HEADER.encode())]
    headers += [(b"content-length", str(len(request._body)).encode()), (CONVERSATION_HEADER.encode(), conversation_id.encode())]
    request.scope["headers"] = headers
    return None


def _crashes_the_model(path: str, payload: dict) -> str | None:
    """Why the endpoint's request model would *crash* on ``payload`` rather than reject it:
    some upstream before-validators use a field before its type is checked (``"messages":
    null`` raised TypeError, a 500). Rejections (pydantic's ValidationError, a ValueError;
    vLLM's client errors) are left to the endpoint, which answers them with the details."""
    try:
        _REQUEST_MODELS[path].model_validate(payload)
    except (ValueError, VLLMClientError):
        return None
    except Exception as e:  # noqa: BLE001 - any crash on client input is the client's 400
        return f"{type(e).__name__}: {e}"
    return None


@functools.cache
def _rejected() -> Counter:
    return Counter(
        "rendezvous_ingress_rejected",
        description="Requests the ingress turned away before they reached a model, by reason: busy (429, max_in_flight "
        "reached), not_ready (503, no decode replica can answer: app/readiness.py), too_large (413), unauthorized (401).",
        tag_keys=("reason",),
    )


@functools.cache
def _decode_lost() -> Counter:
    return Counter(
        "rendezvous_decode_lost",
        description="Requests whose decode replica died or became unreachable, by when: before_first_chunk (sent "
        "through the router once more) or mid_stream (the stream ended with an error event).",
        tag_keys=("when",),
    )


@functools.cache
def _stage_seconds() -> Histogram:
    return Histogram(
        "rendezvous_stage_seconds",
        description="Seconds each stage of a request took, by transfer mode and stage (app/timeline.py): route "
        "(decode_pick + decode_hop), bind, prefill_pick, prefill_hop, prefill_queue, prefill_compute, register, handoff "
        "(KV to decode and its first step: transfer + first_step), local_prefill, deliver (first token to the client), ttft.",
        boundaries=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64],
        tag_keys=("mode", "stage"),
    )


def record_timeline(timeline: RequestTimeline) -> None:
    """Export one finished request's stage durations and log its timeline as one line."""
    for stage, seconds in timeline.stages().items():
        _stage_seconds().observe(seconds, tags={"mode": timeline.mode, "stage": stage})
    logger.info("%s", timeline.to_log_line())


async def timelines_recorded(responses: AsyncIterator, arrived: float) -> AsyncIterator:
    """``responses`` without the decode replica's :class:`RequestTimeline`, which is
    completed with the ingress's own stamps (arrival, first chunk out) and recorded."""
    timeline, first_chunk = None, None
    async for response in responses:
        if isinstance(response, RequestTimeline):
            timeline = response  # before a whole response, or after a stream's last chunk
        elif first_chunk is None and not isinstance(response, Prefilled):
            first_chunk = time.time()
        if timeline is not None and first_chunk is not None:
            # Before the yield: upstream stops reading after a whole (non-streamed) response.
            timeline.stamp(ARRIVED, arrived)
            timeline.stamp(FIRST_CHUNK, first_chunk)
            record_timeline(timeline)
            timeline = None
        if not isinstance(response, RequestTimeline):
            yield response


async def ending_with_an_error_event(chunks: AsyncIterator[str | bytes], path: str) -> AsyncIterator[str | bytes]:
    """``chunks`` of a server-sent event stream; if they fail after the stream started
    (its decode replica died), an OpenAI error event and ``[DONE]`` end the stream, as
    vLLM's own server ends one, instead of a connection cut mid-chunk."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # noqa: BLE001 - the status line is long gone: tell the client in-band
        logger.warning("stream of %s failed after it started: %r", path, exc)
        _decode_lost().inc(tags={"when": "mid_stream"})
        error = json.loads(openai_error(503, f"the stream failed after it started ({type(exc).__name__}); retry the request").body)
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n"


class Ingress(OpenAiIngress):
    async def health(self) -> dict:
        return {"status": "ok"}

    async def _get_response(self, *, body, call_method: str, raw_request: Request | None = None):
        """Upstream's call of the decode deployment, plus late binding (pull): when the
        replica that took the request answers that it had it prefilled, the request goes
        through the decode router once more, which picks by the load at that moment."""
        if getattr(body, "kv_transfer_params", None) is not None:
            body = body.model_copy(update={"kv_transfer_params": None})  # engine addressing is ours alone
        arrived = getattr(getattr(raw_request, "state", None), "rendezvous_arrived", None) or time.time()
        prefilled = None
        responses = super()._get_response(body=body, call_method=call_method, raw_request=raw_request)
        async for response in timelines_recorded(responses, arrived):
            if isinstance(response, Prefilled):
                prefilled = response  # the entry replica's answer ends here: it is no longer counted busy
                continue
            yield response
        if prefilled is not None:
            responses = super()._get_response(body=prefilled.attach_to(body), call_method=call_method, raw_request=raw_request)
            async for response in timelines_recorded(responses, arrived):
                yield response

    async def _process_llm_request(self, body, call_method: str, raw_request: Request | None = None) -> Response:
        try:
            response = await super()._process_llm_request(body, call_method, raw_request)
        except RayActorError as exc:
            # The decode replica died (or became unreachable) before its first chunk: nothing
            # reached the client, so the request goes through the router once more, which
            # no longer offers that replica.
            logger.warning("%s: decode replica lost before the first chunk (%r); retrying once", call_method, exc)
            _decode_lost().inc(tags={"when": "before_first_chunk"})
            response = await super()._process_llm_request(body, call_method, raw_request)
        # Upstream streams the replica's chunks with no handling of a failure mid-stream.
        if isinstance(response, StreamingResponse):
            response.body_iterator = ending_with_an_error_event(response.body_iterator, call_method)
        return response


ENDPOINTS = {**DEFAULT_ENDPOINTS, "health": lambda app: app.get("/health")}
