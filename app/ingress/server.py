"""The OpenAI-compatible HTTP ingress: Ray Serve LLM's, plus health and readiness routes
(``app.ingress.readiness``: a quick 503 for generation requests while the app cannot answer), OpenAI-shaped
bodies for every HTTP error (FastAPI's own are ``{"detail": ...}``) and admission control
(``app.routing.admission``: by expected time to first byte against ``ingress.ttft_slo_s``, under a hard
``max_in_flight``; a quick 429 with ``Retry-After`` instead of a queue that grows without bound),
a queue deadline (503 and aborted on every engine; ``app.request.queue_deadline``), a request size limit (413),
a completions prompt list split into one request per prompt (``app.ingress.prompt_list``), late binding of the decode replica in pull mode
(``app.routing.late_binding``), one retry of a request whose decode replica died before its
first chunk, an error event (not a cut connection) ending a stream that failed after it
started, and, when ``ingress.api_key_env`` names an environment variable, bearer-token
authentication (401) on everything but ``/health``.

A ``conversation_id`` body field is validated and moved into the ``X-Conversation-Id``
header (where the decode router and replicas read it), so vLLM never sees an unknown
field; the header alone works too."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray.exceptions import RayActorError
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, OpenAiIngress, init
from vllm.exceptions import VLLMClientError

from app.config.args import IngressArgs
from app.ingress import metrics
from app.ingress.errors import answer_errors_as_vllm, openai_error
from app.ingress.prompt_list import joined, split_prompts
from app.ingress.readiness import RETRY_AFTER_S, ReadinessProbe
from app.replica import heartbeat
from app.request.envelope import (
    CONVERSATION_HEADER,
    CONVERSATION_ID_PATTERN,
    CONVERSATION_ID_RULE,
    DEFAULT_OUTPUT_BUDGET,
    QUEUE_DEADLINE_AT,
)
from app.request.queue_deadline import RECHECK_S, QueueDeadline, QueueDeadlineMoved, QueueDeadlinePassed, QueueExpired
from app.request.timeline import ARRIVED, FIRST_CHUNK, FIRST_TOKEN, RequestTimeline
from app.routing.admission import Admission, Decision, Verdict
from app.routing.late_binding import Prefilled

logger = logging.getLogger("ray.serve." + __name__)  # under ray.serve: its handlers write the replica logs

# The request models the endpoints parse (Ray Serve LLM's, vLLM's underneath).
_REQUEST_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
GENERATION_PATHS = tuple(_REQUEST_MODELS)
OPEN_PATHS = ("/health", "/ready")  # probes never carry the key


def make_app(args: IngressArgs | None = None, readiness: ReadinessProbe | None = None) -> FastAPI:
    """The ingress's FastAPI app; with ``readiness`` (the disaggregated app's) also
    ``/ready``, and a quick 503 for generation requests while the app cannot answer."""
    args = args or IngressArgs()
    max_body_bytes, api_key_env = args.max_body_bytes, args.api_key_env
    app = init()
    admission = Admission(args.max_in_flight, args.ttft_slo_s, args.retry_after_s)
    gauge_refresh: list[asyncio.Task] = []  # started with the first generation request, on the serving loop

    if readiness is not None:
        @app.get("/ready")
        async def _ready() -> JSONResponse:
            state = await readiness.fresh()
            return JSONResponse(status_code=200 if state.ready else 503, content=state.body())

    answer_errors_as_vllm(app)

    @app.middleware("http")
    async def _admit(request: Request, call_next) -> Response:
        if request.url.path not in GENERATION_PATHS:
            return await call_next(request)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            metrics.rejected().inc(tags={"reason": "too_large"})
            return openai_error(413, f"request body of {size} bytes exceeds the limit of {max_body_bytes}")
        if readiness is not None and not (state := await readiness.current()).ready:
            metrics.rejected().inc(tags={"reason": "not_ready"})
            return openai_error(
                503, f"not ready yet ({state.reason}); retry after {RETRY_AFTER_S} s, or wait for GET /ready to answer 200",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if not gauge_refresh:
            gauge_refresh.append(asyncio.get_running_loop().create_task(metrics.refresh_admission_gauges(admission)))
        arrived = time.time()
        body = await request.body()
        if len(body) > max_body_bytes:  # a chunked upload has no Content-Length to check up front
            metrics.rejected().inc(tags={"reason": "too_large"})
            return openai_error(413, f"request body of {len(body)} bytes exceeds the limit of {max_body_bytes}")
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None  # not JSON: FastAPI reports it
        # Admission before the body is validated: under overload a rejection must cost nearly nothing
        # (reading and parsing it is microseconds; what the client waits for depends on it).
        decision, ticket = admission.try_enter(len(body), arrived, awaited_output_tokens(payload))
        metrics.admission_gauges(admission)
        if ticket is None:
            metrics.rejected().inc(tags={"reason": decision.verdict.value})
            return openai_error(429, _busy_message(decision, admission), headers={"Retry-After": str(decision.retry_after_s)})
        metrics.admitted().inc(tags={"reason": decision.verdict.value})
        request.state.rendezvous_arrived = arrived  # the request's timeline starts here (app.request.timeline)
        if args.queue_deadline_s is not None:
            request.state.rendezvous_deadline = QueueDeadline(arrived + args.queue_deadline_s, args.queue_deadline_s,
                                                              args.retry_after_s)
        try:
            problem = _prepare_body(request, payload)
            if problem is not None:
                admission.leave(ticket)
                return problem
            response = await call_next(request)
        except BaseException:
            admission.leave(ticket)
            raise
        # Its first byte (a stream's first chunk: upstream returns the response once it has it), or
        # given up on at the queue deadline: both tell the model what waiting costs now.
        if response.status_code == 200 or getattr(request.state, "rendezvous_expired", False):
            admission.answered(ticket, time.time(), getattr(request.state, "rendezvous_first_token", None),
                               getattr(request.state, "rendezvous_output_tokens", None))
        body = getattr(response, "body_iterator", None)
        if body is None:
            admission.leave(ticket)
            metrics.admission_gauges(admission)
            return response

        async def body_then_leave():  # a stream is in flight until its last chunk (or a hang-up)
            try:
                async for chunk in body:
                    yield chunk
            finally:
                admission.leave(ticket)
                metrics.admission_gauges(admission)

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
                metrics.rejected().inc(tags={"reason": "unauthorized"})
                return openai_error(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'", headers={"WWW-Authenticate": "Bearer"}
                )
            return await call_next(request)

    app.state.admission = admission
    return app


def _busy_message(decision: Decision, admission: Admission) -> str:
    retry = f"retry after {decision.retry_after_s} s"
    if decision.verdict is Verdict.OVER_SLO:
        what = "the whole answer (not streamed)" if decision.whole else "first token"
        return (f"server busy: the expected time to {what} here is {decision.estimate_s:.1f} s, beyond this "
                f"server's {admission.ttft_slo_s:g} s target; {retry}")
    if decision.verdict is Verdict.LIMIT:
        return f"server busy: {admission.in_flight} requests in flight, the limit while latency is being learned; {retry}"
    return f"server busy: {admission.max_in_flight} requests in flight on this replica; {retry}"


def awaited_output_tokens(payload) -> int:
    """The output tokens a client waits for before its first byte: a whole answer's budget; none for a stream."""
    if not isinstance(payload, dict) or payload.get("stream") is True:
        return 0
    for key in ("max_completion_tokens", "max_tokens"):
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DEFAULT_OUTPUT_BUDGET


