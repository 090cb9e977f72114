"""When the prefill engine queued, started and finished a leg (vLLM-side; no Ray, no ``app``).

The orchestrator times every stage of a request it can see (app/timeline.py); what
happens inside the prefill engine it cannot. Prefill's connector scheduler sees it: the
request's arrival at the engine (``Request.arrival_time``, stamped by vLLM's frontend),
its first allocation (scheduled to compute) and its finish. They travel back in the
``kv_transfer_params`` of prefill's response under ``STAGES_KEY``, as the reuse report does.
Wall clock: the orchestrator compares them with its own stamps (same host, or NTP).
"""

from __future__ import annotations

import time
from typing import Any

from connector.params import STAGES_KEY


class StageClock:
    """Mixin for prefill's connector scheduler (push or pull); put before vLLM's class."""

    def _stage_starts(self) -> dict[str, float]:
        return self.__dict__.setdefault("_rendezvous_started", {})  # swapped in: no __init__ ran

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if _is_prefill_leg(request):
            self._stage_starts().setdefault(request.request_id, time.time())

    def request_finished(self, request, block_ids):
        started = self._stage_starts().pop(request.request_id, None)
        prefill_leg = _is_prefill_leg(request)  # before vLLM rewrites the params
        delay, params = super().request_finished(request, block_ids)
        if prefill_leg and isinstance(params, dict):
            params[STAGES_KEY] = stage_times(getattr(request, "arrival_time", None), started, time.time())
        return delay, params


def stage_times(queued: float | None, started: float | None, finished: float) -> dict[str, Any]:
    return {"queued": queued, "started": started, "finished": finished}


def _is_prefill_leg(request) -> bool:
    return bool((request.kv_transfer_params or {}).get("do_remote_decode"))
