"""vLLM's own code calls every hook our connectors override (behaviour, not existence).

``tests/unit/connector/test_seams.py`` checks that the methods we override still *exist* upstream. That
passes after upstream stops *calling* one (vLLM 0.32 asks the connector for
``get_transfer_results`` instead of ``get_finished``): our override would silently never run.
Here each hook is reached through vLLM's real callers, the way vLLM's own connector unit tests
drive its NIXL connector (``tests/v1/kv_connector/unit/``): on CPU, the real ``Scheduler``
(which builds our scheduler-side connector through ``kv_connector_module_path``), our worker-side
connector built by ``ensure_kv_transfer_initialized`` as a worker process builds it, and each
step's worker side run by the model runner's ``KVConnectorModelRunnerMixin._get_kv_connector_output``.

Only two things are not vLLM's or ours: NIXL itself (``FakeNixl``: an agent that records what it is
asked and hands back the notifications a test queues, as the peer engine would send them) and the
side channel to the peer engine (``_nixl_handshake``, a ZMQ round trip, answered with the local
worker's own agent metadata under the peer's engine id, as vLLM's ``FakeNixlConnectorWorker`` does).

Every override of ours is wrapped by a spy that calls through; each scenario (push decode, push
prefill, pull decode) runs once per module and each test asserts that one hook ran in it, so an
upstream change fails a test named after the hook, e.g.
``test_vllm_reaches_our_hook[push-worker-get_transfer_results]``. ``test_every_override_is_covered_here``
fails when a new override is added without a scenario that reaches it.
"""

from __future__ import annotations

import collections
import functools
import itertools
import shutil
import tempfile
import threading
import time
import traceback

import msgspec
import pytest

HOOKS: dict[str, dict[str, tuple[str, ...]]] = {
    "push": {
        "worker": ("_do_send_reg_notif", "_do_start_push_kv", "_get_new_notifs",
                   "_handle_push_reg_notif", "_pop_done_transfers", "_xfer_blocks_for_req", "get_transfer_results",
                   "start_load_kv"),
        "scheduler": ("build_connector_meta", "get_num_new_matched_tokens", "on_new_request", "request_finished",
                      "update_connector_output", "update_state_after_alloc"),
        "connector": ("build_connector_worker_meta", "wait_for_save"),
    },
    "pull": {
        "worker": ("_pop_done_transfers", "_read_blocks", "_read_blocks_for_req", "get_transfer_results", "start_load_kv"),
        "scheduler": ("build_connector_meta", "get_num_new_matched_tokens", "on_new_request", "request_finished",
                      "update_connector_output", "update_state_after_alloc"),
        "connector": ("build_connector_worker_meta",),
    },
}
CASES = [(mode, side, hook) for mode, sides in HOOKS.items() for side, hooks in sides.items() for hook in hooks]

BLOCK = 32  # the CPU attention kernel's block size (a multiple of 32: one kernel block per logical block)
PROMPT = 2 * BLOCK  # two full blocks: both are transferred
PREFILL_ENGINE, DECODE_ENGINE = "prefill-engine-under-test", "decode-engine-under-test"
WAIT_S = 5.0


# ---------------------------------------------------------------------------------------------- NIXL, faked


class _Telemetry(dict):
    __getattr__ = dict.__getitem__


