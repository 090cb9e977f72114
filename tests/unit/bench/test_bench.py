"""bench/: profiles and their budgets, result rows, CSV/JSON, plots, metric arithmetic and the
sweep's orchestration, all on synthetic data (no app, no engines)."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import yaml

from app.aggregated import aggregated_llm_config, parse_args
from app.config.llm_configs import CPU_DEFAULT_ENV
from app.tools.procs import base_url_of
from bench.__main__ import parser
from bench.engine_metrics import histogram_estimate, total_delta
from bench.multiturn import (
    NOT_AVAILABLE,
    TurnResult,
    conversation_reuse_available,
    speedups,
    summarize,
    user_text,
    write_report,
)
from bench.plots import plot_results
from bench.profiles import PROFILES, Mode, ProfileError, app_args_of, check_profile, load_config
from bench.results import COLUMNS, TRANSFER_COLUMNS, Transfers, make_row, merge_rows, read_results, write_results
import bench.sweep as sweep
from tests.support.layering import HEAVY, imports_of

REPO = Path(__file__).resolve().parents[3]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def vllm_result(completed=4, failed=0, ttft=100.0, tpot=20.0, **extra) -> dict:
    """The shape of vllm.benchmarks.serve.main's result (the keys we read)."""
    result = {
        "num_prompts": completed + failed,
        "completed": completed,
        "failed": failed,
        "duration": 12.5,
        "request_throughput": completed / 12.5,
        "output_throughput": completed * 32 / 12.5,
        "total_token_throughput": completed * (256 + 32) / 12.5,
        "total_input_tokens": completed * 256,
    }
    for metric, base in (("ttft", ttft), ("tpot", tpot), ("itl", tpot), ("e2el", ttft + 31 * tpot)):
        result[f"mean_{metric}_ms"] = base * 1.1
        for p, factor in ((50, 1.0), (90, 1.5), (99, 2.0)):
            result[f"p{p}_{metric}_ms"] = base * factor
    return {**result, **extra}


def synthetic_rows() -> list[dict]:
    rows = []
    for mode, slow in (("push", 1.0), ("pull", 1.4), ("aggregated", 0.9)):
        for input_len in (256, 1024):
            for rate in (0.1, 0.25):
                transfers = None if mode == "aggregated" else Transfers(4, 0, 4e6, 6e6, 8e6, 0.004, True)
                result = vllm_result(ttft=slow * input_len * (1 + rate), tpot=slow * 20 * (1 + rate))
                rows.append(make_row(mode, input_len, rate, 32, result, transfers))
    return rows


# --------------------------------------------------------------------------- profiles


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_profile_fits_its_budget(name):
    profile = PROFILES[name]
    assert profile.estimate_s() < profile.budget_s, f"{name}: {profile.estimate_s() / 60:.1f} min estimated"


def test_cpu_profiles_meet_the_issue_time_targets():
    assert PROFILES["cpu-quick"].budget_s <= 15 * 60
    assert PROFILES["cpu-full"].budget_s <= 60 * 60
    # The quick estimate counts three app starts and stops.
    quick = PROFILES["cpu-quick"]
    assert quick.modes == [Mode.PUSH, Mode.PULL, Mode.AGGREGATED]
    assert quick.estimate_s() >= 3 * (quick.timing.app_start_s + quick.timing.app_stop_s)


def test_aws_profile_has_the_aws_benchmark_shape():
    aws = PROFILES["aws-p5en"]
    assert aws.configs == {
        Mode.PUSH: "configs/gpu-p5en-qwen3-32b-push.yaml",
        Mode.PULL: "configs/gpu-p5en-qwen3-32b-pull.yaml",
    }
    assert min(aws.input_lens) == 1024 and max(aws.input_lens) == 16384
    assert {r for _, r in aws.points()} == {1.0, 2.0, 4.0, 8.0}
    assert aws.output_len == 128 and aws.prefix_caching_off


def test_num_prompts_is_clamped():
    full = PROFILES["cpu-full"]
    assert full.num_prompts(0.001) == full.min_prompts
    assert full.num_prompts(100) == full.max_prompts


@pytest.mark.parametrize("name", ["cpu-quick", "cpu-full"])
def test_cpu_profile_configs_pass_the_checks(name):
    profile = PROFILES[name]
    configs = check_profile(profile, profile.modes)
    assert set(configs) == set(profile.modes)
    for mode, config in configs.items():
        assert base_url_of(config) == "http://127.0.0.1:8000"
        args = app_args_of(config)
        assert args.model.id == "SmolLM2-135M-Instruct"


