"""The envelope: every field, key and header of ours that a request carries between the ingress and the
deployments (decode, prefill), each named once here with a typed accessor, and the vocabularies as enums.

On vLLM's request models (they accept extra fields; a request type that takes none carries nothing):

* :data:`PROMPT_TOKENS` (``rendezvous_prompt_tokens``, int): a prefill leg's prompt tokens as the decode replica
  counted them, read by the prefill router and the prefill replica's published load;
* :data:`DECODE_PICKED_AT` (``rendezvous_decode_picked``, epoch seconds): when the ingress's decode router picked
  the decode replica (``app.request.timeline``);
* :data:`QUEUE_DEADLINE_AT` (``rendezvous_queue_deadline``, epoch seconds): the ingress's queue deadline
  (``app.request.queue_deadline``).

In ``kv_transfer_params``: :data:`PREFILLED_KEY`, late binding's ``Prefilled`` (``app.routing.late_binding``),
attached by the ingress alone (it drops a client's). The keys the engines read stay in the codec,
``connector/params.py`` (``connector/`` imports no ``app``): ``REUSE_KEY``, ``KEEP_HISTORY_KEY`` and
``KV_DEADLINE_KEY`` on the legs; ``REUSE_REPORT_KEY``, ``STAGES_KEY`` and ``KV_SUMS_KEY`` in prefill's response.

In the headers: :data:`CONVERSATION_HEADER`, which the ingress fills from a body's ``conversation_id``.

Vocabularies: :class:`Route` and :class:`TurnReason` here; the mode is ``connector.params.TransferMode``. They are
``str`` enums whose values are the strings on the wire, in the logs and in metric labels: pass ``.value`` where a
string is wanted (``str()`` of a member is its class and name).

The messages that come back to the ingress in a response stream are their modules': ``RequestTimeline``
(``timeline``), ``QueueDeadlineMoved`` and ``QueueExpired`` (``queue_deadline``), ``Prefilled``.

Not on the request but kept by request id in the decode replica's process: :data:`PREFILL_PICKS`.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

# Output tokens assumed for a request that sets no max_tokens (load accounting, admission).
DEFAULT_OUTPUT_BUDGET = 256


class Route(str, Enum):
    """How a request was prefilled; the ``prefill`` label of ``rendezvous_requests``."""

    LOCAL = "local"  # by the decode engine itself: a short prompt, or one a prefill leg cannot serve
    REMOTE = "remote"  # disaggregated
    FALLBACK = "fallback"  # the handoff failed; decode prefilled it itself
    HANDED_OFF = "handed_off"  # prefilled here, decoded on the replica the ingress picked next (late binding)


class TurnReason(str, Enum):
    """Whether a conversation turn tries to reuse history, and why not (``app.routing.conversations.Turn``); the
    ``history`` label of ``rendezvous_conversation_turns`` for a turn that does not."""

    ATTEMPT = "attempt"  # reuse is tried; the engines report the outcome
    FIRST_TURN = "first_turn"
    EXPIRED = "expired"  # this replica held it, but retention_s passed since its last turn
    REPLICA_GONE = "replica_gone"  # it continues a conversation this replica holds nothing of


# --------------------------------------------------------------------------- fields on vLLM's request models


@dataclass(frozen=True)
class StampField:
    """Epoch seconds on a request model, written in place: the decode router writes on the request Serve is
    about to send (the arguments go after the pick), and it survives the replica's copies."""

    name: str

    def write(self, request: Any, at: float) -> None:
        try:
            setattr(request, self.name, at)
        except (AttributeError, TypeError, ValueError):  # a request type that takes no extra field: nothing is carried
            pass

    def read(self, request: Any) -> float | None:
        value = getattr(request, self.name, None)
        return value if isinstance(value, float) else None


