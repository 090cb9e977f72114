"""bench/soak.py: how each request of the soak ended, against a mock HTTP transport."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize(
    "status, body, stream, outcome",
    [
        (200, {"choices": [{"message": {"content": "hi"}}]}, False, "ok"),
        (429, {"error": {"message": "busy"}}, False, "rejected"),
        (503, {"error": {"message": "no replica"}}, False, "error"),
        (502, "<html>bad gateway</html>", False, "lost"),  # not an OpenAI error: a client cannot act on it
        (200, 'data: {"choices": []}\n\ndata: [DONE]\n\n', True, "ok"),
        (200, 'data: {"choices": []}\n\ndata: {"error": {"code": 503}}\n\ndata: [DONE]\n\n', True, "error"),
        (200, 'data: {"choices": []}\n\n', True, "lost"),  # cut: no [DONE]
    ],
)
def test_soak_classifies_how_each_request_ended(status, body, stream, outcome):
    import random

    import httpx

    from bench.soak import one_request

    def handler(request):
        content = body if isinstance(body, str) else json.dumps(body)
        return httpx.Response(status, content=content.encode())

    rng = random.Random(1 if stream else 0)
    http = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://app")
    for _ in range(50):  # until the random kind is streamed (or not) as this case needs
        kind, got, _ = one_request(http, rng, "m", {"id": "c", "messages": []})
        if (kind == "completion-stream") == stream:
            break
    assert (kind == "completion-stream") == stream and got == outcome