def _prepare_body(request: Request, payload) -> Response | None:
    """Check a generation request's body (``payload``, parsed) before the endpoint parses it, and
    move a body ``conversation_id`` into the header; an error response if the body cannot be served."""
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


def record_timeline(timeline: RequestTimeline) -> None:
    """Export one finished request's stage durations and log its timeline as one line."""
    for stage, seconds in timeline.stages().items():
        metrics.stage_seconds().observe(seconds, tags={"mode": timeline.mode.value, "stage": stage})
    logger.info("%s", timeline.to_log_line())


async def timelines_recorded(responses: AsyncIterator, arrived: float, state: Any = None) -> AsyncIterator:
    """``responses`` without the decode replica's :class:`RequestTimeline`, which is
    completed with the ingress's own stamps (arrival, first chunk out) and recorded. On
    ``state`` (the HTTP request's, for admission): when a whole answer's first token came,
    and how many output tokens it had."""
    timeline, first_chunk = None, None
    async for response in responses:
        if isinstance(response, RequestTimeline):
            timeline = response  # before a whole response, or after a stream's last chunk
            if state is not None and (first_token := timeline.stamps.get(FIRST_TOKEN)) is not None:
                state.rendezvous_first_token = first_token
        elif first_chunk is None and not isinstance(response, (Prefilled, QueueDeadlineMoved)):
            first_chunk = time.time()
        if state is not None and (usage := getattr(response, "usage", None)) is not None:
            state.rendezvous_output_tokens = getattr(usage, "completion_tokens", None)
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
        metrics.decode_lost().inc(tags={"when": "mid_stream"})
        error = json.loads(openai_error(503, f"the stream failed after it started ({type(exc).__name__}); retry the request").body)
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n"