def test_a_missing_config_fails_with_a_clear_message():
    profile = dataclasses.replace(PROFILES["aws-p5en"], configs={Mode.PUSH: "configs/gpu-not-written-yet.yaml"})
    with pytest.raises(ProfileError, match=r"configs/gpu-not-written-yet\.yaml.*does not exist"):
        check_profile(profile, [Mode.PUSH])


def test_aws_profile_either_checks_or_names_the_missing_config():
    aws = PROFILES["aws-p5en"]
    try:
        check_profile(aws, aws.modes)
    except ProfileError as e:
        assert "gpu-p5en-qwen3-32b" in str(e)


def _write_config(tmp_path: Path, args: dict, import_path="app.builder:build_app") -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"applications": [{"name": "x", "import_path": import_path, "args": args}]}))
    return str(path)


def test_prompts_longer_than_max_model_len_are_refused(tmp_path):
    path = _write_config(tmp_path, {"engine_kwargs": {"max_model_len": 1024, "enable_prefix_caching": False}})
    profile = dataclasses.replace(PROFILES["cpu-quick"], configs={Mode.PUSH: path})
    with pytest.raises(ProfileError, match="max_model_len 1024"):
        check_profile(profile, [Mode.PUSH])


def test_prefix_caching_must_be_off(tmp_path):
    path = _write_config(tmp_path, {"engine_kwargs": {"max_model_len": 4096}})
    profile = dataclasses.replace(PROFILES["cpu-quick"], configs={Mode.PUSH: path})
    with pytest.raises(ProfileError, match="enable_prefix_caching: false"):
        check_profile(profile, [Mode.PUSH])


def test_prompts_kept_on_decode_by_conditional_disaggregation_are_refused(tmp_path):
    path = _write_config(
        tmp_path, {"engine_kwargs": {"enable_prefix_caching": False}, "routing": {"local_prefill_below_tokens": 300}}
    )
    profile = dataclasses.replace(PROFILES["cpu-quick"], configs={Mode.PUSH: path})
    with pytest.raises(ProfileError, match="local_prefill_below_tokens 300"):
        check_profile(profile, [Mode.PUSH])


def test_config_mode_must_match(tmp_path):
    path = _write_config(tmp_path, {"mode": "pull", "engine_kwargs": {"enable_prefix_caching": False}})
    profile = dataclasses.replace(PROFILES["cpu-quick"], configs={Mode.PUSH: path})
    with pytest.raises(ProfileError, match="mode is 'pull'"):
        check_profile(profile, [Mode.PUSH])


def test_unknown_profile_is_rejected_by_the_cli():
    with pytest.raises(SystemExit):
        parser().parse_args(["sweep", "--profile", "nope"])
    args = parser().parse_args(["sweep", "--profile", "cpu-quick", "--mode", "push", "--mode", "pull"])
    assert args.mode == ["push", "pull"]


@pytest.mark.parametrize("item, expected", [
    ("push=docs/results/kv-checksum/local-cpu-checksums-off.yaml", None),
    ("push", "MODE=PATH"),
    ("decode=configs/local-cpu.yaml", "MODE=PATH"),
])
def test_sweep_runs_a_mode_with_another_config_when_told(item, expected):
    """An A/B of one setting: the profile's points, one mode's config swapped, checked like the profile's own."""
    from bench.__main__ import _mode_config

    if expected:
        with pytest.raises(SystemExit, match=expected):
            _mode_config(item)
        return
    profile = PROFILES["cpu-quick"].with_configs(dict([_mode_config(item)]))
    assert profile.configs[Mode.PUSH] == item.split("=", 1)[1]
    assert profile.configs[Mode.PULL] == PROFILES["cpu-quick"].configs[Mode.PULL]
    assert profile.points() == PROFILES["cpu-quick"].points()
    assert app_args_of(check_profile(profile, [Mode.PUSH])[Mode.PUSH]).handoff.kv_checksums is False


# --------------------------------------------------------------------------- aggregated baseline


def test_aggregated_config_is_the_decode_role_without_kv_transfer():
    config = load_config("configs/local-cpu-aggregated.yaml")
    assert config["applications"][0]["import_path"] == "app.aggregated:build_aggregated_app"
    args = parse_args(config["applications"][0]["args"])
    llm = aggregated_llm_config(args, "/models/x")
    assert "kv_transfer_config" not in llm["engine_kwargs"]
    assert llm["engine_kwargs"]["enable_prefix_caching"] is False
    assert "experimental_configs" not in llm
    assert llm["runtime_env"]["env_vars"] == {**CPU_DEFAULT_ENV, **args.decode.env}
    assert llm["accelerator_config"] == {"kind": "cpu"}
    assert llm["deployment_config"]["num_replicas"] == 1

    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    LLMConfig.model_validate(llm)


