"""Benchmark profiles: which apps, which load, and the time budget each one must fit (pure).

A profile names one app config per mode, the (input length, request rate) points, the
output length and how many prompts each point sends. ``estimate_s`` adds up what a sweep
costs from a few explicit per-hardware assumptions (``Timing``), and the unit tests keep
each profile inside its budget, so a change to the points that breaks the budget fails
before anyone waits an hour to find out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from app.config.args import AppArgs
from connector.ports import Role

REPO = Path(__file__).resolve().parents[1]


class Mode(str, Enum):
    PUSH = "push"
    PUSH_PROGRESSIVE = "push-progressive"  # push with handoff.progressive: a WRITE per finished prefill chunk
    PULL = "pull"
    AGGREGATED = "aggregated"

    @property
    def disaggregated(self) -> bool:
        return self is not Mode.AGGREGATED

    @property
    def transfer(self) -> str | None:
        """The app's ``mode`` (push or pull) this benchmark mode runs; None for one aggregated engine."""
        return {Mode.PUSH_PROGRESSIVE: "push", Mode.AGGREGATED: None}.get(self, self.value)


class ProfileError(ValueError):
    """A profile cannot run as asked (missing config, prompts that do not fit, ...)."""


@dataclass(frozen=True)
class Timing:
    """What the budget assumes about one hardware class (seconds)."""

    app_start_s: float  # `python -m app.tools.run` until the first tiny request succeeds
    app_stop_s: float  # Ctrl-C until every process has ended
    prefill_s_per_1k: float  # one prompt's prefill per 1k input tokens, no contention
    tpot_s: float  # one output token, light load
    metrics_wait_s: float  # until Ray's export shows a point's transfers (it exports every ~10 s)
    settle_s: float  # once per mode: engine metrics unchanged for one export period, the baseline

    def request_s(self, input_len: int, output_len: int) -> float:
        return self.prefill_s_per_1k * input_len / 1000 + self.tpot_s * output_len


