"""connector/ray_backend.py: our Ray Serve LLM connector backends, their prefill and decode legs on
Ray's real request models (each one vLLM accepts) and their setup() with Ray's lookups faked.
Nothing is started."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import ray
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest

from app.config.args import AppArgs
from app.config.llm_configs import llm_config
from connector.engine_env import SETTINGS_KEY, EngineSettings, engine_env
from connector.params import PeerIdentity, pull_prefill_params, push_decode_params, push_prefill_params
from connector.ports import Role
import connector.ray_backend as ray_backend
from connector.ray_backend import NixlPullBackend, NixlPushBackend
from tests.support.connectors import PEER


# --------------------------------------------------------------------------- our backends on real request models


def _backend(cls, args: dict | None = None, role: Role = Role.DECODE):
    return cls(LLMConfig.model_validate(llm_config(AppArgs.parse(args or {}), role, "/some/path")))


def _chat(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "hello"}],
        request_id="rdv-x",
        **kwargs,
    )


def _completion(**kwargs) -> CompletionRequest:
    return CompletionRequest(model="SmolLM2-135M-Instruct", prompt="hello", request_id="rdv-x", **kwargs)


REQUESTS = [
    pytest.param(_chat, "chatcmpl-rdv-x", id="chat"),
    pytest.param(_completion, "cmpl-rdv-x", id="completions"),
]


@pytest.mark.parametrize("make, _", REQUESTS)
@pytest.mark.parametrize("stream", [True, False])
def test_push_prefill_leg(make, _, stream):
    backend = _backend(NixlPushBackend)
    request = make(max_tokens=50, stream=stream)
    before = request.model_dump()
    prefill = backend.prepare_prefill_request(request=request, peer=PEER.to_metadata())
    assert prefill is not request
    assert prefill.max_tokens == 1
    assert prefill.stream is False
    assert prefill.kv_transfer_params == push_prefill_params()
    assert prefill.request_id == "rdv-x"
    assert "request_id" in prefill.model_fields_set
    assert request.model_dump() == before


def test_push_prefill_leg_clamps_chat_specific_fields():
    request = _chat(max_completion_tokens=50, stream=True, stream_options={"include_usage": True})
    prefill = _backend(NixlPushBackend).prepare_prefill_request(request=request, peer=PEER.to_metadata())
    assert prefill.max_completion_tokens == 1
    assert prefill.stream_options is None
    assert request.max_completion_tokens == 50 and request.stream_options is not None


@pytest.mark.parametrize("make, remote_request_id", REQUESTS)
@pytest.mark.parametrize("stream", [True, False])
def test_push_decode_leg(make, remote_request_id, stream):
    backend = _backend(NixlPushBackend)
    request = make(max_tokens=50, stream=stream)
    before = request.model_dump()
    decode = backend.prepare_decode_request(request=request, peer=PEER.to_metadata(), prefill_response=None)
    assert decode is not request
    assert decode.max_tokens == 50
    assert decode.stream is stream
    assert decode.request_id == "rdv-x"
    assert "request_id" in decode.model_fields_set
    assert decode.kv_transfer_params == push_decode_params(PEER, remote_request_id)
    assert decode.kv_transfer_params["remote_request_id"] == remote_request_id
    assert decode.kv_transfer_params["remote_engine_id"] == PEER.engine_id
    assert decode.kv_transfer_params["do_remote_prefill"] is True
    assert request.model_dump() == before
    assert request.kv_transfer_params is None


@pytest.mark.parametrize("peer", [None, {}, {"host": "10.0.0.5", "port": 20000}])
def test_push_decode_leg_without_peer_identity_is_refused(peer):
    with pytest.raises(ValueError, match="published no NIXL identity"):
        _backend(NixlPushBackend).prepare_decode_request(request=_chat(), peer=peer, prefill_response=None)


@pytest.mark.parametrize("make, _", REQUESTS)
def test_pull_legs(make, _):
    backend = _backend(NixlPullBackend, {"mode": "pull"})
    request = make(max_tokens=50, stream=True)
    before = request.model_dump()
    prefill = backend.prepare_prefill_request(request=request, peer=None)
    assert prefill.max_tokens == 1 and prefill.stream is False
    assert prefill.kv_transfer_params == pull_prefill_params()
    returned = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [1, 2]}
    decode = backend.prepare_decode_request(
        request=request, peer=None, prefill_response=SimpleNamespace(kv_transfer_params=returned)
    )
    assert decode.kv_transfer_params == returned
    assert decode.max_tokens == 50 and decode.stream is True
    assert request.model_dump() == before


@pytest.mark.parametrize("make, _", REQUESTS)
@pytest.mark.parametrize("backend_class, args", [(NixlPushBackend, {}), (NixlPullBackend, {"mode": "pull"})])
def test_prefill_leg_of_a_request_with_min_tokens_is_one_vllm_accepts(make, _, backend_class, args):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    request = make(max_tokens=50, min_tokens=8)
    prefill = _backend(backend_class, args).prepare_prefill_request(request=request, peer=PEER.to_metadata())
    SamplingParams(max_tokens=prefill.max_tokens, min_tokens=prefill.min_tokens)  # raises if it does not fit
    with pytest.raises(VLLMValidationError, match="min_tokens"):  # what the unshaped leg got (a 400)
        SamplingParams(max_tokens=prefill.max_tokens, min_tokens=request.min_tokens)
    assert request.min_tokens == 8  # decode's leg is the client's request


# --------------------------------------------------------------------------- setup(), with Ray's lookups faked


def test_backend_without_our_settings_says_how_to_build():
    raw = llm_config(AppArgs.parse({}), Role.DECODE, "/some/path")
    del raw["experimental_configs"]
    backend = NixlPushBackend(LLMConfig.model_validate(raw))
    assert backend.replica_metadata() == {}
    with pytest.raises(ValueError, match="app.builder:build_app"):
        backend.setup()


@pytest.mark.parametrize(
    "cls, role, args, rank, port, tp",
    [
        (NixlPushBackend, Role.DECODE, {}, 2, 22002, 1),
        (NixlPushBackend, Role.PREFILL, {"prefill": {"engine_kwargs": {"tensor_parallel_size": 2}}}, 0, 20000, 2),
        (NixlPullBackend, Role.PREFILL, {"mode": "pull", "engine_kwargs": {"data_parallel_size": 2}}, 3, 20006, 1),
    ],
)
def test_setup_plans_the_side_channel_and_publishes_the_identity(monkeypatch, cls, role, args, rank, port, tp):
    backend = _backend(cls, args, role)
    settings = EngineSettings.from_dict(backend.llm_config.experimental_configs[SETTINGS_KEY])
    # Register every variable setup() writes so that monkeypatch restores os.environ.
    for key in engine_env(side_channel_host="h", side_channel_port=1, user_env=settings.env):
        monkeypatch.setenv(key, "before")
    monkeypatch.setattr(ray_backend.serve, "get_replica_context", lambda: SimpleNamespace(rank=SimpleNamespace(rank=rank)))
    monkeypatch.setattr(ray_backend.ray.util, "get_node_ip_address", lambda: "10.0.0.9")
    engine_config = backend.llm_config.get_engine_config()

    backend.setup()

    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.9"
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(port)
    assert os.environ["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] == "1"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    engine_id = backend.kv_transfer_config["engine_id"]
    assert engine_id.startswith(f"{role.value}-r{rank}-10.0.0.9-{port}-")
    # Written in place: what vLLM will be started with carries the same id.
    assert engine_config.get_initialization_kwargs()["kv_transfer_config"]["engine_id"] == engine_id
    identity = PeerIdentity.from_metadata(backend.replica_metadata())
    assert identity == PeerIdentity(engine_id=engine_id, host="10.0.0.9", port=port, tp_size=tp, pp_size=1)
    assert not ray.is_initialized()


def test_setup_takes_the_next_free_port_when_its_ranks_is_held(monkeypatch, caplog):
    """Scaled down and up again, Serve gave a new decode replica the rank whose port the kept replica's engine
    binds (seen in tests/integration/test_multi_replica.py's rollouts): it takes the next free one and says so."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    base = held.getsockname()[1]
    backend = _backend(NixlPushBackend, {"nixl": {"decode_port_base": base, "prefill_port_base": base - 2000}})
    settings = EngineSettings.from_dict(backend.llm_config.experimental_configs[SETTINGS_KEY])
    for key in engine_env(side_channel_host="h", side_channel_port=1, user_env=settings.env):
        monkeypatch.setenv(key, "before")
    monkeypatch.setattr(ray_backend.serve, "get_replica_context", lambda: SimpleNamespace(rank=SimpleNamespace(rank=0)))
    monkeypatch.setattr(ray_backend.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    try:
        backend.setup()
    finally:
        held.close()
    port = int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    assert port != base and base < port < base + settings.ports.span
    assert PeerIdentity.from_metadata(backend.replica_metadata()).port == port
    assert f"port 127.0.0.1:{base} (replica rank 0's) is held by pid {os.getpid()}" in caplog.text