class FakeNixl:
    """NIXL's agent (``nixl._api.nixl_agent``) without a transport: what vLLM asks of it is recorded,
    transfers complete at once, and the notifications a test queues are what the peer sent."""

    def __init__(self, name, config=None, *args, **kwargs):
        self.name = name
        self.sent: list[tuple[str, bytes]] = []
        self.transfers: list[tuple] = []
        self.released: list[int] = []
        self._incoming: collections.deque[bytes] = collections.deque()
        self._handles = itertools.count(1)
        self._lock = threading.Lock()

    # the peer's side
    def deliver(self, notif: bytes) -> None:
        with self._lock:
            self._incoming.append(notif)

    # memory and descriptors
    def get_reg_descs(self, caches_data, memory_type=None):
        return [f"reg-{i}" for i, _ in enumerate(caches_data)]

    def register_memory(self, descs, backends=None):
        return None

    def deregister_memory(self, descs):
        return None

    def get_xfer_descs(self, blocks_data, memory_type=None):
        return list(blocks_data)

    def prep_xfer_dlist(self, agent_name, descs, *args, **kwargs):
        return next(self._handles)

    def release_dlist_handle(self, handle):
        return None

    # agents
    def get_agent_metadata(self) -> bytes:
        return f"agent:{self.name}".encode()

    def add_remote_agent(self, agent_metadata: bytes) -> str:
        return "peer-of-" + self.name

    def remove_remote_agent(self, agent_name):
        return None

    # notifications
    def send_notif(self, agent_name, notif_msg=b"", *args, **kwargs):
        with self._lock:
            self.sent.append((agent_name, bytes(notif_msg)))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with self._lock:
            notifs, self._incoming = list(self._incoming), collections.deque()
        return {"peer": notifs} if notifs else {}

    # transfers
    def make_prepped_xfer(self, op, local_handle, local_ids, remote_handle, remote_ids, notif_msg=b"", *a, **kw):
        handle = next(self._handles)
        with self._lock:
            self.transfers.append((op, handle, list(local_ids), list(remote_ids), notif_msg))
        return handle

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        return "DONE"

    def get_xfer_telemetry(self, handle):
        return _Telemetry(xferDuration=1.0, postDuration=1.0, totalBytes=1, descCount=1)

    def release_xfer_handle(self, handle):
        self.released.append(handle)


def _wait_for(condition, what: str, step=None):
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if step is not None:
            step()
        time.sleep(0.005)


# ---------------------------------------------------------------------------------------------- spies


def our_overrides(cls) -> dict[str, list[type]]:
    """Hook name -> our classes (module ``connector.*``) in ``cls``'s MRO that override a method vLLM defines."""
    ours = [c for c in cls.__mro__ if c.__module__.startswith("connector.")]
    theirs = [c for c in cls.__mro__ if c.__module__.startswith("vllm.")]
    hooks: dict[str, list[type]] = {}
    for c in ours:
        for name, value in vars(c).items():
            if name.startswith("__") or not callable(value):
                continue
            if any(name in vars(base) for base in theirs):
                hooks.setdefault(name, []).append(c)
    return hooks


CALLS: collections.Counter = collections.Counter()  # (our class the object is, class defining the override, hook)
RAISED: dict[tuple[str, str, str], str] = {}  # the same key -> what the override raised when vLLM called it


def _spy(mp: pytest.MonkeyPatch, cls: type, spied: set) -> None:
    for hook, definers in our_overrides(cls).items():
        for definer in definers:
            if (definer, hook) in spied:  # a part both stacks share (StageClock, TransfersFirst, ...): once
                continue
            spied.add((definer, hook))
            original = vars(definer)[hook]

            @functools.wraps(original)
            def spy(self, *args, _original=original, _definer=definer, _hook=hook, **kwargs):
                key = (type(self).__name__, _definer.__name__, _hook)
                CALLS[key] += 1
                try:
                    return _original(self, *args, **kwargs)
                except Exception as exc:  # none of our hooks raises by design: upstream changed its call or result
                    RAISED.setdefault(key, f"{type(exc).__name__}: {exc}")
                    raise

            mp.setattr(definer, hook, spy)


def _ran(of: type, hook: str) -> dict[str, int]:
    """Our overrides of ``hook`` on objects of class ``of``: how often each ran."""
    return {definer.__name__: CALLS[(of.__name__, definer.__name__, hook)] for definer in our_overrides(of)[hook]}


