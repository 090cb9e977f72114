"""app/aggregated.py: the aggregated baseline the bench compares against is the decode role without
KV transfer (no app, no engines)."""

from __future__ import annotations

import pytest

from app.aggregated import aggregated_llm_config, parse_args
from app.config.llm_configs import CPU_DEFAULT_ENV
from bench.profiles import app_args_of, load_config


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

    validated = LLMConfig.model_validate(llm)
    from app.replica.streaming import AggregatedServer

    assert validated.server_cls is AggregatedServer  # streams as the decode servers do (app.replica.streaming)


def test_aggregated_engine_kwargs_match_the_push_config():
    push = app_args_of(load_config("configs/local-cpu.yaml"))
    aggregated = app_args_of(load_config("configs/local-cpu-aggregated.yaml"))
    assert aggregated.engine_kwargs == push.engine_kwargs
    assert aggregated.model == push.model


@pytest.mark.parametrize("key", ["mode", "prefill", "nixl", "routing"])
def test_aggregated_rejects_disaggregation_keys(key):
    with pytest.raises(ValueError, match=key):
        parse_args({key: {} if key != "mode" else "push"})
