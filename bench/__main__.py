"""``python -m bench``: what does rendezvous do on this hardware? (docs/benchmarks.md)

  sweep           start each mode's app (push, pull, aggregated), load it, stop it; results + plots
  plot            redraw the plots of a results directory
  multiturn       per-turn TTFT of growing conversations (with and without conversation reuse)
  nixl-bandwidth  NIXL WRITE bandwidth vs memcpy on this machine
  soak            mixed traffic for a long while, replicas killed on a timer: nothing lost?
  skew            load-aware vs round-robin decode placement when every other request is long
  timeline        where each request's time to first token goes, stage by stage, push vs pull
  overload        goodput at 1x, 2x and 4x of what the box sustains: fixed in-flight limit vs admission by TTFB,
                  streamed and whole answers; or a burst of whole answers at once (--burst)
  parity          every OpenAI request shape, sent to each app config and to `vllm serve`: answers compared field by field
  identity-cost   what the KV identity digest costs a request, by prompt length
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _sweep(a: argparse.Namespace) -> int:
    from bench.profiles import Mode, get_profile
    from bench.sweep import run_sweep

    profile = get_profile(a.profile)
    if a.config:
        profile = profile.with_configs(dict(_mode_config(item) for item in a.config))
    if a.set:
        profile = profile.with_overrides(_overrides(a.set))
    out = Path(a.out or f"results/{profile.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    modes = [Mode(m) for m in a.mode] if a.mode else None
    run_sweep(
        profile, out, modes=modes, output_len=a.output_len, base_url=a.base_url, metrics_urls=a.metrics_url,
        tokenizer=a.tokenizer, ignore_budget=a.ignore_budget,
    )
    return 0


def _mode_config(item: str):
    from bench.profiles import Mode

    mode, sep, path = item.partition("=")
    if not sep or mode not in {m.value for m in Mode}:
        raise SystemExit(f"--config wants MODE=PATH with MODE one of {', '.join(m.value for m in Mode)}: got {item!r}")
    return Mode(mode), path


def _overrides(items: list[str]) -> dict:
    """``--set engine_kwargs.max_num_batched_tokens=512`` as app args: {"engine_kwargs": {"max_num_batched_tokens": 512}}."""
    import yaml

    overrides: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set wants KEY=VALUE (KEY dotted, as in docs/configuration.md): got {item!r}")
        *sections, last = key.split(".")
        target = overrides
        for section in sections:
            target = target.setdefault(section, {})
        target[last] = yaml.safe_load(value)
    return overrides


def _plot(a: argparse.Namespace) -> int:
    from bench.plots import plot_results
    from bench.results import read_results

    for path in plot_results(read_results(Path(a.results_dir))["rows"], Path(a.results_dir)):
        print(f"wrote {path}")
    return 0


def _multiturn(a: argparse.Namespace) -> int:
    from bench.multiturn import run_multiturn

    out = Path(a.out or f"results/multiturn-{time.strftime('%Y%m%d-%H%M%S')}")
    run_multiturn(
        a.config, out, base_url=a.base_url, tokenizer_path=a.tokenizer, conversations=a.conversations,
        turns=a.turns, turn_tokens=a.turn_tokens, output_len=a.output_len,
    )
    return 0


def _nixl_bandwidth(a: argparse.Namespace) -> int:
    from bench.nixl_bandwidth import run

    run(a.sizes_mib, a.iters, a.descriptor_kib, a.backend, Path(a.out) if a.out else None)
    return 0


def _soak(a: argparse.Namespace) -> int:
    from bench.soak import run_soak

    out = Path(a.out or f"results/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    report = run_soak(a.config, out, minutes=a.minutes, workers=a.workers, kill_every_s=a.kill_every_s)
    return 1 if report.requests.get("lost") else 0


def _skew(a: argparse.Namespace) -> int:
    from bench.skew import SkewLoad, run_skew

    out = Path(a.out or f"results/skew-{time.strftime('%Y%m%d-%H%M%S')}")
    load = SkewLoad(requests=a.requests, rate=a.rate, short_tokens=a.short_tokens, long_tokens=a.long_tokens)
    report = run_skew(a.config, out, load)
    return 1 if any(p.errors for p in report) else 0


def _timeline(a: argparse.Namespace) -> int:
    from bench.timeline import MODES, TimelineLoad, run_timeline

    out = Path(a.out or f"results/timeline-{time.strftime('%Y%m%d-%H%M%S')}")
    load = TimelineLoad(cycles=a.cycles, long_words=a.long_words, output_len=a.output_len)
    samples = run_timeline(out, load, {m: MODES[m] for m in (a.mode or MODES)})
    return 1 if any(s.timeline is None for s in samples) else 0


def _overload(a: argparse.Namespace) -> int:
    from bench.overload import ARMS, OverloadLoad, run_burst, run_overload

    out = Path(a.out or f"results/overload-{time.strftime('%Y%m%d-%H%M%S')}")
    load = OverloadLoad(slo_s=a.slo_s, queue_deadline_s=a.queue_deadline_s, client_timeout_s=a.client_timeout_s,
                        seconds=a.seconds, prompt_words=a.prompt_words, output_len=a.output_len)
    if a.burst:
        run_burst(a.config, out, load, a.burst)
        return 0
    rows = run_overload(a.config, out, load, arms=a.arm or ARMS)
    return 1 if any(r["other_status"] for r in rows) else 0


def _parity(a: argparse.Namespace) -> int:
    from bench.parity import run_parity

    out = Path(a.out or f"results/parity-{time.strftime('%Y%m%d-%H%M%S')}")
    rows = run_parity(a.config or ["configs/local-cpu.yaml", "configs/local-cpu-pull.yaml"], out)
    print((out / "summary.md").read_text())
    return 0 if all(r["identical"] == r["shapes"] for r in rows) else 1


def _identity_cost(a: argparse.Namespace) -> int:
    from bench.identity_cost import run_identity_cost

    for row in run_identity_cost(Path(a.out)):
        print(f"{row['prompt_tokens']:>7} prompt tokens: {row['median_ms']:.3f} ms a side (p90 {row['p90_ms']:.3f})")
    return 0


def parser() -> argparse.ArgumentParser:
    from bench.profiles import PROFILES, Mode

    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("sweep", help="run a profile: every mode x input length x request rate")
    s.add_argument("--profile", required=True, choices=list(PROFILES))
    s.add_argument("--out", help="results directory (default results/<profile>-<time>); a mode run adds to it")
    s.add_argument("--mode", action="append", choices=[m.value for m in Mode], help="only this mode (repeatable)")
    s.add_argument("--output-len", type=int, help="output tokens per request (default: the profile's)")
    s.add_argument("--base-url", help="benchmark the app already running here (one --mode) instead of starting it")
    s.add_argument("--metrics-url", action="append", help="with --base-url: Ray's Prometheus export of a node (repeatable)")
    s.add_argument("--tokenizer", help="tokenizer path or hub id (default: the config's model source)")
    s.add_argument("--ignore-budget", action="store_true", help="run every point even past the profile's time budget")
    s.add_argument("--config", action="append", metavar="MODE=PATH",
                   help="run MODE with this app config instead of the profile's (repeatable), e.g. an A/B of one setting")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="set an app arg in every mode's config (repeatable; KEY as in docs/configuration.md), e.g. "
                   "engine_kwargs.max_num_batched_tokens=512")
    s.set_defaults(func=_sweep)

    s = sub.add_parser("plot", help="redraw ttft_vs_rate.png and tpot_vs_rate.png from RESULTS_DIR/results.json")
    s.add_argument("results_dir")
    s.set_defaults(func=_plot)

    s = sub.add_parser("multiturn", help="per-turn TTFT of conversations with growing history")
    s.add_argument("--config", default="configs/local-cpu.yaml")
    s.add_argument("--base-url", help="use the app already running here instead of starting --config")
    s.add_argument("--tokenizer", help="tokenizer path or hub id (default: the config's model source)")
    s.add_argument("--conversations", type=int, default=3)
    s.add_argument("--turns", type=int, default=4)
    s.add_argument("--turn-tokens", type=int, default=500, help="new user tokens per turn (turn 4 ~ 2k history)")
    s.add_argument("--output-len", type=int, default=32)
    s.add_argument("--out", help="report directory (default results/multiturn-<time>)")
    s.set_defaults(func=_multiturn)

    s = sub.add_parser("nixl-bandwidth", help="NIXL WRITE bandwidth vs memcpy, two agents in one process")
    s.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8, 64, 256])
    s.add_argument("--iters", type=int, default=10)
    s.add_argument("--descriptor-kib", type=int, default=0, help="split each transfer into descriptors this big (0: one)")
    s.add_argument("--backend", default="UCX")
    s.add_argument("--out", help="also write the table as JSON here")
    s.set_defaults(func=_nixl_bandwidth)

    s = sub.add_parser("soak", help="mixed traffic with periodic replica kills; exit 1 if a request was lost")
    s.add_argument("--config", default="configs/local-cpu-1p2d.yaml")
    s.add_argument("--minutes", type=float, default=30)
    s.add_argument("--workers", type=int, default=4, help="clients sending one request after another")
    s.add_argument("--kill-every-s", type=float, default=300, help="SIGKILL a decode replica, then the prefill engine, ...; 0: none")
    s.add_argument("--out", help="report directory (default results/soak-<time>)")
    s.set_defaults(func=_soak)

    s = sub.add_parser("skew", help="load-aware vs round-robin decode placement, long and short requests alternating")
    s.add_argument("--config", default="configs/local-cpu-1p2d.yaml")
    s.add_argument("--requests", type=int, default=48)
    s.add_argument("--rate", type=float, default=0.6, help="requests/s, Poisson")
    s.add_argument("--short-tokens", type=int, default=16)
    s.add_argument("--long-tokens", type=int, default=384)
    s.add_argument("--out", help="report directory (default results/skew-<time>)")
    s.set_defaults(func=_skew)

    s = sub.add_parser("timeline", help="per-request stage waterfall and median stage durations, by mode")
    s.add_argument("--mode", action="append", choices=["push", "pull", "push-progressive"], help="only this mode (repeatable)")
    s.add_argument("--cycles", type=int, default=4, help="cycles of: long prompt, short during its prefill, short alone")
    s.add_argument("--long-words", type=int, default=1800, help="words of the long prompt (~1.1 tokens each)")
    s.add_argument("--output-len", type=int, default=8)
    s.add_argument("--out", help="report directory (default results/timeline-<time>)")
    s.set_defaults(func=_timeline)

    s = sub.add_parser("overload", help="goodput at 1x/2x/4x of the sustainable rate: fixed limit vs admission by TTFT")
    s.add_argument("--config", default="configs/local-cpu.yaml")
    s.add_argument("--slo-s", type=float, default=10.0, help="TTFT target: the adaptive arm's ingress.ttft_slo_s and goodput's")
    s.add_argument("--queue-deadline-s", type=float, default=20.0, help="the adaptive arm's ingress.queue_deadline_s")
    s.add_argument("--client-timeout-s", type=float, default=30.0, help="the client gives up (and hangs up) after this")
    s.add_argument("--seconds", type=float, default=60.0, help="offered load per factor")
    s.add_argument("--prompt-words", type=int, default=180, help="words of each prompt (~1.1 tokens a word)")
    s.add_argument("--output-len", type=int, default=64, help="output tokens of each request")
    s.add_argument("--arm", action="append", choices=("fixed", "adaptive", "whole"), help="only these arms (repeatable)")
    s.add_argument("--burst", type=int, default=0, metavar="N",
                   help="instead: N whole requests at once to the config as it is (its own SLO), the client giving up "
                   "after --client-timeout-s")
    s.add_argument("--out", help="report directory (default results/overload-<time>)")
    s.set_defaults(func=_overload)

    s = sub.add_parser("parity", help="every OpenAI request shape against `vllm serve`; exit 1 if an answer differs")
    s.add_argument("--config", action="append", help="app config (repeatable; default: the push and the pull CPU configs)")
    s.add_argument("--out", help="report directory (default results/parity-<time>)")
    s.set_defaults(func=_parity)

    s = sub.add_parser("identity-cost", help="the KV identity digest's cost a request, by prompt length")
    s.add_argument("--out", default="docs/results/kv-identity-cost.json")
    s.set_defaults(func=_identity_cost)
    return p


def main(argv: list[str] | None = None) -> int:
    from bench.profiles import ProfileError

    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
