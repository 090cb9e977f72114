"""``/tokenize`` and ``/detokenize`` served as vLLM's server serves them.

Ray Serve LLM 2.60 looks for vLLM's tokenization server under its name before vLLM 0.32
(``state.openai_serving_tokenization``); vLLM 0.32 calls it ``state.serving_tokenization``. Ray finds
nothing and answers every ``/tokenize`` with a 400, "This model does not support the 'tokenization'
task". A replica hands its engine the server vLLM built (``connector.seams`` lists both names)."""

from __future__ import annotations

from typing import Any


def serve_tokenization(engine: Any) -> bool:
    """Give Ray's vLLM ``engine`` the tokenization server vLLM built for it, if Ray did not find it; whether
    the engine has one now."""
    if getattr(engine, "_oai_serving_tokenization", None) is None:
        serving = getattr(getattr(engine, "_app_state", None), "serving_tokenization", None)
        if serving is not None:
            engine._oai_serving_tokenization = serving
    return getattr(engine, "_oai_serving_tokenization", None) is not None
