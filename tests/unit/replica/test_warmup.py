"""app.replica.warmup: what the warm-up asks of an engine, and that a failing or hung engine fails the start."""

import asyncio

import pytest
from ray.llm._internal.serve.core.configs.openai_api_models import ErrorResponse

from app.replica.warmup import OUTPUT_TOKENS, SAMPLING, warm_up, warm_up_requests


def _engine(*chunks, hang=False):
    seen = []

    async def generate(request):
        seen.append(request)

        async def stream():
            for chunk in chunks:
                yield chunk
            if hang:
                await asyncio.sleep(60)
        return stream()
    return generate, seen


def test_the_warm_ups_sample_with_top_p_and_with_a_seed_and_carry_no_transfer_params():
    requests = warm_up_requests("m")
    assert [(r.temperature, r.top_p, r.seed) for r in requests] == [(1.0, 0.9, None), (1.0, None, 0)]
    assert len(requests) == len(SAMPLING)
    for request in requests:
        assert request.model == "m" and request.max_tokens == OUTPUT_TOKENS and not request.stream
        assert request.kv_transfer_params is None and request.request_id.startswith("warmup-")
    assert len({r.request_id for r in requests + warm_up_requests("m")}) == 2 * len(SAMPLING)


def test_a_served_warm_up_returns_its_duration():
    generate, seen = _engine("a completion")
    seconds = asyncio.run(warm_up(None, "m", "decode", generate=generate))
    assert seconds >= 0 and len(seen) == len(SAMPLING) and seen[0].model == "m"


@pytest.mark.parametrize("chunks, hang, message", [
    ((ErrorResponse(error={"message": "boom", "type": "InternalServerError", "code": 500}),), False,
     "the prefill engine failed its warm-up generation"),
    ((), True, "the prefill engine did not finish its warm-up generations in 0 s"),
])
def test_an_engine_that_fails_or_hangs_its_warm_up_fails_the_start(chunks, hang, message):
    generate, _ = _engine(*chunks, hang=hang)
    with pytest.raises(RuntimeError, match=message):
        asyncio.run(warm_up(None, "m", "prefill", generate=generate, timeout_s=0.2))
