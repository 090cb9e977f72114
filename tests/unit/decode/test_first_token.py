"""app.decode.first_token: a whole answer's first token, as vLLM's own output processor times it."""

from __future__ import annotations

import asyncio
import time

from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
from vllm.v1.metrics.stats import IterationStats

from app.decode.first_token import FirstTokens, first_token_of

STEP_S = 0.05


class EngineClient:
    """The part of vLLM's AsyncLLM a whole answer goes through: its own output processor (with stats, as our
    engines run), fed one engine output per step; ``generate`` yields what the request's collector holds."""

    def __init__(self, log_stats: bool = True):
        self.output_processor = OutputProcessor(None, log_stats=log_stats)

    async def generate(self, engine_request_id: str, tokens: int):
        params = SamplingParams(max_tokens=tokens, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
        request = EngineCoreRequest(
            request_id=engine_request_id + "-internal", prompt_token_ids=[1, 2, 3], mm_features=None,
            sampling_params=params, pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
            data_parallel_rank=None, external_req_id=engine_request_id)
        collector = RequestOutputCollector(RequestOutputKind.FINAL_ONLY, request.request_id)
        self.output_processor.add_request(request, None, queue=collector)
        for i in range(tokens):
            await asyncio.sleep(STEP_S)
            done = FinishReason.LENGTH if i == tokens - 1 else None
            self.output_processor.process_outputs(
                [EngineCoreOutput(request_id=request.request_id, new_token_ids=[7 + i], finish_reason=done)],
                time.monotonic(), IterationStats() if self.output_processor.log_stats else None)
        yield collector.get_nowait()


async def _answer(client, engine_request_id: str, tokens: int):
    outputs = [o async for o in client.generate(engine_request_id, tokens)]
    return outputs, time.time()


def test_a_whole_answers_first_token_is_its_first_steps_time_not_its_last():
    client = EngineClient()
    first_tokens = FirstTokens.watching(client)
    sent = time.time()
    (output,), answered = asyncio.run(_answer(client, "cmpl-rdv-abc-0", tokens=4))
    assert output.finished
    first = first_tokens.take("rdv-abc")  # our id: without the endpoint's prefix and the prompt's index
    assert first is not None and sent + STEP_S * 0.9 <= first.frontend_at <= answered - 2 * STEP_S
    # The engine core's monotonic stamp, on the wall clock: here the same moment (the "core" is this process).
    assert first.engine_at is not None and abs(first.engine_at - first.frontend_at) < 0.02
    assert first_tokens.take("rdv-abc") is None  # once


def test_a_streams_later_outputs_note_nothing_more():
    """Noted once per request: after the replica took a stream's first token, its later outputs (the same stats) do
    not put it back."""

    class Stream(EngineClient):
        async def generate(self, engine_request_id, tokens):
            async for output in super().generate(engine_request_id, tokens):
                yield output
                yield output  # a later output of the same request

    client = Stream()
    first_tokens = FirstTokens.watching(client)

    async def drain():
        taken = []
        async for _ in client.generate("cmpl-rdv-s-0", 2):
            taken.append(first_tokens.take("rdv-s"))  # the replica takes it at its first chunk
        return taken

    first, later = asyncio.run(drain())
    assert first is not None and later is None and first_tokens.take("rdv-s") is None


def test_without_the_engines_stats_nothing_is_noted():
    client = EngineClient(log_stats=False)
    first_tokens = FirstTokens.watching(client)
    (output,), _ = asyncio.run(_answer(client, "cmpl-rdv-abc-0", tokens=2))
    assert first_token_of(output) is None and first_tokens.take("rdv-abc") is None


def test_an_engine_client_without_generate_leaves_the_callers_stamp():
    assert FirstTokens.watching(None).take("rdv-abc") is None


def test_first_tokens_never_taken_do_not_pile_up():
    first_tokens = FirstTokens()

    class Output:
        def __init__(self, i):
            self.request_id, self.metrics = f"cmpl-rdv-{i}-0", type("S", (), {"arrival_time": 1.0, "first_token_latency": 0.5})
    for i in range(5000):
        first_tokens.note(Output(i))
    assert first_tokens.take("rdv-0") is None and first_tokens.take("rdv-4999") == (None, 1.5)
