"""The decode replica's handoff never hangs and never fails a request it can serve
itself (app/decode/handoff.py). A real Handoff over stand-ins for the engine and the prefill
replica; the integration tests stall a real prefill engine."""

from __future__ import annotations

import asyncio
import types

import pytest
from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest, ErrorResponse
from vllm.entrypoints.serve.engine.protocol import ErrorInfo

from app.decode.handoff import Handoff, HandoffFailed, Served
from app.request.deadlines import Deadlines
from app.request.envelope import PROMPT_TOKENS, Route
from app.routing.late_binding import Prefilled
from connector.params import TransferMode


def _error(code: int) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=f"boom {code}", type="x", code=code))


class _Prefill:
    """A prefill response stream: yields ``chunks`` after ``delay_s`` (never, if None)."""

    def __init__(self, delay_s: float | None, chunks=("p",), fail: bool = False):
        self.delay_s, self.chunks, self.fail, self.cancelled = delay_s, chunks, fail, False

    def cancel(self) -> None:  # as Serve's DeploymentResponseGenerator: cancels the call on the replica
        self.cancelled = True

    async def __aiter__(self):
        await asyncio.sleep(3600 if self.delay_s is None else self.delay_s)
        if self.fail:
            raise RuntimeError("prefill replica died")
        for chunk in self.chunks:
            yield chunk


def _handoff(*, decode_after_s: float = 0.0, decode_chunks=("d1", "d2"), timeout_s: float = 0.3, mode="push",
             push=None, prefill=None, backend=None, replica_id="decode-1") -> Handoff:
    """A Handoff whose decode engine yields ``decode_chunks`` after ``decode_after_s``, or
    "local" for a request without kv_transfer_params (decode prefilling it itself)."""
    decode_closed, local_requests = [], []

    async def engine(endpoint, request, raw=None):
        async def gen():
            try:
                if request.kv_transfer_params is None:  # local prefill
                    local_requests.append(request)
                    yield "local"
                    return
                await asyncio.sleep(decode_after_s)
                for chunk in decode_chunks:
                    yield chunk
            finally:
                decode_closed.append(request.request_id)

        return gen()

    handoff = Handoff(mode=TransferMode(mode), engine=engine, deadlines=_deadlines(timeout_s), timelines={},
                      replica_id=replica_id, push=push, prefill=prefill, backend=backend)
    handoff.decode_closed, handoff.local_requests = decode_closed, local_requests
    return handoff


def _deadlines(floor_s: float) -> Deadlines:
    """The deadlines' floor alone: a prefill cost too small to count (app.request.deadlines sizes them to the work)."""
    return Deadlines(prefill_floor_s=floor_s, kv_after_prefill_s=15.0, margin=3.0, assumed_prefill_tokens_per_s=1e9)


def _decode_request() -> CompletionRequest:
    return CompletionRequest(model="m", prompt="hi", request_id="rdv-1", kv_transfer_params={"do_remote_prefill": True})


def _collect(agen) -> tuple[list, BaseException | None]:
    async def go():
        out = []
        try:
            async for chunk in agen:
                out.append(chunk)
        except Exception as exc:
            return out, exc
        return out, None

    return asyncio.run(go())


def test_a_prefill_that_never_finishes_fails_the_handoff_at_the_deadline():
    handoff = _handoff(decode_after_s=3600)
    chunks, error = _collect(handoff.concurrent_decode("completions", _decode_request(), _Prefill(None), None))
    assert chunks == [] and isinstance(error, HandoffFailed) and "within 0 s" in str(error)
    assert handoff.decode_closed == ["rdv-1"], "the decode leg must be aborted"


