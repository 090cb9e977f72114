"""The tokens a router sent to each replica that have not completed (pure).

A replica's published load reaches the routers seconds late on a busy box; what this router sent
since is exact and immediate. Both Serve routers (``decode_router``, ``prefill_router``) keep one:
a request counts from its pick until Serve reports it completed, keyed by Serve's internal request
id (a request picked again, after its first pick was full, counts once).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any, Callable

from app.request.envelope import DEFAULT_OUTPUT_BUDGET, PROMPT_TOKENS

_CHARS_PER_TOKEN = 4  # when a request does not say its prompt length
_REMEMBERED = 10_000  # requests in flight a router keeps track of, at most


def prompt_tokens_of(request: Any) -> int:
    """A request's prompt tokens: as it says (a prefill leg's), else estimated from its text."""
    said = PROMPT_TOKENS.read(request)
    if said is not None:
        return said
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, list):
        return len(prompt)
    text = prompt if isinstance(prompt, str) else "".join(str(m.get("content", "")) for m in getattr(request, "messages", None) or [])
    return len(text) // _CHARS_PER_TOKEN


def decode_tokens_of(request: Any) -> int:
    """What a request costs a decode replica, as the replica itself counts it (``DecodeServer``):
    its prompt and its output budget."""
    budget = getattr(request, "max_tokens", None) or getattr(request, "max_completion_tokens", None)
    return prompt_tokens_of(request) + (budget if isinstance(budget, int) and budget > 0 else DEFAULT_OUTPUT_BUDGET)


class SentTokens:
    def __init__(self) -> None:
        self._by_replica: Counter = Counter()  # replica id -> tokens of the requests in flight there
        self._in_flight: OrderedDict[str, tuple[str, int]] = OrderedDict()  # internal request id -> (replica, tokens)

    def __getitem__(self, replica_id: str) -> int:
        return self._by_replica[replica_id]

    def as_dict(self) -> dict[str, int]:
        return dict(self._by_replica)

    def tokens_for(self, pending_request: Any, estimate: Callable[[Any], int]) -> int:
        """What ``pending_request`` (Serve's) counts: as at its earlier pick (that replica was full: it is picked
        again), else ``estimate`` of the request it carries."""
        entry = self._in_flight.get(_request_id(pending_request))
        if entry is not None:
            return entry[1]
        args = getattr(pending_request, "args", None) or ()
        return estimate(args[0]) if args else 0

    def picked(self, pending_request: Any, replica_id: str, tokens: int) -> None:
        """``pending_request`` goes to ``replica_id``, counted as ``tokens`` until it completes (once if picked again)."""
        request_id = _request_id(pending_request)
        if request_id is None:
            return
        self.completed(request_id)
        self._in_flight[request_id] = (replica_id, tokens)
        self._by_replica[replica_id] += tokens
        if len(self._in_flight) > _REMEMBERED:  # requests that were picked but never sent
            self.completed(next(iter(self._in_flight)))

    def completed(self, request_id: str) -> None:
        entry = self._in_flight.pop(request_id, None)
        if entry is not None:
            replica, tokens = entry
            self._by_replica[replica] -= tokens
            if self._by_replica[replica] <= 0:
                del self._by_replica[replica]


def _request_id(pending_request: Any) -> str | None:
    """Serve's internal id of a pending request, which its completion is reported by."""
    return getattr(getattr(pending_request, "metadata", None), "internal_request_id", None)
