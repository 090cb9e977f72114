"""``python -m bench sweep``: for each mode, start the app, load it point by point, stop it.

A *point* is one (input length, request rate) load run by vLLM's benchmark client
(:func:`run_point`); around it we read the engines' NIXL metrics from Ray's Prometheus
export, so each row also says how many KV transfers the point caused and roughly how
many bytes they moved. The app is started exactly as ``make serve`` starts it
(``python -m app.tools.run CONFIG`` in its own process group) and stopped with Ctrl-C; a run
that leaves any process behind is an error.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from app.model_source import resolve_model_source
from app.request.envelope import Route
from app.request.timeline import RequestTimeline
from app.tools.cluster_plan import NodeKind
from app.tools.procs import AppProcess, base_url_of, busy_ports, kill_run
from bench import client
from bench.engine_metrics import RoleMetrics, Snapshot, histogram_estimate, total_delta
from bench.plots import plot_results
from bench.profiles import Mode, Profile, ProfileError, app_args_of, check_profile
from bench.results import Transfers, make_row, merge_rows, read_results, write_results

TRANSFER_COUNT = "nixl_xfer_time_seconds_count"
TIMELINE_WAIT_S = 2.0  # until the last request's timeline is in the app's log
FAILED_TRANSFERS = ("nixl_num_failed_transfers_total", "nixl_num_failed_transfers")


@dataclass(frozen=True)
class Point:
    row: dict[str, Any]  # the results row (bench.results.COLUMNS)
    raw: dict[str, Any]  # vLLM's benchmark result
    after: Snapshot | None  # engine metrics after the point: the next point's baseline


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def transfers_between(after: Snapshot, before: Snapshot, settled: bool) -> Transfers:
    size = histogram_estimate(after, before, "nixl_bytes_transferred")
    seconds = histogram_estimate(after, before, "nixl_xfer_time_seconds")
    return Transfers(
        count=int(round(total_delta(after, before, TRANSFER_COUNT))),
        failed=int(round(total_delta(after, before, *FAILED_TRANSFERS))),
        bytes_lo=size.low,
        bytes_mid=size.mid,
        bytes_hi=size.high,
        time_mean_s=seconds.mean,
        settled=settled,
    )


def run_point(
    base_url: str,
    tokenizer: str,
    input_len: int,
    rate: float,
    num_prompts: int,
    output_len: int,
    *,
    mode: str = "push",
    metrics: RoleMetrics | None = None,
    before: Snapshot | None = None,
    model: str | None = None,
    backend: str = "openai",
    range_ratio: float = 0.0,
    seed: int = 0,
    raw_dir: Path | None = None,
    metrics_timeout_s: float = 45.0,
) -> Point:
    """Load a running app with one point and return its results row.

    With ``metrics`` (and a disaggregated ``mode``), the row carries the NIXL transfers
    between ``before`` (default: a settled snapshot taken now) and the moment Ray's export
    shows one transfer per completed request (or ``metrics_timeout_s``, then the row says
    ``transfer_metrics_settled: false``).
    """
    disaggregated = Mode(mode).disaggregated
    if metrics is not None and disaggregated and before is None:
        before = metrics.settled_snapshot()
    raw_path = None if raw_dir is None else Path(raw_dir) / f"{mode}-in{input_len}-rate{rate:g}.json"
    load = client.Load(
        base_url=base_url,
        tokenizer=str(tokenizer),
        input_len=input_len,
        rate=rate,
        num_prompts=num_prompts,
        output_len=output_len,
        model=model,
        backend=backend,
        range_ratio=range_ratio,
        seed=seed,
        result_path=raw_path,
    )
    raw = client.run(load)
    transfers, after = None, None
    if metrics is not None and disaggregated:
        wanted = int(raw.get("completed", 0))
        try:
            after = metrics.wait_for(lambda s: total_delta(s, before, TRANSFER_COUNT) >= wanted, timeout_s=metrics_timeout_s)
            settled = True
        except TimeoutError:
            after, settled = metrics.snapshot(), False
            log(f"{mode} in={input_len} rate={rate:g}: Ray's export showed fewer than {wanted} transfers after {metrics_timeout_s:g} s")
        transfers = transfers_between(after, before, settled)
    return Point(row=make_row(mode, input_len, rate, output_len, raw, transfers), raw=raw, after=after)


def warm_up(base_url: str, tokenizer: str, input_len: int, output_len: int, n: int, model: str | None, backend: str) -> None:
    """First requests pay one-time costs (NIXL handshakes, allocator growth): send them untimed."""
    if n <= 0:
        return
    load = client.Load(base_url, str(tokenizer), input_len, float("inf"), n, output_len, model=model, backend=backend, seed=12345)
    result = client.run(load)
    if int(result.get("completed", 0)) < n:
        raise RuntimeError(f"warm-up: {result.get('failed')} of {n} requests failed; errors: {result.get('errors')}")


@contextlib.contextmanager
def running_app(config_path: str, base_url: str, log_dir: Path, link_mbit: float | None = None) -> Iterator[AppProcess]:
    """Start ``config_path`` like ``make serve`` (with ``link_mbit``: on this host's three-node cluster, its links
    shaped to that rate, like ``make serve-cluster LINK_MBIT=...``); on exit Ctrl-C it and insist nothing is left."""
    busy = busy_ports()
    if busy:
        raise RuntimeError(f"ports {busy} are taken before starting {config_path}: stop that app first (make clean-procs)")
    how, args = ("cluster", ["--link-mbit", f"{link_mbit:g}"]) if link_mbit is not None else ("app.tools.run", [])
    app = AppProcess(config_path, log_dir, how=how, base_url=base_url, args=args).start()
    log(f"started {config_path} (run id {app.run_id[:8]}, log {app.log_path})")
    try:
        t0 = time.monotonic()
        app.wait_ready()
        log(f"{config_path} ready after {time.monotonic() - t0:.0f} s")
        yield app
    finally:
        t0 = time.monotonic()
        code = app.interrupt()
        left = app.leftovers()
        if left:
            kill_run(app.run_id)
            raise RuntimeError(f"{config_path}: processes survived Ctrl-C (now killed): {left}; log {app.log_path}")
        log(f"stopped {config_path} (exit {code}) in {time.monotonic() - t0:.0f} s; no process left")


def run_sweep(
    profile: Profile,
    out_dir: Path,
    *,
    modes: list[Mode] | None = None,
    output_len: int | None = None,
    base_url: str | None = None,
    metrics_urls: list[str] | None = None,
    tokenizer: str | None = None,
    ignore_budget: bool = False,
) -> list[dict[str, Any]]:
    """Run ``profile`` and write results.json / results.csv / plots under ``out_dir``.

    With ``base_url`` the app is not started: exactly one mode is benchmarked against what
    runs there (e.g. a cluster deployed with k8s), and ``metrics_urls`` point at Ray's
    Prometheus export of its nodes (optional; without them the transfer columns stay empty).
    """
    modes = modes or profile.modes
    output_len = output_len or profile.output_len
    if base_url and len(modes) != 1:
        raise ProfileError("--base-url benchmarks a running app: pass exactly one --mode (the one deployed there)")
    configs = check_profile(profile, modes, output_len)
    out_dir = Path(out_dir)
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    existing = _existing_rows(out_dir, profile)

    estimate = profile.estimate_s(modes, output_len)
    start = time.monotonic()
    deadline = start + profile.budget_s
    log(
        f"profile {profile.name}: modes {', '.join(m.value for m in modes)}, {len(profile.points())} points each; "
        f"estimated {estimate / 60:.1f} min, budget {profile.budget_s / 60:.0f} min"
        + ("" if ignore_budget else " (points that would overrun it are skipped)")
    )
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []

    def meta() -> dict[str, Any]:
        return {
            "profile": profile.summary(),
            # The rows may also hold earlier runs' modes (a mode run on its own adds to a directory).
            "last_run": {
                "modes": [m.value for m in modes],
                "output_len": output_len,
                "base_url": base_url,
                # A cluster of this host's namespaces shaped with --link-mbit: the rate its KV crossed (Mbit/s).
                "link_mbit": _cluster_link_mbit() if base_url else profile.link_mbit,
                "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
                "elapsed_s": round(time.monotonic() - start, 1),
                "skipped": skipped,
            },
        }

    def over_budget(seconds: float) -> bool:
        return not ignore_budget and time.monotonic() + seconds > deadline

    for mode in modes:
        config, cluster = configs[mode], None
        # The config as run (the profile's overrides set), kept with the results.
        config_path = str(out_dir / "configs" / f"{mode.value}.yaml")
        Path(config_path).parent.mkdir(exist_ok=True)
        Path(config_path).write_text(yaml.safe_dump(config))
        args = app_args_of(config)
        model_dir = tokenizer or resolve_model_source(args.model.source)
        url = base_url or base_url_of(config)
        if profile.on_cluster(mode) and not base_url:
            from app.tools.cluster import load_plan  # root only: the profiles that ask for a cluster

            cluster = load_plan(link_mbit=profile.link_mbit)
            url = cluster.base_url(int(config.get("http_options", {}).get("port", 8000)))
        first_point = profile.point_s(*profile.points()[0], mode, output_len)
        if not base_url and over_budget(profile.mode_fixed_s(mode, output_len) + first_point):
            skipped.append(f"{mode.value}: all points (not even one would fit the budget)")
            log(f"SKIPPING {mode.value}: starting it now would overrun the {profile.budget_s / 60:.0f} min budget")
            continue
        link = profile.link_mbit if cluster is not None else None
        app_context = contextlib.nullcontext(None) if base_url else running_app(config_path, url, out_dir / "logs", link)
        with app_context as app:
            metrics = None
            if mode.disaggregated:
                if cluster is not None:
                    metrics = RoleMetrics([cluster.metrics_url(kind) for kind in NodeKind])
                elif app is not None:
                    metrics = RoleMetrics(app.metrics_url())
                elif metrics_urls:
                    metrics = RoleMetrics(metrics_urls)
            warm_up(url, model_dir, profile.input_lens[-1], output_len, profile.warmups, args.model.id, profile.backend)
            before = metrics.settled_snapshot() if metrics else None
            windows: list[tuple[dict[str, Any], float, float]] = []  # each point's row and when it ran (wall clock)
            for input_len, rate in profile.points():
                name = f"{mode.value} in={input_len} rate={rate:g}"
                # The app must still be stopped after the point.
                if over_budget(profile.point_s(input_len, rate, mode, output_len) + (0 if base_url else profile.timing.app_stop_s)):
                    skipped.append(name)
                    log(f"SKIPPING {name}: it would overrun the budget")
                    continue
                n = profile.num_prompts(rate)
                log(f"{name}: {n} prompts, {output_len} output tokens")
                started = time.time()
                point = run_point(
                    url, model_dir, input_len, rate, n, output_len,
                    mode=mode.value, metrics=metrics, before=before, model=args.model.id,
                    backend=profile.backend, range_ratio=profile.range_ratio, raw_dir=out_dir / "raw",
                )
                before = point.after if point.after is not None else before
                windows.append((point.row, started, time.time()))
                rows.append(point.row)
                write_results(out_dir, merge_rows(existing, rows), meta())
            if app is not None and mode.disaggregated and windows:  # the app's log, read once a mode
                time.sleep(TIMELINE_WAIT_S)
                timelines = _read_timelines(app.log_path)
                for row, since, until in windows:
                    row.update(exposed_transfers(timelines, since, until))
                write_results(out_dir, merge_rows(existing, rows), meta())
    all_rows = merge_rows(existing, rows)
    write_results(out_dir, all_rows, meta())
    if all_rows:
        for path in plot_results(all_rows, out_dir):
            log(f"wrote {path}")
    log(f"done in {(time.monotonic() - start) / 60:.1f} min; results in {out_dir}/results.csv" + (f"; skipped {len(skipped)}" if skipped else ""))
    return all_rows


def _read_timelines(log_path: Path) -> list[RequestTimeline]:
    from bench.timeline import read_timelines  # bench.timeline runs its apps with running_app above

    return list(read_timelines(log_path).values())


def exposed_transfers(timelines: list[RequestTimeline], since: float, until: float) -> dict[str, Any]:
    """The exposed transfer (prefill finished to KV landed) of the disaggregated requests that arrived between
    ``since`` and ``until`` (wall clock), from their timelines (the app's log): bench.results.EXPOSED_COLUMNS."""
    seconds = sorted(
        stages["transfer"] for timeline in timelines
        if timeline.route is Route.REMOTE and timeline.stamps and since <= min(timeline.stamps.values()) <= until
        and "transfer" in (stages := timeline.stages())
    )
    if not seconds:
        return {"exposed_transfers": 0}
    at = lambda q: seconds[min(len(seconds) - 1, int(q * len(seconds)))] * 1e3  # noqa: E731
    return {"exposed_transfer_p50_ms": at(0.5), "exposed_transfer_p90_ms": at(0.9), "exposed_transfers": len(seconds)}


def _cluster_link_mbit() -> float | None:
    """The rate this host's one-machine cluster (app.tools.cluster) shapes its worker nodes' links to, read from the
    kernel; None without such a cluster, unshaped, or where it cannot be read (not root, no tc)."""
    from app.tools.cluster import link_mbit, load_plan  # only a sweep against a running app asks

    try:
        return link_mbit(load_plan())
    except (OSError, ValueError):
        return None


def _existing_rows(out_dir: Path, profile: Profile) -> list[dict[str, Any]]:
    """Rows already in ``out_dir`` from the same profile (a mode run on its own adds to them)."""
    if not (out_dir / "results.json").is_file():
        return []
    doc = read_results(out_dir)
    name = doc.get("profile", {}).get("name")
    if name != profile.name:
        raise ProfileError(f"{out_dir} holds results of profile {name!r}, not {profile.name!r}: choose another --out")
    return doc["rows"]
