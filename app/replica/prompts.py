"""A prompt's token ids as a replica renders them (for routing and reuse decisions)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("ray.serve." + __name__)


def prompt_token_ids(tokenizer, request) -> list[int] | None:
    """Prompt token ids of ``request`` as this replica renders them; None if unknown."""
    if tokenizer is None:
        return None
    try:
        if hasattr(request, "messages"):
            # return_dict=False: transformers 5 returns a BatchEncoding (2 keys) by default.
            return list(tokenizer.apply_chat_template(
                [_plain_message(m) for m in request.messages], add_generation_prompt=True, tokenize=True,
                return_dict=False,
            ))
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, add_special_tokens=False)
    except Exception:  # an unusual prompt shape: the engine will judge it
        logger.debug("could not tokenize the prompt", exc_info=True)
    return None


def _plain_message(message: Any) -> dict:
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):  # content parts: keep the text
        message["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return message


def load_tokenizer(llm_config):
    from transformers import AutoTokenizer

    source = llm_config.model_loading_config.model_source or llm_config.model_id
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception:
        logger.warning("no tokenizer for %s: prompt lengths unknown, every request is disaggregated", source, exc_info=True)
        return None
