"""``python -m bench multiturn``: conversations whose history grows turn by turn; per-turn TTFT.

Each conversation starts with a user message of ``turn_tokens`` random tokens; every
later turn resends the whole history (earlier user messages and the model's answers)
plus a new user message of the same size, so turn 4 carries about 4 x ``turn_tokens``
+ 3 x ``output_len`` tokens. Conversations run one at a time, turns in order, streamed,
so TTFT is the cost of the turn itself, not of queueing.

Two arms: ``no-reuse`` (plain requests) and ``reuse`` (the same requests with a
``conversation_id`` body field, for the conversation feature: a follow-up turn goes back
to the decode replica that holds the conversation's KV). When this build has no such
feature only the no-reuse baseline runs, and the report says so.
"""

from __future__ import annotations

import csv
import json
import random
import statistics
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from app.config.args import AppArgs

NOT_AVAILABLE = "conversation reuse is not available in this build; reporting the no-reuse baseline only"
ARMS = ("no-reuse", "reuse")


def conversation_reuse_available(args_model: type = AppArgs) -> bool:
    """Whether this build's app has the conversation feature: its args grow a
    ``conversation...`` section when it does (nothing else in the app reads a
    ``conversation_id`` today, so sending one would measure nothing)."""
    return any(name.startswith("conversation") for name in args_model.model_fields)


@dataclass(frozen=True)
class TurnResult:
    arm: str
    conversation: int
    turn: int  # 1-based
    prompt_tokens: int | None
    ttft_ms: float | None
    e2e_ms: float | None
    ok: bool
    error: str = ""


