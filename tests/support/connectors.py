"""Our composed connector classes built as an engine builds them, for unit tests that start nothing."""

from __future__ import annotations

from types import SimpleNamespace

from connector.params import PeerIdentity
from connector.pull_connector import PullScheduler
from connector.push_connector import PushScheduler
from connector.settings import ConnectorSettings


def push_scheduler(extra: dict | None = None, engine_id: str = "decode-engine",
                   cls: type = PushScheduler) -> PushScheduler:
    """The composed push scheduler (or ``cls``: ``PullScheduler``), as an engine has it: vLLM's own scheduler built by
    vLLM's constructor (a one-rank CPU engine's config, one full-attention KV cache group), then our features
    composed in (``init_features``, as ``connector.vllm_connectors`` does). ``extra``: the
    ``kv_connector_extra_config``."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    extra = dict(extra or {})
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, decode_context_parallel_size=1, data_parallel_index=0,
                                        data_parallel_size=1, data_parallel_rank=0),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_buffer_device="cpu",
                                           get_from_extra_config=lambda key, default: extra.get(key, default)),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        model_config=SimpleNamespace(dtype=torch.float32, get_total_num_hidden_layers=lambda: 1,
                                     get_total_num_kv_heads=lambda: 1, get_head_size=lambda: 8),
        max_concurrent_batches=1,
    )
    scheduler = cls(vllm_config, engine_id, kv_cache_config)
    scheduler.init_features(ConnectorSettings.parse(extra), vllm_config)
    return scheduler


def pull_scheduler(extra: dict | None = None, engine_id: str = "decode-engine") -> PullScheduler:
    return push_scheduler(extra, engine_id, PullScheduler)


# A prefill replica's published identity, as decode legs carry it.
PEER = PeerIdentity(engine_id="prefill-r0-10.0.0.5-20000-abc123", host="10.0.0.5", port=20000, tp_size=2, pp_size=1)
