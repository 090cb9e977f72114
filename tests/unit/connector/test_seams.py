"""Pins of the Ray Serve LLM and vLLM internals we build on.

An upgrade that moves any of these fails here, in seconds, instead of at runtime inside
a replica. Nothing is started: Ray modules are imported, never ``ray.init``.
"""

from __future__ import annotations

import ast
import asyncio
import types
import inspect
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
import vllm
import vllm.envs
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest
from ray.llm._internal.serve.core.server.builder import build_llm_deployment
from ray.llm._internal.serve.engines.vllm.kv_transfer import base as ray_kv_base
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import BaseConnectorBackend
from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDDecodeServer, PDPrefillServer

from app.config.args import AppArgs
from app.config.llm_configs import llm_config
from connector.engine_env import SETTINGS_KEY, EngineSettings, engine_env
from connector.params import (
    CONNECTOR_CLASS,
    PeerIdentity,
    TransferMode,
    pull_prefill_params,
    push_decode_params,
    push_prefill_params,
)
from connector.ports import Role
import connector.ray_backend as ray_backend
from connector.ray_backend import BACKENDS, NixlPullBackend, NixlPushBackend, register_backends
from connector.upgrade_check import assigned_on_self
from tests.support.decode_server import decode_server, drain

VLLM_DIR = Path(vllm.__file__).parent
PEER = PeerIdentity(engine_id="prefill-r0-10.0.0.5-20000-abc123", host="10.0.0.5", port=20000, tp_size=2, pp_size=1)


# --------------------------------------------------------------------------- versions


def test_pinned_versions():
    assert ray.__version__ == "2.60.0"
    assert vllm.__version__ == seams.PINNED["vllm"], vllm.__version__


# --------------------------------------------------------------------------- Ray: connector backend protocol


def test_base_connector_backend_protocol():
    assert BaseConnectorBackend.requires_peer_binding is False
    assert BaseConnectorBackend.concurrent_handoff is False
    assert {"prepare_prefill_request", "prepare_decode_request"} <= BaseConnectorBackend.__abstractmethods__
    for method, params in [
        ("prepare_prefill_request", ["request", "peer"]),
        ("prepare_decode_request", ["request", "peer", "prefill_response"]),
    ]:
        signature = inspect.signature(getattr(BaseConnectorBackend, method))
        names = [n for n in signature.parameters if n != "self"]
        assert names == params, (method, names)
        kinds = {signature.parameters[n].kind for n in names}
        assert kinds == {inspect.Parameter.KEYWORD_ONLY}, (method, kinds)
    # Our backends fill in the protocol: both are concrete.
    for cls in (NixlPushBackend, NixlPullBackend):
        assert not getattr(cls, "__abstractmethods__", frozenset()), cls
        assert inspect.signature(cls.prepare_prefill_request).parameters.keys() == inspect.signature(
            BaseConnectorBackend.prepare_prefill_request
        ).parameters.keys()
        assert inspect.signature(cls.prepare_decode_request).parameters.keys() == inspect.signature(
            BaseConnectorBackend.prepare_decode_request
        ).parameters.keys()


def test_base_backend_helpers_we_use():
    assert callable(ray_kv_base.clamp_request_to_single_token)
    assert hasattr(ray_kv_base, "DefaultPDProtocolMixin")
    assert isinstance(inspect.getattr_static(BaseConnectorBackend, "kv_transfer_config"), property)
    assert "llm_config" in inspect.signature(BaseConnectorBackend.__init__).parameters
    for name in ("setup", "replica_metadata"):
        assert callable(getattr(BaseConnectorBackend, name))


def test_our_backend_flags():
    assert NixlPushBackend.requires_peer_binding is True
    assert NixlPushBackend.concurrent_handoff is True
    assert NixlPullBackend.requires_peer_binding is False
    assert NixlPullBackend.concurrent_handoff is False


def test_backend_factory_api():
    for name in ("register_backend", "is_registered", "get_backend_class", "create_backend"):
        assert callable(getattr(KVConnectorBackendFactory, name)), name
    assert list(inspect.signature(KVConnectorBackendFactory.register_backend).parameters) == ["name", "backend_class_or_path"]


def test_llmconfig_creates_the_backend_by_kv_connector_name():
    """Ray looks up ``kv_transfer_config['kv_connector']``: the names we register under."""
    source = inspect.getsource(LLMConfig._setup_kv_connector_backend)
    assert 'kv_transfer_config.get("kv_connector")' in source
    assert "KVConnectorBackendFactory.create_backend" in source
    assert set(BACKENDS) == set(CONNECTOR_CLASS.values())


@pytest.fixture
def registered_backends():
    fresh = [name for name in BACKENDS if not KVConnectorBackendFactory.is_registered(name)]
    register_backends()
    yield
    for name in fresh:
        KVConnectorBackendFactory.unregister_backend(name)


def test_registered_backends_resolve_to_our_classes(registered_backends):
    assert not ray.is_initialized()  # the registry works process-locally without Ray
    register_backends()  # idempotent
    assert KVConnectorBackendFactory.get_backend_class(CONNECTOR_CLASS[TransferMode.PUSH]) is NixlPushBackend
    assert KVConnectorBackendFactory.get_backend_class(CONNECTOR_CLASS[TransferMode.PULL]) is NixlPullBackend


def test_engine_config_shares_kv_transfer_config_with_llm_config():
    """setup() writes engine_id into kv_transfer_config in place; the engine must see it."""
    config = LLMConfig.model_validate(llm_config(AppArgs.parse({}), Role.PREFILL, "/some/path"))
    engine_config = config.get_engine_config()
    ktc = config.engine_kwargs["kv_transfer_config"]
    assert engine_config.engine_kwargs["kv_transfer_config"] is ktc
    assert engine_config.get_initialization_kwargs()["kv_transfer_config"] is ktc


# --------------------------------------------------------------------------- Ray: PD servers and builder


