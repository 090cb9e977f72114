"""``python -m bench timeline``: where each request's time to first token goes, per mode.

For each mode (push, pull, push-progressive; one prefill chunk size for all) the command starts the app with short prompts served by decode
alone (``routing.local_prefill_below_tokens``), then repeats a cycle: a long prompt
(disaggregated), a short one while the long one is being prefilled (decode is waiting for
its KV then: in push, asleep), and a short one alone. Each request's timeline comes from
the app's log (one ``rendezvous_timeline`` line per request, app/request/timeline.py), matched to
the client's request by the response id. Output: ``timeline.json`` (every request's
stamps and stages), ``timeline.csv`` (median stage durations per mode and kind),
``waterfall.png`` (one bar per request, one colour per stage; progressive push's chunk WRITEs drawn
over its prefill as ``streamed``) and a Markdown table.
"""

from __future__ import annotations

import csv
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import yaml

from app.request.timeline import STAGES, RequestTimeline
from bench.profiles import merge_args
from bench.sweep import log, running_app

MODES = {"push": "configs/local-cpu.yaml", "pull": "configs/local-cpu-pull.yaml", "push-progressive": "configs/local-cpu.yaml"}
# App args a mode sets over its config's; every mode runs with the same prefill chunk (progressive push WRITEs one a chunk).
CHUNK_TOKENS = 512
_MODE_ARGS = {"push-progressive": {"handoff": {"progressive": True}}}
KINDS = ("long", "short_during", "short_alone")
_WORDS = "river fox stone cloud lantern meadow copper violin harbor maple".split()
# Bars of the waterfall, in the order a request passes them.
# A handoff is drawn as its two parts (transfer, first_step) when the decode engine stamped them,
# and push's transfer as its two (write_wait, write) when the WRITE's start came through.
_SEGMENTS = ["route", "bind", "prefill_hop", "prefill_queue", "prefill_compute", "write_wait", "write", "transfer",
             "schedule", "forward", "output", "first_step", "handoff", "local_prefill", "deliver"]
_COLORS = dict(zip(_SEGMENTS, ["tab:gray", "tab:olive", "tab:cyan", "tab:orange", "tab:blue", "gold", "tab:red",
                               "tab:red", "lightpink", "hotpink", "mediumvioletred", "tab:pink", "tab:brown",
                               "tab:purple", "tab:green"]))
# A stage is drawn as its parts when all of them were stamped; decode's first step as schedule, forward, output.
_DRAWN_AS_PARTS = {"handoff": ("transfer",), "transfer": ("write_wait", "write"),
                   "first_step": ("schedule", "forward", "output")}
# Drawn over the bars, not after them: it overlaps prefill_compute.
_OVERLAY, _OVERLAY_COLOR = "streamed", "black"


@dataclass(frozen=True)
class TimelineLoad:
    cycles: int = 4
    period_s: float = 12.0  # one cycle: long at 0, short_during at during_s, short_alone at alone_s
    during_s: float = 1.5
    alone_s: float = 9.0
    long_words: int = 1800  # ~2k tokens
    short_words: int = 40
    output_len: int = 8
    seed: int = 0


@dataclass
class Sample:
    mode: str
    kind: str
    client_ttft_s: float | None
    timeline: RequestTimeline | None


