"""Where a request goes, decided from facts: admission at the ingress (``admission``), the filter → score →
pick pipeline (``pipeline``) run by the Serve request routers of the decode and the prefill deployment
(``decode_router``, ``prefill_router``), which requests get a prefill leg (``eligibility``), what a decode
replica does with one request (``planner``), which conversations it holds (``conversations``) and pull mode's
late binding (``late_binding``).

Pure but for the two Serve routers, which import Ray's request router: no module here imports vLLM, and the
rest import neither Ray nor torch. Shared by the roles, it imports none of them (``ingress/``, ``decode/``,
``prefill/``) nor ``replica/`` or ``tools/``.
"""
