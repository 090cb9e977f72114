"""``python -m bench skew``: load-aware vs round-robin decode placement under a skewed load.

Every other request is a long generation, the rest are short; arrivals are Poisson. Round
robin over two decode replicas then sends every long generation to the same replica,
while the load-aware router (``app/routing/decode_router.py``) sees where the work is. For each
placement the command starts the app (1 prefill : 2 decode by default) with
``routing.decode_router`` set, sends the same requests (same seed), stops the app, and
reports TTFT and TPOT percentiles of the short and the long requests and how many
requests each decode replica handled. Streamed completions with ``ignore_eos``: every
request produces exactly its ``max_tokens``; TPOT = (last token - first token) / (n - 1).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from bench.engine_metrics import scrape
from bench.sweep import log, running_app

PLACEMENTS = ("load_aware", "round_robin")
_WORDS = "river fox stone cloud lantern meadow copper violin harbor maple".split()


@dataclass(frozen=True)
class SkewLoad:
    requests: int = 48
    rate: float = 0.6  # requests/s, Poisson
    prompt_words: int = 200
    short_tokens: int = 16
    long_tokens: int = 384
    seed: int = 0


@dataclass
class Placement:
    name: str
    ttft_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> p50/p90/p99
    tpot_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: int = 0
    per_replica: dict[str, float] = field(default_factory=dict)  # decode replica -> requests handled
    wall_s: float = 0.0


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]  # noqa: E731
    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99)}


def _requests(load: SkewLoad, model: str) -> list[tuple[float, str, dict]]:
    """(send at s, kind, body) for every request: long and short alternate."""
    rng = random.Random(load.seed)
    at, out = 0.0, []
    for i in range(load.requests):
        kind = "long" if i % 2 == 0 else "short"
        words = " ".join(rng.choice(_WORDS) for _ in range(load.prompt_words))
        body = {
            "model": model, "prompt": f"Request {i}. {words}\nContinue the story:", "temperature": 0, "stream": True,
            "ignore_eos": True, "max_tokens": load.long_tokens if kind == "long" else load.short_tokens,
        }
        out.append((at, kind, body))
        at += rng.expovariate(load.rate)
    return out


async def _one(http: httpx.AsyncClient, at: float, start: float, body: dict) -> tuple[float, float] | None:
    """(TTFT s, TPOT s) of one streamed request sent at ``start + at``; None if it failed."""
    await asyncio.sleep(max(0.0, start + at - time.monotonic()))
    sent, first, last, tokens = time.monotonic(), None, None, 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    return None
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    last = time.monotonic()
                    first = first or last
                    tokens += 1
    except httpx.HTTPError:
        return None
    if first is None:
        return None
    return first - sent, (last - first) / max(1, tokens - 1)


async def _send(url: str, load: SkewLoad, model: str) -> tuple[dict[str, list[float]], dict[str, list[float]], int]:
    plan = _requests(load, model)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        start = time.monotonic() + 0.5
        results = await asyncio.gather(*(_one(http, at, start, body) for at, _, body in plan))
    ttft, tpot, errors = {"short": [], "long": []}, {"short": [], "long": []}, 0
    for (_, kind, _), result in zip(plan, results):
        if result is None:
            errors += 1
            continue
        ttft[kind].append(result[0] * 1000)
        tpot[kind].append(result[1] * 1000)
    return ttft, tpot, errors


def _decode_handled(metrics_url: str) -> Counter:
    counts = Counter()
    for name, labels, value in scrape(metrics_url):
        if name == "ray_serve_deployment_request_counter_total" and labels.get("deployment", "").startswith("Decode"):
            counts[labels["replica"]] += value
    return counts


def _config_with(config_path: str, placement: str, out_dir: Path) -> str:
    raw = yaml.safe_load(Path(config_path).read_text())
    raw["applications"][0]["args"].setdefault("routing", {})["decode_router"] = placement
    derived = out_dir / f"{Path(config_path).stem}-{placement}.yaml"
    derived.write_text(yaml.safe_dump(raw))
    return str(derived)


def run_skew(config_path: str, out_dir: Path, load: SkewLoad, placements=PLACEMENTS) -> list[Placement]:
    from bench.profiles import app_args_of, load_config
    from app.tools.procs import base_url_of

    config = load_config(config_path)
    model, url = app_args_of(config).model.id, base_url_of(config)
    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    report = []
    for name in placements:
        with running_app(_config_with(config_path, name, out_dir), url, out_dir / "logs") as app:
            asyncio.run(_send(url, SkewLoad(requests=4, rate=float("inf"), short_tokens=4, long_tokens=4), model))  # warm-up
            time.sleep(10)  # Ray's metrics export: the warm-up's counts are in before we read them
            before = _decode_handled(app.metrics_url())
            t0 = time.monotonic()
            log(f"{name}: {load.requests} requests at {load.rate:g}/s, long and short alternating")
            ttft, tpot, errors = asyncio.run(_send(url, load, model))
            placement = Placement(name, errors=errors, wall_s=round(time.monotonic() - t0, 1))
            placement.ttft_ms = {kind: percentiles(v) for kind, v in ttft.items()}
            placement.tpot_ms = {kind: percentiles(v) for kind, v in tpot.items()}
            time.sleep(12)
            placement.per_replica = dict(_decode_handled(app.metrics_url()) - before)
        report.append(placement)
        log(f"{name}: {_summary(placement)}")
    (out_dir / "skew.json").write_text(json.dumps({"load": asdict(load), "placements": [asdict(p) for p in report]}, indent=2))
    print(table(report))
    return report


def _summary(p: Placement) -> str:
    return (
        f"TTFT p99 short {p.ttft_ms['short'].get('p99', float('nan')):.0f} ms, long {p.ttft_ms['long'].get('p99', float('nan')):.0f} ms; "
        f"TPOT p99 short {p.tpot_ms['short'].get('p99', float('nan')):.1f} ms, long {p.tpot_ms['long'].get('p99', float('nan')):.1f} ms; "
        f"errors {p.errors}; per decode replica {sorted(p.per_replica.values())}"
    )


def table(report: list[Placement]) -> str:
    """A Markdown table of the report (what docs/benchmarks.md shows)."""
    rows = ["| placement | kind | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) |", "|---|---|---|---|"]
    for p in report:
        for kind in ("short", "long"):
            t, o = p.ttft_ms.get(kind, {}), p.tpot_ms.get(kind, {})
            rows.append(
                f"| {p.name} | {kind} | {' / '.join(f'{t.get(q, 0):.0f}' for q in ('p50', 'p90', 'p99'))} "
                f"| {' / '.join(f'{o.get(q, 0):.1f}' for q in ('p50', 'p90', 'p99'))} |"
            )
    return "\n".join(rows)
