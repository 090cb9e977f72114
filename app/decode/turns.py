"""One decode replica's conversation turns, from begin to end: what each reused, counted and logged.

``ConversationTable`` (app.routing.conversations) decides whether a turn may reuse history;
this book follows each turn through its request: pull's read-back of the history this
replica kept (``conversations.pull_history: upstream``), prefill's report of what it
reused (push), and at the end the outcome (``app.routing.planner.turn_outcome``), metrics and log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.request.envelope import Route
from app.routing.conversations import ConversationTable, Turn
from app.routing.planner import PlanSettings, turn_outcome
from connector.params import REUSE_REPORT_KEY, ReuseReason, ReuseReport, pull_history_params, verified_history_tokens

logger = logging.getLogger("ray.serve." + __name__)


@dataclass
class KeptHistory:
    """Pull with upstream read-back: what decode kept of a conversation's last turn."""

    params: dict  # kv_transfer_params of decode's response: where the blocks are
    token_ids: list[int]  # the turn's prompt as rendered here: what the kept KV is verified against
    kept_at: float


class TurnBook:
    def __init__(
        self,
        table: ConversationTable,
        settings: PlanSettings,
        metrics,
        *,
        recompute_threshold: int,
        block_size: Callable[[], int],
        kv_bytes_per_token: Callable[[], int],
    ):
        self.table, self._settings, self._metrics = table, settings, metrics
        self._recompute_threshold = recompute_threshold
        self._block_size, self._kv_bytes_per_token = block_size, kv_bytes_per_token
        self._reports: dict[str, ReuseReport | None] = {}  # request id -> prefill's report, until the turn ends
        self._kept: dict[str, KeptHistory] = {}  # conversation id -> its last turn's blocks (read-back)
        self._kept_params: dict[str, dict] = {}  # request id -> decode's response params, until the turn ends

    def begin(self, conversation_id: str, request_id: str, continuation: bool) -> Turn:
        self._reports[request_id] = None  # filled in by the prefill leg, if it reports
        return self.table.begin(conversation_id, time.time(), continuation)

    def prefill_reported(self, request_id: str, params: dict) -> None:
        """Prefill's response params (push; pull: those reporting a history READ that landed wrong); only
        turns still in flight have a slot."""
        if request_id in self._reports:
            self._reports[request_id] = ReuseReport.from_wire(params.get(REUSE_REPORT_KEY))

    def kept(self, request_id: str, params: dict) -> None:
        """Pull read-back: decode's response params of a turn whose blocks it keeps."""
        self._kept_params[request_id] = params

    def read_back(self, turn: Turn, request_id: str, prompt_ids: list[int]) -> dict | None:
        """Pull with upstream read-back: the prefill leg's params that READ the verified
        prefix of the history this replica kept, or None (and why, as the turn's report)."""
        kept = self._kept.pop(turn.conversation_id, None)
        now = time.time()
        for cid in [c for c, k in self._kept.items() if now - k.kept_at > self.table.retention_s]:
            del self._kept[cid]  # conversations that never came back; decode freed their blocks
        if not turn.reuse:
            return None
        block_size, tokens, reason = self._block_size(), 0, ReuseReason.NO_OFFER  # e.g. the last turn was streamed
        if kept is not None:
            tokens = verified_history_tokens(kept.token_ids, prompt_ids, block_size)
            reason = (ReuseReason.NO_MATCH if tokens == 0 else ReuseReason.THRESHOLD
                      if tokens < max(1, self._recompute_threshold) else ReuseReason.REUSED)
        reused = reason is ReuseReason.REUSED
        self._reports[request_id] = ReuseReport(reason.value, tokens if reused else 0, 0, self._kv_bytes_per_token())
        return pull_history_params(kept.params, tokens, block_size) if reused else None

    def report(self, request_id: str) -> ReuseReport | None:
        return self._reports.get(request_id)

    def end(self, turn: Turn, route: Route, request_id: str, prompt_ids: list[int]) -> None:
        now = time.time()
        prompt_tokens = len(prompt_ids)
        self.table.end(turn, now, prompt_tokens)
        report = self._reports.pop(request_id, None)
        kept = self._kept_params.pop(request_id, None)
        if kept is not None:
            self._kept[turn.conversation_id] = KeptHistory(kept, prompt_ids, now)
        outcome = turn_outcome(turn, route, self._settings, report)
        report = report or ReuseReport(outcome)
        reused, pushed, per_token = report.reused_tokens, report.pushed_tokens, report.kv_bytes_per_token
        self._metrics.turn(outcome, reused, prompt_tokens - reused, reused * per_token, pushed * per_token)
        logger.info(
            "conversation %s, request %s: history %s; %d prompt tokens, %d reused (%d B read back), %d pushed (%d B)",
            turn.conversation_id, request_id, outcome, prompt_tokens, reused, reused * per_token, pushed, pushed * per_token,
        )
