"""Probes of the Ray Serve LLM, vLLM, NIXL and Starlette internals and behaviour we build on: each
reads the installed upstream's source or runs a small piece of it to pin what our code relies on
(connector/seams.py names them in ``checked_by``).

An upgrade that moves any of these fails here, in seconds, instead of at runtime inside
a replica. Nothing is started: Ray modules are imported, never ``ray.init``.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import sys
import textwrap
import threading
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
import vllm
import vllm.envs
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest
from ray.llm._internal.serve.core.server.builder import build_llm_deployment
from ray.llm._internal.serve.engines.vllm.kv_transfer import base as ray_kv_base
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import BaseConnectorBackend
from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDDecodeServer, PDPrefillServer

from app.config.args import AppArgs
from app.config.llm_configs import llm_config
from connector.params import CONNECTOR_CLASS, TransferMode, push_decode_params
from connector.ports import Role
from connector.ray_backend import BACKENDS, NixlPullBackend, NixlPushBackend, register_backends
from connector import seams
from connector.upgrade_check import assigned_on_self
from tests.support.connectors import PEER
from tests.support.source import class_source

VLLM_DIR = Path(vllm.__file__).parent


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


# --------------------------------------------------------------------------- our connector classes on vLLM's


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
    assigned = set().union(*(assigned_on_self(class_source(k)) for k in upstream))
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


# --------------------------------------------------------------------------- Ray's node initialization (app/replica/node_init.py)


def test_ray_node_initialization_downloads_nothing_without_a_mirror():
    """app.replica.node_init skips Ray Serve LLM's per-node task where it would be a no-op: Ray's download
    returns a local path or hub id as it is, without a mirror config."""
    from ray.llm._internal.common.utils.download_utils import download_model_files

    for model_id in ("/models/SmolLM2-135M-Instruct-v1", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert download_model_files(model_id=model_id, mirror_config=None) == model_id


def test_the_engines_logging_config_leaves_serves_replica_log_answering(tmp_path, monkeypatch):
    """What AsyncLLM does in the replica's process (vllm.logger.configure_logging) closes Serve's buffered
    replica-log handler, which then forgets its file: Serve's controller, recovering replicas after a head
    restart, reads that file and stops each replica that cannot say (app.replica.serve_logs). Around the
    engine's start the target is put back, and the replica's records reach the file again."""
    import logging
    from logging.handlers import MemoryHandler

    from ray.serve._private.constants import SERVE_LOGGER_NAME
    from ray.serve._private.logging_utils import get_component_logger_file_path
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    from app.replica.serve_logs import serve_log_targets_kept

    monkeypatch.setattr(ray._private.worker, "_global_node", SimpleNamespace(get_logs_dir_path=lambda: str(tmp_path)))
    serve_logger = logging.getLogger(SERVE_LOGGER_NAME)
    handlers, level = list(serve_logger.handlers), serve_logger.level
    try:
        def replica_log():
            target = logging.FileHandler(tmp_path / f"replica_{len(serve_logger.handlers)}.log")
            buffered = MemoryHandler(1, target=target)
            serve_logger.handlers[:] = [buffered]
            return buffered

        buffered = replica_log()
        configure_logging(LoggingConfig(configure_logging=True))
        assert buffered.target is None, "vLLM's logging config no longer drops Serve's log target: serve_logs may go"
        with pytest.raises(AttributeError):  # what the recovering controller got: the replica is stopped
            get_component_logger_file_path()

        buffered = replica_log()
        path = buffered.target.baseFilename
        with serve_log_targets_kept():
            configure_logging(LoggingConfig(configure_logging=True))
        assert get_component_logger_file_path() == path.removeprefix(str(tmp_path))
        serve_logger.setLevel(logging.INFO)
        serve_logger.info("after the engine started")
        buffered.flush()
        assert "after the engine started" in Path(path).read_text()
    finally:
        serve_logger.handlers[:] = handlers
        serve_logger.setLevel(level)
