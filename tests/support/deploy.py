"""The configs/*.yaml files and the check every one of them must pass before a cluster sees it
(``check_serve_config``: Ray Serve's schema, our AppArgs, vLLM's own parsers, the installed NIXL, the
built Serve application); used by tests/unit/test_deploy_configs.py on the files and by
tests/unit/test_k8s.py on the serveConfigV2 embedded in rendered manifests. Also the overlays of
``k8s/`` and their rendering, shared by test_k8s.py and tests/unit/deploy/."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from app.config.args import Accelerator, AppArgs
from app.config.llm_configs import kv_transfer_config
from connector.ports import Role
from deploy.checks import APP_IMPORT_PATH, app_args_of
from deploy.render import render

REPO = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted((REPO / "configs").glob("*.yaml"))
# Configs for real hardware (the local-cpu-* ones run on this machine).
DEPLOY_CONFIGS = [p for p in CONFIG_FILES if not p.name.startswith("local-")]
RAY_UNLIMITED = 1e9  # Ray Serve LLM's default max_ongoing / target_ongoing_requests


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def config_ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


# --------------------------------------------------------------------------- vLLM's own parsers


@cache
def vllm_engine_args() -> tuple[set[str], dict[str, argparse.Action], argparse.ArgumentParser]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    return fields, actions, parser


def _argv(name: str, value: Any, action: argparse.Action) -> list[str]:
    option = next(o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-"))
    if isinstance(action, argparse.BooleanOptionalAction):
        return [option if value else "--no-" + option[2:]]
    if action.nargs == 0:  # store_true / store_false
        return [option] if value != action.default else []
    if isinstance(value, dict):
        return [option, json.dumps(value)]
    if isinstance(value, list):
        return [option, *map(str, value)]
    return [option, str(value)]


def engine_kwarg_problems(kwargs: dict[str, Any]) -> list[str]:
    """Names vLLM 0.29 does not take, and values its CLI parser does not parse back to themselves."""
    fields, actions, parser = vllm_engine_args()
    problems = []
    for name, value in kwargs.items():
        if name not in fields or name not in actions:
            problems.append(f"{name}: not an AsyncEngineArgs field and CLI option of vLLM 0.29")
            continue
        argv = _argv(name, value, actions[name])
        try:
            parsed = getattr(parser.parse_args(argv), name)
        except SystemExit:
            problems.append(f"{name}={value!r}: vLLM's parser refuses {argv}")
            continue
        if not isinstance(value, dict) and parsed != value:
            problems.append(f"{name}={value!r}: vLLM's parser reads {argv} as {parsed!r}")
    return problems


def vllm_env_problems(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import vllm.envs as envs

    problems = []
    for name, value in env.items():
        if not name.startswith("VLLM_"):
            continue
        if name not in envs.environment_variables:
            problems.append(f"{name}: not an environment variable vLLM 0.29 reads")
            continue
        with monkeypatch.context() as m:
            m.setenv(name, value)
            try:
                envs.environment_variables[name]()
            except ValueError as e:
                problems.append(f"{name}={value!r}: {e}")
    return problems


@cache
def nixl_plugins() -> frozenset[str]:
    from nixl._api import nixl_agent, nixl_agent_config

    # No backends, no threads, no listener: only asks which plugins this NIXL build has.
    agent = nixl_agent("rendezvous-config-check", nixl_agent_config(enable_prog_thread=False, backends=[]))
    return frozenset(agent.get_plugin_list())


def build_serve_app(args: AppArgs, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Build the Serve application and return its deployments by name, without starting Ray.

    Ray Serve LLM reads the driver's runtime_env while building deployment options, and that
    call alone would start a local Ray instance: hand it an empty one instead.
    """
    import ray
    from ray.serve._private.build_app import build_app as serve_build_app

    import app.builder as builder

    with monkeypatch.context() as m:
        m.setattr(builder, "resolve_model_source", lambda source: source)
        m.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(runtime_env={}))
        logging.disable(logging.INFO)  # Ray Serve LLM logs every deployment's options
        try:
            built = serve_build_app(builder.build_app(args), name="rendezvous")
        finally:
            logging.disable(logging.NOTSET)
    assert not ray.is_initialized()
    return {d.name: d for d in built.deployments}


def check_serve_config(config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> AppArgs:
    """Everything a config must pass before a cluster sees it; returns its AppArgs."""
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    (application,) = config["applications"]
    args = AppArgs.parse(application.get("args"))
    assert AppArgs.parse(schema.applications[0].args) == args

    problems = []
    for role in Role:
        problems += [f"{role.value}: {p}" for p in engine_kwarg_problems(args.engine_kwargs_for(role))]
        problems += [f"{role.value}.env: {p}" for p in vllm_env_problems(dict(args.role(role).env), monkeypatch)]
    assert not problems, "\n".join(problems)

    from vllm.config import KVTransferConfig

    for role in Role:
        ktc = KVTransferConfig(**kv_transfer_config(args, role))
        assert ktc.kv_connector_extra_config["backends"] == args.nixl.backends
    missing = set(args.nixl.backends) - nixl_plugins()
    assert not missing, f"NIXL {sorted(nixl_plugins())} has no backend {sorted(missing)}"

    if application["import_path"] != APP_IMPORT_PATH:
        return args  # another app over the same args (e.g. the aggregated baseline); not built here
    assert app_args_of(config) == args
    deployments = build_serve_app(args, monkeypatch)
    for role, prefix in ((Role.PREFILL, "Prefill:"), (Role.DECODE, "Decode:")):
        role_args = args.role(role)
        (deployment,) = [d for name, d in deployments.items() if name.startswith(prefix)]
        config_ = deployment._deployment_config
        if role_args.autoscaling is None:
            assert config_.num_replicas == role_args.replicas and config_.autoscaling_config is None
        else:
            scaling = config_.autoscaling_config
            assert (scaling.min_replicas, scaling.max_replicas) == (role_args.min_replicas, role_args.max_replicas)
            assert scaling.target_ongoing_requests == role_args.autoscaling.target_ongoing_requests
        assert config_.max_ongoing_requests == role_args.max_ongoing_requests
        bundles = deployment._replica_config.placement_group_bundles
        assert all(bundles[0].get(k) == v for k, v in role_args.resources.items())
        assert not any(k in b for b in bundles[1:] for k in role_args.resources)
        if args.accelerator is not Accelerator.CPU:
            assert deployment._replica_config.placement_group_strategy == "STRICT_PACK"
    return args


# --------------------------------------------------------------------------- k8s/ rendered

OVERLAYS = sorted(p.name for p in (REPO / "k8s" / "overlays").iterdir() if p.is_dir())


@cache
def rendered(overlay: str, config: Path) -> tuple[dict[str, Any], ...]:
    return tuple(render(overlay, config))