def test_aggregated_engine_kwargs_match_the_push_config():
    push = app_args_of(load_config("configs/local-cpu.yaml"))
    aggregated = app_args_of(load_config("configs/local-cpu-aggregated.yaml"))
    assert aggregated.engine_kwargs == push.engine_kwargs
    assert aggregated.model == push.model


@pytest.mark.parametrize("key", ["mode", "prefill", "nixl", "routing"])
def test_aggregated_rejects_disaggregation_keys(key):
    with pytest.raises(ValueError, match=key):
        parse_args({key: {} if key != "mode" else "push"})


# --------------------------------------------------------------------------- rows, CSV, JSON


def test_row_maps_vllm_percentiles_and_transfers():
    row = make_row("push", 1024, 0.25, 32, vllm_result(), Transfers(4, 1, 4e6, 6e6, 8e6, 0.002, True))
    assert list(row) == COLUMNS
    assert row["ttft_p50_ms"] == 100.0 and row["ttft_p90_ms"] == 150.0 and row["ttft_p99_ms"] == 200.0
    assert row["tpot_p99_ms"] == 40.0 and row["e2el_p50_ms"] == 100.0 + 31 * 20.0
    assert row["completed"] == 4 and row["failed"] == 0 and row["num_prompts"] == 4
    assert row["mean_input_tokens"] == 256
    assert row["nixl_transfers"] == 4 and row["nixl_failed_transfers"] == 1
    assert row["nixl_bytes_per_transfer_est_bucket_mid"] == 1.5e6
    assert row["nixl_xfer_time_mean_ms_est_bucket_mid"] == pytest.approx(2.0)


def test_row_without_transfers_and_non_finite_numbers():
    row = make_row("aggregated", 256, 0.1, 32, vllm_result(p99_tpot_ms=float("nan"), completed=0, failed=3), None)
    assert all(row[c] is None for c in TRANSFER_COLUMNS)
    assert row["tpot_p99_ms"] is None
    assert row["mean_input_tokens"] is None and row["failed"] == 3


def test_estimated_byte_columns_say_so_in_their_names():
    bytes_columns = [c for c in COLUMNS if "bytes" in c]
    assert bytes_columns and all("bucket" in c for c in bytes_columns)


def test_results_json_and_csv_are_well_formed(tmp_path):
    rows = synthetic_rows()
    random.Random(1).shuffle(rows)
    json_path, csv_path = write_results(tmp_path, rows, {"profile": {"name": "cpu-quick"}})
    doc = json.loads(json_path.read_text())
    assert doc["columns"] == COLUMNS and "nixl_bytes" in doc["notes"]
    assert [r["mode"] for r in doc["rows"]][:4] == ["push"] * 4  # sorted: push, pull, aggregated
    with open(csv_path) as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        csv_rows = list(reader)
    assert len(csv_rows) == len(rows)
    for row in csv_rows:
        for column in ("ttft_p50_ms", "tpot_p90_ms", "request_throughput_rps"):
            assert math.isfinite(float(row[column]))
        if row["mode"] == "aggregated":
            assert row["nixl_transfers"] == ""
        else:
            assert int(row["nixl_transfers"]) == 4
    assert read_results(tmp_path)["rows"] == doc["rows"]


def test_a_new_run_replaces_rows_of_the_same_point():
    old = synthetic_rows()
    new = [dict(old[0], ttft_p50_ms=1.0)]
    merged = merge_rows(old, new)
    assert len(merged) == len(old)
    assert [r for r in merged if r["ttft_p50_ms"] == 1.0] == new


def test_read_results_says_how_to_make_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="bench sweep"):
        read_results(tmp_path)


# --------------------------------------------------------------------------- plots


def test_plots_are_non_empty_pngs(tmp_path):
    paths = plot_results(synthetic_rows(), tmp_path)
    assert sorted(p.name for p in paths) == ["tpot_vs_rate.png", "ttft_vs_rate.png"]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_plot_tolerates_missing_values(tmp_path):
    rows = synthetic_rows()
    rows[0] = dict(rows[0], ttft_p50_ms=None, ttft_p90_ms=None)
    assert all(p.stat().st_size > 0 for p in plot_results(rows, tmp_path))


# --------------------------------------------------------------------------- engine metrics arithmetic


def snap(transfers=0, buckets=None, failed=0, replica_copy=True) -> dict:
    """A RoleMetrics snapshot: push records transfers on prefill; per-replica entries repeat them."""
    role = {"nixl_xfer_time_seconds_count": float(transfers), "nixl_num_failed_transfers_total": float(failed)}
    for le, count in (buckets or {}).items():
        role[f"nixl_bytes_transferred_bucket[le={le}]"] = float(count)
    out = {"prefill": role, "decode": {"request_success_total": float(transfers)}}
    if replica_copy:
        out["replica:abc"] = dict(role)
    return out


