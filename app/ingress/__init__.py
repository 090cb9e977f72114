"""The ingress deployment, where a request enters: the OpenAI HTTP server with admission, auth and
``/health`` (``server``), ``/ready`` (``readiness``) and its metrics (``metrics``).

It imports the shared packages (``config/``, ``routing/``, ``request/``), never the other roles
(``decode/``, ``prefill/``) nor ``tools/``.
"""
