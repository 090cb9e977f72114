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

Composed into vLLM's pull scheduler by ``connector.pull_connector``.
"""

from __future__ import annotations

from contextlib import contextmanager

from connector.feature import Feature
from connector.params import KEEP_HISTORY_KEY, READ_PLANNED_KEY, is_prefill_leg


class HistoryPullScheduler(Feature):
    """On the pull scheduler."""

    UPSTREAM = frozenset({"is_bidirectional_kv_xfer_enabled"})

    @staticmethod
    def read_tried(request) -> bool:
        """For vLLM's get_num_new_matched_tokens: a prefill leg whose history READ was tried already (it
        recomputes: see the module docstring)."""
        params = request.kv_transfer_params
        return is_prefill_leg(params) and bool(params.get(READ_PLANNED_KEY))

    @contextmanager
    def finishing(self, request):
        """Around vLLM's request_finished: a decode leg that did not ask to keep its history finishes as
        without bi-directional transfer (upstream decides "keep for a read-back" on this flag alone)."""
        params = request.kv_transfer_params
        keep = not params or is_prefill_leg(params) or params.get(KEEP_HISTORY_KEY)
        if keep or not self.is_bidirectional_kv_xfer_enabled:
            yield
            return
        self.host.is_bidirectional_kv_xfer_enabled = False
        try:
            yield
        finally:
            self.host.is_bidirectional_kv_xfer_enabled = True
