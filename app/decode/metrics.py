"""The decode replica's metrics (Ray's Prometheus export, ``ray_`` prefix)."""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram


class DecodeMetrics:
    """Our layer's metrics, exported through Ray's Prometheus endpoint with a ``ray_`` prefix.

    ``first_chunk_seconds`` is time to first token as the orchestrator sees it for
    streamed requests (for non-streamed ones the first chunk is the whole answer)."""

    _BUCKETS = [0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128]

    def __init__(self, mode: str):
        self._tags = {"mode": mode}
        tags = ("mode", "prefill", "stream")
        self._requests = Counter(
            "rendezvous_requests",
            description="Requests served, by transfer mode, prefill path and streaming. prefill: remote (disaggregated), "
            "local (prefilled by decode: a short prompt), fallback (the prefill leg failed or was late: decode prefilled "
            "it), kv_deadline (no WRITE, or no READ done, by the KV deadline), kv_failed (the transfer failed) or kv_mismatch (the "
            "KV landed with bytes other than prefill's): for these three decode recomputed the prompt.",
            tag_keys=tags,
        )
        self._first_chunk = Histogram(
            "rendezvous_first_chunk_seconds",
            description="Seconds from the decode replica receiving a request to its first chunk.",
            boundaries=self._BUCKETS,
            tag_keys=tags,
        )
        self._duration = Histogram(
            "rendezvous_request_seconds",
            description="Seconds from the decode replica receiving a request to its last chunk.",
            boundaries=self._BUCKETS,
            tag_keys=tags,
        )
        self._ongoing = Gauge("rendezvous_decode_ongoing_requests", description="Requests in flight on a decode replica.", tag_keys=("mode",))
        self._tokens = Gauge(
            "rendezvous_decode_tokens_in_flight",
            description="Prompt + remaining output tokens in flight on a decode replica (the router's load signal).",
            tag_keys=("mode",),
        )

        self._bindings = Counter(
            "rendezvous_decode_bindings",
            description="Requests decoded, by when their decode replica was picked: arrival, or late (pull with late "
            "binding: after prefill finished), and whether the late pick moved the request off the replica that ran "
            "its prefill leg.",
            tag_keys=("mode", "binding", "moved"),
        )
        self._turns = Counter(
            "rendezvous_conversation_turns",
            description="Conversation turns by what happened to their history: reused (prefill read it back from "
            "decode), local (decode prefilled the turn from its own cache), or why not: first_turn, expired, "
            "replica_gone, threshold, no_match, no_offer, unsupported (pull), fallback, unreported, kv_mismatch (read "
            "back, but its checksums differed: prefill recomputed it).",
            tag_keys=("mode", "history"),
        )
        self._history_tokens = Counter(
            "rendezvous_conversation_prompt_tokens",
            description="Prompt tokens of conversation turns: reused (read back from decode) or computed (by prefill, "
            "or by decode for a local turn).",
            tag_keys=("mode", "kind"),
        )
        self._kv_bytes = Counter(
            "rendezvous_conversation_kv_bytes",
            description="KV bytes of conversation turns (from token counts): d_to_p = history read back by prefill, "
            "p_to_d = new tail pushed to decode.",
            tag_keys=("mode", "direction"),
        )
        self._retained = Gauge(
            "rendezvous_conversations_retained", description="Conversations a decode replica retains.", tag_keys=("mode",)
        )

    def turn(self, history: str, reused: int, computed: int, read_back_bytes: int, pushed_bytes: int) -> None:
        self._turns.inc(tags={**self._tags, "history": history})
        for kind, tokens in (("reused", reused), ("computed", computed)):
            if tokens > 0:
                self._history_tokens.inc(tokens, tags={**self._tags, "kind": kind})
        for direction, size in (("d_to_p", read_back_bytes), ("p_to_d", pushed_bytes)):
            if size > 0:
                self._kv_bytes.inc(size, tags={**self._tags, "direction": direction})

    def retained(self, conversations: int) -> None:
        self._retained.set(conversations, tags=self._tags)

    def bound(self, binding: str, moved: bool) -> None:
        self._bindings.inc(tags={**self._tags, "binding": binding, "moved": str(moved).lower()})

    def load(self, ongoing: int, tokens: int) -> None:
        self._ongoing.set(ongoing, tags=self._tags)
        self._tokens.set(tokens, tags=self._tags)

    def finished(self, prefill: str, stream: bool, first_chunk_s: float | None, total_s: float) -> None:
        tags = {**self._tags, "prefill": prefill, "stream": str(bool(stream)).lower()}
        self._requests.inc(tags=tags)
        if first_chunk_s is not None:
            self._first_chunk.observe(first_chunk_s, tags=tags)
        self._duration.observe(total_s, tags=tags)
