"""``python -m bench overload``: does admission keep its promise past what the box sustains?

Three arms, each its own app start: ``fixed`` (``ingress.ttft_slo_s: null``: the ``max_in_flight`` count
alone, as before app/routing/admission.py), ``adaptive`` (admission by expected time to first byte against
``--slo-s``, and a stream queue deadline) and ``whole`` (``adaptive``'s app, but the requests are not
streamed and their client gives up at the SLO: admission must judge the time to the *last* token). First
the sustainable rate is measured (a closed loop on the fixed arm: completed requests per second with
``--calibration-concurrency`` always in flight), then each arm gets Poisson arrivals at 1x, 2x and 4x of
it for ``--seconds`` each: chat completions (~200-token prompts, 64 output tokens) from a client that
gives up after ``--client-timeout-s`` (the user of the issue: 30 s; the SLO in ``whole``), as such a
client would.

``--burst N`` instead sends N non-streamed requests at once to the config as it is (its own SLO), from
a client that gives up after ``--client-timeout-s``, and reports how many were answered in time, refused
(429, and how quickly) and given up on.

Per arm and load: goodput (answers complete, first byte within the SLO, not given up on, per second
of offered load; for ``whole``, answers complete within the SLO), answered in time (the same, counted), admitted TTFT p50 / p99 (the first chunk, client side), rejections (429) and their
latency p99, 503s at the queue deadline, and how many requests the client gave up on and the seconds
it waited on them (engine time, until its hang-up aborts them, spent on answers nobody read).
Output: ``overload.json`` (every request), ``overload.csv`` (the table), ``overload.png``.
"""

from __future__ import annotations

import asyncio
import csv
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from bench.openloop import StallClock, poisson_arrivals
from bench.sweep import log, running_app

ARMS = ("fixed", "adaptive", "whole")
FACTORS = (1.0, 2.0, 4.0)
_WORDS = "river fox stone cloud lantern meadow copper violin harbor maple".split()


@dataclass(frozen=True)
class OverloadLoad:
    slo_s: float = 10.0
    queue_deadline_s: float = 20.0
    client_timeout_s: float = 30.0
    seconds: float = 60.0
    prompt_words: int = 180  # ~200 tokens
    output_len: int = 64
    calibration_s: float = 40.0
    calibration_concurrency: int = 8
    seed: int = 0


@dataclass(frozen=True)
class Outcome:
    arm: str
    factor: float
    index: int
    sent_at: float  # seconds from the load's start
    status: int  # 0: no HTTP answer (given up on, or an error)
    ttft_s: float | None  # first data chunk (client side)
    latency_s: float  # sent -> complete, or -> given up
    abandoned: bool  # the client gave up (its timeout) before the answer was complete
    retry_after: str | None
    client_stall_s: float = 0.0  # the longest stall of this client's loop while the request was out (bench.openloop)


def _body(model: str, load: OverloadLoad, rng: random.Random, index: int, stream: bool = True) -> dict:
    text = " ".join(rng.choice(_WORDS) for _ in range(load.prompt_words))
    return {"model": model, "messages": [{"role": "user", "content": f"Request {index}. {text}"}],
            "max_tokens": load.output_len, "temperature": 0, "ignore_eos": True, "stream": stream}


def _patience_s(load: OverloadLoad, arm: str) -> float:
    """How long the arm's client waits: the SLO for whole answers, else the client timeout."""
    return load.slo_s if arm == "whole" else load.client_timeout_s


async def _one(session, body: dict, patience_s: float, arm: str, factor: float, index: int, t0: float,
               stalls: StallClock) -> Outcome:
    sent = time.monotonic()
    status, first, retry_after = 0, None, None
    try:
        async with asyncio.timeout(patience_s):
            async with session.post("/v1/chat/completions", json=body) as r:
                status, retry_after = r.status, r.headers.get("retry-after")
                async for line in r.content:
                    if first is None and (line.startswith(b"data: {") or not body["stream"]):
                        first = time.monotonic() - sent  # a whole answer's first byte is all of it
        abandoned = False
    except TimeoutError:
        abandoned = True  # leaving the block closes the connection: the server sees a hang-up
    except Exception:  # noqa: BLE001 - a failed request, counted as status 0
        abandoned = False
    return Outcome(arm, factor, index, sent - t0, status, first, time.monotonic() - sent, abandoned, retry_after,
                   stalls.worst_since(sent))


