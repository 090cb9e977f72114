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


def engine_env(*, side_channel_host: str, side_channel_port: int, user_env: Mapping[str, str]) -> dict[str, str]:
    env = {
        # UCX over loopback/shared memory works on any host; EFA deployments override.
        "UCX_TLS": "tcp,shm,self",
        # Our request ids are fresh UUIDs, so vLLM need not append a random suffix; an
        # exact internal id lets decode's heartbeats extend prefill's block lease.
        "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
    }
    env.update(user_env)
    # Derived from the port plan; a user value here would break peer addressing.
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = side_channel_host
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    return env
