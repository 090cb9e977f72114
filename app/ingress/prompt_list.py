"""A completions request with a list of prompts, served as one disaggregated request per prompt.

vLLM turns ``"prompt": [p0, p1, ...]`` into one engine request per prompt, but a disaggregated request
carries one KV handoff: decoded as one request, every prompt after the first would continue the first
prompt's KV (HTTP 200, wrong text). So the ingress splits the list, sends each prompt through the whole
path (routing, prefill, handoff, fallback) as a request of its own, and joins the answers back into the one
OpenAI response vLLM's server gives: choice ``j`` of prompt ``i`` has index ``i * n + j``, usage is summed, one
id names every choice; a stream interleaves the prompts' chunks as they come, with one usage chunk (when
asked) and one ``[DONE]``. If one prompt fails before its answer started, the request fails with its error
and the other prompts are cancelled, as in vLLM's server.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")
_DONE = "[DONE]"


def split_prompts(body: Any) -> list[Any] | None:
    """One request per prompt of a completions request with several prompts; None for one prompt (a string,
    a list of token ids, or a list of one)."""
    prompt = getattr(body, "prompt", None)
    if not isinstance(prompt, list) or len(prompt) < 2 or all(isinstance(p, int) for p in prompt):
        return None
    return [body.model_copy(update={"prompt": p}) for p in prompt]


def sequences_per_prompt(body: Any) -> int:
    return max(getattr(body, "n", None) or 1, 1)


async def joined(parts: Sequence[Any], answer: Callable[[Any], Awaitable[Response]]) -> Response:
    """The answers of ``parts`` (``answer(part)`` each, all at once) as one response."""
    tasks = [asyncio.ensure_future(answer(part)) for part in parts]
    try:
        responses = await _all_or_first_failure(tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if failed := next((r for r in responses if r.status_code != 200), None):
        await _close_streams(responses)
        return failed
    n = sequences_per_prompt(parts[0])
    if all(isinstance(r, StreamingResponse) for r in responses):
        include_usage = bool(getattr(getattr(parts[0], "stream_options", None), "include_usage", False))
        return StreamingResponse(_joined_stream(responses, n, include_usage), media_type="text/event-stream")
    return JSONResponse(content=join_answers([json.loads(r.body) for r in responses], n))


async def _all_or_first_failure(tasks: list[asyncio.Future]) -> list[Response]:
    """Every task's response; on the first exception, that exception (the caller cancels the rest)."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()
    return [task.result() for task in tasks]


async def _close_streams(responses: Sequence[Response]) -> None:
    for response in responses:
        body = getattr(response, "body_iterator", None)
        if body is not None and hasattr(body, "aclose"):
            await body.aclose()


def join_answers(answers: Sequence[dict], n: int) -> dict:
    """Whole answers, one per prompt in order, as vLLM's one answer to the list."""
    joined_answer = dict(answers[0])
    joined_answer["choices"] = [
        {**choice, "index": i * n + choice.get("index", 0)} for i, answer in enumerate(answers) for choice in answer["choices"]
    ]
    joined_answer["usage"] = summed_usage([answer.get("usage") for answer in answers])
    return joined_answer


def summed_usage(usages: Sequence[dict | None]) -> dict | None:
    present = [usage for usage in usages if usage]
    if not present:
        return None
    return {**present[0], **{k: sum(usage.get(k) or 0 for usage in present) for k in _USAGE_FIELDS},
            "prompt_tokens_details": None}


class StreamJoin:
    """The events of several prompts' streams, as one stream (pure: fed event by event)."""

    def __init__(self, prompts: int, n: int, include_usage: bool) -> None:
        self._n, self._include_usage = n, include_usage
        self._open = set(range(prompts))
        self._usage: list[dict] = []
        self._id, self._created, self._model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), None
        self.failed = False

    def event(self, prompt: int, data: str) -> str | None:
        """What to send for one ``data:`` payload of prompt ``prompt``'s stream, if anything."""
        if data == _DONE:
            self._open.discard(prompt)
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            return f"data: {data}\n\n"
        if "error" in chunk:
            self.failed = True
            return f"data: {data}\n\n"
        if not chunk.get("choices") and chunk.get("usage"):
            self._usage.append(chunk["usage"])  # the prompt's own usage chunk: summed at the end
            return None
        self._model = self._model or chunk.get("model")
        chunk.update(id=self._id, created=self._created)
        for choice in chunk.get("choices") or ():
            choice["index"] = prompt * self._n + choice.get("index", 0)
        return f"data: {json.dumps(chunk)}\n\n"

    @property
    def finished(self) -> bool:
        return self.failed or not self._open

    def ending(self) -> str:
        """The usage chunk (when asked for) and ``[DONE]``."""
        usage = ""
        if self._include_usage and not self.failed:
            chunk = {"id": self._id, "object": "text_completion", "created": self._created, "model": self._model,
                     "choices": [], "usage": summed_usage(self._usage)}
            usage = f"data: {json.dumps(chunk)}\n\n"
        return usage + f"data: {_DONE}\n\n"


def events(packet: str | bytes) -> list[str]:
    """The ``data:`` payloads of a server-sent-events packet (one or several events)."""
    text = packet.decode() if isinstance(packet, bytes) else packet
    return [line[len("data:"):].strip() for line in text.split("\n") if line.startswith("data:")]


async def _joined_stream(responses: Sequence[StreamingResponse], n: int, include_usage: bool) -> AsyncIterator[str]:
    join = StreamJoin(len(responses), n, include_usage)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(prompt: int, body: AsyncIterator) -> None:
        try:
            async for packet in body:
                await queue.put((prompt, packet))
        finally:
            await queue.put((prompt, None))

    pumps = [asyncio.ensure_future(pump(i, r.body_iterator)) for i, r in enumerate(responses)]
    ended = 0
    try:
        while ended < len(pumps) and not join.finished:
            prompt, packet = await queue.get()
            if packet is None:
                ended += 1
                join.event(prompt, _DONE)  # a stream that ended without [DONE] is over all the same
                continue
            out = "".join(text for data in events(packet) if (text := join.event(prompt, data)) is not None)
            if out:
                yield out
        yield join.ending()
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