def test_histogram_estimate_uses_bucket_edges_and_midpoints():
    before = snap(1, {"2048.0": 1, "8192.0": 1, "32768.0": 1, "+Inf": 1})
    # +2 in (2048, 8192], +1 in (8192, 32768]; cumulative counts.
    after = snap(4, {"2048.0": 1, "8192.0": 3, "32768.0": 4, "+Inf": 4})
    est = histogram_estimate(after, before, "nixl_bytes_transferred")
    assert est.count == 3
    assert est.low == 2 * 2048 + 8192
    assert est.high == 2 * 8192 + 32768
    assert est.mid == 2 * (2048 + 8192) / 2 + (8192 + 32768) / 2
    assert est.mean == est.mid / 3


def test_histogram_estimate_above_the_last_bucket_has_no_upper_bound():
    est = histogram_estimate(snap(1, {"1024.0": 0, "+Inf": 1}), snap(0, {"1024.0": 0, "+Inf": 0}), "nixl_bytes_transferred")
    assert est.count == 1 and est.low == 1024 and est.high is None


def test_totals_count_each_sample_once():
    after, before = snap(5, failed=1), snap(2)
    assert total_delta(after, before, "nixl_xfer_time_seconds_count") == 3  # not 6: replica entries are skipped
    assert total_delta(after, before, "nixl_num_failed_transfers_total", "nixl_num_failed_transfers") == 1


# --------------------------------------------------------------------------- run_point / run_sweep with fakes


class FakeMetrics:
    """Engine metrics that advance when the fake client 'sends' requests."""

    def __init__(self, export_lag=False):
        self.transfers = 0
        self.export_lag = export_lag

    def snapshot(self):
        shown = self.transfers - (1 if self.export_lag and self.transfers else 0)
        return snap(shown, {"65536.0": shown, "262144.0": shown, "+Inf": shown}, replica_copy=False)

    settled_snapshot = snapshot

    def wait_for(self, predicate, timeout_s=60, poll_s=1.0):
        s = self.snapshot()
        if not predicate(s):
            raise TimeoutError("fake")
        return s


@pytest.fixture
def fake_load(monkeypatch):
    metrics = FakeMetrics()
    calls = []

    def run(load):
        calls.append(load)
        if load.result_path is not None:
            load.result_path.parent.mkdir(parents=True, exist_ok=True)
            load.result_path.write_text("{}")
        metrics.transfers += load.num_prompts
        return vllm_result(completed=load.num_prompts)

    monkeypatch.setattr(sweep.client, "run", run)
    return metrics, calls


def test_run_point_counts_the_points_transfers(fake_load, tmp_path):
    metrics, calls = fake_load
    metrics.transfers = 7  # earlier traffic
    point = sweep.run_point(
        "http://x:8000", "/tok", 1024, 0.25, 4, 32, mode="push", metrics=metrics, raw_dir=tmp_path, model="m"
    )
    assert point.row["nixl_transfers"] == 4 and point.row["transfer_metrics_settled"] is True
    assert point.row["nixl_bytes_total_bucket_lo"] == 4 * 0  # first bucket starts at 0
    assert point.row["nixl_bytes_total_bucket_hi"] == 4 * 65536
    assert (tmp_path / "push-in1024-rate0.25.json").is_file()
    assert calls[0].model == "m" and calls[0].input_len == 1024 and calls[0].rate == 0.25


def test_run_point_flags_transfers_ray_has_not_exported(fake_load):
    metrics, _ = fake_load
    metrics.export_lag = True
    point = sweep.run_point("http://x", "/tok", 256, 0.1, 3, 32, mode="pull", metrics=metrics, metrics_timeout_s=0)
    assert point.row["transfer_metrics_settled"] is False and point.row["nixl_transfers"] == 2


def test_run_point_aggregated_has_no_transfer_columns(fake_load):
    metrics, _ = fake_load
    point = sweep.run_point("http://x", "/tok", 256, 0.1, 3, 32, mode="aggregated", metrics=metrics)
    assert all(point.row[c] is None for c in TRANSFER_COLUMNS)


def _fake_apps(monkeypatch, metrics):
    started = []

    @contextlib.contextmanager
    def running_app(config_path, base_url, log_dir):
        started.append(config_path)

        class App:
            def metrics_url(self):
                return "http://metrics"

        yield App()

    monkeypatch.setattr(sweep, "running_app", running_app)
    monkeypatch.setattr(sweep, "RoleMetrics", lambda url: metrics)
    monkeypatch.setattr(sweep, "resolve_model_source", lambda source: "/tok")
    return started