def user_text(tokenizer, n_tokens: int, rng: random.Random) -> str:
    """About ``n_tokens`` tokens of random vocabulary (as vLLM's random dataset makes prompts)."""
    vocab = tokenizer.vocab_size
    ids = [rng.randrange(100, max(vocab - 100, 101)) for _ in range(n_tokens)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def stream_chat(http: httpx.Client, body: dict[str, Any]) -> tuple[float | None, float, str, int | None]:
    """POST a streamed chat completion; return (ttft_s, e2e_s, text, prompt_tokens)."""
    start = time.perf_counter()
    ttft, text, prompt_tokens = None, [], None
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content") or ""
                if ttft is None and content:  # the first chunk may carry only the role
                    ttft = time.perf_counter() - start
                text.append(content)
            if event.get("usage"):
                prompt_tokens = event["usage"].get("prompt_tokens")
    return ttft, time.perf_counter() - start, "".join(text), prompt_tokens


def run_arm(
    http: httpx.Client, tokenizer, model: str, arm: str, *, conversations: int, turns: int, turn_tokens: int,
    output_len: int, seed: int = 0,
) -> list[TurnResult]:
    results = []
    for c in range(conversations):
        rng = random.Random(seed * 1000 + c)  # the same conversations in both arms
        conversation_id = f"bench-{uuid.uuid4().hex[:12]}"
        history: list[dict[str, str]] = []
        for turn in range(1, turns + 1):
            history.append({"role": "user", "content": user_text(tokenizer, turn_tokens, rng)})
            body: dict[str, Any] = {
                "model": model,
                "messages": history,
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if arm == "reuse":
                body["conversation_id"] = conversation_id
            try:
                ttft, e2e, answer, prompt_tokens = stream_chat(http, body)
            except (httpx.HTTPError, RuntimeError) as e:
                results.append(TurnResult(arm, c, turn, None, None, None, ok=False, error=str(e)[:300]))
                break  # the rest of this conversation has no history to build on
            history.append({"role": "assistant", "content": answer})
            results.append(
                TurnResult(arm, c, turn, prompt_tokens, None if ttft is None else ttft * 1e3, e2e * 1e3, ok=ttft is not None)
            )
    return results


def summarize(results: Iterable[TurnResult]) -> list[dict[str, Any]]:
    """One row per (arm, turn): how many succeeded, mean prompt tokens, TTFT p50 and mean."""
    results = list(results)
    rows = []
    for arm in ARMS:
        for turn in sorted({r.turn for r in results if r.arm == arm}):
            group = [r for r in results if r.arm == arm and r.turn == turn]
            ok = [r for r in group if r.ok and r.ttft_ms is not None]
            tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
            rows.append(
                {
                    "arm": arm,
                    "turn": turn,
                    "completed": len(ok),
                    "failed": len(group) - len(ok),
                    "prompt_tokens_mean": statistics.fmean(tokens) if tokens else None,
                    "ttft_p50_ms": statistics.median(r.ttft_ms for r in ok) if ok else None,
                    "ttft_mean_ms": statistics.fmean(r.ttft_ms for r in ok) if ok else None,
                }
            )
    return rows


def speedups(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Per turn: no-reuse TTFT p50 / reuse TTFT p50 (only where both arms ran)."""
    by = {(r["arm"], r["turn"]): r["ttft_p50_ms"] for r in rows}
    return {
        turn: by[("no-reuse", turn)] / by[("reuse", turn)]
        for arm, turn in by
        if arm == "reuse" and by.get(("reuse", turn)) and by.get(("no-reuse", turn))
    }


def write_report(out_dir: Path, results: list[TurnResult], rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {**meta, "per_turn": rows, "speedup_no_reuse_over_reuse": speedups(rows), "turns": [asdict(r) for r in results]}
    json_path, csv_path, png_path = out_dir / "multiturn.json", out_dir / "multiturn.csv", out_dir / "multiturn_ttft.png"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    columns = ["arm", "turn", "completed", "failed", "prompt_tokens_mean", "ttft_p50_ms", "ttft_mean_ms"]
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows({c: "" if r[c] is None else r[c] for c in columns} for r in rows)
    _plot(rows, png_path)
    return [json_path, csv_path, png_path]


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for arm, color in zip(ARMS, ("tab:orange", "tab:blue")):
        xy = [(r["turn"], r["ttft_p50_ms"]) for r in rows if r["arm"] == arm and r["ttft_p50_ms"] is not None]
        if xy:
            ax.plot(*zip(*xy), "-o", color=color, label=arm)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("Multi-turn TTFT by turn (history grows each turn)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_multiturn(
    config_path: str,
    out_dir: Path,
    *,
    base_url: str | None = None,
    tokenizer_path: str | None = None,
    conversations: int = 3,
    turns: int = 4,
    turn_tokens: int = 500,
    output_len: int = 32,
) -> list[dict[str, Any]]:
    """Start ``config_path`` (or use the app at ``base_url``), run the arms, write the report."""
    import contextlib

    from transformers import AutoTokenizer

    from app.model_source import resolve_model_source
    from bench.profiles import app_args_of, load_config
    from app.tools.procs import base_url_of
    from bench.sweep import log, running_app

    config = load_config(config_path)
    args = app_args_of(config)
    available = conversation_reuse_available()
    arms = list(ARMS) if available else ["no-reuse"]
    if not available:
        log(NOT_AVAILABLE)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or resolve_model_source(args.model.source))
    url = base_url or base_url_of(config)
    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    app_context = contextlib.nullcontext() if base_url else running_app(config_path, url, out_dir / "logs")
    results: list[TurnResult] = []
    with app_context, httpx.Client(base_url=url, timeout=600) as http:
        # One untimed turn: first requests pay one-time costs (NIXL handshakes).
        run_arm(http, tokenizer, args.model.id, "no-reuse", conversations=1, turns=1, turn_tokens=turn_tokens,
                output_len=output_len, seed=999)
        for arm in arms:
            log(f"multiturn {arm}: {conversations} conversations x {turns} turns, +{turn_tokens} tokens per turn")
            results += run_arm(http, tokenizer, args.model.id, arm, conversations=conversations, turns=turns,
                               turn_tokens=turn_tokens, output_len=output_len)
    rows = summarize(results)
    meta = {
        "config": config_path,
        "conversation_reuse_available": available,
        "note": None if available else NOT_AVAILABLE,
        "settings": {"conversations": conversations, "turns": turns, "turn_tokens": turn_tokens, "output_len": output_len},
    }
    for path in write_report(out_dir, results, rows, meta):
        log(f"wrote {path}")
    print(format_table(rows))
    if not available:
        print(NOT_AVAILABLE)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'arm':<9} {'turn':>4} {'ok':>3} {'prompt tok':>10} {'TTFT p50 ms':>12} {'TTFT mean ms':>12}"]
    for r in rows:
        def num(v):
            return "-" if v is None else f"{v:.0f}"
        lines.append(
            f"{r['arm']:<9} {r['turn']:>4} {r['completed']:>3} {num(r['prompt_tokens_mean']):>10} "
            f"{num(r['ttft_p50_ms']):>12} {num(r['ttft_mean_ms']):>12}"
        )
    for turn, ratio in speedups(rows).items():
        lines.append(f"turn {turn}: no-reuse / reuse TTFT p50 = {ratio:.2f}x")
    return "\n".join(lines)