def test_pd_servers():
    assert callable(PDDecodeServer._pd_handle_request)
    assert callable(PDDecodeServer._concurrent_decode)
    assert list(inspect.signature(PDDecodeServer._pd_handle_request).parameters) == ["self", "request", "raw_request_info"]
    for method in ("chat", "completions"):
        assert list(inspect.signature(getattr(PDDecodeServer, method)).parameters) == ["self", "request", "raw_request_info"]
    assert "prefill_server" in inspect.signature(PDDecodeServer.__init__).parameters
    assert callable(PDPrefillServer.record_replica_metadata)


def test_the_ingress_streams_through_the_method_we_wrap():
    """``app.ingress.server.Ingress`` wraps the StreamingResponse that upstream's
    ``_process_llm_request`` returns, and every generation endpoint goes through it."""
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

    method = OpenAiIngress._process_llm_request
    assert list(inspect.signature(method).parameters) == ["self", "body", "call_method", "raw_request"]
    assert "return StreamingResponse(" in inspect.getsource(method)
    for endpoint in (OpenAiIngress.chat, OpenAiIngress.completions):
        assert "self._process_llm_request(" in inspect.getsource(endpoint)


def test_the_ingress_calls_the_decode_deployment_through_the_method_we_extend():
    """Late binding overrides ``OpenAiIngress._get_response`` (keyword arguments; an
    async generator of the deployment's chunks) and relies on ``_process_llm_request``
    taking every generation request's first chunk from it."""
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

    method = OpenAiIngress._get_response
    assert inspect.isasyncgenfunction(method)
    params = inspect.signature(method).parameters
    assert [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY] == ["body", "call_method", "raw_request"]
    assert "self._get_response(" in inspect.getsource(OpenAiIngress._process_llm_request)


def test_the_ingress_calls_the_decode_deployment_on_the_handle_we_wrap():
    """The queue deadline (app.ingress.server) wraps the handle ``_get_configured_serve_handle`` returns;
    upstream calls ``options(...)`` on it and then ``<method>.remote(...)``, and a handle call's
    response can be cancelled."""
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress
    from ray.serve.handle import DeploymentResponseGenerator

    assert list(inspect.signature(OpenAiIngress._get_configured_serve_handle).parameters) == ["self", "model_id"]
    source = inspect.getsource(OpenAiIngress._get_response)
    assert "model_handle = self._get_configured_serve_handle(model_id)" in source
    assert "model_handle = model_handle.options(session_id=session_id)" in source
    assert "getattr(model_handle, call_method).remote(" in source
    assert callable(DeploymentResponseGenerator.cancel)


def test_vllm_descriptor_layout_and_receive_failure_the_kv_checksums_rely_on():
    """connector.kv_checksum sums the memory each NIXL descriptor covers and fails a receive as vLLM does."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker, push_worker

    from connector.kv_checksum import KvChecksums

    # Descriptors: rows of (address, length, device); all-attention descriptor ids are region * num_blocks + block
    # (every region num_blocks long, unless told otherwise; one KV cache group: no region-to-group mapping).
    desc_ids = inspect.getsource(base_worker.NixlBaseConnectorWorker._compute_desc_ids)
    assert "region_num_blocks = [num_blocks] * num_desc_regions" in desc_ids
    assert "region_offsets = np.cumsum([0, *region_num_blocks[:-1]])" in desc_ids
    assert "return (region_offsets[:, None] + block_arr).ravel()" in desc_ids
    assert "self.src_blocks_data = (" in inspect.getsource(base_worker.NixlBaseConnectorWorker.register_kv_caches)
    assert "self.device_kv_caches = kv_caches" in inspect.getsource(base_worker.NixlBaseConnectorWorker.register_kv_caches)
    # A failed receive: what _pop_done_transfers returns as failed (and what is queued on _failed_recv_reqs) is
    # reported finished with its blocks invalid, in the same get_transfer_results, after the notifications.
    results = inspect.getsource(base_worker.NixlBaseConnectorWorker.get_transfer_results)
    popped = results.index("done_recving, newly_failed = self._pop_done_transfers(self._recving_transfers)")
    assert results.index("self._get_new_notifs()") < popped < results.index("self._recv_failures.update(newly_failed)")
    assert popped < results.index("self._failed_recv_reqs.empty()") < results.index("done_recving.update(failed_recv_reqs)")
    assert "self._invalid_block_ids.put(set(meta.local_block_ids[0]))" in results
    # Push: a completion notification makes an empty transfer entry, popped as done.
    assert "self._recving_transfers.setdefault(req_id, [])" in inspect.getsource(push_worker.NixlPushConnectorWorker._get_new_notifs)
    # A remote engine's agents are keyed by (pp rank, tp rank).
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_worker

    assert "self._remote_agents[dst_engine_id][(0, remote_rank)]" in inspect.getsource(pull_worker)
    # D->P: the registration decode sends carries the offer our scheduler added (connector.push_reuse).
    assert "notif_msg = PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(reg_data)" in inspect.getsource(
        push_worker.NixlPushConnectorWorker._do_send_reg_notif)


def test_build_llm_deployment_signature():
    params = inspect.signature(build_llm_deployment).parameters
    for name in ("name_prefix", "bind_kwargs", "deployment_cls"):
        assert name in params, name
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY


def test_decode_server_gives_each_request_a_fresh_transfer_id():
    from app.decode.server import DecodeServer
    from app.prefill.server import PrefillServer

    assert issubclass(DecodeServer, PDDecodeServer) and issubclass(PrefillServer, PDPrefillServer)
    server = decode_server()
    # As the ingress hands them over: request_id is a default, not explicitly set.
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    completion = CompletionRequest(model="m", prompt="hi")
    assert "request_id" not in chat.model_fields_set | completion.model_fields_set
    original_ids = (chat.request_id, completion.request_id)

    assert drain(server, "chat", chat, "raw") == ["remote-chunk"]
    drain(server, "chat", chat)
    drain(server, "completions", completion)
    ids = [request.request_id for request, _ in server.seen]
    assert all(i.startswith("rdv-") for i in ids) and len(set(ids)) == 3
    # Explicitly set, so Ray's LLMServer does not replace it with Serve's request id.
    assert all("request_id" in request.model_fields_set for request, _ in server.seen)
    assert server.seen[0][1] == "raw"
    assert (chat.request_id, completion.request_id) == original_ids  # originals untouched
    assert not set(ids) & set(original_ids)


def test_decode_server_counts_load_while_a_request_is_in_flight():
    server = decode_server(prompt_tokens=40)
    drain(server, "completions", CompletionRequest(model="m", prompt="hi", max_tokens=10))
    assert server.load == [(1, 50)]
    assert (server._ongoing, server._tokens_in_flight) == (0, 0)


@pytest.fixture
def local_engine(monkeypatch):
    """Decode's own engine (``LLMServer.chat``) answers ``local-chunk``."""
    from ray.llm._internal.serve.core.server.llm_server import LLMServer

    async def local_chat(self, request, raw=None):
        async def gen():
            yield "local-chunk"

        return gen()

    monkeypatch.setattr(LLMServer, "chat", local_chat)


