"""What one engine process needs to know about itself, and its environment (pure).

vLLM reads its NIXL side channel and CPU settings only from environment variables, and
the engine processes inherit the replica's environment. ``engine_env`` is the one place
that decides those variables; ``connector.ray_backend`` is the one place that applies
them. The app builder hands :class:`EngineSettings` to each replica inside
``LLMConfig.experimental_configs[SETTINGS_KEY]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from connector.ports import PortPlan, Role

SETTINGS_KEY = "rendezvous"


@dataclass(frozen=True)
class EngineSettings:
    role: Role
    ports: PortPlan
    env: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role.value, "ports": asdict(self.ports), "env": dict(self.env)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "EngineSettings":
        return cls(role=Role(raw["role"]), ports=PortPlan(**raw["ports"]), env=dict(raw["env"]))


# UCX over loopback/shared memory works on any host for KV in host memory; EFA deployments override.
HOST_UCX_TLS = "tcp,shm,self"


def ucx_tls_problem(value: str) -> str | None:
    """Why UCX_TLS ``value`` cannot move KV that lives in GPU memory (``kv_buffer_device: cuda``), or None.
    Without a CUDA transport UCX fails to register device memory, or stages it through host copies over TCP."""
    transports = [t.strip().lower() for t in value.split(",") if t.strip()]
    if not transports or transports == ["all"]:
        return None
    if transports[0].startswith("^"):  # every transport but these
        excluded = [transports[0][1:], *transports[1:]]
        cut = [t for t in excluded if t.startswith("cuda")]
        return f"UCX_TLS={value} excludes {', '.join(cut)}" if cut else None
    if any(t.startswith(("cuda", "gdr")) for t in transports):
        return None
    return (f"UCX_TLS={value} has no CUDA transport (cuda_copy, cuda_ipc; gdr_copy for GPUDirect), so UCX cannot move "
            "KV held in GPU memory: add them, use 'all' (UCX picks), or nixl.backends: [LIBFABRIC] for EFA")


def engine_env(*, side_channel_host: str, side_channel_port: int, user_env: Mapping[str, str],
               kv_buffer_device: str = "cpu") -> dict[str, str]:
    env = {
        # Our request ids are fresh UUIDs, so vLLM need not append a random suffix; an
        # exact internal id lets decode's heartbeats extend prefill's block lease.
        "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
    }
    if kv_buffer_device == "cpu":  # on a GPU, UCX's own choice includes the CUDA transports
        env["UCX_TLS"] = HOST_UCX_TLS
    env.update(user_env)
    # Derived from the port plan; a user value here would break peer addressing.
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = side_channel_host
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    return env
