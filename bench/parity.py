"""``python -m bench parity``: the app's OpenAI surface against vLLM's own server, request by request.

Every request shape vLLM's server takes for completions, chat, ``/tokenize`` and ``/detokenize`` (:func:`shapes`) is
sent to the app and to one plain ``vllm serve`` with the app's decode engine args (``bench.reference``), one at a
time, greedy or seeded, and the answers are compared field by field (:func:`differences`): choices, token ids,
text, logprobs (to 1e-4 nats: two engines may round apart), finish reasons, usage; a stream by what it delivers per
choice, its usage chunks and its one ``[DONE]``; a refusal by its status and error ``type``. What cannot be equal is
left out: ids, timestamps, and the error messages' wording. With ``conversation_id`` each shape is also a
conversation's first turn (the app keeps its KV for a next turn; the answer must not change).

The integration modules run the same comparison on their own app (tests/integration/cases.py); this command
writes the report: one JSON per app config and conversation setting, and a table (``summary.md``).
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.reference import ReferenceServer

MAX_TOKENS = 12
# A prompt of ~330 tokens: several KV blocks, so that the KV the app moves matters to every answer.
LEDGER = " ".join(f"Entry {i}: {['ash', 'birch', 'cedar', 'elm', 'fir'][i % 5]} logs, {i * 7 % 23} cords, "
                  f"sold to {['Ada', 'Bo', 'Cy', 'Di'][i % 4]}." for i in range(24)) + "\nThe buyer of entry 9 was"
_DROPPED = {"id", "created", "system_fingerprint", "prompt_tokens_details", "kv_transfer_params", "service_tier"}
_LOGPROB_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Shape:
    name: str
    path: str
    body: dict[str, Any]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def shapes(encode) -> list[Shape]:
    """Every shape the comparison sends; ``encode(text)``: the engine's token ids of a text (token-id prompts)."""
    short, long = "The capital of France is", LEDGER
    chat = [{"role": "user", "content": "Name three rivers of Europe."}]
    long_chat = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": LEDGER + "\nSum it up."}]
    greedy = {"temperature": 0, "max_tokens": MAX_TOKENS}
    completion = lambda name, **body: Shape(name, "/v1/completions", {"prompt": long, **greedy, **body})  # noqa: E731
    chatting = lambda name, **body: Shape(name, "/v1/chat/completions", {"messages": long_chat, **greedy, **body})  # noqa: E731
    schema = {"type": "object", "properties": {"river": {"type": "string"}}, "required": ["river"]}
    return [
        completion("completion", return_token_ids=True),
        completion("completion-short", prompt=short),
        completion("prompt-list", prompt=[long, short, "One plus one is"]),
        completion("prompt-list-token-ids", prompt=[encode(long), encode(short)]),
        completion("token-id-prompt", prompt=encode(long), return_token_ids=True),
        completion("echo", echo=True),
        completion("echo-logprobs", echo=True, logprobs=2),
        completion("logprobs", logprobs=3),
        completion("prompt-logprobs", prompt_logprobs=1),
        completion("n-seeded", n=2, temperature=0.9, seed=7),
        completion("best-of", best_of=2),
        completion("seeded-sampling", temperature=1.0, top_p=0.9, seed=42),
        completion("stop-string", stop=["."]),
        completion("stop-token-ids", stop_token_ids=[13]),
        completion("min-tokens", min_tokens=10, stop=["."]),
        completion("logit-bias", logit_bias={"13": 8.0}),
        completion("penalties", presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3),
        completion("structured-choice", prompt=short, structured_outputs={"choice": ["Paris", "Lyon", "Nice"]}),
        completion("structured-regex", prompt=short, structured_outputs={"regex": "[A-Z][a-z]+"}),
        completion("stream-usage", stream=True, stream_options={"include_usage": True}),
        completion("stream-continuous-usage", stream=True,
                   stream_options={"include_usage": True, "continuous_usage_stats": True}),
        completion("stream-prompt-list", prompt=[long, short], stream=True, stream_options={"include_usage": True}),
        Shape("chat-short", "/v1/chat/completions", {"messages": chat, **greedy}),
        chatting("chat", return_token_ids=True),
        chatting("chat-logprobs", logprobs=True, top_logprobs=2),
        chatting("chat-n-seeded", n=2, temperature=0.9, seed=7),
        chatting("chat-max-completion-tokens", max_tokens=None, max_completion_tokens=6),
        chatting("chat-json-schema", messages=chat,
                 response_format={"type": "json_schema", "json_schema": {"name": "river", "schema": schema}}),
        chatting("chat-json-object", messages=chat, response_format={"type": "json_object"}),
        chatting("chat-continue-final-message", messages=[*chat, {"role": "assistant", "content": "The Danube,"}],
                 add_generation_prompt=False, continue_final_message=True),
        chatting("chat-stream", stream=True, stream_options={"include_usage": True}),
        Shape("tokenize", "/tokenize", {"prompt": long}),
        Shape("tokenize-chat", "/tokenize", {"messages": chat, "add_generation_prompt": True}),
        Shape("detokenize", "/detokenize", {"tokens": encode(short)}),
        completion("error-negative-temperature", temperature=-1),
        completion("error-zero-max-tokens", max_tokens=0),
        completion("error-over-context", prompt=[1] * 4096),
        Shape("error-no-messages", "/v1/chat/completions", {"max_tokens": 4}),
        Shape("error-unknown-model", "/v1/completions", {"model": "no-such-model", "prompt": short, "max_tokens": 4}),
    ]


