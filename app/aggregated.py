"""The benchmarks' baseline: one plain Ray Serve LLM engine that prefills and decodes.

``import_path: app.aggregated:build_aggregated_app`` (configs/local-cpu-aggregated.yaml).
It reads the same ``args`` as the disaggregated app and runs the *decode* role's settings
(replicas, cpus, env, engine_kwargs on top of the shared ones) with no KV transfer, behind
Ray Serve LLM's stock OpenAI ingress; its server is Ray's own, its streams' first chunk sent at once as the decode
servers send theirs (``app.replica.streaming``). ``mode``, ``prefill``, ``nixl`` and ``routing`` mean
nothing here, so a config that sets them is rejected.
"""

from __future__ import annotations

from typing import Any

from app.config.args import AppArgs
from app.config.llm_configs import ingress_actor_options, llm_config
from connector.engine_env import SETTINGS_KEY, EngineSettings
from connector.ports import Role

IGNORED_KEYS = ("mode", "prefill", "nixl", "routing")
# Ray Serve LLM's server, streaming as the decode servers do (app.replica.streaming): a fair baseline.
AGGREGATED_SERVER = "app.replica.streaming:AggregatedServer"


def aggregated_llm_config(args: AppArgs, model_source: str) -> dict[str, Any]:
    """The decode role's ``LLMConfig`` dict without KV transfer (pure).

    Built from :func:`app.config.llm_configs.llm_config`, so model, engine kwargs, CPU defaults,
    placement and replicas follow the same rules; the engine environment that the
    connector backend would apply goes into ``runtime_env`` instead.
    """
    config = llm_config(args, Role.DECODE, model_source)
    experimental = dict(config.pop("experimental_configs", {}))
    settings = EngineSettings.from_dict(experimental.pop(SETTINGS_KEY))
    # As configured: no KV transfer, and no conversations here to turn the prefix cache on for.
    engine_kwargs = args.engine_kwargs_for(Role.DECODE)
    config = {**config, "engine_kwargs": engine_kwargs, "runtime_env": {"env_vars": dict(settings.env)},
              "server_cls": AGGREGATED_SERVER}
    if experimental:
        config["experimental_configs"] = experimental
    return config


def parse_args(raw: dict[str, Any] | AppArgs | None) -> AppArgs:
    if isinstance(raw, dict):
        ignored = [key for key in IGNORED_KEYS if key in raw]
        if ignored:
            raise ValueError(
                f"invalid aggregated app args: {', '.join(ignored)}: used only by the disaggregated app "
                "(app.builder:build_app); the aggregated engine reads model, accelerator, engine_kwargs, decode, ingress"
            )
    return AppArgs.parse(raw)


def build_aggregated_app(args: dict[str, Any] | AppArgs | None = None):
    from ray.serve.llm import build_openai_app

    from app.model_source import resolve_model_source

    app_args = parse_args(args)
    source = resolve_model_source(app_args.model.source)
    return build_openai_app(
        {
            "llm_configs": [aggregated_llm_config(app_args, source)],
            "ingress_deployment_config": {
                "num_replicas": app_args.ingress.replicas,
                "max_ongoing_requests": app_args.ingress.max_ongoing_requests,
                "max_surge_percent": app_args.ingress.max_surge_percent,
                "graceful_shutdown_timeout_s": app_args.ingress.graceful_shutdown_timeout_s,
                "ray_actor_options": ingress_actor_options(app_args.ingress),
            },
        }
    )