class Ingress(OpenAiIngress):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        heartbeat.start()  # app.replica.heartbeat: how fresh this replica's metrics are

    async def health(self) -> dict:
        return {"status": "ok"}

    async def tokenize(self, body: TokenizeRequest, request: Request) -> Response:
        """vLLM's ``/tokenize`` takes a prompt or chat messages; Ray's route takes a prompt only."""
        return await super().tokenize(body, request)

    async def _get_response(self, *, body, call_method: str, raw_request: Request | None = None):
        """Upstream's call of the decode deployment, plus late binding (pull): when the
        replica that took the request answers that it had it prefilled, the request goes
        through the decode router once more, which picks by the load at that moment."""
        if getattr(body, "kv_transfer_params", None) is not None:
            body = body.model_copy(update={"kv_transfer_params": None})  # engine addressing is ours alone
        arrived = getattr(getattr(raw_request, "state", None), "rendezvous_arrived", None) or time.time()
        prefilled = None
        state = getattr(raw_request, "state", None)
        responses = super()._get_response(body=body, call_method=call_method, raw_request=raw_request)
        async for response in timelines_recorded(responses, arrived, state):
            if isinstance(response, Prefilled):
                prefilled = response  # the entry replica's answer ends here: it is no longer counted busy
                continue
            if isinstance(response, QueueExpired):
                raise QueueDeadlinePassed(response.request_id)
            if isinstance(response, QueueDeadlineMoved):
                _move_deadline(raw_request, response.at)
                continue
            yield response
        if prefilled is not None:
            responses = super()._get_response(body=prefilled.attach_to(body), call_method=call_method, raw_request=raw_request)
            async for response in timelines_recorded(responses, arrived, state):
                if isinstance(response, QueueDeadlineMoved):
                    _move_deadline(raw_request, response.at)
                    continue
                yield response

    def _get_configured_serve_handle(self, model_id: str):
        return _CallsKept(super()._get_configured_serve_handle(model_id))

    async def _process_llm_request(self, body, call_method: str, raw_request: Request | None = None) -> Response:
        if call_method == "completions" and (parts := split_prompts(body)) is not None:
            # One disaggregated request per prompt (app.ingress.prompt_list): one handoff carries one prompt's KV.
            return await joined(parts, lambda part: self._process_llm_request(part, call_method, raw_request))
        deadline = getattr(getattr(raw_request, "state", None), "rendezvous_deadline", None)
        if deadline is None:
            return await self._answer(body, call_method, raw_request)
        # The decode replica adds the request's own work to it (app.request.queue_deadline).
        QUEUE_DEADLINE_AT.write(body, deadline.at)
        if not getattr(body, "stream", False):
            # A whole answer comes at its end: the decode replica, which can ask its engine, tells
            # whether the request started by the deadline.
            try:
                return await self._answer(body, call_method, raw_request)
            except QueueDeadlinePassed:
                return _expired(raw_request, call_method, "no first token")
        calls = _CALLS.set([])
        answer = asyncio.ensure_future(self._answer(body, call_method, raw_request))
        try:
            while True:  # until the first chunk, or the deadline as the decode replica last moved it
                left = raw_request.state.rendezvous_deadline.at - time.time()
                if (await asyncio.wait({answer}, timeout=max(0.0, min(left, RECHECK_S))))[0]:
                    return answer.result()
                if time.time() >= raw_request.state.rendezvous_deadline.at:
                    break
            answer.cancel()
            for call in _CALLS.get():
                call.cancel()  # the decode replica's request is cancelled, which aborts its engines' legs
            return _expired(raw_request, call_method, "no first chunk")
        finally:
            if not answer.done():
                answer.cancel()
            _CALLS.reset(calls)

    async def _answer(self, body, call_method: str, raw_request: Request | None) -> Response:
        try:
            response = await super()._process_llm_request(body, call_method, raw_request)
        except RayActorError as exc:
            # The decode replica died (or became unreachable) before its first chunk: nothing
            # reached the client, so the request goes through the router once more, which
            # no longer offers that replica.
            logger.warning("%s: decode replica lost before the first chunk (%r); retrying once", call_method, exc)
            metrics.decode_lost().inc(tags={"when": "before_first_chunk"})
            response = await super()._process_llm_request(body, call_method, raw_request)
        # Upstream streams the replica's chunks with no handling of a failure mid-stream.
        if isinstance(response, StreamingResponse):
            response.body_iterator = ending_with_an_error_event(response.body_iterator, call_method)
        return response


