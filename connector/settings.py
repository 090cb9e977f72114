"""Our connectors' settings, parsed once from vLLM's ``kv_connector_extra_config`` (vLLM-side; no Ray, no ``app``).

The app writes them (``app.config.llm_configs``: :meth:`ConnectorSettings.extra`) and each connector reads them once, at
its construction (:meth:`ConnectorSettings.parse`), then hands its features what they need. Our keys share the
``rendezvous_`` prefix. A prefixed key we do not know is refused, with the list of those we do: a misspelt key
would otherwise leave a feature at its default without a word. vLLM's own keys in the same dict are vLLM's to
check; of them we read ``backends`` (what NIXL moves KV with).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PREFIX = "rendezvous_"
VLLM_DEFAULT_BACKENDS = ("UCX",)  # vLLM's NIXL connectors' default backend list


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config`` keys of our connectors (each with the ``rendezvous_`` prefix)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_timeout_s: float | None = Field(
        None, gt=0, description="Push: seconds decode waits for its KV from registering its blocks "
        "(connector.push_deadline; a leg's own kv_transfer_params may size it to its work). Pull: seconds a posted "
        "READ may take (connector.pull_deadline). None: no deadline.")
    kv_checksums: bool = Field(
        True, description="Digest the KV the sender moves and check it on landing (connector.kv_checksum, "
        "connector.pull_checksum). Both roles must agree.")
    progressive: bool = Field(
        False, description="Push, prefill: WRITE each chunk of a prompt's KV as soon as a step completes it, while "
        "the next computes; the last WRITE, after the final chunk, carries the completion (connector.progressive). "
        "Helps only with chunked prefill (max_num_batched_tokens below the prompt).")
    kv_peer_tp_size: int = Field(
        1, ge=1, description="Pull: the other role's tensor parallel size; a sender digests each block in as many "
        "chunks as the reader has ranks a block (connector.sum_ranks). Push learns it in the NIXL handshake.")

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Ours of a ``kv_connector_extra_config``; ValueError naming an unknown or invalid key."""
        ours = {key[len(PREFIX):]: value for key, value in (extra or {}).items() if key.startswith(PREFIX)}
        unknown = sorted(set(ours) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config key(s) {[PREFIX + k for k in unknown]}; "
                             f"ours are {[PREFIX + k for k in cls.model_fields]}")
        try:
            return cls(**ours)
        except ValidationError as e:
            raise ValueError(f"kv_connector_extra_config: {e}") from None

    def extra(self) -> dict[str, Any]:
        """These settings as ``kv_connector_extra_config`` entries (None left out: the default)."""
        return {PREFIX + key: value for key, value in self.model_dump().items() if value is not None}


def backends(extra: Mapping[str, Any] | None) -> list[str]:
    """The NIXL backends vLLM's connector will use (its ``backends`` key, or its default)."""
    return list((extra or {}).get("backends") or VLLM_DEFAULT_BACKENDS)


DEFAULTS = ConnectorSettings()  # for the features' class-level defaults: one home per default