# ---------------------------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def vllm_env():
    """One process as a one-rank vLLM engine: its distributed groups (gloo), NIXL faked, our hooks spied."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import nixl_utils, parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    from connector import vllm_connectors

    threads_before = set(threading.enumerate())
    mp, spied = pytest.MonkeyPatch(), set()
    mp.setattr(base_worker, "NixlWrapper", FakeNixl)
    mp.setattr(base_worker, "nixl_agent_config", None)
    mp.setattr(nixl_utils, "NixlWrapper", FakeNixl, raising=False)  # connector.nixl_progress looks it up here
    mp.setattr(vllm_connectors, "die_with_parent", lambda: False)  # not pytest's: a prctl on the test process
    for cls in (vllm_connectors.PushWorker, vllm_connectors.PushScheduler, vllm_connectors.PullWorker,
                vllm_connectors.PullScheduler, vllm_connectors.RendezvousPushConnector,
                vllm_connectors.RendezvousPullConnector):
        _spy(mp, cls, spied)
    store = tempfile.mkdtemp(prefix="vllm-dist-")  # torch's file store (it removes its file on destroy)
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"file://{store}/init")
        parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
        mp.undo()
        shutil.rmtree(store, ignore_errors=True)
        left = {t.name for t in set(threading.enumerate()) - threads_before if t.is_alive()}
        assert not left, f"threads left behind: {left}"


def _vllm_config(mode: str, role):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    from app.config.args import AppArgs
    from app.config.llm_configs import kv_transfer_config
    from app.model_source import ensure_embedded_model

    model = ModelConfig(model=str(ensure_embedded_model()), dtype="float32", seed=0, max_model_len=4 * BLOCK)
    kv = kv_transfer_config(AppArgs.parse({"mode": mode}), role)
    kv["engine_id"] = PREFILL_ENGINE if kv["kv_role"] == "kv_producer" else DECODE_ENGINE
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    cache.kv_cache_layout = "LBHNC"  # resolved once by the engine core in a real engine; NIXL's preference
    return VllmConfig(
        model_config=model, cache_config=cache, device_config=DeviceConfig("cpu"),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4 * BLOCK, max_model_len=4 * BLOCK,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(**kv),
    )


class Engine:
    """A one-rank engine without a model: vLLM's Scheduler and our worker-side connector, stepped by vLLM's
    own model-runner code for the connector; the forward pass samples token 0 for every scheduled request."""

    NUM_BLOCKS = 16

    def __init__(self, mode: str, role):
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_initialized
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.config = _vllm_config(mode, role)
        model = self.config.model_config
        heads, head_size = model.get_total_num_kv_heads(), model.get_head_size()
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_size, dtype=torch.float32)
        self.kv_cache_config = KVCacheConfig(num_blocks=self.NUM_BLOCKS, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.config.cache_config.num_gpu_blocks = self.NUM_BLOCKS
        with set_current_vllm_config(self.config):
            ensure_kv_transfer_initialized(self.config, self.kv_cache_config)  # as a worker process does
            self.connector = get_kv_transfer_group()
            self.worker = self.connector.connector_worker
            self.worker._nixl_handshake = self._handshake  # the side channel: no peer engine to ask
            # The CPU backend's layout: [blocks, heads, block size, K and V].
            self.kv = torch.zeros(self.NUM_BLOCKS, heads, BLOCK, 2 * head_size)
            self.connector.register_kv_caches({"layer.0": self.kv})
            self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config,
                                       structured_output_manager=StructuredOutputManager(self.config),
                                       block_size=BLOCK, log_stats=False)
        self.nixl: FakeNixl = self.worker.nixl_wrapper
        self.finished: set[str] = set()  # requests the engine finished (their outputs' finish reason)
        self.recved: set[str] = set()  # KV loads the worker reported done (landed or failed)
        self.sent: set[str] = set()  # KV sends the worker reported done
        self.invalid: set[int] = set()  # blocks whose load failed (recomputed: kv_load_failure_policy)

    def _handshake(self, host, port, remote_tp_size, expected_engine_id, remote_dcp_size=1, remote_pp_size=1,
                   notif_agents_only=False):
        """The peer answers with this worker's own metadata under its engine id (same model, same layout)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

        if expected_engine_id.startswith("dead-"):
            raise ConnectionError(f"no engine at {host}:{port}")
        payload = self.worker.xfer_handshake_metadata
        meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
        meta.engine_id = expected_engine_id
        if notif_agents_only:
            name = self.worker._add_notif_only_remote_agent(meta, remote_tp_size, meta.dcp_size)
        else:
            name = self.worker.add_remote_agent(meta, 0, remote_tp_size, meta.dcp_size)
        return {(0, 0): name}, 0.0

    def add(self, request_id: str, params: dict, max_tokens: int = 1) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(request_id=request_id, prompt_token_ids=list(range(1, PROMPT + 1)),
                          sampling_params=sampling, pooling_params=None)
        request.kv_transfer_params = params
        self.scheduler.add_request(request)

    def step(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        scheduler_output = self.scheduler.schedule()
        with set_current_vllm_config(self.config), set_forward_context(None, self.config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output) as kv_output:
            pass  # the forward pass
        self.recved |= kv_output.finished_recving or set()
        self.sent |= kv_output.finished_sending or set()
        self.invalid |= kv_output.invalid_block_ids or set()
        req_ids = [r.req_id for r in scheduler_output.scheduled_new_reqs] + list(
            scheduler_output.scheduled_cached_reqs.req_ids)
        sampled = [[0] if self._completes_prompt(rid, scheduler_output) else [] for rid in req_ids]
        runner_output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                          sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                          pooler_output=[], kv_connector_output=kv_output)
        for engine_outputs in self.scheduler.update_from_output(scheduler_output, runner_output).values():
            for out in engine_outputs.outputs:
                if out.finish_reason is not None:
                    self.finished.add(out.request_id)

    def _completes_prompt(self, req_id, scheduler_output) -> bool:
        request = self.scheduler.requests[req_id]
        scheduled = scheduler_output.num_scheduled_tokens[req_id]
        return request.num_computed_tokens + scheduled >= request.num_prompt_tokens

    def close(self) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        self.scheduler.shutdown()
        ensure_kv_transfer_shutdown()  # joins the push writer thread