def _hi(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kwargs)


@pytest.mark.parametrize("prompt_tokens, expected", [(3, "local"), (15, "local"), (16, "remote"), (400, "remote")])
def test_decode_server_prefills_short_prompts_locally(local_engine, prompt_tokens, expected):
    server = decode_server(local_below=16, prompt_tokens=prompt_tokens)
    assert drain(server, "chat", _hi()) == [f"{expected}-chunk"] and server.paths == [expected]


@pytest.mark.parametrize("request_, prompt_tokens, expected", [
    (_hi(n=2), 400, "local"),
    (_hi(max_tokens=4000), 400, "remote"),  # 400 + 4000 > the fake's 4096: vLLM bounds the output, not a refusal
    (_hi(max_tokens=3000), 400, "remote"),
    (_hi(max_tokens=1), 4096, "local"),  # no room for one token: decode's engine refuses it
])
def test_decode_server_serves_alone_what_a_prefill_leg_cannot(local_engine, request_, prompt_tokens, expected):
    server = decode_server(prompt_tokens=prompt_tokens)
    assert drain(server, "chat", request_) == [f"{expected}-chunk"] and server.paths == [expected]


def test_llm_server_keeps_an_explicitly_set_request_id(monkeypatch):
    """Both legs must reach their engines under our transfer id, not Serve's per-replica id."""
    from ray.llm._internal.serve.core.server import llm_server

    monkeypatch.setattr(llm_server, "get_serve_request_id", lambda: "serve-id")
    stamp = llm_server.LLMServer._maybe_add_request_id_to_request
    explicit = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], request_id="rdv-x")
    implicit = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    asyncio.run(stamp(None, explicit))
    asyncio.run(stamp(None, implicit))
    assert explicit.request_id == "rdv-x"
    assert implicit.request_id == "serve-id"


def test_vllm_engine_makes_the_request_id_the_x_request_id_header():
    """vLLM's OpenAI layer prefers X-Request-Id; Ray overwrites a client's with ours."""
    from ray.llm._internal.serve.core.protocol import RawRequestInfo
    from ray.llm._internal.serve.engines.vllm.vllm_engine import _canonicalize_request_id_header

    raw = RawRequestInfo(headers={"X-Request-Id": "client-chosen", "other": "kept"})
    headers = _canonicalize_request_id_header(SimpleNamespace(request_id="rdv-x"), raw).headers
    assert headers == {"x-request-id": "rdv-x", "other": "kept"}
    assert _canonicalize_request_id_header(SimpleNamespace(request_id="rdv-x"), None).headers == {"x-request-id": "rdv-x"}


# --------------------------------------------------------------------------- vLLM


@pytest.mark.parametrize(
    "name",
    [
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CPU_OMP_THREADS_BIND",
    ],
)
def test_vllm_reads_the_env_we_set(name):
    assert name in vllm.envs.environment_variables


def _push_sources() -> str:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata, push_scheduler

    return inspect.getsource(push_scheduler) + inspect.getsource(metadata)


@pytest.mark.parametrize("key", [k for k in push_decode_params(PEER, "chatcmpl-rdv-x") if k != "pp_size"])
def test_vllm_push_scheduler_reads_our_decode_keys(key):
    source = _push_sources()
    assert f'"{key}"' in source or f"'{key}'" in source, f"vLLM's NIXL push path no longer reads {key!r}"