async def offer(url: str, model: str, load: OverloadLoad, arm: str, factor: float, rate: float) -> list[Outcome]:
    import aiohttp

    rng = random.Random(load.seed + int(factor * 100))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        def launch(index: int, stalls: StallClock, t0: float):
            body = _body(model, load, rng, index, stream=arm != "whole")
            return _one(session, body, _patience_s(load, arm), arm, factor, index, t0, stalls)

        return await poisson_arrivals(rate, load.seconds, rng, launch)


async def sustained_rate(url: str, model: str, load: OverloadLoad) -> float:
    """Completed requests per second with ``calibration_concurrency`` always in flight."""
    import aiohttp

    rng, done = random.Random(load.seed), 0
    async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.monotonic()

        async def worker(w: int) -> None:
            nonlocal done
            i = 0
            while time.monotonic() - t0 < load.calibration_s:
                async with session.post("/v1/chat/completions", json=_body(model, load, rng, w * 10_000 + i)) as r:
                    await r.read()
                    done += r.status == 200
                i += 1

        await asyncio.gather(*(worker(w) for w in range(load.calibration_concurrency)))
        return done / (time.monotonic() - t0)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(outcomes: list[Outcome], load: OverloadLoad) -> dict:
    ok = [o for o in outcomes if o.status == 200 and not o.abandoned]
    good = [o for o in ok if o.ttft_s is not None and o.ttft_s <= load.slo_s]  # a whole answer: all of it
    admitted_ttft = [o.ttft_s for o in outcomes if o.status == 200 and o.ttft_s is not None]
    # A 429's time less the longest stall of this client's own loop meanwhile: the server's part.
    rejected = [max(0.0, o.latency_s - o.client_stall_s) for o in outcomes if o.status == 429]
    return {
        "offered": len(outcomes),
        "answered": len(ok),
        "answered_in_time": len(good),
        "goodput_rps": len(good) / load.seconds,
        "ttft_p50_s": _pct(admitted_ttft, 0.5),
        "ttft_p99_s": _pct(admitted_ttft, 0.99),
        "rejected_429": len(rejected),
        "rejection_p99_s": _pct(rejected, 0.99),
        "expired_503": sum(o.status == 503 for o in outcomes),
        "abandoned": sum(o.abandoned for o in outcomes),
        "abandoned_in_flight_s": sum(o.latency_s for o in outcomes if o.abandoned),
        # Status 0 of a request the client gave up on is the client's doing, not an error.
        "other_status": sorted({o.status for o in outcomes if not o.abandoned} - {200, 429, 503}),
        "client_stall_max_s": max((o.client_stall_s for o in outcomes), default=0.0),
    }


def _arm_config(config_path: str, arm: str, load: OverloadLoad, out_dir: Path) -> str:
    raw = yaml.safe_load(Path(config_path).read_text())
    ingress = raw["applications"][0]["args"].setdefault("ingress", {})
    if arm == "fixed":
        ingress.update(ttft_slo_s=None, queue_deadline_s=None)
    elif arm != "as-is":
        ingress.update(ttft_slo_s=load.slo_s, queue_deadline_s=load.queue_deadline_s)
    derived = out_dir / f"{Path(config_path).stem}-{arm}.yaml"
    derived.write_text(yaml.safe_dump(raw))
    return str(derived)