def test_sweep_runs_every_mode_and_point_and_writes_everything(fake_load, monkeypatch, tmp_path):
    metrics, calls = fake_load
    started = _fake_apps(monkeypatch, metrics)
    profile = PROFILES["cpu-quick"]
    rows = sweep.run_sweep(profile, tmp_path, ignore_budget=True)
    assert started == [profile.configs[m] for m in profile.modes]
    assert len(rows) == len(profile.modes) * len(profile.points())
    assert len(calls) == len(rows) + len(profile.modes) * (profile.warmups > 0)  # + one warm-up per mode
    for name in ("results.json", "results.csv", "ttft_vs_rate.png", "tpot_vs_rate.png"):
        assert (tmp_path / name).stat().st_size > 0
    pushed = [r for r in rows if r["mode"] == "push"]
    assert all(r["nixl_transfers"] == r["completed"] for r in pushed)
    # A second run of one mode adds to the same directory instead of replacing it.
    sweep.run_sweep(profile, tmp_path, modes=[Mode.PULL], ignore_budget=True)
    assert len(read_results(tmp_path)["rows"]) == len(rows)


def test_sweep_skips_what_would_overrun_the_budget(fake_load, monkeypatch, tmp_path):
    metrics, _ = fake_load
    started = _fake_apps(monkeypatch, metrics)
    profile = dataclasses.replace(PROFILES["cpu-quick"], budget_s=1)
    rows = sweep.run_sweep(profile, tmp_path)
    assert rows == [] and started == []
    assert len(read_results(tmp_path)["last_run"]["skipped"]) == len(profile.modes)


def test_sweep_refuses_a_directory_of_another_profile(fake_load, monkeypatch, tmp_path):
    metrics, _ = fake_load
    _fake_apps(monkeypatch, metrics)
    write_results(tmp_path, [], {"profile": {"name": "cpu-full"}})
    with pytest.raises(ProfileError, match="cpu-full"):
        sweep.run_sweep(PROFILES["cpu-quick"], tmp_path, ignore_budget=True)


def test_base_url_needs_exactly_one_mode(tmp_path):
    with pytest.raises(ProfileError, match="exactly one --mode"):
        sweep.run_sweep(PROFILES["cpu-quick"], tmp_path, base_url="http://x:8000")


# --------------------------------------------------------------------------- the vLLM client seam


def test_load_arguments_are_ones_vllms_benchmark_accepts(tmp_path):
    from bench.client import Load, parse_args

    load = Load("http://h:8000/", "/tok", 512, 0.5, 6, 64, model="m", result_path=tmp_path / "r.json")
    args = parse_args(load.argv())
    assert (args.backend, args.base_url, args.endpoint) == ("openai", "http://h:8000", "/v1/completions")
    assert (args.dataset_name, args.random_input_len, args.random_output_len) == ("random", 512, 64)
    assert (args.num_prompts, args.request_rate, args.ignore_eos, args.temperature) == (6, 0.5, True, 0.0)
    assert args.metric_percentiles == "50,90,99" and args.percentile_metrics == "ttft,tpot,itl,e2el"
    assert args.save_result and args.result_dir == str(tmp_path) and args.result_filename == "r.json"
    assert args.num_warmups == 0 and args.model == "m" and args.tokenizer == "/tok"
    chat = parse_args(dataclasses.replace(load, backend="openai-chat", result_path=None).argv())
    assert chat.endpoint == "/v1/chat/completions" and not chat.save_result


# --------------------------------------------------------------------------- multi-turn


def test_this_build_has_conversation_reuse():
    assert conversation_reuse_available() is True
    assert "not available" in NOT_AVAILABLE


def test_conversation_reuse_is_detected_from_the_app_args():
    from pydantic import BaseModel

    class WithConversations(BaseModel):
        model: str = "m"
        conversations: dict = {}

    assert conversation_reuse_available(WithConversations) is True


def test_multiturn_summary_and_report(tmp_path):
    results = []
    for arm, cost in (("no-reuse", 100.0), ("reuse", 30.0)):
        for c in range(3):
            for turn in (1, 2, 3, 4):
                ttft = 100.0 if turn == 1 else cost * turn
                results.append(TurnResult(arm, c, turn, 500 * turn, ttft, ttft + 500, ok=True))
    results.append(TurnResult("reuse", 3, 1, None, None, None, ok=False, error="boom"))
    rows = summarize(results)
    turn4 = {r["arm"]: r for r in rows if r["turn"] == 4}
    assert turn4["no-reuse"]["ttft_p50_ms"] == 400 and turn4["reuse"]["ttft_p50_ms"] == 120
    assert turn4["reuse"]["prompt_tokens_mean"] == 2000
    assert [r["failed"] for r in rows if r["arm"] == "reuse" and r["turn"] == 1] == [1]
    assert speedups(rows)[4] == pytest.approx(400 / 120)
    paths = write_report(tmp_path, results, rows, {"conversation_reuse_available": True})
    assert [p.name for p in paths] == ["multiturn.json", "multiturn.csv", "multiturn_ttft.png"]
    assert paths[2].read_bytes().startswith(PNG_MAGIC)
    assert json.loads(paths[0].read_text())["speedup_no_reuse_over_reuse"]["4"] == pytest.approx(400 / 120)