def _move_deadline(raw_request: Request | None, at: float) -> None:
    state = getattr(raw_request, "state", None)
    deadline = getattr(state, "rendezvous_deadline", None)
    if deadline is not None:
        state.rendezvous_deadline = dataclasses.replace(deadline, at=at)


def _expired(raw_request: Request, call_method: str, what: str) -> Response:
    raw_request.state.rendezvous_expired = True
    deadline: QueueDeadline = raw_request.state.rendezvous_deadline
    waited = time.time() - raw_request.state.rendezvous_arrived
    metrics.expired().inc()
    logger.warning("%s: %s %.0f s after admission (queue deadline %g s and the request's own work): answered 503 and "
                   "aborted", call_method, what, waited, deadline.seconds)
    return openai_error(
        503, f"the request did not start within the server's queue deadline ({deadline.seconds:g} s of waiting, "
        f"{waited:.0f} s in all with its own work) and was aborted; retry after {deadline.retry_after_s} s",
        headers={"Retry-After": str(deadline.retry_after_s)})


# The decode deployment's calls made for the current request (only where a deadline may cancel them).
_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar("rendezvous_calls", default=None)


class _CallsKept:
    """A Serve handle whose calls (``handle.chat.remote(...)``) are kept in ``_CALLS`` when it is set,
    so that a queue deadline can cancel them (the HTTP request itself goes on, with a 503)."""

    def __init__(self, handle):
        self._handle = handle

    def options(self, **kwargs) -> "_CallsKept":
        return _CallsKept(self._handle.options(**kwargs))

    def __getattr__(self, method: str):
        target = getattr(self._handle, method)
        return _KeptMethod(target) if hasattr(target, "remote") else target


class _KeptMethod:
    def __init__(self, method):
        self._method = method

    def remote(self, *args, **kwargs):
        call = self._method.remote(*args, **kwargs)
        if (calls := _CALLS.get()) is not None:
            calls.append(call)
        return call


ENDPOINTS = {**DEFAULT_ENDPOINTS, "health": lambda app: app.get("/health")}
