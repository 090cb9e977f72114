"""Turn :class:`AppArgs` into the two Ray Serve LLM ``LLMConfig`` dicts (pure).

Everything role-specific the engines need is decided here; ``connector.ray_backend``
reads our part back from ``experimental_configs['rendezvous']`` inside each replica.
"""

from __future__ import annotations

from typing import Any

from app.args import Accelerator, AppArgs
from connector.params import CONNECTOR_CLASS, CONNECTOR_MODULE
from connector.ports import Role
from connector.engine_env import SETTINGS_KEY, EngineSettings

CPU_DEFAULT_ENV = {
    # vLLM on CPU otherwise reserves 92 % of *system* RAM for KV, so a second engine on
    # the same box cannot start. 1 GiB holds ~45k tokens of SmolLM2-135M KV in bf16.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # vLLM's "auto" binding assumes one engine owns the host; several engines would bind
    # the same cores. Let the OS place one thread per engine unless the config says more.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


def kv_transfer_config(args: AppArgs, role: Role) -> dict[str, Any]:
    return {
        "kv_connector": CONNECTOR_CLASS[args.mode],
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer" if role is Role.PREFILL else "kv_consumer",
        "kv_buffer_device": "cpu" if args.accelerator is Accelerator.CPU else "cuda",
        "kv_connector_extra_config": {"backends": list(args.nixl.backends), **args.nixl.extra_config},
    }


def llm_config(args: AppArgs, role: Role, model_source: str) -> dict[str, Any]:
    role_args = args.role(role)
    engine_kwargs = {**args.engine_kwargs_for(role), "kv_transfer_config": kv_transfer_config(args, role)}
    devices = int(engine_kwargs.get("tensor_parallel_size") or 1) * int(engine_kwargs.get("pipeline_parallel_size") or 1)
    if args.accelerator is Accelerator.CPU:
        hardware = {
            "accelerator_config": {"kind": "cpu"},
            "placement_group_config": {"bundles": [{"CPU": role_args.cpus}]},
        }
        env = {**CPU_DEFAULT_ENV, **role_args.env}
    else:
        hardware = {
            "placement_group_config": {
                "bundles": [{"GPU": role_args.gpus, "CPU": role_args.cpus}] * devices,
            },
        }
        env = dict(role_args.env)
    return {
        "model_loading_config": {"model_id": args.model.id, "model_source": model_source},
        "engine_kwargs": engine_kwargs,
        **hardware,
        "deployment_config": {
            "num_replicas": role_args.replicas,
            "max_ongoing_requests": role_args.max_ongoing_requests,
            # The placement bundle already holds the replica's CPU share.
            "ray_actor_options": {"num_cpus": 0},
        },
        "log_engine_metrics": True,
        "experimental_configs": {
            SETTINGS_KEY: EngineSettings(role=role, ports=args.nixl.port_plan(), env=env).to_dict(),
        },
    }