def run_overload(config_path: str, out_dir: Path, load: OverloadLoad, arms=ARMS, factors=FACTORS) -> list[dict]:
    from app.tools.procs import base_url_of
    from bench.profiles import app_args_of, load_config

    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    config = load_config(config_path)
    model, url = app_args_of(config).model.id, base_url_of(config)
    rows, everything, rate = [], [], None
    for arm in arms:
        with running_app(_arm_config(config_path, arm, load, out_dir), url, out_dir / "logs"):
            if rate is None:
                rate = asyncio.run(sustained_rate(url, model, load))
                log(f"sustained: {rate:.3f} req/s ({load.calibration_concurrency} in flight, {load.calibration_s:g} s)")
            for factor in factors:
                outcomes = asyncio.run(offer(url, model, load, arm, factor, factor * rate))
                row = {"arm": arm, "factor": factor, "rate_rps": round(factor * rate, 4), **summarize(outcomes, load)}
                log(f"{arm} {factor:g}x: {json.dumps(row)}")
                rows.append(row)
                everything += [asdict(o) for o in outcomes]
                time.sleep(5)  # what the client gave up on is aborted before the next load
    (out_dir / "overload.json").write_text(json.dumps({"load": asdict(load), "sustained_rps": rate, "rows": rows,
                                                       "requests": everything}, indent=1))
    with open(out_dir / "overload.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out_dir / "overload.png", load)
    print(table(rows))
    return rows


async def burst(url: str, model: str, load: OverloadLoad, count: int) -> list[Outcome]:
    """``count`` whole (non-streamed) requests at once; each client gives up after ``client_timeout_s``."""
    import aiohttp

    rng, stalls = random.Random(load.seed), StallClock()
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        stalling = asyncio.ensure_future(stalls.run())
        t0 = time.monotonic()
        try:
            return list(await asyncio.gather(*(
                _one(session, _body(model, load, rng, i, stream=False), load.client_timeout_s, "burst", 0.0, i, t0, stalls)
                for i in range(count))))
        finally:
            stalling.cancel()


def run_burst(config_path: str, out_dir: Path, load: OverloadLoad, count: int) -> dict:
    """The config as it is (its own SLO and queue deadline), ``count`` whole requests at once."""
    from app.tools.procs import base_url_of
    from bench.profiles import app_args_of, load_config

    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    config = load_config(config_path)
    args, url = app_args_of(config), base_url_of(config)
    with running_app(_arm_config(config_path, "as-is", load, out_dir), url, out_dir / "logs"):
        for warm_up in (4, 8):  # the app has seen answers at a few loads, as a live one has: admission has a model
            asyncio.run(burst(url, args.model.id, load, warm_up))
        outcomes = asyncio.run(burst(url, args.model.id, load, count))
    slo = args.ingress.ttft_slo_s or load.client_timeout_s
    ok = [o for o in outcomes if o.status == 200 and not o.abandoned]
    rejected = [max(0.0, o.latency_s - o.client_stall_s) for o in outcomes if o.status == 429]
    row = {
        "offered": count, "client_timeout_s": load.client_timeout_s, "slo_s": slo,
        "admitted": sum(o.status not in (429,) for o in outcomes),
        "answered_in_time": len(ok), "answered_p99_s": _pct([o.latency_s for o in ok], 0.99),
        "rejected_429": len(rejected), "rejection_p99_s": _pct(rejected, 0.99),
        "expired_503": sum(o.status == 503 for o in outcomes), "given_up": sum(o.abandoned for o in outcomes),
        "goodput_rps": len(ok) / max((o.latency_s for o in outcomes), default=1.0),
    }
    (out_dir / "burst.json").write_text(json.dumps({"load": asdict(load), "row": row,
                                                    "requests": [asdict(o) for o in outcomes]}, indent=1))
    log(f"burst: {json.dumps(row)}")
    return row


def table(rows: list[dict]) -> str:
    def f(v, fmt="{:.2f}"):
        return "–" if v is None else fmt.format(v)

    lines = ["| arm | load | offered | answered (in time) | goodput req/s | TTFB p50 / p99 s | 429s (p99 s) | 503s | given up (s waited) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['factor']:g}x ({r['rate_rps']:.2f} req/s) | {r['offered']} | {r['answered']} "
                     f"({r.get('answered_in_time', '–')}) | "
                     f"{r['goodput_rps']:.3f} | {f(r['ttft_p50_s'])} / {f(r['ttft_p99_s'])} | {r['rejected_429']} "
                     f"({f(r['rejection_p99_s'])}) | {r['expired_503']} | {r['abandoned']} ({r['abandoned_in_flight_s']:.0f}) |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, load: OverloadLoad) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (good, ttft) = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm in sorted({r["arm"] for r in rows}):
        mine = [r for r in rows if r["arm"] == arm]
        good.plot([r["factor"] for r in mine], [r["goodput_rps"] for r in mine], marker="o", label=arm)
        ttft.plot([r["factor"] for r in mine], [r["ttft_p99_s"] or 0 for r in mine], marker="o", label=arm)
    ttft.axhline(load.slo_s, color="gray", linestyle="--", label="SLO")
    good.set(xlabel="offered load (x sustainable)", ylabel="goodput (req/s within SLO)", title="goodput")
    ttft.set(xlabel="offered load (x sustainable)", ylabel="admitted TTFT p99 (s)", title="admitted TTFT p99")
    for ax in (good, ttft):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
