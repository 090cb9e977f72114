"""Every configs/*.yaml, checked against the real parsers it meets on a cluster (no Ray started).

* Ray Serve's ``ServeDeploySchema`` (what ``serve run`` and KubeRay's serveConfigV2 go through)
  and our ``AppArgs``;
* vLLM 0.29's own engine-argument parser: every engine kwarg (shared and per role) is a field of
  ``AsyncEngineArgs`` (Ray Serve LLM calls ``AsyncEngineArgs(**engine_kwargs)``) and an option of
  its CLI parser, and its value parses back to itself; the kv_transfer_config we build is a valid
  ``KVTransferConfig``; every ``VLLM_*`` variable in a role's env is one vLLM knows, with a valid value;
* the installed NIXL offers every backend a config names;
* the whole Serve application builds (``app.builder.build_app``) into the deployments we meant.

``check_serve_config`` is reused by tests/unit/test_k8s.py for the serveConfigV2 embedded in
rendered manifests.
"""

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
from app.config.llm_configs import kv_transfer_config, llm_config
from connector.params import TransferMode
from connector.ports import Role
from deploy.checks import APP_IMPORT_PATH, app_args_of

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


# --------------------------------------------------------------------------- every config file


def test_there_are_configs_for_real_hardware():
    names = {p.name for p in DEPLOY_CONFIGS}
    assert {
        "gpu-p5en-qwen3-32b-push.yaml",
        "gpu-p5en-qwen3-32b-pull.yaml",
        "gpu-xpyd-2p1d.yaml",
        "gpu-multiturn-push.yaml",
        "trn2-qwen3-32b-push.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=config_ids(CONFIG_FILES))
def test_config_passes_every_parser(path, monkeypatch):
    check_serve_config(load(path), monkeypatch)


def test_engine_kwarg_check_is_not_vacuous():
    assert engine_kwarg_problems({"tensor_parallel_size": 8, "enable_prefix_caching": False, "max_model_len": 32768}) == []
    problems = engine_kwarg_problems(
        {"tensor_paralel_size": 8, "dtype": "float64", "enable_prefix_caching": "no", "max_num_seqs": 1.5}
    )
    assert any(p.startswith("tensor_paralel_size: not") for p in problems), problems
    assert any(p.startswith("dtype='float64'") for p in problems), problems
    assert any(p.startswith("enable_prefix_caching='no'") for p in problems), problems
    assert any(p.startswith("max_num_seqs=1.5") for p in problems), problems


def test_vllm_env_check_is_not_vacuous(monkeypatch):
    assert vllm_env_problems({"VLLM_KV_CACHE_LAYOUT": "LBHNC", "FI_PROVIDER": "efa"}, monkeypatch) == []
    problems = vllm_env_problems({"VLLM_KV_CACHE_LAYOUTS": "HND", "VLLM_KV_CACHE_LAYOUT": "sideways"}, monkeypatch)
    assert len(problems) == 2, problems


# --------------------------------------------------------------------------- what the deploy configs promise


@pytest.mark.parametrize("path", DEPLOY_CONFIGS, ids=config_ids(DEPLOY_CONFIGS))
def test_deploy_configs_listen_on_all_interfaces_and_set_real_limits(path):
    config = load(path)
    assert config["http_options"]["host"] == "0.0.0.0" and config["http_options"]["port"] == 8000
    raw = config["applications"][0]["args"]
    args = AppArgs.parse(raw)
    assert args.accelerator in (Accelerator.GPU, Accelerator.NEURON)
    for role in ("prefill", "decode"):
        # Set on purpose, not inherited: Ray's defaults are effectively unlimited.
        assert "max_ongoing_requests" in raw[role], f"{path.name}: {role}.max_ongoing_requests"
        role_args = args.role(Role(role))
        assert role_args.max_ongoing_requests < RAY_UNLIMITED
        if role_args.autoscaling:
            assert role_args.autoscaling.target_ongoing_requests <= role_args.max_ongoing_requests
        assert role_args.resources == {f"{role}_group": 0.01}, "k8s/base offers prefill_group / decode_group"
        # EFA: libfabric's efa provider with device RDMA, fork-safe.
        env = args.role(Role(role)).env
        assert {k: env.get(k) for k in ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE")} == {
            "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"
        }
    assert args.nixl.backends == ["LIBFABRIC"]
    assert args.model.id == "Qwen/Qwen3-32B"


@pytest.mark.parametrize("path", DEPLOY_CONFIGS, ids=config_ids(DEPLOY_CONFIGS))
def test_no_push_config_asks_for_bidirectional_transfer(path):
    """vLLM 0.29's NixlPushConnectorScheduler raises NotImplementedError for it."""
    args = AppArgs.parse(load(path)["applications"][0]["args"])
    if args.mode is TransferMode.PUSH:
        assert not args.nixl.extra_config.get("bidirectional_kv_xfer")


def _args(name: str) -> AppArgs:
    return AppArgs.parse(load(REPO / "configs" / name)["applications"][0]["args"])


def test_p5en_push_and_pull_differ_only_in_mode():
    push = load(REPO / "configs" / "gpu-p5en-qwen3-32b-push.yaml")
    pull = load(REPO / "configs" / "gpu-p5en-qwen3-32b-pull.yaml")
    assert push["applications"][0]["args"].pop("mode") == "push"
    assert pull["applications"][0]["args"].pop("mode") == "pull"
    assert push == pull


@pytest.mark.parametrize("name", ["gpu-p5en-qwen3-32b-push.yaml", "gpu-p5en-qwen3-32b-pull.yaml"])
def test_p5en_benchmark_shape(name):
    args = _args(name)
    assert args.accelerator is Accelerator.GPU
    for role in Role:
        kwargs = args.engine_kwargs_for(role)
        assert kwargs["tensor_parallel_size"] * args.role(role).gpus == 8  # one P5en node per engine
        assert kwargs["enable_prefix_caching"] is False  # AWS's --no-enable-prefix-caching
        assert args.role(role).replicas == 1


def test_2p1d_has_heterogeneous_tp_and_independent_autoscaling():
    args = _args("gpu-xpyd-2p1d.yaml")
    assert args.engine_kwargs_for(Role.PREFILL)["tensor_parallel_size"] == 4
    assert args.engine_kwargs_for(Role.DECODE)["tensor_parallel_size"] == 8
    assert args.prefill.autoscaling.min_replicas == 2 * args.decode.autoscaling.min_replicas
    assert args.prefill.autoscaling != args.decode.autoscaling
    # Hetero TP splits KV heads across ranks: both sides need the same head-major layout.
    assert args.prefill.env["VLLM_KV_CACHE_LAYOUT"] == args.decode.env["VLLM_KV_CACHE_LAYOUT"] == "LBHNC"


def test_multiturn_knobs():
    args = _args("gpu-multiturn-push.yaml")
    assert args.mode is TransferMode.PUSH
    assert args.nixl.extra_config == {}  # upstream's knobs are ours: conversations.*
    assert (args.conversations.enabled, args.conversations.retention_s, args.conversations.recompute_threshold) == (True, 480, 64)
    assert args.engine_kwargs["enable_prefix_caching"] is True


def test_trainium_config(monkeypatch):
    """8 engines of TP 8 per role (tests/unit/test_k8s.py checks that a node holds them); each replica
    actor holds its engine's NeuronCores in the bundle Serve pins it to."""
    args = _args("trn2-qwen3-32b-push.yaml")
    assert args.accelerator is Accelerator.NEURON
    deployments = build_serve_app(args, monkeypatch)
    for role, prefix in ((Role.PREFILL, "Prefill:"), (Role.DECODE, "Decode:")):
        assert args.role(role).gpus == 0
        assert args.role(role).replicas == 8
        assert args.engine_kwargs_for(role)["tensor_parallel_size"] == 8
        config = llm_config(args, role, "Qwen/Qwen3-32B")
        assert config["engine_kwargs"]["kv_transfer_config"]["kv_buffer_device"] == "cpu"
        (deployment,) = [d for name, d in deployments.items() if name.startswith(prefix)]
        replica = deployment._replica_config
        assert replica.ray_actor_options["resources"] == {"neuron_cores": 8}
        (bundle,) = replica.placement_group_bundles
        assert bundle["neuron_cores"] == 8 and bundle["CPU"] == 8 * args.role(role).cpus


@pytest.mark.parametrize(
    "mode, late, decode, expected",
    [
        ("pull", True, {"replicas": 2}, True),
        ("pull", True, {"autoscaling": {"max_replicas": 4}}, True),
        ("pull", True, {"replicas": 1}, False),  # nothing to pick from
        ("pull", False, {"replicas": 2}, False),
        ("push", True, {"replicas": 2}, False),
    ],
)
def test_only_pull_mode_with_decode_replicas_to_pick_from_binds_late(mode, late, decode, expected, monkeypatch):
    args = AppArgs.parse({"mode": mode, "routing": {"pull_late_binding": late}, "decode": decode})
    deployments = build_serve_app(args, monkeypatch)
    (decode,) = [d for name, d in deployments.items() if name.startswith("Decode:")]
    assert decode._replica_config.init_kwargs["late_binding"] is expected