def _remote_prefill(engine_id: str = PREFILL_ENGINE, **extra) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "prefill-leg", "tp_size": 1, **extra}


# ---------------------------------------------------------------------------------------------- scenarios


def push_decode() -> None:
    """Decode: registers its blocks with prefill (PUSH_REG), the WRITE lands (completion notif), it decodes.
    A second request's prefill is unreachable: vLLM fails its load."""
    from connector.ports import Role

    engine = Engine("push", Role.DECODE)
    try:
        engine.add("landed", _remote_prefill())
        engine.add("unreachable", _remote_prefill("dead-prefill"))
        engine.step()  # schedules both; the worker queues their registrations for the writer thread
        _wait_for(lambda: any(m.startswith(b"PUSH_REG") for _, m in engine.nixl.sent), "the PUSH_REG", engine.step)
        engine.nixl.deliver(b"landed:1")  # prefill's WRITE completed (its notif_msg: "<request>:<prefill TP>")
        _wait_for(lambda: {"landed", "unreachable"} <= engine.finished, "both requests to finish", engine.step)
        assert {"landed", "unreachable"} <= engine.recved
        assert engine.invalid, "the unreachable prefill's blocks were not failed (recomputed)"
    finally:
        engine.close()


def push_prefill() -> None:
    """Prefill: computes the prompt, decode's registration arrives, the WRITE is issued and completes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX

    from connector.ports import Role

    engine = Engine("push", Role.PREFILL)
    try:
        engine.add("leg", {"do_remote_decode": True, "do_remote_prefill": False})
        _wait_for(lambda: "leg" in engine.finished, "the prefill leg to finish", engine.step)
        engine.step()  # ships the finished blocks to the writer thread
        registration = {
            "request_id": "leg", "decode_engine_id": DECODE_ENGINE, "decode_host": "127.0.0.1", "decode_port": 2,
            "decode_tp_size": 1, "local_block_ids": [[5, 6]], "remote_engine_id": PREFILL_ENGINE,
            "remote_host": "127.0.0.1", "remote_port": 1, "remote_tp_size": 1, "remote_pp_size": 1,
        }
        engine.nixl.deliver(PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(registration))
        _wait_for(lambda: any(t[0] == "WRITE" for t in engine.nixl.transfers), "the WRITE", engine.step)
        _wait_for(lambda: "leg" in engine.sent, "the WRITE to complete", engine.step)
        (write,) = [t for t in engine.nixl.transfers if t[0] == "WRITE"]
        assert write[4] == b"leg:1"  # decode counts it as its request's completion notif
    finally:
        engine.close()


def pull_decode() -> None:
    """Decode: READs the prompt's KV from prefill, then decodes."""
    from connector.ports import Role

    engine = Engine("pull", Role.DECODE)
    try:
        engine.add("read", _remote_prefill(remote_block_ids=[[3, 4]]))
        _wait_for(lambda: any(t[0] == "READ" for t in engine.nixl.transfers), "the READ", engine.step)
        _wait_for(lambda: "read" in engine.finished, "the request to finish", engine.step)
        assert "read" in engine.recved and not engine.invalid
    finally:
        engine.close()


