"""How much of the prefill a KV transfer takes on a shaped link (docs/cluster.md, "A shaped link").

Starts configs/local-cpu-2node.yaml (push) on this machine's three-node cluster (app.tools.cluster, root), its
worker nodes' links unshaped and then shaped to each ``--mbit``, and sends one completion at a time of each
prompt length (token ids, each request its own: no prefix cache hit). From each request's timeline in the app log
(app.request.timeline): prefill's compute, the WRITE (push: the writer thread starting it until decode's engine saw
the KV land) and the exposed transfer (prefill finished to KV landed). The rate at which the transfer is
``--share`` of the prefill it follows is the KV's bits over that share of the compute. Writes ``link-rate.json``
next to this file.

    .venv/bin/python docs/results/link-rate.py [--mbit 400] [--lengths 512 1024 2048] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from app.tools.cluster import link_mbit, load_plan
from app.tools.procs import AppProcess
from bench.profiles import kv_bytes_per_token
from bench.timeline import read_timelines

CONFIG = "configs/local-cpu-2node.yaml"
HTTP_PORT = 8000


def run(mbit: float | None, lengths: list[int], repeats: int, log_dir: Path, seed: int) -> list[dict]:
    plan = load_plan(link_mbit=mbit)
    app = AppProcess(CONFIG, log_dir, how="cluster", base_url=plan.base_url(HTTP_PORT),
                     args=[] if mbit is None else ["--link-mbit", f"{mbit:g}"]).start()
    sent: list[tuple[str, int]] = []
    try:
        app.wait_ready(timeout_s=900)
        assert link_mbit(plan) == mbit, f"the cluster's link is at {link_mbit(plan)}, not {mbit}"
        http = httpx.Client(base_url=app.base_url, timeout=600)
        model = http.get("/v1/models").json()["data"][0]["id"]
        for n in lengths:
            for r in range(repeats):
                base = 1000 + (seed * 7919 + n * 31 + r * 104729) % 9000
                prompt = [(base + i * 7) % 20000 + 1000 for i in range(n)]
                resp = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
                resp.raise_for_status()
                sent.append((resp.json()["id"], resp.json()["usage"]["prompt_tokens"]))
        time.sleep(3)  # the last timeline's log line
    finally:
        app.interrupt(timeout_s=300)
    timelines = read_timelines(app.log_path)
    per_token = kv_bytes_per_token(CONFIG)
    rows = []
    for request_id, tokens in sent:
        timeline = next((t for rid, t in timelines.items() if rid in request_id or request_id in rid), None)
        stages = timeline.stages() if timeline is not None else {}
        kv_bytes = (tokens - 1) * per_token  # decode computes the last token itself
        rows.append({
            "link_mbit": mbit, "prompt_tokens": tokens, "kv_bytes": kv_bytes,
            "prefill_compute_s": stages.get("prefill_compute"), "write_s": stages.get("write"),
            "transfer_s": stages.get("transfer"), "route": timeline.route.value if timeline else None,
        })
    return rows


def summary(rows: list[dict], share: float) -> dict:
    by = {}
    for row in rows:
        if row["prefill_compute_s"] and row["transfer_s"] is not None:
            by.setdefault((row["link_mbit"], row["prompt_tokens"]), []).append(row)
    out = []
    for (mbit, tokens), group in sorted(by.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
        compute = statistics.median(r["prefill_compute_s"] for r in group)
        transfer = statistics.median(r["transfer_s"] for r in group)
        write = statistics.median(r["write_s"] for r in group if r["write_s"] is not None)
        bits = group[0]["kv_bytes"] * 8
        out.append({
            "link_mbit": mbit, "prompt_tokens": tokens, "prefill_compute_s": round(compute, 3),
            "transfer_s": round(transfer, 3), "write_s": round(write, 3),
            "transfer_share_of_prefill": round(transfer / compute, 3),
            "write_mbit_per_s": round(bits / write / 1e6, 1) if write else None,
            f"mbit_for_{share:g}_share": round(bits / (share * compute) / 1e6),
        })
    return {"points": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=float, action="append", help="shaped rates to measure (after the unshaped link)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--share", type=float, default=0.2, help="the transfer's share of the prefill to size the link by")
    args = parser.parse_args()
    log_dir = Path("/tmp/rendezvous-link-rate")
    log_dir.mkdir(exist_ok=True)
    rows = []
    for i, mbit in enumerate([None, *(args.mbit or [400.0])]):
        rows += run(mbit, args.lengths, args.repeats, log_dir, seed=i)
    result = {
        "what": f"one completion at a time (max_tokens 1), {CONFIG} (push) on app.tools.cluster, worker links "
                f"unshaped and shaped (tbf), {time.strftime('%Y-%m-%d')}; medians of {args.repeats} per point",
        "rows": rows,
        **summary(rows, args.share),
    }
    out = Path(__file__).with_name("link-rate.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["points"], indent=1))


if __name__ == "__main__":
    main()
