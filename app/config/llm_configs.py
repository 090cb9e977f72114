"""Turn :class:`AppArgs` into the two Ray Serve LLM ``LLMConfig`` dicts (pure).

Everything role-specific the engines need is decided here; ``connector.ray_backend``
reads our part back from ``experimental_configs['rendezvous']`` inside each replica.
"""

from __future__ import annotations

from typing import Any

from app.config.args import Accelerator, AppArgs, DecodeRouter, IngressArgs
from connector.engine_env import SETTINGS_KEY, EngineSettings
from connector.params import (
    BIDIRECTIONAL_KEY,
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    DECODER_BLOCKS_TTL_KEY,
    RECOMPUTE_THRESHOLD_KEY,
    TransferMode,
)
from connector.ports import Role
from connector.settings import ConnectorSettings

# Serve request routers (they import Ray, so named, not imported).
DECODE_ROUTERS = {
    DecodeRouter.LOAD_AWARE: "app.routing.decode_router.LoadAwareDecodeRouter",
    DecodeRouter.ROUND_ROBIN: "app.routing.decode_router.RoundRobinDecodeRouter",
}
PREFILL_ROUTER = "app.routing.prefill_router.LoadAwarePrefillRouter"
# Ray Serve LLM's node initialization, skipped when it would download nothing (it imports Ray).
NODE_INIT_CALLBACK = "app.replica.node_init.SkipIdleNodeInit"