def test_multiturn_baseline_only_has_no_speedup():
    rows = summarize([TurnResult("no-reuse", 0, t, 10, 5.0, 9.0, ok=True) for t in (1, 2)])
    assert speedups(rows) == {} and {r["arm"] for r in rows} == {"no-reuse"}


def test_user_text_has_about_the_asked_tokens():
    class Tok:
        vocab_size = 5000

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(f"w{i}" for i in ids)

    text = user_text(Tok(), 50, random.Random(0))
    assert len(text.split()) == 50
    assert text == user_text(Tok(), 50, random.Random(0))


# --------------------------------------------------------------------------- layering


@pytest.mark.parametrize("rel", ["bench/results.py", "bench/profiles.py", "bench/engine_metrics.py", "bench/__init__.py"])
def test_bench_core_modules_import_no_heavy_package(rel):
    bad = [str(i) for i in imports_of(rel) if i.top in HEAVY]
    assert not bad, f"{rel} must stay light: " + "; ".join(bad)


def test_run_arm_grows_the_history_and_sends_conversation_id_only_when_reusing():
    import httpx

    from bench.multiturn import run_arm

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        n = len(body["messages"])
        events = [
            {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"delta": {"content": f"answer{n}"}}]},
            {"choices": [], "usage": {"prompt_tokens": 100 * n, "completion_tokens": 1}},
        ]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    class Tok:
        vocab_size = 1000

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    http = httpx.Client(base_url="http://app", transport=httpx.MockTransport(handler))
    plain = run_arm(http, Tok(), "m", "no-reuse", conversations=1, turns=3, turn_tokens=5, output_len=4)
    reused = run_arm(http, Tok(), "m", "reuse", conversations=1, turns=3, turn_tokens=5, output_len=4)
    assert [len(b["messages"]) for b in seen] == [1, 3, 5] * 2
    assert seen[2]["messages"][1] == {"role": "assistant", "content": "answer1"}
    assert [b["messages"][0] for b in seen[:3]] == [b["messages"][0] for b in seen[3:]]  # same conversations
    assert all("conversation_id" not in b for b in seen[:3])
    assert len({b["conversation_id"] for b in seen[3:]}) == 1
    assert all(r.ok and r.ttft_ms is not None for r in plain + reused)
    assert [r.prompt_tokens for r in plain] == [100, 300, 500]
    assert seen[0]["max_tokens"] == 4 and seen[0]["stream"] is True


def test_run_arm_stops_a_conversation_at_an_error():
    import httpx

    from bench.multiturn import run_arm

    http = httpx.Client(base_url="http://app", transport=httpx.MockTransport(lambda r: httpx.Response(400, text="bad")))

    class Tok:
        vocab_size = 1000

        def decode(self, ids, skip_special_tokens=True):
            return "x"

    results = run_arm(http, Tok(), "m", "no-reuse", conversations=2, turns=3, turn_tokens=5, output_len=4)
    assert [(r.conversation, r.turn, r.ok) for r in results] == [(0, 1, False), (1, 1, False)]
    assert "HTTP 400" in results[0].error


# --------------------------------------------------------------------------- soak: how a request ended


@pytest.mark.parametrize(
    "status, body, stream, outcome",
    [
        (200, {"choices": [{"message": {"content": "hi"}}]}, False, "ok"),
        (429, {"error": {"message": "busy"}}, False, "rejected"),
        (503, {"error": {"message": "no replica"}}, False, "error"),
        (502, "<html>bad gateway</html>", False, "lost"),  # not an OpenAI error: a client cannot act on it
        (200, 'data: {"choices": []}\n\ndata: [DONE]\n\n', True, "ok"),
        (200, 'data: {"choices": []}\n\ndata: {"error": {"code": 503}}\n\ndata: [DONE]\n\n', True, "error"),
        (200, 'data: {"choices": []}\n\n', True, "lost"),  # cut: no [DONE]
    ],
)
def test_soak_classifies_how_each_request_ended(status, body, stream, outcome):
    import random

    import httpx

    from bench.soak import one_request

    def handler(request):
        content = body if isinstance(body, str) else json.dumps(body)
        return httpx.Response(status, content=content.encode())

    rng = random.Random(1 if stream else 0)
    http = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://app")
    for _ in range(50):  # until the random kind is streamed (or not) as this case needs
        kind, got, _ = one_request(http, rng, "m", {"id": "c", "messages": []})
        if (kind == "completion-stream") == stream:
            break
    assert (kind == "completion-stream") == stream and got == outcome