def test_our_decode_leg_has_every_key_vllms_push_scheduler_requires():
    """The reverse direction: every ``params["..."]`` the decode side reads, we send."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import push_scheduler

    tree = ast.parse(inspect.getsource(push_scheduler))
    function = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "update_state_after_alloc"
    )
    required = {
        node.slice.value
        for node in ast.walk(function)
        if isinstance(node, ast.Subscript)
        and isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and node.value.id == "params"
        and isinstance(node.slice, ast.Constant)
    }
    assert required, "found no required keys; the scanner is out of date"
    missing = required - set(push_decode_params(PEER, "chatcmpl-rdv-x"))
    assert not missing, f"vLLM's push scheduler requires {sorted(missing)}"


@pytest.mark.parametrize(
    "path, prefix",
    [
        ("entrypoints/openai/chat_completion/serving.py", 'f"chatcmpl-{self._base_request_id(raw_request, request.request_id)}"'),
        ("entrypoints/openai/completion/serving.py", 'f"cmpl-{self._base_request_id(raw_request, request.request_id)}"'),
    ],
)
def test_vllm_internal_request_id_prefixes(path, prefix):
    """connector.params.engine_request_id assumes these prefixes (remote_request_id)."""
    assert prefix in (VLLM_DIR / path).read_text()


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


def test_chat_prompts_are_counted_in_tokens_not_in_encoding_keys():
    """transformers 5's apply_chat_template returns a BatchEncoding unless told otherwise;
    its len() is 2 (its keys), which once sent every chat request down the local path."""
    from transformers import AutoTokenizer

    from app.model_source import resolve_model_source
    from app.decode.server import DecodeServer

    server = DecodeServer.__new__(DecodeServer)
    server._tokenizer = AutoTokenizer.from_pretrained(resolve_model_source("embedded"))
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Why is the sky blue? " * 10}])
    expected = server._tokenizer.apply_chat_template(
        [{"role": "user", "content": "Why is the sky blue? " * 10}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert server._prompt_token_ids(chat) == list(expected) and len(expected) > 60


def test_without_a_tokenizer_every_request_is_disaggregated():
    server = decode_server(local_below=16)
    del server._prompt_token_ids  # the real one: no tokenizer, length unknown
    drain(server, "completions", CompletionRequest(model="m", prompt="hi"))
    assert server.paths == ["remote"]


# --------------------------------------------------------------------------- handoff deadline (app/decode/handoff.py)


def test_ray_calls_the_concurrent_decode_we_override():
    from ray.llm._internal.serve.serving_patterns.prefill_decode import pd_server

    from app.decode.server import DecodeServer

    ours = inspect.signature(DecodeServer._concurrent_decode)
    theirs = inspect.signature(pd_server.PDOrchestratorMixin._concurrent_decode)
    assert list(ours.parameters) == list(theirs.parameters)
    source = inspect.getsource(pd_server.PDOrchestratorMixin._pd_handle_request)
    assert "self._concurrent_decode(" in source and "cancel_on_failure=False" in source
    assert inspect.iscoroutinefunction(pd_server._drain_prefill)


def test_serve_hands_a_router_every_change_of_the_published_stats():
    """app.routing.prefill_router overrides update_replicas to read the prefill cost the replicas publish: Serve must call it
    with each replica's latest routing stats, and broadcast a change of the stats alone (it is in the replica's hash)."""
    from ray.serve._private import common
    from ray.serve._private.request_router import replica_wrapper, request_router

    shim = inspect.getsource(request_router.RequestRouter._update_running_replicas)
    assert "wrapper.update_replica_info(r)" in shim and "return self.update_replicas(replica_wrappers)" in shim
    assert "str(self.routing_stats)" in inspect.getsource(common.RunningReplicaInfo)
    assert "self._replica_info.routing_stats" in inspect.getsource(replica_wrapper.RunningReplica.routing_stats.fget)


# --------------------------------------------------------------------------- push connector overrides (connector/push_deadline.py, push_reuse.py)


def test_vllm_push_internals_our_overrides_use():
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
        base_scheduler,
        base_worker,
        connector,
        pull_worker,
        push_scheduler,
        push_worker,
    )
    from vllm.v1.core.sched import scheduler

    # The WRITE's start: sent from the one method that issues push WRITEs, to the agents vLLM notifies.
    assert "self._xfer_blocks_for_req(req_id=request_id, meta=push_meta)" in inspect.getsource(
        push_worker.NixlPushConnectorWorker._do_start_push_kv)
    assert '"WRITE",' in inspect.getsource(push_worker.NixlPushConnectorWorker)
    assert "self.nixl_wrapper.send_notif(agent_name, notif_msg=" in inspect.getsource(push_worker)
    assert "self._remote_agents.get(engine_id)" in inspect.getsource(push_worker)
    # State the overrides read, by name.
    assert "self._push_pending_registrations[request.request_id] = {" in inspect.getsource(push_scheduler)
    worker_source = inspect.getsource(push_worker) + inspect.getsource(base_worker)
    for name in (
        "_recving_metadata", "_recving_transfers", "_pending_d_registrations", "consumer_notification_counts_by_req",
        "_pending_completion_notifs", "_physical_blocks_per_logical_kv_block",
    ):
        assert f"self.{name}" in worker_source, name
    # A receive that will never land, failed as upstream's push worker fails one from its threads.
    assert "self._failed_recv_reqs.put(" in inspect.getsource(push_worker)
    # Registration fields prefill reads from decode's PUSH_REG payload (a withdrawal keeps the addressing).
    from connector.push_deadline import _ADDRESSING

    for key in ("local_block_ids", *_ADDRESSING):
        assert f'"{key}":' in inspect.getsource(push_scheduler), key
    # A withdrawal: decode's scheduler stages it as a registration, its worker's writer thread sends
    # each staged one in order; an aborted request waiting for KV has computed nothing (vLLM sets the
    # count once its KV landed) and reaches the connector's request_finished with its blocks held.
    assert "self._reg_send_inbox.put((req_id, reg_data))" in inspect.getsource(push_worker.NixlPushConnectorWorker.start_load_kv)
    assert "request.num_computed_tokens = request.num_tokens - 1" in inspect.getsource(scheduler.Scheduler)
    assert "delay_free_blocks = (" in inspect.getsource(scheduler.Scheduler.finish_requests)
    # Reuse: vLLM's pull READ, borrowed as is; a None match means "ask again next step";
    # worker metadata reaches the scheduler-side connector; the recompute threshold key.
    assert list(inspect.signature(pull_worker.NixlPullConnectorWorker._read_blocks_for_req).parameters) == ["self", "req_id", "meta"]
    assert "if ext_tokens is None:" in inspect.getsource(scheduler)
    assert "self.connector.update_connector_output(kv_connector_output)" in inspect.getsource(scheduler)
    assert '"kv_recompute_threshold", 64' in inspect.getsource(base_scheduler)
    # The connector builds its scheduler and worker in __init__ under these attribute names.
    init = inspect.getsource(connector.NixlPushConnector.__init__)
    assert "self.connector_scheduler = NixlPushConnectorScheduler(" in init
    assert "self.connector_worker = NixlPushConnectorWorker(" in init
    assert KVTransferConfig(kv_load_failure_policy="recompute").kv_load_failure_policy == "recompute"


def test_vllm_engine_loop_internals_the_idle_wait_relies_on():
    """connector.idle_wait: where the engine core sleeps, what wakes it, what it reads."""
    import queue

    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import push_scheduler, push_worker
    from vllm.v1.core.sched import scheduler
    from vllm.v1.engine import core
    from vllm.v1.executor import multiproc_executor
    from vllm.v1.request import Request

    # The input queue exists before the engine core builds its scheduler (and our connector); the thread that
    # feeds it, whose target is how connector.idle_wait.engine_core finds the core, starts after.
    init = inspect.getsource(core.EngineCoreProc.__init__)
    assert 0 <= init.index("self.input_queue = queue.Queue") < init.index("super().__init__("), "input_queue moved"
    assert init.index("super().__init__(") < init.index("target=self.process_input_sockets,") < init.index(
        "input_thread.start()")
    assert "self._target = target" in inspect.getsource(threading.Thread.__init__)
    assert "self.input_queue.put_nowait(" in inspect.getsource(core.EngineCoreProc)  # every input: hooked via put
    assert "self.put(item, block=False)" in inspect.getsource(queue.Queue.put_nowait)
    assert issubclass(core.DPEngineCoreProc, core.EngineCoreProc)  # data parallel: never waits
    assert "KVConnectorFactory.create_connector(" in inspect.getsource(scheduler.Scheduler.__init__)
    # Every request the scheduler holds is announced to the connector (our idle wait keeps its own list).
    assert "self.connector.on_new_request(request)" in inspect.getsource(scheduler.Scheduler.add_request)
    assert "total_num_scheduled_tokens" in inspect.getsource(scheduler.Scheduler.schedule)
    assert "self.arrival_time" in inspect.getsource(Request.__init__)  # prefill's "queued" stamp
    # The worker's RPC reader spins for busy_loop_s after each message, then waits on a socket.
    assert "current_time <= self.last_read + self.busy_loop_s" in inspect.getsource(shm_broadcast.SpinCondition.wait)
    assert "self._spin_condition = SpinCondition(" in inspect.getsource(shm_broadcast.MessageQueue.__init__)
    # The worker's RPC reader is the death-pipe thread's first argument (connector.idle_wait.rpc_reader).
    monitor = inspect.getsource(multiproc_executor.WorkerProc.monitor_death_pipe)
    assert 'name="DeathPipeMonitor"' in monitor and "self._args = args" in inspect.getsource(threading.Thread.__init__)
    main = inspect.getsource(multiproc_executor.WorkerProc.worker_main)
    assert main.index("worker.monitor_death_pipe(") < main.index("worker.worker_busy_loop("), "watched after the first step"
    assert "self._execute_worker_rpc(self.rpc_broadcast_mq.dequeue(" in inspect.getsource(multiproc_executor.WorkerProc)
    # The writer thread: an untimed wait on the wake event; completion notifications forwarded by put.
    loop = inspect.getsource(push_worker.NixlPushConnectorWorker._push_writer_loop)
    assert "self._push_writer_wake.wait()" in loop and "self._pending_completion_notifs.put(notif)" in loop
    for name in ("_push_registration_deadlines", "_finished_request_blocks"):
        assert f"self.{name}" in inspect.getsource(push_scheduler.NixlPushConnectorScheduler), name


def test_vllm_pull_read_back_internals_we_rely_on():
    """conversations.pull_history: upstream (app.decode.server, connector.pull_history)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker, connector, pull_scheduler
    from vllm.entrypoints.openai.chat_completion import serving as chat_serving

    finished = inspect.getsource(pull_scheduler.NixlPullConnectorScheduler.request_finished)
    assert "if is_d_node and not self.is_bidirectional_kv_xfer_enabled:" in finished  # the flag we lower per request
    for key in ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_num_tokens"):
        assert f"{key}=" in finished, key  # decode's offer, which the next prefill leg carries
    matched = inspect.getsource(pull_scheduler.NixlPullConnectorScheduler.get_num_new_matched_tokens)
    assert 'params.get("remote_num_tokens")' in matched  # how much prefill loads: our verified count
    # Local and remote blocks pair from the end: the offer's list is cut, not just the count.
    assert "prefill_block_ids[i] = prefill_group[-num_decode_blocks:]" in inspect.getsource(base_worker)
    assert '"bidirectional_kv_xfer", False' in inspect.getsource(connector)
    assert "kv_transfer_params=final_res.kv_transfer_params" in inspect.getsource(chat_serving)  # not in streams


