"""The tokens a router sent to each replica that have not completed (pure).

A replica's published load reaches the routers seconds late on a busy box; what this router sent
since is exact and immediate. Both Serve routers (``decode_router``, ``prefill_router``) keep one:
a request counts from its pick until Serve reports it completed, keyed by Serve's internal request
id (a request picked again, after its first pick was full, counts once).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

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

    def tokens_of(self, request_id: str | None) -> int | None:
        """The tokens a request was counted with at its earlier pick, if it had one."""
        entry = self._in_flight.get(request_id) if request_id is not None else None
        return entry[1] if entry else None

    def picked(self, request_id: str, replica_id: str, tokens: int) -> None:
        self.completed(request_id)  # a request picked again counts once
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