CPU_2CORE = Timing(app_start_s=90, app_stop_s=20, prefill_s_per_1k=2.0, tpot_s=0.15, metrics_wait_s=8, settle_s=15)
# One P5en node per role, Qwen3-32B TP 8; the start includes loading ~65 GB of weights.
P5EN = Timing(app_start_s=900, app_stop_s=60, prefill_s_per_1k=0.08, tpot_s=0.02, metrics_wait_s=10, settle_s=15)


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    configs: Mapping[Mode, str]  # repo-relative config path per mode, in run order
    rates: Mapping[int, tuple[float, ...]]  # input length -> request rates (req/s, Poisson)
    output_len: int
    budget_s: float
    timing: Timing
    window_s: float  # each point sends about rate x window_s prompts ...
    min_prompts: int  # ... but at least this many ...
    max_prompts: int  # ... and at most this many
    warmups: int = 1  # requests per mode after the app is ready, excluded from every point
    backend: str = "openai"  # vLLM bench backend: openai (completions) or openai-chat
    range_ratio: float = 0.0  # input lengths drawn from [len x (1 - r), len x (1 + r)]
    prefix_caching_off: bool = True  # refuse configs that enable it (random prompts; cache hits skew TTFT)
    notes: tuple[str, ...] = field(default_factory=tuple)
    # App args set on top of every mode's config (e.g. the same prefill chunk size everywhere), and per mode.
    overrides: Mapping[str, Any] = field(default_factory=dict)
    mode_overrides: Mapping[Mode, Mapping[str, Any]] = field(default_factory=dict)
    # Run the disaggregated modes on this host's three-node cluster (app.tools.cluster, root), the prefill and
    # decode nodes' links shaped to this rate (Mbit/s); the aggregated engine runs as `make serve` runs it.
    link_mbit: float | None = None

    def config_of(self, mode: Mode) -> dict[str, Any]:
        """``mode``'s app config as the sweep runs it: the profile's file, with the overrides set (push-progressive:
        ``handoff.progressive``)."""
        config = load_config(self.configs[mode])
        args = config["applications"][0].setdefault("args", {})
        progressive = {"handoff": {"progressive": True}} if mode is Mode.PUSH_PROGRESSIVE else {}
        for overrides in (self.overrides, self.mode_overrides.get(mode, {}), progressive):
            merge_args(args, overrides)
        return config

    def on_cluster(self, mode: Mode) -> bool:
        return self.link_mbit is not None and mode.disaggregated

    def with_configs(self, configs: Mapping[Mode, str]) -> "Profile":
        """The same points with some modes' configs replaced (checked like the profile's own before a run)."""
        return replace(self, configs={**self.configs, **configs})

    def with_overrides(self, overrides: Mapping[str, Any]) -> "Profile":
        """The same points with more app args set in every mode's config."""
        merged: dict[str, Any] = {}
        merge_args(merged, self.overrides)
        merge_args(merged, overrides)
        return replace(self, overrides=merged)

    @property
    def modes(self) -> list[Mode]:
        return list(self.configs)

    @property
    def input_lens(self) -> list[int]:
        return list(self.rates)

    def points(self) -> list[tuple[int, float]]:
        return [(input_len, rate) for input_len, rates in self.rates.items() for rate in rates]

    def num_prompts(self, rate: float) -> int:
        return max(self.min_prompts, min(self.max_prompts, math.ceil(rate * self.window_s)))

    def point_s(self, input_len: int, rate: float, mode: Mode, output_len: int | None = None) -> float:
        """Arrivals (or the prefill backlog, if the point saturates), the last request, metrics."""
        t, n = self.timing, self.num_prompts(rate)
        output_len = output_len or self.output_len
        arrivals = max(n / rate, n * t.prefill_s_per_1k * input_len / 1000)
        return arrivals + t.request_s(input_len, output_len) + (t.metrics_wait_s if mode.disaggregated else 0)

    def mode_fixed_s(self, mode: Mode, output_len: int | None = None) -> float:
        """Start, warm-up, metrics baseline and stop of one mode's app: everything but the points."""
        t = self.timing
        fixed = t.app_start_s + t.app_stop_s + self.warmups * t.request_s(self.input_lens[-1], output_len or self.output_len)
        return fixed + (t.settle_s if mode.disaggregated else 0)

    def mode_s(self, mode: Mode, output_len: int | None = None) -> float:
        return self.mode_fixed_s(mode, output_len) + sum(self.point_s(i, r, mode, output_len) for i, r in self.points())

    def estimate_s(self, modes: list[Mode] | None = None, output_len: int | None = None) -> float:
        return sum(self.mode_s(m, output_len) for m in (modes or self.modes))

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "configs": {m.value: c for m, c in self.configs.items()},
            "rates": {str(i): list(r) for i, r in self.rates.items()},
            "num_prompts": {str(r): self.num_prompts(r) for r in sorted({r for _, r in self.points()})},
            "output_len": self.output_len,
            "budget_s": self.budget_s,
            "estimate_s": round(self.estimate_s()),
            "warmups_per_mode": self.warmups,
            "backend": self.backend,
            "range_ratio": self.range_ratio,
            "timing_assumptions": vars(self.timing),
            "overrides": {"all": dict(self.overrides), **{m.value: dict(o) for m, o in self.mode_overrides.items()}},
            "link_mbit": self.link_mbit,
        }