def test_vllm_sends_a_steps_outputs_after_the_worker_metadata_the_pull_sums_ride_in():
    """connector.pull_checksum: prefill's workers sum a leg's blocks after the step that completes its
    prompt; the scheduler adds the sums to the params dict request_finished returned in that step."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_scheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    step = inspect.getsource(Scheduler.update_from_output)
    finished = step.index("kv_transfer_params, ec_transfer_params = self._free_request(request)")
    assert finished < step.index("kv_transfer_params=kv_transfer_params,")  # the same dict, in the output
    assert finished < step.index("self._update_from_kv_xfer_finished(kv_connector_output)")
    assert "self.connector.update_connector_output(kv_connector_output)" in inspect.getsource(
        Scheduler._update_from_kv_xfer_finished)
    # The pull scheduler's prefill params are a fresh dict it returns (ours is that object).
    assert "return delay_free_blocks, dict(" in inspect.getsource(pull_scheduler.NixlPullConnectorScheduler.request_finished)


def test_nixl_agents_keep_an_idle_progress_thread_off_the_cpu():
    """nixl_agent.__init__ sets pthrDelay = 0 (a busy-polling progress thread once
    connected); connector.nixl_progress swaps in a config class that keeps it at or above its floor.
    Two real agents, one WRITE between them, then idle: the spin cost ~2 cores here."""
    import sys
    import time

    import numpy as np
    from vllm.distributed import nixl_utils

    from connector.nixl_progress import PROGRESS_POLL_US, calm_progress_threads

    agent_cls = nixl_utils.NixlWrapper
    assert "pthrDelay = 0" in inspect.getsource(agent_cls.__init__)  # the seam: still hard-coded
    assert calm_progress_threads() and calm_progress_threads()  # idempotent
    assert not calm_progress_threads(["GDS"])  # a backend whose progress thread we have not read: left as NIXL sets it
    assert calm_progress_threads(["LIBFABRIC"])  # it spun a core per agent (tests/unit/connector/test_nixl_progress.py)
    config = sys.modules[agent_cls.__module__].nixlBind.nixlAgentConfig()
    config.pthrDelay = 0
    assert config.pthrDelay == PROGRESS_POLL_US

    a = agent_cls("seam-a", nixl_utils.nixl_agent_config(num_threads=4))
    b = agent_cls("seam-b", nixl_utils.nixl_agent_config(num_threads=4))
    src, dst = np.ones(1 << 20, dtype=np.uint8), np.zeros(1 << 20, dtype=np.uint8)
    for agent, buf in ((a, src), (b, dst)):
        agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    handle = a.initialize_xfer(
        "WRITE", a.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM"),
        b.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM"), "seam-b", b"done",
    )
    a.transfer(handle)
    deadline = time.monotonic() + 30
    while a.check_xfer_state(handle) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
    a.release_xfer_handle(handle)
    assert dst[-1] == 1, "the WRITE did not land"
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(2)
    idle_cores = (time.process_time() - cpu) / (time.monotonic() - wall)
    assert idle_cores < 0.5, f"two idle NIXL agents used {idle_cores:.2f} cores"


# --------------------------------------------------------------------------- the seams list (connector/seams.py)
# Every private upstream name we touch is an entry there; each is resolved here against the
# installed packages, and a new private use without an entry fails the scans below.

import importlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import tomllib  # noqa: E402
from importlib import metadata  # noqa: E402

from connector import seams  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
SOURCE_FILES = sorted(str(p.relative_to(REPO)) for package in ("app", "connector") for p in (REPO / package).rglob("*.py"))
UPSTREAM_PACKAGES = ("vllm", "ray", "starlette")
PRIVATE_NAME = re.compile(r"_[a-z]\w*")
PRIVATE_MODULE = re.compile(r"(ray\.llm\._internal|ray\.serve\._private|vllm)\.[\w.]+")


def _resolve(target: str):
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _class_source(klass) -> str:
    try:
        return inspect.getsource(klass)
    except (OSError, TypeError):  # builtins, C extensions
        return ""


def _class_sources(cls):
    """The source of ``cls`` and of each of its bases."""
    return [_class_source(klass) for klass in getattr(cls, "__mro__", (cls,)) if klass is not object]


def _has_attribute(cls, name: str) -> bool:
    """A class attribute, property, enum member, or an annotated (dataclass, pydantic) field."""
    if hasattr(cls, name):
        return True
    if any(name in vars(klass).get("__annotations__", {}) for klass in getattr(cls, "__mro__", ())):
        return True
    fields = getattr(cls, "model_fields", None)
    return isinstance(fields, dict) and name in fields


def _seam_problem(seam: seams.Seam) -> str | None:
    """None if the seam is as listed, else what changed (completes "<where> ...")."""
    try:
        obj = _resolve(seam.target)
    except (ImportError, AttributeError) as exc:
        return f"cannot be reached: {seam.target} no longer resolves ({exc!r})"
    name = seam.attribute
    if seam.kind in ("import", "behaviour"):
        ok = hasattr(obj, name)
    elif seam.kind == "method":
        ok = callable(getattr(obj, name, None))
    elif seam.kind == "attribute":
        ok = _has_attribute(obj, name)
    elif seam.kind == "instance":
        ok = any(name in assigned_on_self(source) for source in _class_sources(obj))
    elif seam.kind == "global":
        ok = hasattr(sys.modules[obj.__module__], name)
    else:
        return f"has an unknown kind {seam.kind!r}"
    if not ok:
        return "is gone" if seam.kind != "instance" else f"is gone (no `self.{name} = ...` in {seam.target} or its bases)"
    if seam.snippet is not None and seam.snippet not in inspect.getsource(obj):
        return f"changed shape: {seam.target}'s source no longer contains {seam.snippet!r}"
    return None


@pytest.mark.parametrize("seam", seams.SEAMS, ids=lambda s: f"{s.library}:{s.where}")
def test_seam(seam):
    problem = _seam_problem(seam)
    assert problem is None, seam.changed(problem)


def test_seam_messages_say_what_changed_and_what_to_reread():
    seam = next(s for s in seams.SEAMS if s.attribute == "_is_hma_required")
    message = seam.changed("is gone")
    assert message.startswith(f"vllm {seams.PINNED['vllm']} seam changed: NixlBaseConnectorWorker._is_hma_required (instance")
    assert "Re-read connector/vllm_connectors.py" in message and "silently" in message
    gone = _seam_problem(seams.Seam("vllm", "vllm.v1.request:Request", "_no_such_name", "instance", ("x.py",), "test"))
    assert gone.startswith("is gone (no `self._no_such_name = ...` in vllm.v1.request:Request")
    moved = _seam_problem(seams.Seam("ray", "ray.serve:NoSuchClass", "x", "method", ("x.py",), "test"))
    assert "no longer resolves" in moved
    reshaped = _seam_problem(seams.Seam("vllm", "vllm.v1.request:Request", "arrival_time", "instance", ("x.py",), "test",
                                        snippet="no such text"))
    assert reshaped.startswith("changed shape")


def test_the_seams_module_is_pure_data():
    """Read by people and by tests: it must import nothing heavy (and connector/ never imports app)."""
    tree = ast.parse((REPO / "connector/seams.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "dataclasses"}, f"connector/seams.py imports {sorted(imported)}"


def _test_exists(reference: str) -> bool:
    path, _, name = reference.partition("::")
    file = REPO / path
    return file.is_file() and re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M) is not None


def test_the_seams_list_is_well_formed():
    problems = []
    keys = [(s.target, s.attribute) for s in seams.SEAMS]
    problems += [f"listed twice: {k}" for k in sorted({k for k in keys if keys.count(k) > 1})]
    for seam in seams.SEAMS:
        if seam.kind not in seams.KINDS or seam.library not in seams.PINNED:
            problems.append(f"{seam.where}: kind {seam.kind!r} / library {seam.library!r} unknown")
        if not seam.used_by or not seam.why:
            problems.append(f"{seam.where}: say who uses it and why")
        if seam.checked_by and not _test_exists(seam.checked_by):
            problems.append(f"{seam.where}: checked_by names a test that does not exist: {seam.checked_by}")
        if seam.kind == "behaviour" and not seam.checked_by:
            problems.append(f"{seam.where}: a behaviour seam needs the test that checks it (checked_by)")
        for rel in seam.used_by:
            if not (REPO / rel).is_file():
                problems.append(f"{seam.where}: used_by names a missing file {rel}")
            elif seam.kind != "behaviour" and seam.attribute not in (REPO / rel).read_text():
                problems.append(f"{seam.where}: {rel} no longer mentions {seam.attribute!r}: drop it from used_by "
                                "(or the entry, if nothing uses it any more)")
    assert not problems, "connector/seams.py:\n" + "\n".join(problems)


def test_our_composed_classes_override_vllm_hooks_with_vllms_signatures():
    """connector.push_connector / pull_connector override each hook once: with the parameters vLLM passes."""
    from connector.pull_connector import PullScheduler, PullWorker
    from connector.push_connector import PushScheduler, PushWorker

    checked = 0
    for ours in (PushScheduler, PushWorker, PullScheduler, PullWorker):
        upstream = ours.__bases__[0]
        for name, fn in vars(ours).items():
            if inspect.isfunction(fn) and fn.__qualname__.startswith(ours.__name__ + ".") and hasattr(upstream, name):
                checked += 1
                assert list(inspect.signature(fn).parameters) == list(
                    inspect.signature(getattr(upstream, name)).parameters), f"{upstream.__name__}.{name} changed"
    assert checked >= 20, f"only {checked} overrides found: the scan is out of date"


def test_the_borrowed_pull_read_finds_everything_it_reads_on_the_push_worker():
    """push_connector.PushWorker borrows vLLM's pull READ as plain functions: whatever they read
    on ``self`` must exist on a push worker too (set by the base worker, or a method)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    from connector.push_connector import PushWorker as ReuseWorker

    borrowed = {
        name: fn for name, fn in vars(ReuseWorker).items()
        if inspect.isfunction(fn) and fn.__qualname__.startswith(f"{NixlPullConnectorWorker.__name__}.")
    }
    assert borrowed, "PushWorker borrows nothing from the pull worker any more: update connector/seams.py"
    upstream = [k for k in ReuseWorker.__mro__ if k.__module__.startswith("vllm.")]
    assert NixlPullConnectorWorker not in upstream
    assigned = set().union(*(assigned_on_self(_class_source(k)) for k in upstream))
    for name, fn in borrowed.items():
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        reads = {
            n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
        }
        missing = sorted(r for r in reads if not hasattr(ReuseWorker, r) and r not in assigned)
        assert not missing, (
            f"vllm {seams.PINNED['vllm']} seam changed: NixlPullConnectorWorker.{name}, borrowed by "
            f"connector/push_connector.py, now reads {missing}, which a push worker does not have (set only by the pull "
            "worker?): the history READ would fail at runtime. Re-read connector/push_reuse.py before upgrading."
        )


