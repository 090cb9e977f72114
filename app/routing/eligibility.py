"""Which requests a prefill leg can serve (pure).

A disaggregated request is computed twice over: prefill computes the prompt and one
token, decode continues from the prompt's KV. Some requests need more of the prompt
than its KV, or could never be decoded; decode serves them alone (a local prefill),
which answers them exactly as one engine would:

* several prompts (a completions prompt list; the ingress splits one into a request per prompt,
  ``app.ingress.prompt_list``, so only a caller that skips it gets here): the decode engine makes one
  request of each, and a handoff carries one prompt's KV;
* several sequences per prompt (``n`` or ``best_of`` above 1, beam search): each of the decode
  engine's sequences would register for the one prefill request's KV;
* prompt logprobs (``prompt_logprobs``, or ``echo``, which asks for them as well):
  they come from the engine that computes the prompt, and decode computes none of it;
* a request decode's engine refuses (a 400) while the prefill leg, shaped to one token,
  would pass: sampling parameters vLLM rejects (``max_tokens`` 0 or below, ...). The leg
  would compute the prompt and hold its KV for nobody until its lease ran out;
* a prompt that leaves no room in the model's context for one token: vLLM refuses it.

A prompt plus *requested* output beyond the context is not among them: vLLM (since 0.32,
``get_max_tokens``) serves it, its output bounded by what the context holds, and so does
a disaggregated request (decode's engine bounds it the same way).
"""

from __future__ import annotations

from typing import Any

_NO_BOUND = 1 << 20  # output tokens when neither the request nor the model bounds them


def requested_output_tokens(request: Any) -> int | None:
    """The output bound the request asks for, as vLLM reads it (chat's
    ``max_completion_tokens`` before ``max_tokens``); None = up to the context length."""
    return getattr(request, "max_completion_tokens", None) or getattr(request, "max_tokens", None)


def decode_alone_reason(request: Any, prompt_tokens: int | None, max_model_len: int | None) -> str | None:
    """Why ``request`` must not get a prefill leg, or None if it may."""
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(p, int) for p in prompt):
        return "several prompts"
    sequences = max(getattr(request, "n", None) or 1, getattr(request, "best_of", None) or 1)
    if sequences > 1 or getattr(request, "use_beam_search", False):
        return "several sequences"
    if _prompt_logprobs(request) is not None:
        return "prompt logprobs"
    if _refused_sampling(request, max_model_len):
        return "invalid sampling parameters"
    if prompt_tokens is not None and max_model_len and prompt_tokens + 1 > max_model_len:
        return "longer than the context"
    return None


def _refused_sampling(request: Any, max_model_len: int | None) -> bool:
    """Whether vLLM's own validation refuses the sampling parameters decode would get."""
    if not hasattr(request, "to_sampling_params"):
        return False
    bound = requested_output_tokens(request)
    try:
        request.to_sampling_params(bound if bound is not None else max_model_len or _NO_BOUND, {})
    except Exception:  # noqa: BLE001 - whatever vLLM refuses, decode's engine answers with its 400
        return True
    return False


def _prompt_logprobs(request: Any) -> int | None:
    # As vLLM's to_sampling_params reads them: echo asks for them too.
    wanted = getattr(request, "prompt_logprobs", None)
    if wanted is None and getattr(request, "echo", False):
        wanted = getattr(request, "top_logprobs" if hasattr(request, "messages") else "logprobs", None)
    return wanted
