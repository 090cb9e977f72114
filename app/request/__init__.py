"""What travels with a request between the roles: the envelope, every field, key and header of ours it carries
and their vocabularies (``envelope``), its stage timeline (``timeline``), the deadlines sized to its work
(``deadlines``) and the queue deadline (``queue_deadline``).

Shared by the roles, it imports none of them (``ingress/``, ``decode/``, ``prefill/``) nor ``replica/`` or
``tools/``, and never Ray; only ``queue_deadline`` reaches into a vLLM engine's state, by attribute (no import).
``envelope`` imports nothing of ``app``: ``routing/`` and the roles read the envelope from it.
"""