def test_an_abandoned_or_failed_push_handoff_aborts_its_prefill_leg():
    """Push: a consumer that goes away before the first chunk (a client hang-up, the queue
    deadline) cancels the prefill leg too, and so does a handoff past its deadline: decode
    computes the prompt itself, and a prefill nobody waits for would only cost compute.
    Decode's registered blocks are freed at their expiry (connector.push_deadline)."""
    handoff, prefill = _handoff(decode_after_s=3600), _Prefill(None)

    async def abandon():
        task = asyncio.ensure_future(anext(handoff.concurrent_decode("completions", _decode_request(), prefill, None)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(abandon())
    assert prefill.cancelled and handoff.decode_closed == ["rdv-1"]

    handoff, prefill = _handoff(decode_after_s=3600, timeout_s=0.05), _Prefill(None)

    async def fail():
        with pytest.raises(HandoffFailed):
            await anext(handoff.concurrent_decode("completions", _decode_request(), prefill, None))

    asyncio.run(fail())
    assert prefill.cancelled and handoff.decode_closed == ["rdv-1"]


@pytest.mark.parametrize("prefill", [_Prefill(0.01, chunks=(_error(500),)), _Prefill(0.01, fail=True)], ids=["error", "dead"])
def test_a_failed_prefill_fails_the_handoff_at_once(prefill):
    handoff = _handoff(decode_after_s=3600, timeout_s=30)
    chunks, error = _collect(handoff.concurrent_decode("completions", _decode_request(), prefill, None))
    assert chunks == [] and isinstance(error, HandoffFailed)
    assert handoff.decode_closed == ["rdv-1"]


def test_once_decode_produced_a_prefill_failure_is_moot():
    handoff = _handoff(decode_after_s=0.0, timeout_s=30)
    chunks, error = _collect(handoff.concurrent_decode("completions", _decode_request(), _Prefill(0.05, fail=True), None))
    assert (chunks, error) == (["d1", "d2"], None)


def test_a_slow_prefill_within_the_deadline_is_waited_for():
    handoff = _handoff(decode_after_s=0.1, timeout_s=5)
    chunks, error = _collect(handoff.concurrent_decode("completions", _decode_request(), _Prefill(0.05), None))
    assert (chunks, error) == (["d1", "d2"], None)


def test_a_failed_handoff_is_served_by_local_prefill_under_a_fresh_id():
    async def remote(request, raw=None):
        raise HandoffFailed("prefill did not finish within 30 s")
        yield  # pragma: no cover

    handoff = _handoff(push=remote)
    served = Served(Route.REMOTE)
    request = CompletionRequest(model="m", prompt="hi", request_id="rdv-1")
    chunks, error = _collect(handoff.remote_or_fallback(request, None, "completions", served))
    assert (chunks, error, served.route) == (["local"], None, Route.FALLBACK)
    assert handoff.local_requests[0].request_id not in ("rdv-1", None)
    # Where the queue deadline asks the engine whether the request started (app.request.queue_deadline).
    assert served.fallback_request_id == handoff.local_requests[0].request_id


def test_a_push_that_cannot_pick_a_prefill_replica_falls_back_at_the_deadline():
    """Ray's orchestration waits in its pick for as long as no prefill replica is routable
    (a lost prefill node): decode prefills locally at the handoff's deadline and the pick is
    cancelled. Once the legs went out, the prefill leg's own deadline counts from there."""
    picking = {"cancelled": False}

    async def never_picks(request, raw=None):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            picking["cancelled"] = True
            raise
        yield  # pragma: no cover

    handoff = _handoff(push=never_picks, timeout_s=0.1)
    served = Served(Route.REMOTE)
    request = CompletionRequest(model="m", prompt="hi", request_id="rdv-1")
    chunks, error = _collect(handoff.remote_or_fallback(request, None, "completions", served))
    assert (chunks, error, served.route) == (["local"], None, Route.FALLBACK)
    assert picking["cancelled"] and not handoff._legs_out

    # Picked at 0.08 s, decode's first chunk 0.15 s later: 0.23 s from the start, past the pick's
    # 0.2 s, but within the leg's own 0.2 s counted from the pick.
    handoff = _handoff(decode_after_s=0.15, timeout_s=0.2)

    async def picks_late(request, raw=None):
        await asyncio.sleep(0.08)
        async for chunk in handoff.concurrent_decode("completions", _decode_request(), _Prefill(0.1), None):
            yield chunk

    handoff._push = picks_late
    served = Served(Route.REMOTE)
    request = CompletionRequest(model="m", prompt="hi", request_id="rdv-1")
    chunks, error = _collect(handoff.remote_or_fallback(request, None, "completions", served))
    assert (chunks, error, served.route) == (["d1", "d2"], None, Route.REMOTE)


def test_a_server_error_before_any_chunk_falls_back_but_a_client_error_passes_through():
    for code, expected_route in [(503, "fallback"), (400, "remote")]:
        async def remote(request, raw=None, code=code):
            yield _error(code)

        handoff = _handoff(push=remote)
        served = Served(Route.REMOTE)
        chunks, _ = _collect(handoff.remote_or_fallback(CompletionRequest(model="m", prompt="hi"), None, "completions", served))
        assert served.route == expected_route
        assert chunks == (["local"] if code >= 500 else [_error(400)])


@pytest.mark.parametrize(
    "registration, now, margin, expired",
    [
        ({}, 1e12, 5.0, False),  # unstamped (another decode build): never expires here
        ({"rendezvous_expires_at": 100.0}, 94.0, 5.0, False),
        ({"rendezvous_expires_at": 100.0}, 95.0, 5.0, True),  # prefill stops writing 5 s early
        ({"rendezvous_expires_at": 100.0}, 99.9, 0.0, False),
        ({"rendezvous_expires_at": 100.0}, 100.0, 0.0, True),  # decode gives up at the deadline
    ],
)
def test_registration_expiry(registration, now, margin, expired):
    from connector.push_deadline import EXPIRES_KEY, registration_expired

    assert EXPIRES_KEY == "rendezvous_expires_at"
    assert registration_expired(registration, now, margin) is expired


def test_engines_get_their_modes_kv_deadline_and_recompute_on_load_failure():
    from app.config.args import AppArgs
    from app.config.llm_configs import kv_transfer_config
    from connector.ports import Role
    from connector.settings import ConnectorSettings

    handoff = {"prefill_timeout_s": 10, "kv_timeout_s": 25, "read_timeout_s": 7}
    push = kv_transfer_config(AppArgs.parse({"handoff": handoff}), Role.DECODE)
    pull = kv_transfer_config(AppArgs.parse({"mode": "pull", "handoff": handoff}), Role.DECODE)
    # As the connectors read them (connector.vllm_connectors).
    assert ConnectorSettings.parse(push["kv_connector_extra_config"]).kv_timeout_s == 25  # from registering the blocks
    assert ConnectorSettings.parse(pull["kv_connector_extra_config"]).kv_timeout_s == 7  # from posting the READ
    assert push["kv_load_failure_policy"] == pull["kv_load_failure_policy"] == "recompute"


def test_the_engine_deadline_must_outlast_the_orchestrators():
    from app.config.args import AppArgs

    with pytest.raises(ValueError, match="must exceed prefill_timeout_s"):
        AppArgs.parse({"handoff": {"prefill_timeout_s": 60, "kv_timeout_s": 60}})


@pytest.mark.parametrize("args, warned", [
    ({}, None),  # the defaults: every rung comes before the queue deadline
    ({"mode": "pull"}, None),
    ({"ingress": {"queue_deadline_s": None}, "handoff": {"kv_timeout_s": 600}}, None),
    ({"handoff": {"kv_timeout_s": 60}}, "kv_timeout_s (60) is not below ingress.queue_deadline_s (60)"),
    ({"mode": "pull", "handoff": {"kv_timeout_s": 60}}, None),  # push's deadline means nothing in pull
    ({"mode": "pull", "handoff": {"read_timeout_s": 30}}, "read_timeout_s (60) is not below ingress.queue_deadline_s (60)"),
    ({"ingress": {"queue_deadline_s": 40, "ttft_slo_s": 10}}, "kv_timeout_s (45) is not below"),
])
def test_deadlines_that_let_the_queue_deadline_pre_empt_decodes_recompute_are_warned_of(args, warned):
    from app.config.args import AppArgs

    advice = AppArgs.parse(args).deadline_advice()
    if warned is None:
        assert advice is None
    else:
        assert warned in advice, advice


class _PrefillStream:
    """A pull-mode prefill response: one answer carrying where its KV is."""

    def __init__(self, params):
        self.params, self.cancelled = params, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.params is None:
            raise StopAsyncIteration
        answer, self.params = types.SimpleNamespace(kv_transfer_params=self.params), None
        return answer

    def cancel(self):
        self.cancelled = True


def _pull_handoff() -> Handoff:
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    from app.config.args import AppArgs
    from app.config.llm_configs import llm_config
    from connector.ports import Role
    from connector.ray_backend import NixlPullBackend

    backend = NixlPullBackend(LLMConfig.model_validate(llm_config(AppArgs.parse({"mode": "pull"}), Role.DECODE, "/some/path")))
    calls = []

    def call(request, raw=None):
        calls.append(request)
        return _PrefillStream({"remote_block_ids": [1, 2], "remote_engine_id": "p0"})

    handoff = _handoff(timeout_s=5, mode="pull", replica_id="entry-1",
                       prefill=types.SimpleNamespace(completions=types.SimpleNamespace(remote=call)),
                       backend=lambda: backend)
    handoff.prefill_calls = calls
    return handoff


def test_late_binding_prefills_here_and_hands_the_decode_leg_back():
    handoff = _pull_handoff()
    served = Served(Route.REMOTE)
    request = CompletionRequest(model="m", prompt="hi", request_id="rdv-1")
    chunks, error = _collect(handoff.remote_or_fallback(request, None, "completions", served, hand_off=True))
    assert error is None and served.route is Route.HANDED_OFF
    assert chunks == [Prefilled("rdv-1", {"remote_block_ids": [1, 2], "remote_engine_id": "p0"}, "entry-1")]
    assert handoff.decode_closed == [], "no decode leg runs on the entry replica"
    assert handoff.prefill_calls[0].kv_transfer_params["do_remote_decode"] is True


def test_without_late_binding_the_same_replica_decodes_what_it_had_prefilled():
    handoff = _pull_handoff()
    served = Served(Route.REMOTE)
    request = CompletionRequest(model="m", prompt="hi", request_id="rdv-1")
    chunks, error = _collect(handoff.remote_or_fallback(request, None, "completions", served))
    assert (chunks, error, served.route) == (["d1", "d2"], None, Route.REMOTE)
    assert handoff.decode_closed == ["rdv-1"]


def test_a_prefilled_request_is_decoded_from_the_prefill_answer_under_its_prefill_id():
    from tests.support.decode_server import decode_server, drain

    server = decode_server(mode="pull", late_binding=True)
    server._replica_id = "other-2"
    bound, decoded = [], []
    server._metrics.bound = lambda binding, moved: bound.append((binding, moved))

    async def pull_decode(request, raw, endpoint, params, keep=False):
        decoded.append((request.request_id, request.kv_transfer_params, params))
        yield "late-chunk"

    server._handoff.pull_decode = pull_decode
    prefilled = Prefilled("rdv-7", {"remote_block_ids": [3]}, "entry-1")
    chunks = drain(server, "completions", prefilled.attach_to(CompletionRequest(model="m", prompt="x" * 50)))
    assert chunks == ["late-chunk"] and server.paths == ["remote"]
    assert decoded == [("rdv-7", None, {"remote_block_ids": [3]})]
    assert bound == [("late", True)]


@pytest.mark.parametrize("prompt_tokens, route", [(1, Route.FALLBACK), (100, Route.REMOTE)], ids=["short", "long"])
def test_the_prefill_deadline_is_sized_to_the_legs_work(prompt_tokens, route):
    """app.request.deadlines: a 0.05 s floor, prefill at 1,000 tokens/s and a margin of 3. A leg that takes 0.15 s is past
    the floor: a 1-token prompt (expected 1 ms) falls back at it; a 100-token one (expected 0.1 s, deadline 0.3 s) is
    waited for. The decode leg tells its engine the matching KV deadline (connector.push_deadline)."""
    from connector.params import KV_DEADLINE_KEY

    handoff = _handoff(decode_after_s=0.15)
    handoff.deadlines = Deadlines(prefill_floor_s=0.05, kv_after_prefill_s=15.0, margin=3.0, assumed_prefill_tokens_per_s=1000)
    sent = []

    async def push(request, raw=None):
        decode_request = _decode_request()
        async for chunk in handoff.concurrent_decode("completions", decode_request, _Prefill(0.15), None):
            sent.append(decode_request.kv_transfer_params[KV_DEADLINE_KEY])
            yield chunk

    handoff._push = push
    served = Served(Route.REMOTE)
    request = PROMPT_TOKENS.copy_with(CompletionRequest(model="m", prompt="hi", request_id="rdv-1"), prompt_tokens)
    chunks, error = _collect(handoff.remote_or_fallback(request, None, "completions", served))
    assert (error, served.route) == (None, route)
    if route is Route.REMOTE:
        assert chunks == ["d1", "d2"] and sent[0] == pytest.approx(0.3 + 15.0)  # past the engine's default (15.05)