@dataclass(frozen=True)
class CountField:
    """A count on a request model, set on a copy: it travels with the copies Ray's backends make of each leg."""

    name: str

    def copy_with(self, request: Any, count: int) -> Any:
        return request.model_copy(update={self.name: count})

    def read(self, request: Any) -> int | None:
        value = getattr(request, self.name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


PROMPT_TOKENS = CountField("rendezvous_prompt_tokens")
DECODE_PICKED_AT = StampField("rendezvous_decode_picked")
QUEUE_DEADLINE_AT = StampField("rendezvous_queue_deadline")
FIELDS: tuple[StampField | CountField, ...] = (PROMPT_TOKENS, DECODE_PICKED_AT, QUEUE_DEADLINE_AT)


# --------------------------------------------------------------------------- in kv_transfer_params

PREFILLED_KEY = "rendezvous_prefilled"


def with_prefilled(body: Any, prefilled: dict[str, Any]) -> Any:
    """``body`` with late binding's ``Prefilled`` (as a dict) as its only ``kv_transfer_params``."""
    return body.model_copy(update={"kv_transfer_params": {PREFILLED_KEY: prefilled}})


def prefilled_of(request: Any) -> dict[str, Any] | None:
    raw = (getattr(request, "kv_transfer_params", None) or {}).get(PREFILLED_KEY)
    return raw if isinstance(raw, dict) else None


# --------------------------------------------------------------------------- in the headers

# The ingress moves a body ``conversation_id`` here; the decode router and replicas read it.
CONVERSATION_HEADER = "x-conversation-id"
CONVERSATION_ID_PATTERN = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
CONVERSATION_ID_RULE = "a string of 1 to 128 characters from A-Z a-z 0-9 . _ : @ -"


def conversation_id_of(raw_request_info: Any) -> str | None:
    """The conversation of a request to a decode replica (``chat``/``completions(body, raw_request_info)``)."""
    return (getattr(raw_request_info, "headers", None) or {}).get(CONVERSATION_HEADER)


# --------------------------------------------------------------------------- kept in the process, by request id


class PrefillPick(NamedTuple):
    at: float  # when the prefill router picked the leg's prefill replica (the last pick)
    tokens_ahead: int  # the prompt tokens in flight there then


class PrefillPicks:
    """Each request's prefill pick, from the prefill router until the decode replica reads it.

    Process-local, not on the request: the prefill router runs in the decode replica's process (each decode
    replica routes its own legs on its own handle), and it sees a leg, a copy of the request the replica keeps;
    the replica reads the pick there (its deadlines, the timeline at the first token). Bounded: the picks of
    requests that never reached a first token are dropped oldest first."""

    def __init__(self, kept: int = 10_000):
        self._kept = kept
        self._picks: OrderedDict[str, PrefillPick] = OrderedDict()

    def record(self, request_id: str, at: float, tokens_ahead: int = 0) -> None:
        self._picks[request_id] = PrefillPick(at, tokens_ahead)
        if len(self._picks) > self._kept:
            self._picks.popitem(last=False)

    def take_picked_at(self, request_id: str) -> float | None:
        """When ``request_id``'s prefill replica was picked (the last pick); once."""
        picked = self._picks.pop(request_id, None)
        return picked.at if picked else None

    def tokens_ahead(self, request_id: str) -> int | None:
        """The prompt tokens in flight on ``request_id``'s prefill replica when it was picked; None before."""
        picked = self._picks.get(request_id)
        return picked.tokens_ahead if picked else None

    def __len__(self) -> int:
        return len(self._picks)


# One per process. Here, not in app.routing.prefill_router: Serve pickles a request router's module *by value*, so
# the router's module-level state would be a copy; this module is imported by reference from both sides.
PREFILL_PICKS = PrefillPicks()


def record_prefill_pick(request_id: str, at: float, tokens_ahead: int = 0) -> None:
    """The prefill router's way in: an object it imported would be a copy in the replica; this function, pickled
    by reference, reaches the real one."""
    PREFILL_PICKS.record(request_id, at, tokens_ahead)
