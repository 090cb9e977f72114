"""Which requests get a prefill leg (app.routing.eligibility), on vLLM's own request models."""

from __future__ import annotations

import pytest
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest

from app.routing.eligibility import _prompt_logprobs, decode_alone_reason, requested_output_tokens

MODEL = "SmolLM2-135M-Instruct"


def chat(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}], **kwargs)


def completion(**kwargs) -> CompletionRequest:
    return CompletionRequest(model=MODEL, **{"prompt": "hi", **kwargs})


@pytest.mark.parametrize("request_", [
    chat(max_tokens=16), chat(), chat(logprobs=True, top_logprobs=3), chat(min_tokens=4, max_tokens=8),
    completion(max_tokens=16), completion(logprobs=2), completion(echo=True), completion(n=1, best_of=1),
    completion(prompt=[1, 2, 3]), completion(prompt=["one prompt in a list"]), completion(prompt=[[1, 2, 3]]),
], ids=repr)
def test_ordinary_requests_get_a_prefill_leg(request_):
    assert decode_alone_reason(request_, prompt_tokens=100, max_model_len=4096) is None


@pytest.mark.parametrize("request_, reason", [
    (completion(prompt=["one", "two"]), "several prompts"),
    (completion(prompt=[[1, 2], [3, 4]]), "several prompts"),
    (chat(n=2), "several sequences"),
    (completion(n=3), "several sequences"),
    (completion(best_of=2), "several sequences"),
    (completion(use_beam_search=True), "several sequences"),
    (chat(prompt_logprobs=0), "prompt logprobs"),
    (chat(echo=True), "prompt logprobs"),
    (completion(prompt_logprobs=1), "prompt logprobs"),
    (completion(echo=True, logprobs=0), "prompt logprobs"),
], ids=repr)
def test_what_only_the_engine_computing_the_prompt_can_answer_stays_on_decode(request_, reason):
    assert decode_alone_reason(request_, prompt_tokens=100, max_model_len=4096) == reason


@pytest.mark.parametrize("request_", [
    chat(max_tokens=0), chat(max_completion_tokens=-1), completion(max_tokens=-2), completion(temperature=-1.0),
    chat(top_p=1.5), completion(min_tokens=-1), chat(logit_bias={"abc": 1.0}), completion(n=0), chat(top_k=-2),
    completion(min_tokens=10, max_tokens=4),
], ids=repr)
def test_sampling_parameters_decode_would_refuse_are_refused_by_decode_alone(request_):
    """The prefill leg asks for one token, which vLLM would accept: it must not be sent."""
    assert decode_alone_reason(request_, prompt_tokens=100, max_model_len=4096) == "invalid sampling parameters"


@pytest.mark.parametrize("request_, prompt_tokens, alone", [
    (completion(max_tokens=96), 4000, False),  # exactly the context
    (completion(max_tokens=97), 4000, False),  # more than fits: vLLM bounds the output by the context
    (chat(max_tokens=10, max_completion_tokens=200), 4000, False),
    (completion(max_tokens=10**6), 4095, False),  # room for one token
    (chat(), 4095, False),  # no bound: up to the context, one token at least
    (chat(), 4096, True),  # no room for one token: vLLM refuses it
    (completion(max_tokens=1), 4096, True),
    (completion(max_tokens=10**6), None, False),  # prompt not counted: the engines decide
])
def test_only_a_prompt_that_fills_the_context_is_refused_by_decode_alone(request_, prompt_tokens, alone):
    reason = decode_alone_reason(request_, prompt_tokens=prompt_tokens, max_model_len=4096)
    assert (reason == "longer than the context") is alone


def test_vllm_serves_a_request_for_more_output_than_the_context_holds_bounded_by_it():
    """The vLLM behaviour the rule above follows (a seam): 4000 prompt tokens in a 4096-token context, 10**6
    output tokens asked for: 96 are allowed, not an error; a prompt that fills the context is refused."""
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    assert get_max_tokens(4096, 10**6, 4000, {}) == 96
    assert get_max_tokens(4096, 16, 4000, {}) == 16
    with pytest.raises(ValueError):
        get_max_tokens(4096, 16, 4097, {})


@pytest.mark.parametrize("request_", [
    chat(), chat(echo=True), chat(echo=True, logprobs=True, top_logprobs=4), chat(prompt_logprobs=2), chat(logprobs=True),
    completion(), completion(echo=True), completion(echo=True, logprobs=3), completion(prompt_logprobs=0),
    completion(logprobs=5),
], ids=repr)
def test_prompt_logprobs_are_read_as_vllm_reads_them(request_):
    assert _prompt_logprobs(request_) == request_.to_sampling_params(16, {}).prompt_logprobs


def test_output_bound_is_read_as_vllm_reads_it():
    assert requested_output_tokens(chat(max_tokens=10, max_completion_tokens=20)) == 20
    assert requested_output_tokens(chat(max_tokens=10)) == 10
    assert requested_output_tokens(chat()) is None
    assert requested_output_tokens(completion()) == 16  # the completions API's default