def test_skew_load_alternates_long_and_short_with_poisson_gaps():
    from bench.skew import SkewLoad, _requests

    plan = _requests(SkewLoad(requests=6, rate=2.0, short_tokens=3, long_tokens=9), "m")
    assert [kind for _, kind, _ in plan] == ["long", "short"] * 3
    assert [body["max_tokens"] for _, _, body in plan] == [9, 3] * 3
    assert all(body["ignore_eos"] and body["stream"] and body["temperature"] == 0 for _, _, body in plan)
    times = [at for at, _, _ in plan]
    assert times[0] == 0 and times == sorted(times) and len(set(times)) == 6
    assert _requests(SkewLoad(requests=6), "m") == _requests(SkewLoad(requests=6), "m")  # same seed, same load


def test_skew_report_table_and_percentiles():
    from bench.skew import Placement, percentiles, table

    assert percentiles([]) == {}
    assert percentiles([float(v) for v in range(1, 101)]) == {"p50": 51.0, "p90": 90.0, "p99": 99.0}
    p = Placement("round_robin", ttft_ms={"short": {"p50": 1, "p90": 2, "p99": 3}, "long": {}}, tpot_ms={"short": {}, "long": {}})
    lines = table([p]).splitlines()
    assert lines[0].startswith("| placement") and "| round_robin | short | 1 / 2 / 3 |" in lines[2]


def test_skew_sets_the_decode_router_of_the_config(tmp_path):
    from app.config.args import DecodeRouter
    from bench.skew import PLACEMENTS, _config_with

    assert set(PLACEMENTS) == {r.value for r in DecodeRouter}
    derived = _config_with("configs/local-cpu-1p2d.yaml", "round_robin", tmp_path)
    assert app_args_of(load_config(derived)).routing.decode_router is DecodeRouter.ROUND_ROBIN


def test_openloop_sends_unique_bodies_at_poisson_arrivals_and_records_every_answer():
    import asyncio

    from aiohttp import web

    from bench.openloop import body_for, offer

    assert body_for({"prompt": "Note {i} says", "n": ["{i}"], "max_tokens": 4}, 7) == {"prompt": "Note 7 says", "n": ["7"], "max_tokens": 4}
    seen = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((await request.json())["prompt"])
        if len(seen) % 2:
            return web.json_response({"ok": len(seen)})
        return web.Response(status=429, headers={"retry-after": "1"}, text="busy")

    async def run():
        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await offer(f"http://127.0.0.1:{port}", "/v1/completions", {"prompt": "p{i}"}, rate=200, seconds=0.2,
                               seed=3, first_index=10)
        finally:
            await runner.cleanup()

    outcomes = asyncio.run(run())
    assert 10 <= len(outcomes) <= 90  # ~40 expected
    assert [o.index for o in outcomes] == list(range(10, 10 + len(outcomes)))
    assert sorted(seen) == sorted(f"p{o.index}" for o in outcomes)
    assert {o.status for o in outcomes} == {200, 429}
    assert all(o.retry_after == "1" and o.response == "busy" for o in outcomes if o.status == 429)
    assert all(isinstance(o.response, dict) for o in outcomes if o.status == 200)
    assert all(o.latency_s >= 0 for o in outcomes)
    assert [o.sent_s for o in outcomes] == sorted(o.sent_s for o in outcomes) and outcomes[-1].sent_s < 0.5


def test_openloop_records_how_long_its_own_loop_was_stalled():
    """A request that was out while the client's loop was blocked is charged the stall, one sent
    after it is not (so a slow client is not read as a slow server)."""
    import asyncio
    import time

    from bench.openloop import StallClock

    async def run():
        stalls = StallClock()
        clock = asyncio.create_task(stalls.run())
        before = time.monotonic()
        await asyncio.sleep(0.2)
        time.sleep(0.5)  # the loop is blocked, as when the process is not scheduled
        await asyncio.sleep(0.1)
        after = time.monotonic()
        await asyncio.sleep(0.2)
        clock.cancel()
        return stalls.worst_since(before), stalls.worst_since(after)

    during, later = asyncio.run(run())
    assert 0.4 < during < 0.6 and later == 0.0, (during, later)


