"""A completions prompt list split into one request per prompt and joined back (app.ingress.prompt_list)."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.responses import JSONResponse, StreamingResponse
from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest

from app.ingress.prompt_list import StreamJoin, events, join_answers, joined, split_prompts

MODEL = "m"


def request(prompt, **kwargs) -> CompletionRequest:
    return CompletionRequest(model=MODEL, prompt=prompt, **kwargs)


@pytest.mark.parametrize("prompt", ["one", [1, 2, 3], ["one"], [[1, 2, 3]]], ids=repr)
def test_one_prompt_is_not_split(prompt):
    assert split_prompts(request(prompt)) is None


@pytest.mark.parametrize("prompt", [["one", "two", "three"], [[1, 2], [3], [4, 5, 6]]], ids=repr)
def test_a_list_becomes_one_request_per_prompt_with_everything_else_kept(prompt):
    parts = split_prompts(request(prompt, max_tokens=7, temperature=0.0, stream=True))
    assert [part.prompt for part in parts] == prompt
    assert {(part.max_tokens, part.temperature, part.stream) for part in parts} == {(7, 0.0, True)}


def answer(texts: list[str], prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": f"cmpl-{texts[0]}", "object": "text_completion", "model": MODEL,
            "choices": [{"index": j, "text": text, "finish_reason": "length"} for j, text in enumerate(texts)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def test_whole_answers_join_as_vllms_one_answer_to_the_list():
    joined_answer = join_answers([answer(["a0", "a1"], 10, 4), answer(["b0", "b1"], 20, 6)], n=2)
    assert [(c["index"], c["text"]) for c in joined_answer["choices"]] == [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]
    assert joined_answer["usage"] == {"prompt_tokens": 30, "completion_tokens": 10, "total_tokens": 40,
                                      "prompt_tokens_details": None}
    assert joined_answer["id"] == "cmpl-a0"


def chunk(index: int, text: str) -> str:
    return json.dumps({"id": "x", "object": "text_completion", "created": 1, "model": MODEL,
                       "choices": [{"index": index, "text": text}]})


def usage_chunk(prompt_tokens: int, completion_tokens: int) -> str:
    return json.dumps({"id": "x", "object": "text_completion", "created": 1, "model": MODEL, "choices": [],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens}})


def test_streams_interleave_with_one_id_renumbered_choices_one_usage_chunk_and_one_done():
    join = StreamJoin(prompts=2, n=1, include_usage=True)
    out = [join.event(1, chunk(0, "b")), join.event(0, chunk(0, "a")), join.event(1, usage_chunk(5, 1)),
           join.event(1, "[DONE]")]
    assert out[2:] == [None, None] and not join.finished
    assert [join.event(0, usage_chunk(3, 1)), join.event(0, "[DONE]")] == [None, None] and join.finished
    sent = [json.loads(e) for text in out[:2] + [join.ending()] for e in events(text) if e != "[DONE]"]
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in sent[:2]] == [(1, "b"), (0, "a")]
    assert len({c["id"] for c in sent}) == 1
    assert sent[2]["choices"] == [] and sent[2]["usage"]["total_tokens"] == 10
    assert events(join.ending())[-1] == "[DONE]"


def test_an_error_event_ends_the_joined_stream():
    join = StreamJoin(prompts=2, n=1, include_usage=True)
    error = json.dumps({"error": {"message": "lost", "code": 503}})
    assert join.event(0, error) == f"data: {error}\n\n" and join.finished
    assert events(join.ending()) == ["[DONE]"]


def test_a_failed_prompt_fails_the_request_and_the_others_are_cancelled():
    cancelled = []

    async def answer_of(part):
        if part.prompt == "bad":
            await asyncio.sleep(0.01)
            return JSONResponse(status_code=400, content={"error": {"message": "bad", "code": 400}})
        try:
            await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            cancelled.append(part.prompt)
            raise

        async def body():
            yield f"data: {chunk(0, part.prompt)}\n\n"

        return StreamingResponse(body())

    response = asyncio.run(joined(split_prompts(request(["ok", "bad"], stream=True)), answer_of))
    assert response.status_code == 400 and cancelled == []  # the stream that came is closed

    async def raising(part):
        if part.prompt == "bad":
            raise ValueError("refused")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(part.prompt)
            raise

    with pytest.raises(ValueError):
        asyncio.run(joined(split_prompts(request(["ok", "bad"])), raising))
    assert cancelled == ["ok"]


def test_joined_streams_come_out_as_one_stream():
    async def answer_of(part):
        async def body():
            for word in part.prompt.split():
                await asyncio.sleep(0)
                yield f"data: {chunk(0, word)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body())

    async def read():
        response = await joined(split_prompts(request(["a b c", "d e"], stream=True)), answer_of)
        return [e for packet in [p async for p in response.body_iterator] for e in events(packet)]

    sent = asyncio.run(read())
    assert sent[-1] == "[DONE]" and sent.count("[DONE]") == 1
    texts = {}
    for data in sent[:-1]:
        choice = json.loads(data)["choices"][0]
        texts.setdefault(choice["index"], []).append(choice["text"])
    assert texts == {0: ["a", "b", "c"], 1: ["d", "e"]}
