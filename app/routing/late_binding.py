"""Pull mode with late binding: the decode replica is picked after prefill finished (pure).

The ingress routes a request to a decode replica as usual: the *entry* replica. It
decides what the request needs (a local prefill for a short prompt; a conversation turn
stays bound to the replica holding its history). A disaggregated request without a
conversation is only prefilled there: the entry replica runs the prefill leg and answers
with a :class:`Prefilled` instead of decoding. The ingress then sends the request through
the decode router once more, which picks by the load at *that* moment, with the
prefilled KV's address attached (``app.request.envelope.PREFILLED_KEY``). The ingress drops whatever a
client put in ``kv_transfer_params``, so only it can attach one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from app.request.envelope import prefilled_of, with_prefilled


@dataclass(frozen=True)
class Prefilled:
    request_id: str  # the prefill leg's; the decode leg keeps it
    kv_transfer_params: dict[str, Any]  # prefill's answer: where its blocks are, for decode's READ
    entry_replica: str  # the decode replica that ran the prefill leg
    stamps: dict[str, float] = field(default_factory=dict)  # the request's timeline so far (app.request.timeline)

    def attach_to(self, body: Any) -> Any:
        """``body`` (the client's request) as the ingress sends it to be decoded."""
        return with_prefilled(body, asdict(self))

    @classmethod
    def attached_to(cls, request: Any) -> Prefilled | None:
        raw = prefilled_of(request)
        return cls(**raw) if raw is not None else None
