"""KV checksums on and off, end to end, arms interleaved (docs/benchmarks.md, "KV checksums").

Each arm starts the push app (configs/local-cpu.yaml, or the same with ``handoff.kv_checksums: false``),
sends 10 streamed completions one after another (~250 prompt tokens, 48 output tokens, greedy), and
records each one's TTFT and TPOT as the client sees them; then stops the app. Arms alternate so
that the box's drift falls on both.

    .venv/bin/python docs/results/kv-checksum/interleaved_ab.py on off on off > interleaved-ab.json
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx

from app.tools.procs import BASE_URL, REPO
from tests.integration.cases import long_text

CONFIGS = {"on": "configs/local-cpu.yaml", "off": "docs/results/kv-checksum/local-cpu-checksums-off.yaml"}
REQUESTS, OUTPUT_TOKENS = 10, 48


def run_arm(arm: str) -> dict[str, list[float]]:
    app = subprocess.Popen([sys.executable, "-m", "app.tools.run", CONFIGS[arm]], cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            try:
                if '"ready":true' in httpx.get(f"{BASE_URL}/ready", timeout=5).text:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(3)
        ttft, tpot = [], []
        for i in range(REQUESTS):
            body = {"model": "SmolLM2-135M-Instruct", "prompt": f"Run {i} {arm} {time.time()}.\n" + long_text(20)
                    + "\nNote 3 says", "max_tokens": OUTPUT_TOKENS, "min_tokens": OUTPUT_TOKENS, "temperature": 0,
                    "stream": True}
            started, chunks = time.time(), []
            with httpx.stream("POST", f"{BASE_URL}/v1/completions", json=body, timeout=300) as r:
                chunks = [time.time() for line in r.iter_lines() if line.startswith("data: {")]
            ttft.append(round((chunks[0] - started) * 1000))
            tpot.append(round((chunks[-1] - chunks[0]) / (len(chunks) - 1) * 1000, 1))
        return {"ttft_ms": ttft, "tpot_ms": tpot}
    finally:
        os.killpg(app.pid, signal.SIGINT)
        app.wait(120)
        subprocess.run([sys.executable, "-m", "app.tools.procs", "--kill"], cwd=REPO, capture_output=True)


def main(arms: list[str]) -> None:
    runs: dict[str, list[dict]] = {}
    for arm in arms:
        runs.setdefault(arm, []).append(result := run_arm(arm))
        print(f"{arm}: TTFT median {statistics.median(result['ttft_ms']):.0f} ms, TPOT median "
              f"{statistics.median(result['tpot_ms']):.1f} ms", file=sys.stderr)
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:] or ["on", "off", "on", "off"])
