"""The ``kv_transfer_params`` codec: every key vLLM's NIXL connectors read, in one place.

The orchestrator works with typed objects (:class:`PeerIdentity`); this module turns
them into the dicts vLLM expects on each leg. Pinned to vLLM 0.32's NIXL push/pull
connectors (see ``tests/unit/connector/test_params.py`` for the seam).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class TransferMode(str, Enum):
    PUSH = "push"
    PULL = "pull"


# Our vLLM-side connectors (kv_transfer_config.kv_connector), loaded by vLLM from
# CONNECTOR_MODULE via kv_connector_module_path; they extend vLLM's NIXL connectors.
CONNECTOR_MODULE = "connector.vllm_connectors"
CONNECTOR_CLASS = {TransferMode.PUSH: "RendezvousPushConnector", TransferMode.PULL: "RendezvousPullConnector"}

# Push, per request (the decode leg's kv_transfer_params): seconds from registering its blocks to their
# expiry, sized to the request's own work by the orchestrator (app/request/deadlines.py); the engine's
# ConnectorSettings.kv_timeout_s (connector/settings.py) is the default for a leg that does not say.
KV_DEADLINE_KEY = "rendezvous_kv_deadline_s"
# Pull: the sums of the KV a prefill leg leaves for decode to READ, in prefill's response and so in
# the decode leg's kv_transfer_params (connector/pull_checksum.py).
KV_SUMS_KEY = "rendezvous_kv_sums"
# The digest of the prompt token ids a KV was computed from (pull: in prefill's response; push: in decode's
# registration), compared before the KV is used (connector/kv_identity.py).
KV_IDENTITY_KEY = "rendezvous_kv_identity"
# Prefill never starts a WRITE into a registration this close to its expiry.
WRITE_MARGIN_S = 5.0

# Conversation turns (both legs' kv_transfer_params): decode offers the history it holds
# in its push registration; prefill waits for that offer, READs the verified prefix back
# and computes only the rest (connector/vllm_connectors.py).
REUSE_KEY = "rendezvous_reuse"
# What prefill did about reuse, in the kv_transfer_params of its response.
REUSE_REPORT_KEY = "rendezvous_reuse_report"
# When the prefill engine had a leg (wall clock, seconds): its arrival at the engine, first
# scheduled, finished. In the kv_transfer_params of prefill's response (connector/stages.py).
STAGES_KEY = "rendezvous_stages"
# vLLM's own kv_connector_extra_config keys: fewer reusable tokens than this are recomputed;
# pull's read-back of a conversation's history (decode keeps its blocks for this many seconds).
RECOMPUTE_THRESHOLD_KEY = "kv_recompute_threshold"
BIDIRECTIONAL_KEY = "bidirectional_kv_xfer"
DECODER_BLOCKS_TTL_KEY = "decoder_kv_blocks_ttl"
# How long prefill waits for decode's offer before it computes the whole prompt.
REUSE_OFFER_WAIT_S = 2.0

# Pull mode with ``conversations.pull_history: upstream`` (vLLM's ``bidirectional_kv_xfer``):
# decode keeps the blocks of a turn carrying this key for the next turn's prefill to READ
# back (connector/pull_history.py); upstream would keep every request's.
KEEP_HISTORY_KEY = "rendezvous_keep_history"

# vLLM's own keys for a leg's role: prefill computes for a remote decode; decode loads from a remote prefill.
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
# vLLM's own (pull scheduler): set on a leg's params once its READ is planned (or found unneeded).
READ_PLANNED_KEY = "_remote_blocks_processed"


def is_prefill_leg(params: dict[str, Any] | None) -> bool:
    return bool((params or {}).get(DO_REMOTE_DECODE))


def kv_timeout_of(params: dict[str, Any] | None, default_s: float | None) -> float | None:
    """A decode leg's own KV deadline (seconds), else the engine's default."""
    said = (params or {}).get(KV_DEADLINE_KEY)
    try:
        return float(said) if said is not None and float(said) > 0 else default_s
    except (TypeError, ValueError):
        return default_s


def is_decode_leg(params: dict[str, Any] | None) -> bool:
    """A decode leg still to load its KV (vLLM clears the flag once it has registered or read)."""
    return bool((params or {}).get(DO_REMOTE_PREFILL))


# vLLM's OpenAI layer prefixes the external request id per endpoint; the engine's
# internal id is ``<prefix><external id>`` once id randomization is disabled.
_ENDPOINT_PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-"}


class ReuseReason(str, Enum):
    """What became of a turn's history on the prefill leg (``ReuseReport.reason``)."""

    REUSED = "reused"  # READ back from decode; only the rest computed
    NO_OFFER = "no_offer"  # decode offered nothing in time (or kept nothing: pull)
    NO_MATCH = "no_match"  # the offered history does not match the prompt's first block
    THRESHOLD = "threshold"  # fewer matching tokens than kv_recompute_threshold: recomputed
    UNSUPPORTED = "unsupported"  # this engine cannot reuse (several KV cache groups)
    MISMATCH = "kv_mismatch"  # READ back, but not the bytes decode holds (connector.kv_checksum): recomputed