SCENARIOS = {"push": (push_decode, push_prefill), "pull": (pull_decode,)}


@pytest.fixture(scope="module")
def scenarios_ran(vllm_env) -> dict[str, str]:
    """Runs every scenario once; mode -> how its scenarios failed (each hook's test says it)."""
    failures: dict[str, str] = {}
    for mode, runs in SCENARIOS.items():
        for run in runs:
            try:
                run()
            except Exception as exc:
                where = "".join(traceback.format_exception(exc)[-4:])
                failures[mode] = failures.get(mode, "") + f"\n{run.__name__} failed:\n{where}"
    return failures


# ---------------------------------------------------------------------------------------------- tests


def _our_class(mode: str, side: str):
    from connector import vllm_connectors as vc

    return {("push", "worker"): vc.PushWorker, ("push", "scheduler"): vc.PushScheduler,
            ("pull", "worker"): vc.PullWorker, ("pull", "scheduler"): vc.PullScheduler,
            ("push", "connector"): vc.RendezvousPushConnector,
            ("pull", "connector"): vc.RendezvousPullConnector}[(mode, side)]


@pytest.mark.parametrize(("mode", "side", "hook"), CASES, ids=[f"{m}-{s}-{h}" for m, s, h in CASES])
def test_vllm_reaches_our_hook(scenarios_ran, mode, side, hook):
    cls = _our_class(mode, side)
    ran = _ran(cls, hook)
    modules = ", ".join(sorted({c.__module__ for c in our_overrides(cls)[hook]}))
    raised = {definer: RAISED[key] for definer in ran if (key := (cls.__name__, definer, hook)) in RAISED}
    if raised:
        pytest.fail(f"vLLM called {cls.__name__}.{hook}, and ours raised: {raised}. Upstream changed how it calls the "
                    f"hook or what the hook returns; re-read {modules} against the new vLLM.")
    missed = [definer for definer, count in ran.items() if count == 0]
    if missed:
        stopped = (f" A {mode} scenario also stopped early (a crash of ours, or a consequence of the hook not "
                   f"running):{scenarios_ran[mode]}" if mode in scenarios_ran else "")
        pytest.fail(f"vLLM never called {cls.__name__}.{hook} (ours in {', '.join(missed)}) while it ran requests "
                    f"through the {mode} connectors: upstream no longer calls it, or calls something else instead, "
                    f"and our override never runs. Re-read {modules} against the new vLLM.{stopped}")


@pytest.mark.parametrize(("mode", "side"), [(m, s) for m, sides in HOOKS.items() for s in sides])
def test_every_override_is_covered_here(mode, side):
    cls = _our_class(mode, side)
    assert sorted(our_overrides(cls)) == sorted(HOOKS[mode][side]), (
        f"{cls.__name__} overrides {sorted(our_overrides(cls))}: give each a scenario above that reaches it through "
        f"vLLM's own callers, and list it in HOOKS")
