"""The AppArgs fields for deploying at scale: per-role autoscaling and custom resources, and the
neuron accelerator; and what app.config.llm_configs makes of them (no Ray started)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
from ray.serve._private.config import DeploymentConfig

from app.config.args import (
    RAY_RESOURCE_NAMES,
    Accelerator,
    AppArgs,
    AutoscalingArgs,
    RoleArgs,
    reference_markdown,
)
from app.config.llm_configs import (
    deployment_config,
    kv_transfer_config,
    llm_config,
    placement_group_config,
    replica_actor_resources,
)
from connector.engine_env import SETTINGS_KEY, EngineSettings
from connector.ports import Role

SOURCE = "/models/x"


def parse_error(raw) -> str:
    with pytest.raises(ValueError) as excinfo:
        AppArgs.parse(raw)
    assert not isinstance(excinfo.value, ValidationError)
    return str(excinfo.value)


# --------------------------------------------------------------------------- autoscaling


def test_autoscaling_is_off_by_default_and_replicas_rule():
    args = AppArgs.parse({"prefill": {"replicas": 3}})
    for role in Role:
        assert args.role(role).autoscaling is None
    assert (args.prefill.min_replicas, args.prefill.max_replicas) == (3, 3)
    assert (args.decode.min_replicas, args.decode.max_replicas) == (1, 1)


def test_autoscaling_defaults_are_real_values():
    scaling = AppArgs.parse({"decode": {"autoscaling": {}}}).decode.autoscaling
    assert scaling == AutoscalingArgs()
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 2, 16)
    # Not Ray's "effectively unlimited" defaults.
    assert scaling.target_ongoing_requests <= RoleArgs().max_ongoing_requests < 1e9


@pytest.mark.parametrize(
    "role_raw, min_replicas, max_replicas",
    [
        ({"autoscaling": {"min_replicas": 2, "max_replicas": 4, "target_ongoing_requests": 8}}, 2, 4),
        ({"autoscaling": {"min_replicas": 3, "max_replicas": 3}}, 3, 3),
        ({"autoscaling": {"max_replicas": 10}, "max_ongoing_requests": 16}, 1, 10),
    ],
)
def test_autoscaling_sets_min_and_max(role_raw, min_replicas, max_replicas):
    role = AppArgs.parse({"prefill": role_raw}).prefill
    assert (role.min_replicas, role.max_replicas) == (min_replicas, max_replicas)


@pytest.mark.parametrize(
    "raw, where, fragment",
    [
        ({"prefill": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "prefill.autoscaling", "min_replicas (3) is above max_replicas (2)"),
        ({"prefill": {"autoscaling": {"min_replicas": 0}}}, "prefill.autoscaling.min_replicas", "greater than or equal to 1"),
        ({"decode": {"autoscaling": {"max_replicas": 0}}}, "decode.autoscaling.max_replicas", "greater than or equal to 1"),
        ({"decode": {"autoscaling": {"target_ongoing_requests": 0}}}, "decode.autoscaling.target_ongoing_requests", "greater than 0"),
        ({"decode": {"autoscaling": {"target_ongoing_requests": "many"}}}, "decode.autoscaling.target_ongoing_requests", "valid number"),
        ({"decode": {"replicas": 2, "autoscaling": {}}}, "decode", "set either replicas or autoscaling, not both"),
        # Explicitly setting the default still counts as setting it.
        ({"decode": {"replicas": 1, "autoscaling": {}}}, "decode", "set either replicas or autoscaling, not both"),
        ({"decode": {"max_ongoing_requests": 8, "autoscaling": {"target_ongoing_requests": 9}}}, "decode", "is above max_ongoing_requests (8)"),
        ({"decode": {"autoscaling": 3}}, "decode.autoscaling", "valid dictionary"),
    ],
)
def test_bad_autoscaling_is_refused(raw, where, fragment):
    message = parse_error(raw)
    assert f"  {where}: " in message, message
    assert fragment in message, message


def test_unknown_autoscaling_key_lists_the_valid_ones():
    message = parse_error({"prefill": {"autoscaling": {"min_replica": 1}}})
    line = next(l for l in message.splitlines() if l.strip().startswith("prefill.autoscaling.min_replica:"))
    listed = line.split("valid keys here:", 1)[1].strip().split(", ")
    assert listed == sorted(AutoscalingArgs.model_fields) == ["max_replicas", "min_replicas", "target_ongoing_requests"]


@pytest.mark.parametrize(
    "raw, ok",
    [
        ({"decode": {"autoscaling": {"max_replicas": 2000}}}, True),
        # Ports are planned for max_replicas, not min_replicas.
        ({"decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 2001}}}, False),
        ({"prefill": {"autoscaling": {"max_replicas": 1000}, "engine_kwargs": {"data_parallel_size": 2}}}, True),
        ({"prefill": {"autoscaling": {"max_replicas": 1001}, "engine_kwargs": {"data_parallel_size": 2}}}, False),
    ],
)
def test_port_plan_must_fit_max_replicas(raw, ok):
    if ok:
        AppArgs.parse(raw)
    else:
        assert "does not fit" in parse_error(raw)


def test_fixed_replicas_give_num_replicas():
    config = deployment_config(AppArgs.parse({"prefill": {"replicas": 3, "max_ongoing_requests": 5}}), Role.PREFILL)
    config.pop("request_router_config")  # test_routers_of_both_roles
    assert config == {"num_replicas": 3, "max_ongoing_requests": 5, "max_surge_percent": 0,
                      "graceful_shutdown_timeout_s": 60.0, "ray_actor_options": {"num_cpus": 0}}


def test_a_rolling_update_surges_the_ingress_and_only_the_engine_roles_told_to():
    """Serve stops an old replica before starting its replacement unless max_surge_percent says otherwise: the
    ingress (a tenth of a CPU) surges by default, so a redeploy leaves no moment without one; an engine role
    only where its config says there is room for the extra engines. Serve's own models take the values."""
    from ray.serve._private.config import DeploymentConfig

    args = AppArgs.parse({"decode": {"max_surge_percent": 50}})
    assert DeploymentConfig(**deployment_config(args, Role.DECODE)).max_surge_percent == 50
    assert DeploymentConfig(**deployment_config(args, Role.PREFILL)).max_surge_percent == 0
    assert args.ingress.max_surge_percent == 100
    # Drained deliberately: a replaced ingress outlasts the streams it carries (a cut there has no error event).
    assert DeploymentConfig(**deployment_config(args, Role.DECODE)).graceful_shutdown_timeout_s == 60
    assert args.ingress.graceful_shutdown_timeout_s == 600


