"""The ingress deployment, where a request enters: the OpenAI HTTP server with admission, auth and
``/health`` (``server``), ``/ready`` (``readiness``) and its metrics (``metrics``); and, in front of it inside
each Serve proxy, the quick 503 while no ingress replica runs yet (``proxy_gate``).

It imports the shared packages (``config/``, ``routing/``, ``request/``), never the other roles
(``decode/``, ``prefill/``) nor ``tools/``.
"""
