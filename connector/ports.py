"""Side-channel port and engine-id planning (pure).

vLLM's NIXL scheduler binds one ZMQ side channel per engine at
``VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index``. Every engine on a host therefore
needs its own base port. We give each role a base and offset it by the Serve replica
rank (times the DP size, so DP ranks of one replica never reach the next replica's
port). Prefill and decode bases are far enough apart that they cannot meet.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from enum import Enum


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class PortPlan:
    prefill_base: int = 20000
    decode_base: int = 22000
    # Ports one role may use: replicas × DP size must fit below the next base.
    span: int = 2000

    def __post_init__(self) -> None:
        lo, hi = sorted((self.prefill_base, self.decode_base))
        if hi - lo < self.span:
            raise ValueError(
                f"side-channel port bases {self.prefill_base} and {self.decode_base} are "
                f"closer than {self.span}: replicas of the two roles would collide"
            )
        if not (1024 <= lo and hi + self.span <= 65536):
            raise ValueError(f"side-channel ports must lie in 1024..65535, got bases {lo}, {hi}")

    def base(self, role: Role) -> int:
        return self.prefill_base if role is Role.PREFILL else self.decode_base

    def port(self, role: Role, replica_rank: int, dp_size: int = 1) -> int:
        offset = replica_rank * max(1, dp_size)
        if replica_rank < 0 or offset + max(1, dp_size) > self.span:
            raise ValueError(
                f"replica rank {replica_rank} (dp_size {dp_size}) does not fit in the "
                f"{self.span} side-channel ports reserved for {role.value}"
            )
        return self.base(role) + offset

    def candidates(self, role: Role, replica_rank: int, dp_size: int = 1) -> list[int]:
        """Base ports a replica may bind, best first: its rank's, then every other block of the role's span.
        Serve's ranks are not stable: scaled down and up again, a deployment can give a new replica the rank
        whose port a live replica still binds (and a replaced replica's engine may hold its port a while)."""
        dp = max(1, dp_size)
        own = self.port(role, replica_rank, dp)
        return [own] + [self.base(role) + i * dp for i in range(self.span // dp) if self.base(role) + i * dp != own]

    def check_fits(self, role: Role, replicas: int, dp_size: int = 1) -> None:
        """Fail at build time if ``replicas`` replicas cannot all get ports.

        Pass the most replicas the role can have: its fixed replica count, or its
        autoscaling ``max_replicas`` (replica ranks run up to that minus one).
        """
        self.port(role, replicas - 1, dp_size)

    def ports(self, role: Role, max_replicas: int, dp_size: int = 1) -> list[int]:
        """Every side-channel port the role's engines can bind (each replica × DP rank)."""
        dp = max(1, dp_size)
        return [self.port(role, rank, dp) + i for rank in range(max_replicas) for i in range(dp)]


def make_engine_id(role: Role, replica_rank: int, host: str, port: int, nonce: str | None = None) -> str:
    """A readable, unique engine id.

    The nonce changes on every start: peers cache NIXL agent metadata by engine id, so a
    restarted replica (same rank, host and port) must not be mistaken for its previous
    incarnation.
    """
    nonce = nonce or secrets.token_hex(3)
    return f"{role.value}-r{replica_rank}-{host}-{port}-{nonce}"