def test_timeline_report_from_log_lines(tmp_path):
    """bench timeline: timelines read back from an app log, matched by response id, medians
    per mode and kind, and the files it writes."""
    from app.request.timeline import RequestTimeline
    from bench.timeline import Sample, TimelineLoad, _engine_id, _schedule, medians, read_timelines, table, write_report

    remote = {"arrived": 0.0, "decode_received": 0.01, "legs_sent": 0.02, "prefill_queued": 0.03,
              "prefill_started": 0.05, "prefill_finished": 2.05, "first_token": 2.25, "first_chunk": 2.26}
    lines = [
        "(ServeReplica:rendezvous:OpenAiIngress pid=1) INFO -- "
        + RequestTimeline(f"rdv-{i}", "push", "remote", True, {k: v + i for k, v in remote.items()}).to_log_line()
        for i in range(3)
    ]
    log = tmp_path / "app.log"
    log.write_text("\n".join(["noise", *lines, "more noise"]))
    timelines = read_timelines(log)
    assert sorted(timelines) == ["rdv-0", "rdv-1", "rdv-2"]
    assert _engine_id("cmpl-rdv-1") == "rdv-1" and _engine_id(None) is None
    samples = [Sample("push", "long", 2.3, timelines[f"rdv-{i}"]) for i in range(3)] + [Sample("push", "short_alone", None, None)]
    m = medians(samples)[("push", "long")]
    assert m["prefill_compute"] == pytest.approx(2.0) and m["handoff"] == pytest.approx(0.2)
    assert "| push | long |" in table(samples)
    write_report(samples, tmp_path)
    assert (tmp_path / "waterfall.png").stat().st_size > 1000
    assert "prefill_compute" in (tmp_path / "timeline.csv").read_text()
    plan = _schedule(TimelineLoad(cycles=2), "m")
    assert [kind for _, kind, _ in plan] == ["long", "short_during", "short_alone"] * 2
    assert [at for at, _, _ in plan] == sorted(at for at, _, _ in plan)


def test_overload_counts_goodput_as_complete_answers_within_the_slo_that_the_client_still_waited_for():
    from bench.overload import Outcome, OverloadLoad, summarize

    load = OverloadLoad(slo_s=10.0, seconds=20.0)

    def outcome(status, ttft, latency, abandoned=False):
        return Outcome("adaptive", 2.0, 0, 0.0, status, ttft, latency, abandoned, None)

    row = summarize([
        outcome(200, 2.0, 6.0), outcome(200, 9.0, 14.0),  # good
        outcome(200, 12.0, 16.0),  # answered, but its first byte missed the SLO
        outcome(200, 25.0, 30.0, abandoned=True),  # the client gave up mid-stream: 30 s the server spent for nobody
        outcome(0, None, 30.0, abandoned=True),  # given up on before any answer: not an error of the server
        outcome(429, None, 0.05), outcome(429, None, 0.2), outcome(503, None, 20.0),
    ], load)
    assert row["goodput_rps"] == 2 / 20.0 and row["answered"] == 3 and row["abandoned_in_flight_s"] == 60.0
    assert row["answered_in_time"] == 2
    assert (row["rejected_429"], row["rejection_p99_s"], row["expired_503"]) == (2, 0.2, 1)
    assert (row["ttft_p50_s"], row["ttft_p99_s"], row["other_status"]) == (12.0, 25.0, [])


def test_overload_arms_differ_only_in_admission(tmp_path):
    from bench.overload import OverloadLoad, _arm_config

    from app.config.args import AppArgs

    load = OverloadLoad(slo_s=7.0, queue_deadline_s=14.0)
    configs = [yaml.safe_load(Path(_arm_config("configs/local-cpu.yaml", arm, load, tmp_path)).read_text())
               for arm in ("fixed", "adaptive", "whole", "as-is")]
    ingress = [AppArgs.model_validate(c["applications"][0]["args"]).ingress for c in configs]
    assert (ingress[0].ttft_slo_s, ingress[0].queue_deadline_s) == (None, None)
    assert (ingress[1].ttft_slo_s, ingress[1].queue_deadline_s) == (7.0, 14.0)
    assert ingress[2] == ingress[1], "the whole-answer arm runs the adaptive arm's app"
    assert ingress[3] == AppArgs.model_validate(load_config("configs/local-cpu.yaml")["applications"][0]["args"]).ingress
    assert ingress[0].max_in_flight == ingress[1].max_in_flight


def test_the_whole_answer_arm_is_not_streamed_and_its_client_waits_only_the_slo():
    import random

    from bench.overload import OverloadLoad, _body, _patience_s

    load = OverloadLoad(slo_s=7.0, client_timeout_s=30.0)
    assert _body("m", load, random.Random(0), 1, stream=False)["stream"] is False
    assert (_patience_s(load, "whole"), _patience_s(load, "adaptive")) == (7.0, 30.0)