def merge_args(into: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """Set ``overrides`` in ``into``, section by section (a nested mapping merges; anything else replaces)."""
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            merge_args(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


# The embedded default's three modes, in run order.
_CPU_CONFIGS = {
    Mode.PUSH: "configs/local-cpu.yaml",
    Mode.PULL: "configs/local-cpu-pull.yaml",
    Mode.AGGREGATED: "configs/local-cpu-aggregated.yaml",
}

_CLUSTER_CONFIG = "configs/local-cpu-2node.yaml"
CHUNK_TOKENS = 256  # cpu-link's prefill chunk (max_num_batched_tokens), the same in every mode: docs/benchmarks.md

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in [
        Profile(
            name="cpu-quick",
            description="2-core laptop, embedded SmolLM2-135M: push vs pull vs one aggregated engine, small load",
            configs=_CPU_CONFIGS,
            rates={256: (0.1, 0.25), 1024: (0.1, 0.25)},
            output_len=32,
            budget_s=15 * 60,
            timing=CPU_2CORE,
            window_s=12,
            min_prompts=3,
            max_prompts=3,
            notes=("3 prompts per point: p90/p99 are close to the maximum; quote cpu-full for percentiles.",),
        ),
        Profile(
            name="cpu-quick-progressive",
            description="2-core laptop, embedded SmolLM2-135M, unshaped: progressive push on and off at cpu-quick's "
            "points, 8 prompts a point, 512-token prefill chunks in both (does progressive cost anything where it "
            "cannot help?)",
            configs={Mode.PUSH_PROGRESSIVE: _CPU_CONFIGS[Mode.PUSH], Mode.PUSH: _CPU_CONFIGS[Mode.PUSH]},
            rates={256: (0.1, 0.25), 1024: (0.1, 0.25)},
            output_len=32,
            budget_s=20 * 60,
            timing=CPU_2CORE,
            window_s=12,
            min_prompts=8,
            max_prompts=8,
            overrides={"engine_kwargs": {"max_num_batched_tokens": 512}},
        ),
        Profile(
            name="cpu-overload-corner",
            description="2-core laptop, embedded SmolLM2-135M: 20 prompts of 1k tokens at 0.5 req/s, past what the box "
            "sustains: every request answered (or refused at arrival), at what throughput against one engine",
            configs=_CPU_CONFIGS,
            rates={1024: (0.5,)},
            output_len=64,
            budget_s=30 * 60,
            timing=CPU_2CORE,
            window_s=40,
            min_prompts=20,
            max_prompts=20,
            notes=("The corner where fixed deadlines made the fallback ladder an amplifier (issue: deadlines sized "
                   "to the work): the prefill queue grows past 30 s.",),
        ),
        Profile(
            name="cpu-full",
            description="2-core laptop, embedded SmolLM2-135M: 512-4k inputs, rates up to saturation",
            configs=_CPU_CONFIGS,
            # "4k" is 3968: prompt + 64 output tokens must fit max_model_len 4096.
            rates={
                512: (0.05, 0.15, 0.3),
                1024: (0.05, 0.1, 0.2),
                2048: (0.03, 0.06, 0.1),
                3968: (0.02, 0.04, 0.06),
            },
            # 64, not 128: on 2 cores each output token costs ~0.15 s, and 128 would not fit the hour.
            output_len=64,
            budget_s=60 * 60,
            timing=CPU_2CORE,
            window_s=40,
            min_prompts=3,
            max_prompts=12,
        ),
        Profile(
            name="cpu-link",
            description="the embedded app on this host's three-node cluster, its prefill and decode links shaped to "
            "800 Mbit/s (a transfer ~20 % of the prefill it follows, the ratio of the GPU seeds): progressive push "
            "vs push vs pull vs one aggregated engine, 256-token prefill chunks everywhere",
            configs={Mode.PUSH_PROGRESSIVE: _CLUSTER_CONFIG, Mode.PUSH: _CLUSTER_CONFIG, Mode.PULL: _CLUSTER_CONFIG,
                     Mode.AGGREGATED: _CPU_CONFIGS[Mode.AGGREGATED]},
            rates={1024: (0.05, 0.1), 2048: (0.03, 0.06)},
            output_len=16,
            budget_s=60 * 60,
            timing=CPU_2CORE,
            window_s=60,
            min_prompts=3,
            max_prompts=4,
            overrides={"engine_kwargs": {"max_num_batched_tokens": CHUNK_TOKENS}},
            mode_overrides={Mode.PULL: {"mode": "pull"}},
            link_mbit=800.0,
            notes=("Exposed transfer: prefill finished to KV landed (the request timelines in the app log).",),
        ),
        Profile(
            name="aws-p5en",
            description="Qwen3-32B, 1 prefill + 1 decode P5en node (8x H200 each, TP 8 per role), EFA; AWS's P/D shape",
            configs={
                Mode.PUSH: "configs/gpu-p5en-qwen3-32b-push.yaml",
                Mode.PULL: "configs/gpu-p5en-qwen3-32b-pull.yaml",
            },
            rates={n: (1.0, 2.0, 4.0, 8.0) for n in (1024, 2048, 4096, 8192, 16384)},
            output_len=128,
            budget_s=4 * 3600,
            timing=P5EN,
            window_s=60,
            min_prompts=32,
            max_prompts=480,
            warmups=4,
        ),
    ]
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ProfileError(f"unknown profile {name!r}; valid: {', '.join(PROFILES)}") from None


# --------------------------------------------------------------------------- app configs


def load_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_absolute():
        path = REPO / path
    return yaml.safe_load(path.read_text())


def app_args_of(config: dict[str, Any]) -> AppArgs:
    return AppArgs.parse(config["applications"][0].get("args"))


_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "auto": 2}


def kv_bytes_per_token(config: str | Path) -> int:
    """Bytes of KV a prompt token holds with ``config``'s model and dtype (K and V of every layer and KV head),
    from the model's own config.json: what a transfer of the prompt's KV moves."""
    from app.model_source import resolve_model_source

    args = app_args_of(load_config(config))
    cfg = json.loads((Path(resolve_model_source(args.model.source)) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = _DTYPE_BYTES[str(args.engine_kwargs.get("dtype", "auto"))]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * dtype


def check_profile(profile: Profile, modes: list[Mode], output_len: int | None = None) -> dict[Mode, dict[str, Any]]:
    """Load and check each mode's config before anything starts; raise ProfileError saying what is wrong."""
    output_len = output_len or profile.output_len
    unknown = [m for m in modes if m not in profile.configs]
    if unknown:
        raise ProfileError(
            f"profile {profile.name} has no config for mode(s) {', '.join(m.value for m in unknown)}; "
            f"its modes: {', '.join(m.value for m in profile.modes)}"
        )
    missing = [profile.configs[m] for m in modes if not (REPO / profile.configs[m]).is_file()]
    if missing:
        raise ProfileError(
            f"profile {profile.name} needs {', '.join(missing)}, which {'does' if len(missing) == 1 else 'do'} not exist "
            f"in {REPO}. Add the config (see docs/benchmarks.md) or run another profile: {', '.join(PROFILES)}."
        )
    loaded = {}
    for mode in modes:
        path = profile.configs[mode]
        config = profile.config_of(mode)
        args = app_args_of(config)
        import_path = config["applications"][0].get("import_path", "")
        if mode.disaggregated and args.mode.value != mode.transfer:
            raise ProfileError(f"{path}: mode is {args.mode.value!r}, but profile {profile.name} runs it as {mode.value!r}")
        if mode is Mode.PUSH and args.handoff.progressive:
            raise ProfileError(f"{path}: handoff.progressive is on; run it as mode {Mode.PUSH_PROGRESSIVE.value!r}")
        if not mode.disaggregated and not import_path.startswith("app.aggregated:"):
            raise ProfileError(f"{path}: the aggregated baseline must use import_path app.aggregated:build_aggregated_app")
        shortest = min(profile.input_lens) * (1 - profile.range_ratio)
        if mode.disaggregated and shortest < args.routing.local_prefill_below_tokens:
            raise ProfileError(
                f"{path}: routing.local_prefill_below_tokens {args.routing.local_prefill_below_tokens} keeps prompts of "
                f"{shortest:g} tokens on decode (no transfer); profile {profile.name} measures disaggregated prefill"
            )
        roles = [Role.DECODE] if not mode.disaggregated else list(Role)
        for role in roles:
            kwargs = args.engine_kwargs_for(role)
            limit = kwargs.get("max_model_len")
            longest = max(profile.input_lens) * (1 + profile.range_ratio)
            if limit is not None and longest + output_len > int(limit):
                raise ProfileError(
                    f"{path}: {role.value} max_model_len {limit} < longest prompt {longest:g} + {output_len} output tokens"
                )
            if profile.prefix_caching_off and kwargs.get("enable_prefix_caching", True) is not False:
                raise ProfileError(
                    f"{path}: {role.value} must set enable_prefix_caching: false for profile {profile.name} "
                    "(random prompts; a cache hit would skew TTFT)"
                )
        loaded[mode] = config
    return loaded
