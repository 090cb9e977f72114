"""The prefill deployment: ``PrefillServer`` (``server``), which publishes its outstanding prefill work for the
decode replicas' prefill routers.

It imports the shared packages (``config/``, ``routing/``, ``request/``, ``replica/``), never the other roles
(``ingress/``, ``decode/``) nor ``tools/``.
"""
