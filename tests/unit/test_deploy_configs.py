"""Every configs/*.yaml, checked against the real parsers it meets on a cluster (no Ray started).

* Ray Serve's ``ServeDeploySchema`` (what ``serve run`` and KubeRay's serveConfigV2 go through)
  and our ``AppArgs``;
* vLLM 0.29's own engine-argument parser: every engine kwarg (shared and per role) is a field of
  ``AsyncEngineArgs`` (Ray Serve LLM calls ``AsyncEngineArgs(**engine_kwargs)``) and an option of
  its CLI parser, and its value parses back to itself; the kv_transfer_config we build is a valid
  ``KVTransferConfig``; every ``VLLM_*`` variable in a role's env is one vLLM knows, with a valid value;
* the installed NIXL offers every backend a config names;
* the whole Serve application builds (``app.builder.build_app``) into the deployments we meant.

``check_serve_config`` lives in tests/support/deploy.py: tests/unit/test_k8s.py runs it on the
serveConfigV2 embedded in rendered manifests.
"""

from __future__ import annotations

import pytest

from app.config.args import Accelerator, AppArgs
from app.config.llm_configs import llm_config
from connector.params import TransferMode
from connector.ports import Role
from tests.support.deploy import (
    CONFIG_FILES,
    DEPLOY_CONFIGS,
    RAY_UNLIMITED,
    REPO,
    build_serve_app,
    check_serve_config,
    config_ids,
    engine_kwarg_problems,
    load,
    vllm_env_problems,
)


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