def _scan(rel: str):
    """(names our code owns, private names it reads from others with their lines, private
    names each class of ours uses on self, private names read off upstream imports)."""
    tree = ast.parse((REPO / rel).read_text())
    upstream_imports = {
        alias.asname or alias.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
        and n.module.split(".")[0] in UPSTREAM_PACKAGES for alias in n.names
    }
    owned, read, by_class, off_upstream = set(), {}, {}, {}

    def string_attr(node):  # getattr(obj, "_x", ...), hasattr(...), setattr(...)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and PRIVATE_NAME.fullmatch(node.args[1].value)):
            return node.args[1].value
        return None

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            owned.add(node.name)
        if isinstance(node, ast.Attribute) and PRIVATE_NAME.fullmatch(node.attr):
            on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if isinstance(node.ctx, ast.Store) and on_self:
                owned.add(node.attr)
            else:
                read.setdefault(node.attr, node.lineno)
            if isinstance(node.value, ast.Name) and node.value.id in upstream_imports:
                off_upstream.setdefault(node.attr, node.lineno)
        name = string_attr(node)
        if name:
            read.setdefault(name, node.lineno)
        if isinstance(node, ast.ClassDef):
            used = set()
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self"
                        and PRIVATE_NAME.fullmatch(sub.attr)):
                    used.add(sub.attr)
                if string_attr(sub) and isinstance(sub.args[0], ast.Name) and sub.args[0].id == "self":
                    used.add(string_attr(sub))
            for statement in node.body:
                if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    used.add(statement.name)
                targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
                for target in targets:
                    if isinstance(target, ast.Name):
                        owned.add(target.id)
                        used.add(target.id)
            by_class[node.name] = {n for n in used if PRIVATE_NAME.fullmatch(n)}
    return owned, read, by_class, off_upstream


