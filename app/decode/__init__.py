"""The decode deployment: ``DecodeServer`` (``server``), whose ``DecodeServing`` (``serving``) gathers a
request's facts and carries out its plan, the handoff of a remote prefill (``handoff``), a conversation turn from begin to end (``turns``) and
the replica's metrics (``metrics``).

It imports the shared packages (``config/``, ``routing/``, ``request/``, ``replica/``), never the other roles
(``ingress/``, ``prefill/``) nor ``tools/``.
"""
