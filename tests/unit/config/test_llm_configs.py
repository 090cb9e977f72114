"""llm_config(): AppArgs -> the two Ray Serve LLM ``LLMConfig`` dicts (no Ray started)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from ray.llm._internal.common.callbacks.base import CallbackConfig
from ray.llm._internal.common.utils.import_utils import load_class
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

from app.config.args import Accelerator, AppArgs
from app.config.llm_configs import CPU_DEFAULT_ENV, HEAD_NODE_RESOURCE, ingress_actor_options, kv_transfer_config, llm_config
from connector.engine_env import SETTINGS_KEY, EngineSettings, engine_env
from connector.params import CONNECTOR_CLASS, CONNECTOR_MODULE, TransferMode
from connector.ports import PortPlan, Role

REPO = Path(__file__).resolve().parents[3]
SOURCE = "/models/SmolLM2-135M-Instruct-v1"

CPU_RAW = {
    "model": {"id": "my-model", "source": "embedded"},
    "engine_kwargs": {"max_model_len": 4096, "enforce_eager": True},
    "prefill": {
        "replicas": 2,
        "cpus": 1.5,
        "max_ongoing_requests": 7,
        "engine_kwargs": {"max_model_len": 2048},
        "env": {"VLLM_CPU_KVCACHE_SPACE": "4", "UCX_TLS": "tcp"},
    },
    "decode": {"replicas": 3, "cpus": 0.25, "max_ongoing_requests": 9},
    "nixl": {
        "backends": ["UCX", "LIBFABRIC"],
        "prefill_port_base": 30000,
        "decode_port_base": 40000,
        "extra_config": {"kv_lease_duration": 60, "push_registration_timeout": 5},
    },
}
CPU_ARGS = AppArgs.parse(CPU_RAW)

GPU_ARGS = AppArgs.parse(
    {
        "accelerator": "gpu",
        "engine_kwargs": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
        "prefill": {"gpus": 1, "cpus": 2},
        "decode": {"gpus": 1, "cpus": 1, "engine_kwargs": {"pipeline_parallel_size": 1}},
    }
)


def cfg(role: Role, args: AppArgs = CPU_ARGS) -> dict:
    return llm_config(args, role, SOURCE)


# --------------------------------------------------------------------------- cpu


@pytest.mark.parametrize("role", list(Role))
def test_cpu_hardware_is_one_cpu_bundle_and_no_actor_cpus(role):
    config = cfg(role)
    assert config["accelerator_config"] == {"kind": "cpu"}
    assert config["placement_group_config"] == {"bundles": [{"CPU": CPU_ARGS.role(role).cpus}]}
    # The bundle holds the replica's CPUs; the actor itself asks for none.
    assert config["deployment_config"]["ray_actor_options"] == {"num_cpus": 0}


@pytest.mark.parametrize("role, replicas, max_ongoing", [(Role.PREFILL, 2, 7), (Role.DECODE, 3, 9)])
def test_deployment_config_comes_from_the_role(role, replicas, max_ongoing):
    deployment = cfg(role)["deployment_config"]
    assert deployment["num_replicas"] == replicas
    assert deployment["max_ongoing_requests"] == max_ongoing


@pytest.mark.parametrize("role", list(Role))
def test_model_loading_config(role):
    assert cfg(role)["model_loading_config"] == {"model_id": "my-model", "model_source": SOURCE}


@pytest.mark.parametrize(
    "role, expected",
    [
        (Role.PREFILL, {"max_model_len": 2048, "enforce_eager": True}),
        # Conversations (on by default) are retained in decode's prefix cache.
        (Role.DECODE, {"max_model_len": 4096, "enforce_eager": True, "enable_prefix_caching": True}),
    ],
)
def test_engine_kwargs_are_the_merged_user_kwargs_plus_kv_transfer_config(role, expected):
    engine_kwargs = cfg(role)["engine_kwargs"]
    assert {k: v for k, v in engine_kwargs.items() if k != "kv_transfer_config"} == expected
    assert engine_kwargs["kv_transfer_config"] == kv_transfer_config(CPU_ARGS, role)


@pytest.mark.parametrize(
    "mode, role, kv_role",
    [
        ("push", Role.PREFILL, "kv_producer"),
        ("push", Role.DECODE, "kv_consumer"),
        ("pull", Role.PREFILL, "kv_producer"),
        ("pull", Role.DECODE, "kv_consumer"),
    ],
)
def test_kv_transfer_config_names_our_connector(mode, role, kv_role):
    args = AppArgs.parse({**CPU_RAW, "mode": mode})
    ktc = cfg(role, args)["engine_kwargs"]["kv_transfer_config"]
    assert ktc["kv_connector"] == CONNECTOR_CLASS[TransferMode(mode)]
    assert ktc["kv_connector"] == {"push": "RendezvousPushConnector", "pull": "RendezvousPullConnector"}[mode]
    assert ktc["kv_connector_module_path"] == CONNECTOR_MODULE == "connector.vllm_connectors"
    assert ktc["kv_role"] == kv_role
    assert ktc["kv_buffer_device"] == "cpu"
    extra = ktc["kv_connector_extra_config"]
    assert extra["backends"] == ["UCX", "LIBFABRIC"]
    assert extra["kv_lease_duration"] == 60 and extra["push_registration_timeout"] == 5
    # Both modes: both roles sum or check the KV they move (connector.kv_checksum, connector.pull_checksum),
    # unless the config says not to.
    assert extra["rendezvous_kv_checksums"] is True
    off = AppArgs.parse({**CPU_RAW, "mode": mode, "handoff": {"kv_checksums": False}})
    assert cfg(role, off)["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"][
        "rendezvous_kv_checksums"] is False
    # Our engine-id is set per replica by the Ray backend, never here.
    assert "engine_id" not in ktc


def test_pull_engines_know_the_other_roles_tp_size_to_sum_in_its_chunks():
    """A pull sender sums each block in as many chunks as the reader's TP has ranks a block
    (connector.sum_ranks); decode is picked late, so the size comes from the config, not the request."""
    args = AppArgs.parse({**CPU_RAW, "mode": "pull", "decode": {**CPU_RAW.get("decode", {}),
                                                              "engine_kwargs": {"tensor_parallel_size": 3}}})
    peer = {role: cfg(role, args)["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"][
        "rendezvous_kv_peer_tp_size"] for role in Role}
    assert peer == {Role.PREFILL: 3, Role.DECODE: 1}


@pytest.mark.parametrize("pull_history, bidirectional", [("recompute", False), ("upstream", True)])
def test_pull_history_upstream_turns_on_vllms_read_back_with_our_retention(pull_history, bidirectional):
    conversations = {"pull_history": pull_history, "retention_s": 90, "recompute_threshold": 32}
    args = AppArgs.parse({**CPU_RAW, "mode": "pull", "conversations": conversations})
    for role in Role:
        extra = cfg(role, args)["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]
        assert extra.get("bidirectional_kv_xfer", False) is bidirectional
        if bidirectional:
            assert (extra["decoder_kv_blocks_ttl"], extra["kv_recompute_threshold"]) == (90, 32)


def test_each_config_gets_its_own_kv_transfer_config():
    """The Ray backend writes engine_id into kv_transfer_config in place: no sharing."""
    prefill, decode = cfg(Role.PREFILL), cfg(Role.DECODE)
    prefill["engine_kwargs"]["kv_transfer_config"]["engine_id"] = "p"
    prefill["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]["backends"].append("X")
    assert "engine_id" not in decode["engine_kwargs"]["kv_transfer_config"]
    assert "engine_id" not in cfg(Role.PREFILL)["engine_kwargs"]["kv_transfer_config"]
    assert CPU_ARGS.nixl.backends == ["UCX", "LIBFABRIC"]
    assert "kv_transfer_config" not in CPU_ARGS.engine_kwargs_for(Role.PREFILL)


@pytest.mark.parametrize("role", list(Role))
def test_engine_settings_round_trip(role):
    raw = cfg(role)["experimental_configs"][SETTINGS_KEY]
    assert SETTINGS_KEY == "rendezvous"
    # It travels through Serve's config: plain JSON.
    assert json.loads(json.dumps(raw)) == raw
    settings = EngineSettings.from_dict(raw)
    assert settings.role is role
    assert settings.ports == PortPlan(prefill_base=30000, decode_base=40000)
    assert settings.ports.port(role, 1) == {Role.PREFILL: 30001, Role.DECODE: 40001}[role]
    assert EngineSettings.from_dict(settings.to_dict()) == settings


def test_cpu_default_env_is_present_and_user_env_wins():
    prefill_env = EngineSettings.from_dict(cfg(Role.PREFILL)["experimental_configs"][SETTINGS_KEY]).env
    decode_env = EngineSettings.from_dict(cfg(Role.DECODE)["experimental_configs"][SETTINGS_KEY]).env
    assert decode_env == CPU_DEFAULT_ENV
    assert set(CPU_DEFAULT_ENV) == {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"}
    assert prefill_env == {**CPU_DEFAULT_ENV, "VLLM_CPU_KVCACHE_SPACE": "4", "UCX_TLS": "tcp"}
    assert CPU_DEFAULT_ENV["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the default itself is untouched


@pytest.mark.parametrize("role", list(Role))
def test_engine_metrics_are_logged(role):
    assert cfg(role)["log_engine_metrics"] is True


# --------------------------------------------------------------------------- gpu


@pytest.mark.parametrize(
    "role, workers, bundle",
    [
        (Role.PREFILL, 4, {"GPU": 1, "CPU": 2.0}),  # TP 2 x PP 2
        (Role.DECODE, 2, {"GPU": 1, "CPU": 1.0}),  # TP 2 x PP 1 (role override)
    ],
)
def test_gpu_gets_one_bundle_per_worker(role, workers, bundle):
    config = cfg(role, GPU_ARGS)
    assert config["placement_group_config"]["bundles"] == [bundle] * workers
    assert "accelerator_config" not in config
    assert config["engine_kwargs"]["kv_transfer_config"]["kv_buffer_device"] == "cuda"
    assert config["deployment_config"]["ray_actor_options"] == {"num_cpus": 0}


def test_gpu_single_worker_and_gpus_per_worker():
    args = AppArgs.parse({"accelerator": "gpu", "prefill": {"gpus": 2}, "decode": {"gpus": 1}})
    assert cfg(Role.PREFILL, args)["placement_group_config"]["bundles"] == [{"GPU": 2, "CPU": 0.5}]
    assert cfg(Role.DECODE, args)["placement_group_config"]["bundles"] == [{"GPU": 1, "CPU": 0.5}]


def test_gpu_env_has_no_cpu_defaults():
    args = AppArgs.parse({"accelerator": "gpu", "prefill": {"gpus": 1, "env": {"FI_PROVIDER": "efa"}}, "decode": {"gpus": 1}})
    prefill = EngineSettings.from_dict(cfg(Role.PREFILL, args)["experimental_configs"][SETTINGS_KEY])
    decode = EngineSettings.from_dict(cfg(Role.DECODE, args)["experimental_configs"][SETTINGS_KEY])
    assert dict(prefill.env) == {"FI_PROVIDER": "efa"}
    assert dict(decode.env) == {}


# --------------------------------------------------------------------------- Ray accepts them


def _config_file_args() -> list:
    return [
        pytest.param(yaml.safe_load(path.read_text())["applications"][0].get("args") or {}, id=path.name)
        for path in sorted((REPO / "configs").glob("*.yaml"))
    ]


@pytest.mark.parametrize(
    "args",
    [CPU_ARGS, AppArgs.parse({}), AppArgs.parse({"mode": "pull"}), GPU_ARGS],
    ids=["cpu-custom", "cpu-defaults", "cpu-pull", "gpu-tp2-pp2"],
)
@pytest.mark.parametrize("role", list(Role))
def test_ray_llmconfig_accepts_the_dicts(args, role):
    raw = cfg(role, args)
    config = LLMConfig.model_validate(raw)
    assert config.model_id == args.model.id
    assert config.engine_kwargs["kv_transfer_config"] == raw["engine_kwargs"]["kv_transfer_config"]
    assert config.experimental_configs[SETTINGS_KEY] == raw["experimental_configs"][SETTINGS_KEY]
    assert config.deployment_config["num_replicas"] == args.role(role).replicas
    assert config.placement_group_config == raw["placement_group_config"]
    # Ray's engine config sees the same number of devices we reserved bundles for.
    engine_config = config.get_engine_config()
    assert len(engine_config.placement_bundles) == len(raw["placement_group_config"]["bundles"])


@pytest.mark.parametrize("raw", _config_file_args())
def test_shipped_configs_give_configs_ray_accepts(raw):
    args = AppArgs.parse(raw)
    for role in Role:
        config = LLMConfig.model_validate(cfg(role, args))
        if args.accelerator is Accelerator.CPU:
            assert config.accelerator_config.kind == "cpu"
        assert config.engine_kwargs["kv_transfer_config"]["kv_connector"] == CONNECTOR_CLASS[args.mode]


# --------------------------------------------------------------------------- engine_env


@pytest.mark.parametrize(
    "user_env",
    [
        {"VLLM_NIXL_SIDE_CHANNEL_HOST": "0.0.0.0", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"},
        {"VLLM_NIXL_SIDE_CHANNEL_PORT": "1"},
        {},
    ],
)
def test_side_channel_address_cannot_be_overridden(user_env):
    env = engine_env(side_channel_host="10.0.0.7", side_channel_port=20003, user_env=user_env)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.7"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "20003"


@pytest.mark.parametrize(
    "user_env, kv_buffer_device, ucx_tls",
    [
        ({}, "cpu", "tcp,shm,self"),
        ({"UCX_TLS": "rc,cuda_copy"}, "cpu", "rc,cuda_copy"),
        # KV in GPU memory: no host-only default (it would fail to register the KV, or copy it through TCP);
        # UCX picks, CUDA transports included, unless the config says (and app.config.args checks what it says).
        ({}, "cuda", None),
        ({"UCX_TLS": "rc,cuda_copy,cuda_ipc"}, "cuda", "rc,cuda_copy,cuda_ipc"),
    ],
)
def test_ucx_tls_default_fits_where_the_kv_lives_and_users_may_override(user_env, kv_buffer_device, ucx_tls):
    env = engine_env(side_channel_host="h", side_channel_port=20000, user_env=user_env, kv_buffer_device=kv_buffer_device)
    assert env.get("UCX_TLS") == ucx_tls


@pytest.mark.parametrize("ucx_tls, refused", [
    ("tcp,shm,self", "has no CUDA transport"),
    ("rc,sm", "has no CUDA transport"),
    ("^cuda_ipc", "excludes cuda_ipc"),
    ("rc,cuda_copy,cuda_ipc,gdr_copy", None),
    ("all", None),
    ("^tcp", None),
])
def test_a_gpu_config_whose_ucx_cannot_move_gpu_memory_is_refused_at_startup(ucx_tls, refused):
    raw = {"accelerator": "gpu", "prefill": {"gpus": 1, "env": {"UCX_TLS": ucx_tls}}, "decode": {"gpus": 1}}
    if refused is None:
        AppArgs.parse(raw)
        return
    with pytest.raises(ValueError, match=refused) as err:
        AppArgs.parse(raw)
    assert "prefill.env: UCX_TLS=" in str(err.value)
    AppArgs.parse({**raw, "nixl": {"backends": ["LIBFABRIC"]}})  # UCX_TLS means nothing to LIBFABRIC
    AppArgs.parse({**raw, "accelerator": "cpu", "prefill": {"env": {"UCX_TLS": ucx_tls}}, "decode": {}})


def test_engine_env_defaults_and_pass_through():
    user_env = {"FI_PROVIDER": "efa", **CPU_DEFAULT_ENV}
    before = dict(user_env)
    env = engine_env(side_channel_host="h", side_channel_port=20000, user_env=user_env)
    assert env["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] == "1"
    assert env["FI_PROVIDER"] == "efa"
    assert {k: env[k] for k in CPU_DEFAULT_ENV} == CPU_DEFAULT_ENV
    assert all(isinstance(v, str) for v in env.values())  # os.environ takes strings only
    assert user_env == before  # not mutated


def test_the_ingress_goes_to_the_head_node_unless_told_otherwise():
    """An ingress on an engine's node would die with that node (tests/integration/test_cluster.py
    loses the decode node mid-stream). The head's resource is Ray's; the name here must be it."""
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME

    assert HEAD_NODE_RESOURCE == HEAD_NODE_RESOURCE_NAME
    assert ingress_actor_options(AppArgs.parse({}).ingress) == {"num_cpus": 0.1, "resources": {HEAD_NODE_RESOURCE: 0.001}}
    assert ingress_actor_options(AppArgs.parse({"ingress": {"on_head": False, "cpus": 0.5}}).ingress) == {"num_cpus": 0.5}
    # Or on the nodes that offer a resource of its own (a CPU worker group: off the head and the engine nodes).
    own = AppArgs.parse({"ingress": {"on_head": False, "resources": {"ingress": 0.01}}}).ingress
    assert ingress_actor_options(own) == {"num_cpus": 0.1, "resources": {"ingress": 0.01}}
    with pytest.raises(ValueError, match="set on_head: false"):
        AppArgs.parse({"ingress": {"resources": {"ingress": 0.01}}})


# --------------------------------------------------------------------------- node initialization


@pytest.mark.parametrize(
    "source, downloads",
    [
        (SOURCE, False),  # a local directory: the embedded model's conversion, or the user's own
        ("HuggingFaceTB/SmolLM2-135M-Instruct", False),  # a hub id: vLLM downloads it itself
        ("s3://bucket/models/smollm2", True),  # Ray's mirror download: its node tasks must run
        ("gs://bucket/models/smollm2", True),
    ],
)
@pytest.mark.parametrize("role", list(Role))
def test_node_initialization_runs_only_where_ray_would_download_the_model(source, downloads, role):
    """app.replica.node_init: Ray Serve LLM's per-node tasks (a vLLM import each) run only for a cloud mirror."""
    config = LLMConfig.model_validate(llm_config(CPU_ARGS, role, source))
    assert isinstance(config.callback_config, CallbackConfig)
    callback = load_class(config.callback_config.callback_class)(llm_config=config)
    asyncio.run(callback.run_callback("on_before_node_init"))
    assert callback.ctx.run_init_node is downloads
