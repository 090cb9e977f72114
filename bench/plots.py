"""Figures from results rows: latency vs request rate, one panel per input length, one
line per mode (push-progressive / push / pull / aggregated). Solid lines are p50, dashed p90."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display needed (and none on a server)
import matplotlib.pyplot as plt  # noqa: E402

from bench.results import MODE_ORDER, sort_rows  # noqa: E402

COLORS = {"push-progressive": "tab:purple", "push": "tab:blue", "pull": "tab:orange", "aggregated": "tab:green"}
FIGURES = {
    "ttft_vs_rate.png": ("ttft", "TTFT (ms)", "Time to first token"),
    "tpot_vs_rate.png": ("tpot", "TPOT (ms)", "Time per output token"),
}
# Drawn where the rows have it (a sweep that started its apps: bench.results.EXPOSED_COLUMNS).
OPTIONAL_FIGURES = {
    "exposed_transfer_vs_rate.png": ("exposed_transfer", "prefill finished → KV landed (ms)", "Exposed transfer"),
}


def plot_latency_vs_rate(
    rows: Iterable[Mapping[str, Any]], metric: str, ylabel: str, title: str, path: Path
) -> Path:
    rows = sort_rows(rows)
    input_lens = sorted({r["input_len"] for r in rows})
    if not input_lens:
        raise ValueError("no rows to plot")
    modes = [m for m in MODE_ORDER if any(r["mode"] == m for r in rows)]
    modes += sorted({r["mode"] for r in rows} - set(modes))
    fig, axes = plt.subplots(1, len(input_lens), figsize=(4.2 * len(input_lens), 3.8), squeeze=False)
    for ax, input_len in zip(axes[0], input_lens):
        for mode in modes:
            points = [r for r in rows if r["mode"] == mode and r["input_len"] == input_len]
            for pct, style in (("p50", "-"), ("p90", "--")):
                xy = [(r["request_rate"], r[f"{metric}_{pct}_ms"]) for r in points if r.get(f"{metric}_{pct}_ms") is not None]
                if not xy:
                    continue
                xs, ys = zip(*xy)
                ax.plot(
                    xs, ys, style, marker="o" if pct == "p50" else None, color=COLORS.get(mode), alpha=1.0 if pct == "p50" else 0.6,
                    label=f"{mode} {pct}",
                )
        ax.set_title(f"input {input_len} tokens")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    if handles:
        fig.legend(handles, labels, loc="center right", fontsize="small")
    fig.suptitle(f"{title} vs request rate (solid p50, dashed p90)")
    fig.tight_layout(rect=(0, 0, 0.84, 0.94))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_results(rows: Iterable[Mapping[str, Any]], out_dir: Path) -> list[Path]:
    rows = list(rows)
    optional = {name: figure for name, figure in OPTIONAL_FIGURES.items()
                if any(r.get(f"{figure[0]}_p50_ms") is not None for r in rows)}
    return [
        plot_latency_vs_rate(rows, metric, ylabel, title, Path(out_dir) / name)
        for name, (metric, ylabel, title) in {**FIGURES, **optional}.items()
    ]
