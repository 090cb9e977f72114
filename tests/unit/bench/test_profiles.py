"""bench/profiles.py: the profiles and their budgets, and the checks a profile's configs must pass
(no app, no engines)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from app.tools.procs import base_url_of
from bench.profiles import CHUNK_TOKENS, PROFILES, Mode, ProfileError, app_args_of, check_profile, load_config


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


def test_cpu_link_runs_every_mode_with_the_same_chunks_and_only_progressive_push_streams_them():
    profile = PROFILES["cpu-link"]
    configs = check_profile(profile, profile.modes)
    args = {mode: app_args_of(config) for mode, config in configs.items()}
    assert {m: a.engine_kwargs["max_num_batched_tokens"] for m, a in args.items()} == {m: CHUNK_TOKENS for m in profile.modes}
    assert {m: a.handoff.progressive for m, a in args.items()} == {
        Mode.PUSH_PROGRESSIVE: True, Mode.PUSH: False, Mode.PULL: False, Mode.AGGREGATED: False}
    assert args[Mode.PULL].mode.value == "pull" and args[Mode.PUSH_PROGRESSIVE].mode.value == "push"
    # The disaggregated modes cross the shaped links of the three-node cluster; one engine has no link to cross.
    assert [m for m in profile.modes if profile.on_cluster(m)] == [Mode.PUSH_PROGRESSIVE, Mode.PUSH, Mode.PULL]
    assert load_config(profile.configs[Mode.PUSH]) != configs[Mode.PUSH]  # the file itself is untouched


def test_plain_push_refuses_a_progressive_config(tmp_path):
    path = _write_config(tmp_path, {"mode": "push", "handoff": {"progressive": True},
                                    "engine_kwargs": {"enable_prefix_caching": False}})
    profile = dataclasses.replace(PROFILES["cpu-quick"], configs={Mode.PUSH: path})
    with pytest.raises(ProfileError, match="push-progressive"):
        check_profile(profile, [Mode.PUSH])


@pytest.mark.parametrize("config, dtype_bytes", [("configs/local-cpu.yaml", 4), ("configs/local-cpu-2node.yaml", 4)])
def test_a_prompt_tokens_kv_is_k_and_v_of_every_layer_and_kv_head_of_the_configs_model(config, dtype_bytes):
    """SmolLM2-135M (the embedded model's config.json): 30 layers, 3 KV heads of 64; the local configs run float32."""
    from bench.profiles import kv_bytes_per_token

    assert kv_bytes_per_token(config) == 30 * 2 * 3 * 64 * dtype_bytes
