"""``python -m bench soak``: mixed traffic for a long while, with replicas killed on a timer.

Workers send, one after another, a mix of chat and completion requests, short and long,
streamed and not, and conversation turns (each worker carries a conversation for a few
turns, then starts a new one). Every ``kill_every_s`` one replica is SIGKILLed, in turn a
decode replica (its Ray worker process) and the prefill engine (its vLLM processes); Serve
replaces them. Each request ends one way:

* ``ok``: a 200 whose stream (if any) ended with ``[DONE]`` and no error event;
* ``rejected``: a 429 (admission control);
* ``error``: a clean OpenAI error, as a 4xx/5xx body or as a stream's error event;
* ``lost``: anything else — a timeout past the request's deadline, a cut connection, a
  body that is not an OpenAI response. The target is 0.

Which rung served what: the ingress counts requests whose decode replica was lost
(``ray_rendezvous_decode_lost_total``; the ingress is never killed), and the app log counts
prefill legs that fell back to decode (``handoff failed``), as replicas that die take their
own counters with them. The decode replicas' own counts of prefill paths and conversation
histories are reported too (``kv_mismatch`` among them: KV checksums that disagreed); with
``kill_every_s`` 0 nothing is killed, so they cover the whole run (a clean-traffic run's
false-alarm count). Memory: resident memory of every process of the run, and the
engines' KV usage after one short request, at start and at end.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.tools.procs import engine_processes, find_processes
from bench.engine_metrics import RoleMetrics, counted_by
from bench.faults import healthy_replicas, worker_pid
from bench.sweep import log, running_app

OUTCOMES = ("ok", "rejected", "error", "lost")
_WORDS = "river fox stone cloud lantern meadow copper violin harbor maple".split()


@dataclass
class SoakReport:
    config: str
    minutes: float
    workers: int
    kill_every_s: float
    requests: Counter = field(default_factory=Counter)  # outcome -> count
    by_kind: dict[str, Counter] = field(default_factory=dict)  # request kind -> outcome -> count
    kills: list[dict[str, Any]] = field(default_factory=list)
    decode_lost: dict[str, float] = field(default_factory=dict)  # when -> count (ingress)
    prefill_fallbacks: int = 0  # from the app log
    prefill_paths: dict[str, float] = field(default_factory=dict)  # decode replicas' ray_rendezvous_requests_total
    histories: dict[str, float] = field(default_factory=dict)  # ... and ray_rendezvous_conversation_turns_total
    rss_mib: dict[str, float] = field(default_factory=dict)  # start / end
    kv_usage: dict[str, dict[str, float]] = field(default_factory=dict)  # start / end -> role -> fraction
    lost_examples: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["requests"] = dict(self.requests)
        data["by_kind"] = {kind: dict(c) for kind, c in self.by_kind.items()}
        return data


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def one_request(http: httpx.Client, rng: random.Random, model: str, conversation: dict) -> tuple[str, str, str]:
    """Send one request of a random kind; return (kind, outcome, detail)."""
    kind = rng.choice(["chat", "chat-long", "completion-stream", "conversation"])
    stream = kind == "completion-stream"
    if kind == "completion-stream":
        path, body = "/v1/completions", {"prompt": _text(rng, 40), "max_tokens": 32}
    elif kind == "conversation":
        conversation["messages"].append({"role": "user", "content": _text(rng, 120)})
        path, body = "/v1/chat/completions", {"messages": conversation["messages"], "max_tokens": 24,
                                              "conversation_id": conversation["id"]}
    else:
        words = 400 if kind == "chat-long" else 20
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": _text(rng, words)}], "max_tokens": 24}
    body.update(model=model, temperature=0, stream=stream)
    try:
        if stream:
            with http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    return kind, *_classify_error(r.status_code, r.read())
                events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
            if any('"error"' in e[:20] for e in events):
                return kind, "error", next(e for e in events if '"error"' in e[:20])[:200]
            return (kind, "ok", "") if events and events[-1] == "[DONE]" else (kind, "lost", f"stream ended without [DONE]: {events[-1:]}")
        r = http.post(path, json=body)
        if r.status_code != 200:
            return kind, *_classify_error(r.status_code, r.content)
        answer = r.json()["choices"][0]
        if kind == "conversation":
            conversation["messages"].append({"role": "assistant", "content": answer["message"]["content"]})
        return kind, "ok", ""
    except (httpx.HTTPError, ValueError, KeyError) as e:  # a timeout, a cut connection, a body that is not OpenAI's
        return kind, "lost", f"{type(e).__name__}: {e}"[:200]


def _classify_error(status: int, content: bytes) -> tuple[str, str]:
    if status == 429:
        return "rejected", ""
    try:
        error = json.loads(content)["error"]
        return "error", f"{status}: {error.get('message', '')[:160]}"
    except (ValueError, KeyError, TypeError):
        return "lost", f"{status} without an OpenAI error body: {content[:160]!r}"


def _rss_mib(run_id: str | None) -> float:
    total_kib = 0
    for pid in find_processes(run_id):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
        except OSError:
            continue
    return total_kib / 1024


def _kv_usage(metrics: RoleMetrics, url: str, model: str) -> dict[str, float]:
    """Each role's KV usage right after one short request: Ray exports an engine's gauges only
    while the engine steps, so an idle engine reports none."""
    httpx.post(f"{url}/v1/chat/completions", timeout=120,
               json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    time.sleep(12)  # Ray exports every few seconds
    snap = metrics.snapshot()
    return {role: values.get("kv_cache_usage_perc", float("nan")) for role, values in snap.items() if not role.startswith("replica:")}


def _kill_one(metrics_url: str, victim: str) -> dict[str, Any]:
    """SIGKILL a decode replica's process, or the prefill engine's processes."""
    if victim == "decode":
        replicas = healthy_replicas(metrics_url, "Decode", timeout_s=10)
        if not replicas:
            return {"victim": victim, "skipped": "no healthy decode replica"}
        replica, worker = sorted(replicas.items())[0]
        pids = [worker_pid(worker)]
    else:
        replica, pids = "engine", engine_processes("Prefill")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"victim": victim, "replica": replica, "pids": pids}


def run_soak(
    config_path: str,
    out_dir: Path,
    *,
    minutes: float = 30,
    workers: int = 4,
    kill_every_s: float = 300,
    request_timeout_s: float = 120,
    seed: int = 0,
) -> SoakReport:
    from bench.profiles import app_args_of, load_config
    from app.tools.procs import base_url_of

    config = load_config(config_path)
    model, url = app_args_of(config).model.id, base_url_of(config)
    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    os.environ["RAY_DEDUP_LOGS"] = "0"  # every fallback line in the app log, not "[repeated Nx]"
    report = SoakReport(config_path, minutes, workers, kill_every_s)
    with running_app(config_path, url, out_dir / "logs") as app:
        metrics = RoleMetrics(app.metrics_url())
        report.rss_mib["start"], report.kv_usage["start"] = _rss_mib(app.run_id), _kv_usage(metrics, url, model)
        lost_before, paths_before = _decode_lost(metrics.url), _paths(metrics.url)
        stop, lock = threading.Event(), threading.Lock()

        def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            conversation = {"id": f"soak-{index}-0", "messages": []}
            with httpx.Client(base_url=url, timeout=request_timeout_s) as http:
                for n in itertools.count():
                    if stop.is_set():
                        return
                    if len(conversation["messages"]) >= 8:  # 4 turns, then a new conversation
                        conversation = {"id": f"soak-{index}-{n}", "messages": []}
                    kind, outcome, detail = one_request(http, rng, model, conversation)
                    with lock:
                        report.requests[outcome] += 1
                        report.by_kind.setdefault(kind, Counter())[outcome] += 1
                        if outcome == "lost" and len(report.lost_examples) < 20:
                            report.lost_examples.append(f"{kind}: {detail}")

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
        for t in threads:
            t.start()
        started, victims = time.monotonic(), ["decode", "prefill"]
        next_kill = started + kill_every_s if kill_every_s > 0 else float("inf")
        while (now := time.monotonic()) < started + minutes * 60:
            if now >= next_kill:
                kill = _kill_one(metrics.url, victims[len(report.kills) % 2])
                kill["at_s"] = round(now - started)
                report.kills.append(kill)
                log(f"soak: killed {kill}")
                next_kill += kill_every_s
            time.sleep(1)
            if int(now - started) % 60 == 0:
                log(f"soak: {int(now - started) // 60} min, {dict(report.requests)}")
        stop.set()
        for t in threads:
            t.join(timeout=request_timeout_s + 10)
        time.sleep(15)  # Ray exports metrics every few seconds; engines go idle
        report.decode_lost = {k: v - lost_before.get(k, 0) for k, v in _decode_lost(metrics.url).items()}
        for name, (before, after) in zip(("prefill_paths", "histories"), zip(paths_before, _paths(metrics.url))):
            setattr(report, name, {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)})
        report.rss_mib["end"], report.kv_usage["end"] = _rss_mib(app.run_id), _kv_usage(metrics, url, model)
        report.prefill_fallbacks = app.log_path.read_text(errors="replace").count("handoff failed")
    (out_dir / "soak.json").write_text(json.dumps(report.to_json(), indent=2))
    print(format_report(report))
    return report


def _decode_lost(metrics_url: str) -> dict[str, float]:
    return dict(counted_by(metrics_url, "ray_rendezvous_decode_lost_total", "when"))


def _paths(metrics_url: str) -> tuple[dict[str, float], dict[str, float]]:
    """(prefill path -> requests, history -> conversation turns), as decode replicas count them."""
    return (dict(counted_by(metrics_url, "ray_rendezvous_requests_total", "prefill")),
            dict(counted_by(metrics_url, "ray_rendezvous_conversation_turns_total", "history")))


def format_report(r: SoakReport) -> str:
    total = sum(r.requests.values())
    kills = f"a kill every {r.kill_every_s:g} s" if r.kill_every_s > 0 else "no kills"
    lines = [f"soak of {r.config}: {r.minutes:g} min, {r.workers} workers, {kills} ({len(r.kills)} kills)"]
    lines.append(f"requests {total}: " + ", ".join(f"{o} {r.requests.get(o, 0)}" for o in OUTCOMES))
    for kind, c in sorted(r.by_kind.items()):
        lines.append(f"  {kind:<18} " + ", ".join(f"{o} {c.get(o, 0)}" for o in OUTCOMES))
    lines.append(f"rungs: prefill fell back to decode {r.prefill_fallbacks}x; decode replica lost {r.decode_lost}")
    lines.append(f"prefill paths (decode replicas' counts) {r.prefill_paths}; conversation histories {r.histories}")
    lines.append(f"memory of the run (RSS): {r.rss_mib.get('start', 0):.0f} MiB at start, {r.rss_mib.get('end', 0):.0f} MiB at end")
    lines.append(f"KV usage after one short request: start {r.kv_usage.get('start')}, end {r.kv_usage.get('end')}")
    for example in r.lost_examples:
        lines.append(f"  lost: {example}")
    return "\n".join(lines)