CPU_DEFAULT_ENV = {
    # vLLM on CPU otherwise reserves 92 % of *system* RAM for KV, so a second engine on
    # the same box cannot start. 1 GiB holds ~23k tokens of SmolLM2-135M KV in float32 (the local configs), ~45k in bf16.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # vLLM's "auto" binding assumes one engine owns the host; several engines would bind
    # the same cores. Let the OS place one thread per engine unless the config says more.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


def kv_transfer_config(args: AppArgs, role: Role) -> dict[str, Any]:
    # nixl.extra_config holds none of ours (NixlArgs refuses them): ours come from handoff.* and the TP sizes.
    extra = {**args.nixl.extra_config, "backends": list(args.nixl.backends)}
    if args.mode is TransferMode.PUSH:
        ours = ConnectorSettings(kv_timeout_s=args.handoff.kv_timeout_s, kv_checksums=args.handoff.kv_checksums,
                                 progressive=args.handoff.progressive)
        extra[RECOMPUTE_THRESHOLD_KEY] = args.conversations.recompute_threshold
    else:
        peer = Role.DECODE if role is Role.PREFILL else Role.PREFILL
        ours = ConnectorSettings(kv_timeout_s=args.handoff.read_timeout_s,  # a READ's deadline (connector.pull_deadline)
                                 kv_checksums=args.handoff.kv_checksums,
                                 kv_peer_tp_size=int(args.engine_kwargs_for(peer).get("tensor_parallel_size") or 1))
        if args.upstream_pull_history:
            extra[BIDIRECTIONAL_KEY] = True
            extra[DECODER_BLOCKS_TTL_KEY] = args.conversations.retention_s
            extra[RECOMPUTE_THRESHOLD_KEY] = args.conversations.recompute_threshold
    extra.update(ours.extra())
    return {
        "kv_connector": CONNECTOR_CLASS[args.mode],
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer" if role is Role.PREFILL else "kv_consumer",
        # Neuron: vLLM's NIXL worker registers device memory only for the device types it
        # knows (cuda, xpu, ...) or that an out-of-tree platform declares; Neuron HBM is not
        # one, so KV is staged through a host buffer (device<->host copies on both sides).
        "kv_buffer_device": "cuda" if args.accelerator is Accelerator.GPU else "cpu",
        "kv_connector_extra_config": extra,
        # KV that fails to arrive (a failed READ or WRITE, a push past its deadline) is
        # recomputed by decode instead of failing the request.
        "kv_load_failure_policy": "recompute",
    }


def placement_group_config(args: AppArgs, role: Role) -> dict[str, Any]:
    """One replica's placement group: its engine workers, plus the role's custom resources.

    The replica actor itself runs in the first bundle, so custom resources there (e.g. a
    k8s worker group's ``prefill_group``) decide which Ray nodes the replica may use; with
    STRICT_PACK every other bundle (tensor parallel worker) follows it onto the same node.
    Serve adds :func:`replica_actor_resources` to the first bundle (a Neuron replica's cores).
    """
    role_args = args.role(role)
    kwargs = args.engine_kwargs_for(role)
    devices = int(kwargs.get("tensor_parallel_size") or 1) * int(kwargs.get("pipeline_parallel_size") or 1)
    if args.accelerator is Accelerator.CPU:
        bundles = [{"CPU": role_args.cpus}]
    elif args.accelerator is Accelerator.GPU:
        bundles = [{"GPU": role_args.gpus, "CPU": role_args.cpus} for _ in range(devices)]
    else:
        # One bundle: the engine's NeuronCores are the replica actor's own (replica_actor_resources),
        # and `cpus` is per NeuronCore. Ray Serve LLM has no Neuron accelerator kind: a bundle
        # without GPU/TPU makes it pick vLLM's multiprocessing executor (one process tree per
        # engine, the replica's children, as the Neuron plugin runs).
        bundles = [{"CPU": role_args.cpus * devices}]
    bundles[0] = {**bundles[0], **role_args.resources}
    config: dict[str, Any] = {"bundles": bundles}
    if args.accelerator is not Accelerator.CPU:
        # Tensor parallel workers share a node (NVLink / NeuronLink), and follow the first
        # bundle's custom resources there; PACK would let them spill onto other nodes.
        config["strategy"] = "STRICT_PACK"
    return config


def replica_actor_resources(args: AppArgs, role: Role) -> dict[str, float]:
    """Ray resources the replica actor asks for itself, beyond its CPUs (Serve adds them to bundle 0).

    Neuron: the engine's NeuronCores, one per tensor parallel (x pipeline) rank. Ray sets
    NEURON_RT_VISIBLE_CORES only in a worker that holds ``neuron_cores`` (to the core ids it holds),
    and the engine's processes are the replica's children and inherit it; so the replica itself
    must hold them for several engines on one node to see disjoint cores. Cores held only by
    other bundles are bookkeeping: no process gets their ids.
    """
    if args.accelerator is not Accelerator.NEURON:
        return {}
    kwargs = args.engine_kwargs_for(role)
    return {"neuron_cores": int(kwargs.get("tensor_parallel_size") or 1) * int(kwargs.get("pipeline_parallel_size") or 1)}


def deployment_config(args: AppArgs, role: Role) -> dict[str, Any]:
    role_args = args.role(role)
    if role_args.autoscaling is None:
        replicas: dict[str, Any] = {"num_replicas": role_args.replicas}
    else:
        scaling = role_args.autoscaling
        replicas = {
            "autoscaling_config": {
                "min_replicas": scaling.min_replicas,
                "max_replicas": scaling.max_replicas,
                "target_ongoing_requests": scaling.target_ongoing_requests,
            }
        }
    # The placement bundle already holds the replica's CPU share.
    actor_options: dict[str, Any] = {"num_cpus": 0}
    if own := replica_actor_resources(args, role):
        actor_options["resources"] = own
    config = {
        **replicas,
        "max_ongoing_requests": role_args.max_ongoing_requests,
        "max_surge_percent": role_args.max_surge_percent,
        "graceful_shutdown_timeout_s": role_args.graceful_shutdown_timeout_s,
        "ray_actor_options": actor_options,
    }
    routing = args.routing
    router, policy = (
        (DECODE_ROUTERS[routing.decode_router], routing.decode_policy) if role is Role.DECODE
        else (PREFILL_ROUTER, routing.prefill_policy)
    )
    config["request_router_config"] = {
        "request_router_class": router,
        "request_router_kwargs": {"policy": policy.model_dump()},
        "request_routing_stats_period_s": routing.stats_period_s,
    }
    return config


def llm_config(args: AppArgs, role: Role, model_source: str) -> dict[str, Any]:
    role_args = args.role(role)
    engine_kwargs = {**args.engine_kwargs_for(role), "kv_transfer_config": kv_transfer_config(args, role)}
    if role is Role.DECODE and args.conversations.enabled:
        engine_kwargs["enable_prefix_caching"] = True  # where conversations are retained (app.routing.conversations)
    hardware: dict[str, Any] = {"placement_group_config": placement_group_config(args, role)}
    if args.accelerator is Accelerator.CPU:
        hardware = {"accelerator_config": {"kind": "cpu"}, **hardware}
        env = {**CPU_DEFAULT_ENV, **role_args.env}
    else:
        # GPU: Ray sets CUDA_VISIBLE_DEVICES per worker. Neuron: Ray sets NEURON_RT_VISIBLE_CORES
        # in the replica, which holds its engine's cores (replica_actor_resources); not set here.
        env = dict(role_args.env)
    return {
        "model_loading_config": {"model_id": args.model.id, "model_source": model_source},
        "engine_kwargs": engine_kwargs,
        **hardware,
        "deployment_config": deployment_config(args, role),
        "log_engine_metrics": True,
        "callback_config": {"callback_class": NODE_INIT_CALLBACK},
        "experimental_configs": {
            SETTINGS_KEY: EngineSettings(role=role, ports=args.nixl.port_plan(), env=env).to_dict(),
        },
    }


# Ray's resource of the head node (amount 1 there, absent elsewhere): ray._common.constants'
# HEAD_NODE_RESOURCE_NAME, by value here (this module imports no Ray; connector/seams.py lists it).
HEAD_NODE_RESOURCE = "node:__internal_head__"


def ingress_actor_options(ingress: IngressArgs) -> dict[str, Any]:
    """Ray actor options of one ingress replica: its CPUs and, ``on_head``, a sliver of the head's
    own resource, so Ray places it on the head whatever CPU the engine nodes have free (or the
    custom resources it asks for: the nodes of its own)."""
    options: dict[str, Any] = {"num_cpus": ingress.cpus}
    if ingress.on_head:
        options["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    elif ingress.resources:
        options["resources"] = dict(ingress.resources)
    return options