def _upstream_private_names() -> dict[str, set[str]]:
    """Every upstream private name our code uses -> where. Upstream: read off an upstream
    import; read off something and never defined by us; or used by a class of ours on
    ``self`` where an upstream base class defines it (overrides, inherited state)."""
    scans = {rel: _scan(rel) for rel in SOURCE_FILES}
    owned = set().union(*(scan[0] for scan in scans.values()))
    found: dict[str, set[str]] = {}
    names_of_class = {}
    for rel, (_, read, by_class, off_upstream) in scans.items():
        for name, line in read.items():
            if name not in owned:
                found.setdefault(name, set()).add(f"{rel}:{line}")
        for name, line in off_upstream.items():
            found.setdefault(name, set()).add(f"{rel}:{line}")
        module = rel[:-3].replace("/", ".")
        for cls_name, names in by_class.items():
            names_of_class[f"{module}.{cls_name}"] = (rel, names)
    for qualified in names_of_class:
        module, cls_name = qualified.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), cls_name, None)
        if not isinstance(cls, type):
            continue
        ours = [k for k in cls.__mro__ if f"{k.__module__}.{k.__qualname__}" in names_of_class]
        theirs = [k for k in cls.__mro__ if k.__module__.split(".")[0] in UPSTREAM_PACKAGES]
        if not theirs:
            continue
        upstream_names = set().union(*(vars(k).keys() | assigned_on_self(_class_source(k)) for k in theirs))
        for klass in ours:
            rel_of_klass, names = names_of_class[f"{klass.__module__}.{klass.__qualname__}"]
            for name in names & upstream_names:
                found.setdefault(name, set()).add(f"{rel_of_klass}:{klass.__name__}")
    return found


