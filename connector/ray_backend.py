"""Ray-side NIXL connector backends: per-replica ports, engine ids and request shaping.

Ray Serve LLM 2.60 creates one backend per engine (``LLMConfig.setup_engine_backend``)
before the engine starts, publishes ``replica_metadata()`` of the prefill replica that
the decode orchestrator binds (``choose_replica``), and asks the backend to shape both
legs. Ray ships a backend for ``NixlConnector`` (pull) only; an unregistered name such as
``NixlPushConnector`` silently gets a default that sets no ports, host or engine id. So
we register our own for both vLLM connector names:

* push (``requires_peer_binding`` + ``concurrent_handoff``): the decode leg carries the
  bound prefill engine's identity and both legs go out at once with one request id; a
  conversation turn marked for reuse by the orchestrator (``REUSE_KEY``) keeps the mark
  on both legs;
* pull (default sequential protocol): decode READs using what prefill returned.

Pinned to ray 2.60 (``BaseConnectorBackend`` protocol) and vLLM 0.32.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray import serve
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
    BaseConnectorBackend,
    DefaultPDProtocolMixin,
    clamp_request_to_single_token,
)
from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory

from connector.engine_env import SETTINGS_KEY, EngineSettings, engine_env
from connector.faults import injected_fault
from connector.params import (
    CONNECTOR_CLASS,
    REUSE_KEY,
    PeerIdentity,
    TransferMode,
    engine_request_id,
    pull_prefill_params,
    push_decode_params,
    push_prefill_params,
)
from connector.port_check import first_free_block, holder
from connector.ports import make_engine_id

logger = logging.getLogger("ray.serve.rendezvous.connector")


def _endpoint(request: Any) -> str:
    return "chat" if hasattr(request, "messages") else "completions"


def _one_token(prefill: Any) -> None:
    """Ray's clamp to one non-streaming token, and a ``min_tokens`` that fits it: a
    client's ``min_tokens`` is for decode's output, and above 1 vLLM would refuse the leg."""
    clamp_request_to_single_token(prefill)
    if getattr(prefill, "min_tokens", 0):
        prefill.min_tokens = 0


def _misrouted(prefill: Any) -> None:
    """Test-only fault (``connector.faults``, ``misroute``): the prefill leg gets another prompt (rotated by one
    character, one token id, or the last message's first character), as a handoff that paired two requests would."""
    if injected_fault() != "misroute":
        return
    prompt, messages = getattr(prefill, "prompt", None), getattr(prefill, "messages", None)
    if isinstance(prompt, (str, list)) and len(prompt) > 1:
        prefill.prompt = prompt[1:] + prompt[:1]
    elif messages and isinstance(messages[-1].get("content"), str) and len(messages[-1]["content"]) > 1:
        content = messages[-1]["content"]
        messages[-1] = {**messages[-1], "content": content[1:] + content[:1]}
    else:
        return
    logger.warning("fault injection: request %s's prefill leg computes another prompt than decode's", prefill.request_id)


def _reuse(request: Any) -> bool:
    return bool((getattr(request, "kv_transfer_params", None) or {}).get(REUSE_KEY))


class _RendezvousNixlBackend(BaseConnectorBackend):
    """Shared setup: plan this replica's side channel, apply the engine env, set the id."""

    _identity: PeerIdentity | None = None

    def _settings(self) -> EngineSettings:
        try:
            raw = self.llm_config.experimental_configs[SETTINGS_KEY]
        except KeyError:
            raise ValueError(
                f"{type(self).__name__} needs experimental_configs['{SETTINGS_KEY}'], which "
                "app.builder writes; build the app with app.builder:build_app"
            ) from None
        return EngineSettings.from_dict(raw)

    def setup(self) -> None:
        settings = self._settings()
        role = settings.role
        kwargs = self.llm_config.engine_kwargs
        dp_size = int(kwargs.get("data_parallel_size") or 1)
        rank = serve.get_replica_context().rank.rank
        host = ray.util.get_node_ip_address()
        # vLLM's listener thread would die on a taken port and leave the replica starting for good: take a
        # free block of the role's ports, the rank's own if it is free (connector.ports.PortPlan.candidates).
        planned = settings.ports.port(role, rank, dp_size)
        port = first_free_block(settings.ports.candidates(role, rank, dp_size), dp_size, host,
                                what=f"{role.value} NIXL side-channel")
        if port != planned:
            logger.warning("%s NIXL side channel: port %s:%d (replica rank %d's) is held by %s; using %d",
                           role.value, host, planned, rank, holder(planned), port)
        env = engine_env(side_channel_host=host, side_channel_port=port, user_env=settings.env,
                         kv_buffer_device=self.kv_transfer_config.get("kv_buffer_device") or "cpu")
        # The one place that writes the engine environment: the engine processes that
        # vLLM spawns next inherit it.
        os.environ.update(env)
        engine_id = make_engine_id(role, rank, host, port)
        # In place: the engine config was cached with a reference to this dict.
        self.kv_transfer_config["engine_id"] = engine_id
        self._identity = PeerIdentity(
            engine_id=engine_id,
            host=host,
            port=port,
            tp_size=int(kwargs.get("tensor_parallel_size") or 1),
            pp_size=int(kwargs.get("pipeline_parallel_size") or 1),
        )
        logger.info(
            "NIXL %s engine %s: side channel %s:%d, env %s",
            role.value, engine_id, host, port, sorted(env),
        )

    def replica_metadata(self) -> dict[str, Any]:
        return self._identity.to_metadata() if self._identity else {}


class NixlPushBackend(_RendezvousNixlBackend):
    """Push: decode registers its blocks with the bound prefill engine, which WRITEs."""

    requires_peer_binding = True
    concurrent_handoff = True

    def prepare_prefill_request(self, *, request, peer):
        prefill = request.model_copy(deep=True)
        prefill.request_id = request.request_id
        prefill.kv_transfer_params = push_prefill_params(reuse=_reuse(request))
        _one_token(prefill)
        _misrouted(prefill)
        return prefill

    def prepare_decode_request(self, *, request, peer, prefill_response):
        prefill_peer = PeerIdentity.from_metadata(peer)
        decode = request.model_copy(deep=True)
        decode.request_id = request.request_id
        decode.kv_transfer_params = push_decode_params(
            prefill_peer, engine_request_id(_endpoint(request), request.request_id), reuse=_reuse(request)
        )
        return decode


class NixlPullBackend(DefaultPDProtocolMixin, _RendezvousNixlBackend):
    """Pull: prefill keeps its blocks; decode READs them using prefill's response."""

    def prepare_prefill_request(self, *, request, peer):
        prefill = super().prepare_prefill_request(request=request, peer=peer)
        prefill.kv_transfer_params = pull_prefill_params()
        _one_token(prefill)
        _misrouted(prefill)
        return prefill


BACKENDS = {
    CONNECTOR_CLASS[TransferMode.PUSH]: f"{__name__}:NixlPushBackend",
    CONNECTOR_CLASS[TransferMode.PULL]: f"{__name__}:NixlPullBackend",
}


def register_backends() -> None:
    """Register our backends with Ray's cluster-wide registry (idempotent)."""
    for name, path in BACKENDS.items():
        if not KVConnectorBackendFactory.is_registered(name):
            KVConnectorBackendFactory.register_backend(name, path)