def test_autoscaling_gives_autoscaling_config_instead_of_num_replicas():
    args = AppArgs.parse(
        {
            "prefill": {"autoscaling": {"min_replicas": 2, "max_replicas": 4, "target_ongoing_requests": 8}, "max_ongoing_requests": 16},
            "decode": {"replicas": 2},
        }
    )
    prefill = deployment_config(args, Role.PREFILL)
    assert "num_replicas" not in prefill
    assert prefill["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 4, "target_ongoing_requests": 8}
    assert prefill["max_ongoing_requests"] == 16
    decode = deployment_config(args, Role.DECODE)
    assert decode["num_replicas"] == 2 and "autoscaling_config" not in decode
    # Serve's own model accepts both and keeps our values.
    serve_config = DeploymentConfig(**prefill)
    assert serve_config.autoscaling_config.min_replicas == 2
    assert serve_config.autoscaling_config.max_replicas == 4
    assert serve_config.autoscaling_config.target_ongoing_requests == 8
    assert DeploymentConfig(**decode).num_replicas == 2
    # And so does Ray Serve LLM's LLMConfig.
    llm = LLMConfig.model_validate(llm_config(args, Role.PREFILL, SOURCE))
    assert llm.deployment_config["autoscaling_config"]["max_replicas"] == 4


# --------------------------------------------------------------------------- custom resources


def test_resources_default_empty():
    assert AppArgs.parse({}).prefill.resources == {}


@pytest.mark.parametrize("accelerator, gpus", [("cpu", 0), ("gpu", 1), ("neuron", 0)])
def test_resources_go_into_the_first_bundle_only(accelerator, gpus):
    args = AppArgs.parse(
        {
            "accelerator": accelerator,
            "engine_kwargs": {"tensor_parallel_size": 4},
            "prefill": {"gpus": gpus, "resources": {"prefill_group": 0.01, "zone_a": 1}},
            "decode": {"gpus": gpus, "resources": {"decode_group": 0.5}},
        }
    )
    prefill = placement_group_config(args, Role.PREFILL)["bundles"]
    decode = placement_group_config(args, Role.DECODE)["bundles"]
    assert prefill[0]["prefill_group"] == 0.01 and prefill[0]["zone_a"] == 1
    assert decode[0]["decode_group"] == 0.5
    for bundle in prefill[1:] + decode[1:]:
        assert not {"prefill_group", "zone_a", "decode_group"} & set(bundle)
    assert "decode_group" not in prefill[0] and "prefill_group" not in decode[0]
    # Bundles are separate objects: Ray's engine config copies, but nothing may alias.
    assert len({id(b) for b in prefill}) == len(prefill)
    # Ray Serve LLM's engine config reserves exactly these bundles.
    engine = LLMConfig.model_validate(llm_config(args, Role.PREFILL, SOURCE)).get_engine_config()
    assert engine.placement_bundles[0]["prefill_group"] == 0.01
    assert len(engine.placement_bundles) == len(prefill)


@pytest.mark.parametrize("name", sorted(RAY_RESOURCE_NAMES) + ["node:10.0.0.1", "accelerator_type:H200"])
def test_ray_resource_names_are_refused(name):
    message = parse_error({"decode": {"resources": {name: 1}}})
    assert f"resources.{name}: Ray's own resource" in message


@pytest.mark.parametrize("amount, ok", [(0.01, True), (1, True), (100, True), (0.0001, True), (0, False), (-1, False), (0.00001, False), (0.12345, False)])
def test_resource_amounts_are_positive_in_ray_units(amount, ok):
    raw = {"prefill": {"resources": {"prefill_group": amount}}}
    if ok:
        assert AppArgs.parse(raw).prefill.resources == {"prefill_group": amount}
    else:
        assert "must be positive and a multiple of 0.0001" in parse_error(raw)


def test_resources_must_be_numbers():
    assert "prefill.resources.g" in parse_error({"prefill": {"resources": {"g": "lots"}}})


# --------------------------------------------------------------------------- neuron


NEURON_RAW = {
    "accelerator": "neuron",
    "engine_kwargs": {"tensor_parallel_size": 8},
    "prefill": {"cpus": 0.25, "resources": {"prefill_group": 0.01}, "env": {"FI_PROVIDER": "efa"}},
    "decode": {"engine_kwargs": {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}},
}


def test_neuron_is_an_accelerator_and_needs_gpus_zero():
    assert AppArgs.parse(NEURON_RAW).accelerator is Accelerator.NEURON
    message = parse_error({**NEURON_RAW, "decode": {"gpus": 1}})
    assert "decode.gpus must be 0 with accelerator 'neuron'" in message


@pytest.mark.parametrize("role, bundle", [
    (Role.PREFILL, {"CPU": 0.25 * 8, "prefill_group": 0.01}),
    (Role.DECODE, {"CPU": 0.5 * 8}),  # TP 4 x PP 2
])
def test_a_neuron_replica_holds_one_neuron_core_per_rank_itself(role, bundle):
    """Ray sets NEURON_RT_VISIBLE_CORES only in a worker holding neuron_cores, and the engine runs in the
    replica's process tree: the replica actor asks for them, its one bundle holds its CPUs (per core)."""
    args = AppArgs.parse(NEURON_RAW)
    config = placement_group_config(args, role)
    assert config == {"bundles": [bundle], "strategy": "STRICT_PACK"}
    assert replica_actor_resources(args, role) == {"neuron_cores": 8}
    assert deployment_config(args, role)["ray_actor_options"] == {"num_cpus": 0, "resources": {"neuron_cores": 8}}
    gpu = AppArgs.parse({"accelerator": "gpu", "prefill": {"gpus": 1}, "decode": {"gpus": 1}})
    assert replica_actor_resources(gpu, role) == replica_actor_resources(AppArgs.parse({}), role) == {}


def test_neuron_kv_buffer_is_host_memory_and_env_has_no_cpu_defaults():
    args = AppArgs.parse(NEURON_RAW)
    assert kv_transfer_config(args, Role.PREFILL)["kv_buffer_device"] == "cpu"
    config = llm_config(args, Role.PREFILL, SOURCE)
    assert "accelerator_config" not in config
    assert dict(EngineSettings.from_dict(config["experimental_configs"][SETTINGS_KEY]).env) == {"FI_PROVIDER": "efa"}


@pytest.mark.parametrize("role", list(Role))
def test_ray_serve_llm_takes_neuron_configs_with_the_mp_executor(role, monkeypatch):
    """Ray Serve LLM 2.60 has no Neuron kind: GPU-less bundles mean its CPU path (mp executor); the
    replica actor's NeuronCores go into its first bundle, where Serve pins the actor."""
    import ray
    from ray.llm._internal.serve.core.server.llm_server import LLMServer

    args = AppArgs.parse(NEURON_RAW)
    llm = LLMConfig.model_validate(llm_config(args, role, SOURCE))
    assert llm.accelerator_config.kind == "cpu"
    engine = llm.get_engine_config()
    assert engine.placement_strategy == "STRICT_PACK"
    assert engine.get_initialization_kwargs()["distributed_executor_backend"] == "mp"
    # Serve LLM reads the driver's runtime_env here; that call alone would start Ray.
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(runtime_env={}))
    options = LLMServer.get_deployment_options(llm)
    (bundle,) = options["placement_group_bundles"]
    assert bundle["neuron_cores"] == 8 and bundle["CPU"] == args.role(role).cpus * 8
    assert options["ray_actor_options"]["resources"] == {"neuron_cores": 8}
    assert not ray.is_initialized()