def test_every_upstream_private_name_we_use_is_a_listed_seam():
    found = _upstream_private_names()
    assert {"_body", "_is_hma_required", "_prefill_handle", "_read_blocks"} <= set(found), (
        f"the scanner is out of date: it found only {sorted(found)}"
    )
    listed = {s.attribute for s in seams.SEAMS}
    missing = {name: sorted(where) for name, where in found.items() if name not in listed}
    assert not missing, (
        "private names of vLLM/Ray/Starlette used without an entry in connector/seams.py (add one: target, kind, "
        "used_by, why; an upgrade that moves them must fail here, not at runtime):\n"
        + "\n".join(f"  {name}: {', '.join(where)}" for name, where in sorted(missing.items()))
    )


def test_every_private_upstream_module_we_import_is_a_listed_seam():
    listed = {(s.target.partition(":")[0], s.attribute) for s in seams.SEAMS}
    modules = {s.target.partition(":")[0] for s in seams.SEAMS}
    missing, seen = [], 0
    for rel in SOURCE_FILES:
        for node in ast.walk(ast.parse((REPO / rel).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and PRIVATE_MODULE.fullmatch(node.module):
                for alias in node.names:
                    seen += 1
                    if (node.module, alias.name) not in listed and f"{node.module}.{alias.name}" not in modules:
                        missing.append(f"{rel}:{node.lineno} from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if PRIVATE_MODULE.fullmatch(alias.name):
                        seen += 1
                        if not any(m == alias.name or m.startswith(alias.name + ".") for m in modules):
                            missing.append(f"{rel}:{node.lineno} import {alias.name}")
    assert seen > 20, f"the import scan found only {seen} private imports: it is out of date"
    assert not missing, "private upstream imports without an entry in connector/seams.py:\n" + "\n".join(missing)


def test_nothing_finds_upstream_objects_up_the_call_stack():
    """Frame walks find whatever caller happens to match, and break silently when upstream calls us
    from elsewhere: upstream objects we need come from hooks or from a thread's listed seams."""
    walks = re.compile(r"sys\._getframe|inspect\.(stack|currentframe|getouterframes)|\.f_back\b|\.f_locals\b")
    found = [f"{rel}:{n}" for rel in SOURCE_FILES for n, line in enumerate((REPO / rel).read_text().splitlines(), 1)
             if walks.search(line)]
    assert not found, "frame walks: " + ", ".join(found)


def test_installed_versions_are_the_pinned_ones():
    wrong = []
    for library, pinned in seams.PINNED.items():
        if pinned is None:
            continue
        installed = {}
        for distribution in seams.DISTRIBUTIONS[library]:
            try:
                installed[distribution] = metadata.version(distribution)
            except metadata.PackageNotFoundError:
                pass
        assert installed, f"{library} is not installed (looked for {', '.join(seams.DISTRIBUTIONS[library])})"
        wrong += [f"{d} {v} is installed; connector/seams.py was read against {library} {pinned}"
                  for d, v in installed.items() if v.split("+")[0] != pinned]
    assert not wrong, (
        "\n".join(wrong) + "\nUpgrading? Run `pytest tests/unit/connector/test_seams.py`, re-read the files its failures name, "
        "then update PINNED in connector/seams.py and the pins in pyproject.toml (docs/upgrading.md)."
    )


def test_pyproject_pins_what_the_seams_were_read_against():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    pins = {}
    for requirement in requirements:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*==\s*([^\s;]+)\s*", requirement)
        if match:
            pins.setdefault(match.group(1).lower(), set()).add(match.group(2))
    for library, pinned in seams.PINNED.items():
        if pinned is None:
            continue
        versions = set().union(*(pins.get(d, set()) for d in seams.DISTRIBUTIONS[library]))
        assert versions == {pinned}, (
            f"pyproject.toml pins {library} to {sorted(versions) or 'nothing'}, connector/seams.py to {pinned}: "
            "they move together (docs/upgrading.md)"
        )


def test_ray_node_initialization_downloads_nothing_without_a_mirror():
    """app.replica.node_init skips Ray Serve LLM's per-node task where it would be a no-op: Ray's download
    returns a local path or hub id as it is, without a mirror config."""
    from ray.llm._internal.common.utils.download_utils import download_model_files

    for model_id in ("/models/SmolLM2-135M-Instruct-v1", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert download_model_files(model_id=model_id, mirror_config=None) == model_id
