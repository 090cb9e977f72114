"""app/decode/server.py: DecodeServer, built without Ray Serve or an engine (tests/support/decode_server.py):
transfer ids, load accounting, and which prompts it prefills itself."""

from __future__ import annotations

import pytest
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDDecodeServer, PDPrefillServer

from tests.support.decode_server import decode_server, drain


def test_decode_server_gives_each_request_a_fresh_transfer_id():
    from app.decode.server import DecodeServer
    from app.prefill.server import PrefillServer

    assert issubclass(DecodeServer, PDDecodeServer) and issubclass(PrefillServer, PDPrefillServer)
    server = decode_server()
    # As the ingress hands them over: request_id is a default, not explicitly set.
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    completion = CompletionRequest(model="m", prompt="hi")
    assert "request_id" not in chat.model_fields_set | completion.model_fields_set
    original_ids = (chat.request_id, completion.request_id)

    assert drain(server, "chat", chat, "raw") == ["remote-chunk"]
    drain(server, "chat", chat)
    drain(server, "completions", completion)
    ids = [request.request_id for request, _ in server.seen]
    assert all(i.startswith("rdv-") for i in ids) and len(set(ids)) == 3
    # Explicitly set, so Ray's LLMServer does not replace it with Serve's request id.
    assert all("request_id" in request.model_fields_set for request, _ in server.seen)
    assert server.seen[0][1] == "raw"
    assert (chat.request_id, completion.request_id) == original_ids  # originals untouched
    assert not set(ids) & set(original_ids)


def test_decode_server_counts_load_while_a_request_is_in_flight():
    server = decode_server(prompt_tokens=40)
    drain(server, "completions", CompletionRequest(model="m", prompt="hi", max_tokens=10))
    assert server.load == [(1, 50)]
    assert (server._ongoing, server._tokens_in_flight) == (0, 0)


def _hi(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kwargs)


@pytest.mark.parametrize("prompt_tokens, expected", [(3, "local"), (15, "local"), (16, "remote"), (400, "remote")])
def test_decode_server_prefills_short_prompts_locally(prompt_tokens, expected):
    server = decode_server(local_below=16, prompt_tokens=prompt_tokens)
    assert drain(server, "chat", _hi()) == [f"{expected}-chunk"] and server.paths == [expected]


@pytest.mark.parametrize("request_, prompt_tokens, expected", [
    (_hi(n=2), 400, "local"),
    (_hi(max_tokens=4000), 400, "remote"),  # 400 + 4000 > the fake's 4096: vLLM bounds the output, not a refusal
    (_hi(max_tokens=3000), 400, "remote"),
    (_hi(max_tokens=1), 4096, "local"),  # no room for one token: decode's engine refuses it
])
def test_decode_server_serves_alone_what_a_prefill_leg_cannot(request_, prompt_tokens, expected):
    server = decode_server(prompt_tokens=prompt_tokens)
    assert drain(server, "chat", request_) == [f"{expected}-chunk"] and server.paths == [expected]


def test_chat_prompts_are_counted_in_tokens_not_in_encoding_keys():
    """transformers 5's apply_chat_template returns a BatchEncoding unless told otherwise;
    its len() is 2 (its keys), which once sent every chat request down the local path."""
    from transformers import AutoTokenizer

    from app.model_source import resolve_model_source

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source("embedded"))
    server = decode_server(prompt_tokens=None, tokenizer=tokenizer)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Why is the sky blue? " * 10}])
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Why is the sky blue? " * 10}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert server._prompt_token_ids(chat) == list(expected) and len(expected) > 60


def test_without_a_tokenizer_every_request_is_disaggregated():
    server = decode_server(local_below=16, prompt_tokens=None)  # no tokenizer: length unknown
    drain(server, "completions", CompletionRequest(model="m", prompt="hi"))
    assert server.paths == ["remote"]
