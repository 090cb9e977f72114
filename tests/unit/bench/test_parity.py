"""bench.parity's comparison (what of two answers must be equal) and bench.reference's `vllm serve` flags."""

from __future__ import annotations

import json

import httpx
import pytest

from bench.parity import answer_of, differences, shapes
from bench.reference import cli_args


def response(status: int, body=None, stream: list[str] | None = None) -> httpx.Response:
    if stream is not None:
        return httpx.Response(status, text="".join(f"data: {e}\n\n" for e in stream),
                              headers={"content-type": "text/event-stream"})
    return httpx.Response(status, json=body)


ANSWER = {"id": "cmpl-1", "created": 5, "object": "text_completion", "model": "m",
          "choices": [{"index": 0, "text": " Paris", "token_ids": [7], "logprobs": {"token_logprobs": [-0.25]},
                       "finish_reason": "length"}],
          "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, "prompt_tokens_details": None}}


def test_ids_timestamps_and_message_wording_are_not_compared_everything_else_is():
    other = json.loads(json.dumps(ANSWER)) | {"id": "cmpl-2", "created": 9}
    assert differences(answer_of(response(200, ANSWER)), answer_of(response(200, other))) == []
    other["choices"][0]["token_ids"] = [8]
    assert differences(answer_of(response(200, ANSWER)), answer_of(response(200, other))) == [
        ".body.choices[0].token_ids[0]: 7, vLLM 8"]
    refused = lambda kind, words: response(400, {"error": {"type": kind, "message": words, "code": 400}})  # noqa: E731
    assert differences(answer_of(refused("BadRequestError", "a")), answer_of(refused("BadRequestError", "b"))) == []
    assert differences(answer_of(refused("OpenAIHTTPException", "a")), answer_of(refused("BadRequestError", "a"))) == [
        ".type: \"OpenAIHTTPException\", vLLM \"BadRequestError\""]


@pytest.mark.parametrize("theirs, equal", [(-0.25 + 5e-5, True), (-0.25 + 1e-3, False)])
def test_logprobs_are_equal_to_a_ten_thousandth_of_a_nat(theirs, equal):
    other = json.loads(json.dumps(ANSWER))
    other["choices"][0]["logprobs"]["token_logprobs"] = [theirs]
    assert (differences(answer_of(response(200, ANSWER)), answer_of(response(200, other))) == []) is equal


def chunk(index: int, text: str, usage=None) -> str:
    return json.dumps({"id": "x", "choices": [{"index": index, "text": text}] if text else [], "usage": usage})


def test_a_stream_is_compared_by_what_it_delivers_per_choice_which_chunks_carry_usage_and_its_one_done():
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    interleaved = answer_of(response(200, stream=[chunk(1, "b"), chunk(0, "a"), chunk(0, "c"), chunk(0, "", usage), "[DONE]"]))
    ordered = answer_of(response(200, stream=[chunk(0, "a"), chunk(0, "c"), chunk(1, "b"), chunk(0, "", usage), "[DONE]"]))
    assert differences(interleaved, ordered) == []
    assert interleaved["stream"]["choices"] == {"0": {"text": "ac", "finish_reason": None},
                                                "1": {"text": "b", "finish_reason": None}}
    twice = answer_of(response(200, stream=[chunk(0, "a"), chunk(0, "c"), chunk(1, "b"), chunk(0, "", usage), "[DONE]",
                                            "[DONE]"]))
    assert differences(twice, ordered) == [".stream.done: 2, vLLM 1"]


def test_tokens_merged_into_fewer_chunks_are_the_same_stream_but_usage_in_other_chunks_is_not():
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    three = answer_of(response(200, stream=[chunk(0, "a", usage), chunk(0, "c", usage), chunk(0, "", usage), "[DONE]"]))
    merged = answer_of(response(200, stream=[chunk(0, "ac", usage), chunk(0, "", usage), "[DONE]"]))
    assert differences(merged, three) == []
    assert three["stream"]["usage_in"] == "every chunk"
    last_only = answer_of(response(200, stream=[chunk(0, "ac"), chunk(0, "", usage), "[DONE]"]))
    assert differences(last_only, three) == [".stream.usage_in: \"last chunk\", vLLM \"every chunk\""]
    none = answer_of(response(200, stream=[chunk(0, "ac"), "[DONE]"]))
    assert none["stream"]["usage_in"] == "none"


def test_every_shape_the_issue_names_is_sent():
    sent = shapes(lambda text: [1, 2, 3])
    names = {s.name for s in sent}
    assert len(names) == len(sent)
    fields = {key for s in sent for key in s.body} | {key for s in sent for key in s.body.get("stream_options", {})}
    assert {"echo", "logprobs", "top_logprobs", "prompt_logprobs", "n", "best_of", "stop", "stop_token_ids", "min_tokens",
            "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "structured_outputs",
            "response_format", "include_usage", "continuous_usage_stats", "continue_final_message",
            "max_completion_tokens"} <= fields
    assert {s.path for s in sent} == {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    assert any(isinstance(s.body.get("prompt"), list) and isinstance(s.body["prompt"][0], list) for s in sent)
    assert sum(s.name.startswith("error-") for s in sent) == 5


def test_engine_kwargs_become_vllm_serve_flags():
    assert cli_args({"max_model_len": 4096, "dtype": "float32", "enable_prefix_caching": False, "enforce_eager": True,
                     "kv_transfer_config": None, "limit_mm_per_prompt": {"image": 0}}) == [
        "--max-model-len", "4096", "--dtype", "float32", "--no-enable-prefix-caching", "--enforce-eager",
        "--limit-mm-per-prompt", '{"image": 0}']