def answer_of(response) -> dict[str, Any]:
    """What of an HTTP answer is compared: a refusal's status and type, a stream's deliveries, a body's fields."""
    if response.status_code != 200:
        error = response.json().get("error", {})
        return {"status": response.status_code, "type": error.get("type"), "message": error.get("message")}
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return {"status": 200, "body": _without(response.json())}
    choices: dict[int, dict[str, Any]] = {}
    usage, events, with_usage, last_has_usage, done, errors = None, 0, 0, False, 0, []
    for line in response.text.splitlines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done += 1
            continue
        event = json.loads(data)
        if "error" in event:
            errors.append(event["error"].get("type"))
            continue
        events += 1
        last_has_usage = bool(event.get("usage"))
        if last_has_usage:
            usage, with_usage = _without(event["usage"]), with_usage + 1
        for choice in event.get("choices") or ():
            seen = choices.setdefault(choice["index"], {"text": "", "finish_reason": None})
            seen["text"] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            seen["finish_reason"] = choice.get("finish_reason") or seen["finish_reason"]
    return {"status": 200, "stream": {"choices": {str(k): v for k, v in sorted(choices.items())}, "usage": usage,
                                      "usage_in": _usage_in(events, with_usage, last_has_usage), "done": done,
                                      "errors": errors}}


def _usage_in(events: int, with_usage: int, last_has_usage: bool) -> str:
    """Which chunks carry usage. Not how many: both servers merge tokens that pile up between two reads of the
    engine's output into one chunk, so the count of chunks depends on the box's speed (CI saw 10 here, 13 in vLLM)."""
    if with_usage == 0:
        return "none"
    if with_usage == events:
        return "every chunk"
    return "last chunk" if with_usage == 1 and last_has_usage else f"{with_usage} of {events} chunks"


def _without(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without(v) for k, v in value.items() if k not in _DROPPED}
    if isinstance(value, list):
        return [_without(v) for v in value]
    return value


def differences(ours: Any, theirs: Any, where: str = "") -> list[str]:
    """Where two answers differ (empty: equal); error messages are reported, not compared."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for key in sorted(set(ours) | set(theirs)):
            if key == "message" and "status" in ours:
                continue
            out += differences(ours.get(key), theirs.get(key), f"{where}.{key}")
        return out
    if isinstance(ours, list) and isinstance(theirs, list):
        if len(ours) != len(theirs):
            return [f"{where}: {len(ours)} items, vLLM {len(theirs)}"]
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in differences(a, b, f"{where}[{i}]")]
    if isinstance(ours, float) and isinstance(theirs, float):
        both_inf = math.isinf(ours) and ours == theirs
        return [] if both_inf or abs(ours - theirs) <= _LOGPROB_TOLERANCE else [f"{where}: {ours!r}, vLLM {theirs!r}"]
    return [] if ours == theirs else [f"{where}: {_short(ours)}, vLLM {_short(theirs)}"]


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."


def compare(app_http, reference: ReferenceServer, shape: Shape, conversation: bool = False) -> dict[str, Any]:
    """One shape, sent to the app (``app_http``: an httpx client on its base URL) then to vLLM's server."""
    body = {"model": reference.model, **shape.body}
    headers = {"X-Conversation-Id": f"parity-{uuid.uuid4().hex[:12]}"} if conversation else {}
    ours = answer_of(app_http.post(shape.path, json=body, headers=headers))
    cache = reference.parity_answers
    if shape.name not in cache:
        cache[shape.name] = answer_of(reference.http.post(shape.path, json=body))
    theirs = cache[shape.name]
    return {"shape": shape.name, "path": shape.path, "conversation": conversation,
            "identical": not (found := differences(ours, theirs)), "differences": found, "ours": ours, "vllm": theirs}


def run_parity(configs: list[str], out_dir: Path, reference_config: str | None = None) -> list[dict[str, Any]]:
    """Each of ``configs``' apps, with and without a conversation, against one ``vllm serve``."""
    import httpx

    from app.tools.procs import BASE_URL
    from bench.sweep import log, running_app

    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    reference = ReferenceServer(reference_config or configs[0], out_dir / "reference")
    rows = []
    try:
        for config in configs:
            with running_app(config, BASE_URL, out_dir / "logs") as app, httpx.Client(base_url=BASE_URL, timeout=300) as http:
                for conversation in (False, True):
                    results = [compare(http, reference, shape, conversation) for shape in shapes(reference.encode)]
                    name = f"{Path(config).stem}{'-conversation' if conversation else ''}"
                    (out_dir / f"{name}.json").write_text(json.dumps(results, separators=(",", ":")))
                    same = sum(r["identical"] for r in results)
                    log(f"{name}: {same} of {len(results)} shapes identical to vllm serve (app log {app.log_path})")
                    rows.append({"run": name, "identical": same, "shapes": len(results),
                                 "different": [r["shape"] for r in results if not r["identical"]]})
    finally:
        reference.close()
    table = ["| app config | conversation | identical to `vllm serve` | different |", "|---|---|---|---|"]
    table += [f"| {r['run'].removesuffix('-conversation')} | {'yes' if r['run'].endswith('-conversation') else 'no'} | "
              f"{r['identical']} of {r['shapes']} | {', '.join(r['different']) or '-'} |" for r in rows]
    (out_dir / "summary.md").write_text("\n".join(table) + "\n")
    return rows