def _schedule(load: TimelineLoad, model: str) -> list[tuple[float, str, dict]]:
    rng, plan = random.Random(load.seed), []
    for cycle in range(load.cycles):
        start = cycle * load.period_s
        for kind, offset, words in (("long", 0.0, load.long_words), ("short_during", load.during_s, load.short_words),
                                    ("short_alone", load.alone_s, load.short_words)):
            text = " ".join(rng.choice(_WORDS) for _ in range(words))
            body = {"model": model, "prompt": f"{kind} {cycle}. {text}\nContinue:", "max_tokens": load.output_len,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            plan.append((start + offset, kind, body))
    return plan


def _send(url: str, plan: list[tuple[float, str, dict]]) -> list[tuple[str, str | None, float | None]]:
    """(kind, response id, client TTFT s) per request; requests overlap, so threads."""
    import concurrent.futures as cf

    def one(at: float, start: float, body: dict):
        time.sleep(max(0.0, start + at - time.monotonic()))
        sent, first, rid = time.monotonic(), None, None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    rid = rid or chunk.get("id")
                    first = first or time.monotonic()
        return rid, (first - sent) if first else None

    start = time.monotonic() + 0.5
    with cf.ThreadPoolExecutor(len(plan)) as pool:
        futures = [pool.submit(one, at, start, body) for at, _, body in plan]
        return [(kind, *f.result()) for (_, kind, _), f in zip(plan, futures)]


def _engine_id(response_id: str | None) -> str | None:
    """``cmpl-rdv-…`` -> ``rdv-…``: vLLM prefixes our request id per endpoint."""
    return response_id.split("-", 1)[1] if response_id and "-" in response_id else None


def read_timelines(log_path: Path) -> dict[str, RequestTimeline]:
    out = {}
    for line in log_path.read_text(errors="replace").splitlines():
        timeline = RequestTimeline.from_log_line(line)
        if timeline is not None:
            out[timeline.request_id] = timeline
    return out


def _config_for(mode: str, config_path: str, load: TimelineLoad, out_dir: Path) -> str:
    """``config_path`` with short prompts prefilled by decode, the bench's chunk size, and the mode's own args."""
    raw = yaml.safe_load(Path(config_path).read_text())
    args = raw["applications"][0]["args"]
    merge_args(args, {"routing": {"local_prefill_below_tokens": load.short_words * 3},
                  "engine_kwargs": {"max_num_batched_tokens": CHUNK_TOKENS}, **_MODE_ARGS.get(mode, {})})
    derived = out_dir / f"{mode}-timeline.yaml"
    derived.write_text(yaml.safe_dump(raw))
    return str(derived)


def run_timeline(out_dir: Path, load: TimelineLoad, modes: dict[str, str] = MODES) -> list[Sample]:
    from bench.profiles import app_args_of, load_config
    from app.tools.procs import base_url_of

    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    samples: list[Sample] = []
    for mode, config_path in modes.items():
        config = load_config(config_path)
        model, url = app_args_of(config).model.id, base_url_of(config)
        with running_app(_config_for(mode, config_path, load, out_dir), url, out_dir / "logs") as app:
            _send(url, _schedule(TimelineLoad(cycles=1, period_s=0, during_s=0, alone_s=0), model))  # warm-up
            log(f"{mode}: {load.cycles} cycles of {load.period_s:g} s (long, short while it is prefilled, short alone)")
            sent = _send(url, _schedule(load, model))
            time.sleep(3)  # the last log lines reach the driver's output
            timelines = read_timelines(app.log_path)
        samples += [Sample(mode, kind, ttft, timelines.get(_engine_id(rid))) for kind, rid, ttft in sent]
    write_report(samples, out_dir)
    return samples


def medians(samples: list[Sample]) -> dict[tuple[str, str], dict[str, float]]:
    """(mode, kind) -> stage -> median seconds, over the requests that have the stage."""
    out = {}
    for key in sorted({(s.mode, s.kind) for s in samples}):
        stages: dict[str, list[float]] = {}
        for s in samples:
            if (s.mode, s.kind) == key and s.timeline is not None:
                for name, seconds in s.timeline.stages().items():
                    stages.setdefault(name, []).append(seconds)
        out[key] = {name: statistics.median(v) for name, v in stages.items()}
    return out


def table(samples: list[Sample]) -> str:
    by_kind = medians(samples)
    names = [n for n in STAGES if any(n in m for m in by_kind.values())]
    rows = ["| mode | kind | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for (mode, kind), m in by_kind.items():
        rows.append(f"| {mode} | {kind} | " + " | ".join(f"{m[n] * 1000:.0f}" if n in m else "–" for n in names) + " |")
    return "\n".join(rows)


def write_report(samples: list[Sample], out_dir: Path) -> None:
    out_dir = Path(out_dir)
    (out_dir / "timeline.json").write_text(json.dumps([
        {**asdict(s), "timeline": asdict(s.timeline) if s.timeline else None,
         "stages": s.timeline.stages() if s.timeline else None} for s in samples
    ], indent=1))
    with open(out_dir / "timeline.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["mode", "kind", "stage", "median_ms", "requests"])
        counts = Counter((s.mode, s.kind) for s in samples if s.timeline is not None)
        for (mode, kind), m in medians(samples).items():
            for stage, seconds in m.items():
                writer.writerow([mode, kind, stage, round(seconds * 1000, 1), counts[(mode, kind)]])
    plot_waterfall(samples, out_dir / "waterfall.png")
    missing = sum(1 for s in samples if s.timeline is None)
    print(table(samples))
    log(f"wrote {out_dir}/timeline.json, timeline.csv, waterfall.png ({missing} requests without a timeline)")


def plot_waterfall(samples: list[Sample], path: Path) -> Path:
    """One panel per mode; one bar per request from its arrival, one colour per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({s.mode for s in samples})
    fig, axes = plt.subplots(len(modes), 1, figsize=(12.5, 1.2 + 0.32 * max(1, len(samples) // max(1, len(modes)))),
                             squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        rows = [s for s in samples if s.mode == mode and s.timeline is not None]
        t0 = min((s.timeline.stamps["arrived"] for s in rows if "arrived" in s.timeline.stamps), default=0.0)
        for y, s in enumerate(rows):
            stamps, stages = s.timeline.stamps, s.timeline.stages()
            left = stamps.get("arrived", t0) - t0
            for name in _SEGMENTS:
                parts = _DRAWN_AS_PARTS.get(name, ())
                if name in stages and not (parts and all(part in stages for part in parts)):
                    ax.barh(y, stages[name], left=left, color=_COLORS[name], label=name if y == 0 or name not in
                            ax.get_legend_handles_labels()[1] else None)
                    left += stages[name]
            if _OVERLAY in stages:  # progressive push: the chunk WRITEs landing while prefill computes
                ax.barh(y + 0.3, stages[_OVERLAY], left=stamps["first_chunk_landed"] - t0, height=0.25,
                        color=_OVERLAY_COLOR, label=f"{_OVERLAY} ({s.timeline.chunk_writes} chunk WRITEs)"
                        if y == 0 or _OVERLAY not in " ".join(ax.get_legend_handles_labels()[1]) else None)
        ax.set_yticks(range(len(rows)), [s.kind for s in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{mode}: each request from its arrival (s)", fontsize=9)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # off the bars
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