@dataclass(frozen=True)
class ReuseReport:
    """What the prefill leg did about a conversation turn's history (prefill -> decode, in
    the kv_transfer_params of prefill's response under ``REUSE_REPORT_KEY``; pull's decode
    replica writes its own)."""

    reason: str  # a ReuseReason (a str on the wire)
    reused_tokens: int = 0  # history READ back from decode instead of computed
    pushed_tokens: int = 0  # the rest, computed and pushed to decode
    kv_bytes_per_token: int = 0  # of this engine's KV cache, all layers

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, raw: Any) -> ReuseReport | None:
        if not isinstance(raw, dict) or not isinstance(raw.get("reason"), str):
            return None
        return cls(raw["reason"], *(int(raw.get(k) or 0) for k in ("reused_tokens", "pushed_tokens", "kv_bytes_per_token")))


def kv_bytes_per_token(vllm_config: Any) -> int:
    """K and V of every layer for one token, all tensor parallel ranks together (what a
    transfer of one token's KV moves in all)."""
    model = vllm_config.model_config
    itemsize = 1 if "fp8" in str(vllm_config.cache_config.cache_dtype) else model.dtype.itemsize
    return 2 * model.get_total_num_hidden_layers() * model.get_total_num_kv_heads() * model.get_head_size() * itemsize


@dataclass(frozen=True)
class PeerIdentity:
    """What a decode engine needs to reach a prefill engine's NIXL side channel."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1

    def to_metadata(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any] | None) -> "PeerIdentity":
        if not metadata or "engine_id" not in metadata:
            raise ValueError(
                "the bound prefill replica published no NIXL identity "
                f"(replica_metadata={metadata!r}); is it running a rendezvous NIXL backend?"
            )
        return cls(**{k: metadata[k] for k in ("engine_id", "host", "port", "tp_size", "pp_size")})


def new_transfer_request_id() -> str:
    """A fresh id shared by both legs of one request. vLLM pairs the legs by it."""
    return f"rdv-{uuid.uuid4().hex}"


def engine_request_id(endpoint: str, request_id: str) -> str:
    """The id the engine uses internally for ``request_id`` on ``endpoint``."""
    return _ENDPOINT_PREFIX[endpoint] + request_id


def external_request_id(engine_request_id: str) -> str:
    """The id an engine request had outside the engine: without the endpoint's prefix and,
    for completions, without the prompt's index that vLLM appends (``-0``: we send one)."""
    for endpoint, prefix in _ENDPOINT_PREFIX.items():
        if engine_request_id.startswith(prefix):
            rest = engine_request_id[len(prefix):]
            return re.sub(r"-\d+$", "", rest) if endpoint == "completions" else rest
    return engine_request_id


def push_prefill_params(reuse: bool = False) -> dict[str, Any]:
    """Prefill leg in push mode: compute the prompt, then WRITE it to whoever registers.
    With ``reuse``, first READ the history that decode offers and compute only the rest."""
    params: dict[str, Any] = {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False}
    if reuse:
        params[REUSE_KEY] = True
    return params


def push_decode_params(peer: PeerIdentity, prefill_engine_request_id: str, reuse: bool = False) -> dict[str, Any]:
    """Decode leg in push mode: allocate blocks, register them with ``peer``, wait. With
    ``reuse``, the registration also offers the blocks of decode's prefix-cache hit."""
    params: dict[str, Any] = {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        "remote_engine_id": peer.engine_id,
        "remote_host": peer.host,
        "remote_port": peer.port,
        "tp_size": peer.tp_size,
        "pp_size": peer.pp_size,
        # The prefill engine extends its block lease on heartbeats naming this id exactly.
        "remote_request_id": prefill_engine_request_id,
    }
    if reuse:
        params[REUSE_KEY] = True
    return params


def pull_prefill_params() -> dict[str, Any]:
    """Prefill leg in pull mode: compute, keep the blocks, return where they are."""
    return {
        DO_REMOTE_DECODE: True,
        DO_REMOTE_PREFILL: False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def pull_history_params(offer: dict[str, Any], tokens: int, block_size: int) -> dict[str, Any]:
    """Prefill leg in pull mode that first READs ``tokens`` of a conversation's history
    back from decode (vLLM's bi-directional path). ``offer`` is the ``kv_transfer_params``
    of decode's response to the previous turn; vLLM would load all of it (its own token
    count), so it is cut to the whole blocks of the verified prefix. The worker pairs
    local and remote blocks from the end of the lists: the remote list must end there."""
    blocks = tokens // block_size
    return {
        **offer,
        DO_REMOTE_DECODE: True,
        DO_REMOTE_PREFILL: False,
        "remote_block_ids": [list(group[:blocks]) for group in offer["remote_block_ids"]],
        "remote_num_tokens": blocks * block_size,
    }


def reusable_tokens(offered_tokens: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens prefill may load: whole blocks only, and never the last prompt token (the
    engine must compute at least one token to produce the first output)."""
    limit = (max(prompt_tokens - 1, 0) // block_size) * block_size
    return max(0, min(offered_tokens, limit))


def verified_history_tokens(held: Sequence[int], prompt: Sequence[int], block_size: int) -> int:
    """History tokens a turn may reuse: whole blocks of the common prefix of the token ids
    decode holds and the new prompt's (an edited or re-rendered history stops it early)."""
    common = next((i for i, (a, b) in enumerate(zip(held, prompt)) if a != b), min(len(held), len(prompt)))
    return reusable_tokens(common // block_size * block_size, len(prompt), block_size)