# --------------------------------------------------------------------------- placement strategy


def test_gpu_replicas_are_strictly_packed_and_cpu_ones_keep_rays_default():
    gpu = AppArgs.parse({"accelerator": "gpu", "prefill": {"gpus": 1}, "decode": {"gpus": 1}})
    assert placement_group_config(gpu, Role.PREFILL)["strategy"] == "STRICT_PACK"
    assert "strategy" not in placement_group_config(AppArgs.parse({}), Role.PREFILL)
    assert LLMConfig.model_validate(llm_config(gpu, Role.DECODE, SOURCE)).get_engine_config().placement_strategy == "STRICT_PACK"


# --------------------------------------------------------------------------- reference table


@pytest.mark.parametrize(
    "row",
    [
        "| `prefill.autoscaling` | `None` |",
        "| `prefill.autoscaling.min_replicas` | `1` |",
        "| `decode.autoscaling.max_replicas` | `2` |",
        "| `decode.autoscaling.target_ongoing_requests` | `16` |",
        "| `prefill.resources` | `{}` |",
    ],
)
def test_reference_documents_the_new_fields(row):
    assert row in reference_markdown()


def test_reference_names_neuron():
    assert "neuron" in next(l for l in reference_markdown().splitlines() if l.startswith("| `accelerator`"))


@pytest.mark.parametrize("router, cls", [("load_aware", "LoadAwareDecodeRouter"), ("round_robin", "RoundRobinDecodeRouter")])
def test_routers_of_both_roles(router, cls):
    import importlib

    from ray.serve._private.request_router.request_router import RequestRouter

    from app.routing.pipeline import RoutingPolicy

    args = AppArgs.parse({"routing": {"decode_router": router}})
    decode = deployment_config(args, Role.DECODE)["request_router_config"]
    prefill = deployment_config(args, Role.PREFILL)["request_router_config"]
    assert decode["request_router_class"] == f"app.routing.decode_router.{cls}"
    assert prefill["request_router_class"] == "app.routing.prefill_router.LoadAwarePrefillRouter"
    assert RoutingPolicy.model_validate(prefill["request_router_kwargs"]["policy"]) == args.routing.prefill_policy
    assert decode["request_routing_stats_period_s"] == prefill["request_routing_stats_period_s"] == args.routing.stats_period_s
    for path in (decode["request_router_class"], prefill["request_router_class"]):
        module, name = path.rsplit(".", 1)
        assert issubclass(getattr(importlib.import_module(module), name), RequestRouter)
