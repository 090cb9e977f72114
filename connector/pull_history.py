"""Pull + bi-directional KV (vLLM's ``bidirectional_kv_xfer``), kept to the turns that ask
(vLLM-side; imports neither Ray nor ``app``).

With bi-directional transfer on, vLLM's pull scheduler keeps the blocks of *every*
finished decode request for ``decoder_kv_blocks_ttl`` seconds, outside the prefix cache's
eviction, so that the next turn's prefill can READ them back. One-off requests and
streamed turns (whose response cannot carry the blocks' address) would hold blocks nobody
reads until the TTL, and a busy decode engine would run out of KV. Here decode keeps only
the requests whose ``kv_transfer_params`` carry ``KEEP_HISTORY_KEY`` (the orchestrator's
non-streamed conversation turns); the others finish as without bi-directional transfer.

A history READ is tried once. Upstream asks for it again whenever the prefill leg's computed tokens
fall back to zero (a READ that failed, was cancelled at its deadline or landed wrong, all recomputed
from the first block; a preemption) but plans only one READ per request: the second ask left the
request waiting for KV that never comes, for good (seen with a history READ that landed wrong).
Here the leg recomputes the history instead.

Swapped into vLLM's pull scheduler by ``connector.vllm_connectors``.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

from connector.params import KEEP_HISTORY_KEY, READ_PLANNED_KEY, is_prefill_leg


class HistoryPullScheduler(NixlPullConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params
        if is_prefill_leg(params) and params.get(READ_PLANNED_KEY):
            return 0, False  # its history READ was tried already (see the module docstring)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(self, request, block_ids):
        params = request.kv_transfer_params
        keep = not params or is_prefill_leg(params) or params.get(KEEP_HISTORY_KEY)
        if keep or not self.is_bidirectional_kv_xfer_enabled:
            return super().request_finished(request, block_ids)
        # Upstream decides "keep for a read-back" on this flag alone (its D-node branch).
        self.is_bidirectional_kv_xfer_enabled = False
        try:
            return super().request_finished(request, block_ids)
        finally:
            self.is_bidirectional_kv_xfer_enabled = True
