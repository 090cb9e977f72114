"""Which conversations a decode replica holds, and what a new turn may reuse (pure).

Retention is decode's prefix cache: after a turn, the blocks of its prompt and output
stay cached (vLLM counts them as free, and evicts the least recently used first when a
new request needs room, so retained history can never block new requests). Each
conversation has its own cache salt, so conversations never share or see each other's
KV. ``retention_s`` after its last turn ends, a conversation's salt is dropped: the next
turn starts a new salt and cannot reach the old blocks, which age out of the cache.

The table only decides whether reuse is *worth trying*; what is reused is decided by
the engines from the token ids themselves (``connector.push_reuse``).
"""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from app.request.envelope import TurnReason


@dataclass(frozen=True)
class Turn:
    conversation_id: str
    cache_salt: str
    reuse: bool
    reason: TurnReason  # ATTEMPT when reuse, else why not
    # Prompt tokens of the conversation's last finished turn here: a lower bound of the
    # history decode holds (its answer is held too), for deciding where to prefill.
    held_tokens: int = 0


@dataclass
class _Entry:
    salt: str
    expires_at: float  # math.inf while a turn is in flight
    active: int = 0
    held_tokens: int = 0


class ConversationTable:
    def __init__(self, retention_s: float, max_conversations: int = 100_000):
        self.retention_s = retention_s
        self.max_conversations = max_conversations
        # Least recently used first. Expired entries stay (so a late turn is told
        # "expired") until max_conversations pushes them out.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def begin(self, conversation_id: str, now: float, continuation: bool) -> Turn:
        entry = self._entries.get(conversation_id)
        if entry is not None and (entry.active or now < entry.expires_at):
            turn = Turn(conversation_id, entry.salt, True, TurnReason.ATTEMPT, entry.held_tokens)
        else:
            reason = (TurnReason.EXPIRED if entry is not None else TurnReason.REPLICA_GONE if continuation
                      else TurnReason.FIRST_TURN)
            # A new salt: KV of an expired retention is never reached again.
            entry = _Entry(salt=f"rdv-conv:{conversation_id}:{uuid.uuid4().hex[:12]}", expires_at=math.inf)
            self._entries[conversation_id] = entry
            turn = Turn(conversation_id, entry.salt, False, reason)
        entry.active += 1
        entry.expires_at = math.inf
        self._entries.move_to_end(conversation_id)
        while len(self._entries) > self.max_conversations:
            self._entries.popitem(last=False)
        return turn

    def end(self, turn: Turn, now: float, prompt_tokens: int = 0) -> None:
        entry = self._entries.get(turn.conversation_id)
        if entry is None or entry.salt != turn.cache_salt:
            return
        entry.held_tokens = max(entry.held_tokens, prompt_tokens)
        entry.active = max(0, entry.active - 1)
        if not entry.active:
            entry.expires_at = now + self.retention_s

    def held(self, now: float) -> list[str]:
        """Conversations retained here, most recently used last."""
        return [cid for cid, e in self._entries.items() if e.active or now < e.expires_at]

    def known(self, limit: int) -> list[str]:
        """The ``limit`` most recently used conversations, retained or expired: where a
        conversation's next turn should go (an expired one is then told so, and restarts)."""
        return list(self._entries)[-limit:]


def continues_a_conversation(request) -> bool:
    """A chat request carrying an earlier assistant turn continues a conversation."""
    messages = getattr(request, "messages", None) or []
    return any((m.get("role") if isinstance(m, dict) else getattr(m, "role", None)) == "assistant" for m in messages)
